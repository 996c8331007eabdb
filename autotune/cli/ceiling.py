"""``autotune ceiling``: the highest load one config sustains under the SLO, in req/s,
requests in flight, or users who think between requests (``--by``).

This module only parses: the options, and with ``--study``/``--trial`` what that
study's search fixed, become one :class:`autotune.search.ceiling_run.CeilingOptions`,
and :func:`autotune.search.ceiling_run.run_ceiling` runs it.  Everything the user can
get wrong is checked before the first probe and before any file is written.  Exit 0
with the answer; 1 when even the lowest rate tried misses the SLO; 2 on bad input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
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
    By,
    ByOpt,
    DatasetSource,
    InputLen,
    MaxDuration,
    MaxModelLen,
    MinDuration,
    MultiTurn,
    NumPrompts,
    OutputLen,
    PrefixShare,
    Seed,
    Slo,
    SloP99,
    Think,
    ThinkOpt,
    ThinkTime,
    VllmCmd,
    Warmup,
)
from autotune.cli._parse import (
    backend_kind,
    load_unit,
    parse_slo,
    parse_steady,
    parse_validate,
    server_options,
    sim_profile,
)
from autotune.search.ceiling_run import CeilingOptions, run_ceiling
from autotune.study.space import flag_type_error
from autotune.tuning.ceiling import search_looks
from autotune.tuning.load_unit import LoadUnit
from autotune.tuning.options import DEFAULT_CONTEXT, RateSearch, WorkloadOptions
from autotune.tuning.record import StoredTrial
from autotune.tuning.verdict import SteadyState
from autotune.workload.pool import PoolOptions


class Backend(str, Enum):
    sim = "sim"
    vllm = "vllm"
    attach = "attach"


INHERITED = {
    "slo_p99": "slo", "profile": "profile", "model_profile": "sim_model", "gpus": "gpus",
    "num_prompts": "num_prompts", "warmup": "warmup", "seed": "seed", "tol": "tol",
    "max_probes": "max_probes", "headroom": "headroom", "tokenizer": "tokenizer",
    "sample_max_len": "max_model_len", "min_duration": "min_duration",
    "max_duration": "max_duration", "backlog_share": "backlog_share",
    "min_rate": "min_rate", "max_rate": "max_rate",
}


# The options only `ceiling` takes, one line each in its signature.
Int = Annotated[int | None, typer.Option()]
ChunkedPrefill = Annotated[bool | None, typer.Option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill", help="vLLM chunked prefill.",
    show_default=False)]
Param = Annotated[list[str] | None, typer.Option(
    help="Any other server flag as key=value (repeatable), e.g. block_size=32.")]
StudyOpt = Annotated[str | None, typer.Option(help="Take the config of --trial N of this study.")]
Trial = Annotated[int | None, typer.Option(help="Trial number in --study.")]
StorageOpt = Annotated[str | None, typer.Option(
    help="Optuna storage of --study (default sqlite:///studies/<name>.db).")]
StudiesDir = Annotated[Path, typer.Option(help="Folder of study databases.")]
ProfileOpt = Annotated[str | None, typer.Option(
    help="Simulator hardware [Nx]HARDWARE[:MODEL], e.g. a100-80gb or 4xh100-80gb.")]
ModelProfile = Annotated[str | None, typer.Option(
    help="Simulator model profile, e.g. llama-3-8b.")]
SimGpus = Annotated[int | None, typer.Option(help="Simulator GPU count.")]
Url = Annotated[str | None, typer.Option(help="Attach to this running OpenAI-compatible server.")]
Model = Annotated[str | None, typer.Option(
    help="Model for --backend vllm (path or name); with attach, the served name.")]
BackendOpt = Annotated[Backend | None, typer.Option(
    help="sim (virtual time; default without --url/--model), vllm, or attach.")]
StartRate = Annotated[float | None, typer.Option(
    help="First rate (req/s); default: a saturation probe, then 70% of it.")]
Tol = Annotated[float, typer.Option(
    help="Stop when feasible and infeasible rates are this close (relative).")]
MaxProbes = Annotated[int, typer.Option(help="Load tests the search may run.")]
MaxNumPrompts = Annotated[int, typer.Option(
    help="Most measured requests one probe may be raised to.")]
Repeats = Annotated[int, typer.Option(help="Runs of each boundary rate (1 = no re-runs).")]
Headroom = Annotated[float, typer.Option(help="Recommended cap this share under the ceiling.")]
Confidence = Annotated[float, typer.Option(
    help="Confidence of the upper bound on each percentile.")]
MinRate = Annotated[float | None, typer.Option(
    help="Lowest rate to try when probes keep failing (default start / 32).")]
MaxRate = Annotated[float | None, typer.Option(
    help="Highest rate to try (default: none; with --study, the space's top request_rate).")]
NoPrune = Annotated[bool, typer.Option("--no-prune", help="Run every probe to the end.")]
Tokenizer = Annotated[str | None, typer.Option(
    help="Path to the model's tokenizer.json (default: the server's /tokenize, else "
         "mistral-common's tekken).")]
Output = Annotated[Path | None, typer.Option(
    "--output", "--out", help="Write the result and every probe's summary as JSON.")]
CsvPath = Annotated[Path | None, typer.Option(
    "--csv", help="Write one row per probe and SLO limit.")]
Validate = Annotated[str, typer.Option(
    help="Run the cap this long at the end (virtual time on the simulator); a failed run "
         "steps it down 5%; 'off' skips it.")]
SEQS, MNBT, TP, GMU = ("vLLM --max-num-seqs.", "vLLM --max-num-batched-tokens.",
                       "vLLM --tensor-parallel-size.", "vLLM --gpu-memory-utilization.")


@app.command("ceiling")
def ceiling(  # one line per option, each defined above or in cli._options
    ctx: typer.Context, slo_p99: SloP99 = None, slo: Slo = None,
    backend: BackendOpt = None,
    max_num_seqs: Annotated[int | None, typer.Option(help=SEQS)] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help=MNBT)] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(help=TP)] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help=GMU)] = None,
    enable_chunked_prefill: ChunkedPrefill = None, max_model_len: MaxModelLen = None,
    param: Param = None, study: StudyOpt = None, trial: Trial = None,
    storage: StorageOpt = None, studies_dir: StudiesDir = Path("studies"),
    profile: ProfileOpt = None, model_profile: ModelProfile = None, gpus: SimGpus = None,
    url: Url = None, model: Model = None, vllm_cmd: VllmCmd = VLLM_CMD,
    start_rate: StartRate = None, tol: Tol = 0.03, max_probes: MaxProbes = 8,
    num_prompts: NumPrompts = NUM_PROMPTS, max_num_prompts: MaxNumPrompts = 2400,
    repeats: Repeats = 1, headroom: Headroom = 0.10, confidence: Confidence = 0.95,
    min_rate: MinRate = None, max_rate: MaxRate = None, warmup: Warmup = WARMUP,
    seed: Seed = 0, no_prune: NoPrune = False, dataset: DatasetSource = "sharegpt",
    input_len: InputLen = 256, output_len: OutputLen = 128, tokenizer: Tokenizer = None,
    output: Output = None, csv_path: CsvPath = None, min_duration: MinDuration = None,
    max_duration: MaxDuration = None, validate: Validate = "5m",
    backlog_share: BacklogShare = 0.02, by: ByOpt = By.rate, think_time: ThinkTime = None,
    think: ThinkOpt = Think.exponential, multi_turn: MultiTurn = False,
    prefix_share: PrefixShare = 0.0,
) -> None:
    """Find the highest load (req/s, in flight, users, trace speed) that meets the SLO.

    With confidence, and a cap under it, validated by a long run."""
    with one_line_errors():
        trial_, settings = _stored_trial(study, trial, storage, studies_dir)
        take = Inherited(ctx, settings)
        config = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens":
                  max_num_batched_tokens, "tensor_parallel_size": tensor_parallel_size,
                  "gpu_memory_utilization": gpu_memory_utilization,
                  "enable_chunked_prefill": enable_chunked_prefill,
                  "max_model_len": max_model_len}
        n = take("num_prompts", num_prompts)
        unit = take.unit(by.value, think_time, think.value)
        # A trial's replayed start is in its study's unit, and the space's rate bounds in
        # req/s: a search in another unit takes neither.
        same = unit.spec() == LoadUnit.from_spec(settings.get("load_unit")).spec()
        by_rate = unit.by == "rate"
        start, must_pass = (replay_start(trial_) if trial_ is not None and start_rate is None
                            and same else (start_rate, False))
        rates = RateSearch(tol=take("tol", tol), max_probes=take("max_probes", max_probes),
                           headroom=take("headroom", headroom))
        kind = backend_kind(None if backend is None else backend.value, url=url, model=model)
        if kind == "attach":
            # An attached server is not restarted: --max-model-len then says its context
            # (which requests fit it), not a flag to start it with.
            config["max_model_len"] = None
        options = CeilingOptions(
            slo=take.slo(slo_p99, slo),
            backend=kind,
            flags=config_flags(trial_, config, param),
            profile=sim_profile(take("profile", profile), None, take("gpus", gpus),
                                model=take("model_profile", model_profile)),
            server=server_options(model=model, url=url, vllm_cmd=vllm_cmd,
                                  startup_timeout=900.0, gpu_ids=None, vllm_env=None),
            workload=WorkloadOptions(num_prompts=n, warmup=take("warmup", warmup),
                                     seed=take("seed", seed),
                                     tokenizer=take("tokenizer", tokenizer)),
            context=max_model_len or take("sample_max_len", None) or DEFAULT_CONTEXT,
            pool=PoolOptions(dataset=dataset, multi_turn=multi_turn,
                             prefix_share=prefix_share),
            input_len=input_len, output_len=output_len,
            steady=_steady(take("min_duration", min_duration),
                           take("max_duration", max_duration), n,
                           take("backlog_share", backlog_share), rates.max_probes),
            rates=rates, start_rate=start, first_must_pass=must_pass,
            unit=unit,
            max_num_prompts=max_num_prompts, repeats=repeats, confidence=confidence,
            min_rate=take("min_rate", min_rate) if by_rate and same else min_rate,
            max_rate=take("max_rate", max_rate) if by_rate and same else max_rate,
            prune=not no_prune, validate_s=parse_validate(validate), output=output,
            csv_path=csv_path, studies_dir=studies_dir)
        code = run_ceiling(options)
    if code:
        raise typer.Exit(code)


# ----------------------------------------------------------------------------- parsing


class Inherited:
    """What ``--study``'s search fixed, for every option the user left at its default, so
    that ``ceiling --study S --trial N`` measures trial N as the search did."""

    def __init__(self, ctx: typer.Context, settings: Mapping[str, Any]) -> None:
        self.settings = dict(settings)
        # Given on the command line or in the environment: anything but a default.
        # (By name: typer ships its own copy of click's ParameterSource.)
        self.explicit = {k for k in ctx.params if getattr(
            ctx.get_parameter_source(k), "name", "DEFAULT") != "DEFAULT"}

    def __call__(self, option: str, value: Any) -> Any:
        key = INHERITED[option]
        if option in self.explicit or self.settings.get(key) is None:
            return value
        return self.settings[key]

    def unit(self, by: str, think_time: str | None, think: str) -> LoadUnit:
        """The study's load unit (a search --by users measures users) unless --by,
        --think-time or --think was given."""
        stored = self.settings.get("load_unit")
        if stored and not {"by", "think_time", "think"} & self.explicit:
            return LoadUnit.from_spec(stored)
        return load_unit(by, think_time, think)

    def slo(self, slo_p99: str | None, slo: str | None) -> Any:
        """The study's SLO only when neither --slo-p99 nor --slo was given."""
        if self.settings.get("slo") is not None and not {"slo_p99", "slo"} & self.explicit:
            return parse_slo(str(self.settings["slo"]), None)
        return parse_slo(slo_p99, slo)


