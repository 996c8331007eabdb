"""One load test as a library call: ``run_bench(BenchOptions(...))``.

``autotune bench`` parses its options into one :class:`BenchOptions` and calls
:func:`run_bench` once.  Without an SLO it is a fixed-count test, as ``vllm bench
serve`` runs one; with an SLO it is sized by time and judged on steady-state evidence
(:mod:`autotune.tuning.verdict`).  The figures are printed with how they were obtained,
and written as JSON (ours or vLLM's ``--save-result`` layout) and CSV.
"""

from __future__ import annotations

import csv as csv_module
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.analysis import diagnose
from autotune.analysis.vllm_results import write_vllm_result
from autotune.backends.base import LoadPlan
from autotune.backends.factory import BackendSpec, create_backend
from autotune.client import loadgen
from autotune.core.errors import AutotuneError
from autotune.core.files import atomic_write, check_writable, write_json
from autotune.core.metrics import (
    MEASURED,
    SIMULATED,
    SIMULATED_HTTP,
    LatencyStats,
    Summary,
    summarize,
)
from autotune.core.records import RequestRecord
from autotune.core.slo import SLO
from autotune.core.terminal import console, err_console
from autotune.tuning.options import DEFAULT_CONTEXT, OptionsError, SimProfile, WorkloadOptions
from autotune.tuning.trial import evaluate
from autotune.tuning.verdict import SteadyState, horizon
from autotune.workload import sources as workload
from autotune.workload import tokenizer


class BenchError(AutotuneError):
    """The load test could not run; the message says why."""


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """One load test, every value parsed: the server (or the simulator's ``profile``),
    the load, the workload, the SLO and its steady-state rule, and the outputs."""

    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None  # never printed or saved
    profile: SimProfile | None = None  # the simulator in virtual time instead of --url
    flags: dict[str, Any] = field(default_factory=dict)  # the simulated server config
    rate: float = 1.0  # inf: all at once
    max_concurrency: int | None = None
    arrival: str = "poisson"  # poisson, gamma or constant
    burstiness: float = 1.0
    request_timeout_s: float = 600.0
    endpoint: str = "completions"  # or chat
    transport: str = "native"  # native, aiohttp or httpx
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    dataset: str = "sharegpt"  # or synthetic
    dataset_path: Path | None = None
    input_len: int = 256
    output_len: int = 128
    length_spread: float = 0.0
    length_distribution: str = "lognormal"
    slo: SLO | None = None  # None: a fixed-count test without a verdict
    steady: SteadyState | None = None  # with an SLO: the steady-state rule
    output: Path | None = None
    output_format: str = "autotune"  # or vllm (its --save-result layout)
    csv: Path | None = None

    def __post_init__(self) -> None:
        _positive("--rate", self.rate, allow_inf=True)
        _positive("--burstiness", self.burstiness)
        _positive("--request-timeout", self.request_timeout_s)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise OptionsError(f"--max-concurrency must be at least 1, got "
                               f"{self.max_concurrency}")
        if self.dataset_path is not None and not Path(self.dataset_path).exists():
            raise OptionsError(f"dataset file {self.dataset_path} does not exist")
        for name, value in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if value < 1:
                raise OptionsError(f"{name} must be at least 1 token, got {value}")
        if self.steady is not None and self.slo is None:
            raise OptionsError("--duration/--min-duration/--max-duration size a test judged "
                               "against an SLO: add --slo-p99 or --slo")
        if self.steady is not None and self.rate == math.inf:
            raise OptionsError("a verdict needs a finite --rate (arrivals sized by time); "
                               "drop the SLO to measure rate inf")


def _sim_flags(o: BenchOptions, profile: SimProfile
               ) -> tuple[dict[str, Any], tuple[Any, Any]]:
    """The simulated config (the profile's model plus ``--param`` flags) and the
    (hardware, model) profiles it runs on."""
    hardware, model = profile.load()
    return {"model": model.hf_id, **o.flags}, (hardware, model)


