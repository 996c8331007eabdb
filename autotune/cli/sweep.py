"""``autotune sweep``: change one variable, keep everything else fixed (the seed's method).

Prints and saves the case-study table (rate or concurrency, req/s, tokens/s, P99 with
its bound, GPU util, KV usage, overloaded and why), one PNG per figure against the
swept variable, the knee, the TP scaling analysis and the diagnoses with evidence.
Everything the user can get wrong is checked before the first file is written.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from autotune.cli._app import app
from autotune.cli._common import UsageError, one_line_errors
from autotune.cli._options import (
    NUM_PROMPTS,
    VLLM_CMD,
    WARMUP,
    MaxDuration,
    MaxModelLen,
    NumPrompts,
    Seed,
    VllmCmd,
    Warmup,
)
from autotune.cli._parse import parse_profile, parse_steady
from autotune.core.files import atomic_write, write_json
from autotune.core.metrics import MEASURED, SIMULATED
from autotune.core.terminal import console, err_console
from autotune.tuning.options import DEFAULT_CONTEXT

BACKENDS = ("sim", "vllm", "attach")
PLOTTED = (
    ("request_throughput", "request throughput (req/s)"),
    ("output_throughput", "output tokens/s"),
    ("total_token_throughput", "total tokens/s (input + output)"),
    ("p99_e2e_s", "P99 end-to-end latency (s), 95% bound"),
    ("gpu_util_mean_pct", "GPU util mean (%)"),
    ("kv_usage_max", "KV-cache usage max (0..1)"),
)


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    """What ``autotune sweep`` was given: one typed, frozen object, not a bag of options."""

    rate: str | None = None
    concurrency: str | None = None
    param: str | None = None
    set_: list[str] | None = None
    backend: str | None = None
    profile: str | None = None
    model_profile: str | None = None
    gpus: int | None = None
    model: str | None = None
    vllm_cmd: str = 'vllm serve'
    url: str | None = None
    num_prompts: int = 1000
    warmup: int = 100
    dataset: str = 'sharegpt'
    input_len: int = 256
    output_len: int = 128
    length_spread: float = 0.5
    length_distribution: str = 'lognormal'
    max_model_len: int | None = None
    tokenizer: str | None = None
    arrival: str = 'poisson'
    slo_p99: str | None = None
    slo: str | None = None
    knee_gain: float = 0.1
    knee_rise: float = 0.5
    seed: int = 0
    min_duration: str | None = None
    max_duration: str | None = None
    out: Path | None = None
    no_plot: bool = False


@app.command("sweep")
def sweep(
    rate: Annotated[str | None, typer.Option(
        help="Request rates (req/s): '10,20,30' or START:STOP:STEP '10:50:10'; 'inf' "
             "sends all at once.")] = None,
    concurrency: Annotated[str | None, typer.Option(
        help="Max concurrency values, e.g. '32,64,128' (alone: rate unlimited).")] = None,
    param: Annotated[str | None, typer.Option(
        help="One server-side parameter, e.g. 'max_num_seqs=64,128,192' or "
             "'tensor_parallel_size=1,2,4,8'; one server start per value.")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="A fixed server flag NAME=VALUE (repeatable), e.g. max_num_seqs=128.")
    ] = None,
    backend: Annotated[str | None, typer.Option(
        help="sim (virtual time; default without --model/--url), vllm, or attach.")] = None,
    profile: Annotated[str | None, typer.Option(
        help="Simulator profile HARDWARE[:MODEL], e.g. a100-80gb:llama-3-8b.")] = None,
    model_profile: Annotated[str | None, typer.Option(
        help="Simulator model profile (overrides the one in --profile).")] = None,
    gpus: Annotated[int | None, typer.Option(
        help="GPUs of the node (simulator: default 4, or the largest TP swept).")] = None,
    model: Annotated[str | None, typer.Option(
        help="Model for --backend vllm (a path or name); implies vllm.")] = None,
    vllm_cmd: VllmCmd = VLLM_CMD,
    url: Annotated[str | None, typer.Option(
        help="Attach to this running server (client-side sweeps only).")] = None,
    num_prompts: NumPrompts = NUM_PROMPTS,
    warmup: Warmup = WARMUP,
    dataset: Annotated[str, typer.Option(help="sharegpt or synthetic.")] = "sharegpt",
    input_len: Annotated[int, typer.Option(help="Synthetic: mean prompt tokens.")] = 256,
    output_len: Annotated[int, typer.Option(help="Synthetic: mean output tokens.")] = 128,
    length_spread: Annotated[float, typer.Option(
        help="Synthetic: relative spread of lengths (0 = fixed).")] = 0.5,
    length_distribution: Annotated[str, typer.Option(
        help="Synthetic: fixed, uniform or lognormal.")] = "lognormal",
    max_model_len: MaxModelLen = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="Path to the model's tokenizer.json (default: mistral-common's tekken).")
    ] = None,
    arrival: Annotated[str, typer.Option(help="poisson, gamma or constant.")] = "poisson",
    slo_p99: Annotated[str | None, typer.Option(
        help="P99 end-to-end latency limit (default 10s, the seed's).")] = None,
    slo: Annotated[str | None, typer.Option(
        help="More limits, e.g. 'p99:ttft<=2s'.")] = None,
    knee_gain: Annotated[float, typer.Option(
        help="Knee: tokens/s gains under this share on the next step ...")] = 0.10,
    knee_rise: Annotated[float, typer.Option(
        help="... while P99 rises over this share.")] = 0.50,
    seed: Seed = 0,
    min_duration: Annotated[str | None, typer.Option(
        help="Arrivals of each point last at least this long before it may pass "
             "(default max(60s, 6x the largest latency limit)); 'count' for fixed-count "
             "points of --num-prompts requests, as vllm bench serve runs them.")] = None,
    max_duration: MaxDuration = None,
    out: Annotated[Path | None, typer.Option(
        "--output", "--out",
        help="Output folder (default studies/sweep-<timestamp>).")] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Skip the PNG plots.")] = False,
) -> None:
    """Sweep one variable (rate, concurrency or one server flag), everything else fixed."""
    with one_line_errors():
        _sweep(SweepOptions(**locals()))


# ----------------------------------------------------------------------------- validation


def _flag(text: str) -> tuple[str, Any]:
    from autotune.analysis.sweep import _coerce

    name, sep, value = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not sep or not name or not value.strip():
        raise UsageError(f"--set {text!r}: give NAME=VALUE, e.g. --set max_num_seqs=128")
    return name, _coerce(value)


def _spec(o: SweepOptions) -> Any:
    from autotune.analysis.sweep import SweepError, SweepSpec, parse_param, parse_values

    try:
        rates = (parse_values(o.rate, name="--rate") if o.rate and o.rate.strip() != "inf"
                 else [math.inf] if o.rate or o.concurrency else [])
        concs: list[int | None] = ([int(c) for c in parse_values(
            o.concurrency, name="--concurrency", integer=True)] if o.concurrency else [None])
        name, values = parse_param(o.param) if o.param else (None, [])
        base = dict(_flag(s) for s in (o.set_ or []))
        if not rates:
            if name is None:
                raise SweepError("nothing to sweep: give --rate, --concurrency or --param")
            raise SweepError(f"--param {name} needs the load to offer each server: give "
                             "--rate R (or a list) or --concurrency C")
        return SweepSpec(rates=rates, concurrencies=concs, param=name, values=values,
                         base_flags=base)
    except SweepError as exc:
        raise UsageError(str(exc)) from None


def _positive(o: SweepOptions) -> None:
    for name, value, low in (("--num-prompts", o.num_prompts, 1), ("--warmup", o.warmup, 0),
                             ("--input-len", o.input_len, 1), ("--output-len", o.output_len, 1)):
        if value < low:
            raise UsageError(f"{name} must be at least {low}, got {value}")
    if o.gpus is not None and o.gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {o.gpus}")
    if not 0 < o.knee_gain < 10 or not 0 < o.knee_rise < 100:
        raise UsageError("--knee-gain and --knee-rise are shares above 0, e.g. 0.10 and 0.50")
    if o.dataset not in ("sharegpt", "synthetic"):
        raise UsageError(f"unknown --dataset {o.dataset!r}; use sharegpt or synthetic")
    if o.arrival not in ("poisson", "gamma", "constant"):
        raise UsageError(f"unknown --arrival {o.arrival!r}; use poisson, gamma or constant")


def _sim_profile(o: SweepOptions, spec: Any) -> tuple[str, str, int]:

    hw, mdl, count = parse_profile(o.profile, {}, o.gpus)
    if o.model_profile:
        mdl = o.model_profile
    if o.gpus is None and spec.param == "tensor_parallel_size":
        count = max(count, *(int(v) for v in spec.values))
    from autotune.sim.profiles import ProfileError, load_hardware, load_model

    try:
        load_hardware(f"{count}x{hw}")
        load_model(mdl)
    except (ProfileError, OSError, ValueError) as exc:
        raise UsageError(f"simulator profile {hw}:{mdl}: {exc}") from None
    return hw, mdl, count


def _out_dir(o: SweepOptions) -> Path:
    folder = o.out or Path("studies") / dt.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} is a file; give a folder")
    parent = folder.resolve().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    import os

    if not os.access(probe, os.W_OK):
        raise UsageError(f"--out {folder}: {probe} is not writable")
    return folder


# ----------------------------------------------------------------------------- main


def _sweep(o: SweepOptions) -> None:
    from autotune.core.slo import combine

    spec = _spec(o)
    _positive(o)
    slo = combine(o.slo_p99 or ("10s" if not o.slo else None), o.slo)
    kind = o.backend or ("attach" if o.url else "vllm" if o.model else "sim")
    if kind not in BACKENDS:
        raise UsageError(f"unknown --backend {kind!r}; use one of {', '.join(BACKENDS)}")
    if kind == "attach":
        _attach_url(o)  # refuses a missing --url before anything is read or started
    if kind == "attach" and spec.param is not None:
        raise UsageError(f"--param {spec.param} is a server-side setting and an attached "
                         "server cannot be restarted: sweep --rate or --concurrency only, or "
                         "use --backend sim or vllm")
    if kind == "attach" and spec.base_flags:
        raise UsageError("--set changes server flags, which an attached server cannot take")
    if kind == "vllm" and not o.model:
        raise UsageError("--backend vllm needs --model (a path or a model name)")
    sim = _sim_profile(o, spec) if kind == "sim" else None
    folder = _out_dir(o)
    wl = _workload(o, _context(o, spec, kind))
    plan = _plan(o, slo, wl)
    backend = _backend(o, kind, sim, folder)

    from autotune.analysis.diagnose import workload_settings
    from autotune.analysis.sweep import run_sweep

    node_gpus = sim[2] if sim else o.gpus
    settings = {"gpus": node_gpus,
                **workload_settings([r.prompt_tokens for r in wl.requests], wl.source)}
    label = SIMULATED if kind == "sim" else MEASURED
    console.print(f"sweep: {escape(spec.describe())}; backend {kind}"
                  + (f" ({sim[2]}x{sim[0]}, {sim[1]})" if sim else "")
                  + f"; {label}; SLO {slo}; workload {escape(wl.source)}, "
                    + (f"{len(plan.requests)} measured + {plan.warmup} warm-up requests per "
                       "point" if plan.steady is None else
                       f"{plan.warmup} warm-up requests, then at least "
                       f"{plan.steady.min_s(slo):g} s of arrivals per point (up to "
                       f"{plan.steady.max_s(slo):g} s), each judged on steady-state evidence"),
                  soft_wrap=True)

    def progress(p: Any) -> None:
        err_console.print(f"[dim]point {spec.param or ''}{'=' if spec.param else ''}"
                          f"{'' if p.server_value is None else p.server_value} rate "
                          f"{p.rate:g} conc {p.concurrency}: {p.result.status}[/]")

    try:
        res = run_sweep(spec, backend, plan, settings=settings, on_point=progress,
                        knee_gain=o.knee_gain, knee_rise=o.knee_rise)
    finally:
        backend.close()
    _print(res, slo)
    _save(res, folder, no_plot=o.no_plot)
    if all(p.summary is None for p in res.points):
        first = res.points[0].result
        err_console.print(f"[bold red]error:[/] no point could be measured; first failure: "
                          f"{first.reason}: {escape(str(first.detail))[:300]}", soft_wrap=True)
        raise typer.Exit(1)


def _attach_url(o: SweepOptions) -> str:
    if not o.url:
        raise UsageError("--backend attach needs --url of the running server")
    return o.url


def _context(o: SweepOptions, spec: Any, kind: str) -> int:
    """The ShareGPT length limit: --max-model-len, else the swept config's, else what an
    attached server reports, else the default."""
    if o.max_model_len:
        return int(o.max_model_len)
    if spec.base_flags.get("max_model_len"):
        return int(spec.base_flags["max_model_len"])
    if kind == "attach":
        from autotune.client.loadgen import check_server

        reported = check_server(_attach_url(o)).max_model_len
        if reported:
            return int(reported)
    return DEFAULT_CONTEXT


def _workload(o: SweepOptions, context: int) -> Any:
    from autotune.workload.sources import build_workload
    from autotune.workload.tokenizer import load_tokenizer

    tok = load_tokenizer(o.tokenizer)
    total = o.num_prompts + o.warmup
    wl = build_workload(o.dataset, tokenizer=tok, num_prompts=total, seed=o.seed,
                        max_model_len=context,
                        output_len=o.output_len if o.dataset == "synthetic" else None,
                        input_len=o.input_len, distribution=o.length_distribution,
                        input_spread=o.length_spread, output_spread=o.length_spread)
    if len(wl.requests) <= o.warmup:
        raise UsageError(f"only {len(wl.requests)} usable requests in {wl.source}: not "
                         f"enough for {o.warmup} warm-up plus measured ones; lower --warmup")
    return wl


def _plan(o: SweepOptions, slo: Any, wl: Any) -> Any:
    """Each point is the steady-state load test of search and ceiling (sized by time,
    judged pass / fail / inconclusive), unless ``--min-duration count`` asks for
    fixed-count points."""
    from autotune.backends.base import LoadPlan

    count = (o.min_duration or "").strip().lower() == "count"
    steady = None if count else parse_steady(o.min_duration, o.max_duration, o.num_prompts)
    reqs = list(wl.requests)
    return LoadPlan(slo=slo, requests=reqs[o.warmup:], warmup_requests=reqs[: o.warmup],
                    warmup=o.warmup, seed=o.seed, process=o.arrival, window_s=1.0,
                    steady=steady)


def _backend(o: SweepOptions, kind: str, sim: tuple[str, str, int] | None,
             folder: Path) -> Any:
    from autotune.backends.factory import BackendSpec, create_backend

    if kind == "sim" and sim is not None:
        return create_backend(BackendSpec(kind="sim", hardware=f"{sim[2]}x{sim[0]}",
                                          sim_model=sim[1]))
    attach = kind == "attach"
    return create_backend(BackendSpec(
        kind="attach" if attach else "vllm", url=_attach_url(o) if attach else None,
        model=None if o.model is None else str(o.model), vllm_cmd=o.vllm_cmd,
        log_dir=folder / "logs", gpus=o.gpus, nvml=False))


# ----------------------------------------------------------------------------- output


def _f(v: float, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    return format(v, fmt)


def table_of(res: Any, slo: Any) -> Table:
    """The seed's case-study table, one row per point."""
    spec = res.spec
    sim = " (sim)" if res.simulated else ""
    t = Table(title=f"sweep over {spec.x_name} ({res.source})", caption=res.how,
              title_justify="left", caption_justify="left")
    conc = any(p.concurrency is not None for p in res.points)
    cols = ([spec.param] if spec.param else []) + ["rate (req/s)"] + (
        ["max conc"] if conc else []) + [
        "req/s", "output tok/s", "P99 e2e s [95% bound]", f"GPU util{sim}",
        f"KV mean/max{sim}", f"SLO {slo}", "overloaded"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("overloaded", f"SLO {slo}") else "right")
    for p in res.points:
        rate = "∞" if math.isinf(p.rate) else f"{p.rate:g}"
        over = ("-" if p.overloaded is None else "yes" if p.overloaded else "no")
        p99 = (f"{_f(p.fig('p99_e2e_s'), '.2f')} [{_f(p.fig('p99_e2e_lo_s'), '.2f')}, "
               f"{_f(p.fig('p99_e2e_hi_s'), '.2f')}]")
        util = p.fig("gpu_util_mean_pct")
        row = ([str(p.server_value)] if spec.param else []) + [rate] + (
            ["-" if p.concurrency is None else str(p.concurrency)] if conc else []) + [
            _f(p.fig("request_throughput"), ".2f"), _f(p.fig("output_throughput"), ",.0f"),
            p99,
            "-" if math.isnan(util) else f"{util:.0f}%",
            f"{_f(p.fig('kv_usage_mean'), '.0%')}/{_f(p.fig('kv_usage_max'), '.0%')}",
            "met" if p.slo_text() == "met" else p.slo_text().split(" (")[0],
            escape(f"yes: {p.overload_why}" if p.overloaded else over)]
        t.add_row(*row)
    return t


