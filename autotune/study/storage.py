"""Where a study lives: SQLite, PostgreSQL/MySQL (with heartbeats), or a journal file.

``open_storage(url)`` is the one way every command opens a study's storage:

* ``sqlite:///studies/NAME.db`` (the default; one host);
* ``postgresql://user@host/db`` or ``mysql://...``: Optuna's ``RDBStorage`` with
  heartbeats, so a worker killed with ``kill -9`` leaves its trial RUNNING only until
  the grace period passes; then the trial is FAILED and retried once
  (``RetryHeartbeatStaleTrialCallback(max_retry=1)``).  ``pool_pre_ping`` replaces
  connections the database dropped;
* ``journal:PATH``: Optuna's ``JournalStorage`` on a file, for clusters with a shared
  filesystem (NFS) and no database.

Every storage call is retried with backoff while the database is unreachable, so a
database that drops for a few seconds costs a pause, not the worker.  A URL's password
is never printed: :func:`mask_url` shows ``postgresql://user:***@host/db``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import random
import time
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import event
from sqlalchemy import exc as sa_exc

from autotune.core.errors import AutotuneError
from autotune.core.files import file_lock
from autotune.core.terminal import mask_url, url_password
from autotune.study.optuna_adapter import FrozenStudy, HeartbeatRelay, cached_rdb, heartbeat_rdb
from autotune.study.optuna_adapter import heartbeat_enabled as heartbeat_enabled

log = logging.getLogger("autotune.study.storage")

DEFAULT_HEARTBEAT_S = 60
DEFAULT_GRACE_S = 180
DEFAULT_RETRY_S = 120.0  # how long a storage call keeps retrying an unreachable database
SERVER_SCHEMES = ("postgresql", "postgres", "mysql", "mariadb")


class StudyError(AutotuneError, ValueError):
    """The study cannot be created or continued as asked."""


class StorageError(StudyError):
    """The storage cannot be opened or reached; the message never holds a password."""


# ----------------------------------------------------------------------------- secrets


def scrub(text: str, url: str | None = None) -> str:
    """``text`` with every URL password masked, and ``url``'s password wherever it
    appears (driver errors sometimes quote it)."""
    text = mask_url(text)
    pw = url_password(url) if url else None
    if pw:
        for secret in {pw, unquote(pw)}:
            if len(secret) >= 3:
                text = text.replace(secret, "***")
    return text


# ----------------------------------------------------------------------------- kinds


def storage_kind(url: str) -> str:
    """``"sqlite"``, ``"server"`` (PostgreSQL/MySQL), ``"journal"`` or ``"other"``."""
    if url.startswith("journal:"):
        return "journal"
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme == "sqlite":
        return "sqlite"
    if scheme in SERVER_SCHEMES:
        return "server"
    return "other"


def _normalise(url: str) -> str:
    """Heroku-style ``postgres://`` to ``postgresql://``, and a driver that is installed
    when the URL names none (SQLAlchemy 2.1 defaults to psycopg 3; we ship psycopg2)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    if url.startswith("postgresql://"):
        for module, driver in (("psycopg2", "psycopg2"), ("psycopg", "psycopg")):
            if importlib.util.find_spec(module) is not None:
                return f"postgresql+{driver}://" + url[len("postgresql://"):]
    return url


# ----------------------------------------------------------------------------- retries


_FINAL = ("password authentication failed", "no password supplied", "does not exist",
          "permission denied", "access denied")


def transient(exc: BaseException) -> bool:
    """True when ``exc`` means "the database is unreachable right now"."""
    if any(text in str(exc).lower() for text in _FINAL):
        return False  # a wrong password or database name does not heal by waiting
    if isinstance(exc, optuna.exceptions.StorageInternalError):
        # RDBStorage wraps every SQLAlchemy error in this; the cause says which.
        # Bad data (integrity, value too long, SQL) fails again; anything else about the
        # connection or session (closed, invalidated, pending rollback) heals on retry.
        cause = exc.__cause__ or exc.__context__
        if cause is None:
            return False
        bad = (sa_exc.IntegrityError, sa_exc.DataError, sa_exc.ProgrammingError,
               sa_exc.NotSupportedError)
        return not isinstance(cause, bad) and isinstance(cause, sa_exc.SQLAlchemyError)
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError):
        return True
    if isinstance(exc, sa_exc.StatementError) and exc.orig is not None:
        return transient(exc.orig)
    name = type(exc).__name__
    return name in ("OperationalError", "InterfaceError") and "psycopg" in type(exc).__module__


