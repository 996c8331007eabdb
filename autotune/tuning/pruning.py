"""The overload pruner: stop a load test as soon as overload is clear.

Two rules, each a pure function over per-window evidence:

(a) ``certain_violation``: more requests have already broken a latency limit
    (finished late or failed, or still in flight and older than the limit) than the
    limit's percentile allows for the planned number of requests.  No later request
    can undo that, so the trial's SLO check is already decided.
(b) ``backlog_growing``: the number of requests in flight or waiting keeps growing
    across windows: the least-squares slope over time is significantly above zero
    (t statistic over a threshold, after a minimum number of windows and after the
    backlog had time to settle).  Offered rate exceeds service rate.

The trial runner turns records into :class:`Window` evidence (``window_evidence``),
hands it to the pruner (``observe``) and asks Optuna ``trial.should_prune()``, which
calls :meth:`OverloadPruner.prune`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import optuna
from optuna.pruners import BasePruner

from autotune.core.records import RequestRecord
from autotune.core.slo import SLO, Limit

CERTAIN_VIOLATION = "certain_violation"
UNBOUNDED_BACKLOG = "unbounded_backlog"
RULES = (CERTAIN_VIOLATION, UNBOUNDED_BACKLOG)
# Metrics a single request can be judged on while the load test runs (ITL is pooled
# over tokens, so a count of late requests says nothing certain about its percentile).
_COUNTABLE = ("e2e", "ttft", "tpot")


@dataclass(frozen=True)
class Window:
    """What the load test looked like at the end of one window."""

    t_s: float  # seconds since the first measured request was scheduled
    in_flight: int  # scheduled by now and not finished (waiting or running)
    finished: int
    late: dict[str, int]  # per limit label: requests that certainly break it
    arrivals_done: bool = False  # every planned request has been scheduled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PruneDecision:
    rule: str
    at_s: float  # load-test time at which it fired
    window: int
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def allowed_late(planned: int, percentile: float) -> int:
    """How many of ``planned`` samples may exceed a limit with the percentile still
    under it (numpy's linear percentile: the sample at floor(q(n-1)) must be within)."""
    if planned <= 0:
        return 0
    return planned - 1 - int(math.floor(percentile / 100.0 * (planned - 1) + 1e-9))


def certain_violation(late: int, planned: int, percentile: float) -> bool:
    """Rule (a): ``late`` requests already break a p-``percentile`` limit for good."""
    return late > allowed_late(planned, percentile)


@dataclass(frozen=True)
class Trend:
    slope: float  # requests per second
    stderr: float
    t: float
    n: int
    growth: float  # slope times the fitted time span (requests)


def backlog_trend(
    times: Sequence[float] | np.ndarray, backlog: Sequence[float] | np.ndarray, *,
    corr_s: float = 0.0
) -> Trend | None:
    """Least-squares slope of backlog over time with a Newey-West standard error.

    A backlog count is autocorrelated (a request stays in flight for several
    windows), so the plain OLS error is too small and a stable queue would look
    like it grows; the Bartlett-kernel correction widens it accordingly.  ``corr_s``
    is how long a request typically stays (the correlation time): the kernel spans
    at least that many seconds of windows.
    """
    t = np.asarray(times, dtype=float)
    y = np.asarray(backlog, dtype=float)
    n = t.size
    if n < 3 or np.ptp(t) <= 0:
        return None
    tc = t - t.mean()
    sxx = float(tc @ tc)
    slope = float(tc @ (y - y.mean())) / sxx
    resid = y - y.mean() - slope * tc
    u = tc * resid
    spacing = float(np.ptp(t)) / (n - 1)
    lags = max(int(round(n ** (1.0 / 3.0))) + 1, min(int(math.ceil(corr_s / spacing)), n // 3))
    s = float(u @ u)
    for lag in range(1, min(lags, n - 1) + 1):
        s += 2.0 * (1.0 - lag / (lags + 1.0)) * float(u[lag:] @ u[:-lag])
    # Small-sample scaling, and a floor of one request of counting noise so a
    # perfectly straight line keeps a finite t.
    var = max(s * n / (n - 2), sxx / 12.0) / (sxx * sxx)
    stderr = math.sqrt(var)
    return Trend(slope, stderr, slope / stderr, n, slope * float(np.ptp(t)))


def backlog_growing(
    times: Sequence[float],
    backlog: Sequence[float],
    *,
    min_windows: int = 8,
    t_threshold: float = 4.0,
    min_growth: float = 8.0,
    corr_s: float = 0.0,
    min_span_s: float = 0.0,
    noise_sigmas: float = 5.0,
) -> bool:
    """Rule (b): the backlog grows with slope significantly above zero.

    Needs ``min_windows`` windows spanning ``min_span_s`` seconds, a t statistic above
    ``t_threshold`` and a total growth over the fitted span of at least
    ``min_growth`` requests and ``noise_sigmas`` Poisson standard deviations of the
    mean backlog: a stable queue wanders by a few of those within a correlation time,
    so counting noise at a stable level does not fire it.
    """
    if len(times) < min_windows or float(np.ptp(np.asarray(times, dtype=float))) < min_span_s:
        return False
    trend = backlog_trend(times, backlog, corr_s=corr_s)
    if trend is None or trend.slope <= 0:
        return False
    noise = noise_sigmas * math.sqrt(max(float(np.mean(np.asarray(backlog, dtype=float))), 1.0))
    return trend.t > t_threshold and trend.growth >= max(min_growth, noise)


def _late_for(record: RequestRecord, limit: Limit, now: float) -> bool:
    """Whether ``record`` is late for a TTFT or TPOT limit at ``now`` (an end-to-end
    limit is counted on arrays, in :func:`_count_late`)."""
    threshold = limit.threshold_s
    if record.done:
        if not record.ok:
            return True  # failures count as infinitely late (slo.py)
        value = getattr(record, f"{limit.metric}_s")
        return value is not None and value > threshold
    if record.sent_s is None:
        return False
    age = now - record.sent_s
    if limit.metric == "ttft":
        return record.first_token_s is None and age > threshold
    return False  # tpot is only known at the end


def _count_late(records: Sequence[RequestRecord], ends: list[float | None], limit: Limit,
                now: float) -> int:
    """How many ``records`` (finished at ``ends``) are late for ``limit`` at ``now``:
    failed, or over it so far.  An end-to-end limit is counted on arrays (every window
    counts every request so far, so a load test's windows cost its requests squared),
    the others by :func:`_late_for`."""
    if limit.metric != "e2e":
        return sum(1 for r in records if _late_for(r, limit, now))
    # None reads as nan, and a nan latency is under any limit, as a missing e2e_s or
    # an unsent request is never late.
    sent = np.array([r.sent_s for r in records], dtype=float)
    done = np.array([t is not None for t in ends], dtype=bool)
    failed = done & np.array([r.error is not None for r in records], dtype=bool)
    with np.errstate(invalid="ignore"):  # inf - inf is nan, in Python as here: silent
        late = np.where(done, np.array(ends, dtype=float) - sent, now - sent)
    return int(np.count_nonzero((late > limit.threshold_s) | failed))


def window_evidence(
    now: float, records: Sequence[RequestRecord], slo: SLO, *, planned: int, t0: float
) -> Window:
    """Evidence at ``now`` from the measured records so far (warm-up excluded)."""
    measured = [r for r in records if not r.warmup]
    scheduled = [r for r in measured if r.scheduled_s <= now]
    ends = [r.end_s for r in scheduled]
    finished = len(ends) - ends.count(None)
    late = {
        limit.label: _count_late(scheduled, ends, limit, now)
        for limit in slo.limits
        if limit.metric in _COUNTABLE
    }
    return Window(
        t_s=now - t0,
        in_flight=len(scheduled) - finished,
        finished=finished,
        late=late,
        arrivals_done=len(scheduled) >= planned,
    )


@dataclass
class PrunerSettings:
    min_windows: int = 8
    t_threshold: float = 4.0
    min_growth: float = 8.0
    noise_sigmas: float = 5.0
    # Backlog windows before this load-test time are skipped: a stable system fills
    # up to its steady level in about one e2e limit.  None: the SLO's e2e threshold.
    settle_s: float | None = None
    rules: tuple[str, ...] = RULES


def settle_time(slo: SLO, settings: PrunerSettings) -> float:
    if settings.settle_s is not None:
        return settings.settle_s
    e2e = [lim.threshold_s for lim in slo.limits if lim.metric == "e2e"]
    return max(e2e) if e2e else 10.0


def decide(
    windows: Sequence[Window], slo: SLO, *, planned: int,
    settings: PrunerSettings | None = None,
) -> PruneDecision | None:
    """Both rules over the windows so far; the first that fires, or None."""
    s = settings or PrunerSettings()
    if not windows:
        return None
    last = windows[-1]
    idx = len(windows) - 1
    if CERTAIN_VIOLATION in s.rules:
        by_label = {lim.label: lim for lim in slo.limits}
        for label, late in last.late.items():
            lim = by_label[label]
            if certain_violation(late, planned, lim.percentile):
                return PruneDecision(
                    CERTAIN_VIOLATION, last.t_s, idx,
                    f"{late} of {planned} planned requests already break {lim} "
                    f"(at most {allowed_late(planned, lim.percentile)} may)",
                )
    if UNBOUNDED_BACKLOG in s.rules:
        settle = settle_time(slo, s)
        use = [w for w in windows if w.t_s >= settle and not w.arrivals_done]
        times = [w.t_s for w in use]
        backlog = [w.in_flight for w in use]
        if backlog_growing(times, backlog, min_windows=s.min_windows,
                           t_threshold=s.t_threshold, min_growth=s.min_growth,
                           corr_s=settle, min_span_s=2.0 * settle,
                           noise_sigmas=s.noise_sigmas):
            trend = backlog_trend(times, backlog, corr_s=settle)
            assert trend is not None
            return PruneDecision(
                UNBOUNDED_BACKLOG, last.t_s, idx,
                f"backlog grows {trend.slope:.2f} req/s (t={trend.t:.1f} over {trend.n} "
                f"windows, {backlog[0]} -> {backlog[-1]} in flight)",
            )
    return None


@dataclass
class _TrialFeed:
    planned: int
    windows: list[Window] = field(default_factory=list)


class OverloadPruner(BasePruner):
    """Prunes a trial whose load test is clearly overloaded (see module docstring).

    The trial runner calls :meth:`observe` with each window's evidence, reports the
    goodput so far with ``trial.report`` and asks ``trial.should_prune()``.
    """

    def __init__(self, slo: SLO, settings: PrunerSettings | None = None) -> None:
        self._slo = slo
        self._settings = settings or PrunerSettings()
        self._feeds: dict[int, _TrialFeed] = {}
        self.decisions: dict[int, PruneDecision] = {}

    def begin(self, trial_number: int, planned: int) -> None:
        self._feeds[trial_number] = _TrialFeed(planned=planned)
        self.decisions.pop(trial_number, None)

    def observe(self, trial_number: int, window: Window) -> None:
        feed = self._feeds.get(trial_number)
        if feed is not None:
            feed.windows.append(window)

    def windows(self, trial_number: int) -> list[Window]:
        feed = self._feeds.get(trial_number)
        return [] if feed is None else list(feed.windows)

    def end(self, trial_number: int) -> None:
        self._feeds.pop(trial_number, None)

    def prune(self, study: optuna.study.Study, trial: optuna.trial.FrozenTrial) -> bool:
        if trial.number in self.decisions:
            return True
        feed = self._feeds.get(trial.number)
        if feed is None:
            return False
        decision = decide(feed.windows, self._slo, planned=feed.planned,
                          settings=self._settings)
        if decision is None:
            return False
        self.decisions[trial.number] = decision
        return True
