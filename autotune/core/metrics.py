"""From request records to the figures of one load test (pure).

Definitions follow vLLM's ``benchmark_serving.py`` so figures are comparable:
TTFT = first content chunk - send; E2E = last byte - send; TPOT = (E2E - TTFT) /
(output_tokens - 1) per request with more than one output token; ITL = gaps between
consecutive content chunks, pooled over requests; percentiles are numpy's linear ones.
What differs, on purpose: warm-up requests are excluded, and the window is measured
from the first measured send to the last measured completion.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain
from typing import Any

import numpy as np
from scipy.stats import binom

from autotune.core.files import json_safe
from autotune.core.records import RequestRecord
from autotune.core.slo import SLO, SLOCheck, check_samples, quantile

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)


def quantile_bounds(
    values: Sequence[float] | np.ndarray, q: float, confidence: float = 0.95
) -> tuple[float, float]:
    """Distribution-free two-sided confidence interval for the q-th percentile.

    From order statistics: the number of samples below the true quantile is
    Binomial(n, q/100), so ranks (l, u) with P(l <= B < u) >= confidence bracket it.
    Each side is the one-sided bound at (1 + confidence) / 2.  A side that needs more
    samples than there are is infinite (for p99 at 95%, the upper bound needs n >= 368).
    """
    x = np.asarray(values, dtype=float)
    n = x.size
    if n == 0:
        return (-math.inf, math.inf)
    tail = (1.0 - confidence) / 2.0
    lo, hi = _lower_rank(n, q / 100.0, tail), _upper_rank(n, q / 100.0, tail)
    lo_x, hi_x = _ranked(x, (lo, hi))
    return (-math.inf if lo < 1 else lo_x, math.inf if hi > n else hi_x)


def quantile_upper_bound(
    values: Sequence[float] | np.ndarray, q: float, confidence: float = 0.95
) -> float:
    """One-sided upper confidence bound of the q-th percentile (order statistics)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return math.inf
    k = _upper_rank(x.size, q / 100.0, 1.0 - confidence)
    return math.inf if k > x.size else _ranked(x, (k,))[0]


def _ranked(x: np.ndarray, ranks: tuple[int, ...]) -> list[float]:
    """The ``ranks``-th smallest of ``x`` (1-based; nan for a rank outside it), as
    ``np.sort`` orders them: a partition, not a sort, since a load test pools a
    million ITL gaps."""
    kth = sorted({k - 1 for k in ranks if 1 <= k <= x.size})
    part = np.partition(x, kth) if kth else x
    return [float(part[k - 1]) if 1 <= k <= x.size else math.nan for k in ranks]


# Ranks are cached: scipy's binom costs about 0.1 ms a call, and the looks of a search's
# tests ask for the same (n, percentile, confidence) about every other time.
@functools.lru_cache(maxsize=4096)
def _upper_rank(n: int, p: float, alpha: float) -> int:
    # Smallest k with P(B <= k - 1) >= 1 - alpha: the quantile lies below x_(k).
    k = int(binom.ppf(1.0 - alpha, n, p)) + 1
    while k > 1 and binom.cdf(k - 2, n, p) >= 1.0 - alpha:
        k -= 1
    return k


@functools.lru_cache(maxsize=4096)
def _lower_rank(n: int, p: float, alpha: float) -> int:
    # Largest k with P(B >= k) >= 1 - alpha: the quantile lies above x_(k).
    k = int(binom.ppf(alpha, n, p))
    while k < n and binom.sf(k, n, p) >= 1.0 - alpha:
        k += 1
    while k >= 1 and binom.sf(k - 1, n, p) < 1.0 - alpha:
        k -= 1
    return k