def call_with_retry(fn: Callable[..., Any], *args: Any, what: str = "storage call",
                    retry_s: float = DEFAULT_RETRY_S, first_delay_s: float = 0.25,
                    max_delay_s: float = 5.0, url: str | None = None,
                    sleep: Callable[[float], None] = time.sleep, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, retried with exponential backoff while the database is
    unreachable, for up to ``retry_s`` seconds; other errors pass through at once."""
    deadline = time.monotonic() + retry_s
    delay = first_delay_s
    attempt = 0
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not transient(exc) or time.monotonic() + delay > deadline:
                raise
            attempt += 1
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            # One line says it is retrying and for how long; the error, if it stays
            # down, is the caller's one line.  A line per attempt was nine lines of the
            # same refusal over 32 s.
            log.log(logging.WARNING if attempt == 1 else logging.DEBUG,
                    "database unreachable during %s: %s; retrying for up to %d s",
                    what, scrub(first, url), math.ceil(max(deadline - time.monotonic(), 0.0)))
            sleep(delay)
            delay = min(delay * 2, max_delay_s)


# What two processes creating Optuna's schema in one new database at the same moment
# get: both CREATE TABLE (PostgreSQL's catalogue has one row per type name), or both
# stamp alembic's version.  The loser finds the schema there when it tries again.
_SCHEMA_RACE = ("pg_type_typname_nsp_index", "alembic_version", "already exists",
                "duplicate key value violates unique constraint", "Duplicate entry",
                "UNIQUE constraint failed")


def schema_race(exc: BaseException) -> bool:
    """True when ``exc`` is another process creating the same schema at the same time."""
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        text += " " + str(cause)
    return any(marker in text for marker in _SCHEMA_RACE)


def schema_race_retry(fn: Callable[[], Any], *, attempts: int = 8,
                      sleep: Callable[[float], None] = time.sleep) -> Any:
    """``fn()``, tried again while it loses a schema-creation race (see ``_SCHEMA_RACE``).

    A random pause before each retry keeps the losers from colliding again."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts or not schema_race(exc):
                raise
            log.info("storage schema created concurrently by another process (attempt %d); "
                     "opening again", attempt)
            sleep(random.uniform(0.05, 0.25) * attempt)
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


class RetryingStorage(BaseStorage):
    """Any Optuna storage (``inner``), each call retried with backoff while the database
    is down.

    Optuna's own retries cover a single dropped connection; a database restart takes
    seconds, and a worker whose trial already cost minutes of GPU time should wait.
    Every method of Optuna's storage API is written out, so a method Optuna adds is an
    abstract method this class lacks (a TypeError at once), not a silent pass-through.
    """

    def __init__(self, inner: BaseStorage, *, url: str, retry_s: float = DEFAULT_RETRY_S
                 ) -> None:
        self.inner = inner
        self.url = url
        self.retry_s = retry_s

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return call_with_retry(fn, *args, what=what, retry_s=self.retry_s, url=self.url,
                               **kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {mask_url(self.url)}>"

    def remove_session(self) -> None:
        self.inner.remove_session()

    # studies

    def create_new_study(self, directions: Sequence[StudyDirection],
                         study_name: str | None = None) -> int:
        return self._call("create_new_study", self.inner.create_new_study, directions,
                          study_name)

    def delete_study(self, study_id: int) -> None:
        self._call("delete_study", self.inner.delete_study, study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call("set_study_user_attr", self.inner.set_study_user_attr, study_id, key,
                   value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call("set_study_system_attr", self.inner.set_study_system_attr, study_id, key,
                   value)

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._call("get_study_id_from_name", self.inner.get_study_id_from_name,
                          study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._call("get_study_name_from_id", self.inner.get_study_name_from_id,
                          study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._call("get_study_directions", self.inner.get_study_directions, study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("get_study_user_attrs", self.inner.get_study_user_attrs, study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("get_study_system_attrs", self.inner.get_study_system_attrs,
                          study_id)

    def get_all_studies(self) -> list[FrozenStudy]:
        return self._call("get_all_studies", self.inner.get_all_studies)

    # trials

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None
                         ) -> int:
        return self._call("create_new_trial", self.inner.create_new_trial, study_id,
                          template_trial)

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        self._call("set_trial_param", self.inner.set_trial_param, trial_id, param_name,
                   param_value_internal, distribution)

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int
                                                ) -> int:
        return self._call("get_trial_id_from_study_id_trial_number",
                          self.inner.get_trial_id_from_study_id_trial_number, study_id,
                          trial_number)

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self._call("get_trial_number_from_id", self.inner.get_trial_number_from_id,
                          trial_id)

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return self._call("get_trial_param", self.inner.get_trial_param, trial_id,
                          param_name)

    def set_trial_state_values(self, trial_id: int, state: TrialState,
                               values: Sequence[float] | None = None) -> bool:
        return self._call("set_trial_state_values", self.inner.set_trial_state_values,
                          trial_id, state, values)

    def set_trial_intermediate_value(self, trial_id: int, step: int,
                                     intermediate_value: float) -> None:
        self._call("set_trial_intermediate_value", self.inner.set_trial_intermediate_value,
                   trial_id, step, intermediate_value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call("set_trial_user_attr", self.inner.set_trial_user_attr, trial_id, key,
                   value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call("set_trial_system_attr", self.inner.set_trial_system_attr, trial_id, key,
                   value)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._call("get_trial", self.inner.get_trial, trial_id)

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self._call("get_all_trials", self.inner.get_all_trials, study_id,
                          deepcopy=deepcopy, states=states)

    def get_n_trials(self, study_id: int,
                     state: tuple[TrialState, ...] | TrialState | None = None) -> int:
        return self._call("get_n_trials", self.inner.get_n_trials, study_id, state)

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._call("get_best_trial", self.inner.get_best_trial, study_id)

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        return self._call("get_trial_params", self.inner.get_trial_params, trial_id)

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call("get_trial_user_attrs", self.inner.get_trial_user_attrs, trial_id)

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call("get_trial_system_attrs", self.inner.get_trial_system_attrs,
                          trial_id)

    def check_trial_is_updatable(self, trial_id: int, trial_state: TrialState) -> None:
        # Optuna's base raises UpdateFinishedTrialError from the state it is given: no
        # storage call to retry.
        self.inner.check_trial_is_updatable(trial_id, trial_state)


class RetryingHeartbeatStorage(RetryingStorage, HeartbeatRelay):
    """:class:`RetryingStorage` for a storage with heartbeats (RDB): Optuna sees a
    heartbeat storage and records heartbeats and fails stale trials through it."""


# ----------------------------------------------------------------------------- open


def _engine_kwargs(url: str, grace_period: int | None) -> dict[str, Any]:
    """Connections checked before use; on PostgreSQL, a session left idle inside a
    transaction longer than the grace period is ended by the server.  A host stopped in
    the middle of a storage call (SIGSTOP, a frozen VM, swapping) holds its row locks
    until then: without the limit, the worker that fails its trial as stale would wait
    on those locks for as long as the host stays stopped."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith(("postgresql", "postgres")):
        limit_ms = 1000 * max(int(grace_period or DEFAULT_GRACE_S), 10)
        kwargs["connect_args"] = {
            "options": f"-c idle_in_transaction_session_timeout={limit_ms}"}
    return kwargs


def open_storage(
    url: str,
    *,
    heartbeat_interval: int | None = DEFAULT_HEARTBEAT_S,
    grace_period: int | None = DEFAULT_GRACE_S,
    max_retry: int = 1,
    retry_s: float = DEFAULT_RETRY_S,
) -> BaseStorage:
    """The Optuna storage for ``url`` (see the module docstring), or a
    :class:`StorageError` whose message names the URL masked.

    Heartbeats apply to PostgreSQL/MySQL only: SQLite is one host (the study's own
    stale-trial check covers it) and Optuna's journal storage has none.
    """
    shown = mask_url(url)
    url = _normalise(url)
    kind = storage_kind(url)
    if kind == "journal":
        return _open_journal(url[len("journal:"):], shown)
    if kind == "sqlite":
        return _open_sqlite(url)
    if kind != "server":
        raise StorageError(f"unsupported storage {shown}: use sqlite:///PATH, "
                           "postgresql://USER@HOST/DB, mysql://USER@HOST/DB or journal:PATH")
    if heartbeat_interval is not None and heartbeat_interval < 1:
        raise StorageError(f"--heartbeat-interval must be >= 1 s, got {heartbeat_interval}")
    if grace_period is not None and heartbeat_interval is not None and (
            grace_period <= heartbeat_interval):
        raise StorageError(f"--grace-period ({grace_period} s) must exceed "
                           f"--heartbeat-interval ({heartbeat_interval} s), or a live "
                           "worker's trial would be failed between two heartbeats")
    def connect() -> BaseStorage:
        rdb = heartbeat_rdb(url, heartbeat_interval=heartbeat_interval,
                            grace_period=grace_period, max_retry=max_retry,
                            engine_kwargs=_engine_kwargs(url, grace_period))
        return cached_rdb(rdb)

    try:
        inner = call_with_retry(schema_race_retry, connect, what="connect",
                                retry_s=min(retry_s, 30.0), url=url)
    except ImportError:
        driver = "psycopg2-binary" if url.startswith("postgres") else "PyMySQL"
        raise StorageError(f"cannot open storage {shown}: the database driver is not "
                           f"installed; pip install {driver}") from None
    except Exception as exc:
        raise StorageError(f"cannot open storage {shown}: {_first_line(exc, url)}") from None
    out = RetryingHeartbeatStorage(inner, url=url, retry_s=retry_s)
    if heartbeat_interval is not None:  # Optuna's own default grace: two intervals
        out.grace_s = float(grace_period or 2 * heartbeat_interval)
    return out


def _open_journal(path_text: str, shown: str) -> BaseStorage:
    if not path_text:
        raise StorageError("journal storage needs a file: journal:PATH (e.g. "
                           "journal:/nfs/studies/NAME.log)")
    path = Path(path_text)
    if not path.resolve().parent.is_dir():
        raise StorageError(f"cannot open storage {shown}: folder {path.resolve().parent} "
                           "does not exist")
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except OSError as exc:
        raise StorageError(f"cannot open storage {shown}: {exc.strerror or exc}") from None


def _first_line(exc: BaseException, url: str) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return scrub(first, url)


# ----------------------------------------------------------------------------- sqlite


def _open_sqlite(url: str) -> optuna.storages.RDBStorage:
    """An Optuna storage, or a StudyError that says why it cannot be opened."""
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        parent = path.resolve().parent
        if not parent.exists():
            # Only the default studies/ folder is created; another path must exist.
            if parent.name == "studies" or path.parent == Path("studies"):
                parent.mkdir(parents=True, exist_ok=True)
            else:
                raise StudyError(f"cannot open storage {url}: folder {parent} does not exist")
    lock: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if url.startswith("sqlite:///") and path.name not in ("", ":memory:"):
        # Optuna creates the schema on first open, and two processes doing that at once
        # collide ("UNIQUE constraint failed: alembic_version.version_num"): take turns.
        lock = file_lock(path.with_name(path.name + ".lock"))
    try:
        # SQLite: wait up to 30 s for a lock (Python's default is 5 s), so a reader such
        # as optuna-dashboard or `autotune report` on the same file cannot fail a study.
        with lock:
            storage = optuna.storages.RDBStorage(
                url, engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite")
                else {"connect_args": {"timeout": 30.0}})
    except Exception as exc:  # sqlalchemy raises many kinds: say which, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StudyError(f"cannot open storage {url}: {first}") from None
    if url.startswith("sqlite"):
        _sqlite_wal(storage)
    return storage


def _sqlite_wal(storage: optuna.storages.RDBStorage) -> None:
    """WAL with synchronous=NORMAL: a commit no longer waits for fsync, and a killed
    process still loses nothing that was committed (only a power cut could)."""
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    event.listen(storage.engine, "connect", on_connect)
    storage.engine.dispose()