def _stored_trial(study: str | None, trial: int | None, storage: str | None,
                  studies_dir: Path) -> tuple[StoredTrial | None, dict[str, Any]]:
    """--trial N of --study and what the study's search fixed (None and nothing without
    them), opened once; checked before any storage is touched."""
    if trial is not None and trial < 0:
        raise UsageError(f"--trial must be a trial number (0 or more), got {trial}")
    if study is None and trial is None:
        return None, {}
    if trial is None or study is None:
        raise UsageError("--study and --trial go together: give both, e.g. --study S "
                         "--trial 12")
    # The study's storage (Optuna, SQLAlchemy) loads only when --study is given.
    import optuna

    from autotune.core.terminal import mask_url
    from autotune.study.optuna_adapter import quiet_logging
    from autotune.study.storage import open_storage
    from autotune.study.study import SETTINGS_ATTR, storage_url

    url = storage_url(study, storage, studies_dir)
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).is_file():
        raise UsageError(f"no study database {url[len('sqlite:///'):]}: check --study "
                         "or --storage")
    quiet_logging()
    try:
        st = optuna.load_study(study_name=study, storage=open_storage(
            url, heartbeat_interval=None, grace_period=None))
    except KeyError:
        raise UsageError(f"no study named {study!r} in {mask_url(url)}") from None
    found = [t for t in st.get_trials(deepcopy=False) if t.number == trial]
    if not found:
        raise UsageError(f"study {study!r} has no trial {trial} "
                         f"(it has {len(st.trials)} trials)")
    # Empty for a study made before its search stored them.
    return StoredTrial.of(found[0]), {**dict(st.user_attrs.get(SETTINGS_ATTR) or {}),
                                      "load_unit": st.user_attrs.get("load_unit")}