def _print(res: Any, slo: Any) -> None:
    from autotune.analysis.diagnose import render

    console.print(table_of(res, slo))
    sim = " (simulated)" if res.simulated else ""
    for key, knee in res.knees.items():
        where = "" if key == "all" else f"{key}: "
        console.print(f"[bold]knee{sim}:[/] {escape(where + knee.why)}", soft_wrap=True)
    if res.scaling is not None:
        for line in res.scaling.lines():
            console.print(escape(line), soft_wrap=True, highlight=False)
        if sim:
            console.print("  (scaling figures are simulated: the simulator's all-reduce "
                          "model, not your interconnect)", soft_wrap=True)
    if res.warnings:
        for line in render(res.warnings, "rich"):
            console.print(line, soft_wrap=True)
    if not any(p.diagnoses for p in res.points):
        console.print(f"diagnoses{sim}: none fired at any point", soft_wrap=True)
    for p in res.points:
        if not p.diagnoses:
            continue
        head = (f"{res.spec.param}={p.server_value} " if res.spec.param else "") + (
            f"rate {'∞' if math.isinf(p.rate) else f'{p.rate:g}'}"
            + ("" if p.concurrency is None else f", concurrency {p.concurrency}"))
        console.print(f"[bold]diagnoses at {escape(head)}{sim}:[/]")
        for line in render(p.diagnoses, "rich"):
            console.print("  " + line, soft_wrap=True)