def _positive(name: str, value: float | None, *, allow_inf: bool = False) -> None:
    if value is None:
        return
    if not value > 0:
        raise OptionsError(f"{name} must be greater than 0, got {value:g}")
    if value == float("inf") and not allow_inf:
        raise OptionsError(f"{name} must be finite, got inf")


def run_bench(o: BenchOptions) -> None:
    """One load test: the workload, the run (judged when there is an SLO), the figures
    printed with how they were measured, and the files asked for."""
    slo, steady = o.slo, o.steady
    check_writable(o.output, "--output")
    check_writable(o.csv, "--csv")
    sim = o.profile is not None
    flags, profiles = _sim_flags(o, o.profile) if o.profile is not None else ({}, None)
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
    n_warm = o.workload.warmup
    if len(wl.requests) <= n_warm:
        raise OptionsError(
            f"only {len(wl.requests)} usable requests in {wl.source}, not enough for "
            f"{n_warm} warm-up plus measured requests; lower --warmup or --num-prompts")
    warm, measured = wl.requests[:n_warm], wl.requests[n_warm:]

    if sim or steady is not None:
        summary, records, evidence, where = _run_judged(o, slo, steady, flags, profiles,
                                                        model, url, warm, measured, source)
    else:
        summary, records = _run_http(o, url, model, warm, measured, source)
        evidence, where = None, f"{model} at {url}"

    how, findings = _print_results(o, slo, summary, records, evidence, where, wl, warm)
    run = {
        "url": None if sim else url, "backend": "sim" if sim else "http", "model": model,
        "rate": None if o.rate == float("inf") else o.rate,
        "max_concurrency": o.max_concurrency, "config": flags or None,
        "num_prompts": len(measured), "warmup": len(warm), "dataset": wl.source,
        "tokenizer": wl.tokenizer, "arrival": o.arrival, "burstiness": o.burstiness,
        "endpoint": o.endpoint, "seed": o.workload.seed,
        "request_timeout_s": o.request_timeout_s,
        "transport": o.transport, "source": summary.source,
        "slo": None if slo is None else str(slo), "notes": wl.notes,
        "steady_state": None if steady is None else steady.to_dict(),
        "diagnoses": [d.to_dict() for d in findings],
    }
    _write_outputs(o, run, how, summary, records, evidence)


def _model_and_context(o: BenchOptions, sim: bool, flags: dict[str, Any], profiles: Any,
                       url: str) -> tuple[str, Any, int]:
    """The model to ask for and the context that bounds the workload, asking the server
    only for what the options leave open."""
    served = None
    if sim:
        model = str(flags.get("model"))
    elif o.model and o.workload.max_model_len is not None:
        model = o.model  # the server is checked after the workload, before any load
    else:
        # The model's name or its context length comes from the server.
        served = loadgen.check_server(url, api_key=o.api_key)
        first = served.first_model  # a server with no model is refused even when named
        model = o.model or first
    context = o.workload.max_model_len or (
        int(flags.get("max_model_len") or profiles[1].max_model_len) if profiles
        else served.max_model_len if served is not None and served.max_model_len
        else DEFAULT_CONTEXT)
    return model, served, context


def _load_workload(o: BenchOptions, slo: Any, sim: bool, url: str, model: str,
                   context: int) -> Any:
    """Draw the requests, counting tokens as the model would, sized for a verdict when
    there is an SLO."""
    # A test judged against an SLO is sized by time: it draws at least
    # workload.POOL_REQUESTS distinct requests, so a long test judges the workload's
    # tail rather than the same few longest replies of a small pool again and again
    # (its sequential tests take requests as independent).
    w = o.workload
    total = (w.num_prompts if slo is None else workload.pool_size(w.num_prompts)) + w.warmup
    with tokenizer.load_tokenizer(w.tokenizer, server_url=None if sim else url, model=model,
                                  api_key=o.api_key) as tok:
        if o.dataset == "sharegpt":
            wl = workload.load_sharegpt(o.dataset_path, tokenizer=tok, num_prompts=total,
                                        max_model_len=context, seed=w.seed)
        else:
            wl = workload.synthetic_workload(
                tok, num_prompts=total, input_len=o.input_len, output_len=o.output_len,
                distribution=o.length_distribution, input_spread=o.length_spread,
                output_spread=o.length_spread, seed=w.seed)
    return wl


