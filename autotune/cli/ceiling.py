"""``autotune ceiling``: the highest request rate one config sustains under the SLO.

Everything the user can get wrong is checked before the first probe and before any
file is written: the SLO, the search settings, the config, the backend and its
server, the output paths.  Exit 0 with the answer; 1 when even the lowest rate tried
misses the SLO; 2 on bad input.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from autotune.cli._app import app
from autotune.cli._common import UsageError, one_line_errors
from autotune.cli._options import (
    NUM_PROMPTS,
    VLLM_CMD,
    WARMUP,
    BacklogShare,
    MaxDuration,
    MaxModelLen,
    MinDuration,
    NumPrompts,
    Seed,
    VllmCmd,
    Warmup,
)
from autotune.cli._parse import parse_profile, parse_steady, parse_validate
from autotune.core.files import atomic_write, check_writable, write_json
from autotune.core.terminal import console, err_console
from autotune.servers.process import interrupted_code
from autotune.study.space import flag_type_error
from autotune.tuning.options import DEFAULT_CONTEXT
from autotune.tuning.record import StoredTrial
from autotune.workload.sources import pool_size

CSV_COLUMNS = (
    "index", "phase", "rate", "num_prompts", "num_measured", "verdict", "pruned",
    "prune_reason", "request_throughput", "output_throughput", "binding", "limit",
    "observed_s", "bound_s", "threshold_s", "gpu_util", "server_s", "repeat", "source",
)


class Backend(str, Enum):
    sim = "sim"
    vllm = "vllm"
    attach = "attach"


class Dataset(str, Enum):
    sharegpt = "sharegpt"
    synthetic = "synthetic"


@dataclass(frozen=True, kw_only=True)
class CeilingOptions:
    """What ``autotune ceiling`` was given, after the study's settings were inherited."""

    slo_p99: str | None = None
    slo: str | None = None
    backend: Backend | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    enable_chunked_prefill: bool | None = None
    max_model_len: int | None = None
    param: tuple[str, ...] = ()
    study: str | None = None
    trial: int | None = None
    storage: str | None = None
    studies_dir: Path = Path("studies")
    profile: str | None = None
    model_profile: str | None = None
    gpus: int | None = None
    url: str | None = None
    model: str | None = None
    vllm_cmd: str = "vllm serve"
    start_rate: float | None = None
    tol: float = 0.03
    max_probes: int = 8
    num_prompts: int = NUM_PROMPTS
    max_num_prompts: int = 2400
    repeats: int = 1
    headroom: float = 0.10
    confidence: float = 0.95
    min_rate: float | None = None
    max_rate: float | None = None
    warmup: int = WARMUP
    seed: int = 0
    no_prune: bool = False
    dataset: Dataset = Dataset.sharegpt
    input_len: int = 256
    output_len: int = 128
    # Not an option: the study's ShareGPT length limit, when --max-model-len is not given.
    sample_max_len: int | None = None
    tokenizer: str | None = None
    output: Path | None = None
    csv_path: Path | None = None
    min_duration: str | None = None
    max_duration: str | None = None
    validate: str = "5m"
    backlog_share: float = 0.02

    def __post_init__(self) -> None:
        # Checked before the study is opened: a bad number must not wait on a storage.
        if self.trial is not None and self.trial < 0:
            raise UsageError(f"--trial must be a trial number (0 or more), got {self.trial}")


# What a study fixed, read from its "autotune:settings" attribute, by option: every one
# the user left at its default is taken from the study, so `ceiling --study S --trial N`
# measures trial N as the search did.
INHERITED = {
    "slo_p99": "slo", "profile": "profile", "model_profile": "sim_model", "gpus": "gpus",
    "num_prompts": "num_prompts", "warmup": "warmup", "seed": "seed", "tol": "tol",
    "max_probes": "max_probes", "headroom": "headroom", "tokenizer": "tokenizer",
    "sample_max_len": "max_model_len", "min_duration": "min_duration",
    "max_duration": "max_duration", "backlog_share": "backlog_share",
    "min_rate": "min_rate", "max_rate": "max_rate",
}


