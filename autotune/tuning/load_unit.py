"""What a ceiling search's load levels count: request rate, or users of a closed loop.

``ceiling --by rate`` searches open-loop Poisson arrivals in req/s (a real number);
``--by concurrency`` searches users who send again as soon as their reply ends (the
requests in flight, as GuideLLM and AIPerf report); ``--by users`` searches users who
think between requests (the seed's "200 concurrent dialogues"); ``--by speed`` replays a
logged trace at its own arrival times, sped up or slowed down by a factor.  Users are
whole: the search rounds its levels, and its bracket closes when its ends are one user
apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from autotune.workload.arrivals import ClosedLoop

BY: tuple[str, ...] = ("rate", "concurrency", "users", "speed")


def fmt_rate(r: float) -> str:
    """A rate with the digits it deserves: 0.123, 1.23, 12.3, 123."""
    if math.isinf(r):
        return "inf"
    if r >= 100:
        return f"{r:.0f}"
    if r >= 10:
        return f"{r:.1f}"
    if r >= 1:
        return f"{r:.2f}"
    return f"{r:.3g}"


def cap_word(label: str) -> str:
    """What a gateway caps for levels labelled ``label``: a request rate ("req/s"), or
    the load of users (or requests) in flight."""
    return "rate" if label == "req/s" else "load"


@dataclass(frozen=True, kw_only=True)
class LoadUnit:
    """The unit of one search's levels; ``closed`` is None for a request rate."""

    by: str = "rate"
    closed: ClosedLoop | None = None
    # --by speed: the trace's own mean arrival rate (req/s), which the saturation
    # probe's throughput is divided by for a start (None until the trace is read).
    trace_rps: float | None = None

    def __post_init__(self) -> None:
        if self.by not in BY:
            raise ValueError(f"unknown load unit {self.by!r}; use one of {', '.join(BY)}")
        if (self.by in ("concurrency", "users")) != (self.closed is not None):
            raise ValueError("a closed loop's levels are users (--by users or "
                             "concurrency); a request rate has no closed loop")
        if self.by == "users" and self.closed is not None and self.closed.think_s <= 0:
            raise ValueError("--by users needs a think time (e.g. --think-time 20s); "
                             "without one, use --by concurrency")
        if self.by == "concurrency" and self.closed is not None and self.closed.think_s > 0:
            raise ValueError("--by concurrency keeps requests in flight back to back: drop "
                             "--think-time, or use --by users")

    @classmethod
    def of(cls, by: str, think_s: float | None = None, think: str = "exponential"
           ) -> LoadUnit:
        if by in ("rate", "speed"):
            if think_s:
                raise ValueError("--think-time applies to --by users only")
            return cls(by=by)
        return cls(by=by, closed=ClosedLoop(think_s=think_s or 0.0, think=think))

    def spec(self) -> dict[str, str | float]:
        """What a study stores of its unit, read back by :meth:`from_spec`."""
        closed = self.closed
        return {"by": self.by, "think_s": 0.0 if closed is None else closed.think_s,
                "think": "exponential" if closed is None else closed.think}

    @classmethod
    def from_spec(cls, spec: Mapping[str, object] | None) -> LoadUnit:
        """The unit a study stored (a study from before units searched req/s)."""
        if not spec:
            return RATE
        think_s = float(spec.get("think_s") or 0.0)  # type: ignore[arg-type]
        return cls.of(str(spec.get("by", "rate")), think_s or None,
                      str(spec.get("think", "exponential")))

    @property
    def whole(self) -> bool:
        return self.closed is not None

    @property
    def label(self) -> str:
        if self.by == "speed":
            return "x the trace's speed"
        return "req/s" if self.closed is None else self.closed.unit

    @property
    def noun(self) -> str:
        """What one level is called in a sentence: "rate", "concurrency", "number of
        users", "speed"."""
        return {"users": f"number of {self.label}"}.get(self.by, self.by)

    @property
    def none(self) -> str:
        """No level at all, in a sentence: "no rate", "no concurrency"."""
        return f"no {self.noun}"

    def fmt(self, level: float) -> str:
        """A level with its unit: "12.3 req/s", "64 in flight", "180 users"."""
        if self.by == "speed":
            return f"{fmt_rate(level)}{self.label}"
        if not self.whole or math.isinf(level):
            return f"{fmt_rate(level)} {self.label}"
        return f"{level:.0f} {self.label}"

    def at(self, level: float) -> float:
        """The level a search runs for ``level``: itself, or the nearest whole user."""
        if not self.whole or math.isinf(level):
            return level
        return float(max(1, round(level)))

    def between(self, aim: float, lo: float, hi: float) -> float:
        """A level strictly inside the bracket (lo, hi) near ``aim``."""
        if not self.whole:
            return aim
        return float(min(max(round(aim), lo + 1), hi - 1))

    def up(self, level: float, nxt: float) -> float:
        """The next level above ``level`` near ``nxt``: at least one user more."""
        return nxt if not self.whole else float(max(round(nxt), level + 1))

    def down(self, level: float, nxt: float) -> float:
        """The next level below ``level`` near ``nxt``: at least one user fewer."""
        return nxt if not self.whole else float(max(min(round(nxt), level - 1), 1))

    def closed_bracket(self, lo: float, hi: float, tol: float) -> bool:
        """The bracket is as tight as asked: within ``tol``, or one user apart."""
        return hi / lo - 1.0 <= tol + 1e-12 or (self.whole and hi - lo <= 1.0 + 1e-9)

    def capacity(self, saturated_rps: float) -> float | None:
        """The saturated throughput in this unit's levels (None for users: a closed
        loop's users at capacity depend on their latency)."""
        if self.by == "speed":
            return saturated_rps / (self.trace_rps or saturated_rps)
        return None if self.whole else saturated_rps

    def start(self, saturated_rps: float, service_s: float) -> float:
        """Where a search starts after its saturation probe: 70% of the saturated
        throughput; for users, the users that throughput keeps busy when each request
        takes ``service_s`` plus the think time (Little's law), 70% of it."""
        if self.by == "speed":
            return 0.7 * saturated_rps / (self.trace_rps or saturated_rps)
        if self.closed is None:
            return 0.7 * saturated_rps
        return self.at(0.7 * saturated_rps * (self.closed.think_s + service_s))

    def level_of_rate(self, rate: float, service_s: float) -> float:
        """The level at which requests come at ``rate`` req/s: the rate; the speed of a
        trace whose mean rate that is; the users who send it when each request takes
        ``service_s`` plus the think time (Little's law)."""
        if self.by == "speed":
            return rate / (self.trace_rps or rate)
        if self.closed is None:
            return rate
        return rate * (self.closed.think_s + service_s)

    def cap(self, feasible_max: float, headroom: float) -> float:
        """``headroom`` under the ceiling: whole users rounded down, at least one."""
        cap = feasible_max * (1.0 - headroom)
        return cap if not self.whole else float(max(1, math.floor(cap + 1e-9)))


RATE = LoadUnit()
