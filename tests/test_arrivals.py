import numpy as np
import pytest
from scipy import stats

from autotune.workload.arrivals import arrival_offsets


@pytest.mark.parametrize("process", ["poisson", "gamma", "constant"])
def test_offered_rate_is_exact_for_every_draw(process: str) -> None:
    for seed in range(20):
        t = arrival_offsets(300, 5.0, process=process, burstiness=0.5, seed=seed)
        assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
        assert (len(t) - 1) / t[-1] == pytest.approx(5.0)


def test_poisson_gaps_stay_exponential() -> None:
    gaps = np.diff(arrival_offsets(5000, 10.0, seed=3))
    assert stats.kstest(gaps, "expon", args=(0, 0.1)).pvalue > 0.01
    # and the test can tell a constant schedule apart
    const = np.diff(arrival_offsets(5000, 10.0, process="constant"))
    assert stats.kstest(const, "expon", args=(0, 0.1)).pvalue < 1e-6


def test_bursty_gaps_vary_more() -> None:
    cv = {b: np.std(g := np.diff(arrival_offsets(5000, 10.0, process="gamma",
                                                  burstiness=b, seed=1))) / g.mean()
          for b in (0.25, 1.0, 4.0)}
    assert cv[0.25] > 1.5 > cv[1.0] > 0.8 > cv[4.0]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(10, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(10, 1.0, burstiness=0)
    assert np.all(arrival_offsets(5, float("inf")) == 0)