@app.command("ceiling")
def ceiling(
    ctx: typer.Context,
    slo_p99: Annotated[str | None, typer.Option(
        help="P99 end-to-end latency limit, e.g. 10s.")] = None,
    slo: Annotated[str | None, typer.Option(
        help="More limits, e.g. 'p99:ttft<=2s,p99:tpot<=100ms'.")] = None,
    backend: Annotated[Backend | None, typer.Option(
        help="sim (virtual time; default without --url/--model), vllm, or attach.")] = None,
    # -- the config
    max_num_seqs: Annotated[int | None, typer.Option(help="vLLM --max-num-seqs.")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        help="vLLM --max-num-batched-tokens.")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(
        help="vLLM --tensor-parallel-size.")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        help="vLLM --gpu-memory-utilization.")] = None,
    enable_chunked_prefill: Annotated[bool | None, typer.Option(
        "--enable-chunked-prefill/--no-enable-chunked-prefill",
        help="vLLM chunked prefill.", show_default=False)] = None,
    max_model_len: MaxModelLen = None,
    param: Annotated[list[str] | None, typer.Option(
        help="Any other server flag as key=value (repeatable), e.g. block_size=32.")] = None,
    study: Annotated[str | None, typer.Option(
        help="Take the config of --trial N of this study.")] = None,
    trial: Annotated[int | None, typer.Option(help="Trial number in --study.")] = None,
    storage: Annotated[str | None, typer.Option(
        help="Optuna storage of --study (default sqlite:///studies/<name>.db).")] = None,
    studies_dir: Annotated[Path, typer.Option(
        help="Folder of study databases.")] = Path("studies"),
    # -- where it runs
    profile: Annotated[str | None, typer.Option(
        help="Simulator hardware [Nx]HARDWARE[:MODEL], e.g. a100-80gb or 4xh100-80gb.")
    ] = None,
    model_profile: Annotated[str | None, typer.Option(
        help="Simulator model profile, e.g. llama-3-8b.")] = None,
    gpus: Annotated[int | None, typer.Option(help="Simulator GPU count.")] = None,
    url: Annotated[str | None, typer.Option(
        help="Attach to this running OpenAI-compatible server.")] = None,
    model: Annotated[str | None, typer.Option(
        help="Model for --backend vllm (path or name); with attach, the served name.")
    ] = None,
    vllm_cmd: VllmCmd = VLLM_CMD,
    # -- the search
    start_rate: Annotated[float | None, typer.Option(
        help="First rate (req/s); default: a saturation probe, then 70% of it.")] = None,
    tol: Annotated[float, typer.Option(
        help="Stop when feasible and infeasible rates are this close (relative).")] = 0.03,
    max_probes: Annotated[int, typer.Option(help="Load tests the search may run.")] = 8,
    num_prompts: NumPrompts = NUM_PROMPTS,
    max_num_prompts: Annotated[int, typer.Option(
        help="Most measured requests one probe may be raised to.")] = 2400,
    repeats: Annotated[int, typer.Option(
        help="Runs of each boundary rate (1 = no re-runs).")] = 1,
    headroom: Annotated[float, typer.Option(
        help="Recommended cap this share under the ceiling.")] = 0.10,
    confidence: Annotated[float, typer.Option(
        help="Confidence of the upper bound on each percentile.")] = 0.95,
    min_rate: Annotated[float | None, typer.Option(
        help="Lowest rate to try when probes keep failing (default start / 32).")] = None,
    max_rate: Annotated[float | None, typer.Option(
        help="Highest rate to try (default: none; with --study, the space's top "
             "request_rate).")] = None,
    warmup: Warmup = WARMUP,
    seed: Seed = 0,
    no_prune: Annotated[bool, typer.Option(
        "--no-prune", help="Run every probe to the end.")] = False,
    # -- the workload
    dataset: Annotated[Dataset, typer.Option(help="Request source.")] = Dataset.sharegpt,
    input_len: Annotated[int, typer.Option(help="Synthetic: mean prompt tokens.")] = 256,
    output_len: Annotated[int, typer.Option(help="Synthetic: mean output tokens.")] = 128,
    tokenizer: Annotated[str | None, typer.Option(
        help="Path to the model's tokenizer.json (default: the server's /tokenize, else "
             "mistral-common's tekken).")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "--out",
        help="Write the result and every probe's summary as JSON.")] = None,
    csv_path: Annotated[Path | None, typer.Option(
        "--csv", help="Write one row per probe and SLO limit.")] = None,
    min_duration: MinDuration = None,
    max_duration: MaxDuration = None,
    validate: Annotated[str, typer.Option(
        help="Run the cap this long at the end (virtual time on the simulator); a "
             "failed run steps it down 5%; 'off' skips it.")] = "5m",
    backlog_share: BacklogShare = 0.02,
) -> None:
    """Find the highest request rate that meets the SLO with confidence, and a cap."""
    given = {k: v for k, v in locals().items() if k != "ctx"}
    given["param"] = tuple(param or ())
    with one_line_errors():
        o = CeilingOptions(**given)
        study = None
        if o.study is not None:
            study = _open_study(o)  # opened once: its settings here, the trial's config later
            # Given on the command line or in the environment: anything but a default.
            # (By name: typer ships its own copy of click's ParameterSource.)
            o = inherit(o, _study_settings(study), explicit={
                k for k in INHERITED | {"slo": ""}
                if getattr(ctx.get_parameter_source(k), "name", "DEFAULT") != "DEFAULT"})
        code = _ceiling(o, study)
    if code:
        raise typer.Exit(code)


