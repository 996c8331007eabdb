"""The report's figures (matplotlib, headless Agg): pure rows in, one PNG out.

Every figure carries its provenance in a footer line (measured or simulated, the
backend, the hardware, how many load tests) so a PNG copied out of the report still
says where its numbers came from.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from autotune.analysis.pareto import front
from autotune.core.slo import parse_slo
from autotune.report.data import config_label, varying_keys

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_CONFIGS = 6  # more curves than this on one plot is unreadable
REASON_MARKERS = ("v", "^", "s", "D", "P", "X", "<", ">")


@functools.cache
def pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend, loaded by the first plot: every
    command imports the report package, and only the ones that draw need matplotlib
    (about 0.4 s to import)."""
    import matplotlib  # heavy: see the docstring

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display is needed

    return plt


def _color(i: int) -> Any:
    """The i-th colour of matplotlib's tab10 cycle."""
    import matplotlib  # loaded already by pyplot(), which every plot calls first

    colors = matplotlib.color_sequences["tab10"]
    return colors[i % len(colors)]


def _save(fig: Figure, path: Path, provenance: str) -> Path:
    fig.text(0.01, 0.005, provenance, fontsize=7, color="#555555", ha="left", va="bottom",
             wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    # "tight" grows the canvas to hold the legends, which sit outside the axes.
    fig.savefig(path, dpi=110, format="png", bbox_inches="tight")
    pyplot().close(fig)
    return path


def legend(ax: Any, *, fontsize: int = 7) -> Any:
    """The axes' legend to the right of its plot area, so that it never hides a point;
    None when nothing plotted has a label (a plot of no trial, or of failed ones)."""
    if not ax.get_legend_handles_labels()[0]:
        return None
    return ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                     borderaxespad=0.0)


def _ok(x: Any) -> TypeGuard[float]:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def slo_line(slo_text: str | None) -> tuple[str, float | None, str]:
    """(row key of the plotted p99, SLO threshold in s or None, axis label)."""
    if slo_text:
        try:
            slo = parse_slo(slo_text)
        except ValueError:
            slo = None
        if slo is not None:
            limits = sorted(slo.limits, key=lambda lim: lim.metric != "e2e")
            for lim in limits:
                if lim.metric in ("e2e", "ttft", "tpot") and lim.percentile == 99:
                    return (f"{lim.metric}_p99_s", lim.threshold_s,
                            f"P99 {lim.metric.upper()} (s)")
    return "e2e_p99_s", None, "P99 E2E latency (s)"


# ----------------------------------------------------------------------------- 1


