"""The knee of a sweep: where more load stops buying throughput and starts buying latency.

Pure.  Over points ordered by the swept variable (rate, concurrency, ``max_num_seqs``
...), the knee is the last point before the first step on which tokens/s gains less
than ``max_gain`` (default 10%) while P99 latency rises more than ``min_rise``
(default 50%).  The seed's case: 10 -> 20 -> 30 req/s gave 7,200 -> 8,900 -> 9,100
tok/s and P99 3.1 -> 5.8 -> 12.4 s; the 20 -> 30 step gains 2.2% for +114% P99, so
the knee is at 20 req/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.core.errors import AutotuneError

DEFAULT_MAX_GAIN = 0.10
DEFAULT_MIN_RISE = 0.50


class KneeError(AutotuneError, ValueError):
    """The sweep cannot be read for a knee (lengths differ, x not ascending)."""


@dataclass(frozen=True)
class Step:
    """One step between neighbouring points: relative changes of tokens/s and P99."""

    x_from: float
    x_to: float
    tokens_from: float
    tokens_to: float
    p99_from: float
    p99_to: float
    tokens_gain: float  # tokens_to / tokens_from - 1 (inf when from is 0)
    p99_rise: float  # p99_to / p99_from - 1 (inf when the new P99 is inf)
    knee: bool


@dataclass(frozen=True)
class Knee:
    """``x`` is the knee (None when there is none); ``why`` always says how it was read."""

    x: float | None
    why: str
    next_x: float | None = None
    tokens_gain: float | None = None
    p99_rise: float | None = None
    max_gain: float = DEFAULT_MAX_GAIN
    min_rise: float = DEFAULT_MIN_RISE
    steps: tuple[Step, ...] = field(default=())

    @property
    def found(self) -> bool:
        return self.x is not None

    def to_dict(self) -> dict[str, Any]:
        def fin(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        data = asdict(self)
        data["steps"] = [{k: fin(v) for k, v in s.items()} for s in data["steps"]]
        return {k: fin(v) if not isinstance(v, list) else v for k, v in data.items()}


def _rel(new: float, old: float) -> float:
    if math.isnan(new) or math.isnan(old):
        return math.nan
    if math.isinf(new) and not math.isinf(old):
        return math.inf
    if old <= 0:
        return math.inf if new > 0 else 0.0
    return new / old - 1.0


def _fmt_x(x: float) -> str:
    return f"{x:g}"


def _fmt_s(v: float) -> str:
    return "inf (failures)" if math.isinf(v) else f"{v:.3g} s"


def find_knee(
    xs: Sequence[float],
    tokens_per_s: Sequence[float],
    p99_s: Sequence[float],
    *,
    max_gain: float = DEFAULT_MAX_GAIN,
    min_rise: float = DEFAULT_MIN_RISE,
    x_label: str = "x",
) -> Knee:
    """The knee of one sweep (x ascending), with the step that shows it.

    A P99 of ``inf`` (a percentile reaching into failed requests) counts as an infinite
    rise; a point with NaN figures (nothing completed) ends the reading there.
    """
    if not (len(xs) == len(tokens_per_s) == len(p99_s)):
        raise KneeError(f"sweep columns differ in length: {len(xs)} x, "
                        f"{len(tokens_per_s)} tokens/s, {len(p99_s)} P99")
    if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
        raise KneeError(f"{x_label} values must be strictly ascending, got {list(xs)}")
    if len(xs) < 2:
        return Knee(None, f"one point only: a knee needs at least two {x_label} values",
                    max_gain=max_gain, min_rise=min_rise)
    steps: list[Step] = []
    dips: list[str] = []
    for i in range(len(xs) - 1):
        t0, t1, p0, p1 = (float(tokens_per_s[i]), float(tokens_per_s[i + 1]),
                          float(p99_s[i]), float(p99_s[i + 1]))
        if any(math.isnan(v) for v in (t0, t1, p0, p1)):
            bad = xs[i + 1] if math.isnan(t1) or math.isnan(p1) else xs[i]
            why = (f"no figures at {x_label}={_fmt_x(bad)} (nothing completed): the sweep "
                   "cannot be read past it")
            return Knee(None, why, max_gain=max_gain, min_rise=min_rise, steps=tuple(steps))
        gain, rise = _rel(t1, t0), _rel(p1, p0)
        # "After which" tokens/s gains little: a dip that a later point climbs out of is
        # noise or a regime change, not a knee.
        later = [float(t) for t in tokens_per_s[i + 1:] if not math.isnan(float(t))]
        recovered = bool(later) and max(later) >= t0 * (1.0 + max_gain)
        is_knee = gain < max_gain and rise > min_rise and not recovered
        step = Step(float(xs[i]), float(xs[i + 1]), t0, t1, p0, p1, gain, rise, is_knee)
        steps.append(step)
        if gain < max_gain and rise > min_rise and recovered:
            dips.append(f"{_fmt_x(xs[i])} -> {_fmt_x(xs[i + 1])} ({gain:+.0%} tokens/s) "
                        f"recovered later (up to {max(later):,.0f} tok/s)")
        if is_knee:
            why = (f"knee at {x_label}={_fmt_x(xs[i])}: going to {_fmt_x(xs[i + 1])} gains "
                   f"{gain:+.1%} tokens/s ({t0:,.0f} -> {t1:,.0f}, under +{max_gain:.0%}) "
                   f"while P99 rises {'inf' if math.isinf(rise) else f'{rise:+.0%}'} "
                   f"({_fmt_s(p0)} -> {_fmt_s(p1)}, over +{min_rise:.0%})")
            return Knee(float(xs[i]), why, float(xs[i + 1]), gain, rise, max_gain, min_rise,
                        tuple(steps))
    last = steps[-1]
    why = (f"no knee over {x_label} {_fmt_x(xs[0])}..{_fmt_x(xs[-1])}: no step gained under "
           f"+{max_gain:.0%} tokens/s while P99 rose over +{min_rise:.0%} (last step "
           f"{last.tokens_gain:+.1%} tokens/s, P99 "
           f"{'inf' if math.isinf(last.p99_rise) else f'{last.p99_rise:+.0%}'}); "
           "extend the sweep upward to find it")
    if dips:
        why += "; not a knee, since throughput climbed again: " + "; ".join(dips)
    return Knee(None, why, max_gain=max_gain, min_rise=min_rise, steps=tuple(steps))