# ----------------------------------------------------------------------------- parsing


def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_params(items: Sequence[str] | None) -> dict[str, Any]:
    """``["block_size=32", "enforce-eager=true"]`` -> ``{"block_size": 32, ...}``."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise UsageError(f"--param {item!r}: give key=value, e.g. --param block_size=32")
        out[key] = _value(value)
        if (why := flag_type_error(key, out[key])) is not None:
            raise UsageError(f"--param {why}")
    return out


def inherit(o: CeilingOptions, settings: dict[str, Any], *, explicit: set[str]
            ) -> CeilingOptions:
    """``o`` with every option the user did not give taken from the study's
    ``settings`` (the SLO only when neither --slo-p99 nor --slo was given)."""
    changes: dict[str, Any] = {}
    for option, key in INHERITED.items():
        if option in explicit or settings.get(key) is None:
            continue
        if option == "slo_p99":
            if "slo" not in explicit:
                changes["slo_p99"], changes["slo"] = str(settings[key]), None
            continue
        changes[option] = settings[key]
    return replace(o, **changes)


def _open_study(o: CeilingOptions) -> Any:
    import optuna

    from autotune.study.study import storage_url

    if o.trial is None or o.study is None:
        raise UsageError("--study and --trial go together: give both, e.g. --study S "
                         "--trial 12")
    url = storage_url(o.study, o.storage, o.studies_dir)
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).is_file():
        raise UsageError(f"no study database {url[len('sqlite:///'):]}: check --study "
                         "or --storage")
    from autotune.study.optuna_adapter import quiet_logging
    from autotune.study.storage import mask_url, open_storage

    quiet_logging()
    try:
        st = optuna.load_study(study_name=o.study, storage=open_storage(
            url, heartbeat_interval=None, grace_period=None))
    except KeyError:
        raise UsageError(f"no study named {o.study!r} in {mask_url(url)}") from None
    return st


def _study_settings(st: Any) -> dict[str, Any]:
    """What the study's search fixed (empty for a study made before it was stored)."""
    from autotune.search.pipeline import SETTINGS_ATTR

    return dict(st.user_attrs.get(SETTINGS_ATTR) or {})


def _stored_trial(o: CeilingOptions, st: Any) -> StoredTrial:
    found = [t for t in st.get_trials(deepcopy=False) if t.number == o.trial]
    if not found:
        raise UsageError(f"study {o.study!r} has no trial {o.trial} "
                         f"(it has {len(st.trials)} trials)")
    return StoredTrial.of(found[0])


def replay_start(trial: StoredTrial) -> tuple[float | None, bool]:
    """Where the search started this trial's rate search: (first rate, whether it had to
    pass there, i.e. beat the incumbent).  (None, False): a saturation probe first."""
    probes = trial.ceiling.get("probes") or []
    first = probes[0] if probes and isinstance(probes[0], dict) else {}
    rate, phase = first.get("rate"), first.get("phase")
    if phase in ("incumbent", "bracket") and isinstance(rate, (int, float)) and rate > 0:
        return float(rate), phase == "incumbent"
    return None, False


def config_flags(o: CeilingOptions, study: Any = None) -> dict[str, Any]:
    """The server config from --study/--trial (``study``: that study, already open),
    then the flags, then --param."""
    flags: dict[str, Any] = {}
    if o.study is not None or o.trial is not None:
        flags.update(_stored_trial(o, study if study is not None else _open_study(o)).flags)
    for key in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                "gpu_memory_utilization", "enable_chunked_prefill", "max_model_len"):
        value = getattr(o, key)
        if value is not None:
            flags[key] = value
    flags.update(parse_params(o.param))
    for key in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                "max_model_len"):
        value = flags.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    return flags


