"""The study's twin: the simulator learning the server a study measures, trial by trial.

After each trial of a real study (``autotune search --twin``), :class:`StudyTwin`:

1. scores the trial's load tests on the twin as it was *before* the trial ran, so each
   trial shows the twin's out-of-sample error (the number that must shrink as the study
   goes on), beside the prior profile's error on the same tests;
2. refits the profile's free factors (:func:`autotune.tuning.twin.fit_twin`) to every load
   test so far, and writes ``studies/<name>/profile.fitted.yaml`` (a hardware profile
   the simulator, ``--prescreen`` and ``bench --backend sim`` read) and ``twin.json``
   (the fit after every trial);
3. predicts configs not yet run: a short study on the twin in virtual time gives its
   best config, which the real study measures next, and every trial's first probe
   starts at the twin's predicted ceiling.

:meth:`StudyTwin.hooks` is the one wiring of a twin into ``run_study`` (the search
pipeline and the scenario benchmark both pass it).  Predictions are stored with the
trial (``predicted``, source ``simulated``) so the recommendation and the report show
predicted and measured side by side.  Everything the twin says is simulated; only the
load tests it learns from are measured.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import optuna

from autotune.backends.base import TrialFailed
from autotune.backends.factory import BackendSpec, create_backend
from autotune.core.errors import AutotuneError
from autotune.core.files import atomic_write, json_safe
from autotune.core.flags import config_key
from autotune.core.metrics import SIMULATED
from autotune.sim.profiles import HardwareProfile, ModelProfile
from autotune.study.study import prescreen_enqueue, rate_bounds, rows_from_study, run_study
from autotune.tuning.record import stored_trials
from autotune.tuning.twin import (
    FIGURES,
    ObservedTest,
    TwinError,
    TwinFit,
    fit_twin,
    observations_from_search,
    predict_ceiling,
    resimulate,
    write_twin,
)

PROFILE_FILE = "profile.fitted.yaml"
HISTORY_FILE = "twin.json"


@dataclass(frozen=True, kw_only=True)
class TwinStep:
    """What the twin learned from one trial."""

    trial: int
    new_tests: int
    tests: int  # every test fitted so far
    before_error: float | None  # RMS log error of this trial's tests on the twin before it
    prior_error: float | None  # ... and on the prior profile
    fit_error: float  # RMS log error of every test on the refitted twin
    factors: dict[str, tuple[float, float]]  # name -> (value, log s.e.)
    predicted_ceiling: float | None  # the twin's prediction before the trial ran
    measured_ceiling: float | None
    cpu_s: float
    notes: tuple[str, ...] = ()

    def sentence(self) -> str:
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{math.expm1(x):.1%}"

        facs = ", ".join(f"{n} x{v:.3g}±{se:.2g}" for n, (v, se) in self.factors.items())
        pred = ""
        if self.predicted_ceiling is not None:
            meas = ("none passed" if self.measured_ceiling is None
                    else f"measured {self.measured_ceiling:.4g} req/s")
            pred = f"; ceiling predicted {self.predicted_ceiling:.4g} req/s, {meas}"
        return (f"twin after trial {self.trial} (simulated; fitted to {self.tests} measured "
                f"load tests): this trial's {self.new_tests} tests were predicted within "
                f"{pct(self.before_error)} RMS before it ran (the prior profile: "
                f"{pct(self.prior_error)}); refitted RMS {pct(self.fit_error)}; {facs}"
                f"{pred}; {self.cpu_s:.1f} CPU s")

    def to_dict(self) -> dict[str, Any]:
        return {"trial": self.trial, "new_tests": self.new_tests, "tests": self.tests,
                "before_rms_log_error": self.before_error,
                "prior_rms_log_error": self.prior_error,
                "fit_rms_log_error": self.fit_error,
                "factors": {n: {"value": v, "log_se": se}
                            for n, (v, se) in self.factors.items()},
                "predicted_ceiling": self.predicted_ceiling,
                "measured_ceiling": self.measured_ceiling, "cpu_s": self.cpu_s,
                "notes": list(self.notes)}


@dataclass
class StudyTwin:
    """The twin of one study: its prior, what it has seen, and its current profile.

    ``plan``: the study's load plan (the twin's predictions run its ceiling search with
    the same requests and rules).  ``settings``: the study's settings (space, SLO,
    objective, ceiling search), used for the twin's own short study.  ``candidates``:
    trials of that study after each refit (0: predict only the trial at hand).
    ``tests_per_trial``, ``max_tests`` and ``cap``: how many of a trial's load tests are
    kept (most informative first), how many in all (the oldest go first) and how many
    completed requests of each are scored, so that a refit costs seconds to a minute of
    CPU however long the study runs (every solver step re-simulates every test).
    """

    prior: HardwareProfile
    model: ModelProfile
    out_dir: Path
    plan: Any  # autotune.backends.base.LoadPlan
    settings: Any  # autotune.study.study.StudySettings
    candidates: int = 12
    tests_per_trial: int = 3
    max_tests: int = 12
    cap: int = 150
    profile: HardwareProfile = field(init=False)
    tests: list[ObservedTest] = field(default_factory=list)
    steps: list[TwinStep] = field(default_factory=list)
    fit: TwinFit | None = None
    queued: set[str] = field(default_factory=set)  # configs the twin has queued

    def __post_init__(self) -> None:
        if (self.candidates < 0 or self.tests_per_trial < 1 or self.max_tests < 1
                or self.cap < 1):
            raise TwinError("the twin needs candidates >= 0, and tests_per_trial, max_tests "
                            "and cap >= 1")
        self.profile = self.prior

    @classmethod
    def for_study(cls, *, prior: HardwareProfile, model: ModelProfile, settings: Any,
                  plan: Any, candidates: int = 12) -> StudyTwin:
        """The twin of the study ``settings`` describes, writing into its folder."""
        return cls(prior=prior, model=model, out_dir=settings.out_dir, plan=plan,
                   settings=settings, candidates=candidates,
                   # One pass over the request pool at most: scoring a test's cycled
                   # repeats of the same requests tells the fit nothing new.
                   cap=max(1, min(cls.cap, len(plan.requests))))

    def hooks(self, *, say: Callable[[str], None] | None = None,
              warn: Callable[[str], None] | None = None) -> dict[str, Callable[..., Any]]:
        """``run_study``'s keyword arguments that put this twin in the study
        (``predict`` and ``on_searched``): every trial not already predicted is
        predicted, and after each searched trial the twin refits, records what it
        learned on the trial (``twin``) and queues its best config not yet measured.
        ``say`` gets what it learned and picked, ``warn`` why it could not."""
        return {"predict": self.predict,
                "on_searched": _learner(self, say or _quiet, warn or _quiet)}

    @property
    def source(self) -> str:
        if self.fit is None:
            return f"the prior profile {self.prior.name} (no trial fitted yet)"
        return f"the twin fitted to {len(self.tests)} load tests"

    # -- predictions -------------------------------------------------------------------
    def predict(self, flags: Mapping[str, Any]) -> dict[str, Any] | None:
        """The twin's ceiling of ``flags`` as a trial's ``predicted`` attrs (None when
        the simulator refuses the config: the real server is the judge of that)."""
        low, high = _rate_bounds(self.settings)
        try:
            p = predict_ceiling(self.profile, self.model, flags, self.plan,
                                tol=self.settings.tol, max_probes=self.settings.max_probes,
                                headroom=self.settings.headroom, min_rate=low, max_rate=high)
        except (AutotuneError, TrialFailed, ValueError) as exc:  # advice, never a crash
            return {"source": SIMULATED, "by": self.source, "ceiling_rate": None,
                    "note": f"the twin could not predict this config: {exc}"}
        if p.ceiling_rate is None:
            return None
        return {"source": SIMULATED, "by": self.source, "ceiling_rate": p.ceiling_rate,
                "goodput_tokens": p.goodput_tokens, "goodput_requests": p.goodput_requests,
                "cpu_s": p.cpu_s}

    def picks(self, measured: Sequence[Mapping[str, Any]], *, seed: int = 0
              ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """The twin's best config not yet measured, with its predicted ceiling: a short
        study (``candidates`` trials) on the twin in virtual time, in a throwaway
        folder and in-memory storage."""
        if self.candidates < 1:
            return []

        # Enqueued trials hold no params until they run: what the twin queued itself.
        seen = {config_key(m) for m in measured} | self.queued
        with tempfile.TemporaryDirectory(prefix="autotune-twin-") as tmp:
            pre = replace(self.settings, name=f"{self.settings.name}-twin",
                          n_trials=self.candidates, timeout_s=None, budget_s=None,
                          storage=None, studies_dir=Path(tmp), seed=seed)
            sim = create_backend(BackendSpec(kind="sim", hardware=self.profile,
                                             sim_model=self.model))
            run = run_study(pre, sim, self.plan,
                            storage=optuna.storages.InMemoryStorage())
            ranked = prescreen_enqueue(rows_from_study(run.study), self.settings.space,
                                       top_k=self.candidates)
        for params, attrs in ranked:
            if config_key(params) not in seen:
                attrs["predicted"]["by"] = (f"{self.source}, best of {self.candidates} "
                                            "simulated trials")
                self.queued.add(config_key(params))
                return [(params, attrs)]
        return []

    # -- learning ----------------------------------------------------------------------
    def observe(self, number: int, probe: Any, ceiling: Any,
                predicted: Mapping[str, Any] | None = None) -> TwinStep | None:
        """Learn from trial ``number``'s ceiling search (``probe`` and ``ceiling`` of
        ``autotune.tuning.ceiling``); None when none of its tests completed a request."""
        t0 = time.process_time()
        new = observations_from_search(probe, ceiling, limit=self.tests_per_trial,
                                       trial=number, cap=self.cap)
        if not new:
            return None
        before = _rms(new, self.profile, self.model)
        prior = before if self.fit is None else _rms(new, self.prior, self.model)
        self.tests = (self.tests + new)[-self.max_tests:]
        self.fit = fit_twin(self.tests, self.prior, self.model,
                            name=f"{self.prior.name}-twin")
        self.profile = self.fit.profile
        pred = (predicted or {}).get("ceiling_rate")
        step = TwinStep(
            trial=number, new_tests=len(new), tests=len(self.tests), before_error=before,
            prior_error=prior, fit_error=self.fit.rms_log_error,
            factors={f.name: (f.value, f.log_se) for f in self.fit.factors if f.fitted},
            predicted_ceiling=float(pred) if isinstance(pred, (int, float)) else None,
            measured_ceiling=ceiling.feasible_max, cpu_s=time.process_time() - t0,
            notes=self.fit.notes)
        self.steps.append(step)
        self._write()
        return step

    def _write(self) -> None:

        assert self.fit is not None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_twin(self.fit, self.out_dir / PROFILE_FILE,
                   header=[f"Written by autotune search --twin after trial "
                           f"{self.steps[-1].trial}."])
        data = {"prior": self.prior.name, "model": self.model.name, "source": SIMULATED,
                "profile": PROFILE_FILE, "steps": [s.to_dict() for s in self.steps],
                "fit": self.fit.to_dict()}
        atomic_write(self.out_dir / HISTORY_FILE,
                     json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n")


def _quiet(_text: str) -> None:
    return None


def _learner(twin: StudyTwin, say: Callable[[str], None], warn: Callable[[str], None]
             ) -> Callable[[Any, Any, Any], None]:
    """After each searched trial: refit the twin, say how well it predicted the trial,
    and queue its best config not yet measured."""
    def learn(trial: Any, probe: Any, ceiling: Any) -> None:
        try:
            step = twin.observe(trial.number, probe, ceiling, trial.user_attrs.get("predicted"))
        except (AutotuneError, ValueError) as exc:
            # The twin is advice: a config the simulator cannot model (or a fit that
            # fails) costs this trial's lesson, never the study.
            warn(f"twin: trial {trial.number} not learned: {exc}")
            return
        if step is None:
            return
        trial.set_user_attr("twin", step.to_dict())
        say(step.sentence())
        study = trial.study
        measured = [t.params for t in stored_trials(study, finished=False)]
        try:
            picks = twin.picks(measured, seed=pick_seed(twin.settings.seed, trial.number))
        except (AutotuneError, ValueError) as exc:
            warn(f"twin: no pick after trial {trial.number}: {exc}")
            return
        for params, attrs in picks:
            study.enqueue_trial(params, user_attrs=attrs)
            p = attrs["predicted"]
            say(f"twin: next, its best predicted config {params} (ceiling "
                f"{p.get('ceiling_rate') or 0:.4g} req/s, goodput "
                f"{p.get('goodput_tokens') or 0:,.0f} tok/s; simulated)")

    return learn


def pick_seed(study_seed: int, number: int) -> int:
    """The seed of the twin's short study after trial ``number``: fixed by the search's
    ``--seed`` and the trial, so a rerun repeats its picks and another ``--seed`` draws
    others (a plain sum would give seed 1 after trial 1 the picks of seed 0 after 2)."""
    return int(np.random.SeedSequence([study_seed, number]).generate_state(1)[0])


def _rms(tests: Sequence[ObservedTest], profile: HardwareProfile, model: ModelProfile
         ) -> float | None:
    """RMS of log(simulated / measured) over the tests' figures on ``profile``."""
    errs: list[float] = []
    for t in tests:
        try:
            sim = resimulate(t, profile, model).figures
        except TwinError:
            continue
        for name in FIGURES:
            m, s = t.measured.value(name), sim.value(name)
            if math.isfinite(m) and math.isfinite(s) and m > 0 and s > 0:
                errs.append(math.log(s / m))
    return float(np.sqrt(np.mean(np.square(errs)))) if errs else None


def _rate_bounds(settings: Any) -> tuple[float | None, float | None]:
    found = rate_bounds(settings.space)
    return found if found is not None else (None, None)
