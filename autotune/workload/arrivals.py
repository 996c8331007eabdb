"""Arrival schedules: open-loop load (Poisson, gamma (bursty) and constant) and
closed-loop load (virtual users who think between requests).

Pure: the HTTP load generator and the simulator draw the same schedule from the same
seed, so a virtual-time run and a real-time run offer exactly the same load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # sources imports nothing of this module; only the type is needed
    from autotune.workload.sources import Request

Process = Literal["poisson", "gamma", "constant", "trace"]
# "trace": the requests' own arrival times (Request.arrival_s), ``rate`` times faster.
PROCESSES: tuple[str, ...] = ("poisson", "gamma", "constant", "trace")
THINK_DISTS: tuple[str, ...] = ("exponential", "fixed")


def arrival_offsets(
    n: int,
    rate: float,
    *,
    process: Process = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """Send times (seconds from start) of ``n`` requests at ``rate`` req/s.

    Gaps are gamma-distributed with shape ``burstiness`` and mean ``1/rate``, as in
    vLLM's benchmark: shape 1 is Poisson, below 1 is burstier, above 1 smoother.
    ``rate = inf`` sends everything at t=0.  The first request goes at t=0.

    Random gaps are rescaled so that their mean is exactly ``1/rate``: the schedule is
    the arrival process conditioned on its ``n - 1`` gaps spanning ``(n - 1)/rate``
    seconds.  Without that, one unlucky draw of a few hundred gaps offers 10% less
    load than asked, and every figure quoted "at rate R" would be at another rate.
    """
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 req/s, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n == 0:
        return np.zeros(0)
    if np.isinf(rate):
        return np.zeros(n)
    if process == "trace":
        raise ValueError("a trace's arrivals come with its requests: use schedule()")
    rng = np.random.default_rng(seed)
    if process == "constant":
        gaps = np.full(n - 1, 1.0 / rate)
    elif process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    elif process == "gamma":
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    else:
        raise ValueError(f"unknown arrival process {process!r}; use one of {', '.join(PROCESSES)}")
    if process != "constant" and gaps.size and gaps.sum() > 0:
        gaps *= (gaps.size / rate) / gaps.sum()
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass(frozen=True, kw_only=True)
class ClosedLoop:
    """Closed-loop load: each virtual user sends its next request when its previous one
    ends, after a think time.  How many users is the load level (a test's ``rate``
    argument carries it); ``think_s = 0`` keeps that many requests in flight, the
    "concurrency" of GuideLLM's and vLLM's benchmarks.

    ``think``: ``exponential`` draws each think time with mean ``think_s`` (users who do
    not act in step, the textbook closed-loop model), ``fixed`` waits exactly
    ``think_s``.  Users start spread over one think time, so they do not send in step.
    """

    think_s: float = 0.0
    think: str = "exponential"

    def __post_init__(self) -> None:
        if not (self.think_s >= 0 and math.isfinite(self.think_s)):
            raise ValueError(f"think time must be a finite number of seconds >= 0, got "
                             f"{self.think_s:g}")
        if self.think not in THINK_DISTS:
            raise ValueError(f"unknown think-time distribution {self.think!r}; use one of "
                             f"{', '.join(THINK_DISTS)}")

    @property
    def unit(self) -> str:
        """What its levels are called: users who think, or requests kept in flight."""
        return "users" if self.think_s > 0 else "in flight"

    @staticmethod
    def users(level: float) -> int:
        """The whole users a load level stands for (a search's levels are rounded, a
        validation's 5% steps are not): never more than asked."""
        if not level >= 1:
            raise ValueError(f"a closed loop needs at least 1 user, got {level:g}")
        return int(math.floor(level + 1e-9))

    def think_times(self, n: int, seed: int = 0) -> np.ndarray:
        """The think time after each of ``n`` requests (in the order they are sent)."""
        if self.think_s == 0 or n == 0:
            return np.zeros(n)
        if self.think == "fixed":
            return np.full(n, self.think_s)
        return np.random.default_rng([seed, 1]).exponential(self.think_s, size=n)

    def starts(self, users: int, seed: int = 0) -> np.ndarray:
        """Each user's first send, in seconds from the start, ascending: all at once
        without think time, else uniform over one think time."""
        if self.think_s == 0:
            return np.zeros(users)
        return np.sort(np.random.default_rng([seed, 2]).uniform(0.0, self.think_s, users))

    def expected_rate(self, users: int, latency_s: float) -> float:
        """Requests per second ``users`` send when each request takes ``latency_s``
        (Little's law over one cycle of request and think time)."""
        cycle = self.think_s + latency_s
        return math.inf if cycle <= 0 else users / cycle

    def describe(self, users: int | None = None) -> str:
        who = "users" if users is None else f"{users} users"
        if self.think_s == 0:
            return (f"{who}, no think time" if users is None
                    else f"{users} in flight (closed loop, no think time)")
        return f"{who} with {self.think} think time of mean {self.think_s:g} s"


def conversation_order(plan: Sequence[Request]) -> list[list[int]]:
    """The plan's requests grouped by conversation, in the order of first turns; a
    request without a conversation is one of its own.  A conversation that comes round
    again when a pool is cycled starts anew, so its turns are grouped by their run."""
    groups: list[list[int]] = []
    open_: dict[str, int] = {}
    for i, r in enumerate(plan):
        if r.conversation is None:
            groups.append([i])
            continue
        at = open_.get(r.conversation)
        if at is None or r.turn <= plan[groups[at][-1]].turn:
            open_[r.conversation] = len(groups)
            groups.append([i])
        else:
            groups[at].append(i)
    return groups


def trace_offsets(requests: Sequence[Request], speed: float) -> np.ndarray:
    """Send times (seconds from the first) of a logged trace replayed ``speed`` times
    faster: its requests' ``arrival_s`` from the first one's, divided by ``speed``."""
    if not speed > 0:
        raise ValueError(f"replay speed must be > 0, got {speed}")
    times = [r.arrival_s for r in requests]
    if any(t is None for t in times):
        raise ValueError("a trace replay needs every request's arrival time: this "
                         "workload has requests without one")
    arr = np.asarray(times, dtype=float)
    if arr.size and np.any(np.diff(arr) < 0):
        raise ValueError("a trace's arrival times must not go backwards")
    if np.isinf(speed):
        return np.zeros(arr.size)
    return (arr - arr[0]) / speed if arr.size else arr


def schedule(requests: Sequence[Request], rate: float, *, process: str = "poisson",
             burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """The send times of ``requests``: drawn from the arrival process at ``rate`` req/s,
    or, for ``process="trace"``, their own arrival times ``rate`` times faster."""
    if process == "trace":
        return trace_offsets(requests, rate)
    return arrival_offsets(len(requests), rate, process=process,  # type: ignore[arg-type]
                           burstiness=burstiness, seed=seed)


def trace_rate(requests: Sequence[Request]) -> float:
    """A trace's mean arrival rate (req/s) as logged: (n - 1) gaps over its span."""
    times = [r.arrival_s for r in requests if r.arrival_s is not None]
    span = (max(times) - min(times)) if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else math.inf
