"""The twin: the simulator with a profile fitted to what a study has measured so far.

A study's load tests are the evidence.  Each observed test (:class:`ObservedTest`) keeps
what was offered (the config, the requests with their arrival offsets, the warm-up) and
what was measured over the requests that completed (:class:`Figures`: output
throughput, TTFT and TPOT as means over the fastest 90% of requests, median E2E).
:func:`fit_twin` re-simulates every observed test with a candidate profile and fits four
free factors, each multiplying the prior profile's figures:

- ``compute``: ``compute_efficiency`` (achieved FLOP/s);
- ``bandwidth``: ``bandwidth_efficiency`` (achieved memory bandwidth);
- ``overheads``: ``step_overhead_ms`` and ``per_seq_overhead_us`` together (host time);
- ``front_end``: ``frontend_request_ms`` and ``frontend_token_us`` together (the API
  server's CPU per request and per output token).

The fit is least squares on log-ratios of simulated to measured figures (a 10% miss on
TPOT weighs what a 10% miss on throughput does), plus a weak pull of each log-factor
towards 0 (the prior), so a factor the tests cannot see stays where the prior put it
instead of wandering.  Its uncertainty is the Gauss-Newton covariance at the optimum
(the Jacobian of the whitened residuals, prior rows included): a factor the tests do not
identify keeps a standard error near the prior's.  A factor whose fields are 0 in the
prior (the GPU profiles' unmeasured front end) cannot be scaled and is not fitted.

Each observed test is re-simulated on a bounded slice (its first ``cap`` completed
requests, scored, and the arrivals that overlapped them), so one fit costs seconds of
CPU whatever the length of the tests.  The slice keeps the very requests and arrival
times the server saw, so with the true factors the re-simulation of a simulated test
reproduces its figures.

:func:`predict_ceiling` runs a trial's ceiling search (``find_ceiling`` on a
``BackendProbe``) on the twin in virtual time.  Pure apart from calling the simulator.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy.optimize import least_squares

from autotune.backends.factory import BackendSpec, create_backend
from autotune.core.errors import AutotuneError
from autotune.core.files import atomic_write
from autotune.core.records import RequestRecord
from autotune.sim.calibrate import hardware_yaml
from autotune.sim.config import EngineConfig
from autotune.sim.engine import simulate
from autotune.sim.profiles import HardwareProfile, ModelProfile
from autotune.tuning.ceiling import BackendProbe, find_ceiling, search_steady
from autotune.workload.sources import Request

if TYPE_CHECKING:
    from autotune.backends.base import LoadPlan
    from autotune.tuning.ceiling import BackendProbe, CeilingResult
    from autotune.tuning.record import StoredTrial

# Factor name -> the profile fields it multiplies (together).
FACTORS: dict[str, tuple[str, ...]] = {
    "compute": ("compute_efficiency",),
    "bandwidth": ("bandwidth_efficiency",),
    "overheads": ("step_overhead_ms", "per_seq_overhead_us"),
    "front_end": ("frontend_request_ms", "frontend_token_us"),
}
# TTFT and TPOT enter the fit as the mean over the fastest 90% of requests.  A host
# hiccup (a GC pause, a throttled container) that stalled a real-time server 120 ms in
# every 1.4 s raised a short test's plain mean TTFT by 50-100% and dragged the fitted
# front end to x3-4 (the saturated test's TTFT then missed by up to 24%); it leaves the
# trimmed mean where the server put it.  The replay is trimmed alike (its own fastest
# 90%).  The median alone, flat between the simulator's discrete steps, identified
# compute worse (x0.80 for a hidden x0.7).
TRIM_KEEP = 0.9
FIGURES = ("output_throughput", "trimmed_ttft_s", "trimmed_tpot_s", "p50_e2e_s")
# Factors live in [1/10, 10] of the prior: wider than any datasheet-times-efficiency
# guess is off, narrow enough that the simulator never prices a step at ~0 or ~inf.
LOG_BOUND = math.log(10.0)


class TwinError(AutotuneError, ValueError):
    """The twin cannot be fitted or used as asked; the message says what and why."""


# ----------------------------------------------------------------------------- figures


@dataclass(frozen=True, kw_only=True)
class Figures:
    """What one load test measured over its scored (completed) requests.

    Output tokens per second from the first send to the last end and median E2E, as
    ``metrics.summarize`` defines them; each request's TTFT and TPOT (vLLM's, TPOT
    over requests with 2+ output tokens; nan when none has) averaged over the fastest
    90% of requests (``TRIM_KEEP``), where ``summarize`` averages them all.
    """

    output_throughput: float
    trimmed_ttft_s: float
    trimmed_tpot_s: float
    p50_e2e_s: float
    completed: int

    def __post_init__(self) -> None:
        if self.completed < 1:
            raise TwinError("figures need at least one completed request")
        for name in ("output_throughput", "trimmed_ttft_s", "p50_e2e_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise TwinError(f"figure {name} must be a finite number > 0, got {v!r}")
        if not (math.isnan(self.trimmed_tpot_s) or self.trimmed_tpot_s > 0):
            raise TwinError("figure trimmed_tpot_s must be > 0 or nan, got "
                            f"{self.trimmed_tpot_s!r}")

    def value(self, name: str) -> float:
        return float(getattr(self, name))

    def to_dict(self) -> dict[str, float | int | None]:
        return {n: (None if math.isnan(self.value(n)) else self.value(n)) for n in FIGURES
                } | {"completed": self.completed}


def trimmed_mean(values: Sequence[float], keep: float = TRIM_KEEP) -> float:
    """The mean of the smallest ``keep`` share of ``values`` (at least one)."""
    ordered = np.sort(np.asarray(values, dtype=float))
    return float(np.mean(ordered[: max(math.ceil(len(ordered) * keep), 1)]))


def figures_of(records: Sequence[RequestRecord]) -> Figures:
    """The figures of ``records`` (every one completed without error)."""
    if not records:
        raise TwinError("no completed request to take figures from")
    sent = min(float(r.sent_s) for r in records if r.sent_s is not None)
    end = max(float(r.end_s) for r in records if r.end_s is not None)
    tokens = sum(r.output_tokens for r in records)
    ttft = [v for r in records if (v := r.ttft_s) is not None]
    tpot = [v for r in records if (v := r.tpot_s) is not None]
    e2e = [v for r in records if (v := r.e2e_s) is not None]
    if end <= sent or not ttft or not e2e or tokens < 1:
        raise TwinError("the completed requests carry no usable timing (no tokens, or no "
                        "first-token or end time)")
    return Figures(output_throughput=tokens / (end - sent),
                   trimmed_ttft_s=trimmed_mean(ttft),
                   trimmed_tpot_s=trimmed_mean(tpot) if tpot else math.nan,
                   p50_e2e_s=float(np.median(e2e)), completed=len(records))


# ----------------------------------------------------------------------------- observations


@dataclass(frozen=True, kw_only=True)
class ObservedTest:
    """One load test as the twin sees it: what was offered and what was measured.

    ``prompt_tokens``, ``output_tokens`` and ``arrivals_s`` describe every request the
    re-simulation sends, in arrival order, the first ``warmup`` of them warm-up;
    ``scored`` are the positions whose figures were ``measured`` (completed, measured
    requests).  ``prefixes``: each request's declared shared prefixes
    (``Request.prefix``), or () when none has any: a test of a server with prefix
    caching is re-simulated with the cache hits it had, or the fit would read the
    cache's speed as faster hardware.  ``trial``: the study trial the test belongs to
    (for the fit error per trial), if any.
    """

    flags: Mapping[str, Any]
    rate: float
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    arrivals_s: tuple[float, ...]
    warmup: int
    scored: tuple[int, ...]
    measured: Figures
    max_concurrency: int | None = None
    trial: int | None = None
    label: str = ""
    prefixes: tuple[tuple[tuple[str, int], ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "flags", dict(self.flags))  # a copy the caller cannot change
        n = len(self.arrivals_s)
        if not (len(self.prompt_tokens) == len(self.output_tokens) == n):
            raise TwinError(f"{self.name}: prompt tokens, output tokens and arrivals must "
                            "have one entry per request")
        if self.prefixes and len(self.prefixes) != n:
            raise TwinError(f"{self.name}: prefixes must have one entry per request, or "
                            "none")
        if not self.rate > 0:
            raise TwinError(f"{self.name}: the offered rate must be > 0, got {self.rate!r}")
        if not 0 <= self.warmup < n:
            raise TwinError(f"{self.name}: warm-up must leave measured requests "
                            f"(warmup {self.warmup}, {n} requests)")
        if any(not (math.isfinite(a) and a >= 0) for a in self.arrivals_s):
            raise TwinError(f"{self.name}: arrival offsets must be finite and >= 0")
        if not self.scored or any(not self.warmup <= i < n for i in self.scored):
            raise TwinError(f"{self.name}: scored positions must be measured requests")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise TwinError(f"{self.name}: max_concurrency must be >= 1")

    @property
    def name(self) -> str:
        return self.label or f"test at {self.rate:g} req/s"

    @property
    def requests(self) -> list[Request]:
        prefixes = self.prefixes or ((),) * len(self.prompt_tokens)
        return [Request("", p, o, prefix=pf) for p, o, pf in zip(
            self.prompt_tokens, self.output_tokens, prefixes, strict=True)]

    @classmethod
    def from_records(cls, *, flags: Mapping[str, Any], rate: float,
                     requests: Sequence[Request], records: Sequence[RequestRecord],
                     warmup: int, cap: int = 300, max_concurrency: int | None = None,
                     trial: int | None = None, label: str = "") -> ObservedTest:
        """From one load test's records: ``requests`` are the requests in the order the
        test sent them (warm-up first), as a record's ``index + warmup`` counts.

        The measured requests that completed are scored in arrival order, at most
        ``cap`` of them; the slice kept for re-simulation holds every request that
        arrived before the last scored one ended (all that could have competed with
        them, so the slice replays them exactly).  Scoring stops early where that slice
        would pass ``2 x cap`` measured requests, unless even the first scored request
        needs more (a test that sent everything at once).  Raises :class:`TwinError`
        when no measured request completed.
        """
        what = label or f"test at {rate:g} req/s"
        if cap < 1:
            raise TwinError(f"{what}: cap must be >= 1 scored requests, got {cap}")
        by_pos = {r.index + warmup: r for r in records}
        if any(not 0 <= p < len(requests) for p in by_pos):
            raise TwinError(f"{what}: a record's index lies outside the {len(requests)} "
                            "requests given")
        measured = sorted(p for p, r in by_pos.items() if not r.warmup)
        ok = [p for p in measured if by_pos[p].ok][:cap]
        if not ok:
            raise TwinError(f"{what}: no measured request completed, so the test measured "
                            "nothing the twin can fit (was the server down?)")
        if any(p not in by_pos for p in range(max(by_pos) + 1)):
            raise TwinError(f"{what}: records are missing for some requests (the test's "
                            "records are incomplete)")
        # When the client let each request go (its schedule plus the client's own lag):
        # what the server saw, and what a max-concurrency gate then held back.
        arrived = np.array([_released(by_pos[p]) for p in range(max(by_pos) + 1)])
        # Arrivals ascend with position (one schedule): the slice that covers a scored
        # set ends at the last arrival before its last end.
        arrived_by = np.maximum.accumulate(arrived)
        ends = np.maximum.accumulate([float(by_pos[p].end_s or 0.0) for p in ok])
        stops = np.searchsorted(arrived_by, ends, side="right") - 1
        stops = np.maximum(stops, ok)
        budget = max(int(stops[0]), warmup + 2 * cap - 1)
        n_scored = int(np.searchsorted(stops, budget, side="right"))
        ok = ok[:max(n_scored, 1)]
        keep = range(int(stops[len(ok) - 1]) + 1)
        t0 = float(arrived[: len(keep)].min())
        figures = figures_of([by_pos[p] for p in ok])
        return cls(flags=flags, rate=rate,
                   prompt_tokens=tuple(int(requests[p].prompt_tokens) for p in keep),
                   output_tokens=tuple(int(requests[p].output_tokens) for p in keep),
                   arrivals_s=tuple(float(arrived[p] - t0) for p in keep),
                   warmup=warmup, scored=tuple(ok), measured=figures,
                   max_concurrency=max_concurrency, trial=trial, label=label,
                   prefixes=(tuple(tuple(requests[p].prefix) for p in keep)
                             if any(requests[p].prefix for p in keep) else ()))


def _released(r: RequestRecord) -> float:
    return float(r.dispatched_s if r.dispatched_s is not None else r.scheduled_s)


def sent_requests(plan: LoadPlan, rate: float) -> list[Request]:
    """The requests a load test of ``plan`` at ``rate`` sends, in order: ``warmup``
    drawn in turn from the warm-up pool (or the measured one), then the measured ones
    (the convention of the load generator and the simulator backend)."""
    return plan.warm_requests(rate) + plan.measured_for(rate)


def observations_from_search(probe: BackendProbe, ceiling: CeilingResult, *,
                             cap: int = 300, limit: int | None = 3,
                             trial: int | None = None) -> list[ObservedTest]:
    """The load tests of one ceiling search (``probe.results`` beside
    ``ceiling.probes``), most informative first, at most ``limit`` of them.

    Most informative: the saturation test (every request at once shows the service
    rate), the passing test at the ceiling, the failing test above it, then the others
    from the highest rate down.  Tests where nothing completed are left out.
    """
    chosen: list[int] = []
    sat = [p.index for p in ceiling.probes if math.isinf(p.rate)]
    at = ceiling.feasible_probe()
    above = [p for p in ceiling.probes if ceiling.infeasible_min is not None
             and p.rate == ceiling.infeasible_min]
    # The light-load floor test has a plan of its own: the twin does not replay it.
    rest = sorted((p for p in ceiling.probes if p.phase != "floor"),
                  key=lambda p: (-p.rate, p.index))
    for i in [*sat[:1], *([at.index] if at else []), *[p.index for p in above[:1]],
              *[p.index for p in rest]]:
        if i not in chosen:
            chosen.append(i)
    out: list[ObservedTest] = []
    for i in chosen:
        if limit is not None and len(out) >= limit:
            break
        p = ceiling.probes[i]
        try:
            out.append(observation_of(probe, probe.results[i], rate=p.rate,
                                      num_prompts=p.num_prompts, repeat=p.repeat, cap=cap,
                                      trial=trial, label=p.phase))
        except TwinError:
            continue  # nothing completed: the test says nothing the twin could fit
    return out


def observation_of(probe: BackendProbe, result: Any, *, rate: float, num_prompts: int,
                   repeat: int = 0, cap: int = 300, trial: int | None = None,
                   label: str = "test") -> ObservedTest:
    """One load test that ``probe`` ran (``probe(rate, num_prompts, repeat=repeat)``
    returned after appending ``result``, a ``TrialResult``), as the twin sees it: the
    requests it sent rebuilt from the probe's plan, and its records."""
    at = next((a for r, a in zip(probe.results, probe.pool_ats, strict=False) if r is result),
              None)
    plan = probe.plan(num_prompts, repeat, rate, at=at)
    where = f"trial {trial}, " if trial is not None else ""
    return ObservedTest.from_records(
        flags=result.flags, rate=rate, requests=sent_requests(plan, rate),
        records=result.records, warmup=plan.warmup_at(rate), cap=cap,
        max_concurrency=plan.max_concurrency, trial=trial,
        label=f"{where}{label} at {rate:.4g} req/s")


