"""benchmarks/verdict_oc.py: the bound any test obeys, and the verdict's test under it."""

from __future__ import annotations

import pytest

from autotune.tuning.sequential import ExceedanceTest, operating_point
from benchmarks.verdict_oc import best_any_test, requests_for


def test_the_best_any_test_passes_exactly_its_risk_at_the_allowance() -> None:
    assert best_any_test(1500, 0.01, share=1.0) == pytest.approx(0.05)
    powers = [best_any_test(n, 0.01) for n in (500, 1000, 1500, 3000)]
    assert powers == sorted(powers) and 0.05 < powers[0] and powers[-1] < 1.0


def test_eighty_percent_at_half_the_allowance_needs_more_than_1500_requests() -> None:
    n = requests_for(0.8, 0.01)
    assert 1500 < n and best_any_test(n, 0.01) >= 0.8 > best_any_test(n - 10, 0.01)


def test_the_sequential_test_stays_under_the_bound_of_any_test() -> None:
    # A theorem (Neyman-Pearson): were the verdict's test above it within 1,500 requests,
    # its false-pass rate at the allowance would have to exceed 5%.
    test = ExceedanceTest.for_percentile(99)
    at_half = operating_point(test, test.allowance / 2, n_max=1500, at=(1500,))
    at_limit = operating_point(test, test.allowance, n_max=40000)
    assert at_half.p_pass_by[1500] <= best_any_test(1500, test.allowance)
    assert at_limit.p_pass <= 0.05
