"""One trial: a config plus a rate cap, evaluated on a backend.

Two execution modes, one result type:

* **virtual time** (:class:`SimBackend`): the simulator's discrete-event engine runs
  the same workload and arrival schedule thousands of times faster than real time;
* **real time** (:class:`ServerBackend`): a server process (vLLM, the simulator's
  HTTP server, or an attached endpoint) and the HTTP load generator.

Both hand records to ``metrics.summarize``, feed the overload pruner once per
window, and return a :class:`TrialResult`.  A start that fails, a config the engine
refuses, or a server that dies during the load test is an infeasible result with its
reason, never an exception that ends the study.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.arrivals import arrival_offsets
from autotune.metrics import MEASURED, SIMULATED, Summary, summarize
from autotune.pruning import OverloadPruner, PruneDecision, Window, window_evidence
from autotune.records import RequestRecord
from autotune.slo import SLO, SLOCheck
from autotune.verdict import FAIL, INCONCLUSIVE, PASS, Evidence, SteadyState, horizon, judge
from autotune.workload import Request

if TYPE_CHECKING:
    from autotune.sim.profiles import HardwareProfile, ModelProfile

COMPLETE, PRUNED, INFEASIBLE = "complete", "pruned", "infeasible"


@dataclass
class LoadPlan:
    """What every load test of a study offers (same requests, same seed)."""

    slo: SLO
    requests: list[Request]  # the measured requests, in order
    warmup_requests: list[Request] = field(default_factory=list)
    warmup: int = 0
    seed: int = 0
    process: str = "poisson"
    burstiness: float = 1.0
    window_s: float = 1.0
    request_timeout_s: float = 600.0
    max_concurrency: int | None = None
    # Steady-state sizing and stop rule (autotune.verdict); None: a fixed-count test of
    # ``requests`` judged on its SLO check alone (kept for what-if sweeps and old tests).
    steady: SteadyState | None = None
    # When the server-time budget (``--budget``) ends, on the backend's ``server_s``
    # clock: a test sized by time that is running then stops there, with whatever
    # verdict its evidence supports.
    deadline_s: float | None = None

    def measured_for(self, rate: float) -> list[Request]:
        """The measured requests a test at ``rate`` plans: the pool itself, or, when the
        test is sized by time, as many as its cap's duration needs (cycling the pool)."""
        if self.steady is None or not self.requests:
            return list(self.requests)
        n = self.steady.arrivals_for(self.slo, rate)
        pool = self.requests
        return [pool[i % len(pool)] for i in range(n)]

    def planned_span_s(self, rate: float) -> float:
        """When the last measured request is scheduled (from the first)."""
        n = len(self.measured_for(rate))
        off = arrival_offsets(self.warmup + n, rate, process=self.process,  # type: ignore[arg-type]
                              burstiness=self.burstiness, seed=self.seed)
        return float(off[-1] - off[self.warmup]) if len(off) else 0.0

    def warmup_span_s(self, rate: float) -> float:
        """When the first measured request is scheduled (from the first warm-up one)."""
        if not self.warmup or not (rate > 0 and math.isfinite(rate)):
            return 0.0
        off = arrival_offsets(self.warmup + 1, rate, process=self.process,  # type: ignore[arg-type]
                              burstiness=self.burstiness, seed=self.seed)
        return float(off[self.warmup] - off[0])

    def mean_output_tokens(self) -> float:
        """Mean requested output tokens of the measured pool (goodput tok/s per req/s)."""
        if not self.requests:
            return 0.0
        return sum(r.output_tokens for r in self.requests) / len(self.requests)


@dataclass
class LoadRun:
    """The raw outcome of one load test on a backend."""

    records: list[RequestRecord]
    aborted: bool
    abort_reason: str | None
    load_test_s: float  # duration of the load test (virtual seconds in the simulator)
    telemetry: dict[str, Any] = field(default_factory=dict)
    crashed: str | None = None  # why the server died during the test, if it did