@dataclass
class LatencyStats:
    """Seconds.  ``p99_lo``/``p99_hi``: 95% distribution-free bounds of the p99."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float
    p99_lo: float
    p99_hi: float

    @classmethod
    def of(cls, values: Iterable[float] | np.ndarray) -> LatencyStats:
        x = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=float)
        if x.size == 0:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan, -math.inf, math.inf)
        p50, p90, p95, p99 = (float(v) for v in np.percentile(x, PERCENTILES))
        lo, hi = quantile_bounds(x, 99.0)
        return cls(int(x.size), float(x.mean()), p50, p90, p95, p99, float(x.max()), lo, hi)


# How a summary's records were obtained (``Summary.source``), one wording everywhere.
MEASURED = "measured (HTTP)"
SIMULATED = "simulated (virtual time)"
SIMULATED_HTTP = "simulated server (autotune's simulator over HTTP, real time)"


@dataclass
class Summary:
    source: str  # how the records were obtained: "measured (HTTP)", "simulated (virtual time)"
    num_measured: int
    num_completed: int
    num_failed: int
    num_warmup_excluded: int
    failure_reasons: dict[str, int]
    window_start_s: float
    window_end_s: float
    duration_s: float
    offered_rate: float | None
    # The rate of this draw of the arrival process (a Poisson draw of n gaps varies
    # around the offered rate) against the rate the client really sent at.
    scheduled_rate: float
    achieved_send_rate: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    send_lag_p99_s: float
    send_lag_max_s: float
    goodput_requests: float
    goodput_tokens: float
    num_good: int
    attainment: float
    slo: str | None = None
    slo_check: SLOCheck | None = None
    # Requests in flight on average while the measured ones were sent (warm-up ones
    # included: they hold the server too); None with fewer than two sends.
    in_flight_mean: float | None = None
    # Per-request latencies for SLO checks (inf = failed request); not serialized.
    samples: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def meets_slo(self) -> bool | None:
        return None if self.slo_check is None else self.slo_check.met

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("samples")
        data["slo_check"] = None if self.slo_check is None else self.slo_check.to_dict()
        return json_safe(data)

    def how(self) -> str:
        """One sentence that says how the figures were obtained."""
        return (
            f"{self.source}: {self.num_measured} measured requests "
            f"({self.num_completed} completed, {self.num_failed} failed) over a "
            f"{self.duration_s:.1f} s window from the first measured send to the last "
            f"measured completion; {self.num_warmup_excluded} warm-up requests excluded"
        )


def _rate_of(times: Sequence[float]) -> float:
    """Events per second over the span of ``times`` ((n - 1) gaps)."""
    if len(times) < 2:
        return 0.0
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else 0.0


def _reason(record: RequestRecord) -> str:
    if record.error is None:
        return "unfinished"
    return record.error.split(":", 1)[0].strip() or "error"


def own_itl(record: RequestRecord, percentile: float) -> float:
    """A request's own inter-token latency at ``percentile`` of its gaps (0 with none),
    what an ITL limit judges it by."""
    gaps = record.itls_s
    return quantile(gaps, percentile) if gaps else 0.0


def is_good(record: RequestRecord, slo: SLO | None) -> bool:
    """vLLM's goodput rule per request: every limit's metric for this request holds.

    For ITL a request is judged by its own gaps at the limit's percentile.
    """
    if not record.ok:
        return False
    if slo is None:
        return True
    for limit in slo.limits:
        if limit.metric == "itl":
            value = own_itl(record, limit.percentile)
        else:
            value = getattr(record, f"{limit.metric}_s")
            if value is None:
                # A one-token reply has no TPOT: the limit cannot be broken.
                if limit.metric == "tpot" and record.output_tokens < 2:
                    continue
                return False
        if value > limit.threshold_s:
            return False
    return True


def slo_samples(measured: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    """Per-request latencies for SLO percentiles, failures as ``inf``."""
    return _slo_samples(measured, _itl_gaps(measured)[1])


def _slo_samples(measured: Sequence[RequestRecord], itl: np.ndarray
                 ) -> dict[str, np.ndarray]:
    """:func:`slo_samples` with its ITL samples (``_itl_gaps``) given."""
    inf = math.inf
    e2e: list[float] = []
    ttft: list[float] = []
    tpot: list[float] = []
    for r in measured:
        if not r.ok:
            e2e.append(inf)
            ttft.append(inf)
            tpot.append(inf)
            continue
        # ok does not imply a send time; without one the latency is unknown (NaN), not a
        # failure (inf).
        e2e.append(r.e2e_s if r.e2e_s is not None else math.nan)
        ttft.append(r.ttft_s if r.ttft_s is not None else inf)
        if r.tpot_s is not None:
            tpot.append(r.tpot_s)
    out = {k: np.asarray(v, dtype=float) for k, v in (("e2e", e2e), ("ttft", ttft),
                                                       ("tpot", tpot))}
    out["itl"] = itl
    return out


def _itl_gaps(measured: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(every completed request's ``itls_s``, pooled in order; the same with each
    failed request as one ``inf`` in its place), on arrays: a load test streams a
    million chunks, and a list of gaps per request cost most of its summary."""
    ok = np.array([r.ok for r in measured], dtype=bool)
    counts = np.array([len(r.chunk_times_s) for r in measured], dtype=np.intp)
    times = np.fromiter(chain.from_iterable(r.chunk_times_s for r in measured), float,
                        int(counts.sum()))
    owner = np.repeat(np.arange(len(measured)), counts)
    # A gap between two chunks of one completed request, not across two requests.
    keep = (owner[1:] == owner[:-1]) & ok[owner[1:]]
    gaps, of = (times[1:] - times[:-1])[keep], owner[1:][keep]
    failed = np.nonzero(~ok)[0]
    return gaps, np.insert(gaps, np.searchsorted(of, failed), math.inf)