def _sim_profile(o: CeilingOptions) -> tuple[str, str, int]:
    from autotune.sim.profiles import ProfileError, load_hardware, load_model

    hw, mdl, count = parse_profile(o.profile, {}, o.gpus)
    if o.model_profile:
        mdl = o.model_profile
    if count < 1:
        raise UsageError(f"--gpus must be at least 1, got {count}")
    try:
        load_hardware(f"{count}x{hw}")
        load_model(mdl)
    except (ProfileError, OSError, ValueError) as exc:
        raise UsageError(f"simulator profile {hw}:{mdl}: {exc}") from None
    return hw, mdl, count


def _check_numbers(o: CeilingOptions) -> None:
    if not o.tol > 0:
        raise UsageError(f"--tol must be greater than 0 (e.g. 0.03 for 3%), got {o.tol:g}")
    if o.start_rate is not None and not (o.start_rate > 0 and math.isfinite(o.start_rate)):
        raise UsageError(f"--start-rate must be a finite rate above 0 req/s, got "
                         f"{o.start_rate:g}")
    if o.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {o.warmup}")
    for name, value in (("--num-prompts", o.num_prompts), ("--max-probes", o.max_probes),
                        ("--repeats", o.repeats), ("--input-len", o.input_len),
                        ("--output-len", o.output_len)):
        if value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")


# ----------------------------------------------------------------------------- build


def _workload(o: CeilingOptions, total: int, server_url: str | None) -> Any:
    from autotune.workload.sources import pool_workload

    return pool_workload(dataset=o.dataset.value, tokenizer_path=o.tokenizer,
                         url=server_url, model=o.model, total=total, seed=o.seed,
                         context=o.max_model_len or o.sample_max_len or DEFAULT_CONTEXT,
                         input_len=o.input_len, output_len=o.output_len)


def _backend(o: CeilingOptions, kind: str, flags: dict[str, Any]) -> tuple[Any, str]:
    """The trial backend and a one-line description of where probes run."""
    from autotune.backends.factory import BackendSpec, create_backend, describe, server_backend

    if kind == "sim":
        hw, mdl, count = _sim_profile(o)
        spec = BackendSpec(kind="sim", hardware=f"{count}x{hw}", sim_model=mdl)
        return create_backend(spec), describe(spec)
    if kind == "attach" and flags:
        raise UsageError(
            f"the server at {o.url} is attached: autotune cannot restart it with "
            f"{', '.join(sorted(flags))}; drop the config flags, or use --backend vllm")
    return server_backend(kind, url=o.url, model=o.model, vllm_cmd=o.vllm_cmd,
                          log_dir=o.studies_dir / "ceiling" / "logs")


# ----------------------------------------------------------------------------- output


def _s(x: float) -> str:
    from autotune.tuning.ceiling import format_seconds

    return format_seconds(x).replace(" ", "")


def probe_line(p: Any, simulated: bool) -> str:
    """One probe as a table row (printed as it finishes)."""
    rate = "inf" if math.isinf(p.rate) else f"{p.rate:.3f}"
    lims = "  ".join(f"{c.label} {_s(c.observed_s)} (≤{_s(c.bound_s)})" for c in p.checks)
    util = "-" if p.gpu_util is None else f"{p.gpu_util:.0%}"
    verdict = {"pass": "PASS"}.get(p.verdict, p.verdict)
    ev = p.evidence
    secs = "-" if ev is None else f"{ev.at_s:.0f}"
    why = ""
    if p.pruned:
        why = f"pruned: {p.prune_reason.split(':', 1)[0]}"
    elif ev is not None and p.verdict != "pass":
        why = ev.reasons[0][:90]
    return (f"{p.index + 1:>3} {p.phase:<11} {rate:>9} {p.num_measured:>6} {secs:>5} "
            f"{p.request_throughput:>8.2f} {p.output_throughput:>9.0f}  {lims:<40} "
            f"{util:>5}{'*' if simulated and p.gpu_util is not None else ' '} "
            f"{verdict:<12} {why}").rstrip()


