"""The sequential test behind every latency limit (pure).

"P99 ≤ L" means "fewer than 1% of requests exceed L".  A fixed-size test of a
percentile cannot conclude when the true share over L (the *exceedance*) is close to
the allowance, so each limit is judged instead by Wald's sequential probability ratio
test on its exceedance count, with an indifference zone:

* H1, *unsafe*: the exceedance is the allowance ``a`` (1% for a P99);
* H0, *safe*: it is ``safe_share`` of the allowance (half: 0.5% for a P99).

After ``n`` judged requests of which ``k`` exceeded L, the log likelihood ratio is
``llr = k·ln(θ1/θ0) + (n-k)·ln((1-θ1)/(1-θ0))``.  The test *passes* once
``llr ≤ ln(false_pass)`` and *fails* once ``llr ≥ -ln(false_fail)``.

Why the error rates hold whatever the look schedule: under H1 the likelihood ratio
``θ0-likelihood / θ1-likelihood`` is a non-negative martingale of mean 1, so by Ville's
inequality it ever reaches ``1/false_pass`` with probability at most ``false_pass``.
That bound holds for any stopping rule: looks every few seconds, a test cut at its
time cap (a cut only turns would-be passes into "not shown safe"), a fail that stops
the test early.  An exceedance above the allowance only makes a pass rarer (the count
is stochastically larger), so ``P(pass) ≤ false_pass`` whenever the true exceedance is
at or above the allowance.  The same argument under H0 bounds a false fail.

Latencies under load are correlated: a queue that is long for a few seconds makes many
consecutive requests late.  Exceedance counts are then over-dispersed, and a binomial
test would be overconfident.  The test divides its log likelihood ratio by the
*dispersion* ``D ≥ 1`` of the count over the whole test (the variance-inflation, or
quasi-likelihood, correction, which moves both boundaries out by the factor ``D``, so a
clustered tail needs ``D`` times the evidence).  :func:`clustering` estimates it from
the test's own requests: overlapping batch counts give the dispersion over a tenth of
the test, and its growth with the batch length (:func:`_growth`) carries it to the
whole test, because near capacity the queue swings over minutes and short batches see
only part of the variance.  ``tests/test_sequential.py`` checks the false-pass rate on
queues near capacity; benchmark 8b (``benchmarks/clustering_truth.py``) on the simulated scenario
configs, against many independent runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from autotune.core.errors import AutotuneError


class SequentialError(AutotuneError, ValueError):
    """A sequential test that cannot be built; the message says how to fix it."""


PASS, FAIL, OPEN = "pass", "fail", "open"


@dataclass(frozen=True)
class ExceedanceTest:
    """Wald's SPRT on the count of requests over one limit (see the module doc)."""

    allowance: float  # the share of requests allowed over the limit: 0.01 for a P99
    safe_share: float = 0.5  # the safe hypothesis, as a share of the allowance
    false_pass: float = 0.05  # P(pass) at most this when the exceedance >= allowance
    false_fail: float = 0.05  # P(fail) at most this when it is <= safe_share x allowance

    def __post_init__(self) -> None:
        if not 0.0 < self.allowance < 0.5:
            raise SequentialError(f"allowance must be in (0, 0.5), got {self.allowance:g}: "
                                  "a percentile between 50 and 100")
        if not 0.0 < self.safe_share < 1.0:
            raise SequentialError(f"safe share must be in (0, 1), got {self.safe_share:g}")
        for name in ("false_pass", "false_fail"):
            v = getattr(self, name)
            if not 0.0 < v < 0.5:
                raise SequentialError(f"{name} must be in (0, 0.5), got {v:g}")

    @classmethod
    def for_percentile(cls, percentile: float, *, false_pass: float = 0.05,
                       false_fail: float = 0.05, safe_share: float = 0.5) -> ExceedanceTest:
        return cls(allowance=1.0 - percentile / 100.0, safe_share=safe_share,
                   false_pass=false_pass, false_fail=false_fail)

    @property
    def theta0(self) -> float:
        return self.safe_share * self.allowance

    @property
    def theta1(self) -> float:
        return self.allowance

    @property
    def _g1(self) -> float:  # log LR of one exceedance
        return math.log(self.theta1 / self.theta0)

    @property
    def _g0(self) -> float:  # log LR of one request under the limit (negative)
        return math.log((1.0 - self.theta1) / (1.0 - self.theta0))

    def llr(self, n: float, k: float) -> float:
        """log(θ1-likelihood / θ0-likelihood) of ``k`` exceedances in ``n`` requests."""
        return k * self._g1 + (n - k) * self._g0

    def decide(self, n: int, k_pass: int, k_fail: int | None = None,
               dispersion: float = 1.0, fail_dispersion: float | None = None) -> str:
        """PASS, FAIL or OPEN after ``n`` judged requests.

        ``k_pass`` counts every request that may exceed (unknowns as over: what a pass
        must survive); ``k_fail`` those certain to (unknowns as under: what a fail
        needs; default ``k_pass``).  ``dispersion`` >= 1 deflates the evidence;
        ``fail_dispersion`` that of a fail (default ``dispersion``)."""
        d = max(float(dispersion), 1.0)
        df = d if fail_dispersion is None else max(float(fail_dispersion), 1.0)
        if self.llr(n, k_pass if k_fail is None else k_fail) / df >= -math.log(self.false_fail):
            return FAIL
        if self.llr(n, k_pass) / d <= math.log(self.false_pass):
            return PASS
        return OPEN

    def pass_count(self, n: int, dispersion: float = 1.0) -> int:
        """The most exceedances among ``n`` requests that still pass (-1: none can)."""
        d = max(float(dispersion), 1.0)
        return math.floor((d * math.log(self.false_pass) - n * self._g0)
                          / (self._g1 - self._g0) + 1e-9)

    def fail_count(self, n: int, dispersion: float = 1.0) -> int:
        """The fewest exceedances among ``n`` requests that fail the limit."""
        d = max(float(dispersion), 1.0)
        return math.ceil((-d * math.log(self.false_fail) - n * self._g0)
                         / (self._g1 - self._g0) - 1e-9)

    def min_pass_n(self, dispersion: float = 1.0) -> int:
        """The fewest judged requests that can pass (all under the limit)."""
        d = max(float(dispersion), 1.0)
        return math.ceil(d * math.log(self.false_pass) / self._g0 - 1e-9)

    def lent(self, indicators: np.ndarray, stop_at: float = math.log(4.0)
             ) -> tuple[int, int]:
        """What a test's 0/1 exceedances (in arrival order) lend to a pooled test:
        (requests, exceedances) up to the first moment its log likelihood ratio
        reached ``stop_at`` (all of them if it never did).  That moment is a stopping
        time, so the pooled likelihood ratio stays a supermartingale under the unsafe
        hypothesis (Ville's bound holds), and a test that went on to fail costs a pool
        at most a factor ``exp(stop_at)``, not all its exceedances."""
        x = np.asarray(indicators, dtype=float)
        if x.size == 0:
            return 0, 0
        k = np.cumsum(x)
        path = k * (self._g1 - self._g0) + np.arange(1, x.size + 1) * self._g0
        over = np.nonzero(path >= stop_at)[0]
        stop = int(over[0]) + 1 if over.size else int(x.size)
        return stop, int(k[stop - 1])

    def requests_to_pass(self, n: int, k: int, dispersion: float = 1.0) -> int | None:
        """More requests needed, none of them over the limit, before ``k`` in ``n``
        passes (0: it passes now; None: it can no longer pass before failing)."""
        if self.fail_count(n, dispersion) <= k:
            return None
        d = max(float(dispersion), 1.0)
        need = (d * math.log(self.false_pass) - k * (self._g1 - self._g0)) / self._g0
        return max(math.ceil(need - 1e-9) - n, 0)


