"""run_seated_trial: one trial of a shared study, and what another process may do to it
meanwhile (fail it for a stale heartbeat, take the last seat)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.study.seats import SURPLUS, run_seated_trial
from autotune.study.storage import open_storage

optuna.logging.set_verbosity(optuna.logging.CRITICAL)


def _study(tmp: Path) -> tuple[optuna.Study, optuna.Study]:
    """The study as this process and as another process (its own storage) see it."""
    url = f"sqlite:///{tmp / 'seats.db'}"
    here = optuna.create_study(study_name="s", storage=open_storage(url),
                               direction="maximize")
    there = optuna.load_study(study_name="s", storage=open_storage(url))
    return here, there


def _failed_there(there: optuna.Study, then: Callable[[optuna.Trial], float]
                  ) -> Callable[[optuna.Trial], float]:
    """An objective whose trial another process fails while it runs, as Optuna's stale
    check does (state FAIL, its config queued again), before ``then`` goes on."""

    def objective(trial: optuna.Trial) -> float:
        trial.suggest_int("max_num_seqs", 1, 256)
        frozen = there.trials[trial.number]
        there._storage.set_trial_state_values(frozen._trial_id, TrialState.FAIL)
        there.enqueue_trial(frozen.params)
        return then(trial)

    return objective


def test_a_trial_failed_elsewhere_after_its_objective_returned_is_not_a_crash(
        tmp_path: Path) -> None:
    here, there = _study(tmp_path)
    seated = run_seated_trial(here, _failed_there(there, lambda trial: 1.0), n_trials=4)
    assert (seated.number, seated.outcome) == (0, "finished elsewhere")
    assert here.trials[0].state == TrialState.FAIL
    assert [t.state for t in here.trials[1:]] == [TrialState.WAITING]
    # The study goes on: the queued config runs as the next trial.
    again = run_seated_trial(here, lambda trial: float(trial.suggest_int("max_num_seqs",
                                                                          1, 256)), 4)
    assert again.outcome == "ran" and here.trials[1].state == TrialState.COMPLETE
    assert here.trials[1].params == here.trials[0].params


def test_a_trial_failed_elsewhere_while_it_stores_its_result_is_not_a_crash(
        tmp_path: Path) -> None:
    here, there = _study(tmp_path)

    def store(trial: optuna.Trial) -> float:
        trial.set_user_attr("result", {"rate": 3.0})  # finished elsewhere: this raises
        return 1.0

    seated = run_seated_trial(here, _failed_there(there, store), n_trials=4)
    assert seated.outcome == "finished elsewhere"
    assert "result" not in here.trials[0].user_attrs


def test_an_objective_error_is_raised_whether_or_not_its_trial_was_taken_over(
        tmp_path: Path) -> None:
    here, there = _study(tmp_path)

    def bug(trial: optuna.Trial) -> float:
        raise ValueError("a bug in the objective")

    with pytest.raises(ValueError, match="a bug"):
        run_seated_trial(here, _failed_there(there, bug), n_trials=4)

    def own_assert(trial: optuna.Trial) -> float:
        raise AssertionError("an assert of our own")

    with pytest.raises(AssertionError, match="of our own"):
        run_seated_trial(here, own_assert, n_trials=4)
    assert here.trials[-1].state == TrialState.FAIL  # Optuna failed it, not elsewhere


def test_ctrl_c_in_a_trial_taken_over_is_still_ctrl_c(tmp_path: Path) -> None:
    here, there = _study(tmp_path)

    def interrupted(trial: optuna.Trial) -> float:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_seated_trial(here, _failed_there(there, interrupted), n_trials=4)


def test_a_trial_without_a_seat_gives_its_config_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    here, there = _study(tmp_path)
    held = there.ask()  # another process holds the only seat
    held.suggest_int("max_num_seqs", 1, 256)
    ran: list[int] = []

    def objective(trial: optuna.Trial) -> float:
        ran.append(trial.number)
        return 1.0

    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # as autotune's own runs log
    optuna.logging.enable_propagation()
    try:
        seated = run_seated_trial(here, objective, n_trials=1)
    finally:
        optuna.logging.disable_propagation()
        optuna.logging.set_verbosity(before)
    assert (seated.number, seated.outcome) == (1, "surplus") and ran == []
    assert here.trials[1].state == TrialState.FAIL
    assert here.trials[1].user_attrs["reason"] == SURPLUS
    # A trial that never ran is not logged as a failure with a traceback (it read as a
    # crash in a worker's log: CI of 2026-12-06 18:39)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("optuna")]
    assert not [m for m in said if "Trial 1 failed" in m], said