class TrialFailed(Exception):
    """The config could not be evaluated; ``reason`` says why in one word."""

    def __init__(self, reason: str, detail: str, *, log_path: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.log_path = log_path


WindowFn = Callable[[float, Sequence[RequestRecord]], bool]


class Backend(ABC):
    """Where trials run.  ``server_s`` accumulates server time (restarts included)."""

    name: str = "backend"
    mode: str = "real"  # "virtual" | "real"
    restartable: bool = True
    source: str = MEASURED

    def __init__(self) -> None:
        self.server_s = 0.0
        self.restarts = 0

    @abstractmethod
    def prepare(self, flags: Mapping[str, Any], *, trial: int | None = None
                ) -> dict[str, Any]:
        """Make a server with ``flags`` ready (reuse it when the flags are unchanged);
        return its startup info.  Raises :class:`TrialFailed`."""

    @abstractmethod
    def load_test(self, rate: float, plan: LoadPlan, on_window: WindowFn | None) -> LoadRun:
        """Offer ``plan`` at ``rate`` to the prepared server."""

    def gpus_used(self, flags: Mapping[str, Any]) -> int:
        return int(flags.get("tensor_parallel_size", 1)) * int(
            flags.get("pipeline_parallel_size", 1))

    def close(self) -> None:  # noqa: B027 - most backends have nothing to stop
        """Stop whatever runs; nothing may be left behind."""


# ----------------------------------------------------------------------------- results


@dataclass
class TrialResult:
    flags: dict[str, Any]
    rate: float
    status: str  # COMPLETE | PRUNED | INFEASIBLE
    mode: str
    backend: str
    reason: str | None = None  # rule name, pruning rule, startup reason, "crashed"
    detail: str | None = None
    summary: Summary | None = None
    prune: PruneDecision | None = None
    startup: dict[str, Any] | None = None
    telemetry: dict[str, Any] = field(default_factory=dict)
    log_path: str | None = None
    records_path: str | None = None
    load_test_s: float = 0.0
    planned_s: float = 0.0  # how long the full load test would have run (estimate)
    windows: list[Window] = field(default_factory=list)
    gpus: int = 1
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    # The steady-state verdict (plans sized by time); None for a fixed-count test.
    evidence: Evidence | None = None
    # The budget ran out during the test, which stopped there (``LoadPlan.deadline_s``).
    budget_cut: bool = False

    @property
    def check(self) -> SLOCheck | None:
        return None if self.summary is None else self.summary.slo_check

    @property
    def verdict(self) -> str:
        """pass / fail / inconclusive; a fixed-count test has only its SLO check."""
        if self.status != COMPLETE or self.summary is None:
            return FAIL
        if self.evidence is not None:
            return self.evidence.verdict
        return PASS if self.check is not None and self.check.met else FAIL

    @property
    def feasible(self) -> bool:
        return self.verdict == PASS

    def goodput(self, objective: str = "tokens", per_gpu: bool = False) -> float:
        """The objective value: goodput in output tok/s (or req/s); 0 when infeasible.
        Sized-by-time tests give the steady-state goodput (good requests per second of
        judged arrivals), which a drain cannot bias."""
        if self.summary is None or not self.feasible:
            return 0.0
        value = self.measured_goodput(objective)
        return value / max(self.gpus, 1) if per_gpu else value

    def measured_goodput(self, objective: str = "tokens") -> float:
        """The load test's goodput, met or not: the steady-state figure of a test sized
        by time, else the whole window's (a fixed-count test, as vLLM's benchmark)."""
        src: Any = self.evidence if self.evidence is not None else self.summary
        if src is None:
            return 0.0
        return float(src.goodput_tokens if objective == "tokens" else src.goodput_requests)

    def gpu_util(self) -> float | None:
        value = self.telemetry.get("gpu_util_mean_pct")
        return None if value is None else float(value)

    def to_attrs(self) -> dict[str, Any]:
        """JSON-able figures for the trial's user attrs."""
        s = self.summary
        return _finite({
            "status": self.status,
            "feasible": self.feasible,
            "mode": self.mode,
            "backend": self.backend,
            "reason": self.reason,
            "detail": self.detail,
            "flags": self.flags,
            "rate": self.rate,
            "gpus": self.gpus,
            "summary": None if s is None else s.to_dict(),
            "how": None if s is None else s.how(),
            "prune": None if self.prune is None else self.prune.to_dict(),
            "startup": self.startup,
            "telemetry": self.telemetry,
            "log_path": self.log_path,
            "records_path": self.records_path,
            "load_test_s": self.load_test_s,
            "planned_s": self.planned_s,
            "windows": [[w.t_s, w.in_flight, w.finished] for w in self.windows],
            "verdict": self.verdict,
            "evidence": None if self.evidence is None else self.evidence.to_dict(),
            "budget_cut": self.budget_cut,
        })


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- evaluate


class _Feed:
    """The per-window callback: evidence to the pruner, goodput to Optuna.

    ``report_every``: windows between ``trial.report`` writes.  Real load tests report
    every window; virtual ones (hundreds of windows a second) every tenth, and ask the
    pruner directly in between, so storage writes do not dominate a simulated study.
    """

    def __init__(self, plan: LoadPlan, pruner: OverloadPruner | None, trial: Any | None,
                 *, report_every: int = 1) -> None:
        self.plan = plan
        self.pruner = pruner
        self.trial = trial
        self.report_every = max(report_every, 1)
        self.planned = len(plan.requests)
        self.windows: list[Window] = []
        self.t0: float | None = None
        self.step = 0
        if pruner is not None and trial is not None:
            pruner.begin(trial.number, self.planned)

    def __call__(self, now: float, records: Sequence[RequestRecord]) -> bool:
        measured = [r for r in records if not r.warmup]
        if not measured:
            return False
        if self.t0 is None:
            self.t0 = min(r.scheduled_s for r in measured)
        w = window_evidence(now, measured, self.plan.slo, planned=self.planned, t0=self.t0)
        self.windows.append(w)
        if self.pruner is None or self.trial is None:
            return False
        self.pruner.observe(self.trial.number, w)
        self.step += 1
        if self.step % self.report_every and not self.pruner.prune(None, self.trial):  # type: ignore[arg-type]
            return False
        elapsed = max(now - self.t0, 1e-9)
        good = sum(r.output_tokens for r in measured if r.ok and not _late(r, self.plan.slo))
        self.trial.report(good / elapsed, self.step)
        return bool(self.trial.should_prune())


class _SteadyFeed:
    """The per-window stop rule of a load test sized by time: judge the evidence every
    ``check_every_s`` and stop once the verdict is certain (pass after the minimum
    duration, fail at any time) or the cap's duration is reached."""

    def __init__(self, plan: LoadPlan, rate: float, planned: int,
                 cut_s: float | None = None) -> None:
        assert plan.steady is not None
        self.plan = plan
        self.rule = plan.steady
        self.rate = rate
        self.planned = planned
        self.max_s = self.rule.max_s(plan.slo, rate)
        # The budget's end, in seconds from the first measured arrival; ``cut`` once
        # the test stopped there.
        self.cut_s = cut_s
        self.cut = False
        self.t0: float | None = None
        self.next_check = 0.0
        self.evidence: Evidence | None = None
        self.stopped_at: float | None = None
        self.windows: list[Window] = []
        self.on_evidence: Callable[[Evidence], None] | None = None

    def __call__(self, now: float, records: Sequence[RequestRecord]) -> bool:
        measured = [r for r in records if not r.warmup]
        if not measured:
            return False
        if self.t0 is None:
            self.t0 = min(r.scheduled_s for r in measured)
        elapsed = now - self.t0
        over = self.cut_s is not None and elapsed >= self.cut_s
        self.windows.append(window_evidence(now, measured, self.plan.slo,
                                            planned=self.planned, t0=self.t0))
        if elapsed < self.next_check and elapsed < self.max_s and not over:
            return False
        # Every few seconds early on, then every tenth of the time run so far: a long
        # test is judged a few dozen times, not once per window.
        self.next_check = elapsed + max(self.rule.check_every_s, 0.1 * elapsed)
        ev = judge(measured, slo=self.plan.slo, offered_rate=self.rate, now=now,
                   rule=self.rule, planned=self.planned)
        self.evidence = ev
        if self.on_evidence is not None:
            self.on_evidence(ev)
        certain = ev.verdict != INCONCLUSIVE and (
            ev.verdict != FAIL or self.rule.stop_when_failed
            or ev.at_s >= self.rule.min_s(self.plan.slo))
        cap = self.cap_s(ev)
        if certain or ev.at_s >= cap or over:
            self.cut = over and ev.verdict == INCONCLUSIVE and ev.at_s < cap
            self.stopped_at = now
            return True
        return False

    def cap_s(self, ev: Evidence) -> float:
        """The test's cap, given what it has seen.  A TPOT or ITL limit judges a request
        only twice the longest stay after its arrival (verdict.cohort_horizon), later
        than the cap planned for: the cap moves out by that difference so that the
        cohort judged at the end is the size the cap was planned for (a 70B model's
        long replies held a 74 s screening test's judged cohort to 167 requests: every
        config failed its screening).  Never past ``--max-duration`` or the hard cap."""
        if self.rule.max_duration_s is not None:
            return self.max_s
        extra = max(ev.horizon_s - horizon(self.plan.slo), 0.0)
        return max(self.max_s, min(self.max_s + extra, self.rule.hard_cap_s(self.plan.slo)))


def _judged(records: Sequence[RequestRecord], cutoff: float, slo: SLO
            ) -> list[RequestRecord]:
    """The cohort a stopped test is judged on.  What was still in flight in it is older
    than the end-to-end limit, so it is late, not an error of the server; without an
    end-to-end limit its latency is unknown, and it is left out of the summary (the
    verdict already counted it as late for a pass)."""
    has_e2e = any(lim.metric == "e2e" for lim in slo.limits)
    out = []
    for r in records:
        if r.warmup:
            out.append(r)  # summarize drops them, and says how many
            continue
        if r.scheduled_s > cutoff:
            continue
        if r.error is not None and r.error.startswith("aborted"):
            if not has_e2e:
                continue
            r.error = "late: still in flight, past every limit, when the test stopped"
        out.append(r)
    return out


def _late(r: RequestRecord, slo: SLO) -> bool:
    for lim in slo.limits:
        if lim.metric == "itl":
            continue
        value = getattr(r, f"{lim.metric}_s")
        if value is not None and value > lim.threshold_s:
            return True
    return False


def evaluate(
    backend: Backend,
    flags: Mapping[str, Any],
    rate: float,
    plan: LoadPlan,
    *,
    pruner: OverloadPruner | None = None,
    trial: Any | None = None,
    out_dir: Path | None = None,
    on_evidence: Callable[[Evidence], None] | None = None,
) -> TrialResult:
    """Start (or reuse) the server, load-test at ``rate``, summarize, classify.

    With ``plan.steady`` the test is sized by time and ends when its steady-state
    verdict is certain (``on_evidence`` sees each judgement, for progress lines); the
    summary then covers the judged cohort.  Without it, a fixed-count test with the
    overload pruner."""
    flags = dict(flags)
    number = None if trial is None else trial.number
    result = TrialResult(flags=flags, rate=rate, status=INFEASIBLE, mode=backend.mode,
                         backend=backend.name, gpus=backend.gpus_used(flags))
    with contextlib.suppress(Exception):
        result.planned_s = plan.planned_span_s(rate)
    try:
        result.startup = backend.prepare(flags, trial=number)
    except TrialFailed as exc:
        result.reason, result.detail, result.log_path = exc.reason, exc.detail, exc.log_path
        return result
    result.log_path = (result.startup or {}).get("log_path")
    steady: _SteadyFeed | None = None
    feed: _Feed | _SteadyFeed
    if plan.steady is not None:
        cut_s = None
        if plan.deadline_s is not None:
            # After the server start: what is left of the budget for this test, less
            # its warm-up (the stop rule's clock starts at the first measured arrival)
            # and one window (the rule looks once a window): it stops inside the budget.
            cut_s = max(plan.deadline_s - backend.server_s - plan.warmup_span_s(rate)
                        - plan.window_s, 0.0)
        steady = feed = _SteadyFeed(plan, rate, len(plan.measured_for(rate)), cut_s)
        steady.on_evidence = on_evidence
    else:
        feed = _Feed(plan, pruner, trial, report_every=10 if backend.mode == "virtual" else 1)
    try:
        run = backend.load_test(rate, plan, feed)
    except TrialFailed as exc:
        result.reason, result.detail = exc.reason, exc.detail
        result.log_path = exc.log_path or result.log_path
        return result
    finally:
        if pruner is not None and number is not None:
            decision = pruner.decisions.get(number)
            pruner.end(number)
        else:
            decision = None
    result.windows = feed.windows
    result.records = run.records
    result.load_test_s = run.load_test_s
    result.telemetry = run.telemetry
    judged: Sequence[RequestRecord] = run.records
    if steady is not None:
        judged, result.evidence = _final_evidence(steady, run, plan, rate)
    result.summary = summarize(judged, slo=plan.slo, offered_rate=rate,
                               source=backend.source)
    if out_dir is not None and number is not None:
        result.records_path = str(write_records(out_dir, number, run.records))
    if run.crashed:
        result.reason, result.detail = "crashed", run.crashed
        return result
    if steady is not None:
        result.status = COMPLETE
        ev = result.evidence
        result.budget_cut = steady.cut
        if ev is not None and ev.verdict != PASS:
            result.reason = "slo_missed" if ev.verdict == FAIL else INCONCLUSIVE
            result.detail = "; ".join(ev.reasons)
        if result.budget_cut:
            result.detail = "; ".join(filter(None, [
                result.detail, f"cut after {steady.cut_s:.0f} s: the --budget ran out"]))
        return result
    if decision is not None and run.aborted:
        result.status, result.prune = PRUNED, decision
        result.reason, result.detail = decision.rule, decision.detail
        return result
    result.status = COMPLETE
    check = result.check
    if check is not None and not check.met:
        result.reason = "slo_missed"
        result.detail = ", ".join(
            f"{k} {check.observed_s[k]:.3g}s" if math.isfinite(check.observed_s[k])
            else f"{k} inf (failures)" for k in check.failed)
    return result


def _final_evidence(feed: _SteadyFeed, run: LoadRun, plan: LoadPlan, rate: float
                    ) -> tuple[list[RequestRecord], Evidence]:
    """The verdict a test ended on: the stop rule's, or (arrivals ran out first) a
    last judgement over everything that finished."""
    if feed.stopped_at is not None and feed.evidence is not None:
        cutoff = feed.stopped_at - horizon(plan.slo)
        return _judged(run.records, cutoff, plan.slo), feed.evidence
    assert plan.steady is not None
    ends = [r.end_s for r in run.records if r.end_s is not None]
    now = max(ends) if ends else 0.0
    ev = judge(run.records, slo=plan.slo, offered_rate=rate, now=now, rule=plan.steady,
               planned=feed.planned, final=True)
    return _judged(run.records, math.inf, plan.slo), ev


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord)
                       if f.name != "chunk_times_s")


