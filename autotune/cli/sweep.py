"""``autotune sweep``: change one variable, keep everything else fixed (the seed's method).

This module only parses: the options become one
:class:`autotune.search.sweep_run.SweepOptions`, and
:func:`autotune.search.sweep_run.run_sweep_command` runs the points, prints the
case-study table (rate or concurrency, req/s, tokens/s, P99 with its bound, GPU util,
KV usage, overloaded and why), the knee, the TP scaling analysis and the diagnoses, and
saves them with one PNG per figure.  Everything the user can get wrong is checked before
the first file is written.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from autotune.analysis.sweep import SweepError, SweepSpec, _coerce, parse_param, parse_values
from autotune.cli._app import app
from autotune.cli._common import UsageError, one_line_errors
from autotune.cli._options import (
    NUM_PROMPTS,
    VLLM_CMD,
    WARMUP,
    InputLen,
    LengthDistribution,
    LengthSpread,
    MaxDuration,
    MaxModelLen,
    NumPrompts,
    OutputLen,
    Seed,
    Tokenizer,
    VllmCmd,
    Warmup,
)
from autotune.cli._parse import backend_kind, parse_slo, parse_steady, sim_profile
from autotune.search.sweep_run import SweepOptions, run_sweep_command
from autotune.tuning.options import ServerOptions, SimProfile, WorkloadOptions
from autotune.tuning.verdict import SteadyState

# The options only `sweep` takes, one line each in its signature.
Rates = Annotated[str | None, typer.Option(
    help="Request rates (req/s): '10,20,30' or START:STOP:STEP '10:50:10'; 'inf' sends all "
         "at once.")]
Concurrency = Annotated[str | None, typer.Option(
    help="Max concurrency values, e.g. '32,64,128' (alone: rate unlimited).")]
Param = Annotated[str | None, typer.Option(
    help="One server-side parameter, e.g. 'max_num_seqs=64,128,192' or "
         "'tensor_parallel_size=1,2,4,8'; one server start per value.")]
SetFlag = Annotated[list[str] | None, typer.Option(
    "--set", help="A fixed server flag NAME=VALUE (repeatable), e.g. max_num_seqs=128.")]
BackendOpt = Annotated[str | None, typer.Option(
    help="sim (virtual time; default without --model/--url), vllm, or attach.")]
Profile = Annotated[str | None, typer.Option(
    help="Simulator profile HARDWARE[:MODEL], e.g. a100-80gb:llama-3-8b.")]
ModelProfile = Annotated[str | None, typer.Option(
    help="Simulator model profile (overrides the one in --profile).")]
Gpus = Annotated[int | None, typer.Option(
    help="GPUs of the node (simulator: default 4, or the largest TP swept).")]
Model = Annotated[str | None, typer.Option(
    help="Model for --backend vllm (a path or name); implies vllm.")]
Url = Annotated[str | None, typer.Option(
    help="Attach to this running server (client-side sweeps only).")]
DatasetOpt = Annotated[str, typer.Option(help="sharegpt or synthetic.")]
ArrivalOpt = Annotated[str, typer.Option(help="poisson, gamma or constant.")]
SloP99 = Annotated[str | None, typer.Option(
    help="P99 end-to-end latency limit (default 10s, the seed's).")]
Slo = Annotated[str | None, typer.Option(help="More limits, e.g. 'p99:ttft<=2s'.")]
KneeGain = Annotated[float, typer.Option(
    help="Knee: tokens/s gains under this share on the next step ...")]
KneeRise = Annotated[float, typer.Option(help="... while P99 rises over this share.")]
MinDurationOrCount = Annotated[str | None, typer.Option(
    help="Arrivals of each point last at least this long before it may pass (default "
         "max(60s, 6x the largest latency limit)); 'count' for fixed-count points of "
         "--num-prompts requests, as vllm bench serve runs them.")]
Out = Annotated[Path | None, typer.Option(
    "--output", "--out", help="Output folder (default studies/sweep-<timestamp>).")]
NoPlot = Annotated[bool, typer.Option("--no-plot", help="Skip the PNG plots.")]


@app.command("sweep")
def sweep(  # one line per option, each defined above or in cli._options
    rate: Rates = None, concurrency: Concurrency = None, param: Param = None,
    set_: SetFlag = None, backend: BackendOpt = None, profile: Profile = None,
    model_profile: ModelProfile = None, gpus: Gpus = None, model: Model = None,
    vllm_cmd: VllmCmd = VLLM_CMD, url: Url = None, num_prompts: NumPrompts = NUM_PROMPTS,
    warmup: Warmup = WARMUP, dataset: DatasetOpt = "sharegpt", input_len: InputLen = 256,
    output_len: OutputLen = 128, length_spread: LengthSpread = 0.5,
    length_distribution: LengthDistribution = "lognormal", max_model_len: MaxModelLen = None,
    tokenizer: Tokenizer = None, arrival: ArrivalOpt = "poisson", slo_p99: SloP99 = None,
    slo: Slo = None, knee_gain: KneeGain = 0.10, knee_rise: KneeRise = 0.50,
    seed: Seed = 0, min_duration: MinDurationOrCount = None,
    max_duration: MaxDuration = None, out: Out = None, no_plot: NoPlot = False,
) -> None:
    """Sweep one variable (rate, concurrency or one server flag), everything else fixed."""
    with one_line_errors():
        spec = _spec(rate, concurrency, param, set_)
        kind = backend_kind(backend, url=url, model=model)
        options = SweepOptions(
            spec=spec, slo=parse_slo(slo_p99 or ("10s" if not slo else None), slo),
            backend=kind,
            profile=_sim_profile(profile, model_profile, gpus, spec) if kind == "sim"
            else None,
            server=ServerOptions(model=model, url=url, vllm_cmd=vllm_cmd), gpus=gpus,
            workload=WorkloadOptions(num_prompts=num_prompts, warmup=warmup, seed=seed,
                                     tokenizer=tokenizer, max_model_len=max_model_len),
            dataset=dataset, input_len=input_len, output_len=output_len,
            length_spread=length_spread, length_distribution=length_distribution,
            arrival=arrival, steady=_steady(min_duration, max_duration, num_prompts),
            knee_gain=knee_gain, knee_rise=knee_rise, out=out or _default_out(),
            no_plot=no_plot)
        code = run_sweep_command(options)
    if code:
        raise typer.Exit(code)


# ----------------------------------------------------------------------------- parsing


def _flag(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not sep or not name or not value.strip():
        raise UsageError(f"--set {text!r}: give NAME=VALUE, e.g. --set max_num_seqs=128")
    return name, _coerce(value)


def _spec(rate: str | None, concurrency: str | None, param: str | None,
          set_: list[str] | None) -> SweepSpec:
    """What is swept: the rates, the concurrencies and one server flag's values."""
    try:
        rates = (parse_values(rate, name="--rate") if rate and rate.strip() != "inf"
                 else [math.inf] if rate or concurrency else [])
        concs: list[int | None] = ([int(c) for c in parse_values(
            concurrency, name="--concurrency", integer=True)] if concurrency else [None])
        name, values = parse_param(param) if param else (None, [])
        base = dict(_flag(s) for s in (set_ or []))
        if not rates:
            if name is None:
                raise SweepError("nothing to sweep: give --rate, --concurrency or --param")
            raise SweepError(f"--param {name} needs the load to offer each server: give "
                             "--rate R (or a list) or --concurrency C")
        return SweepSpec(rates=rates, concurrencies=concs, param=name, values=values,
                         base_flags=base)
    except SweepError as exc:
        raise UsageError(str(exc)) from None


def _sim_profile(profile: str | None, model_profile: str | None, gpus: int | None,
                 spec: SweepSpec) -> SimProfile:
    """The simulator's node; a TP sweep gets at least as many GPUs as its largest TP."""
    node = sim_profile(profile, None, gpus, model=model_profile)
    if gpus is None and spec.param == "tensor_parallel_size":
        return replace(node, gpus=max(node.gpus, *(int(v) for v in spec.values)))
    return node


def _steady(min_duration: str | None, max_duration: str | None, num_prompts: int
            ) -> SteadyState | None:
    """Each point's steady-state rule; None for ``--min-duration count``."""
    if (min_duration or "").strip().lower() == "count":
        return None
    return parse_steady(min_duration, max_duration, num_prompts)


def _default_out() -> Path:
    return Path("studies") / dt.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