def header(simulated: bool) -> str:
    how = "simulated, virtual time" if simulated else "measured over HTTP"
    return (f"probes ({how}; n = requests judged, s = seconds of arrivals; P99 with its "
            "one-sided 95% upper bound in parentheses; req/s and tok/s: vLLM's throughput "
            "over each probe's judged requests, i.e. completed / (first send to last "
            "completion), so the drain of a long-latency probe reads under its rate "
            "even when it keeps up (the verdict judges keeping up); warm-up excluded; "
            "GPU = mean utilization, * = the "
            "simulator's busy share)\n"
            f"{'#':>3} {'phase':<11} {'rate':>9} {'n':>6} {'s':>5} {'req/s':>8} {'tok/s':>9}  "
            f"{'latency (bound)':<40} {'GPU':>5}  result")


def probes_csv(result: Any) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for p in result.probes:
        for c in p.checks:
            w.writerow([
                p.index, p.phase, p.rate, p.num_prompts, p.num_measured, p.verdict,
                p.pruned, p.prune_reason or "", p.request_throughput, p.output_throughput,
                p.binding or "", c.label, c.observed_s, c.bound_s, c.threshold_s,
                "" if p.gpu_util is None else p.gpu_util,
                "" if p.server_s is None else p.server_s, p.repeat, result.source])
    return buf.getvalue()


def details(result: Any) -> list[str]:
    """The lines after the answer: bracket, cost, the step-down comparison, notes."""
    lines = []
    unit = "virtual" if result.simulated else "wall"
    cost = "" if result.server_s is None else f", {result.server_s:.0f} s server time ({unit})"
    if result.feasible_max is not None:
        hi = ("none found" if result.infeasible_min is None
              else f"{result.infeasible_min:.3f} req/s")
        lines.append(
            f"ceiling: feasible_max {result.feasible_max:.3f} req/s, infeasible_min {hi} "
            f"({'converged' if result.converged else 'not converged'} to tol "
            f"{result.tol:.1%}); binding limit {result.binding}; "
            f"{result.search_probes} search probes + "
            f"{len(result.probes) - result.search_probes} others (saturation, light-load "
            f"floor, repeats){cost}")
    if result.saturated_throughput is not None and result.stepdown_probes is not None:
        lines.append(
            f"for comparison: a 1 req/s step-down from the saturated throughput "
            f"{result.saturated_throughput:.2f} req/s ({result.saturated_how}), as vLLM's "
            f"auto_tune.sh does it, needs {result.stepdown_probes} load tests and ends at "
            + ("no passing rate" if result.stepdown_rate is None else
               f"{result.stepdown_rate:g} req/s "
               f"({1 - result.stepdown_rate / result.feasible_max:.0%} below feasible_max)"))
    for sp in result.spread:
        lines.append(
            f"repeats at {sp.rate:.3f} req/s: {sp.passes}/{sp.runs} passed; {sp.label} "
            f"{_s(sp.observed_min_s)}..{_s(sp.observed_max_s)}, bound "
            f"{_s(sp.bound_min_s)}..{_s(sp.bound_max_s)}, req/s "
            f"{sp.throughput_min:.2f}..{sp.throughput_max:.2f}")
    lines += [f"note: {n}" for n in result.notes]
    return lines


# ----------------------------------------------------------------------------- main


def _validate(o: CeilingOptions, result: Any, backend: Any, probe: Any,
              flags: dict[str, Any], validate_s: float, simulated: bool) -> None:
    from autotune.tuning.ceiling import lent_evidence
    from autotune.tuning.validation import validate_cap

    cap = float(result.recommended_cap)
    console.print(f"validating the cap {cap:.4g} req/s for {validate_s / 60:g} min"
                  + (" (virtual time)" if simulated else ""), soft_wrap=True)
    result.validation = validate_cap(
        backend, flags, cap, probe.plan(o.num_prompts, 0, cap), duration_s=validate_s,
        prior_for=lambda rate: lent_evidence(result.probes, rate),
        on_run=lambda r: console.print(f"  {r.rate:.4g} req/s: {r.verdict} "
                                       f"({r.requests} requests judged)", soft_wrap=True,
                                       highlight=False))


def _proof_span(result: Any) -> str:
    from autotune.tuning.ceiling import format_seconds

    proof = next(p for p in result.probes if p.phase == "proof")
    return format_seconds(proof.evidence.at_s if proof.evidence is not None else math.nan)


