"""Where load tests run: the :class:`Backend` base, the load plan it is offered and
the raw run it returns.

Two execution modes, one run type: virtual time (:mod:`autotune.backends.sim`) and
real time (:mod:`autotune.backends.http`).  ``autotune.tuning.trial`` judges the runs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.core.errors import AutotuneError
from autotune.core.metrics import MEASURED
from autotune.core.records import RequestRecord, WindowCallback
from autotune.core.slo import SLO
from autotune.workload.arrivals import ClosedLoop, schedule, trace_rate
from autotune.workload.sources import Request

if TYPE_CHECKING:
    # The load plan carries the verdict's sizing rule; backends only ask it how many
    # requests a rate plans, so they need not import the tuning package.
    from autotune.tuning.verdict import SteadyState


# A closed loop's test is planned as if each request took at least this long, and its
# users could not send faster than ``closed_rate_cap``: its requests then last to the
# test's cap, which stops it (a plan that ran out first ended the test undecided).
MIN_CYCLE_S = 0.02
# The most measured requests one test plans (a closed loop with no think time and a
# fast server would plan millions); the stop rule ends a test long before.
MAX_PLANNED = 1_000_000


@dataclass
class LoadPlan:
    """What every load test of a study offers (same requests, same seed)."""

    slo: SLO
    requests: list[Request]  # the measured requests, in order
    warmup_requests: list[Request] = field(default_factory=list)
    warmup: int = 0
    seed: int = 0
    process: str = "poisson"
    burstiness: float = 1.0
    window_s: float = 1.0
    request_timeout_s: float = 600.0
    max_concurrency: int | None = None
    # Steady-state sizing and stop rule (autotune.tuning.verdict); None: a fixed-count test of
    # ``requests`` judged on its SLO check alone (kept for what-if sweeps and old tests).
    steady: SteadyState | None = None
    # When the server-time budget (``--budget``) ends, on the backend's ``server_s``
    # clock: a test sized by time that is running then stops there, with whatever
    # verdict its evidence supports.
    deadline_s: float | None = None
    # Closed-loop load: the test's ``rate`` argument is then its number of users
    # (ClosedLoop.users), and the arrival process, burstiness and max_concurrency are
    # unused.  None: open loop at ``rate`` req/s.
    closed: ClosedLoop | None = None
    # The most req/s a closed loop's users can reach: a multiple of the saturated
    # throughput, when a saturation test measured it (completions pace the users).
    closed_rate_cap: float | None = None

    @property
    def replay(self) -> bool:
        """A trace replayed at its logged times: ``rate`` is its speed-up factor."""
        return self.process == "trace"

    def offered_rate(self, rate: float) -> float:
        """The request rate a test at ``rate`` offers whatever the server does: a closed
        loop offers none of its own (its users wait for the server), which the verdict
        reads as "judge the arrivals as they came"; a replayed trace offers its own mean
        rate, ``rate`` times faster."""
        if self.closed is not None:
            return math.inf
        if self.replay:
            return trace_rate(self.requests) * rate
        return rate

    def sizing_rate(self, rate: float) -> float:
        """The request rate a test's length is planned for: a closed loop's users can
        send no faster than one request per think time plus MIN_CYCLE_S each."""
        if self.closed is None:
            return self.offered_rate(rate)
        users = ClosedLoop.users(rate)
        most = users / (self.closed.think_s + MIN_CYCLE_S)
        return most if self.closed_rate_cap is None else min(most, self.closed_rate_cap)

    def measured_for(self, rate: float) -> list[Request]:
        """The measured requests a test at ``rate`` plans: the pool itself, or, when the
        test is sized by time, as many as its cap's duration needs (cycling the pool)."""
        if self.steady is None or not self.requests or self.replay:
            return list(self.requests)  # a trace is replayed once, as logged
        n = min(self.steady.arrivals_for(self.slo, self.sizing_rate(rate)), MAX_PLANNED)
        pool = self.requests
        return [pool[i % len(pool)] for i in range(n)]

    def planned_span_s(self, rate: float) -> float:
        """When the last measured request is scheduled (from the first); for a closed
        loop, when it would be at the most its users can send."""
        measured = self.measured_for(rate)
        n = len(measured)
        if self.closed is not None:
            return n / self.sizing_rate(rate)
        off = schedule(self.warm_requests() + measured, rate, process=self.process,
                       burstiness=self.burstiness, seed=self.seed)
        return float(off[-1] - off[self.warmup]) if len(off) else 0.0

    def warmup_span_s(self, rate: float) -> float:
        """When the first measured request is scheduled (from the first warm-up one)."""
        if self.closed is not None:
            return self.warmup_at(rate) / self.sizing_rate(rate)
        if not self.warmup or not (rate > 0 and math.isfinite(rate)):
            return 0.0
        plan = self.warm_requests() + self.measured_for(rate)[:1]
        off = schedule(plan, rate, process=self.process, burstiness=self.burstiness,
                       seed=self.seed)
        return float(off[self.warmup] - off[0]) if len(off) > self.warmup else 0.0

    def warmup_at(self, rate: float) -> int:
        """The warm-up requests of a test at ``rate``: ``warmup``, and for a closed loop
        at least one per user.  Its users start spread over one think time, so their
        first requests ramp the load up (a test at 618 simulated users with 20 s think
        time read P99 4.74 s and clustering x2.4 with 100 warm-up requests, 4.42 s and
        x1 with 700): the loop is steady once each user has sent once."""
        if self.closed is None or not (rate >= 1 and math.isfinite(rate)):
            return self.warmup
        users = ClosedLoop.users(rate)
        return max(self.warmup, users, self._whole_conversations(users))

    def _whole_conversations(self, users: int) -> int:
        """Warm-up requests that hold the first ``users`` conversations whole: a user
        of a multi-turn loop takes a conversation's turns in order (2.3 turns on
        average in ShareGPT), so one request per user left most users' first turns in
        the judged start-up burst (every failed level of a multi-turn search on real
        vLLM was decided there, in its test's first second).  0 for single requests."""
        pool = self.warmup_requests or self.requests
        if not pool or not any(r.turn for r in pool):
            return 0
        starts = i = 0
        # Bounded: a pool with fewer conversation starts than users cycles at most this.
        limit = max(len(pool), users) * 8
        while i < limit:
            if pool[i % len(pool)].turn == 0:
                if starts == users:
                    break
                starts += 1
            i += 1
        return i

    def warm_requests(self, rate: float | None = None) -> list[Request]:
        """The warm-up requests sent first (``warmup_at(rate)`` of them, ``warmup``
        without a rate), drawn in turn from ``warmup_requests`` (or from ``requests``)."""
        pool = self.warmup_requests or self.requests
        n = self.warmup if rate is None else self.warmup_at(rate)
        return [pool[i % len(pool)] for i in range(n)] if pool else []

    def mean_output_tokens(self) -> float:
        """Mean requested output tokens of the measured pool (goodput tok/s per req/s)."""
        if not self.requests:
            return 0.0
        return sum(r.output_tokens for r in self.requests) / len(self.requests)