@dataclass(frozen=True)
class OperatingPoint:
    """Exact behaviour of a test on independent requests at one true exceedance."""

    exceedance: float
    p_pass: float  # pass by ``n_max``
    p_fail: float  # fail by ``n_max``
    p_open: float  # undecided at ``n_max`` (for the ceiling: not shown safe)
    p_pass_by: dict[int, float]  # P(pass within n requests) at the asked n
    expected_n: float  # expected judged requests to a decision (or n_max)


def operating_point(test: ExceedanceTest, exceedance: float, *, n_max: int = 20000,
                    at: tuple[int, ...] = (1500,)) -> OperatingPoint:
    """P(pass), P(fail) and the expected sample size of ``test`` when requests exceed
    independently with probability ``exceedance``, looked at after every request
    (exact: a dynamic programme over the exceedance count)."""
    return _operating_point(test, float(exceedance), int(n_max), tuple(sorted(at)))


@functools.lru_cache(maxsize=256)
def _operating_point(test: ExceedanceTest, p: float, n_max: int, at: tuple[int, ...]
                     ) -> OperatingPoint:
    width = test.fail_count(n_max) + 2
    prob = np.zeros(width)
    prob[0] = 1.0
    passed = failed = expected = 0.0
    by: dict[int, float] = {}
    for n in range(1, n_max + 1):
        # One more request: the count stays (1 - p) or moves up one (p).
        nxt = prob * (1.0 - p)
        nxt[1:] += prob[:-1] * p
        prob = nxt
        lo, hi = test.pass_count(n), test.fail_count(n)
        if lo >= 0:
            passed_now = float(prob[: lo + 1].sum())
            prob[: lo + 1] = 0.0
        else:
            passed_now = 0.0
        failed_now = float(prob[hi:].sum()) if hi < width else 0.0
        if hi < width:
            prob[hi:] = 0.0
        passed += passed_now
        failed += failed_now
        expected += n * (passed_now + failed_now)
        if n in at:
            by[n] = passed
        if passed + failed > 1.0 - 1e-12:
            break
    open_ = max(1.0 - passed - failed, 0.0)
    for n in at:
        by.setdefault(n, passed)
    return OperatingPoint(p, passed, failed, open_, by, expected + n_max * open_)


