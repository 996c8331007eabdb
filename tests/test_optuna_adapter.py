"""Each private Optuna API that autotune.study.optuna_adapter wraps, exercised against the
installed Optuna.  When an Optuna release moves one, this file fails, not a cluster
run; pyproject.toml pins Optuna to the major versions it passes."""

from __future__ import annotations

import re
import time
from pathlib import Path

import optuna
import pytest
from optuna.storages import BaseStorage, InMemoryStorage, RDBStorage
from optuna.trial import TrialState
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from sqlalchemy.exc import OperationalError

from autotune.study import optuna_adapter as oa
from autotune.study.storage import RetryingHeartbeatStorage, RetryingStorage

ROOT = Path(__file__).resolve().parent.parent

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _sqlite(tmp_path: Path, **kwargs: object) -> RDBStorage:
    return RDBStorage(f"sqlite:///{tmp_path / 'a.db'}", **kwargs)  # type: ignore[arg-type]


def test_installed_optuna_is_in_the_supported_range_and_pyproject_pins_it() -> None:
    assert Version(optuna.__version__) in SpecifierSet(oa.SUPPORTED)
    pin = re.search(r'"optuna([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None and SpecifierSet(pin.group(1)) == SpecifierSet(oa.SUPPORTED)


def test_study_storage_ids_and_system_attrs() -> None:
    storage = InMemoryStorage()
    study = optuna.create_study(storage=storage, study_name="s")
    assert oa.storage_of(study) is storage
    assert oa.study_id(study) == storage.get_study_id_from_name("s")

    def objective(trial: optuna.Trial) -> float:
        oa.set_trial_system_attr(trial, "autotune:pid", 123)
        assert storage.get_trial_number_from_id(oa.trial_id(trial)) == trial.number
        return 1.0

    study.optimize(objective, n_trials=2)
    for frozen in study.get_trials():
        assert frozen.system_attrs["autotune:pid"] == 123
        assert oa.trial_id(frozen) == storage.get_trial_id_from_study_id_trial_number(
            oa.study_id(study), frozen.number)


def test_fail_running_trial_and_trial_now() -> None:
    study = optuna.create_study()
    running = study.ask()
    snapshot = study.get_trials(deepcopy=False)[0]
    assert oa.fail_running_trial(study, snapshot) is True
    assert oa.trial_now(study, snapshot).state == TrialState.FAIL
    assert oa.trial_now(study, snapshot).number == running.number
    # A second process failing the same trial is told so (the callers ignore it).
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        oa.fail_running_trial(study, snapshot)


def test_cached_rdb_is_a_working_storage(tmp_path: Path) -> None:
    storage = oa.cached_rdb(_sqlite(tmp_path))
    assert isinstance(storage, BaseStorage)
    study = optuna.create_study(storage=storage, study_name="c")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    again = optuna.load_study(study_name="c", storage=f"sqlite:///{tmp_path / 'a.db'}")
    assert len(again.trials) == 2


def test_heartbeats_stale_ids_callback_and_fail_stale(tmp_path: Path) -> None:
    rdb = oa.heartbeat_rdb(f"sqlite:///{tmp_path / 'a.db'}", heartbeat_interval=1,
                           grace_period=1, max_retry=1)
    callback = oa.stale_trial_callback(rdb)
    assert callable(callback)
    plain = _sqlite(tmp_path)
    assert not oa.heartbeat_enabled(plain)
    assert not oa.heartbeat_enabled(InMemoryStorage())
    storage = RetryingHeartbeatStorage(oa.cached_rdb(rdb), url="sqlite://", retry_s=1.0)
    assert oa.heartbeat_enabled(storage)
    assert oa.stale_trial_callback(storage) is callback
    assert storage.get_failed_trial_callback() is callback  # the name Optuna 4.x calls

    study = optuna.create_study(storage=storage, study_name="h")
    # A worker that died: its trial started (ask) and beat once, then nothing.
    with pytest.warns(UserWarning, match="Heartbeat"):
        trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    storage.record_heartbeat(oa.trial_id(trial))
    # The heartbeat goes stale after grace_period (1 s): wait for that, bounded.
    deadline = time.monotonic() + 15
    while not oa.stale_trial_ids(storage, oa.study_id(study)):
        assert time.monotonic() < deadline, "the trial's heartbeat never went stale"
        time.sleep(0.1)
    assert oa.stale_trial_ids(rdb, oa.study_id(study)) == [oa.trial_id(trial)]

    oa.fail_stale_heartbeats(study)
    states = [t.state for t in study.get_trials()]
    # The stale trial is FAIL and the callback queued its config again.
    assert states == [TrialState.FAIL, TrialState.WAITING]
    assert study.get_trials()[1].params == trial.params


def test_optimize_runs_through_the_retrying_heartbeat_wrapper(tmp_path: Path) -> None:
    rdb = oa.heartbeat_rdb(f"sqlite:///{tmp_path / 'a.db'}", heartbeat_interval=60,
                           grace_period=120)
    storage = RetryingHeartbeatStorage(oa.cached_rdb(rdb), url="sqlite://", retry_s=1.0)
    study = optuna.create_study(storage=storage, study_name="o")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE] * 3
    assert study.best_trial.number in (0, 1, 2)
    assert "sqlite://" in repr(storage)


def test_the_wrapper_writes_out_every_storage_and_heartbeat_method() -> None:
    # A method Optuna adds to its storage API must be written out here too, or it would
    # bypass the retries (a default built on get_trial) or leave the class abstract.
    public = {name for name in dir(BaseStorage)
              if not name.startswith("__") and callable(getattr(BaseStorage, name))}
    assert public <= set(vars(RetryingStorage)), public - set(vars(RetryingStorage))
    beats = set(oa.BaseHeartbeat.__abstractmethods__)
    assert beats <= set(vars(oa.HeartbeatRelay)), beats - set(vars(oa.HeartbeatRelay))
    assert not RetryingHeartbeatStorage.__abstractmethods__
    assert issubclass(RetryingHeartbeatStorage, oa.BaseHeartbeat)


def test_a_dropped_connection_is_retried_through_the_wrapper() -> None:
    inner = InMemoryStorage()
    study_id = inner.create_new_study([optuna.study.StudyDirection.MINIMIZE], "r")
    calls = {"n": 0}
    real = inner.get_study_name_from_id

    def flaky(sid: int) -> str:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OperationalError("SELECT", {}, ConnectionError("server closed"))
        return real(sid)

    inner.get_study_name_from_id = flaky  # type: ignore[method-assign]
    storage = RetryingStorage(inner, url="postgresql://u:pw@h/db", retry_s=5.0)
    assert storage.get_study_name_from_id(study_id) == "r"
    assert calls["n"] == 2
    assert not oa.heartbeat_enabled(storage)
    assert "pw" not in repr(storage)
