"""The steady-state verdict of one load test: pass, fail or inconclusive (pure).

A load test passes only when its evidence would survive a run ten times longer:

* each limit's percentile, and its one-sided upper confidence bound, are under the
  limit, over the *judged cohort* (below);
* over the steady part of the test (its second half), requests complete at no less
  than ``served_share`` (0.97) of the rate at which they arrive;
* the backlog (requests sent and not finished) is not growing: the upper confidence
  bound of its least-squares slope is under ``backlog_share`` (2%) of the offered rate,
  so no overload larger than that can pass;
* failures are within the percentile's allowance;
* and the arrivals have lasted at least the minimum duration.

It *fails* as soon as failing is certain: a limit's lower confidence bound is over the
limit, more requests already broke a limit than the percentile allows for the whole
planned test, or the backlog's slope is significantly above the allowance.  Anything
else is *inconclusive*: the same test runs on (up to its cap), and an inconclusive test
never counts as passing.

The judged cohort is every measured request scheduled at least ``horizon_s`` (the
largest end-to-end or first-token limit) before ``now``.  A cohort request still in
flight is older than every such limit, so it is certainly late: the cohort's
end-to-end and first-token percentiles are exact even while the test runs, and the
test can stop the moment its verdict is certain, cancelling what is in flight.
A still-running request's TPOT is unknown: it counts as late for the upper bound
(pass) and as on time for the lower bound (fail), so neither verdict is premature.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from autotune.errors import AutotuneError
from autotune.metrics import quantile_upper_bound
from autotune.pruning import allowed_late, backlog_trend
from autotune.records import RequestRecord
from autotune.slo import SLO, Limit, quantile

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
VERDICTS = (PASS, FAIL, INCONCLUSIVE)
# One-sided normal quantiles for the backlog slope's bounds.
_Z = {0.9: 1.2816, 0.95: 1.6449, 0.975: 1.96, 0.99: 2.3263, 0.995: 2.5758}


class VerdictError(AutotuneError, ValueError):
    """Steady-state settings that cannot work; the message says how to fix them."""


def default_min_duration(slo: SLO) -> float:
    """max(60 s, 6x the largest latency limit): the seed chapter's "run until stable",
    made concrete enough that a queue which grows can show it."""
    largest = max((lim.threshold_s for lim in slo.limits), default=0.0)
    return max(60.0, 6.0 * largest)


def horizon(slo: SLO) -> float:
    """How long after its arrival a request's end-to-end and first-token latencies are
    certainly decided against every limit."""
    return max((lim.threshold_s for lim in slo.limits if lim.metric in ("e2e", "ttft")),
               default=0.0)


@dataclass(frozen=True)
class SteadyState:
    """How long a load test runs and what its pass needs.

    ``min_duration_s``: arrivals last at least this long before a pass (None: the
    SLO's :func:`default_min_duration`); ``max_duration_s``: the cap an inconclusive
    test may run on to (None: 3x the minimum); ``min_requests``: a pass also needs this
    many measured arrivals (``--num-prompts``).  ``stop_when_failed``: a certain fail
    ends the test at once (a search needs only the verdict); off, it runs on to the
    minimum duration like a pass (a sweep wants every point's figures over a full
    window, not over the few seconds a fail took to become certain).
    """

    min_duration_s: float | None = None
    max_duration_s: float | None = None
    min_requests: int = 0
    confidence: float = 0.95
    fail_confidence: float = 0.95
    served_share: float = 0.97
    backlog_share: float = 0.02
    check_every_s: float = 5.0
    stop_when_failed: bool = True

    def __post_init__(self) -> None:
        lo, hi = self.min_duration_s, self.max_duration_s
        if lo is not None and not (lo > 0 and math.isfinite(lo)):
            raise VerdictError(f"minimum duration must be a positive number of seconds, got {lo}")
        if hi is not None and not (hi > 0 and math.isfinite(hi)):
            raise VerdictError(f"maximum duration must be a positive number of seconds, got {hi}")
        if lo is not None and hi is not None and hi < lo:
            raise VerdictError(f"maximum duration ({hi:g} s) must be at least the minimum "
                               f"({lo:g} s)")
        if self.min_requests < 0:
            raise VerdictError(f"minimum requests must be >= 0, got {self.min_requests}")
        for name in ("confidence", "fail_confidence"):
            if getattr(self, name) not in _Z:
                raise VerdictError(f"{name} must be one of {sorted(_Z)}, got "
                                   f"{getattr(self, name)}")
        if not 0 < self.served_share <= 1:
            raise VerdictError(f"served share must be in (0, 1], got {self.served_share}")
        if not 0 < self.backlog_share < 1:
            raise VerdictError(f"backlog share must be in (0, 1), got {self.backlog_share}")
        if not self.check_every_s > 0:
            raise VerdictError(f"check interval must be > 0 s, got {self.check_every_s}")

    def min_s(self, slo: SLO) -> float:
        return self.min_duration_s if self.min_duration_s is not None else (
            default_min_duration(slo))

    def max_s(self, slo: SLO, rate: float | None = None) -> float:
        """The cap on a test's arrivals; at ``rate``, never shorter than what
        ``min_requests`` need (with room to run on past them)."""
        cap = (max(self.max_duration_s, self.min_s(slo)) if self.max_duration_s is not None
               else 3.0 * self.min_s(slo))
        if rate is not None and rate > 0 and math.isfinite(rate) and self.min_requests:
            cap = max(cap, 1.5 * self.min_requests / rate)
        return cap

    def arrivals_for(self, slo: SLO, rate: float) -> int:
        """Measured requests a test at ``rate`` plans (it may stop sooner): enough for
        the cap's duration and for ``min_requests``."""
        if math.isinf(rate):
            return max(self.min_requests, 1)
        # Two seconds past the cap, so the stop rule ends the test at the cap rather
        # than the schedule running out a hair before it.
        return max(int(math.ceil(rate * (self.max_s(slo, rate) + 2.0))) + 1,
                   self.min_requests, 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LimitEvidence:
    """One limit over the judged cohort: its percentile (pessimistic: unknown values as
    late), the one-sided upper bound, and the lower bound (optimistic)."""

    label: str
    threshold_s: float
    observed_s: float
    upper_s: float
    lower_s: float
    n: int
    late: int
    allowed: int
    # The same over the steady part alone (the second half of the arrivals): the
    # first minutes' lighter queue must not dilute the tail.
    steady_observed_s: float = math.inf
    steady_upper_s: float = math.inf
    steady_n: int = 0

    @property
    def passes(self) -> bool:
        """The cohort's percentile and bound, and the steady half's percentile, under
        the limit; the steady half's bound too once it has samples enough to be finite
        (a p99 needs 368), so a long test at a low rate is not held back for it."""
        half_bound = self.steady_upper_s if math.isfinite(self.steady_upper_s) else 0.0
        return max(self.observed_s, self.upper_s, self.steady_observed_s,
                   half_bound) <= self.threshold_s

    @property
    def fails(self) -> bool:
        return self.lower_s > self.threshold_s

    def to_dict(self) -> dict[str, Any]:
        return {k: _num(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Evidence:
    """Everything a verdict rests on, and the verdict."""

    verdict: str
    reasons: tuple[str, ...]
    at_s: float  # seconds of arrivals so far (from the first measured arrival)
    cohort: int  # measured requests judged
    cohort_span_s: float  # arrival span of the cohort
    limits: tuple[LimitEvidence, ...]
    offered_rate: float
    arrival_rate: float  # arrivals per second over the steady part
    served_rate: float  # completions per second over the steady part
    backlog_slope: float | None  # requests per second over the steady part
    backlog_upper: float | None
    backlog_lower: float | None
    backlog_allowed: float
    failures: int
    goodput_requests: float  # good cohort requests per second of cohort arrivals
    goodput_tokens: float
    steady_from_s: float
    min_duration_s: float
    # Measured requests sent and completed by ``at_s`` (progress: sent - completed are
    # in flight).
    sent: int = 0
    completed: int = 0

    @property
    def served_share(self) -> float:
        return self.served_rate / self.arrival_rate if self.arrival_rate > 0 else math.nan

    def sentence(self) -> str:
        return f"{self.verdict}: " + "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        out = {k: _num(v) for k, v in asdict(self).items() if k != "limits"}
        out["reasons"] = list(self.reasons)
        out["limits"] = [lim.to_dict() for lim in self.limits]
        out["served_share"] = _num(self.served_share)
        return out


def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


@dataclass
class _Arrays:
    """The measured records as arrays (inf = not yet)."""

    sched: np.ndarray
    sent: np.ndarray
    first: np.ndarray
    end: np.ndarray
    ok: np.ndarray
    failed: np.ndarray
    out_tokens: np.ndarray
    tpot: np.ndarray  # nan when unknown
    records: Sequence[RequestRecord] = field(repr=False, default=())

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> _Arrays:
        inf = math.inf
        n = len(records)
        sched = np.fromiter((r.scheduled_s for r in records), float, n)
        sent = np.fromiter((inf if r.sent_s is None else r.sent_s for r in records), float, n)
        first = np.fromiter((r.first_token_s if r.first_token_s is not None
                             else r.chunk_times_s[0] if r.chunk_times_s else inf
                             for r in records), float, n)
        end = np.fromiter((inf if r.end_s is None else r.end_s for r in records), float, n)
        ok = np.fromiter((r.end_s is not None and r.error is None for r in records), bool, n)
        failed = np.fromiter((r.end_s is not None and r.error is not None for r in records),
                             bool, n)
        out = np.fromiter((r.output_tokens for r in records), float, n)
        tpot = np.fromiter((math.nan if (t := r.tpot_s) is None else t for r in records),
                           float, n)
        return cls(sched, sent, first, end, ok, failed, out, tpot, records)


def _limit_values(a: _Arrays, idx: np.ndarray, limit: Limit, now: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(pessimistic, optimistic) values of ``limit.metric`` for cohort ``idx``."""
    inf = math.inf
    ok, failed = a.ok[idx], a.failed[idx]
    running = ~ok & ~failed
    sent = a.sent[idx]
    if limit.metric == "e2e":
        # Only where used: a request not yet sent has inf times (inf - inf warns).
        known = np.subtract(a.end[idx], sent, out=np.full(len(idx), math.nan), where=ok)
        age = np.where(np.isfinite(sent), now - sent, 0.0)
        hi = np.where(ok, known, inf)
        lo = np.where(ok, known, np.where(failed, inf, age))
    elif limit.metric == "ttft":
        first = a.first[idx]
        have = np.isfinite(first) & ~failed
        known = np.subtract(first, sent, out=np.full(len(idx), math.nan), where=have)
        age = np.where(np.isfinite(sent), now - sent, 0.0)
        hi = np.where(have, known, inf)
        lo = np.where(have, known, np.where(failed, inf, age))
    else:  # tpot (itl is judged per request by its TPOT-like gaps below)
        t = a.tpot[idx]
        known = ok & ~np.isnan(t)
        one_token = ok & np.isnan(t)
        hi = np.where(known, t, np.where(one_token, 0.0, inf))
        lo = np.where(known, t, np.where(failed, inf, 0.0))
        if limit.metric == "itl":
            gaps = [g for i in idx.tolist() for g in a.records[i].itls_s]
            pooled = np.asarray(gaps, dtype=float) if gaps else np.zeros(0)
            n_fail = int(failed.sum())
            n_run = int(running.sum())
            hi = np.concatenate([pooled, np.full(n_fail + n_run, inf)])
            lo = np.concatenate([pooled, np.full(n_fail, inf)])
    return hi, lo


def _lower_bound(values: np.ndarray, q: float, confidence: float) -> float:
    from autotune.metrics import quantile_bounds

    # quantile_bounds is two-sided at (1 + c) / 2 per side; ask for the one-sided c.
    lo, _ = quantile_bounds(values, q, 2.0 * confidence - 1.0)
    return lo


def _backlog(a: _Arrays, t: np.ndarray) -> np.ndarray:
    s = np.sort(a.sched)
    e = np.sort(a.end)
    return (np.searchsorted(s, t, side="right") - np.searchsorted(e, t, side="right")
            ).astype(float)


def judge(
    records: Sequence[RequestRecord],
    *,
    slo: SLO,
    offered_rate: float,
    now: float,
    rule: SteadyState,
    planned: int | None = None,
    final: bool = False,
) -> Evidence:
    """The verdict at ``now`` over measured ``records`` (warm-up ones are dropped).

    ``planned``: measured requests the whole test would send (for the exact
    already-too-many-late rule); ``final``: the test is over (arrivals stopped, so
    whatever is not certain now is inconclusive, never pass by default).
    """
    measured = [r for r in records if not r.warmup]
    min_s = rule.min_s(slo)
    if not measured:
        return _empty(offered_rate, min_s)
    a = _Arrays.of(measured)
    t0 = float(a.sched.min())
    last_arrival = float(a.sched.max())
    # After the arrivals end, time is drain: judge the arrival span only.
    t_end = min(now, last_arrival) if final else now
    at_s = max(t_end - t0, 0.0)
    h = horizon(slo)
    nothing_running = bool(np.all(a.ok | a.failed))
    cutoff = now - h
    idx = np.nonzero((a.sched <= cutoff) | (final & nothing_running))[0]
    reasons: list[str] = []
    fails: list[str] = []
    limits: list[LimitEvidence] = []
    planned_n = max(planned or 0, len(measured))
    # The steady part: the second half of the arrivals so far.
    steady_from = t0 + 0.5 * at_s
    half = idx[a.sched[idx] > steady_from]
    for limit in slo.limits:
        if idx.size == 0:
            limits.append(LimitEvidence(limit.label, limit.threshold_s, math.inf, math.inf,
                                        -math.inf, 0, 0, 0))
            continue
        hi, lo = _limit_values(a, idx, limit, now)
        observed = quantile(hi, limit.percentile) if hi.size else math.inf
        upper = quantile_upper_bound(hi, limit.percentile, rule.confidence)
        hi_half, _ = _limit_values(a, half, limit, now) if half.size else (np.zeros(0), None)
        steady_obs = quantile(hi_half, limit.percentile) if hi_half.size else math.inf
        steady_up = quantile_upper_bound(hi_half, limit.percentile, rule.confidence)
        lower = _lower_bound(lo, limit.percentile, rule.fail_confidence) if lo.size else (
            -math.inf)
        late = int(np.sum(lo > limit.threshold_s))
        allowed = allowed_late(hi.size, limit.percentile)
        ev = LimitEvidence(limit.label, limit.threshold_s, float(observed), float(upper),
                           float(lower), int(hi.size), late, allowed, float(steady_obs),
                           float(steady_up), int(hi_half.size))
        limits.append(ev)
        if ev.fails:
            fails.append(f"{limit.label}: {_s(lower)} is a {rule.fail_confidence:.0%} lower "
                         f"bound over {_s(limit.threshold_s)}")
        elif limit.metric in ("e2e", "ttft", "tpot") and late > allowed_late(
                planned_n, limit.percentile):
            fails.append(f"{limit.label}: {late} requests already late, more than the "
                         f"{allowed_late(planned_n, limit.percentile)} that "
                         f"{planned_n} planned requests allow")

    arr_n = int(np.sum((a.sched > steady_from) & (a.sched <= t_end)))
    done_n = int(np.sum((a.end > steady_from) & (a.end <= t_end)))
    span = t_end - steady_from
    arrival_rate = arr_n / span if span > 0 else 0.0
    served_rate = done_n / span if span > 0 else 0.0
    # The backlog's mean level over the steady part: the scale of its counting noise,
    # for both the served-vs-arriving slack and the growth's materiality below.
    mean_backlog = float(np.mean(_backlog(a, np.linspace(steady_from, t_end, 16)))) if (
        span > 0) else 0.0
    rate_ref = offered_rate if math.isfinite(offered_rate) else arrival_rate
    allowed_slope = rule.backlog_share * rate_ref
    slope = upper_slope = lower_slope = None
    if span > 0 and math.isfinite(offered_rate):
        step = max(min(1.0, span / 20.0), 1e-3)
        times = np.arange(steady_from + step, t_end + 1e-9, step)
        if times.size >= 3:
            trend = backlog_trend(times, _backlog(a, times), corr_s=max(h, step))
            if trend is not None:
                slope = trend.slope
                upper_slope = trend.slope + _Z[rule.confidence] * trend.stderr
                lower_slope = trend.slope - _Z[rule.fail_confidence] * trend.stderr
    # Growth is only judged once the arrivals have run the minimum duration: before
    # that, a queue near (but under) capacity is still filling up, and its backlog
    # grows for tens of seconds without being overloaded.
    # Nor before the steady half starts two typical stays (p90 of the finished requests'
    # end-to-end latency) after the first arrival: the queue fills for about one stay.
    done_e2e = a.end[a.ok] - a.sent[a.ok]  # masked first: unfinished ends are NaN
    stay = float(np.percentile(done_e2e, 90)) if done_e2e.size else math.inf
    # And a growth must be material in requests, not only in slope: at a few req/s a
    # queue of a handful wanders by more than the allowance's worth in a minute.
    growth = 0.0 if lower_slope is None else lower_slope * max(t_end - steady_from, 0.0)
    material = growth >= max(8.0, 5.0 * math.sqrt(max(mean_backlog, 1.0)))
    if (lower_slope is not None and lower_slope > allowed_slope and at_s >= min_s
            and at_s >= 4.0 * stay and material):
        fails.append(f"backlog grows {slope:.3g} req/s (its {rule.fail_confidence:.0%} lower "
                     f"bound {lower_slope:.3g} > {allowed_slope:.3g}, {rule.backlog_share:.0%} "
                     "of the offered rate)")

    cohort_span = float(a.sched[idx].max() - a.sched[idx].min()) if idx.size > 1 else 0.0
    good = _good_mask(a, idx, slo)
    per_s = (idx.size - 1) / cohort_span / idx.size if cohort_span > 0 else 0.0
    goodput_req = float(good.sum()) * per_s
    goodput_tok = float(a.out_tokens[idx][good].sum()) * per_s
    n_failed = int(a.failed[idx].sum()) if idx.size else 0

    if fails:
        verdict, reasons = FAIL, fails
    else:
        need: list[str] = []
        for ev in limits:
            if not ev.passes:
                need.append(f"{ev.label}: {_s(ev.observed_s)}, {rule.confidence:.0%} upper "
                            f"bound {_s(ev.upper_s)} over {ev.n} requests (steady half "
                            f"{_s(ev.steady_observed_s)}, bound {_s(ev.steady_upper_s)} over "
                            f"{ev.steady_n}), limit {_s(ev.threshold_s)}")
        if at_s < min_s:
            need.append(f"arrivals have run {at_s:.0f} of the {min_s:.0f} s minimum")
        if len(measured) < rule.min_requests:
            need.append(f"{len(measured)} of the {rule.min_requests} requests minimum")
        # Completions trail arrivals by the change in backlog over the span, which
        # wanders by a few times the square root of its level in a stable queue.
        slack = 3.0 * math.sqrt(mean_backlog + 1.0) if span > 0 else 0.0
        if arrival_rate > 0 and done_n < rule.served_share * arr_n - slack:
            need.append(f"served {served_rate:.3g} of {arrival_rate:.3g} req/s arriving over "
                        f"the steady part (< {rule.served_share:.0%})")
        if math.isfinite(offered_rate):
            if upper_slope is None:
                need.append("too little steady span to bound the backlog's growth")
            elif upper_slope >= allowed_slope:
                need.append(f"backlog slope {slope:.3g} req/s, {rule.confidence:.0%} upper "
                            f"bound {upper_slope:.3g} not under {allowed_slope:.3g} "
                            f"({rule.backlog_share:.0%} of the offered rate)")
        if need:
            verdict, reasons = INCONCLUSIVE, need
        else:
            verdict = PASS
            reasons = [", ".join(f"{ev.label} {_s(ev.observed_s)} (bound {_s(ev.upper_s)}; "
                                 f"steady half {_s(ev.steady_observed_s)}, bound "
                                 f"{_s(ev.steady_upper_s)})" for ev in limits)
                       + f" over {idx.size} requests; served {served_rate:.3g} of "
                       f"{arrival_rate:.3g} req/s; backlog slope {slope or 0.0:.2g} req/s "
                       f"(bound {upper_slope or 0.0:.2g} < {allowed_slope:.2g})"]
    return Evidence(
        verdict=verdict, reasons=tuple(reasons), at_s=at_s, cohort=int(idx.size),
        cohort_span_s=cohort_span, limits=tuple(limits), offered_rate=offered_rate,
        arrival_rate=arrival_rate, served_rate=served_rate, backlog_slope=slope,
        backlog_upper=upper_slope, backlog_lower=lower_slope, backlog_allowed=allowed_slope,
        failures=n_failed, goodput_requests=goodput_req, goodput_tokens=goodput_tok,
        steady_from_s=steady_from - t0, min_duration_s=min_s,
        sent=int(np.count_nonzero(a.sent <= now)),
        completed=int(np.count_nonzero(a.end <= now)))


def _good_mask(a: _Arrays, idx: np.ndarray, slo: SLO) -> np.ndarray:
    """vLLM's goodput rule per cohort request: completed and within every limit."""
    from autotune.metrics import is_good

    return np.fromiter((is_good(a.records[i], slo) for i in idx.tolist()), bool, idx.size)


def _empty(offered_rate: float, min_s: float) -> Evidence:
    return Evidence(INCONCLUSIVE, ("no measured request yet",), 0.0, 0, 0.0, (), offered_rate,
                    0.0, 0.0, None, None, None, 0.0, 0, 0.0, 0.0, 0.0, min_s)


def _s(x: float) -> str:
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.2f}s"