def dispersion(indicators: np.ndarray, batches: int = 20) -> float:
    """The index of dispersion of 0/1 ``indicators`` (in arrival order) over
    ``batches`` contiguous equal batches: the variance of the batch counts over the
    binomial variance (1 for independent requests, more when they cluster); 1 when
    there are too few events to tell."""
    x = np.asarray(indicators, dtype=float)
    n = x.size
    total = float(x.sum())
    if n < 2 * batches or total < batches:
        return 1.0
    p = total / n
    edges = np.linspace(0, n, batches + 1).astype(int)
    counts = np.add.reduceat(x, edges[:-1])
    sizes = np.diff(edges).astype(float)
    expected = sizes * p
    var = float(np.sum((counts - expected) ** 2)) / (batches - 1)
    binom = float(np.mean(sizes)) * p * (1.0 - p)
    return max(var / binom, 1.0) if binom > 0 else 1.0


# Batches per estimate at the base scale, per fail's estimate, and the batch counts the
# growth is read over.
_BASE_BATCHES, _FINE_BATCHES = 10, 20
_SLOPE_BATCHES = (40, 20, 10, 5)
# A frequent level's least rise over the median, as a share of the way to the limit,
# and the relative width of a tie (see _frequent_levels and _over).
_TAIL_RISE = 0.01
_TIE = 1e-9
# The prefixes (shares of the judged requests) whose estimates are averaged.
_PREFIXES = (0.8, 0.85, 0.9, 0.95, 1.0)


def clustering(values: np.ndarray, threshold: float) -> float:
    """The dispersion a limit's test divides its evidence by, for ``values`` in arrival
    order: the larger of the estimate over all of them and the mean of the estimates
    over their last five prefixes (80% to 100%).

    The truth only grows with the sample (the count's variance over more requests
    takes in slower swings), so an estimate that dips below its recent values is noise;
    a test that may stop at any look would otherwise stop at a dip (while this estimate
    was built, on 48 simulated runs of the A100 scenario's best config at each of 90%
    and 100% of its ceiling, the limit where 1% exceed it, allowing the dips let 9 runs
    pass instead of 3)."""
    v = np.asarray(values, dtype=float)
    n = v.size
    found = [_clustering_now(v[: int(n * share)], threshold) for share in _PREFIXES]
    return max(found[-1], float(np.mean(found)))


