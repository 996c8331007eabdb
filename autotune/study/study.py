"""The Optuna study: storage, sampler, baseline, objective, SLO constraints, resume.

Each trial is one config plus one rate cap from the search space.  The objective is
goodput (output tok/s by default, req/s with ``objective="requests"``, optionally per
GPU); every SLO limit is an Optuna constraint (``trial.set_constraint`` with the
limit's margin, observed/threshold - 1, so <= 0 is feasible).  Every trial sets the
same constraint keys (one per limit plus ``runs``), which GP sampling requires.

Trials that break a space rule are never launched; pruned, refused, failed and
crashed trials are infeasible with their reason in the user attrs.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import socket
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.backends.base import Backend, LoadPlan, TrialFailed
from autotune.core.files import json_safe
from autotune.core.metrics import SIMULATED
from autotune.core.slo import MAX_MARGIN, SLO
from autotune.study.experiments import append_experiment, row_from_summary
from autotune.study.optuna_adapter import (
    GRACE_ATTR,
    fail_running_trial,
    fail_stale_heartbeats,
    heartbeat_enabled,
    heartbeat_grace,
    set_trial_system_attr,
    storage_of,
)
from autotune.study.seats import run_seated_trial, should_wait
from autotune.study.space import CLIENT_PARAMS, SearchSpace, Violation, canonical_params
from autotune.study.storage import StudyError, open_storage
from autotune.tuning.ceiling import (
    BackendProbe,
    BudgetSpent,
    CeilingError,
    find_ceiling,
    min_samples_for_bound,
    search_steady,
)
from autotune.tuning.load_unit import RATE, LoadUnit
from autotune.tuning.pruning import PrunerSettings
from autotune.tuning.record import StoredTrial, stored_trials
from autotune.tuning.trial import INFEASIBLE, PRUNED, TrialResult, write_records
from autotune.tuning.verdict import SteadyState, screening

SAMPLERS = ("tpe", "gp", "random", "grid")
# "level": the ceiling itself, in users or requests in flight (a search --by users or
# concurrency), for which req/s and tok/s are consequences, not the aim.
OBJECTIVES = ("tokens", "requests", "level")
PRESCREEN_BY = "the simulator pre-screen"  # who predicted a trial's ceiling (``predicted``)
RUNS_KEY = "runs"  # constraint: 0 when the server ran the config, 1 when it could not
# Trial system attr, set once every value of the trial is suggested; see _choosing.
CONFIGURED_ATTR = "autotune:configured"
# Study user attr: what the search fixed, which `ceiling --study` inherits.
SETTINGS_ATTR = "autotune:settings"
CHOOSING_S = 60.0


# A screening trial's ceiling search: to within 15%, in at most 4 short tests.
SCREEN_TOL = 0.15
SCREEN_PROBES = 4


@dataclass
class StudySettings:
    name: str
    slo: SLO
    space: SearchSpace
    sampler: str = "tpe"
    storage: str | None = None
    studies_dir: Path = Path("studies")
    objective: str = "tokens"
    per_gpu: bool = False
    gpus: int | None = None
    seed: int = 0
    n_trials: int | None = 30  # total finished trials the study should reach
    timeout_s: float | None = None
    budget_s: float | None = None  # total server time, restarts included
    prune: bool = True
    pruner: PrunerSettings = field(default_factory=PrunerSettings)
    attention_heads: int | None = None
    # The per-config ceiling search of each trial.
    tol: float = 0.03
    max_probes: int = 8
    headroom: float = 0.10
    # Start each rate search at the rate needed to beat the best so far, and stop a
    # config that fails there (False: every config's full ceiling, like a sweep).
    beat_incumbent: bool = True
    # Screening trials: each config's ceiling roughly (SCREEN_TOL, SCREEN_PROBES), on
    # short tests judged on point estimates, to rank configs; the best ones are then
    # proven (refine_ceilings).  False: every trial a full ceiling search.
    screen: bool = False
    # What each trial's ceiling counts: req/s, or the users of a closed loop (whose
    # study maximizes the users, objective "level").
    unit: LoadUnit = RATE

    @property
    def out_dir(self) -> Path:
        return self.studies_dir / self.name


# ----------------------------------------------------------------------------- setup


def storage_url(name: str, storage: str | None, studies_dir: Path = Path("studies")) -> str:
    return storage or f"sqlite:///{(studies_dir / f'{name}.db').as_posix()}"


def validate_name(name: str) -> str:
    if not name or any(c in name for c in "/\\\0") or name.startswith("."):
        raise StudyError(f"study name {name!r} must be a plain file name (no '/', not "
                         "starting with '.')")
    return name


def make_sampler(name: str, *, seed: int, space: SearchSpace) -> optuna.samplers.BaseSampler:
    """TPE (Optuna 5: multivariate, constant liar), GP, random or grid."""
    key = name.lower()
    if key == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=10)
    if key == "gp":
        if importlib.util.find_spec("torch") is None:
            raise StudyError("the GP sampler needs PyTorch, which is not installed: "
                             "pip install torch (CPU wheel is enough), or use --sampler tpe")
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=8)
    if key == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if key == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    raise StudyError(f"unknown sampler {name!r}; use one of {', '.join(SAMPLERS)}")


def open_study(settings: StudySettings, storage: optuna.storages.BaseStorage,
               pruner: optuna.pruners.BasePruner | None, *,
               space: SearchSpace | None = None) -> optuna.Study:
    """``space``: what the sampler proposes (default: the settings' whole space)."""
    sampler = make_sampler(settings.sampler, seed=settings.seed,
                           space=space or settings.space)
    study = optuna.create_study(
        study_name=settings.name, storage=storage, sampler=sampler,
        pruner=pruner or optuna.pruners.NopPruner(), direction="maximize",
        load_if_exists=True)
    _check_same_study(study, settings)
    for key, value in _study_attrs(settings).items():
        study.set_user_attr(key, value)
    return study


def _study_attrs(settings: StudySettings) -> dict[str, Any]:
    return {"slo": str(settings.slo), "space": settings.space.name,
            "objective": settings.objective, "per_gpu": settings.per_gpu,
            "gpus": settings.gpus, "load_unit": settings.unit.spec()}


def _check_same_study(study: optuna.Study, settings: StudySettings) -> None:
    """Resuming with another SLO, objective or load unit would mix incomparable
    trials."""
    old = study.user_attrs
    for key in ("slo", "objective", "per_gpu", "load_unit"):
        new = _study_attrs(settings)[key]
        if key in old and old[key] != new:
            raise StudyError(
                f"study {settings.name!r} was run with {key}={old[key]!r}, not {new!r}: "
                "resume with the same settings or pick another --study-name")


def fail_stale_trials(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by a process that died (kill -9) are marked FAIL, and their
    params are enqueued again so the config is retried."""
    host = socket.gethostname()
    stale = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid, owner = t.system_attrs.get("autotune:pid"), t.system_attrs.get("autotune:host")
        # Only this host's dead processes can be told apart; another host's trial may
        # belong to a live worker there and is left alone.
        if owner not in (None, host) or isinstance(pid, int) and _pid_alive(pid):
            continue
        fail_running_trial(study, t)
        stale.append(t.number)
        if t.params:
            study.enqueue_trial(dict(t.params), user_attrs={"retry_of": t.number,
                                                             **_retry_attrs(t)})
    return stale


def _retry_attrs(t: FrozenTrial) -> dict[str, Any]:
    keep = ("baseline", "predicted")
    return {k: t.user_attrs[k] for k in keep if k in t.user_attrs}


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is new: a RUNNING trial with our pid is stale
    return process_running(pid)


def process_running(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie is not); True when unsure."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state not in ("Z", "X")


def enqueue_coverage(study: optuna.Study, space: SearchSpace, n_trials: int | None, *,
                     gpus: int | None, attention_heads: int | None) -> bool:
    """A finite space no larger than ``n_trials``: when nothing is queued (the
    defaults, a pre-screen's or the twin's picks go first), queue the next config that
    the rules allow and the study has not tried, so that each is tried before the
    sampler repeats one.  Returns whether one was queued."""
    if n_trials is None:
        return False
    configs = space.configs(n_trials)
    if configs is None:
        return False
    trials = study.get_trials(deepcopy=False)
    if any(t.state == TrialState.WAITING for t in trials):
        return False
    # A queued trial keeps its values in "fixed_params" until it runs.
    seen = {repr(sorted((t.params or t.system_attrs.get("fixed_params") or {}).items()))
            for t in trials if t.state != TrialState.FAIL}
    for params in configs:
        if repr(sorted(params.items())) in seen or space.violations(
                params, gpus=gpus, attention_heads=attention_heads):
            continue
        study.enqueue_trial(params, user_attrs={"coverage": True})
        return True
    return False


def enqueue_baseline(study: optuna.Study, space: SearchSpace) -> bool:
    """vLLM's defaults as the first trial, once per study."""
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("baseline") and t.state != TrialState.FAIL:
            return False
    study.enqueue_trial(space.baseline_params(), user_attrs={"baseline": True})
    return True


# ----------------------------------------------------------------------------- objective


def constraint_keys(slo: SLO) -> list[str]:
    return [limit.label for limit in slo.limits] + [RUNS_KEY]


def constraints_for(result: TrialResult | None, slo: SLO) -> dict[str, float]:
    """Each limit's margin (<= 0 met) and ``runs`` (0 ran, 1 could not run).

    A pruned load test gets a positive margin on the limit it was pruned for (its
    percentile is decided, or the backlog makes it so); a config that never ran is
    infeasible on every key.
    """
    keys = constraint_keys(slo)
    if result is None or result.status == INFEASIBLE and result.summary is None:
        return {k: (1.0 if k == RUNS_KEY else MAX_MARGIN) for k in keys}
    out: dict[str, float] = {RUNS_KEY: 0.0 if result.reason != "crashed" else 1.0}
    check = result.check
    for limit in slo.limits:
        m = check.margins.get(limit.label) if check is not None else None
        if m is None or math.isnan(m):
            m = MAX_MARGIN
        if result.status == PRUNED:
            m = max(m, 0.01)
        out[limit.label] = float(min(m, MAX_MARGIN))
    return out


def rows_from_study(study: optuna.Study) -> list[StoredTrial]:
    """The finished trials, as the recommendation, the pre-screen and the refinement
    read them (``autotune.tuning.record``)."""
    return stored_trials(study)


BELOW_INCUMBENT = "below_incumbent"


class Objective:
    """``study.optimize`` calls this once per trial: one config, one server start, and
    that config's safe ceiling searched on the running server.

    The first probe runs at the rate this config needs to beat the best goodput so far
    (beat-the-incumbent): a config that fails there cannot win and is pruned after that
    one probe (reason ``below_incumbent``).  Otherwise the search brackets upward and
    bisects to ``settings.tol``; the trial's value is the goodput at the confirmed
    ceiling and its constraints are the SLO margins there.  The first trials, with no
    incumbent, start at a predicted ceiling (the pre-screen's or the twin's) or after a
    saturation probe.
    """

    def __init__(self, settings: StudySettings, backend: Backend, plan: LoadPlan,
                 pruner: Any = None,
                 on_result: Callable[[int, TrialResult | None, list[Violation]], None]
                 | None = None,
                 on_probe: Callable[[int, Any], None] | None = None) -> None:
        self.s = settings
        self.backend = backend
        self.plan = plan if plan.steady is not None else replace(plan, steady=SteadyState())
        self.on_result = on_result
        self.on_probe = on_probe
        self.load_test_s = 0.0
        self.saved_s = 0.0
        self.space = settings.space.for_configs(gpus=settings.gpus,
                                                attention_heads=settings.attention_heads)
        # The space's request_rate bounds the rates a search by rate tries; users are
        # another unit, bounded only by what the server sustains.
        self.rates = rate_bounds(settings.space) if settings.unit.closed is None else None
        # When ``settings.budget_s`` ends on the backend's server_s clock (run_study
        # sets it): no load test starts after it, and one running then is cut there.
        self.deadline_s: float | None = None
        # (trial, rate, Evidence) at each judgement of a running load test.
        self.on_progress: Callable[[int, float, Any], None] | None = None
        # The twin's hooks (autotune.study.study_twin): a config's predicted ceiling, stored
        # as the trial's ``predicted`` when nothing else predicted it, and what each
        # searched config measured (trial, BackendProbe, CeilingResult).
        self.predict: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = None
        self.on_searched: Callable[[optuna.Trial, Any, Any], None] | None = None

    def __call__(self, trial: optuna.Trial) -> float:
        set_trial_system_attr(trial, "autotune:pid", os.getpid())
        set_trial_system_attr(trial, "autotune:host", socket.gethostname())
        grace = heartbeat_grace(storage_of(trial.study))
        if grace is not None:
            set_trial_system_attr(trial, GRACE_ATTR, grace)
        params = self.space.suggest(trial)
        set_trial_system_attr(trial, CONFIGURED_ATTR, True)  # see _await_running_twin
        if not self.backend.restartable:
            params = {k: v for k, v in params.items() if k in CLIENT_PARAMS}
        flags = self.s.space.server_flags(params)
        violations = self.s.space.violations(params, gpus=self.s.gpus,
                                             attention_heads=self.s.attention_heads)
        if violations and self.backend.restartable:
            return self._rule_broken(trial, flags, violations)
        twin = _same_config(trial.study, trial.number, params)
        if twin is None:
            twin = _await_running_twin(trial.study, trial.number, params)
        if twin is not None:
            return self._repeat(trial, twin)
        if self.predict is not None and not trial.user_attrs.get("predicted"):
            predicted = self.predict(flags)
            if predicted:
                trial.set_user_attr("predicted", predicted)
        outcome = self.search(trial, flags)
        result = outcome.result
        if outcome.pruned:
            result.status, result.reason = PRUNED, BELOW_INCUMBENT
            result.detail = outcome.ceiling.sentence() if outcome.ceiling else None
        self._store(trial, outcome)
        if self.on_result is not None:
            self.on_result(trial.number, result, [])
        if self.on_searched is not None and outcome.ceiling is not None:
            self.on_searched(trial, outcome.probe, outcome.ceiling)
        if outcome.pruned:
            raise optuna.TrialPruned(f"{BELOW_INCUMBENT}: {outcome.ceiling.sentence()}")
        return outcome.value

    # -- the rate search of one config ------------------------------------------------
    def start_rate(self, trial: optuna.Trial, flags: Mapping[str, Any]
                   ) -> tuple[float | None, bool, str, float | None]:
        """(first rate, must it pass, why, lowest rate worth trying).

        The rate needed to beat the incumbent, which must pass; or, when the pre-screen
        predicts a ceiling above that, the prediction, bracketing down no lower than the
        incumbent's rate; or, with neither, None: a saturation probe first."""
        best = incumbent(trial.study) if self.s.beat_incumbent else None
        gpus = self.backend.gpus_used(flags)
        told = trial.user_attrs.get("predicted") or {}
        predicted = told.get("ceiling_rate")
        need: float | None = None
        unit = self.s.unit
        if best is not None and best > 0:
            scale = gpus if self.s.per_gpu else 1
            per_req = (1.0 if self.s.objective in ("requests", "level")
                       else self.plan.mean_output_tokens())
            if per_req > 0:
                need = unit.at(best * scale / per_req)
        if predicted and (need is None or float(predicted) > need):
            by = told.get("by")
            why = ("the pre-screen's predicted ceiling" if by in (None, PRESCREEN_BY)
                   else f"the twin's predicted ceiling ({by})")
            if need is not None:
                why += f" (above the {unit.fmt(need)} that beats the incumbent)"
            return float(predicted), False, why, need
        if need is not None:
            best_unit = {"requests": "req/s", "level": unit.label}.get(self.s.objective,
                                                                      "tok/s")
            return need, True, (f"beat the incumbent: {best:,.4g} {best_unit}"
                                f"{' per GPU' if self.s.per_gpu else ''} needs "
                                f"{unit.fmt(need)}"), None
        return None, False, "a saturation probe (no incumbent yet)", None

    def search(self, trial: optuna.Trial, flags: Mapping[str, Any]) -> ConfigOutcome:
        start, must_pass, why, floor = self.start_rate(trial, flags)
        plan = self.plan
        steady = search_steady(plan.steady, self.s.max_probes)
        tol, max_probes = self.s.tol, self.s.max_probes
        if self.s.screen and steady is not None:
            steady = screening(steady, plan.slo)
            tol, max_probes = max(tol, SCREEN_TOL), min(max_probes, SCREEN_PROBES)
        probe = BackendProbe.for_plan(self.backend, flags, plan, steady=steady,
                                      deadline_s=self.deadline_s, unit=self.s.unit)
        progress = self.on_progress
        if progress is not None:
            probe.on_evidence = lambda rate, ev: progress(trial.number, rate, ev)
        low, high = self.rates or (None, None)
        if floor is not None:
            low = max(low or floor, floor)
        before = self.backend.server_s
        on_probe = None if self.on_probe is None else (
            lambda p: self.on_probe(trial.number, p))  # type: ignore[misc]
        try:
            ceiling = find_ceiling(
                probe, slo=plan.slo, start_rate=start, tol=tol,
                max_probes=max_probes, num_prompts=max(len(plan.requests), 1),
                max_num_prompts=max(len(plan.requests), 2400), headroom=self.s.headroom,
                min_rate=low, max_rate=high, first_must_pass=must_pass, on_probe=on_probe,
                lowest_rate=None if steady is None else steady.lowest_rate(plan.slo),
                unit=self.s.unit)
            if not ceiling.probes:  # the budget ran out before the first load test
                raise BudgetSpent(ceiling.sentence())
        except (CeilingError, TrialFailed) as exc:
            last = probe.results[-1] if probe.results else None
            result = last if last is not None else TrialResult(
                flags=dict(flags), rate=start or 0.0, status=INFEASIBLE,
                mode=self.backend.mode, backend=self.backend.name,
                gpus=self.backend.gpus_used(flags))
            if result.status != INFEASIBLE or result.reason is None:
                reason = "budget_spent" if isinstance(exc, BudgetSpent) else "failed"
                result.status, result.reason, result.detail = INFEASIBLE, reason, str(exc)
            return ConfigOutcome(result, None, 0.0, False, why,
                                 self.backend.server_s - before)
        self.load_test_s += sum(r.load_test_s for r in probe.results)
        at = ceiling.feasible_probe()
        if at is not None:
            result = probe.results[at.index]
        else:
            # No rate passed: the lowest rate's test says why.
            low_probe = min(ceiling.probes, key=lambda p: (p.rate, -p.index))
            result = probe.results[low_probe.index]
        if result.records:
            result.records_path = str(write_records(self.s.out_dir, trial.number,
                                                    result.records))
        value = (0.0 if at is None else trial_value(result, self.s, ceiling.feasible_max))
        return ConfigOutcome(result, ceiling, value, ceiling.below_start, why,
                             self.backend.server_s - before, self._launch(probe.results),
                             probe)

    def _launch(self, results: Sequence[TrialResult]) -> dict[str, Any] | None:
        """The argv and environment the config's server was started with."""
        for r in results:
            argv = (r.startup or {}).get("argv")
            if argv:
                env = getattr(getattr(self.backend, "server", None), "env", None) or {}
                return {"argv": list(argv), "env": dict(env)}
        return None

    def _repeat(self, trial: optuna.Trial, twin: FrozenTrial) -> float:
        """A config the study already searched (a sampler may propose it again): its
        answer stands, and no server time is spent on it twice."""
        attrs = dict(twin.user_attrs.get("result") or {})
        attrs["repeat_of"] = twin.number
        attrs["server_s"] = 0.0
        trial.set_user_attr("result", attrs)
        for key in ("status", "reason", "feasible", "p99_e2e_s", "goodput_tokens"):
            if key in twin.user_attrs:
                trial.set_user_attr(key, twin.user_attrs[key])
        for key, value in (twin.constraints or {}).items():
            trial.set_constraint(key, value)
        if twin.state == TrialState.PRUNED:
            raise optuna.TrialPruned(f"same config as trial {twin.number}")
        return float(twin.value or 0.0)

    def _rule_broken(self, trial: optuna.Trial, flags: dict[str, Any],
                     violations: list[Violation]) -> float:
        first = violations[0]
        trial.set_user_attr("result", {
            "status": INFEASIBLE, "feasible": False, "reason": first.rule,
            "detail": "; ".join(str(v) for v in violations), "flags": flags, "rate": None,
            "rules": [v.rule for v in violations], "launched": False,
        })
        trial.set_user_attr("status", INFEASIBLE)
        trial.set_user_attr("reason", first.rule)
        for key, value in constraints_for(None, self.s.slo).items():
            trial.set_constraint(key, value)
        if self.on_result is not None:
            self.on_result(trial.number, None, violations)
        return 0.0

    def _store(self, trial: optuna.Trial, outcome: ConfigOutcome) -> None:
        result = outcome.result
        attrs = StoredTrial.result_attrs(result)
        attrs["launched"] = True
        ceiling = outcome.ceiling
        if ceiling is not None:
            brief = ceiling.to_dict()
            for p in brief["probes"]:
                p.pop("summary", None)
            attrs["ceiling"] = json_safe(brief)
            attrs["rate_cap"] = ceiling.recommended_cap
        attrs["start"] = outcome.start_how
        attrs["launch"] = outcome.launch
        attrs["server_s"] = outcome.server_s
        trial.set_user_attr("result", attrs)
        trial.set_user_attr("status", attrs["status"])
        trial.set_user_attr("reason", attrs["reason"])
        trial.set_user_attr("feasible", attrs["feasible"])
        if result.summary is not None:
            trial.set_user_attr("p99_e2e_s", _f(result.summary.e2e.p99))
            trial.set_user_attr("goodput_tokens", _f(result.measured_goodput("tokens")))
        for key, value in constraints_for(result, self.s.slo).items():
            trial.set_constraint(key, value)
        if ceiling is None:
            _append_experiment(self.s, trial.number, result)
        else:
            for p in ceiling.probes:
                if p.summary is not None:
                    _append_probe(self.s.out_dir, self.s.name, trial.number, result.flags,
                                  result.backend, p)


@dataclass
class ConfigOutcome:
    """What one trial found for its config."""

    result: TrialResult  # the test at the ceiling (or the one that said why not)
    ceiling: Any  # autotune.tuning.ceiling.CeilingResult, None when no probe could run
    value: float
    pruned: bool  # below the incumbent's rate
    start_how: str
    server_s: float
    launch: dict[str, Any] | None = None
    probe: Any = None  # autotune.tuning.ceiling.BackendProbe, with every test's records


def _same_config(study: optuna.Study, number: int, params: Mapping[str, Any]
                 ) -> FrozenTrial | None:
    """A finished, launched trial of exactly these parameters, if any."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,
                                                      TrialState.PRUNED)):
        res = t.user_attrs.get("result") or {}
        if t.number != number and res.get("launched") and _same_params(t.params, params):
            return t
    return None


def _same_params(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """``a`` and ``b`` are one config.  Optuna stores a sampled stepped float with its
    binary noise (0.8500000000000001) where the space's suggestion, and a config
    queued by value, say 0.85 (``Param.suggest`` rounds to 10 digits): compared as
    they stand, a trial never found its twin of such a config and ran it again."""
    return canonical_params(a) == canonical_params(b)


def _await_running_twin(study: optuna.Study, number: int, params: Mapping[str, Any], *,
                        poll_s: float = 0.5) -> FrozenTrial | None:
    """When another live process is running exactly these parameters (the processes of
    one study sample independently and may propose the same config at once), wait for
    its answer rather than spend a second server start on it.  None when there is no
    such trial, or it failed (then this trial runs the config itself).

    Only a lower-numbered trial is waited for, so two trials never wait for each other.
    A lower-numbered trial still suggesting its values (no CONFIGURED_ATTR yet) may turn
    out to be this config: it is waited for until it says, as in Lamport's bakery with
    the trial number as the ticket.  Comparing only finished suggestions let two workers
    start vLLM's defaults at once (CI of 2026-12-05).

    A trial's process is known to live by its heartbeat, where the storage has them:
    the stale ones are failed once per look, and what is still RUNNING lives.  Without
    them, by a live pid on this host (another host's trial cannot be told from a dead
    one there)."""
    beats = heartbeat_enabled(storage_of(study))
    while True:
        if beats:
            fail_stale_heartbeats(study)
        lower = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                 if t.number < number
                 and (_choosing(t, params) or _same_params(t.params, params))
                 and (beats or _alive_on_this_host(t))]
        if not lower:
            return _same_config(study, number, params)
        time.sleep(poll_s)


def _choosing(t: FrozenTrial, names: Collection[str] = ()) -> bool:
    """Still suggesting its values.  A trial of a process that never sets the marker (an
    older autotune) counts so only for CHOOSING_S after its start, not for its run.

    A trial read with the marker but without one of ``names`` (the parameters this
    trial suggested) was read torn, and counts as choosing too: an RDB storage reads a
    trial's params and its system attrs in separate statements (Optuna's selectinload),
    each with its own snapshot under PostgreSQL's READ COMMITTED, so a trial that
    finishes suggesting between the two shows the marker beside its first values
    only, which looked like another config."""
    if t.datetime_start is None:
        return False
    if t.system_attrs.get(CONFIGURED_ATTR) and all(n in t.params for n in names):
        return False
    return (datetime.now() - t.datetime_start).total_seconds() < CHOOSING_S


def _alive_on_this_host(t: FrozenTrial) -> bool:
    """The process running ``t`` is another one on this host, and alive."""
    pid = t.system_attrs.get("autotune:pid")
    return (t.system_attrs.get("autotune:host") == socket.gethostname()
            and isinstance(pid, int) and pid != os.getpid() and process_running(pid))


def trial_value(result: TrialResult, s: StudySettings, level: float | None) -> float:
    """A searched config's objective: its goodput at its ceiling, or for a search by
    users the ceiling itself (per GPU when asked)."""
    if s.objective != "level":
        return result.goodput(s.objective, s.per_gpu)
    return (level or 0.0) / (max(result.gpus or 1, 1) if s.per_gpu else 1)


def incumbent(study: optuna.Study) -> float | None:
    """The best objective value of a feasible finished trial so far."""
    best: float | None = None
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("feasible") and t.value is not None and (
                best is None or t.value > best):
            best = float(t.value)
    return best


def _f(x: float) -> float | None:
    return None if x is None or math.isnan(x) or math.isinf(x) else float(x)


def _append_probe(out_dir: Path, study: str, number: int, flags: Mapping[str, Any],
                  backend: str | None, probe: Any, purpose: str = "trial") -> None:
    """One row per load test of a ceiling search (a trial's, or a refinement's)."""
    row = row_from_summary(
        probe.summary.to_dict(), study=study, trial=number, config=flags,
        rate=probe.rate, backend=backend,
        gpu={"util_mean_pct": None if probe.gpu_util is None else 100.0 * probe.gpu_util,
             "util_max_pct": None},
        pruned_reason=None if probe.passed else probe.verdict, purpose=purpose)
    append_experiment(out_dir / "experiments.csv", row)


def append_load_test(out_dir: Path, study: str, number: int | None, result: TrialResult,
                     purpose: str) -> None:
    """One row for a load test outside a ceiling search (a trial without one, or the
    validation run)."""
    if result.summary is None:
        return
    row = row_from_summary(
        result.summary.to_dict(), study=study, trial=number, config=result.flags,
        rate=result.rate, backend=result.backend,
        gpu={"util_mean_pct": result.telemetry.get("gpu_util_mean_pct"),
             "util_max_pct": result.telemetry.get("gpu_util_max_pct")},
        pruned_reason=None if result.status != PRUNED else result.reason, purpose=purpose)
    append_experiment(out_dir / "experiments.csv", row)


def _append_experiment(settings: StudySettings, number: int, result: TrialResult) -> None:
    """One row in ``studies/<name>/experiments.csv`` (the shared history)."""
    append_load_test(settings.out_dir, settings.name, number, result, "trial")


# ----------------------------------------------------------------------------- run


@dataclass
class StudyRun:
    study: optuna.Study
    rows: list[StoredTrial]
    new_trials: int
    stale_failed: list[int]
    stopped_by: str  # "n_trials" | "timeout" | "budget" | "grid exhausted" | "nothing to do"
    wall_s: float
    server_s: float
    load_test_s: float
    saved_s: float
    ran_here: int = 0  # of new_trials, those this process ran (workers ran the others)
    # Trials this process ran that another failed meanwhile (a heartbeat gap longer than
    # its grace period); Optuna queued their retries.
    taken_over: list[int] = field(default_factory=list)


def run_study(
    settings: StudySettings,
    backend: Backend,
    plan: LoadPlan,
    *,
    storage: optuna.storages.BaseStorage | None = None,
    enqueue: Sequence[tuple[dict[str, Any], dict[str, Any]]] = (),
    on_result: Callable[[int, TrialResult | None, list[Violation]], None] | None = None,
    on_trial_end: Callable[[optuna.Study, FrozenTrial], None] | None = None,
    on_probe: Callable[[int, Any], None] | None = None,
    on_progress: Callable[[int, float, Any], None] | None = None,
    attrs: Mapping[str, Any] | None = None,
    predict: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = None,
    on_searched: Callable[[optuna.Trial, Any, Any], None] | None = None,
) -> StudyRun:
    """Create or resume the study and run trials until n_trials/timeout/budget.

    ``attrs``: study user attributes that say how it is measured (backend, source,
    profile, workload), for anyone who opens the study (optuna-dashboard).
    ``predict`` and ``on_searched``: the twin's hooks (see :class:`Objective`)."""
    validate_name(settings.name)
    storage = storage or open_storage(storage_url(settings.name, settings.storage,
                                                  settings.studies_dir))
    objective = Objective(settings, backend, plan, None, on_result, on_probe)
    objective.on_progress = on_progress
    objective.predict, objective.on_searched = predict, on_searched
    study = open_study(settings, storage, None, space=objective.space)
    for key, value in (attrs or {}).items():
        study.set_user_attr(key, value)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    stale = fail_stale_trials(study)
    enqueue_baseline(study, objective.space)
    _enqueue_picks(study, objective.space, enqueue)
    # After the defaults and the predicted picks: a small categorical space is covered
    # before any config repeats (TPE's random start-up draws repeat in a tiny space).
    def cover() -> None:
        enqueue_coverage(study, objective.space, settings.n_trials, gpus=settings.gpus,
                         attention_heads=settings.attention_heads)

    cover()
    done_states = (TrialState.COMPLETE, TrialState.PRUNED)
    finished = len(study.get_trials(deepcopy=False, states=done_states))
    remaining = None if settings.n_trials is None else max(settings.n_trials - finished, 0)
    stopped = {"by": "n_trials"}
    server0 = backend.server_s
    if settings.budget_s is not None:
        objective.deadline_s = server0 + settings.budget_s
    min_test_s = objective.plan.steady.min_s(plan.slo) if objective.plan.steady else 0.0

    def budget_cb(study: optuna.Study, frozen: FrozenTrial) -> None:
        if on_trial_end is not None:
            on_trial_end(study, frozen)
        cover()
        # A trial started with less budget than one test's minimum could not pass a
        # test: it would only spend a server start.
        if (settings.budget_s is not None and backend.server_s - server0
                >= settings.budget_s - min_test_s):
            stopped["by"] = "budget"
            study.stop()

    t0 = time.monotonic()
    taken_over: list[int] = []
    if remaining != 0:
        stopped["by"] = _run_seated(study, objective, settings, callbacks=[budget_cb],
                                    budget_spent=lambda: stopped["by"] == "budget",
                                    taken_over=taken_over)
    else:
        stopped["by"] = "nothing to do"
    new = len(study.get_trials(deepcopy=False, states=done_states)) - finished
    mine = _ran_here(study, done_states)
    if (settings.sampler == "grid" and remaining and new < remaining
            and stopped["by"] == "n_trials"):
        stopped["by"] = "grid exhausted"
    return StudyRun(study=study, rows=rows_from_study(study), new_trials=new, ran_here=mine,
                    stale_failed=stale, taken_over=taken_over, stopped_by=stopped["by"],
                    wall_s=time.monotonic() - t0,
                    server_s=backend.server_s - server0, load_test_s=objective.load_test_s,
                    saved_s=objective.saved_s)


def _enqueue_picks(study: optuna.Study, space: SearchSpace,
                   enqueue: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Queue the given first configs (cut to the searched parameters) unless one is
    already waiting, so a resumed study does not run a pick twice."""
    queued = {repr(sorted(t.params.items())) for t in
              study.get_trials(deepcopy=False, states=(TrialState.WAITING,))}
    for params, attrs in enqueue:
        params = {k: v for k, v in params.items() if k in space.params}
        if repr(sorted(params.items())) not in queued:
            study.enqueue_trial(params, user_attrs=attrs)


def _ran_here(study: optuna.Study, done_states: tuple[TrialState, ...]) -> int:
    """Finished trials this process ran, told apart from the workers' by pid and host."""
    return sum(1 for t in study.get_trials(deepcopy=False, states=done_states)
               if t.system_attrs.get("autotune:pid") == os.getpid()
               and t.system_attrs.get("autotune:host") == socket.gethostname())


def _run_seated(study: optuna.Study, objective: Objective, settings: StudySettings, *,
                callbacks: list[Callable[[optuna.Study, FrozenTrial], None]],
                budget_spent: Callable[[], bool], taken_over: list[int],
                poll_s: float = 0.5) -> str:
    """Run trials one at a time until the study (all its processes together) holds
    n_trials finished ones, the timeout passes or the budget is spent; why it stopped.

    Workers may run trials on the same study: a trial claims a seat first (a surplus one
    gives its config back to the queue), and while the last seats are taken elsewhere
    this waits for them rather than ending the study early.  ``taken_over`` collects the
    trials that another process failed while they ran here (see run_seated_trial)."""
    t0 = time.monotonic()
    n_trials = settings.n_trials
    while True:
        left = None if settings.timeout_s is None else settings.timeout_s - (
            time.monotonic() - t0)
        if left is not None and left <= 0:
            return "timeout"
        done, wait = should_wait(study, n_trials)
        if done:
            return "n_trials"
        sampler = study.sampler
        if isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study):
            return "n_trials"
        if wait:
            time.sleep(poll_s)  # other processes hold the last seats; they may die
            continue
        seated = run_seated_trial(study, objective, n_trials, timeout=left,
                                  callbacks=callbacks)
        if seated.outcome == "finished elsewhere" and seated.number is not None:
            taken_over.append(seated.number)
        if seated.outcome == "surplus":
            continue
        if budget_spent():
            return "budget"


# ----------------------------------------------------------------------------- prescreen


def rate_bounds(space: SearchSpace) -> tuple[float, float] | None:
    """Lowest and highest rate cap the space can try (None: it has no request_rate)."""
    p = space.params.get("request_rate")
    if p is None:
        return None
    if p.type == "categorical":
        values = [float(v) for v in p.choices]
        return min(values), max(values)
    low, high = p.bounds()
    return float(low), float(high)


def prescreen_enqueue(rows: Sequence[StoredTrial], space: SearchSpace, *, top_k: int = 3
                      ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The pre-screen's top-K configs, each with its predicted ceiling (the simulated
    trial's own rate search) as where the real trial's search starts."""
    out: list[tuple[dict[str, Any], dict[str, Any]]] = []
    seen: set[str] = set()
    for row in sorted((r for r in rows if r.feasible and r.value is not None),
                      key=lambda r: (-(r.value or 0.0), r.number)):
        params = {k: v for k, v in row.params.items() if k not in CLIENT_PARAMS}
        key = repr(sorted(params.items()))
        if key in seen:
            continue
        seen.add(key)
        predicted = {
            "source": SIMULATED,
            "by": PRESCREEN_BY,
            "prescreen_trial": row.number,
            "ceiling_rate": row.rate,
            "goodput_tokens": row.goodput_tokens,
            "goodput_requests": row.goodput_requests,
            "p99_e2e_s": row.stat("e2e", "p99"),
            "output_throughput": row.measured("output_throughput"),
        }
        out.append((params, {"predicted": predicted}))
        if len(out) >= top_k:
            break
    return out


# ----------------------------------------------------------------------------- refine


@dataclass
class RefinedCeiling:
    """The ceiling search's answer for one of the study's best configs."""

    trial: int
    config: dict[str, Any]
    start_rate: float
    result: Any  # autotune.tuning.ceiling.CeilingResult
    path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "trial": self.trial, "start_rate": self.start_rate,
                **self.result.to_dict()}


def top_configs(rows: Sequence[StoredTrial], *, top_k: int) -> list[StoredTrial]:
    """The best feasible trial of each of the ``top_k`` best distinct server configs."""
    seen: set[str] = set()
    picks: list[StoredTrial] = []
    for row in sorted((r for r in rows if r.feasible and r.value is not None),
                      key=lambda r: (-(r.value or 0.0), r.number)):
        key = repr(sorted((k, v) for k, v in row.flags.items() if k not in CLIENT_PARAMS))
        if key in seen:
            continue
        seen.add(key)
        picks.append(row)
        if len(picks) >= top_k:
            break
    return picks


def refine_ceilings(
    rows: Sequence[StoredTrial],
    backend: Backend,
    plan: LoadPlan,
    *,
    top_k: int = 3,
    headroom: float = 0.10,
    max_probes: int = 8,
    tol: float = 0.05,
    num_prompts: int | None = None,
    out_dir: Path | None = None,
    on_ceiling: Callable[[RefinedCeiling], None] | None = None,
    deadline_s: float | None = None,
    on_probe: Callable[[int, Any], None] | None = None,
    on_progress: Callable[[int, float, Any], None] | None = None,
    unit: LoadUnit = RATE,
) -> list[RefinedCeiling]:
    """Run ``find_ceiling`` on the ``top_k`` best feasible configs, starting at each
    trial's rate, on the study's backend (one server start per config, reused across its
    probes).  With the plan's steady-state rule each probe is a full sequential test,
    pooled across the config's rates (``search_steady``): this is the proof of a
    screened search.  Each result goes to ``<out_dir>/ceiling-trial-<n>.json`` (what
    the report plots).  A config whose probes cannot run is skipped, never ends the
    search.  ``deadline_s`` (on the backend's ``server_s`` clock): the budget's end,
    after which no test starts and a running one is cut."""
    n = num_prompts or len(plan.requests)
    need = max(min_samples_for_bound(lim.percentile, 0.95) for lim in plan.slo.limits)
    steady = search_steady(plan.steady, max_probes)
    out: list[RefinedCeiling] = []
    for row in top_configs(rows, top_k=top_k):
        config = {k: v for k, v in row.flags.items() if k not in CLIENT_PARAMS}
        # A config whose screening passed nothing starts after a saturation test.
        start = float(row.rate) if row.feasible and row.rate else None
        probe = _refine_probe(backend, config, plan, steady, deadline_s, on_progress,
                              row.number, unit)
        try:
            result = find_ceiling(probe, slo=plan.slo, start_rate=start, tol=tol,
                                  on_probe=None if on_probe is None else (
                                      functools.partial(on_probe, row.number)),
                                  max_probes=max_probes, num_prompts=n,
                                  max_num_prompts=2 * max(n, need), headroom=headroom,
                                  lowest_rate=None if steady is None
                                  else steady.lowest_rate(plan.slo), unit=unit)
        except (CeilingError, TrialFailed) as exc:
            out_note = f"trial {row.number}: ceiling search stopped: {exc}"
            if on_ceiling is not None:
                on_ceiling(RefinedCeiling(row.number, config, start or 0.0,
                                          _Failed(out_note)))
            continue
        refined = RefinedCeiling(trial=row.number, config=config, start_rate=start or 0.0,
                                 result=result)
        if out_dir is not None:
            _save_refined(out_dir, refined, backend)
        out.append(refined)
        if on_ceiling is not None:
            on_ceiling(refined)
    return out


def _refine_probe(backend: Backend, config: dict[str, Any], plan: LoadPlan, steady: Any,
                  deadline_s: float | None,
                  on_progress: Callable[[int, float, Any], None] | None, number: int,
                  unit: LoadUnit = RATE) -> Any:
    """One config's probe over the whole pool (warm-up included), reporting its running
    evidence under the trial's number."""
    probe = BackendProbe.for_plan(backend, config, plan, steady=steady,
                                  deadline_s=deadline_s, unit=unit)
    if on_progress is not None:
        probe.on_evidence = functools.partial(on_progress, number)
    return probe


def _save_refined(out_dir: Path, refined: RefinedCeiling, backend: Backend) -> None:
    """Keep each probe in the experiment history and the search's answer as the JSON
    file the report plots."""
    result, number, config = refined.result, refined.trial, refined.config
    for p in result.probes:
        if p.summary is not None:
            _append_probe(out_dir, out_dir.name, number, config,
                          getattr(backend, "name", None), p, purpose="refinement")

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"ceiling-trial-{number}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(json_safe(refined.to_dict()), indent=2,
                              allow_nan=False, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    refined.path = path


@dataclass
class _Failed:
    """Stands in for a CeilingResult when a config's ceiling search could not run."""

    note: str
    feasible: bool = False
    feasible_max: float | None = None

    def sentence(self) -> str:
        return self.note