def write_records(out_dir: Path, number: int, records: Sequence[RequestRecord]) -> Path:
    """``<out_dir>/records/trial-<n>.jsonl``: one record a line, chunk times dropped
    (their count and the ITL percentiles are in the summary)."""
    folder = Path(out_dir) / "records"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"trial-{number:04d}.jsonl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            # Not asdict(): it deep-copies every chunk time, which dominated a study.
            d = {k: getattr(r, k) for k in _RECORD_FIELDS}
            d["num_chunks"] = len(r.chunk_times_s)
            f.write(json.dumps(_finite(d)) + "\n")
    tmp.replace(path)
    return path


def probe(
    backend: Backend,
    flags: Mapping[str, Any],
    rate: float,
    plan: LoadPlan,
    *,
    prune: bool = True,
    on_evidence: Callable[[Evidence], None] | None = None,
) -> TrialResult:
    """One load test outside any study (for the ceiling search): the same runner,
    with the overload pruner on its own so an overloaded rate stops early."""
    pruner = OverloadPruner(plan.slo) if prune else None
    trial = _LoneTrial(pruner) if pruner is not None else None
    return evaluate(backend, flags, rate, plan, pruner=pruner, trial=trial,
                    on_evidence=on_evidence)


class _LoneTrial:
    """Just enough of ``optuna.Trial`` for the pruner outside a study."""

    number = -1

    def __init__(self, pruner: OverloadPruner) -> None:
        self._pruner = pruner

    def report(self, value: float, step: int) -> None:
        pass

    def should_prune(self) -> bool:
        return self._pruner.prune(None, self)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- backends


