"""Every use of Optuna's private API, in one module.

autotune needs a few things Optuna does not publish: a study's storage and a trial's
storage id (to mark a dead process's trial FAIL and to tag a trial with its host and
pid), the cached wrapper Optuna itself puts around an ``RDBStorage``, and the heartbeat
interface (to wrap a storage with retries and still have Optuna's heartbeats work).

Nothing else in autotune reaches past Optuna's public API: when an Optuna release moves
one of these, this module is the one place to change, and ``tests/test_optuna_adapter.py``
(which exercises each function against the installed Optuna) is the test that says so.
pyproject.toml pins Optuna to the major versions that test passes (``SUPPORTED``).

Optuna renamed the heartbeat's stale-trial callback between 4.x and 5.x, and both
names are handled here: the getter (``get_failed_trial_callback`` in 4.x, abstract;
``get_heartbeat_stale_trial_callback`` in 5.x), ``RDBStorage``'s keyword
(``failed_trial_callback`` / ``heartbeat_stale_trial_callback``) and the retry callback's
class (``RetryFailedTrialCallback`` / ``RetryHeartbeatStaleTrialCallback``).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any, TypedDict

import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages._heartbeat import is_heartbeat_enabled as _is_heartbeat_enabled
from optuna.study._frozen import FrozenStudy  # what get_all_studies returns; not exported
from optuna.trial import FrozenTrial, TrialState

from autotune.servers.process import exiting

__all__ = [
    "GRACE_ATTR", "SUPPORTED", "BaseHeartbeat", "BaseStorage", "FrozenStudy",
    "HeartbeatRelay", "heartbeat_grace",
    "cached_rdb", "fail_running_trial", "fail_stale_heartbeats", "heartbeat_enabled",
    "heartbeat_rdb", "quiet_logging", "retry_stale_callback", "set_trial_system_attr",
    "stale_trial_callback", "stale_trial_ids", "storage_of", "study_id", "trial_id",
    "trial_now",
]

# The Optuna versions tests/test_optuna_adapter.py has passed against; pyproject.toml's
# pin says the same.
SUPPORTED = ">=4.5,<6"

StaleCallback = Callable[[optuna.Study, FrozenTrial], None]


def storage_of(study: optuna.Study) -> BaseStorage:
    """The storage a study reads and writes (``Study._storage``)."""
    return study._storage


def study_id(study: optuna.Study) -> int:
    """The study's id in its storage (``Study._study_id``)."""
    return study._study_id


def trial_id(trial: optuna.Trial | FrozenTrial) -> int:
    """A trial's id in its storage (``_trial_id``), not its number in the study."""
    return trial._trial_id


def set_trial_system_attr(trial: optuna.Trial, key: str, value: Any) -> None:
    """A system attribute on a running trial; ``Trial.set_system_attr`` was deprecated
    in Optuna 3.1, so the storage is written directly."""
    trial.storage.set_trial_system_attr(trial_id(trial), key, value)


def fail_running_trial(study: optuna.Study, trial: FrozenTrial) -> bool:
    """Mark a RUNNING trial FAIL; False when another process changed its state first.

    Optuna raises ``UpdateFinishedTrialError`` for a trial that is already finished; the
    caller decides whether that is a race to ignore."""
    return storage_of(study).set_trial_state_values(trial_id(trial), TrialState.FAIL)


def trial_now(study: optuna.Study, trial: FrozenTrial) -> FrozenTrial:
    """The trial as the storage holds it now (a FrozenTrial from ``get_trials`` is a
    snapshot)."""
    return storage_of(study).get_trial(trial_id(trial))


def cached_rdb(rdb: optuna.storages.RDBStorage) -> BaseStorage:
    """``rdb`` behind Optuna's own read cache, as ``optuna.create_study(storage=URL)``
    would wrap it (``optuna.storages._CachedStorage``)."""
    return optuna.storages._CachedStorage(rdb)


def retry_stale_callback(max_retry: int) -> StaleCallback:
    """The callback that queues a stale trial's config again, at most ``max_retry``
    times (experimental in Optuna; the warning says nothing a user can act on)."""
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    if cls is None:
        cls = optuna.storages.RetryFailedTrialCallback  # Optuna 4.x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return cls(max_retry=max_retry)


class _StaleKeyword(TypedDict, total=False):
    """RDBStorage's stale-trial callback keyword: one of the two, by Optuna's major."""

    heartbeat_stale_trial_callback: StaleCallback | None
    failed_trial_callback: StaleCallback | None  # Optuna 4.x


