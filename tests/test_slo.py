import math

import numpy as np
import pytest

from autotune.core.slo import (
    MAX_MARGIN,
    SLOError,
    check_samples,
    combine,
    parse_duration,
    parse_slo,
    quantile,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10s", 10.0), ("500ms", 0.5), ("1.5m", 90.0), (" 2 s ", 2.0), ("2h", 7200.0)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_short_form_is_p99_e2e() -> None:
    slo = parse_slo("10s")
    assert [(x.metric, x.percentile, x.threshold_s) for x in slo.limits] == [("e2e", 99.0, 10.0)]


def test_full_forms_joined() -> None:
    slo = parse_slo("p99:e2e<=10s,p90:ttft<=2s,p99:tpot<=80ms")
    assert [(x.metric, x.percentile, x.threshold_s) for x in slo.limits] == [
        ("e2e", 99.0, 10.0), ("ttft", 90.0, 2.0), ("tpot", 99.0, 0.08)]
    assert str(slo) == "p99:e2e<=10s,p90:ttft<=2s,p99:tpot<=80ms"
    assert parse_slo(str(slo)) == slo


@pytest.mark.parametrize(
    "bad", ["", "10", "0s", "-1s", "fast", "p99:e2e<10s", "p99:foo<=1s", "p100:e2e<=1s",
            "10s,", "p99:e2e<=1s,p99:e2e<=2s", "p99:ttft<=soon"]
)
def test_rejects_with_accepted_forms(bad: str) -> None:
    with pytest.raises(SLOError) as info:
        parse_slo(bad)
    assert "\n" not in str(info.value)


def test_unknown_form_shows_accepted_forms() -> None:
    with pytest.raises(SLOError, match="accepted forms"):
        parse_slo("fast")


def test_combine_cli_options() -> None:
    slo = combine("10s", "p90:ttft<=2s")
    assert [x.label for x in slo.limits] == ["p99:e2e", "p90:ttft"]
    with pytest.raises(SLOError, match="no SLO given"):
        combine(None, None)


def test_quantile_matches_numpy_without_failures() -> None:
    x = np.random.default_rng(1).exponential(size=501)
    for q in (50, 90, 99, 99.9):
        assert quantile(x, q) == pytest.approx(np.percentile(x, q))


def test_failures_count_as_infinitely_late() -> None:
    # 98 fast requests and 2 failures: the p99 reaches into the failures.
    values = [1.0] * 98 + [math.inf] * 2
    assert math.isinf(quantile(values, 99))
    check = check_samples({"e2e": values}, parse_slo("10s"))
    assert not check.met
    assert check.margins["p99:e2e"] == MAX_MARGIN
    # One failure in 1000 stays under the p99.
    ok = check_samples({"e2e": [1.0] * 999 + [math.inf]}, parse_slo("10s"))
    assert ok.met and ok.margins["p99:e2e"] == pytest.approx(-0.9)


def test_margins_and_binding_limit() -> None:
    slo = parse_slo("p99:e2e<=10s,p99:ttft<=1s")
    samples = {"e2e": np.full(100, 8.0), "ttft": np.full(100, 1.5)}
    check = check_samples(samples, slo)
    assert check.margins["p99:e2e"] == pytest.approx(-0.2)
    assert check.margins["p99:ttft"] == pytest.approx(0.5)
    assert check.binding == "p99:ttft" and check.failed == ("p99:ttft",) and not check.met


def test_no_samples_misses_the_limit() -> None:
    check = check_samples({"e2e": []}, parse_slo("10s"))
    assert not check.met