def _keep_interrupted(o: CeilingOptions, probes: Sequence[Any], about: dict[str, Any]
                      ) -> None:
    """One line saying what an interrupted search keeps: with ``--output``, every probe
    that ended, written there; without, nothing on disk."""
    if o.output is None:
        err_console.print(f"interrupted after {len(probes)} probes: nothing kept (no "
                          "--output was given)", soft_wrap=True)
        return
    write_json(o.output, {"interrupted": True, "feasible": None, **about,
                          "total_probes": len(probes),
                          "probes": [p.to_dict() for p in probes]})
    err_console.print(f"interrupted after {len(probes)} probes: each one's evidence is "
                      f"kept in {o.output}", soft_wrap=True)


def _cap_phrase(steady: Any, slo: Any) -> str:
    if steady.max_duration_s is not None:
        return f"{steady.max_s(slo):g} s"
    return (f"what its rate needs ({steady.decide_n(slo)} judged requests pass a safe "
            f"rate 80% of the time), between {steady.max_s(slo):g} and "
            f"{steady.hard_cap_s(slo):g} s")


def _ceiling(o: CeilingOptions, study: Any = None) -> int:
    from autotune.core.slo import combine
    from autotune.tuning.ceiling import check_settings

    if o.slo_p99 is None and o.slo is None:
        raise UsageError("no SLO given: pass --slo-p99 10s (and/or --slo LIMITS)")
    slo = combine(o.slo_p99, o.slo)
    _check_numbers(o)
    check_writable(o.output, "--output")
    check_writable(o.csv_path, "--csv")
    kind = (o.backend.value if o.backend is not None
            else "attach" if o.url else "vllm" if o.model else "sim")
    if kind == "attach" and not o.url:
        raise UsageError("--backend attach needs --url of the running server")
    flags = config_flags(o, study)
    # Fail on search settings before any workload is built or server touched.
    check_settings(slo, start_rate=o.start_rate, tol=o.tol, max_probes=o.max_probes,
                   num_prompts=o.num_prompts, max_num_prompts=o.max_num_prompts,
                   repeats=o.repeats, confidence=o.confidence, headroom=o.headroom,
                   min_rate=o.min_rate)
    validate_s, steady = _durations(o)
    backend, where = _backend(o, kind, flags)
    seen: list[Any] = []  # every probe that ended, kept if the command is interrupted
    result: Any = None
    try:
        # The pool: at least POOL_REQUESTS distinct requests after the warm-up ones, so
        # that the search's tests, each taking up where the last stopped, judge the
        # workload's tail and not a thousand requests' few longest replies again.
        total = pool_size(o.num_prompts) + o.warmup
        wl = _workload(o, total, o.url if kind == "attach" else None)
        pool = list(wl.requests)
        simulated = kind == "sim"
        probe = _start_probe(o, backend, flags, where, slo, steady, wl, pool, simulated)
        result = _search(o, probe, slo, steady, study, seen, simulated)
        _validate_cap(o, result, backend, probe, flags, validate_s, simulated)
    except (KeyboardInterrupt, SystemExit) as exc:
        code = interrupted_code(exc)
        if code is None:
            raise
        about = {"config": flags, "backend": {"kind": kind, "where": where}}
        if result is not None:  # interrupted in the validation: the search is whole
            about = {**result.to_dict(), **about}
        _keep_interrupted(o, seen, about)
        raise typer.Exit(code) from None
    finally:
        backend.close()
    _drain_notes(probe, result)
    _print_answer(result)
    _write_files(o, result, flags, kind, where, wl, pool)
    return 0 if result.feasible else 1


def _durations(o: CeilingOptions) -> tuple[float | None, Any]:
    """The validation run's length and each probe's steady-state rule, with as many
    looks as the search may take."""
    from autotune.tuning.ceiling import search_looks

    validate_s = parse_validate(o.validate)
    steady = replace(parse_steady(o.min_duration, o.max_duration, o.num_prompts,
                                  o.backlog_share),
                     looks=search_looks(o.max_probes))
    return validate_s, steady