def local_clustering(values: np.ndarray, threshold: float) -> float:
    """The dispersion a fail divides its evidence by: over batches of a twentieth of
    ``values``, at the limit and at their 90th and 95th percentiles, with no growth.

    A fail's risk is a safe config refused (capacity lost, never safety), and an
    overload's exceedances are a trend, which the growth would read as one swing as long
    as the test: no overload could fail before the backlog's check (after the minimum
    duration) if a fail had to outweigh it."""
    v = np.asarray(values, dtype=float)
    if v.size < 2 * _FINE_BATCHES:
        return 1.0
    return max(dispersion(_over(v, lv), _FINE_BATCHES)
               for lv in [threshold] + _frequent_levels(v, threshold))


def _clustering_now(v: np.ndarray, threshold: float) -> float:
    """The dispersion of the count over all of ``v``: the largest dispersion over
    overlapping batches of a tenth of ``v``, at the limit and at the 90th and 95th
    percentiles of ``v`` (frequent enough to show how the queue's slow swings cluster
    the tail before the rare ones at the limit can), times its growth from a tenth of
    the sample to all of it (see :func:`_growth`)."""
    if v.size < 2 * _FINE_BATCHES:
        return 1.0
    frequent = _frequent_levels(v, threshold)
    running = {lv: _running(_over(v, lv)) for lv in [threshold, *frequent]}
    base = max(_overlapping(r, _BASE_BATCHES) for r in running.values())
    return base * float(_BASE_BATCHES) ** _growth(v.size, [running[lv] for lv in frequent])


def level_by_part(values: np.ndarray, q: float = 0.9, parts: int = 4) -> tuple[float, ...]:
    """The ``q`` quantile of the known ``values`` in each of ``parts`` consecutive parts
    (arrival order): how the latency level moved over a test; () when a part has too
    few values to tell."""
    v = np.asarray(values, dtype=float)
    chunks = [c[np.isfinite(c)] for c in np.array_split(v, parts)]
    if any(c.size < 20 for c in chunks):
        return ()
    return tuple(float(np.quantile(c, q)) for c in chunks)


def drifted(levels: tuple[float, ...], ratio: float = 1.5) -> bool:
    """Whether the level moved by more than ``ratio`` between parts of a test."""
    return bool(levels) and min(levels) > 0 and max(levels) / min(levels) > ratio


def _frequent_levels(v: np.ndarray, threshold: float) -> list[float]:
    """The 90th and 95th percentiles of ``v`` that rise above its median by more than
    ``_TAIL_RISE`` of the way to ``threshold``.

    A level closer to the median marks how a steady schedule orders its requests, not a
    swing that could carry them to the limit: in a closed loop of identical requests on
    the simulator the 95th percentile was 3.5 ms over a median of 1.51 s, under an 8 s
    limit, and its indicator's pattern over the test read as a clustering of x100, so a
    test with none of 2,713 requests over the limit could not pass."""
    finite = v[np.isfinite(v)]
    if not finite.size:
        return []
    mid, *tail = (float(q) for q in np.quantile(finite, (0.5, 0.90, 0.95)))
    rise = max(1e-6 * abs(mid), _TAIL_RISE * (threshold - mid))
    return [lv for lv in tail if lv > mid + rise]


def _over(v: np.ndarray, level: float) -> np.ndarray:
    """Which of ``v`` exceed ``level``, values within ``_TIE`` of it counting as at it:
    identical requests on the simulator end within float noise of each other, and that
    noise is no exceedance (at 60 users, the 90th percentile and the maximum were the
    same latency to 13 digits, and the noise's pattern read as a clustering of x100)."""
    return v > level + _TIE * abs(level)


def _running(indicators: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(np.asarray(indicators, dtype=float))))


