"""Latency SLOs: parsing (``10s``, ``p99:ttft<=2s``), checking, margins.

A limit ``pXX:metric<=T`` holds when the XX-th percentile of ``metric`` over all
measured requests is at most ``T``.  Failed requests count as infinitely late: a
request that never completed did not meet any latency limit, so more than 1% failures
fails a p99 limit whatever the successful requests did.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autotune.core.errors import AutotuneError

METRICS: tuple[str, ...] = ("e2e", "ttft", "tpot", "itl")
ACCEPTED_FORMS = (
    "accepted forms: a duration for p99 end-to-end latency ('10s', '500ms', '1.5m'), "
    "or limits 'pNN:METRIC<=DURATION' joined with commas, METRIC one of "
    f"{', '.join(METRICS)} (e.g. 'p99:e2e<=10s,p90:ttft<=2s,p99:tpot<=80ms')"
)
# A margin is finite even when a limit is missed by failures, so Optuna can rank it.
MAX_MARGIN = 1e3

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|min|m|h)\s*$")
_LIMIT = re.compile(r"^\s*p(\d+(?:\.\d+)?)\s*:\s*([a-z0-9_]+)\s*<=\s*(.+?)\s*$")


class SLOError(AutotuneError, ValueError):
    """An SLO string could not be parsed or holds an impossible limit."""


def parse_duration(text: str) -> float:
    """``'10s'`` -> 10.0, ``'500ms'`` -> 0.5, ``'1.5m'`` -> 90.0, ``'2h'`` -> 7200.0."""
    m = _DURATION.match(text)
    if not m:
        raise SLOError(f"cannot read duration {text!r}: give a number with a unit ms, s, m or h")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if not value > 0:
        raise SLOError(f"duration {text!r} must be greater than 0")
    return value


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class Limit:
    metric: str
    percentile: float
    threshold_s: float

    @property
    def label(self) -> str:
        return f"p{self.percentile:g}:{self.metric}"

    def __str__(self) -> str:
        return f"{self.label}<={format_duration(self.threshold_s)}"


@dataclass(frozen=True)
class SLO:
    limits: tuple[Limit, ...]

    def __str__(self) -> str:
        return ",".join(str(limit) for limit in self.limits)

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(limit.metric for limit in self.limits)


def _parse_limit(part: str) -> Limit:
    m = _LIMIT.match(part)
    if not m:
        raise SLOError(f"cannot read SLO limit {part!r}; {ACCEPTED_FORMS}")
    percentile, metric, duration = float(m.group(1)), m.group(2), m.group(3)
    if metric not in METRICS:
        raise SLOError(f"unknown SLO metric {metric!r} in {part!r}; {ACCEPTED_FORMS}")
    if not 0 < percentile < 100:
        raise SLOError(f"percentile p{percentile:g} in {part!r} must be between 0 and 100")
    try:
        threshold = parse_duration(duration)
    except SLOError as exc:
        raise SLOError(f"{exc} (in SLO limit {part!r})") from None
    return Limit(metric=metric, percentile=percentile, threshold_s=threshold)


def parse_slo(text: str) -> SLO:
    """Parse ``'10s'`` (p99 end-to-end) or ``'p99:e2e<=10s,p90:ttft<=2s'``."""
    if not isinstance(text, str) or not text.strip():
        raise SLOError(f"empty SLO; {ACCEPTED_FORMS}")
    parts = [p for p in text.split(",")]
    if any(not p.strip() for p in parts):
        raise SLOError(f"empty limit in SLO {text!r}; {ACCEPTED_FORMS}")
    limits: list[Limit] = []
    for part in parts:
        if ":" in part or "<=" in part:
            limit = _parse_limit(part)
        elif _DURATION.match(part):
            limit = Limit(metric="e2e", percentile=99.0, threshold_s=parse_duration(part))
        else:
            raise SLOError(f"cannot read SLO {part.strip()!r}; {ACCEPTED_FORMS}")
        if any(x.label == limit.label for x in limits):
            raise SLOError(f"SLO {text!r} gives {limit.label} twice")
        limits.append(limit)
    return SLO(limits=tuple(limits))


def combine(slo_p99: str | None, slo: str | None) -> SLO:
    """The CLI's ``--slo-p99 10s`` and ``--slo 'p90:ttft<=2s'`` as one SLO."""
    parts = [p for p in (slo_p99, slo) if p]
    if not parts:
        raise SLOError(f"no SLO given: pass --slo-p99 10s or --slo LIMITS; {ACCEPTED_FORMS}")
    return parse_slo(",".join(parts))


def quantile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """Linear-interpolated percentile like ``numpy.percentile`` (vLLM's definition),
    where ``inf`` stands for a failed request: a quantile that reaches into the
    failures is ``inf`` instead of numpy's ``nan``."""
    x = np.sort(np.asarray(values, dtype=float))
    if x.size == 0:
        return math.nan
    pos = (x.size - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, x.size - 1)
    frac = pos - lo
    if frac == 0 or x[lo] == x[hi]:
        return float(x[lo])
    if math.isinf(x[hi]):
        return math.inf
    return float(x[lo] + (x[hi] - x[lo]) * frac)


@dataclass(frozen=True)
class SLOCheck:
    met: bool
    # Per limit label: observed / threshold - 1 (negative = met), capped at MAX_MARGIN.
    margins: dict[str, float]
    observed_s: dict[str, float]
    # The limit with the largest margin: the one that fails first as load rises.
    binding: str | None
    failed: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, object]:
        return {
            "met": self.met,
            "margins": self.margins,
            "observed_s": {k: (None if math.isinf(v) or math.isnan(v) else v)
                           for k, v in self.observed_s.items()},
            "binding": self.binding,
            "failed": list(self.failed),
        }


def margin(observed: float, threshold: float) -> float:
    if math.isnan(observed):
        return MAX_MARGIN
    return min(observed / threshold - 1.0, MAX_MARGIN)


def check_samples(samples: Mapping[str, Sequence[float] | np.ndarray], slo: SLO) -> SLOCheck:
    """Check per-request latencies (``inf`` = failed request) against every limit.

    A metric with no samples at all (nothing completed) misses its limit.
    """
    margins: dict[str, float] = {}
    observed: dict[str, float] = {}
    for limit in slo.limits:
        value = quantile(samples.get(limit.metric, ()), limit.percentile)
        observed[limit.label] = value
        margins[limit.label] = margin(value, limit.threshold_s)
    failed = tuple(k for k, m in margins.items() if not m <= 0)
    binding = max(margins, key=lambda k: margins[k]) if margins else None
    return SLOCheck(met=not failed, margins=margins, observed_s=observed,
                    binding=binding, failed=failed)


def check(summary: object, slo: SLO) -> SLOCheck:
    """Check a :class:`autotune.core.metrics.Summary` against ``slo``."""
    samples = getattr(summary, "samples", None)
    if not samples:
        raise SLOError("this summary carries no per-request samples; re-summarize its records")
    return check_samples(samples, slo)