def read_records(path: str | Path) -> list[RequestRecord]:
    """Records written by ``trial.write_records`` (chunk times dropped, counts kept)."""
    names = {f.name for f in fields(RequestRecord)} - {"chunk_times_s"}
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            data = json.loads(line)
            out.append(RequestRecord(**{k: v for k, v in data.items() if k in names}))
    return out


def observations_from_stored(trial: StoredTrial, plan: LoadPlan, *, cap: int = 300
                             ) -> list[ObservedTest]:
    """What a stored study trial measured that the twin can fit: the load test at its
    ceiling, whose records the study wrote (``records_path``).  Its other probes are
    stored as figures without their requests, so they are not used.  ``plan``: the
    study's load plan (its requests rebuild what that test sent).  Empty when the
    trial left no records."""
    path = trial.result.get("records_path")
    rate = trial.rate
    if not path or not Path(str(path)).is_file() or rate is None or not rate > 0:
        return []
    probes = [p for p in trial.probes() if p.get("rate") == rate]
    n = int(max((p.get("num_prompts") or 0 for p in probes), default=0)) or len(plan.requests)
    at = next((p.get("pool_at") for p in reversed(probes) if p.get("pool_at")), None)
    probe_plan = BackendProbe.for_plan(None, trial.flags, plan,
                                       steady=plan.steady).plan(n, 0, rate, at=at)
    return [ObservedTest.from_records(
        flags=trial.flags, rate=rate, requests=sent_requests(probe_plan, rate),
        records=read_records(str(path)), warmup=probe_plan.warmup_at(rate), cap=cap,
        max_concurrency=plan.max_concurrency, trial=trial.number,
        label=f"trial {trial.number} at {rate:.4g} req/s")]