def heartbeat_rdb(url: str, *, heartbeat_interval: int | None, grace_period: int | None,
                  max_retry: int = 1, engine_kwargs: dict[str, Any] | None = None
                  ) -> optuna.storages.RDBStorage:
    """An ``RDBStorage`` whose heartbeats (when ``heartbeat_interval`` is set) fail a
    dead process's trial after ``grace_period`` s and retry its config ``max_retry``
    times, under whichever keyword the installed Optuna takes."""
    callback = retry_stale_callback(max_retry) if heartbeat_interval is not None else None
    params = inspect.signature(optuna.storages.RDBStorage.__init__).parameters
    stale: _StaleKeyword = {}
    if "heartbeat_stale_trial_callback" in params:
        stale["heartbeat_stale_trial_callback"] = callback
    else:
        stale["failed_trial_callback"] = callback  # Optuna 4.x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval,
            grace_period=grace_period, **stale)


def heartbeat_enabled(storage: BaseStorage) -> bool:
    """True when ``storage`` records heartbeats (a ``BaseHeartbeat`` with an interval)."""
    return _is_heartbeat_enabled(storage)


def stale_trial_ids(storage: BaseHeartbeat, study: int) -> list[int]:
    """Ids of the study's RUNNING trials whose heartbeat is older than the grace
    period (``BaseHeartbeat._get_stale_trial_ids``)."""
    return storage._get_stale_trial_ids(study)


def stale_trial_callback(storage: BaseHeartbeat) -> StaleCallback | None:
    """The callback Optuna runs for a trial failed for a stale heartbeat, under either
    of its names (see the module docstring)."""
    getter = getattr(storage, "get_heartbeat_stale_trial_callback", None)
    if getter is not None:
        return getter()
    return storage.get_failed_trial_callback()  # Optuna 4.x


def fail_stale_heartbeats(study: optuna.Study) -> None:
    """Optuna's ``fail_stale_trials``: FAIL every trial with a stale heartbeat and run
    the storage's stale-trial callback (which retries it).  It is marked experimental;
    the warning says nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


GRACE_ATTR = "autotune:grace_s"  # trial system attr: its process's heartbeat grace


def heartbeat_grace(storage: BaseStorage) -> float | None:
    """The grace period after which ``storage``'s process fails a silent trial (None
    without heartbeats)."""
    return getattr(storage, "grace_s", None) if heartbeat_enabled(storage) else None


class HeartbeatRelay(BaseHeartbeat):
    """The heartbeat half of a storage wrapper that holds the real storage as
    ``self.inner``: each heartbeat call goes to ``inner`` through ``self._call`` (which
    a subclass overrides, e.g. to retry).  Implements the abstract methods of both
    Optuna 4.x and 5.x, so one class satisfies either."""

    inner: BaseStorage
    # Seconds without a heartbeat after which this process fails another's trial.  The
    # processes of one study may be started with different settings (a search with the
    # defaults beside workers with --grace-period 5): each trial records the grace its
    # own process promised (GRACE_ATTR), and a trial is failed only by a process whose
    # grace is at least that long, never for beating at the pace it was started with.
    grace_s: float | None = None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def _beats(self) -> BaseHeartbeat:
        if not isinstance(self.inner, BaseHeartbeat):
            raise TypeError(f"{type(self.inner).__name__} has no heartbeats")
        return self.inner

    def record_heartbeat(self, trial_id: int) -> None:
        self._call("record_heartbeat", self._beats().record_heartbeat, trial_id)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        stale = self._call("stale trial ids", stale_trial_ids, self._beats(), study_id)
        return [tid for tid in stale if self._covers(tid)]

    def _covers(self, trial_id: int) -> bool:
        theirs = self._call("get_trial_system_attrs", self.inner.get_trial_system_attrs,
                            trial_id).get(GRACE_ATTR)
        mine = self.grace_s
        return theirs is None or mine is None or float(theirs) <= mine

    def get_heartbeat_interval(self) -> int | None:
        if not isinstance(self.inner, BaseHeartbeat):
            return None  # no heartbeats: Optuna's is_heartbeat_enabled says False
        return self._call("get_heartbeat_interval", self.inner.get_heartbeat_interval)

    def get_heartbeat_stale_trial_callback(self) -> StaleCallback | None:
        return stale_trial_callback(self._beats())

    def get_failed_trial_callback(self) -> StaleCallback | None:  # Optuna 4.x's name
        return stale_trial_callback(self._beats())


class _QuietWhileExiting(logging.Filter):
    """After Ctrl-C (or SIGTERM, SIGHUP) the command ends with one line that says how to
    resume; Optuna's report of the trial the signal interrupted (a KeyboardInterrupt
    traceback, then "Trial N failed with value None") would only repeat it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not exiting()


_QUIET = _QuietWhileExiting()


def quiet_logging() -> None:
    """Optuna's own log at WARNING (autotune prints a line per trial), and silent once a
    stop signal is unwinding the process.  On Optuna's handlers, not its logger: a
    logger's filters skip the records of its child loggers, where Optuna logs."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for handler in logging.getLogger("optuna").handlers:
        if _QUIET not in handler.filters:
            handler.addFilter(_QUIET)