def markdown_of(res: Any) -> str:
    from autotune.analysis.diagnose import render

    rows = res.rows()
    keys = ([res.spec.param] if res.spec.param else []) + [
        "rate", "concurrency", "request_throughput", "output_throughput", "p99_e2e_s",
        "p99_e2e_hi_s", "gpu_util_mean_pct", "kv_usage_max", "slo", "overloaded",
        "overload_why"]
    lines = [f"# Sweep over {res.spec.x_name} ({res.source})", "", res.how, "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append("-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Knee", ""] + [f"- {k}: {v.why}" for k, v in res.knees.items()]
    if res.scaling is not None:
        lines += ["", "## Scaling", ""] + [f"    {x}" for x in res.scaling.lines()]
    lines += ["", "## Warnings", ""] + render(res.warnings, "markdown")
    lines += ["", "## Diagnoses", ""]
    for p in res.points:
        if p.diagnoses:
            lines.append(f"At {p.server_value if res.spec.param else ''} rate {p.rate:g} "
                         f"concurrency {p.concurrency}:")
            lines += render(p.diagnoses, "markdown")
    return "\n".join(lines) + "\n"


def plot_sweep(res: Any, folder: Path) -> list[Path]:
    """One PNG per figure against the swept variable, one line per server value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from autotune.analysis.sweep import _numeric_x, _series
    from autotune.report.plots import legend

    x = res.spec.x_name
    written: list[Path] = []
    series = _series(res)
    for key, label in PLOTTED:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for name, pts in series.items():
            numeric = _numeric_x(pts, x)
            xs = [p.x(x) for p in pts] if numeric else list(range(len(pts)))
            ys = [p.fig(key) for p in pts]
            if key == "p99_e2e_s":
                lo = [max(y - p.fig("p99_e2e_lo_s"), 0) if math.isfinite(p.fig("p99_e2e_lo_s"))
                      else 0 for p, y in zip(pts, ys, strict=True)]
                hi = [p.fig("p99_e2e_hi_s") - y if math.isfinite(p.fig("p99_e2e_hi_s"))
                      else 0 for p, y in zip(pts, ys, strict=True)]
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3,
                            label=None if name == "all" else name)
            else:
                ax.plot(xs, ys, marker="o", label=None if name == "all" else name)
            if not numeric:
                ax.set_xticks(xs, [str(p.server_value) for p in pts])
        for kname, knee in res.knees.items():
            if knee.x is not None and key in ("output_throughput", "p99_e2e_s"):
                ax.axvline(knee.x, linestyle="--", color="grey", linewidth=1)
                ax.annotate(f"knee {kname if kname != 'all' else ''} {knee.x:g}",
                            (knee.x, ax.get_ylim()[1]), fontsize=8, va="top")
        ax.set_xlabel(x)
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs {x} ({'simulated' if res.simulated else 'measured'})",
                     fontsize=10)
        if len(series) > 1:
            legend(ax, fontsize=8)
        ax.grid(alpha=0.3)
        path = folder / f"sweep-{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _save(res: Any, folder: Path, *, no_plot: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "sweep.csv", res.to_csv())
    write_json(folder / "sweep.json", res.to_dict())
    atomic_write(folder / "sweep.md", markdown_of(res))
    files = ["sweep.csv", "sweep.json", "sweep.md"]
    if not no_plot:
        files += [p.name for p in plot_sweep(res, folder)]
    console.print(f"wrote {folder}/: {', '.join(files)}", soft_wrap=True)