def summarize(
    records: Sequence[RequestRecord],
    *,
    slo: SLO | None = None,
    offered_rate: float | None = None,
    source: str = MEASURED,
) -> Summary:
    """Figures of one load test.  Warm-up records are dropped first."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    sent = [r.sent_s for r in measured if r.sent_s is not None]
    ends = [r.end_s for r in measured if r.end_s is not None]
    start = min(sent) if sent else (min((r.scheduled_s for r in measured), default=0.0))
    end = max(ends) if ends else start
    duration = max(end - start, 0.0)
    per_s = (1.0 / duration) if duration > 0 else 0.0

    dispatched = [r.dispatched_s for r in measured if r.dispatched_s is not None]
    achieved_send = _rate_of(dispatched)
    lags = [lag for r in measured if (lag := r.send_lag_s) is not None]

    good = [r for r in ok if is_good(r, slo)]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    gaps, itl_samples = _itl_gaps(measured)
    samples = _slo_samples(measured, itl_samples)

    summary = Summary(
        source=source,
        num_measured=len(measured),
        num_completed=len(ok),
        num_failed=len(measured) - len(ok),
        num_warmup_excluded=len(records) - len(measured),
        failure_reasons=dict(Counter(_reason(r) for r in measured if not r.ok)),
        window_start_s=start,
        window_end_s=end,
        duration_s=duration,
        offered_rate=offered_rate,
        scheduled_rate=_rate_of([r.scheduled_s for r in measured]),
        achieved_send_rate=achieved_send,
        request_throughput=len(ok) * per_s,
        output_throughput=out_tokens * per_s,
        total_token_throughput=(out_tokens + in_tokens) * per_s,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        ttft=LatencyStats.of(r.ttft_s for r in ok if r.ttft_s is not None),
        tpot=LatencyStats.of(r.tpot_s for r in ok if r.tpot_s is not None),
        itl=LatencyStats.of(gaps),
        e2e=LatencyStats.of(r.e2e_s for r in ok if r.e2e_s is not None),
        send_lag_p99_s=float(np.percentile(lags, 99)) if lags else math.nan,
        send_lag_max_s=max(lags) if lags else math.nan,
        goodput_requests=len(good) * per_s,
        goodput_tokens=sum(r.output_tokens for r in good) * per_s,
        num_good=len(good),
        attainment=len(good) / len(measured) if measured else 0.0,
        slo=None if slo is None else str(slo),
        samples=samples,
    )
    if slo is not None:
        summary.slo_check = check_samples(samples, slo)
    summary.in_flight_mean = in_flight_over_sends(records)
    return summary


def in_flight_over_sends(records: Sequence[RequestRecord]) -> float | None:
    """The time average of the requests in flight (every record, warm-up included)
    from the first measured send to the last: exact, where Little's law (send rate
    times mean latency) is not over a short window, and never more than a closed
    loop's users.  (Over the window to the last reply instead, the drain after the last
    send read 52.4 for 59 users kept in flight.)"""
    sends = [r.sent_s for r in records if not r.warmup and r.sent_s is not None]
    if len(sends) < 2 or max(sends) <= min(sends):
        return None
    t0, t1 = min(sends), max(sends)
    busy = sum(max(0.0, min(t1 if r.end_s is None else r.end_s, t1) - max(r.sent_s, t0))
               for r in records if r.sent_s is not None)
    return busy / (t1 - t0)
