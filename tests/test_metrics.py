import math

import numpy as np
import pytest

from autotune.core.metrics import quantile_bounds, quantile_upper_bound, summarize
from autotune.core.records import RequestRecord
from autotune.core.slo import parse_slo


def record(i: int, sent: float, ttft: float, tokens: int, tpot: float, *,
           warmup: bool = False, error: str | None = None) -> RequestRecord:
    first = sent + ttft
    chunks = [first + k * tpot for k in range(tokens)]
    return RequestRecord(
        index=i, scheduled_s=sent, dispatched_s=sent, sent_s=sent, first_token_s=first,
        chunk_times_s=chunks, end_s=chunks[-1], prompt_tokens=10, output_tokens=tokens,
        expected_output_tokens=tokens, status=200 if error is None else 500, error=error,
        warmup=warmup)


def test_vllm_definitions() -> None:
    recs = [record(i, float(i), 0.2, 11, 0.05) for i in range(10)]
    s = summarize(recs)
    assert s.ttft.p50 == pytest.approx(0.2)
    assert s.tpot.mean == pytest.approx(0.05)  # (e2e - ttft) / (tokens - 1)
    assert s.itl.p50 == pytest.approx(0.05)
    assert s.e2e.max == pytest.approx(0.2 + 10 * 0.05)
    # window: first send (0) to last completion (9 + 0.7)
    assert s.duration_s == pytest.approx(9.7)
    assert s.request_throughput == pytest.approx(10 / 9.7)
    assert s.output_throughput == pytest.approx(110 / 9.7)
    assert s.total_token_throughput == pytest.approx(210 / 9.7)


def test_warmup_excluded_from_every_figure() -> None:
    slow_warmup = [record(i, float(i), 5.0, 11, 1.0, warmup=True) for i in range(5)]
    measured = [record(10 + i, 10.0 + i, 0.1, 11, 0.01) for i in range(5)]
    s = summarize(slow_warmup + measured)
    assert s.num_warmup_excluded == 5 and s.num_measured == 5
    assert s.ttft.max == pytest.approx(0.1)
    assert s.window_start_s == pytest.approx(10.0)


def test_failures_never_goodput_and_attainment_counts_them() -> None:
    recs = [record(i, float(i), 0.1, 5, 0.01) for i in range(8)]
    recs += [record(8, 8.0, 0.1, 5, 0.01, error="http 500: boom"),
             record(9, 9.0, 0.1, 5, 0.01, error="truncated: 3 of 5 tokens")]
    s = summarize(recs, slo=parse_slo("10s"))
    assert s.num_failed == 2 and s.num_completed == 8
    assert s.num_good == 8 and s.attainment == pytest.approx(0.8)
    assert s.failure_reasons == {"http 500": 1, "truncated": 1}
    assert s.goodput_tokens == pytest.approx(40 / s.duration_s)
    # 20% failures: p99 is in the failures, so the SLO is missed.
    assert s.meets_slo is False


def test_goodput_counts_only_requests_within_every_limit() -> None:
    fast = [record(i, float(i), 0.1, 5, 0.01) for i in range(6)]
    late = [record(6 + i, 6.0 + i, 3.0, 5, 0.01) for i in range(4)]
    s = summarize(fast + late, slo=parse_slo("p99:e2e<=10s,p99:ttft<=1s"))
    assert s.num_good == 6
    assert s.slo_check is not None and s.slo_check.binding == "p99:ttft"
    assert s.meets_slo is False


def test_send_lag_and_achieved_rate() -> None:
    recs = []
    for i in range(11):
        r = record(i, float(i), 0.1, 3, 0.01)
        r.dispatched_s = r.scheduled_s + 0.002
        recs.append(r)
    s = summarize(recs, offered_rate=1.0)
    assert s.send_lag_p99_s == pytest.approx(0.002)
    assert s.achieved_send_rate == pytest.approx(1.0)
    assert s.scheduled_rate == pytest.approx(1.0)


def test_to_dict_is_json_safe() -> None:
    import json
    s = summarize([record(0, 0.0, 0.1, 3, 0.01)], slo=parse_slo("10s"))
    text = json.dumps(s.to_dict(), allow_nan=False)
    assert "samples" not in text and '"p99_hi": null' in text


def test_quantile_bounds_cover_the_true_p99() -> None:
    rng = np.random.default_rng(7)
    true_p99 = -math.log(0.01)  # exponential(1)
    covered = 0
    for _ in range(200):
        lo, hi = quantile_bounds(rng.exponential(size=1000), 99)
        covered += lo <= true_p99 <= hi
    assert covered / 200 >= 0.9


def test_quantile_upper_bound_needs_enough_samples() -> None:
    assert math.isinf(quantile_upper_bound(np.arange(298.0), 99))
    assert quantile_upper_bound(np.arange(299.0), 99) == 298.0
    lo, hi = quantile_bounds(np.arange(100.0), 99)
    assert math.isinf(hi) and lo < 99