class SimBackend(Backend):
    """Virtual time: the simulator's engine on a hardware and model profile."""

    name = "sim"
    mode = "virtual"
    source = SIMULATED

    def __init__(self, hardware: str | HardwareProfile, model: str | ModelProfile, *,
                 startup_s: float = 0.0) -> None:
        """``hardware`` and ``model``: profile names (``"4xa100-80gb"``), or profile
        objects, e.g. a shipped profile with changed efficiency factors."""
        super().__init__()
        from autotune.sim import config as sim_config
        from autotune.sim import engine, profiles

        self._cfg, self._engine = sim_config, engine
        self.hardware = (profiles.load_hardware(hardware) if isinstance(hardware, str)
                         else hardware)
        self.model = profiles.load_model(model) if isinstance(model, str) else model
        self.hardware_name = hardware if isinstance(hardware, str) else hardware.label
        self.model_name = model if isinstance(model, str) else model.name
        self.startup_s = startup_s  # virtual seconds charged per (re)start
        self._config: Any = None
        self._flags: dict[str, Any] | None = None
        self._fields = {f.name for f in dataclasses.fields(sim_config.EngineConfig)}

    @property
    def gpus(self) -> int:
        return int(self.hardware.gpus)

    @property
    def attention_heads(self) -> int:
        return int(self.model.num_attention_heads)

    def prepare(self, flags: Mapping[str, Any], *, trial: int | None = None
                ) -> dict[str, Any]:
        flags = dict(flags)
        if self._flags == flags and self._config is not None:
            return {"reused": True, "startup_s": 0.0, "config": flags, "simulated": True}
        modelled = {k: v for k, v in flags.items() if k in self._fields}
        ignored = sorted(set(flags) - set(modelled))
        modelled.setdefault("model", self.model.hf_id)
        try:
            config = self._cfg.EngineConfig.from_flags(modelled)
            setup = self._cfg.resolve(config, self.hardware, self.model)
        except self._cfg.ConfigRefused as exc:
            self._flags = None
            raise TrialFailed("refused", str(exc)) from None
        except ValueError as exc:
            self._flags = None
            raise TrialFailed("invalid_argument", str(exc)) from None
        self._config, self._flags = config, flags
        self.restarts += 1
        self.server_s += self.startup_s
        return {"reused": False, "startup_s": self.startup_s, "config": flags,
                "simulated": True, "kv_cache_tokens": int(setup.kv_capacity_tokens),
                "max_concurrency": float(setup.max_concurrency),
                "max_num_seqs": setup.max_num_seqs,
                "max_num_batched_tokens": setup.max_num_batched_tokens,
                "ignored_flags": ignored}

    def load_test(self, rate: float, plan: LoadPlan, on_window: WindowFn | None) -> LoadRun:
        n_warm = plan.warmup
        pool = plan.warmup_requests or plan.requests
        warm = [pool[i % len(pool)] for i in range(n_warm)]
        reqs = warm + plan.measured_for(rate)
        arrivals = arrival_offsets(len(reqs), rate, process=plan.process,  # type: ignore[arg-type]
                                   burstiness=plan.burstiness, seed=plan.seed)
        try:
            res = self._engine.simulate(self._config, self.hardware, self.model, reqs,
                                        arrivals, warmup=n_warm,
                                        max_concurrency=plan.max_concurrency,
                                        on_window=on_window, window_s=plan.window_s)
        except self._cfg.ConfigRefused as exc:
            self._flags = None
            raise TrialFailed("refused", str(exc)) from None
        records = list(res.records)
        # Server time: from the first (warm-up) send to the last end, virtual seconds.
        ends = [r.end_s for r in records if r.end_s is not None]
        duration = max((max(ends) if ends else 0.0) - float(arrivals[0]), 0.0)
        self.server_s += duration
        stats = res.stats_dict()
        stats.pop("timeline", None)
        telemetry = {"source": "simulated", "gpu_util_mean_pct": 100.0 * res.busy_fraction,
                     "kv_usage_mean": res.kv_usage_mean, "kv_usage_max": res.kv_usage_max,
                     "preemptions": res.preemptions, "engine": stats.get("engine"),
                     "notes": stats.get("notes")}
        return LoadRun(records=records, aborted=bool(res.aborted),
                       abort_reason="pruned" if res.aborted else None,
                       load_test_s=max(res.window_end_s - res.window_start_s, 0.0),
                       telemetry=telemetry)


