"""The validation run's sentence: which figure belongs to which limit."""

from __future__ import annotations

from autotune.validation import Validation, ValidationRun


def test_each_validated_percentile_names_its_metric() -> None:
    run = ValidationRun(rate=64.31, verdict="pass", duration_s=288.0, requests=18680,
                        percentiles={"p99:e2e": 8.29, "p99:ttft": 0.0651}, reasons=(),
                        source="simulated (virtual time)", goodput_tokens=12227.0)
    text = Validation(duration_s=300.0, runs=[run]).sentence()
    # Before: "P99 8.29 s, P99 65.1 ms", two bare P99s for two limits.
    assert text.startswith("validated (simulated, 5 min): P99 e2e 8.29 s, P99 ttft 65.1 ms ")
    assert "over 18680 requests in 4.8 min at 64.31 req/s" in text
    failed = Validation(duration_s=300.0, runs=[ValidationRun(
        rate=70.0, verdict="fail", duration_s=40.0, requests=2000,
        percentiles={"p99:e2e": 12.0}, reasons=("p99:e2e: 12 s",), source="measured")])
    assert failed.sentence().startswith("not validated: 1 runs of 5 min down to 70 req/s")