# ----------------------------------------------------------------------------- re-simulation


def apply_factors(profile: HardwareProfile, factors: Mapping[str, float]) -> HardwareProfile:
    """``profile`` with each named factor multiplied into its fields."""
    changed: dict[str, Any] = {}
    for name, factor in factors.items():
        if name not in FACTORS:
            raise TwinError(f"unknown twin factor {name!r}; known: {', '.join(FACTORS)}")
        if not (math.isfinite(factor) and factor > 0):
            raise TwinError(f"twin factor {name} must be a finite number > 0, got {factor!r}")
        for f in FACTORS[name]:
            changed[f] = float(getattr(profile, f)) * float(factor)
    return replace(profile, **changed)


def engine_config(flags: Mapping[str, Any], model: ModelProfile) -> EngineConfig:
    """The simulator's config for server ``flags`` (flags it does not model are left
    out, as the simulator backend does)."""
    known = {f.name for f in fields(EngineConfig)}
    modelled = {}
    for raw, value in flags.items():
        name = str(raw).lstrip("-").replace("-", "_")
        if name in known or name == "no_enable_chunked_prefill":
            modelled[raw] = value
    if not any(str(k).lstrip("-").replace("-", "_") == "model" for k in modelled):
        modelled["model"] = model.hf_id
    return EngineConfig.from_flags(modelled)