def _print_results(o: BenchOptions, slo: Any, summary: Any, records: Any, evidence: Any,
                   where: str, wl: Any, warm: Any) -> tuple[str, Any]:
    """Print the figures, how they were measured, the verdict and the diagnoses; the
    written files repeat the last two."""
    for table in summary_tables(summary, title=f"autotune bench: {where}"):
        console.print(table)
    how = summary.how()
    if evidence is not None:
        how += (f"; sized by time: {evidence.at_s:.0f} s of arrivals (minimum "
                f"{evidence.min_duration_s:g} s), the requests of the last "
                f"{horizon(slo):g} s before the stop not judged")
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
    if o.output is not None and o.output_format == "vllm":
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


def _run_judged(o: BenchOptions, slo: Any, steady: Any, flags: dict[str, Any],
                profiles: tuple[Any, Any] | None, model: str, url: str, warm: list[Any],
                measured: list[Any], source: str) -> tuple[Any, Any, Any, str]:
    """One load test through the trial runner: the simulator, or the server at ``url``
    with the steady-state stop rule; progress lines as the evidence comes in."""
    if profiles is not None:
        hardware, sim_model = profiles
        backend = create_backend(BackendSpec(kind="sim", hardware=hardware,
                                             sim_model=sim_model))
        where = f"{flags} on {hardware.label}, {sim_model.name} (simulated, virtual time)"
    else:
        backend = create_backend(BackendSpec(
            kind="attach", url=url, request_model=model, name="http",
            endpoint=o.endpoint, api_key=o.api_key, nvml=False,
            transport=o.transport, source=source))
        where = f"{model} at {url}" + (" (autotune's simulator)" if source == SIMULATED_HTTP
                                       else "")
    plan = LoadPlan(slo=slo or SLO(()), requests=measured, warmup_requests=warm,
                    warmup=len(warm), seed=o.workload.seed, process=o.arrival,
                    burstiness=o.burstiness, request_timeout_s=o.request_timeout_s,
                    max_concurrency=o.max_concurrency, steady=steady)

    def progress(ev: Any) -> None:
        err_console.print(f"  {ev.at_s:5.0f} s of arrivals: {ev.cohort} requests judged, "
                          f"served {ev.served_rate:.3g}/{ev.arrival_rate:.3g} req/s, "
                          f"verdict so far {ev.verdict}", soft_wrap=True, highlight=False)

    result = evaluate(backend, flags, o.rate, plan, on_evidence=progress)
    backend.close()
    if result.summary is None:
        raise BenchError(f"the load test could not run ({result.reason}): {result.detail}")
    return result.summary, result.records, result.evidence, where


