"""The steady-state verdict of one load test: pass, fail or inconclusive (pure).

A load test passes only when its evidence would survive a run ten times longer:

* each limit's sequential test (:mod:`autotune.tuning.sequential`) is shown safe: the share of
  judged requests over the limit is, at 95% confidence, under the percentile's
  allowance (1% for a P99), with an indifference zone at half of it;
* over the steady part of the test (its second half), requests complete at no less
  than ``served_share`` (0.97) of the rate at which they arrive;
* the backlog (requests sent and not finished) is not growing: the upper confidence
  bound of its least-squares slope is under ``backlog_share`` (2%) of the offered rate,
  so no overload larger than that can pass;
* and the arrivals have lasted at least the minimum duration.

The latency sample is never halved: stationarity (served vs arriving, the backlog's
growth) is checked on its own, over the second half, and every judged request counts
toward the limits' tests.  A test *fails* as soon as a limit's sequential test shows
it unsafe, or the backlog's slope is significantly above the allowance.  Anything else
is *inconclusive*: the test runs on (up to its time cap), and a test that reaches its
cap without being shown safe never counts as passing.

The judged cohort is every measured request scheduled at least a horizon (the largest
end-to-end or first-token limit; with a TPOT or ITL limit, also twice the slowest
finished request's stay) before ``now``.  A cohort request still in flight is older
than every end-to-end and first-token limit, so it certainly exceeds them and counts
at once.  A still-running request's TPOT or ITL is unknown: it counts as over the limit
for a pass and as under it for a fail, so neither verdict is premature.  Cohorts are
chosen by arrival time, never by outcome, so a fast request cannot be judged before a
slow one that arrived with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from autotune.core.errors import AutotuneError
from autotune.core.metrics import Summary, own_itl, quantile_bounds, quantile_upper_bound
from autotune.core.records import RequestRecord
from autotune.core.slo import SLO, Limit, quantile
from autotune.tuning.pruning import backlog_trend
from autotune.tuning.sequential import FAIL as SEQ_FAIL
from autotune.tuning.sequential import PASS as SEQ_PASS
from autotune.tuning.sequential import (
    ExceedanceTest,
    clustering,
    drifted,
    level_by_part,
    local_clustering,
    requests_for_power,
)

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


# Pooled evidence per limit: (label, judged, over the limit, clustering).
Prior = tuple[tuple[str, int, int, float], ...]


def merge_prior(parts: Sequence[Prior]) -> Prior:
    """Pooled evidence from several sources, summed per limit (clustering: the most);
    limits with nothing judged are left out."""
    total: dict[str, list[float]] = {}
    for part in parts:
        for label, n, k, d in part:
            got = total.setdefault(label, [0, 0, 1.0])
            got[0], got[1], got[2] = got[0] + n, got[1] + k, max(got[2], d)
    return tuple((label, int(v[0]), int(v[1]), float(v[2]))
                 for label, v in total.items() if v[0] > 0)


# The longest a test runs by default, whatever its rate needs: the seed chapter's
# 5-10 minute steady-state runs.  ``--max-duration`` overrides it.
DEFAULT_HARD_CAP_S = 600.0
# The share of tests at the safe exceedance that a default cap gives time to pass.
DEFAULT_POWER = 0.8


def limit_test(limit: Limit, rule: SteadyState | None = None) -> ExceedanceTest:
    """The sequential test of one limit under ``rule``'s error rates (its false-pass
    rate shared among ``rule.looks`` pass decisions)."""
    false_pass = (1.0 - (rule.confidence if rule is not None else 0.95)) / (
        rule.looks if rule is not None else 1)
    false_fail = 1.0 - (rule.fail_confidence if rule is not None else 0.95)
    return ExceedanceTest.for_percentile(limit.percentile, false_pass=false_pass,
                                         false_fail=false_fail,
                                         safe_share=rule.safe_share if rule is not None else 0.5)


def screen_n(limit: Limit) -> int:
    """Judged requests a screening test needs before its point estimate of a limit's
    share counts: twice the requests one exceedance stands for (200 for a P99)."""
    return int(math.ceil(2.0 / (1.0 - limit.percentile / 100.0)))


def screening(rule: SteadyState, slo: SLO) -> SteadyState:
    """``rule`` as a screening test: point estimates, over max(20 s, 2x the largest
    latency limit) of arrivals (the rule's minimum when shorter), never longer."""
    largest = max((lim.threshold_s for lim in slo.limits), default=0.0)
    span = min(rule.min_s(slo), max(20.0, 2.0 * largest))
    cap = rule.max_duration_s
    return replace(rule, screen=True, min_duration_s=span, prior=(),
                   max_duration_s=None if cap is None else max(cap, span))


@dataclass(frozen=True)
class SteadyState:
    """How long a load test runs and what its pass needs.

    ``min_duration_s``: arrivals last at least this long before a pass (None: the
    SLO's :func:`default_min_duration`); ``max_duration_s``: the hard cap on a test's
    arrivals (None: long enough for the limits' sequential tests to pass a safe rate
    with 80% probability, at least 3x the minimum, at most 10 minutes);
    ``min_requests`` (``--num-prompts``) only sizes fixed-count tests: a test sized by
    time is never stretched past its cap for it.  ``stop_when_failed``: a certain fail
    ends the test at once (a search needs only the verdict); off, it runs on to the
    minimum duration like a pass (a sweep wants every point's figures over a full
    window, not over the few seconds a fail took to become certain).
    ``confidence``: 1 - the largest chance that a limit passes when its true
    exceedance is at its allowance; ``fail_confidence``: likewise for a fail at half.
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
    # Evidence pooled from tests at higher rates of the same config, per limit:
    # (label, judged, over the limit, clustering).  Latency grows with the rate, so
    # their exceedances bound this rate's from above: they count toward a pass here,
    # never toward a fail (see autotune.tuning.ceiling).
    prior: Prior = ()
    # The pass decisions that share the false-pass rate 1 - confidence (Bonferroni):
    # a ceiling search that may pass any of its tests, pooled, divides it among them
    # (a fraction when one test is given several looks' share: ceiling's proof).
    looks: float = 1
    # The safe hypothesis of each limit's sequential test, as a share of its allowance
    # (sequential.ExceedanceTest.safe_share).  Half by default; a ceiling search near
    # the latency floor proves a rate against a higher one (ceiling.PROOF_SAFE_SHARE):
    # its false-pass rate at the allowance is the same, and it can pass an exceedance
    # that sits between half the allowance and the allowance.
    safe_share: float = 0.5
    # A screening test (a search's first, short look at a config): a limit passes on
    # its point estimate (at most the allowance over it, of enough requests to show
    # one percentile), for ranking configs; only a proof's sequential tests make an
    # answer.  A certain fail is a fail either way.
    screen: bool = False

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
        if not self.looks >= 1:
            raise VerdictError(f"looks must be >= 1, got {self.looks}")
        if not 0 < self.safe_share < 1:
            raise VerdictError(f"safe share must be in (0, 1), got {self.safe_share}")
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

    def hard_cap_s(self, slo: SLO) -> float:
        """No test's arrivals last longer than this, at any rate."""
        if self.max_duration_s is not None:
            return max(self.max_duration_s, self.min_s(slo))
        return max(DEFAULT_HARD_CAP_S, 3.0 * self.min_s(slo))

    def decide_n(self, slo: SLO) -> int:
        """Judged requests by which a safe rate passes every limit with 80% chance (a
        screening test: twice what its point estimate needs)."""
        if self.screen:
            return 2 * self.pass_n(slo)
        return max((requests_for_power(limit_test(lim, self), DEFAULT_POWER)
                    for lim in slo.limits), default=0)

    def pass_n(self, slo: SLO) -> int:
        """The fewest judged requests that can pass every limit."""
        if self.screen:
            return max((screen_n(lim) for lim in slo.limits), default=0)
        return max((limit_test(lim, self).min_pass_n() for lim in slo.limits), default=0)

    def max_s(self, slo: SLO, rate: float | None = None) -> float:
        """The cap on a test's arrivals at ``rate``: ``max_duration_s`` when given,
        else what the limits' tests need at that rate, within [3x the minimum, the
        hard cap]."""
        if self.max_duration_s is not None:
            return max(self.max_duration_s, self.min_s(slo))
        # A screening test is short: no longer than its minimum unless its rate needs it.
        floor = (1.0 if self.screen else 3.0) * self.min_s(slo)
        if rate is None or not (rate > 0 and math.isfinite(rate)):
            return floor
        need = self.decide_n(slo) / rate + horizon(slo)
        return min(max(floor, need), self.hard_cap_s(slo))

    def lowest_rate(self, slo: SLO) -> float:
        """The lowest rate at which a test can pass within its hard cap: below it, the
        arrivals of the whole cap are fewer than the limits' tests need."""
        span = self.hard_cap_s(slo) - horizon(slo)
        return self.pass_n(slo) / span if span > 0 else math.inf

    def arrivals_for(self, slo: SLO, rate: float) -> int:
        """Measured requests a test at ``rate`` plans (it may stop sooner): enough for
        the cap's duration."""
        if math.isinf(rate):
            return max(self.min_requests, 1)
        span = self.max_s(slo, rate)
        if self.max_duration_s is None and any(lim.metric in ("tpot", "itl")
                                               for lim in slo.limits):
            # The stop rule may move the cap out by the stays it sees (a TPOT's cohort
            # is judged two longest stays after arrival): room up to the hard cap.
            span = max(span, self.hard_cap_s(slo))
        # Two seconds past the cap, so the stop rule ends the test at the cap rather
        # than the schedule running out a hair before it.
        return max(int(math.ceil(rate * (span + 2.0))) + 1, 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LimitEvidence:
    """One limit over the judged cohort: its sequential test's counts and decision,
    and, for the reader, the percentile (pessimistic: unknown values as over), its
    one-sided upper bound, and the lower bound (optimistic)."""

    label: str
    threshold_s: float
    observed_s: float
    upper_s: float
    lower_s: float
    n: int  # judged values (requests; gaps for ITL)
    late: int  # certainly over the limit
    allowed: int  # the most over the limit that would pass now (-1: none yet)
    exceed: int = 0  # over the limit or unknown (what a pass must survive)
    dispersion: float = 1.0  # the clustering the test deflated its evidence by
    decision: str = "open"  # the sequential test's: pass, fail or open
    to_pass: int | None = None  # more values, none over, before it passes
    # With evidence pooled from higher rates (SteadyState.prior): the totals a pass
    # was judged on (0: nothing pooled).
    pooled_n: int = 0
    pooled_exceed: int = 0
    # What this test lends to a pooled test at a lower rate (sequential.lent).
    lend_n: int = 0
    lend_exceed: int = 0
    # The 90th percentile of each quarter of the cohort: a server whose speed drifts
    # shows here why its clustering is large.
    p90_by_quarter: tuple[float, ...] = ()

    @property
    def passes(self) -> bool:
        return self.decision == SEQ_PASS

    @property
    def fails(self) -> bool:
        return self.decision == SEQ_FAIL

    @property
    def exceedance(self) -> float:
        return self.exceed / self.n if self.n else math.nan

    def to_dict(self) -> dict[str, Any]:
        out = {k: _num(v) for k, v in asdict(self).items()}
        out["exceedance"] = _num(self.exceedance)
        return out


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
    # How old a request must be to be judged (see cohort_horizon).
    horizon_s: float = 0.0

    @property
    def served_share(self) -> float:
        return self.served_rate / self.arrival_rate if self.arrival_rate > 0 else math.nan

    def sentence(self) -> str:
        return f"{self.verdict}: " + "; ".join(self.reasons)

    def lent(self) -> Prior:
        """What this test lends to a pooled test at a lower rate, per limit."""
        return tuple((lim.label, lim.lend_n, lim.lend_exceed, lim.dispersion)
                     for lim in self.limits if lim.lend_n)

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
    # The first token as recorded (no chunk stand-in; inf = none), and where a send,
    # a first token and a TPOT are known: what the records' latency properties read.
    token: np.ndarray
    has_sent: np.ndarray
    has_token: np.ndarray
    has_tpot: np.ndarray
    records: Sequence[RequestRecord] = field(repr=False, default=())

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> _Arrays:
        # A comprehension per field and the arithmetic on arrays: judge builds these at
        # every look, and the records' properties (tpot_s) cost calls per record.
        sched = np.array([r.scheduled_s for r in records], dtype=float)
        sent, has_sent = _known([r.sent_s for r in records])
        token, has_token = _known([r.first_token_s for r in records])
        first = np.array([r.first_token_s if r.first_token_s is not None
                          else r.chunk_times_s[0] if r.chunk_times_s else math.inf
                          for r in records], dtype=float)
        end, done = _known([r.end_s for r in records])
        clean = np.array([r.error is None for r in records], dtype=bool)
        ok, failed = done & clean, done & ~clean
        out = np.array([r.output_tokens for r in records], dtype=float)
        # RequestRecord.tpot_s: (e2e - ttft) / (tokens - 1), in the same order of
        # operations, where the request completed with two tokens, a send and a first.
        has_tpot = ok & (out >= 2) & has_sent & has_token
        tpot = np.full(len(records), math.nan)
        e2e, ttft = end[has_tpot] - sent[has_tpot], token[has_tpot] - sent[has_tpot]
        tpot[has_tpot] = (e2e - ttft) / (out[has_tpot] - 1.0)
        return cls(sched, sent, first, end, ok, failed, out, tpot, token, has_sent,
                   has_token, has_tpot, records)


def _known(values: list[float | None]) -> tuple[np.ndarray, np.ndarray]:
    """(``values`` with None as inf, where not None)."""
    return (np.array([math.inf if v is None else v for v in values], dtype=float),
            np.array([v is not None for v in values], dtype=bool))


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

    ``planned``: measured requests the whole test would send (kept for callers; the
    sequential tests need no plan); ``final``: the test is over (arrivals stopped, so
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
    h = cohort_horizon(slo, a)
    idx = _cohort(a, now - h, final)
    # The steady part: the second half of the arrivals so far (stationarity only).
    steady_from = t0 + 0.5 * at_s
    limits, fails = _judge_limits(a, idx, slo, now, rule)
    st = _stationarity(a, steady_from, t_end, offered_rate, h, rule)
    growth = _growth_failure(a, st, steady_from, t_end, at_s, min_s, rule)
    if growth is not None:
        fails.append(growth)
    cohort_span, goodput_req, goodput_tok, n_failed = _goodput(a, idx, slo)

    if fails:
        verdict, reasons = FAIL, fails
    else:
        need = _needs(limits, slo, rule, st, at_s, min_s, offered_rate)
        if need:
            verdict, reasons = INCONCLUSIVE, need
        else:
            verdict, reasons = PASS, [_pass_reason(limits, int(idx.size), st)]
    return Evidence(
        verdict=verdict, reasons=tuple(reasons), at_s=at_s, cohort=int(idx.size),
        cohort_span_s=cohort_span, limits=tuple(limits), offered_rate=offered_rate,
        arrival_rate=st.arrival_rate, served_rate=st.served_rate, backlog_slope=st.slope,
        backlog_upper=st.upper_slope, backlog_lower=st.lower_slope,
        backlog_allowed=st.allowed_slope,
        failures=n_failed, goodput_requests=goodput_req, goodput_tokens=goodput_tok,
        steady_from_s=steady_from - t0, min_duration_s=min_s, horizon_s=h,
        sent=int(np.count_nonzero(a.sent <= now)),
        completed=int(np.count_nonzero(a.end <= now)))


def _cohort(a: _Arrays, cutoff: float, final: bool) -> np.ndarray:
    """The judged requests, chosen by arrival time (never by outcome, so a fast request
    is not judged before a slow one that arrived with it), in arrival order for the
    clustering; once a final test has nothing running, every request is judged."""
    nothing_running = bool(np.all(a.ok | a.failed))
    idx = np.nonzero((a.sched <= cutoff) | (final & nothing_running))[0]
    return idx[np.argsort(a.sched[idx], kind="stable")]


def _judge_limits(a: _Arrays, idx: np.ndarray, slo: SLO, now: float, rule: SteadyState
                  ) -> tuple[list[LimitEvidence], list[str]]:
    """Each limit's sequential test over the cohort, and the reasons of those shown
    unsafe: a limit fails on its own, whatever the queue does."""
    fails: list[str] = []
    limits: list[LimitEvidence] = []
    for limit in slo.limits:
        ev = _limit_evidence(a, idx, limit, now, rule)
        limits.append(ev)
        if ev.fails:
            # A fail's error bound is at the safe share (a config there fails at most
            # 5% of the time), not at the allowance: 20% over a 25% allowance can fail.
            test = limit_test(limit, rule)
            fails.append(f"{limit.label}: {ev.late} of {ev.n} over {_s(limit.threshold_s)} "
                         f"({ev.late / max(ev.n, 1):.2%}, clustering x{ev.dispersion:.2g}) "
                         f"show with {rule.fail_confidence:.0%} confidence that more than "
                         f"{test.theta0 * 100:.3g}% exceed it, against {test.allowance:.1%} "
                         "allowed")
    return limits, fails


@dataclass(frozen=True)
class _Stationarity:
    """Whether the queue keeps up over the steady part, judged apart from the latencies
    (which count every judged request): arrivals against completions, and the
    backlog's growth with its bounds (None: not bounded)."""

    arr_n: int
    done_n: int
    span: float
    arrival_rate: float
    served_rate: float
    mean_backlog: float
    allowed_slope: float
    slope: float | None
    upper_slope: float | None
    lower_slope: float | None


def _stationarity(a: _Arrays, steady_from: float, t_end: float, offered_rate: float,
                  h: float, rule: SteadyState) -> _Stationarity:
    """Arrivals, completions and the backlog's trend over the steady part, which both
    the fail on growth and the pass (or its missing conditions) rest on."""
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
    return _Stationarity(arr_n, done_n, span, arrival_rate, served_rate, mean_backlog,
                         allowed_slope, slope, upper_slope, lower_slope)


def _growth_failure(a: _Arrays, st: _Stationarity, steady_from: float, t_end: float,
                    at_s: float, min_s: float, rule: SteadyState) -> str | None:
    """The fail reason when the backlog's growth is shown above the allowance, and only
    once that growth cannot be a queue still filling up or wandering; else None."""
    # Growth is only judged once the arrivals have run the minimum duration: before
    # that, a queue near (but under) capacity is still filling up, and its backlog
    # grows for tens of seconds without being overloaded.
    # Nor before the steady half starts two typical stays (p90 of the finished requests'
    # end-to-end latency) after the first arrival: the queue fills for about one stay.
    done_e2e = a.end[a.ok] - a.sent[a.ok]  # masked first: unfinished ends are NaN
    stay = float(np.percentile(done_e2e, 90)) if done_e2e.size else math.inf
    # And a growth must be material in requests, not only in slope: at a few req/s a
    # queue of a handful wanders by more than the allowance's worth in a minute.
    lower_slope = st.lower_slope
    growth = 0.0 if lower_slope is None else lower_slope * max(t_end - steady_from, 0.0)
    material = growth >= max(8.0, 5.0 * math.sqrt(max(st.mean_backlog, 1.0)))
    if (lower_slope is not None and lower_slope > st.allowed_slope and at_s >= min_s
            and at_s >= 4.0 * stay and material):
        return (f"backlog grows {st.slope:.3g} req/s (its {rule.fail_confidence:.0%} lower "
                f"bound {lower_slope:.3g} > {st.allowed_slope:.3g}, "
                f"{rule.backlog_share:.0%} of the offered rate)")
    return None


def _goodput(a: _Arrays, idx: np.ndarray, slo: SLO) -> tuple[float, float, float, int]:
    """(cohort span, goodput in requests/s and tokens/s, failed requests) of the cohort:
    figures the evidence reports whatever the verdict."""
    cohort_span = float(a.sched[idx].max() - a.sched[idx].min()) if idx.size > 1 else 0.0
    good = _good_mask(a, idx, slo)
    per_s = (idx.size - 1) / cohort_span / idx.size if cohort_span > 0 else 0.0
    goodput_req = float(good.sum()) * per_s
    goodput_tok = float(a.out_tokens[idx][good].sum()) * per_s
    n_failed = int(a.failed[idx].sum()) if idx.size else 0
    return cohort_span, goodput_req, goodput_tok, n_failed


def _needs(limits: Sequence[LimitEvidence], slo: SLO, rule: SteadyState, st: _Stationarity,
           at_s: float, min_s: float, offered_rate: float) -> list[str]:
    """What a test that did not fail still lacks to pass (empty: it passes): so an
    inconclusive verdict says what more evidence would settle it."""
    need: list[str] = []
    for ev in limits:
        if not ev.passes:
            more = ("" if ev.to_pass is None
                    else f"; {ev.to_pass} more under it would pass")
            if ev.pooled_n:
                more += (f" (pooled with higher rates: {ev.pooled_exceed} of "
                         f"{ev.pooled_n})")
            need.append(f"{ev.label}: {ev.exceed} of {ev.n} over {_s(ev.threshold_s)} "
                        f"({_pct(ev.exceedance)}, P{_p(ev)} {_s(ev.observed_s)}, "
                        f"clustering x{ev.dispersion:.2g}{_drift(ev)}): not yet shown under "
                        f"{limit_test(_limit(slo, ev.label), rule).allowance:.1%}"
                        f"{more}")
    if at_s < min_s:
        need.append(f"arrivals have run {at_s:.0f} of the {min_s:.0f} s minimum")
    # Completions trail arrivals by the change in backlog over the span, which
    # wanders by a few times the square root of its level in a stable queue.
    slack = 3.0 * math.sqrt(st.mean_backlog + 1.0) if st.span > 0 else 0.0
    if st.arrival_rate > 0 and st.done_n < rule.served_share * st.arr_n - slack:
        need.append(f"served {st.served_rate:.3g} of {st.arrival_rate:.3g} req/s arriving "
                    f"over the steady part (< {rule.served_share:.0%})")
    if math.isfinite(offered_rate):
        backlog = _backlog_need(rule, st)
        if backlog is not None:
            need.append(backlog)
    return need


def _backlog_need(rule: SteadyState, st: _Stationarity) -> str | None:
    """Why the backlog's growth does not yet allow a pass, or None when it does."""
    slope, upper_slope, lower_slope = st.slope, st.upper_slope, st.lower_slope
    allowed_slope = st.allowed_slope
    if upper_slope is None:
        return "too little steady span to bound the backlog's growth"
    if rule.screen and lower_slope is not None and lower_slope >= allowed_slope:
        # A screening test is short: over its few seconds of steady span the
        # backlog of a stable queue wanders by its square root and fills for
        # one stay, so a slope point estimate held half the configs of a 70B
        # model under 40% of their ceilings.  It is dropped on growth shown;
        # the proof bounds the growth.
        return (f"backlog grows {slope:.3g} req/s ({rule.fail_confidence:.0%} "
                f"lower bound {lower_slope:.3g} not under {allowed_slope:.3g}, "
                f"{rule.backlog_share:.0%} of the offered rate)")
    if not rule.screen and upper_slope >= allowed_slope:
        return (f"backlog slope {slope:.3g} req/s, {rule.confidence:.0%} upper "
                f"bound {upper_slope:.3g} not under {allowed_slope:.3g} "
                f"({rule.backlog_share:.0%} of the offered rate)")
    return None


def _pass_reason(limits: Sequence[LimitEvidence], cohort: int, st: _Stationarity) -> str:
    """The one reason a pass gives: every limit's figures and the queue's, so a pass
    shows the margins it rests on."""
    return (", ".join(f"{ev.label} {_s(ev.observed_s)}, {ev.exceed} of {ev.n} "
                      f"over {_s(ev.threshold_s)} ({_pct(ev.exceedance)}, "
                      f"clustering x{ev.dispersion:.2g})" for ev in limits)
            + f" over {cohort} requests; served {st.served_rate:.3g} of "
            f"{st.arrival_rate:.3g} req/s; backlog slope {st.slope or 0.0:.2g} req/s "
            f"(bound {st.upper_slope or 0.0:.2g} < {st.allowed_slope:.2g})")


def cohort_horizon(slo: SLO, a: _Arrays | None = None) -> float:
    """How long after its arrival a request is judged: the end-to-end and first-token
    horizon; with a TPOT or ITL limit also twice the longest stay of the requests
    finished so far, so the cohort's TPOTs are known but for a stray few."""
    h = horizon(slo)
    if a is not None and any(lim.metric in ("tpot", "itl") for lim in slo.limits):
        stays = a.end[a.ok] - a.sent[a.ok]
        if stays.size:
            h = max(h, 2.0 * float(stays.max()))
    return h


def _limit_evidence(a: _Arrays, idx: np.ndarray, limit: Limit, now: float,
                    rule: SteadyState) -> LimitEvidence:
    """One limit's sequential test over the cohort ``idx`` (in arrival order)."""
    test = limit_test(limit, rule)
    if idx.size == 0:
        return LimitEvidence(limit.label, limit.threshold_s, math.inf, math.inf, -math.inf,
                             0, 0, -1, to_pass=test.min_pass_n())
    hi, lo = _limit_values(a, idx, limit, now)
    n = int(hi.size)
    k_hi = int(np.sum(hi > limit.threshold_s))
    k_lo = int(np.sum(lo > limit.threshold_s))
    d = clustering(hi, limit.threshold_s)
    observed = quantile(hi, limit.percentile) if n else math.inf
    upper = quantile_upper_bound(hi, limit.percentile, rule.confidence)
    lower = _lower_bound(lo, limit.percentile, rule.fail_confidence) if lo.size else -math.inf
    decision = test.decide(n, k_hi, k_lo, d, local_clustering(hi, limit.threshold_s))
    if rule.screen and decision != SEQ_FAIL:
        decision = SEQ_PASS if n >= screen_n(limit) and k_hi <= test.allowance * n else "open"
    pn = pk = 0
    pd = d
    for label, n_prior, k_prior, d_prior in rule.prior:
        if label == limit.label:
            pn, pk, pd = pn + n_prior, pk + k_prior, max(pd, d_prior)
    if pn and decision != SEQ_FAIL:
        # A fail needs this rate's own evidence; a pass may lean on the higher rates'.
        pooled = test.decide(n + pn, k_hi + pk, 0, pd)
        decision = SEQ_PASS if pooled == SEQ_PASS else decision
    to_pass = test.requests_to_pass(n + pn, k_hi + pk, pd)
    lend_n, lend_k = test.lent(hi > limit.threshold_s)
    return LimitEvidence(
        limit.label, limit.threshold_s, float(observed), float(upper), float(lower), n,
        k_lo, test.pass_count(n + pn, pd) - pk, exceed=k_hi, dispersion=d,
        decision=decision, to_pass=to_pass, pooled_n=n + pn if pn else 0,
        pooled_exceed=k_hi + pk if pn else 0, lend_n=lend_n, lend_exceed=lend_k,
        p90_by_quarter=level_by_part(hi))


# The clustering above which a drifting level is named as its cause.
_DRIFT_NOTE_CLUSTERING = 10.0


def _drift(ev: LimitEvidence) -> str:
    """Why a large clustering: the server's own level moved over the test (a speed that
    wanders reads as one swing as long as the test, so more requests cannot settle
    it), named with the quarters' 90th percentiles."""
    if ev.dispersion < _DRIFT_NOTE_CLUSTERING or not drifted(ev.p90_by_quarter):
        return ""
    return ("; the level drifted, P90 by quarter "
            + ", ".join(_s(x) for x in ev.p90_by_quarter))


def _limit(slo: SLO, label: str) -> Limit:
    return next(lim for lim in slo.limits if lim.label == label)


def _pct(x: float) -> str:
    return "?" if math.isnan(x) else f"{x:.2%}"


def _p(ev: LimitEvidence) -> str:
    return ev.label.split(":")[0][1:]


def _good_mask(a: _Arrays, idx: np.ndarray, slo: SLO) -> np.ndarray:
    """vLLM's goodput rule per cohort request (metrics.is_good, on the arrays):
    completed and within every limit."""
    good = a.ok[idx]
    for limit in slo.limits:
        good = good & _within(a, idx, limit, good)
    return good


def _within(a: _Arrays, idx: np.ndarray, limit: Limit, good: np.ndarray) -> np.ndarray:
    """Where a completed cohort request's own value of ``limit.metric`` holds, as
    metrics.is_good reads it (unknown: broken; a one-token reply's TPOT: holds); only
    the ``good`` ones are asked (an ITL's per-request percentile is costly)."""
    th = limit.threshold_s
    if limit.metric == "itl":
        held = np.ones(idx.size, dtype=bool)
        for j in np.nonzero(good)[0].tolist():
            held[j] = not own_itl(a.records[int(idx[j])], limit.percentile) > th
        return held
    if limit.metric == "tpot":
        value, known = a.tpot[idx], a.has_tpot[idx]
        return (a.out_tokens[idx] < 2) | (known & ~(value > th))
    start = a.end if limit.metric == "e2e" else a.token
    known = a.has_sent[idx] & (a.has_token[idx] if limit.metric == "ttft" else True)
    value = np.subtract(start[idx], a.sent[idx], out=np.full(idx.size, math.nan),
                        where=known)
    return known & ~(value > th)


def _empty(offered_rate: float, min_s: float) -> Evidence:
    return Evidence(INCONCLUSIVE, ("no measured request yet",), 0.0, 0, 0.0, (), offered_rate,
                    0.0, 0.0, None, None, None, 0.0, 0, 0.0, 0.0, 0.0, min_s)


def _s(x: float) -> str:
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.2f}s"


# ----------------------------------------------------------------------------- fixed count
# A test of a fixed number of requests (no steady-state rule: calibration's shapes,
# `sweep --min-duration count`) is judged on its percentiles and their confidence bounds.


@dataclass(frozen=True)
class LimitCheck:
    """One SLO limit at one probe: the percentile and its one-sided upper bound."""

    label: str
    threshold_s: float
    observed_s: float
    bound_s: float
    n: int  # samples the percentile was taken over

    @property
    def point_ok(self) -> bool:
        return self.observed_s <= self.threshold_s

    @property
    def bound_ok(self) -> bool:
        return self.bound_s <= self.threshold_s

    @property
    def margin(self) -> float:
        """observed / threshold - 1 (inf/nan count as a huge margin)."""
        if math.isnan(self.observed_s):
            return math.inf
        return self.observed_s / self.threshold_s - 1.0

    @property
    def slack(self) -> float:
        """threshold / max(observed, bound): >= 1 when the limit holds with confidence;
        0 when either is infinite.  Roughly linear in rate for a queue (1/latency)."""
        worst = max(self.observed_s, self.bound_s)
        if math.isnan(worst) or math.isinf(worst) or worst <= 0:
            return 0.0 if not worst <= 0 else math.inf
        return self.threshold_s / worst

    @property
    def bound_margin(self) -> float:
        if math.isnan(self.bound_s):
            return math.inf
        return self.bound_s / self.threshold_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "threshold_s": self.threshold_s,
                "observed_s": _num(self.observed_s), "bound_s": _num(self.bound_s),
                "n": self.n, "point_ok": self.point_ok, "bound_ok": self.bound_ok}


def check_limits(summary: Summary, slo: SLO, confidence: float) -> list[LimitCheck]:
    """Each limit's percentile and upper confidence bound over the probe's samples."""
    out = []
    for limit in slo.limits:
        values = summary.samples.get(limit.metric, ())
        n = len(values)
        observed = quantile(values, limit.percentile) if n else math.inf
        bound = quantile_upper_bound(values, limit.percentile, confidence) if n else math.inf
        out.append(LimitCheck(limit.label, limit.threshold_s, observed, bound, n))
    return out


def verdict_of(checks: Sequence[LimitCheck], pruned: bool) -> str:
    """``pass`` only if every point estimate and every bound holds."""
    if pruned or not all(c.point_ok for c in checks):
        return "fail"
    if not all(c.bound_ok for c in checks):
        return "uncertain"
    return "pass"


def binding_of(checks: Sequence[LimitCheck], verdict: str) -> str | None:
    """The limit that fails first: the largest point margin, or for an uncertain
    probe the largest bound margin."""
    if not checks:
        return None
    key = (lambda c: c.bound_margin) if verdict == "uncertain" else (lambda c: c.margin)
    return max(checks, key=key).label


def point_verdict(summary: Summary) -> str:
    """A fixed-count trial's verdict on its SLO check alone (the point percentiles; no
    bound, no steady state): what a study of such tests ranks configs by."""
    return PASS if summary.slo_check is not None and summary.slo_check.met else FAIL