@dataclass(frozen=True)
class Replay:
    """One observed test re-simulated on a profile."""

    figures: Figures
    frontend_busy: float  # the front end's busy share over the test (0 when not modelled)


def resimulate(test: ObservedTest, profile: HardwareProfile, model: ModelProfile) -> Replay:
    """Replay ``test``'s slice on ``profile``: its figures over the same scored requests."""
    res = simulate(engine_config(test.flags, model), profile, model, test.requests,
                   np.asarray(test.arrivals_s), warmup=test.warmup,
                   max_concurrency=test.max_concurrency)
    by_pos = {r.index + test.warmup: r for r in res.records}
    scored = [by_pos[p] for p in test.scored if p in by_pos and by_pos[p].ok]
    if len(scored) < len(test.scored):
        raise TwinError(f"{test.name}: the simulator refused requests the server served "
                        "(do the model's max_model_len and the flags match the server's?)")
    return Replay(figures_of(scored), float(res.frontend_busy_fraction))


# ----------------------------------------------------------------------------- the fit


@dataclass(frozen=True, kw_only=True)
class FactorEstimate:
    """One fitted factor: its value (times the prior's fields), and its uncertainty as
    the standard error of its natural log (0.1: about +-10%)."""

    name: str
    fields: tuple[str, ...]
    value: float
    log_se: float
    fitted: bool  # False: held at 1 (its fields are 0 in the prior, or not asked for)
    identified: bool  # the tests pinned it (s.e. well under the prior's)
    note: str = ""

    @property
    def low(self) -> float:
        """95% interval, low end (a normal approximation on the log)."""
        return self.value * math.exp(-1.96 * self.log_se)

    @property
    def high(self) -> float:
        return self.value * math.exp(1.96 * self.log_se)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "fields": list(self.fields), "value": self.value,
                "log_se": self.log_se, "low_95": self.low, "high_95": self.high,
                "fitted": self.fitted, "identified": self.identified, "note": self.note}


