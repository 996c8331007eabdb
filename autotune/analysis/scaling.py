"""Scaling analysis for TP and GPU-count sweeps (pure).

Speedup and parallel efficiency against the smallest layout (TP=1 when present), the
seed's communication checks (TP=4 under 3.2x TP=1, i.e. efficiency under 0.8; more
GPUs slower than fewer), and goodput per GPU so that data-parallel replicas of a
small TP can be weighed against one large TP on the same GPU budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.core.errors import AutotuneError

MIN_EFFICIENCY = 0.8  # the seed: TP=4 must reach 3.2x TP=1
ADVICE = (
    "check the link topology between the GPUs (`nvidia-smi topo -m`: NVLink or PCIe/"
    "across sockets), whether `--enforce-eager` is set (no CUDA graphs: every step's "
    "all-reduce costs more), and the communication library (NCCL) version; compare "
    "data-parallel replicas of the smaller TP (goodput per GPU)"
)


class ScalingError(AutotuneError, ValueError):
    """The points cannot be compared (no points, GPU counts not positive)."""


@dataclass(frozen=True)
class ScalePoint:
    """One layout's best figures: ``gpus`` it uses, its throughput, and its goodput
    under the SLO (None when not known, 0 when no rate met the SLO)."""

    label: str  # e.g. "TP=4"
    gpus: int
    tokens_per_s: float
    goodput_tokens: float | None = None
    # False: no load test of this layout reached its capacity (the offered load was
    # served), so its tokens/s is only a lower bound of what it can do.
    saturated: bool = True


@dataclass(frozen=True)
class ScaleRow:
    label: str
    gpus: int
    tokens_per_s: float
    speedup: float
    ideal: float
    efficiency: float
    tokens_per_gpu: float
    goodput_tokens: float | None
    goodput_per_gpu: float | None
    replicas: int  # copies of this layout that fit the GPU budget (data parallel)
    replicas_goodput: float | None  # replicas x goodput: an estimate, see ``Scaling``
    saturated: bool = True


@dataclass(frozen=True)
class ScalingFlag:
    code: str  # "poor_scaling" | "slower_with_more_gpus"
    label: str
    evidence: str
    next_step: str = ADVICE


@dataclass
class Scaling:
    base: str
    budget_gpus: int
    rows: list[ScaleRow]
    flags: list[ScalingFlag] = field(default_factory=list)
    best_layout: str | None = None  # by replicas x goodput on the budget
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        def fin(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, dict):
                return {k: fin(x) for k, x in v.items()}
            if isinstance(v, list):
                return [fin(x) for x in v]
            return v

        return fin(asdict(self))

    def lines(self) -> list[str]:
        """Plain lines: one per layout, then the flags and the DP comparison."""
        out = [f"scaling against {self.base} ({self.note})"]
        if any(r.goodput_per_gpu is not None for r in self.rows):
            # Two denominators, said once: otherwise a goodput above the tok/s of the
            # same layout reads as a contradiction.
            out.append("  tok/s: output tokens over the whole test, drain included (vLLM's "
                       "output_throughput); goodput: output tokens of requests that met "
                       "the SLO per second of arrivals (the trial's steady-state figure)")
        for r in self.rows:
            good = ("" if r.goodput_per_gpu is None else
                    f", goodput {r.goodput_tokens:,.0f} tok/s = {r.goodput_per_gpu:,.0f} per "
                    f"GPU; {r.replicas} replica(s) on {self.budget_gpus} GPUs ~ "
                    f"{r.replicas_goodput:,.0f} tok/s")
            low = "" if r.saturated else " (lower bound: not saturated)"
            out.append(f"  {r.label} on {r.gpus} GPU(s): {r.tokens_per_s:,.0f} tok/s{low}, speedup "
                       f"{r.speedup:.2f}x of ideal {r.ideal:g}x (efficiency "
                       f"{r.efficiency:.0%}){good}")
        for f in self.flags:
            out.append(f"  FLAG {f.code} at {f.label}: {f.evidence}; next: {f.next_step}")
        if self.best_layout is not None:
            out.append(f"  best use of {self.budget_gpus} GPUs by goodput: {self.best_layout}")
        return out


def analyze_scaling(
    points: Sequence[ScalePoint],
    *,
    budget_gpus: int | None = None,
    min_efficiency: float = MIN_EFFICIENCY,
) -> Scaling:
    """Speedup, efficiency and flags against the point with the fewest GPUs."""
    if not points:
        raise ScalingError("no points to compare: run the sweep over at least two layouts")
    for p in points:
        if p.gpus < 1:
            raise ScalingError(f"{p.label}: GPU count must be at least 1, got {p.gpus}")
    pts = sorted(points, key=lambda p: (p.gpus, p.label))
    base = pts[0]
    budget = budget_gpus or max(p.gpus for p in pts)
    rows: list[ScaleRow] = []
    for p in pts:
        speedup = p.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else math.nan
        ideal = p.gpus / base.gpus
        good_gpu = None if p.goodput_tokens is None else p.goodput_tokens / p.gpus
        replicas = budget // p.gpus
        rows.append(ScaleRow(
            label=p.label, gpus=p.gpus, tokens_per_s=p.tokens_per_s, speedup=speedup,
            ideal=ideal, efficiency=speedup / ideal, tokens_per_gpu=p.tokens_per_s / p.gpus,
            goodput_tokens=p.goodput_tokens, goodput_per_gpu=good_gpu, replicas=replicas,
            replicas_goodput=None if p.goodput_tokens is None else replicas * p.goodput_tokens,
            saturated=p.saturated))
    flags: list[ScalingFlag] = []
    unsaturated = [r.label for r in rows if not r.saturated]
    for r in rows[1:]:
        # An unsaturated layout served all it was offered: its speedup is a lower bound.
        if r.ideal > 1 and r.efficiency < min_efficiency and r.saturated and base.saturated:
            flags.append(ScalingFlag(
                "poor_scaling", r.label,
                f"{r.label} gives {r.speedup:.2f}x the tokens/s of {base.label} on "
                f"{r.ideal:g}x the GPUs (under {min_efficiency * r.ideal:.1f}x = "
                f"{min_efficiency:.0%} efficiency; {r.tokens_per_s:,.0f} vs "
                f"{base.tokens_per_s:,.0f} tok/s): communication eats the parallel gain"))
    for i, r in enumerate(rows):
        smaller = [q for q in rows[:i] if q.gpus < r.gpus and q.tokens_per_s > r.tokens_per_s]
        if smaller and r.saturated:
            q = max(smaller, key=lambda q: q.tokens_per_s)
            flags.append(ScalingFlag(
                "slower_with_more_gpus", r.label,
                f"{r.label} ({r.gpus} GPUs) is slower than {q.label} ({q.gpus} GPUs): "
                f"{r.tokens_per_s:,.0f} vs {q.tokens_per_s:,.0f} tok/s, so synchronisation "
                "costs more than the parallelism brings"))
    with_good = [r for r in rows if r.replicas_goodput is not None and r.replicas > 0]
    best = None
    if with_good:
        b = max(with_good, key=lambda r: (r.replicas_goodput, -r.gpus))
        best = (f"{b.replicas} x {b.label} (~{b.replicas_goodput:,.0f} goodput tok/s, "
                f"{b.goodput_per_gpu:,.0f} per GPU)")
    note = (f"best tokens/s of each layout; efficiency = speedup / (GPUs / {base.gpus}); "
            "replica goodput assumes replicas behind a load balancer scale linearly")
    if unsaturated:
        note += (f"; {', '.join(unsaturated)} never saturated (served all it was offered): "
                 "its tokens/s is a lower bound, raise the rate to measure its capacity")
    return Scaling(base=base.label, budget_gpus=budget, rows=rows, flags=flags,
                   best_layout=best, note=note)
