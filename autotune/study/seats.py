"""Seats: how many trials a shared study still wants.

``--n-trials`` is study-wide.  When a search and workers run trials on one study, each
process asks before a trial whether the study still has a seat for it, so that the study
ends with exactly n_trials finished trials, not n_trials per process.

:func:`run_seated_trial` is the one way a process (search or worker) runs a trial of a
shared study: it claims a seat first, and it survives its trial being finished by another
process meanwhile.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.core.errors import AutotuneError

COUNTED = (TrialState.COMPLETE, TrialState.PRUNED)  # what --n-trials counts
SURPLUS = "surplus"  # the reason stored on a trial that found no seat


class Surplus(AutotuneError):
    """The trial found every seat taken (two processes claimed the last one at once).

    Internal: raised inside a trial, caught by the loop that started it."""


def finished_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=COUNTED))


def seat_of(trials: Sequence[FrozenTrial], number: int) -> int:
    """How many COMPLETE, PRUNED or RUNNING trials precede trial ``number``: the trial
    is surplus when that reaches n_trials (two workers claimed the last seat at once)."""
    live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(1 for t in trials if t.state in live and t.number < number)


def should_wait(study: optuna.Study, n_trials: int | None) -> tuple[bool, bool]:
    """(done, wait): done when n_trials finished; wait when the trials still running
    elsewhere would fill the study and nothing is queued for retry."""
    if n_trials is None:
        return False, False
    trials = study.get_trials(deepcopy=False)
    done = sum(1 for t in trials if t.state in COUNTED)
    running = sum(1 for t in trials if t.state == TrialState.RUNNING)
    waiting = sum(1 for t in trials if t.state == TrialState.WAITING)
    if done >= n_trials:
        return True, False
    return False, done + running >= n_trials and not waiting


def claim_seat(study: optuna.Study, trial: optuna.Trial, n_trials: int | None) -> None:
    """Raise ``Surplus`` (and say so on the trial) when ``trial`` has no seat."""
    if n_trials is None:
        return
    if seat_of(study.get_trials(deepcopy=False), trial.number) >= n_trials:
        trial.set_user_attr("reason", SURPLUS)
        raise Surplus()


def requeue(study: optuna.Study, frozen: FrozenTrial) -> None:
    """Queue ``frozen``'s config again, as Optuna retries a stale trial (at most once)."""
    attrs = _retry_user_attrs(frozen)
    if frozen.params:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)
        retry(study, _with_user_attrs(frozen, attrs))
    elif frozen.system_attrs.get("fixed_params"):
        # Claimed from the queue and stopped before it suggested: put it back as it was.
        study.add_trial(optuna.create_trial(state=TrialState.WAITING, user_attrs=attrs,
                                            system_attrs=dict(frozen.system_attrs)))


def _retry_user_attrs(t: FrozenTrial) -> dict[str, Any]:
    drop = ("worker", "reason", "status", "result", "feasible", "p99_e2e_s",
            "goodput_tokens", "surplus")
    return {k: v for k, v in t.user_attrs.items() if k not in drop}


def _with_user_attrs(t: FrozenTrial, attrs: dict[str, Any]) -> FrozenTrial:
    out = copy.deepcopy(t)
    out.user_attrs = attrs
    return out


def requeue_number(study: optuna.Study, number: int | None, *, only_failed: bool = False
                   ) -> None:
    """Queue trial ``number``'s config again (``only_failed``: only if it failed)."""
    if number is None:
        return
    for t in study.get_trials(deepcopy=False):
        if t.number == number:
            if t.state == TrialState.FAIL or not only_failed:
                requeue(study, t)
            return


# ----------------------------------------------------------------------------- one trial

Outcome = Literal["ran", "surplus", "finished elsewhere"]
# Why a trial is "finished elsewhere", as the worker and the search say it.
TAKEN_OVER_WHY = ("no heartbeat within its grace period: a stalled host or a database "
                  "outage")


@dataclass(frozen=True)
class SeatedTrial:
    """What :func:`run_seated_trial` did: the trial's number (None when Optuna stopped
    before asking for one) and how it ended for this process."""

    number: int | None
    outcome: Outcome


def run_seated_trial(study: optuna.Study, objective: Callable[[optuna.Trial], float],
                     n_trials: int | None, *, timeout: float | None = None,
                     callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = ()
                     ) -> SeatedTrial:
    """Run one trial of ``study`` with ``objective`` after claiming its seat.

    "surplus": every seat was taken; the trial's config is queued again.
    "finished elsewhere": another process failed the trial while it ran (its heartbeat
    was older than that process's grace period: a stalled host or a database outage),
    and Optuna's stale-trial callback queued its retry.  The owner's own ``tell`` then
    fails inside ``study.optimize``, and Optuna 5.1 says so with whatever its code path
    hits (``AssertionError("Should not reach.")`` when the objective returned,
    ``ValueError("Cannot tell a FAIL trial.")`` when it raised): the trial's state in the
    storage, and an objective that raised nothing else, tell that case from a bug.
    Anything else the objective raised (Ctrl-C included) is raised."""
    seen: dict[str, Any] = {}

    def seated(trial: optuna.Trial) -> float:
        seen["number"] = trial.number
        try:
            claim_seat(study, trial, n_trials)
            return objective(trial)
        except optuna.exceptions.UpdateFinishedTrialError:
            if not _failed(study, trial.number):
                raise
            # Returned, not raised: Optuna would log the error with its traceback as
            # this trial's failure, and the trial is not this process's to report.
            return math.nan
        except BaseException as exc:
            seen["raised"] = exc
            raise

    try:
        with _quiet_surplus(seen):
            study.optimize(seated, n_trials=1, timeout=timeout, callbacks=list(callbacks),
                           catch=(), gc_after_trial=False)
    except Surplus:
        requeue_number(study, seen.get("number"))
        return SeatedTrial(seen.get("number"), "surplus")
    except Exception as exc:
        raised, number = seen.get("raised"), seen.get("number")
        if raised is exc:
            raise
        if raised is not None:
            raise raised from None  # e.g. Ctrl-C while the trial was taken over
        if number is None or not _failed(study, number):
            raise
        return SeatedTrial(number, "finished elsewhere")
    return SeatedTrial(seen.get("number"), "ran")


@contextlib.contextmanager
def _quiet_surplus(seen: dict[str, Any]) -> Iterator[None]:
    """Keep Optuna from logging a surplus trial as a failure with its traceback.

    Surplus is raised inside the objective (the seat is known only once the trial has a
    number), so Optuna's loop logs it as any failure would: a traceback in a worker's
    log for a trial that never ran, which reads as a crash.  Only the lines about that
    one trial are dropped; the trial itself is still stored as FAIL with reason
    "surplus"."""
    log = logging.getLogger("optuna.study._optimize")

    def keep(record: logging.LogRecord) -> bool:
        if not isinstance(seen.get("raised"), Surplus):
            return True
        return not str(record.msg).startswith(f"Trial {seen.get('number')} failed")

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def _failed(study: optuna.Study, number: int) -> bool:
    return any(t.number == number and t.state == TrialState.FAIL
               for t in study.get_trials(deepcopy=False))
