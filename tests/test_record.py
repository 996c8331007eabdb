"""autotune.tuning.record: the one reader of stored trials, shared by recommend and report."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune.analysis.recommend import view_of
from autotune.report.data import trial_row
from autotune.tuning.record import StoredTrial, goodput_of


def _trial(result: dict[str, Any], *, state: TrialState = TrialState.COMPLETE,
           value: float | None = 900.0, **attrs: Any) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(
        state=state, value=value if state == TrialState.COMPLETE else None,
        params={"max_num_seqs": 64}, distributions={
            "max_num_seqs": CategoricalDistribution([64, 128])},
        user_attrs={"result": result, **attrs})


STEADY = {
    "status": "complete", "feasible": True, "mode": "virtual", "rate": 5.0, "gpus": 2,
    "flags": {"max_num_seqs": 64, "tensor_parallel_size": 2},
    # The whole window's goodput is biased low by the drain; the judged cohort's is not.
    "summary": {"goodput_tokens": 700.0, "goodput_requests": 3.5,
                "output_throughput": 750.0, "e2e": {"p99": 8.0}},
    "evidence": {"goodput_tokens": 900.0, "goodput_requests": 4.5},
}


def test_recommendation_and_report_read_the_same_steady_state_goodput() -> None:
    frozen = _trial(STEADY)
    t = StoredTrial.of(frozen)
    view, row = view_of(t), trial_row(frozen, "s")
    assert view.goodput_tokens == row["goodput_tokens"] == 900.0
    assert view.goodput_requests == row["goodput_requests"] == 4.5
    assert view.p99_e2e_s == row["e2e_p99_s"] == 8.0
    assert view.flags == row["config"] == STEADY["flags"]
    assert view.gpus == row["gpus"] == 2 and view.feasible and row["feasible"]
    assert view.value == row["value"] == 900.0


def test_fixed_count_tests_fall_back_to_the_summary_goodput() -> None:
    fixed = {k: v for k, v in STEADY.items() if k != "evidence"}
    assert goodput_of(fixed) == 700.0
    assert StoredTrial.of(_trial(fixed)).goodput_requests == 3.5


def test_pruned_and_failed_trials_are_never_feasible_and_say_why() -> None:
    pruned = StoredTrial.of(_trial(STEADY, state=TrialState.PRUNED, reason="below_incumbent"))
    assert not pruned.feasible and pruned.objective_value is None
    failed = StoredTrial.of(_trial({}, state=TrialState.FAIL))
    assert failed.status == "failed" and not failed.feasible
    # Without a stored result the sampled server parameters are the config.
    assert failed.flags == {"max_num_seqs": 64}


def test_a_repeated_config_shows_its_twins_probes() -> None:
    probes = [{"index": 0, "rate": 4.0, "verdict": "pass"}]
    twin = StoredTrial.of(_trial({**STEADY, "ceiling": {"probes": probes}}))
    repeat = StoredTrial(number=1, state="COMPLETE", value=900.0,
                         attrs={"result": {**STEADY, "repeat_of": twin.number}})
    assert repeat.probes([twin, repeat]) == probes
    assert repeat.probes() == []


def test_when_the_defaults_are_best_the_recommendation_says_so() -> None:
    from autotune.analysis.recommend import recommend

    worse = {**STEADY, "flags": {"max_num_seqs": 128, "tensor_parallel_size": 2},
             "evidence": {"goodput_tokens": 500.0, "goodput_requests": 2.5}}
    base = StoredTrial(number=0, state="COMPLETE", value=900.0,
                       attrs={"result": STEADY, "baseline": True})
    other = StoredTrial(number=1, state="COMPLETE", value=500.0, attrs={"result": worse})
    rec = recommend([view_of(base), view_of(other)], slo="p99:e2e<=10s")
    assert rec.best.trial == 0
    # Not "1.00x the defaults": the recommendation is the defaults, at their own ceiling.
    assert rec.vs_baseline["same_config"] is True
    assert "defaults were already the best config" in rec.vs_baseline["note"]


def test_versus_the_defaults_on_equal_gpus_and_per_gpu() -> None:
    from autotune.analysis.recommend import equal_gpus

    # TP=4 at 10,000 tok/s against the 1-GPU defaults at 720 tok/s: 13.9x raw, but the
    # defaults as 4 replicas give 2,880 tok/s on the same GPUs.
    fair = equal_gpus(10_000.0, 4, 720.0, 1)
    assert fair is not None and fair["baseline_replicas"] == 4
    assert fair["goodput_ratio_equal_gpus"] == pytest.approx(10_000 / 2_880)
    assert fair["goodput_ratio_per_gpu"] == pytest.approx(2_500 / 720)
    assert "4 replica(s) of 1 GPU(s): 3.47x" in fair["equal_gpus_note"]
    assert equal_gpus(10_000.0, 1, 720.0, 1) is None  # same GPUs: the plain ratio holds
    half = equal_gpus(1_000.0, 1, 3_000.0, 4)  # the defaults on more GPUs: per GPU only
    assert half is not None and "baseline_replicas" not in half
    assert half["goodput_ratio_per_gpu"] == pytest.approx(4 / 3)