@dataclass(frozen=True, kw_only=True)
class TestFit:
    """One observed test: measured figures, and the prior's and the twin's predictions."""

    label: str
    trial: int | None
    rate: float
    measured: Figures
    prior: Figures
    fitted: Figures

    def errors(self, which: str = "fitted") -> dict[str, float]:
        """Predicted / measured - 1 per figure (figures the test did not measure left out)."""
        pred = self.fitted if which == "fitted" else self.prior
        return {n: pred.value(n) / self.measured.value(n) - 1.0 for n in FIGURES
                if math.isfinite(self.measured.value(n)) and math.isfinite(pred.value(n))}

    def rms_log_error(self, which: str = "fitted") -> float:
        errs = [math.log1p(e) for e in self.errors(which).values()]
        return float(np.sqrt(np.mean(np.square(errs)))) if errs else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "trial": self.trial,
                "rate": None if math.isinf(self.rate) else self.rate,
                "measured": self.measured.to_dict(), "prior": self.prior.to_dict(),
                "fitted": self.fitted.to_dict(), "errors": self.errors(),
                "prior_errors": self.errors("prior"),
                "rms_log_error": self.rms_log_error(),
                "prior_rms_log_error": self.rms_log_error("prior")}


@dataclass(frozen=True, kw_only=True)
class TwinFit:
    """The fitted profile, its factors with their uncertainty, and the error per test."""

    profile: HardwareProfile
    prior: HardwareProfile
    factors: tuple[FactorEstimate, ...]
    tests: tuple[TestFit, ...]
    noise: float  # the log-figure noise the standard errors assume (fitted or floor)
    evaluations: int  # re-simulations of the whole set of tests
    cpu_s: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    def factor(self, name: str) -> FactorEstimate:
        return next(f for f in self.factors if f.name == name)

    @property
    def rms_log_error(self) -> float:
        """Root mean square of log(predicted / measured) over every figure of every test."""
        errs = [math.log1p(e) for t in self.tests for e in t.errors().values()]
        return float(np.sqrt(np.mean(np.square(errs)))) if errs else math.nan

    def error_by_trial(self) -> dict[int | None, float]:
        """The fit error per trial: RMS log error over that trial's tests' figures."""
        out: dict[int | None, list[float]] = {}
        for t in self.tests:
            out.setdefault(t.trial, []).extend(math.log1p(e) for e in t.errors().values())
        return {k: float(np.sqrt(np.mean(np.square(v)))) for k, v in out.items() if v}

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.name, "prior": self.prior.name,
                "factors": [f.to_dict() for f in self.factors],
                "rms_log_error": self.rms_log_error,
                "error_by_trial": {str(k): v for k, v in self.error_by_trial().items()},
                "noise": self.noise, "evaluations": self.evaluations, "cpu_s": self.cpu_s,
                "tests": [t.to_dict() for t in self.tests], "notes": list(self.notes)}


