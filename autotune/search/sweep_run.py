"""A sweep as a library call: ``run_sweep_command(SweepOptions(...))``.

``autotune sweep`` parses its options into one :class:`SweepOptions` and calls
:func:`run_sweep_command` once: it builds the backend and the workload, runs every
point (:func:`autotune.analysis.sweep.run_sweep`: one variable changed, everything else
fixed, the seed's method), prints the case-study table, the knee, the scaling and the
diagnoses, and writes CSV, JSON, Markdown and one PNG per figure.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from autotune.analysis.diagnose import render, workload_settings
from autotune.analysis.sweep import SweepSpec, _numeric_x, _series, run_sweep
from autotune.backends.base import Backend, LoadPlan
from autotune.backends.factory import BackendSpec, create_backend
from autotune.client.loadgen import check_server
from autotune.core.files import atomic_write, write_json
from autotune.core.metrics import MEASURED, SIMULATED
from autotune.core.slo import SLO
from autotune.core.terminal import console, err_console
from autotune.report.plots import legend, pyplot
from autotune.tuning.options import (
    DEFAULT_CONTEXT,
    OptionsError,
    ServerOptions,
    SimProfile,
    WorkloadOptions,
    at_least,
    check_backend,
)
from autotune.tuning.verdict import SteadyState
from autotune.workload.sources import Workload, build_workload
from autotune.workload.tokenizer import load_tokenizer

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
    """One sweep, every value parsed: what is swept, where it runs, the workload, each
    point's load test, the knee's thresholds and the output folder."""

    spec: SweepSpec
    slo: SLO
    backend: str = "sim"  # sim, vllm or attach
    profile: SimProfile | None = None  # the simulator's node (backend sim)
    server: ServerOptions = field(default_factory=ServerOptions)
    gpus: int | None = None  # the node's GPUs (a real server's, for the scaling figures)
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    dataset: str = "sharegpt"  # or synthetic
    input_len: int = 256
    output_len: int = 128
    length_spread: float = 0.5
    length_distribution: str = "lognormal"
    arrival: str = "poisson"  # poisson, gamma or constant
    steady: SteadyState | None = None  # None: fixed-count points, as vllm bench serve
    knee_gain: float = 0.10
    knee_rise: float = 0.50
    out: Path = Path("studies/sweep")
    no_plot: bool = False

    def __post_init__(self) -> None:
        at_least("--input-len", self.input_len, 1)
        at_least("--output-len", self.output_len, 1)
        at_least("--gpus", self.gpus, 1)
        if not 0 < self.knee_gain < 10 or not 0 < self.knee_rise < 100:
            raise OptionsError("--knee-gain and --knee-rise are shares above 0, e.g. 0.10 "
                               "and 0.50")
        if self.dataset not in ("sharegpt", "synthetic"):
            raise OptionsError(f"unknown --dataset {self.dataset!r}; use sharegpt or "
                               "synthetic")
        if self.arrival not in ("poisson", "gamma", "constant"):
            raise OptionsError(f"unknown --arrival {self.arrival!r}; use poisson, gamma or "
                               "constant")
        self._check_backend()

    def _check_backend(self) -> None:
        check_backend(self.backend, self.server.url)
        if self.backend == "attach" and self.spec.param is not None:
            raise OptionsError(f"--param {self.spec.param} is a server-side setting and an "
                               "attached server cannot be restarted: sweep --rate or "
                               "--concurrency only, or use --backend sim or vllm")
        if self.backend == "attach" and self.spec.base_flags:
            raise OptionsError("--set changes server flags, which an attached server cannot "
                               "take")
        if self.backend == "vllm" and not self.server.model:
            raise OptionsError("--backend vllm needs --model (a path or a model name)")
        if self.backend == "sim" and self.profile is None:
            raise OptionsError("--backend sim needs a simulator profile")


def run_sweep_command(o: SweepOptions) -> int:
    """Run every point, print and save; 0, or 1 when no point could be measured."""
    _check_profile(o.profile)
    _check_folder(o.out)
    wl = _workload(o, _context(o))
    plan = _plan(o, wl)
    backend = _backend(o)
    settings = {"gpus": o.profile.gpus if o.profile else o.gpus,
                **workload_settings([r.prompt_tokens for r in wl.requests], wl.source)}
    _print_header(o, wl, plan)

    def progress(p: Any) -> None:
        spec = o.spec
        err_console.print(f"[dim]point {spec.param or ''}{'=' if spec.param else ''}"
                          f"{'' if p.server_value is None else p.server_value} rate "
                          f"{p.rate:g} conc {p.concurrency}: {p.result.status}[/]")

    try:
        res = run_sweep(o.spec, backend, plan, settings=settings, on_point=progress,
                        knee_gain=o.knee_gain, knee_rise=o.knee_rise)
    finally:
        backend.close()
    _print(res, o.slo)
    _save(res, o.out, no_plot=o.no_plot)
    if all(p.summary is None for p in res.points):
        first = res.points[0].result
        err_console.print(f"[bold red]error:[/] no point could be measured; first failure: "
                          f"{first.reason}: {escape(str(first.detail))[:300]}", soft_wrap=True)
        return 1
    return 0


def _print_header(o: SweepOptions, wl: Workload, plan: LoadPlan) -> None:
    """Say what is swept, where, and how each point is measured, before the first."""
    slo, sim = o.slo, o.profile
    label = SIMULATED if o.backend == "sim" else MEASURED
    each = (f"{len(plan.requests)} measured + {plan.warmup} warm-up requests per point"
            if plan.steady is None else
            f"{plan.warmup} warm-up requests, then at least {plan.steady.min_s(slo):g} s of "
            f"arrivals per point (up to {plan.steady.max_s(slo):g} s), each judged on "
            "steady-state evidence")
    console.print(f"sweep: {escape(o.spec.describe())}; backend {o.backend}"
                  + (f" ({sim.node}, {sim.model})" if sim else "")
                  + f"; {label}; SLO {slo}; workload {escape(wl.source)}, {each}",
                  soft_wrap=True)


# ----------------------------------------------------------------------------- build


def _check_profile(profile: SimProfile | None) -> None:
    if profile is not None:
        profile.load("simulator profile")


def _check_folder(folder: Path) -> None:
    """Refuse an output folder that is a file or cannot be written, before any work."""
    if folder.exists() and not folder.is_dir():
        raise OptionsError(f"--out {folder} is a file; give a folder")
    probe = folder.resolve().parent
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise OptionsError(f"--out {folder}: {probe} is not writable")


def _context(o: SweepOptions) -> int:
    """The ShareGPT length limit: --max-model-len, else the swept config's, else what an
    attached server reports, else the default."""
    if o.workload.max_model_len:
        return int(o.workload.max_model_len)
    if o.spec.base_flags.get("max_model_len"):
        return int(o.spec.base_flags["max_model_len"])
    if o.backend == "attach" and o.server.url:
        reported = check_server(o.server.url).max_model_len
        if reported:
            return int(reported)
    return DEFAULT_CONTEXT


def _workload(o: SweepOptions, context: int) -> Workload:
    w = o.workload
    wl = build_workload(o.dataset, tokenizer=load_tokenizer(w.tokenizer),
                        num_prompts=w.num_prompts + w.warmup, seed=w.seed,
                        max_model_len=context,
                        output_len=o.output_len if o.dataset == "synthetic" else None,
                        input_len=o.input_len, distribution=o.length_distribution,
                        input_spread=o.length_spread, output_spread=o.length_spread)
    if len(wl.requests) <= w.warmup:
        raise OptionsError(f"only {len(wl.requests)} usable requests in {wl.source}: not "
                           f"enough for {w.warmup} warm-up plus measured ones; lower --warmup")
    return wl


def _plan(o: SweepOptions, wl: Workload) -> LoadPlan:
    """Each point is the steady-state load test of search and ceiling (sized by time,
    judged pass / fail / inconclusive), unless ``--min-duration count`` asks for
    fixed-count points."""
    reqs, n = list(wl.requests), o.workload.warmup
    return LoadPlan(slo=o.slo, requests=reqs[n:], warmup_requests=reqs[:n], warmup=n,
                    seed=o.workload.seed, process=o.arrival, window_s=1.0, steady=o.steady)


def _backend(o: SweepOptions) -> Backend:
    if o.profile is not None:
        return create_backend(BackendSpec(kind="sim", hardware=o.profile.node,
                                          sim_model=o.profile.model))
    s = o.server
    return create_backend(BackendSpec(
        kind=o.backend, url=s.url if o.backend == "attach" else None, model=s.model,
        vllm_cmd=s.vllm_cmd, env=dict(s.env), log_dir=o.out / "logs", gpus=o.gpus,
        nvml=False))


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
    plt = pyplot()  # matplotlib loads here, only when plots are drawn


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