def config_flags(trial: StoredTrial | None, config: Mapping[str, Any],
                 param: Sequence[str] | None) -> dict[str, Any]:
    """The server config from --study/--trial, then the flags, then --param."""
    flags: dict[str, Any] = dict(trial.flags) if trial is not None else {}
    flags.update({k: v for k, v in config.items() if v is not None})
    flags.update(parse_params(param))
    for key in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                "max_model_len"):
        value = flags.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    return flags


def _steady(min_duration: str | None, max_duration: str | None, num_prompts: int,
            backlog_share: float, max_probes: int) -> SteadyState:
    """Each probe's steady-state rule, with as many looks as the search may take."""
    return replace(parse_steady(min_duration, max_duration, num_prompts, backlog_share),
                   looks=search_looks(max_probes))


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


def replay_start(trial: StoredTrial) -> tuple[float | None, bool]:
    """Where the search started this trial's rate search: (first rate, whether it had to
    pass there, i.e. beat the incumbent).  (None, False): a saturation probe first."""
    probes = trial.ceiling.get("probes") or []
    first = probes[0] if probes and isinstance(probes[0], dict) else {}
    rate, phase = first.get("rate"), first.get("phase")
    if phase in ("incumbent", "bracket") and isinstance(rate, (int, float)) and rate > 0:
        return float(rate), phase == "incumbent"
    return None, False