def _start_probe(o: CeilingOptions, backend: Any, flags: dict[str, Any], where: str,
                 slo: Any, steady: Any, wl: Any, pool: list[Any], simulated: bool) -> Any:
    """Say what is measured and how each probe is judged, around building the probe."""
    from autotune.tuning.ceiling import BackendProbe

    out = console
    out.print(f"ceiling of {flags or 'the default config'} on {where}; SLO {slo}; "
              f"workload {wl.source} ({len(pool)} requests, tokens counted with "
              f"{wl.tokenizer}); {o.warmup} warm-up requests per probe excluded"
              + ("; every figure is simulated" if simulated else ""), soft_wrap=True)
    out.print(header(simulated), soft_wrap=True, highlight=False)
    probe = BackendProbe(backend, flags, slo, pool, warmup=o.warmup, seed=o.seed,
                         prune=not o.no_prune, steady=steady)
    out.print(f"each probe: at least {steady.min_s(slo):g} s of arrivals before it may "
              f"pass, up to {_cap_phrase(steady, slo)}, stopped when its steady-state "
              f"verdict is certain; each limit passes when a sequential test shows "
              f"its exceedance under the percentile's allowance (at most "
              f"{1 - steady.confidence:.0%} false passes)", soft_wrap=True)
    return probe


def _search(o: CeilingOptions, probe: Any, slo: Any, steady: Any, study: Any,
            seen: list[Any], simulated: bool) -> Any:
    """Run the rate search, printing and keeping each probe as it ends."""
    from autotune.tuning.ceiling import PROOF_CAP_S, find_ceiling

    out = console
    # A trial of a study starts where the search started it, so that the same probes
    # give the same answer ("measured as the search did").
    start, must_pass = (replay_start(_stored_trial(o, study))
                        if study is not None and o.start_rate is None
                        else (o.start_rate, False))

    def on_probe(p: Any) -> None:
        seen.append(p)
        out.print(probe_line(p, simulated), soft_wrap=True, highlight=False)

    return find_ceiling(
        probe, slo=slo, start_rate=start, tol=o.tol, max_probes=o.max_probes,
        first_must_pass=must_pass, then_down=True,
        num_prompts=o.num_prompts, max_num_prompts=o.max_num_prompts,
        repeats=o.repeats, confidence=o.confidence, headroom=o.headroom,
        min_rate=o.min_rate, max_rate=o.max_rate,
        lowest_rate=steady.lowest_rate(slo), on_probe=on_probe,
        proof_cap_s=PROOF_CAP_S if o.max_duration is None else steady.max_s(slo))


def _validate_cap(o: CeilingOptions, result: Any, backend: Any, probe: Any,
                  flags: dict[str, Any], validate_s: float | None, simulated: bool) -> None:
    """Validate the cap with its own run, unless the proof already ran long at a rate
    above it."""
    if validate_s and result.recommended_cap and result.proof is None:
        _validate(o, result, backend, probe, flags, validate_s, simulated)
    elif validate_s and result.recommended_cap:
        # A run of a few minutes at the cap cannot decide near the floor; the proof
        # is already the long run, at a rate above the cap.
        result.notes.append(
            f"no separate validation: the proof is the long run ("
            f"{_proof_span(result)} of arrivals at {result.feasible_max:.4g} req/s, "
            f"above the cap)")


def _drain_notes(probe: Any, result: Any) -> None:
    """Note how the server was drained between probes, since it bears on each figure."""
    if probe.drain_note:
        result.notes.append(probe.drain_note)
    elif probe.drain:
        result.notes.append(
            f"between probes the server drained: /metrics showed vllm:num_requests_running "
            f"and vllm:num_requests_waiting both 0 ({probe.drain_s:.1f} s waited in all)")


def _print_answer(result: Any) -> None:
    """Print the answer and its details, on stderr when no rate met the SLO."""
    if not result.feasible:
        err_console.print(result.sentence(), soft_wrap=True, highlight=False)
        for line in details(result):
            err_console.print(line, soft_wrap=True, highlight=False)
    else:
        console.print(result.sentence(), soft_wrap=True, highlight=False)
        for line in details(result):
            console.print(line, soft_wrap=True, highlight=False)


def _write_files(o: CeilingOptions, result: Any, flags: dict[str, Any], kind: str,
                 where: str, wl: Any, pool: list[Any]) -> None:
    """Keep every probe's evidence in --output and --csv, answer or not."""
    if o.output is not None:
        data = result.to_dict()
        data["config"] = flags
        data["backend"] = {"kind": kind, "where": where}
        data["workload"] = {"source": wl.source, "tokenizer": wl.tokenizer,
                            "requests": len(pool), "notes": list(wl.notes),
                            "warmup_per_probe": o.warmup, "seed": o.seed}
        write_json(o.output, data)
        console.print(f"wrote {o.output}")
    if o.csv_path is not None:
        atomic_write(o.csv_path, probes_csv(result))
        console.print(f"wrote {o.csv_path}")