class _Objective:
    """Residuals of the fit: re-simulates every test per candidate, with a cache (the
    solver asks for the same point more than once)."""

    def __init__(self, tests: Sequence[ObservedTest], prior: HardwareProfile,
                 model: ModelProfile, names: Sequence[str]) -> None:
        self.tests, self.prior, self.model, self.names = tests, prior, model, tuple(names)
        self.cache: dict[tuple[float, ...], list[Replay]] = {}
        self.evaluations = 0
        # Which figures of each test enter the fit (TPOT only where it was measured).
        self.used = [[n for n in FIGURES if math.isfinite(t.measured.value(n))]
                     for t in tests]
        self.target = np.array([math.log(t.measured.value(n))
                                for t, used in zip(tests, self.used, strict=True)
                                for n in used])

    def profile(self, x: np.ndarray) -> HardwareProfile:
        return apply_factors(self.prior, {n: math.exp(v) for n, v in
                                          zip(self.names, x, strict=True)})

    def replays(self, x: np.ndarray) -> list[Replay]:
        key = tuple(round(float(v), 12) for v in x)
        if key not in self.cache:
            profile = self.profile(x)
            self.cache[key] = [resimulate(t, profile, self.model) for t in self.tests]
            self.evaluations += 1
        return self.cache[key]

    def log_errors(self, x: np.ndarray) -> np.ndarray:
        """log(simulated / measured) per used figure."""
        sim = [r.figures.value(n) for r, used in zip(self.replays(x), self.used, strict=True)
               for n in used]
        # A figure the replay lacks (no request with 2+ tokens) counts as a miss of
        # e^5, not as a crash of the solver.
        logs = [math.log(v) if math.isfinite(v) and v > 0 else math.nan for v in sim]
        out = np.asarray(logs) - self.target
        return np.where(np.isnan(out), 5.0, out)


def _jacobian(obj: _Objective, x: np.ndarray, step: float, noise: float, prior_sd: float
              ) -> np.ndarray:
    """Forward differences of the whitened residuals with an absolute log step.

    Not scipy's own: its relative step is ~1e-8 at the prior (x = 0), where the
    simulator's discrete scheduling decisions (which request joins which step) make
    slopes of thousands out of nothing.
    """
    base = obj.log_errors(x)
    cols = []
    for j in range(len(x)):
        h = step if x[j] + step <= LOG_BOUND else -step
        moved = x.copy()
        moved[j] += h
        cols.append((obj.log_errors(moved) - base) / h)
    data = np.column_stack(cols) / noise if cols else np.zeros((len(base), 0))
    return np.vstack([data, np.eye(len(x)) / prior_sd])


def _free_factors(prior: HardwareProfile, free: Sequence[str] | None
                  ) -> tuple[list[str], list[str]]:
    """(factors to fit, notes on those held at 1)."""
    names = list(FACTORS) if free is None else list(free)
    unknown = [n for n in names if n not in FACTORS]
    if unknown:
        raise TwinError(f"unknown twin factor(s) {', '.join(unknown)}; known: "
                        f"{', '.join(FACTORS)}")
    fit, notes = [], []
    for n in names:
        if all(float(getattr(prior, f)) == 0.0 for f in FACTORS[n]):
            notes.append(f"{n}: the prior profile gives {' and '.join(FACTORS[n])} 0 (not "
                         "modelled), which no factor can scale: held at 1")
        else:
            fit.append(n)
    return fit, notes


