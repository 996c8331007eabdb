"""What ``autotune search`` runs with: one typed, frozen object, checked when it is made.

The CLI (:mod:`autotune.cli.search`) parses every option string into it; the pipeline
(:func:`autotune.search.pipeline.run_search`) takes it and nothing else.  Option groups
that other commands share (the workload, the server, the simulator's profile, the rate
search) come from :mod:`autotune.tuning.options`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotune.analysis.tiers import Tier, check_tiers
from autotune.core.slo import SLO
from autotune.study.space import SearchSpace
from autotune.study.study import OBJECTIVES, SAMPLERS, storage_url, validate_name
from autotune.tuning.load_unit import RATE, LoadUnit
from autotune.tuning.options import (
    OptionsError,
    RateSearch,
    ServerOptions,
    SimProfile,
    WorkloadOptions,
    at_least,
    check_backend,
)
from autotune.tuning.verdict import SteadyState
from autotune.workload.pool import PoolOptions


@dataclass(frozen=True, kw_only=True)
class TwinOptions:
    """``--twin``: the simulator on ``prior`` learns the server as the study runs; each
    of its picks is the best of ``candidates`` simulated trials."""

    prior: str
    candidates: int = 12

    def __post_init__(self) -> None:
        if self.candidates < 0:
            raise OptionsError(f"--twin-candidates must be 0 (predict only the trial at "
                               f"hand) or more, got {self.candidates}")

    def node(self, study: SimProfile) -> SimProfile:
        """The node the twin starts from: the prior's hardware, the study's GPUs and model."""
        return replace(study, hardware=self.prior)


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """A whole search: the SLO and the space, how each config is measured, how the
    study runs, and what follows it (the proof of the best, the validation of the cap)."""

    slo: SLO
    space: SearchSpace
    backend: str = "sim"
    profile: SimProfile | None = None  # the simulator's node; None: the space's own
    profile_given: bool = False  # --profile was given, not only the space's
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    pool: PoolOptions = field(default_factory=PoolOptions)  # --dataset and its shape
    tiers: tuple[Tier, ...] = ()  # --tier NAME=SLO: re-judged from the proof's tests
    server: ServerOptions = field(default_factory=ServerOptions)
    steady: SteadyState = field(default_factory=SteadyState)
    rates: RateSearch = field(default_factory=RateSearch)
    study_name: str | None = None  # None: space-backend-slo
    storage: str | None = None  # None: sqlite:///<studies_dir>/<name>.db
    studies_dir: Path = Path("studies")
    sampler: str = "tpe"
    n_trials: int | None = None  # None: 30 simulated, 20 otherwise
    timeout_s: float | None = None
    budget_s: float | None = None  # server time, the validation run included
    # What each trial's ceiling counts (--by): req/s, or the users of a closed loop,
    # whose search ranks configs by the users they sustain (objective "level").
    unit: LoadUnit = RATE
    objective: str = "tokens"
    per_gpu: bool = False
    prescreen: bool | None = None  # None: when a real study has a --profile
    prescreen_trials: int = 40
    top_k: int = 3
    prune: bool = True
    prove_top: int = 2
    validate_s: float | None = 300.0  # None: no validation run
    twin: TwinOptions | None = None
    wandb: str | None = None
    mlflow: str | None = None

    def __post_init__(self) -> None:
        self._check_choices()
        for flag, value, low in (("--n-trials", self.n_trials, 1), ("--top-k", self.top_k, 1),
                                 ("--prescreen-trials", self.prescreen_trials, 1),
                                 ("--prove-top", self.prove_top, 0)):
            at_least(flag, value, low)
        if (self.budget_s is not None and self.validate_s is not None
                and self.budget_s <= self.validate_s):
            # The answer's validation run is part of what the budget covers.
            raise OptionsError(
                f"--budget {self.budget_s:g} s leaves no server time for the search after "
                f"the {self.validate_s:g} s validation run: raise --budget above it, or pass "
                "--validate off")
        validate_name(self.name)
        check_tiers(self.tiers)

    def _check_choices(self) -> None:
        if self.sampler not in SAMPLERS:
            raise OptionsError(f"unknown sampler {self.sampler!r}; use one of "
                               f"{', '.join(SAMPLERS)}")
        if self.objective not in OBJECTIVES:
            raise OptionsError(f"unknown objective {self.objective!r}; use tokens or "
                               "requests")
        self._check_unit()
        check_backend(self.backend, self.server.url)
        if self.backend == "vllm" and not (self.server.model or self.space.fixed.get("model")):
            raise OptionsError("--backend vllm needs --model (or 'model' under fixed: in the "
                               "space)")
        if self.prescreen and self.backend != "vllm":
            raise OptionsError("--prescreen sim seeds a real study: use it with --backend vllm")
        if self.twin is not None and self.backend == "attach":
            raise OptionsError("--twin learns from the configs autotune starts, and an "
                               "attached server runs one config: use --twin with --backend "
                               "vllm")

    def _check_unit(self) -> None:
        """A search by users ranks by users, and the twin, which predicts in req/s,
        does not take it yet (the pre-screen searches the same unit in virtual time)."""
        unit = self.unit
        if unit.by == "speed":
            raise OptionsError("search --by speed: a trace's speed is one config's question: "
                               "use `autotune ceiling --dataset FILE --by speed`")
        if unit.closed is None:
            if self.objective == "level":
                raise OptionsError("the objective 'level' ranks a search --by concurrency "
                                   "or users: add --by, or use tokens or requests")
            return
        if self.objective != "level":
            raise OptionsError(f"a search --by {unit.by} ranks configs by the {unit.label} "
                               "they sustain: drop --objective")
        if self.twin is not None:
            raise OptionsError(f"--twin predicts in req/s, not yet in {unit.label}: drop "
                               "it, or search --by rate")

    @property
    def name(self) -> str:
        """The study's name: given, or the space, backend and SLO."""
        slug = re.sub(r"[^a-z0-9]+", "", str(self.slo).lower().replace(".", "p"))
        return self.study_name or f"{self.space.name}-{self.backend}-{slug}"

    @property
    def sim(self) -> SimProfile:
        """The simulator's node: --profile and --gpus, else the space's own profile."""
        return self.profile or SimProfile.of_space(self.space.profile)

    @property
    def storage_url(self) -> str:
        return storage_url(self.name, self.storage, self.studies_dir)

    @property
    def prescreened(self) -> bool:
        """Whether the simulator screens the space first: asked for, or by default when
        a real study is given a profile to simulate."""
        if self.prescreen is not None:
            return self.prescreen
        return self.backend == "vllm" and self.profile_given