def _overlapping(running: np.ndarray, batches: int) -> float:
    """:func:`dispersion` over every window of a ``batches``-th of the indicators whose
    running count is ``running`` (overlapping batch means: the same estimate with about
    1.5 times the degrees of freedom of disjoint batches); 1 when there are too few
    events to tell."""
    n = running.size - 1
    size = n // batches
    total = float(running[-1])
    if size < 1 or n < 2 * batches or total < batches or total >= n:
        return 1.0
    p = total / n
    sums = running[size:] - running[:-size]
    # The windows' squared deviations, scaled as Meketon and Schmeiser's estimator.
    var = float(np.sum((sums - size * p) ** 2)) * n / ((n - size + 1) * (n - size))
    return max(var / (size * p * (1.0 - p)), 1.0)


def _growth(n: int, levels: list[np.ndarray]) -> float:
    """How the dispersion grows with the batch length, as the exponent ``b`` of
    ``D(length) ~ length ** b`` (0: correlations shorter than a batch; 1: a swing as
    long as the sample), in [0, 1]: the weighted least-squares slope of log D against
    log length over batches of a 40th to a 5th of the sample, at the frequent levels
    (``levels``: their running exceedance counts over ``n`` requests).

    A queue near its capacity swings over minutes: across 24 simulated runs of the A100
    scenario's best config at its ceiling, the count's dispersion was 3.7 over 1,000
    requests and 10 over 8,000, so one measured over short batches is several times too
    small for the whole test (the aggregated-variance reading of long-range dependence;
    Hurst exponent (1 + b) / 2).
    The slope over four lengths and overlapping batches is about a third less noisy
    than the ratio of two lengths, and each unit of noise in it multiplies the
    estimate."""
    if n < 2 * _SLOPE_BATCHES[0] or not levels:
        return 0.0
    logs = np.log([n / b for b in _SLOPE_BATCHES])
    w = np.array([b - 1.0 for b in _SLOPE_BATCHES])  # log D's precision ~ its dof
    dx = logs - np.average(logs, weights=w)
    num = den = 0.0
    for running in levels:
        logd = np.log([_overlapping(running, b) for b in _SLOPE_BATCHES])
        num += float(np.sum(w * dx * (logd - np.average(logd, weights=w))))
        den += float(np.sum(w * dx * dx))
    return min(max(num / den, 0.0), 1.0) if den > 0 else 0.0


# Which clustering a pass is deflated by (see :func:`judge_series`).
Clustered = Literal["whole", "local", "none"]


def judge_series(test: ExceedanceTest, values: np.ndarray, threshold: float, *, look: int,
                 clustered: Clustered = "whole",
                 min_pass_n: int = 0) -> tuple[str, int]:
    """``test`` on latencies in arrival order, looked at every ``look`` requests as the
    verdict does (no pass before ``min_pass_n`` requests, a fail at any look): the
    decision and the requests it took (OPEN and all of them if none).  ``clustered``:
    a pass deflated by :func:`clustering` (the verdict's), by :func:`local_clustering`
    alone (short batches, no growth: the verdict before benchmark 8b), or not at all."""
    v = np.asarray(values, dtype=float)
    for m in range(look, v.size + 1, look):
        x = v[:m]
        k = int(np.sum(x > threshold))
        if clustered == "none":
            got = test.decide(m, k, k)
        else:
            local = local_clustering(x, threshold)
            got = test.decide(m, k, k, clustering(x, threshold) if clustered == "whole"
                              else local, local)
        if got == PASS and m < min_pass_n:
            continue
        if got != OPEN:
            return got, m
    return OPEN, int(v.size)


@functools.lru_cache(maxsize=64)
def requests_for_power(test: ExceedanceTest, power: float = 0.8) -> int:
    """Judged requests by which ``test`` passes with probability ``power`` when the
    exceedance is at the safe hypothesis (independent requests, exact)."""
    n_max = int(math.ceil(60.0 / test.allowance))
    step = max(n_max // 120, 1)
    grid = tuple(range(step, n_max + 1, step))
    op = _operating_point(test, test.theta0, n_max, grid)
    return next((n for n in grid if op.p_pass_by[n] >= power), n_max)