def fit_twin(tests: Sequence[ObservedTest], prior: HardwareProfile, model: ModelProfile, *,
             free: Sequence[str] | None = None, noise: float = 0.05, prior_sd: float = 1.0,
             diff_step: float = 0.05, max_iterations: int = 20,
             name: str | None = None) -> TwinFit:
    """Fit the free factors (default: all four) to ``tests``; see the module doc.

    ``noise``: the log-figure noise of a measurement (5%: figures of a few hundred
    requests, and a simulator that is a model), the floor of the scale the standard
    errors use (the residuals' own scale when larger).  ``prior_sd``: the prior's
    standard deviation on each log-factor (1.0: a factor of e either way is plausible;
    weak, it only holds factors the tests cannot see).  ``diff_step``: the log step of
    the finite-difference Jacobian (5%: wide enough that the simulator's discrete
    scheduling decisions do not dominate a slope, narrow enough to stay local).
    ``max_iterations``: solver iterations (each re-simulates the tests once plus once
    per factor).  Raises :class:`TwinError` on no tests.
    """
    tests = tuple(tests)
    _check_fit_args(tests, noise, prior_sd, diff_step, max_iterations)
    cpu0 = time.process_time()
    names, notes = _free_factors(prior, free)
    obj = _Objective(tests, prior, model, names)
    prior_replays = obj.replays(np.zeros(len(names)))
    x, jac = _solve(obj, notes, noise, prior_sd, diff_step, max_iterations)
    scale, cov = _covariance(obj, x, jac, noise, prior_sd)
    replays = obj.replays(x)
    busy = max((r.frontend_busy for r in replays), default=0.0)
    factors = _estimates(names, notes, x, cov, prior_sd, busy)
    fitted = replace(obj.profile(x), name=name or f"{prior.name}-twin",
                     description=f"{prior.description}; twin fitted to {len(tests)} load "
                                 "tests (simulated)")
    per_test = tuple(
        TestFit(label=t.name, trial=t.trial, rate=t.rate, measured=t.measured,
                prior=p.figures, fitted=r.figures)
        for t, p, r in zip(tests, prior_replays, replays, strict=True))
    return TwinFit(profile=fitted, prior=prior, factors=tuple(factors), tests=per_test,
                   noise=scale, evaluations=obj.evaluations,
                   cpu_s=time.process_time() - cpu0, notes=tuple(notes))


def _check_fit_args(tests: Sequence[ObservedTest], noise: float, prior_sd: float,
                    diff_step: float, max_iterations: int) -> None:
    """Refuse a fit that has nothing to fit or settings the solver cannot use."""
    if not tests:
        raise TwinError("no observed load tests to fit the twin to: run at least one "
                        "trial first")
    for what, v in (("noise", noise), ("prior_sd", prior_sd), ("diff_step", diff_step)):
        if not (math.isfinite(v) and v > 0):
            raise TwinError(f"{what} must be a finite number > 0, got {v!r}")
    if max_iterations < 1:
        raise TwinError(f"max_iterations must be >= 1, got {max_iterations}")


def _solve(obj: _Objective, notes: list[str], noise: float, prior_sd: float,
           diff_step: float, max_iterations: int) -> tuple[np.ndarray, np.ndarray]:
    """The log-factors least squares settles on (the prior's with none free), and the
    Jacobian of the log-errors there; a solver that ran out of iterations is noted."""
    x0 = np.zeros(len(obj.names))
    if not obj.names:
        return x0, np.zeros((len(obj.target), 0))
    res = least_squares(lambda x: np.concatenate([obj.log_errors(x) / noise,
                                                  x / prior_sd]),
                        x0, jac=lambda x: _jacobian(obj, x, diff_step, noise, prior_sd),
                        bounds=(-LOG_BOUND, LOG_BOUND), xtol=1e-4, ftol=1e-6,
                        max_nfev=max_iterations, method="trf")
    jac = np.asarray(res.jac)[: len(obj.target)] * noise  # d log-error / d log-factor
    if res.status == 0:
        notes.append(f"the solver stopped after {max_iterations} iterations before "
                     "its tolerance: the factors may move with more")
    return res.x, jac


def _covariance(obj: _Objective, x: np.ndarray, jac: np.ndarray, noise: float,
                prior_sd: float) -> tuple[float, np.ndarray]:
    """The noise scale the standard errors assume (the residuals', floored at
    ``noise``) and the log-factors' covariance at ``x``."""
    n = len(obj.names)
    resid = obj.log_errors(x)
    dof = max(len(resid) - n, 1)
    scale = max(noise, float(np.sqrt(resid @ resid / dof)))
    # Gauss-Newton covariance of the log-factors with the prior's rows: a factor the
    # tests do not move keeps about the prior's standard deviation.
    info = jac.T @ jac / scale**2 + np.eye(n) / prior_sd**2
    cov = np.linalg.inv(info) if n else np.zeros((0, 0))
    return scale, cov


def _estimates(names: Sequence[str], notes: list[str], x: np.ndarray, cov: np.ndarray,
               prior_sd: float, busy: float) -> list[FactorEstimate]:
    """Every factor's estimate, in ``FACTORS`` order: held at 1 with the note that says
    why, or fitted, and noted when the tests do not identify it."""
    factors = []
    for n in FACTORS:
        if n not in names:
            why = next((s for s in notes if s.startswith(f"{n}:")), f"{n}: not fitted")
            factors.append(FactorEstimate(name=n, fields=FACTORS[n], value=1.0,
                                          log_se=prior_sd, fitted=False, identified=False,
                                          note=why.split(": ", 1)[1]))
            continue
        i = names.index(n)
        se = float(math.sqrt(max(cov[i, i], 0.0)))
        identified = se < 0.5 * prior_sd
        note = ""
        if not identified:
            note = ("not identified by these tests: its figures barely move them, so it "
                    "stays near the prior")
            if n == "front_end":
                note += f" (the front end was at most {busy:.0%} busy in any test)"
            notes.append(f"{n}: {note}")
        factors.append(FactorEstimate(name=n, fields=FACTORS[n], value=math.exp(x[i]),
                                      log_se=se, fitted=True, identified=identified,
                                      note=note))
    return factors


