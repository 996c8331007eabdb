"""autotune.record: the one reader of stored trials, shared by recommend and report."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune.recommend import view_of
from autotune.record import StoredTrial, goodput_of
from autotune.report.data import trial_row


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
    from autotune.recommend import recommend

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