@dataclass
class LoadRun:
    """The raw outcome of one load test on a backend."""

    records: list[RequestRecord]
    aborted: bool
    abort_reason: str | None
    load_test_s: float  # duration of the load test (virtual seconds in the simulator)
    telemetry: dict[str, Any] = field(default_factory=dict)
    crashed: str | None = None  # why the server died during the test, if it did


class TrialFailed(AutotuneError):
    """The config could not be evaluated; ``reason`` says why in one word."""

    def __init__(self, reason: str, detail: str, *, log_path: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.log_path = log_path


class Backend(ABC):
    """Where trials run.  ``server_s`` accumulates server time (restarts included)."""

    name: str = "backend"
    mode: str = "real"  # "virtual" | "real"
    restartable: bool = True
    source: str = MEASURED

    def __init__(self) -> None:
        self.server_s = 0.0
        self.restarts = 0

    @abstractmethod
    def prepare(self, flags: Mapping[str, Any], *, trial: int | None = None
                ) -> dict[str, Any]:
        """Make a server with ``flags`` ready (reuse it when the flags are unchanged);
        return its startup info.  Raises :class:`TrialFailed`."""

    @abstractmethod
    def load_test(self, rate: float, plan: LoadPlan, on_window: WindowCallback | None) -> LoadRun:
        """Offer ``plan`` at ``rate`` to the prepared server."""

    def gpus_used(self, flags: Mapping[str, Any]) -> int:
        return int(flags.get("tensor_parallel_size", 1)) * int(
            flags.get("pipeline_parallel_size", 1))

    def close(self) -> None:  # noqa: B027 - most backends have nothing to stop
        """Stop whatever runs; nothing may be left behind."""