# ----------------------------------------------------------------------------- output


def twin_yaml(fit: TwinFit, header: Sequence[str] = ()) -> str:
    """The twin's profile as a ``hardware.<name>.yaml`` file (``load_hardware`` reads
    it back); each fitted field's line says its factor and standard error."""
    comments: dict[str, str] = {}
    fitted: set[str] = set()
    for f in fit.factors:
        if not f.fitted:
            continue
        for name in f.fields:
            fitted.add(name)
            comments[name] = (f"x{f.value:.4g} (log s.e. {f.log_se:.2g}) of the prior "
                              f"{getattr(fit.prior, name):.6g}"
                              + ("" if f.identified else "; not identified"))
    lines = [*header,
             f"Twin of {fit.prior.name}: its factors fitted to {len(fit.tests)} load "
             f"tests, RMS log error {fit.rms_log_error:.3f} (prior: "
             f"{_prior_rms(fit):.3f}). SIMULATOR PROFILE."]
    lines += [f"- {f.name}: x{f.value:.4g} +- {f.log_se:.2g} (log s.e.)"
              + ("" if f.fitted else f" (held: {f.note})") for f in fit.factors]
    return hardware_yaml(fit.profile, lines, fitted=fitted, comments=comments)


def _prior_rms(fit: TwinFit) -> float:
    errs = [math.log1p(e) for t in fit.tests for e in t.errors("prior").values()]
    return float(np.sqrt(np.mean(np.square(errs)))) if errs else math.nan


def write_twin(fit: TwinFit, path: str | Path, header: Sequence[str] = ()) -> Path:
    """Write :func:`twin_yaml` to ``path`` (atomically)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, twin_yaml(fit, header))
    return target


# ----------------------------------------------------------------------------- prediction


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The twin's ceiling search of one config (every figure simulated)."""

    flags: Mapping[str, Any]
    ceiling_rate: float | None  # None: no rate passed
    goodput_tokens: float  # at the ceiling (0 when none)
    goodput_requests: float
    recommended_cap: float | None
    sentence: str
    cpu_s: float
    probes: int

    def to_dict(self) -> dict[str, Any]:
        return {"flags": dict(self.flags), "ceiling_rate": self.ceiling_rate,
                "goodput_tokens": self.goodput_tokens,
                "goodput_requests": self.goodput_requests,
                "recommended_cap": self.recommended_cap, "sentence": self.sentence,
                "cpu_s": self.cpu_s, "probes": self.probes}


def predict_ceiling(profile: HardwareProfile, model: ModelProfile, flags: Mapping[str, Any],
                    plan: LoadPlan, *, start_rate: float | None = None, tol: float = 0.03,
                    max_probes: int = 8, headroom: float = 0.10,
                    min_rate: float | None = None, max_rate: float | None = None
                    ) -> Prediction:
    """The steady-state ceiling and goodput of ``flags`` on the twin: the ceiling search
    a study's trial runs (``find_ceiling`` over a ``BackendProbe`` with the study's
    plan), on the simulator with ``profile``, in virtual time."""
    cpu0 = time.process_time()
    backend = create_backend(BackendSpec(kind="sim", hardware=profile, sim_model=model))
    probe = BackendProbe.for_plan(backend, flags, plan,
                                  steady=search_steady(plan.steady, max_probes))
    ceiling = find_ceiling(probe, slo=plan.slo, start_rate=start_rate, tol=tol,
                           max_probes=max_probes, num_prompts=max(len(plan.requests), 1),
                           max_num_prompts=max(len(plan.requests), 2400), headroom=headroom,
                           min_rate=min_rate, max_rate=max_rate)
    at = ceiling.feasible_probe()
    result = probe.results[at.index] if at is not None else None
    return Prediction(
        flags=dict(flags), ceiling_rate=ceiling.feasible_max,
        goodput_tokens=result.goodput("tokens") if result is not None else 0.0,
        goodput_requests=result.goodput("requests") if result is not None else 0.0,
        recommended_cap=ceiling.recommended_cap, sentence=ceiling.sentence(),
        cpu_s=time.process_time() - cpu0, probes=len(ceiling.probes))