def _run_http(o: BenchOptions, url: str, model: str, warm: list[Any], measured: list[Any],
              source: str) -> tuple[Any, Any]:
    """A fixed-count load test without a verdict, as vLLM's benchmark runs one."""
    config = loadgen.LoadTestConfig(
        url=url, model=model, endpoint=o.endpoint, rate=o.rate,
        process=o.arrival, burstiness=o.burstiness, max_concurrency=o.max_concurrency,
        warmup=len(warm), request_timeout_s=o.request_timeout_s, api_key=o.api_key,
        seed=o.workload.seed, transport=o.transport)
    with Progress(TextColumn("[bold]load test"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as progress:
        task = progress.add_task("requests", total=len(warm) + len(measured))
        result = loadgen.run_load_test_sync(
            config, measured, warmup_requests=warm,
            on_progress=lambda done, _total: progress.update(task, completed=done))
    return summarize(result.records, offered_rate=o.rate, source=source), (
        result.records)


# ----------------------------------------------------------------------------- tables


RECORD_COLUMNS = (
    "index", "warmup", "scheduled_s", "dispatched_s", "sent_s", "first_token_s", "end_s",
    "prompt_tokens", "output_tokens", "expected_output_tokens", "status", "error",
    "ttft_s", "tpot_s", "e2e_s", "send_lag_s", "num_chunks",
)


def records_csv(records: Sequence[RequestRecord]) -> str:
    buf = io.StringIO()
    writer = csv_module.writer(buf)
    writer.writerow(RECORD_COLUMNS)
    for r in records:
        writer.writerow([
            r.index, r.warmup, r.scheduled_s, r.dispatched_s, r.sent_s, r.first_token_s,
            r.end_s, r.prompt_tokens, r.output_tokens, r.expected_output_tokens, r.status,
            r.error or "", r.ttft_s, r.tpot_s, r.e2e_s, r.send_lag_s, len(r.chunk_times_s),
        ])
    return buf.getvalue()


def ms(value: float) -> str:
    if value is None or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "∞"
    return f"{value * 1e3:,.1f}"


def _latency_row(name: str, stats: LatencyStats) -> list[str]:
    bound = f"[{ms(stats.p99_lo)}, {ms(stats.p99_hi)}]"
    return [name, ms(stats.mean), ms(stats.p50), ms(stats.p90), ms(stats.p99), bound,
            ms(stats.max), str(stats.count)]


def summary_tables(summary: Summary, *, title: str) -> list[Table]:
    """The throughput table and the latency table of one load test."""
    top = Table(title=title, show_header=False, title_justify="left")
    top.add_column("figure")
    top.add_column("value", justify="right")
    rate = "unlimited" if summary.offered_rate in (None, math.inf) else f"{summary.offered_rate:g}"
    rows = [
        ("Offered rate (req/s)", rate),
        # The whole schedule (warm-up included) has the offered mean gap; its measured
        # part, a sample of it, need not, so it is named for what it is.
        ("Measured arrivals: scheduled / sent rate (req/s)",
         f"{summary.scheduled_rate:.2f} / {summary.achieved_send_rate:.2f}"),
        ("Measured requests", f"{summary.num_measured}"),
        ("Successful / failed", f"{summary.num_completed} / {summary.num_failed}"),
        ("Warm-up excluded", f"{summary.num_warmup_excluded}"),
        ("Measured window (s)", f"{summary.duration_s:.2f}"),
        ("Request throughput (req/s)", f"{summary.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{summary.output_throughput:,.1f}"),
        ("Total token throughput (tok/s)", f"{summary.total_token_throughput:,.1f}"),
        ("Total input / output tokens",
         f"{summary.total_input_tokens:,} / {summary.total_output_tokens:,}"),
        ("Send lag p99 (ms)", ms(summary.send_lag_p99_s)),
    ]
    if summary.failure_reasons:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(summary.failure_reasons.items()))
        rows.append(("Failures by reason", reasons))
    if summary.slo is not None and summary.slo_check is not None:
        verdict = "met" if summary.slo_check.met else "MISSED (" + ", ".join(
            summary.slo_check.failed) + ")"
        rows += [
            ("SLO", f"{summary.slo}: {verdict}"),
            ("Goodput (req/s)", f"{summary.goodput_requests:.2f}"),
            ("Goodput (output tok/s)", f"{summary.goodput_tokens:,.1f}"),
            ("SLO attainment", f"{summary.attainment:.1%}"),
        ]
    for name, value in rows:
        top.add_row(name, value)

    lat = Table(title="Latency (ms); p99 bound = 95% distribution-free interval",
                title_justify="left")
    for col in ("metric", "mean", "p50", "p90", "p99", "p99 95% bound", "max", "n"):
        lat.add_column(col, justify="right" if col != "metric" else "left")
    for name in ("ttft", "tpot", "itl", "e2e"):
        lat.add_row(*_latency_row(name.upper(), getattr(summary, name)))
    return [top, lat]