class ServerBackend(Backend):
    """Real time: a :class:`autotune.server.Server` and the HTTP load generator."""

    mode = "real"
    source = MEASURED

    def __init__(self, server: Any, *, name: str = "vllm", model: str | None = None,
                 endpoint: str = "completions", api_key: str | None = None,
                 gpus: int | None = None, nvml: bool = True,
                 transport: str = "native") -> None:
        super().__init__()
        self.server = server
        self.name = name
        self.restartable = bool(getattr(server, "restartable", True))
        self.model = model
        self.endpoint = endpoint
        self.api_key = api_key
        self.gpus = gpus
        self.nvml = nvml
        self.transport = transport
        self._flags: dict[str, Any] | None = None

    def prepare(self, flags: Mapping[str, Any], *, trial: int | None = None
                ) -> dict[str, Any]:
        from autotune.server import ServerError, ServerStartError

        server_flags = {k: v for k, v in flags.items() if k != "model"}
        if not self.restartable:
            server_flags = {}
        if self._flags == server_flags and self.server.alive():
            return {"reused": True, "startup_s": 0.0, "config": server_flags,
                    "endpoint": self.server.endpoint}
        t0 = time.monotonic()
        try:
            info = self.server.start(server_flags, trial=trial)
        except ServerStartError as exc:
            self._flags = None
            self.server_s += time.monotonic() - t0
            path = getattr(exc, "log_path", None)
            raise TrialFailed(exc.reason, exc.detail,
                              log_path=None if path is None else str(path)) from None
        except ServerError as exc:
            self._flags = None
            raise TrialFailed("refused", str(exc)) from None
        self.server_s += time.monotonic() - t0
        self.restarts += 1
        self._flags = server_flags
        data = info.to_dict() if hasattr(info, "to_dict") else {}
        data["reused"] = False
        return data

    def load_test(self, rate: float, plan: LoadPlan, on_window: WindowFn | None) -> LoadRun:
        from autotune.loadgen import LoadTestConfig, run_load_test_sync

        cfg = LoadTestConfig(
            url=self.server.endpoint, model=self.model, endpoint=self.endpoint, rate=rate,
            process=plan.process, burstiness=plan.burstiness,
            max_concurrency=plan.max_concurrency, warmup=plan.warmup,
            request_timeout_s=plan.request_timeout_s, api_key=self.api_key, seed=plan.seed,
            window_s=plan.window_s, transport=self.transport)
        sampler = _nvml_sampler() if self.nvml else None
        t0 = time.monotonic()
        try:
            res = run_load_test_sync(cfg, plan.measured_for(rate),
                                     warmup_requests=plan.warmup_requests, on_window=on_window)
        finally:
            gpu = sampler.stop() if sampler is not None else None
            self.server_s += time.monotonic() - t0
        telemetry: dict[str, Any] = {"source": "measured"}
        if gpu is not None and getattr(gpu, "available", False):
            telemetry.update(gpu_util_mean_pct=gpu.util_mean_pct,
                             gpu_util_max_pct=gpu.util_max_pct,
                             gpu_mem_used_max_bytes=gpu.mem_used_max_bytes, gpu_note=gpu.note)
        return LoadRun(records=list(res.records), aborted=res.aborted,
                       abort_reason=res.abort_reason, load_test_s=res.duration_s,
                       telemetry=telemetry, crashed=self.exit_report())

    def exit_report(self) -> str | None:
        """Why the server this backend started is gone (with its log's tail), or None
        while it runs.  A dead server is forgotten, so the next test restarts it."""
        if not self.restartable or self.server.alive():
            return None
        self._flags = None
        return "the server exited during the load test; log tail: " + " | ".join(
            self.server.log_tail(5).splitlines()[-5:])

    def close(self) -> None:
        self._flags = None
        with contextlib.suppress(Exception):
            self.server.stop()


def _nvml_sampler() -> Any:
    try:
        from autotune.telemetry import NvmlSampler

        return NvmlSampler(interval_s=0.5).start()
    except Exception:  # no NVML, no GPU: telemetry is optional
        return None