def rate_curves(
    rows: Sequence[Mapping[str, Any]],
    path: Path,
    *,
    slo: str | None,
    provenance: str,
    ceilings: Mapping[str, float] | None = None,
    imported: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Goodput (top) and P99 (bottom) against the offered rate, one line per config.

    ``ceilings``: config_key -> highest rate that met the SLO (the ceiling search's
    ``feasible_max`` where there is one).  Imported vLLM results are drawn as crosses.
    """
    key, threshold, ylabel = slo_line(slo)
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if _ok(r.get("rate")) and (_ok(r.get("output_throughput")) or _ok(r.get(key))):
            groups.setdefault(r["config_key"], []).append(r)

    def best(g: list[Mapping[str, Any]]) -> float:
        return max((r.get("goodput_tokens") or 0.0) for r in g if r.get("feasible")) \
            if any(r.get("feasible") for r in g) else -1.0

    # The configs with the most points first, then the best: curves need points.
    chosen = sorted(groups, key=lambda k: (-min(len(groups[k]), 3), -best(groups[k])))
    chosen = chosen[:MAX_CONFIGS]
    keys = varying_keys([r for k in chosen for r in groups[k]])
    fig, (top, bottom) = pyplot().subplots(2, 1, figsize=(8.5, 7.0), sharex=True)
    for i, k in enumerate(chosen):
        g = sorted(groups[k], key=lambda r: r["rate"])
        color = _color(i)
        label = config_label(g[0].get("config") or {}, keys)
        xs = [r["rate"] for r in g]
        good = [r.get("goodput_tokens") if r.get("feasible") else 0.0 for r in g]
        out = [r.get("output_throughput") for r in g]
        top.plot(xs, [v if _ok(v) else math.nan for v in out], "--", color=color, alpha=0.5,
                 lw=1)
        top.plot(xs, [v if _ok(v) else math.nan for v in good], "o-", color=color,
                 label=label)
        p99 = [r.get(key) for r in g]
        bottom.plot(xs, [v if _ok(v) else math.nan for v in p99], "o-", color=color)
        for r in g:
            if r.get("pruned") and _ok(r.get(key)):
                bottom.plot([r["rate"]], [r[key]], "v", color=color, ms=9, mfc="none")
        c = (ceilings or {}).get(k)
        if _ok(c):
            for ax in (top, bottom):
                ax.axvline(c, color=color, ls=":", lw=1.2)
            top.annotate(f"ceiling {c:.3g}", (c, 0), xytext=(3, 4),
                         textcoords="offset points", color=color, fontsize=7, rotation=90)
    for j, r in enumerate(imported):
        if not _ok(r.get("rate")):
            continue
        lbl = "vllm bench serve (imported)" if j == 0 else None
        if _ok(r.get("output_throughput")):
            top.plot([r["rate"]], [r["output_throughput"]], "kx", ms=8, label=lbl)
        if _ok(r.get(key)):
            bottom.plot([r["rate"]], [r[key]], "kx", ms=8)
    if threshold is not None:
        bottom.axhline(threshold, color="red", lw=1.5, label=f"SLO {threshold:g} s")
        legend(bottom, fontsize=8)
    top.set_ylabel("goodput (output tok/s)\n(dashed: all output tok/s)")
    top.set_title("Goodput and P99 against the offered rate (the knee is the ceiling)")
    bottom.set_ylabel(ylabel)
    bottom.set_xlabel("offered rate (req/s, open loop)")
    if any(groups.values()) or imported:
        legend(top)
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    if len(groups) > MAX_CONFIGS:
        top.text(0.99, 0.02, f"{MAX_CONFIGS} of {len(groups)} configs shown", ha="right",
                 transform=top.transAxes, fontsize=7)
    return _save(fig, path, provenance)


# ----------------------------------------------------------------------------- 2


def history(rows: Sequence[Mapping[str, Any]], path: Path, *, provenance: str,
            value_label: str = "goodput (output tok/s)") -> Path:
    """Each trial's goodput, the best feasible so far, and why the others failed."""
    fig, ax = pyplot().subplots(figsize=(8.5, 4.5))
    feasible = [r for r in rows if r.get("feasible")]
    ax.plot([r["trial"] for r in feasible], [r.get("value") or 0 for r in feasible], "o",
            color="tab:green", label="met the SLO")
    reasons: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if not r.get("feasible"):
            reasons.setdefault(str(r.get("reason") or r.get("status") or "?"), []).append(r)
    for i, (reason, rs) in enumerate(sorted(reasons.items())):
        ys = [y if _ok(y := r.get("output_throughput")) else 0.0 for r in rs]
        ax.plot([r["trial"] for r in rs], ys, REASON_MARKERS[i % len(REASON_MARKERS)],
                color=_color(i + 3), mfc="none",
                label=f"infeasible: {reason} ({len(rs)})")
    best, xs, ys = -math.inf, [], []
    for r in sorted(rows, key=lambda r: r["trial"]):
        if r.get("feasible") and _ok(r.get("value")):
            best = max(best, r["value"])
        if best > -math.inf:
            xs.append(r["trial"])
            ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="black", lw=1.5, label="best feasible so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(value_label + "\n(infeasible: all output tok/s)")
    ax.set_title("Optimisation history")
    ax.grid(alpha=0.3)
    legend(ax)
    return _save(fig, path, provenance)


# ----------------------------------------------------------------------------- 3


def importances(values: Mapping[str, float], path: Path, *, provenance: str,
                evaluator: str) -> Path:
    fig, ax = pyplot().subplots(figsize=(7.5, 0.5 * max(len(values), 2) + 1.5))
    items = sorted(values.items(), key=lambda kv: kv[1])
    ax.barh([k for k, _ in items], [v for _, v in items], color="tab:blue")
    for y, (_, v) in enumerate(items):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    ax.set_xlabel("importance (normalised to sum 1)")
    ax.set_title(f"Parameter importances ({evaluator})")
    ax.set_xlim(0, max([v for _, v in items] + [0.1]) * 1.2)
    return _save(fig, path, provenance)


# ----------------------------------------------------------------------------- 4


def _per_gpu(r: Mapping[str, Any], key: str) -> float:
    return float(r.get(key) or 0.0) / max(int(r.get("gpus") or 1), 1)


def _tokens_per_user(r: Mapping[str, Any]) -> float | None:
    tpot = r.get("tpot_p50_s")
    return 1.0 / tpot if _ok(tpot) and tpot > 0 else None


def _front_panel(ax: Any, feas: Sequence[tuple[float, float, Mapping[str, Any]]], *,
                 lower_x: bool) -> None:
    """The feasible points, their front and each front point's trial and rate."""
    ax.plot([x for x, _, _ in feas], [g for _, g, _ in feas], "o", color="tab:green",
            label="met the SLO")
    edge = front([(x, g) for x, g, _ in feas], lower_x=lower_x)
    ax.step([x for x, _ in edge], [g for _, g in edge], where="post" if lower_x else "pre",
            color="tab:green", lw=2, label="Pareto front")
    by_point = {(x, g): r for x, g, r in feas}
    for x, g in edge:
        r = by_point.get((x, g))
        if r is not None:
            rate = r.get("rate")
            at = f" @{rate:.3g}/s" if _ok(rate) else ""
            ax.annotate(f"#{r['trial']}{at}", (x, g), xytext=(4, 4), fontsize=7,
                        textcoords="offset points")


def pareto(rows: Sequence[Mapping[str, Any]], path: Path, *, slo: str | None,
           provenance: str) -> Path:
    """Goodput per GPU against P99 latency, and against output tok/s per user (1 /
    median TPOT), each with its front and the rate each front point passed at."""
    key, threshold, ylabel = slo_line(slo)
    fig, (ax, ax_user) = pyplot().subplots(1, 2, figsize=(13.0, 5.0))
    feas = [(r[key], _per_gpu(r, "goodput_tokens"), r)
            for r in rows if r.get("feasible") and _ok(r.get(key))]
    infeas = [(r[key], _per_gpu(r, "output_throughput"))
              for r in rows if not r.get("feasible") and _ok(r.get(key))
              and _ok(r.get("output_throughput"))]
    if infeas:
        ax.plot([p for p, _ in infeas], [g for _, g in infeas], "x", color="grey",
                label="missed the SLO (all output tok/s)")
    if feas:
        _front_panel(ax, feas, lower_x=True)
    if threshold is not None:
        ax.axvline(threshold, color="red", lw=1.5, label=f"SLO {threshold:g} s")
    ax.set_xlabel(ylabel.replace(" (s)", "") + " (s)")
    ax.set_ylabel("goodput per GPU (output tok/s/GPU)")
    ax.set_title("Goodput per GPU against P99 latency")
    ax.grid(alpha=0.3)
    legend(ax)
    per_user = [(u, g, r) for _, g, r in feas if (u := _tokens_per_user(r)) is not None]
    if per_user:
        _front_panel(ax_user, per_user, lower_x=False)
    ax_user.set_xlabel("output tok/s per user (1 / median TPOT)")
    ax_user.set_ylabel("goodput per GPU (output tok/s/GPU)")
    ax_user.set_title("Goodput per GPU against tokens per user")
    ax_user.grid(alpha=0.3)
    legend(ax_user)
    return _save(fig, path, provenance)


# ----------------------------------------------------------------------------- 5


def timeline(series: Mapping[str, Sequence[tuple[float, float]]], path: Path, *,
             provenance: str, title: str) -> Path:
    """GPU utilisation and KV-cache usage (%) on top, requests in flight below."""
    pct = [k for k in ("gpu_util_pct", "kv_cache_usage_pct") if series.get(k)]
    counts = [k for k in ("in_flight", "running", "waiting") if series.get(k)]
    n = (1 if pct else 0) + (1 if counts else 0)
    fig, axes = pyplot().subplots(max(n, 1), 1, figsize=(8.5, 2.6 * max(n, 1) + 0.6),
                             sharex=True, squeeze=False)
    i = 0
    names = {"gpu_util_pct": "GPU utilisation", "kv_cache_usage_pct": "KV-cache usage",
             "in_flight": "requests in flight (client)", "running": "running (vLLM)",
             "waiting": "waiting (vLLM)"}
    for group, ylabel in ((pct, "%"), (counts, "requests")):
        if not group:
            continue
        ax = axes[i][0]
        for k in group:
            ax.plot([t for t, _ in series[k]], [v for _, v in series[k]], label=names[k])
        if group is pct:
            ax.set_ylim(0, 105)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        legend(ax)
        i += 1
    axes[-1][0].set_xlabel("time since the first sample of each series (s)")
    axes[0][0].set_title(title)
    return _save(fig, path, provenance)


# ----------------------------------------------------------------------------- traffic


def traffic(ours: Mapping[str, Sequence[int]], sharegpt: Mapping[str, Sequence[int]],
            path: Path, *, title: str, provenance: str) -> Path:
    """Prompt and output length histograms of a workload, ShareGPT's outlined beside
    them (``ours``/``sharegpt``: "prompt_tokens" and "output_tokens" lists)."""
    fig, axes = pyplot().subplots(1, 2, figsize=(10.0, 4.0))
    for ax, key, name in zip(axes, ("prompt_tokens", "output_tokens"),
                             ("prompt tokens", "output tokens"), strict=True):
        mine, theirs = list(ours.get(key, ())), list(sharegpt.get(key, ()))
        top = max([*mine, *theirs, 1])
        bins = [0.0, *[top * (i + 1) / 40 for i in range(40)]]
        if mine:
            ax.hist(mine, bins=bins, density=True, alpha=0.6, color="tab:blue",
                    label=f"this workload ({len(mine):,})")
        if theirs:
            ax.hist(theirs, bins=bins, density=True, histtype="step", lw=1.5,
                    color="tab:orange", label=f"ShareGPT ({len(theirs):,})")
        ax.set_xlabel(name)
        ax.set_ylabel("share of requests (density)")
        ax.grid(alpha=0.3)
        legend(ax)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path, provenance)
