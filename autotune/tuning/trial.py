"""One trial: a config plus a rate cap, evaluated on a backend.

Whichever backend ran the load test (virtual time in the simulator, real time over
HTTP: :mod:`autotune.backends`), its records go to ``metrics.summarize``, feed the
overload pruner once per window and the steady-state verdict, and come back as a
:class:`TrialResult`.  A start that fails, a config the engine refuses, or a server
that dies during the load test is an infeasible result with its reason, never an
exception that ends the study.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.backends.base import Backend, LoadPlan, LoadRun, TrialFailed
from autotune.core.files import json_safe
from autotune.core.metrics import Summary, summarize
from autotune.core.records import RequestRecord
from autotune.core.slo import SLO, SLOCheck
from autotune.tuning.pruning import OverloadPruner, PruneDecision, Window, window_evidence
from autotune.tuning.verdict import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    Evidence,
    horizon,
    judge,
    point_verdict,
)

if TYPE_CHECKING:
    pass

COMPLETE, PRUNED, INFEASIBLE = "complete", "pruned", "infeasible"


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
        return point_verdict(self.summary)

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
        self.rate = plan.offered_rate(rate)
        self.planned = planned
        # A closed loop's request rate is the server's answer, not planned: its cap
        # follows the rate its users reach (cap_s), up to the hard cap.
        self.closed = plan.closed is not None
        self.max_s = (self.rule.hard_cap_s(plan.slo) if self.closed
                      else self.rule.max_s(plan.slo, plan.sizing_rate(rate)))
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
            return self.rule.max_s(self.plan.slo)
        max_s = self.max_s
        if self.closed:
            reached = ev.sent / ev.at_s if ev.at_s > 0 else 0.0
            max_s = self.rule.max_s(self.plan.slo, reached if reached > 0 else None)
        extra = max(ev.horizon_s - horizon(self.plan.slo), 0.0)
        return max(max_s, min(max_s + extra, self.rule.hard_cap_s(self.plan.slo)))


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
    steady = None if plan.steady is None else _steady_feed(backend, plan, rate, on_evidence)
    feed: _Feed | _SteadyFeed = steady if steady is not None else _Feed(
        plan, pruner, trial, report_every=10 if backend.mode == "virtual" else 1)
    try:
        run = backend.load_test(rate, plan, feed)
    except TrialFailed as exc:
        result.reason, result.detail = exc.reason, exc.detail
        result.log_path = exc.log_path or result.log_path
        return result
    finally:
        decision = _end_pruning(pruner, number)
    _take_run(result, run, feed, steady, plan, rate, backend.source)
    if out_dir is not None and number is not None:
        result.records_path = str(write_records(out_dir, number, run.records))
    if run.crashed:
        result.reason, result.detail = "crashed", run.crashed
        return result
    if steady is not None:
        return _classify_steady(result, steady)
    return _classify_fixed(result, decision, run.aborted)


def _steady_feed(backend: Backend, plan: LoadPlan, rate: float,
                 on_evidence: Callable[[Evidence], None] | None) -> _SteadyFeed:
    """The stop rule of a test sized by time, cut where the ``--budget`` would run out."""
    cut_s = None
    if plan.deadline_s is not None:
        # After the server start: what is left of the budget for this test, less
        # its warm-up (the stop rule's clock starts at the first measured arrival)
        # and one window (the rule looks once a window): it stops inside the budget.
        cut_s = max(plan.deadline_s - backend.server_s - plan.warmup_span_s(rate)
                    - plan.window_s, 0.0)
    steady = _SteadyFeed(plan, rate, len(plan.measured_for(rate)), cut_s)
    steady.on_evidence = on_evidence
    return steady


def _end_pruning(pruner: OverloadPruner | None, number: int | None
                 ) -> PruneDecision | None:
    """The pruner's decision on this trial, if any, with its state for the trial freed
    whether or not the load test raised."""
    if pruner is None or number is None:
        return None
    decision = pruner.decisions.get(number)
    pruner.end(number)
    return decision


def _take_run(result: TrialResult, run: LoadRun, feed: _Feed | _SteadyFeed,
              steady: _SteadyFeed | None, plan: LoadPlan, rate: float, source: str) -> None:
    """Copy what the load test measured into ``result``, summarized over the cohort the
    verdict judges (every record for a fixed-count test)."""
    result.windows = feed.windows
    result.records = run.records
    result.load_test_s = run.load_test_s
    result.telemetry = run.telemetry
    judged: Sequence[RequestRecord] = run.records
    if steady is not None:
        judged, result.evidence = _final_evidence(steady, run, plan, rate)
    result.summary = summarize(judged, slo=plan.slo, offered_rate=plan.offered_rate(rate),
                               source=source)


def _classify_steady(result: TrialResult, steady: _SteadyFeed) -> TrialResult:
    """A test sized by time is complete; its steady-state verdict, and a budget cut,
    say why it did not pass."""
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


def _classify_fixed(result: TrialResult, decision: PruneDecision | None, aborted: bool
                    ) -> TrialResult:
    """A fixed-count test is pruned when the pruner stopped it, else judged by its SLO
    check."""
    if decision is not None and aborted:
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
    ev = judge(run.records, slo=plan.slo, offered_rate=plan.offered_rate(rate), now=now,
               rule=plan.steady, planned=feed.planned, final=True)
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
            f.write(json.dumps(json_safe(d)) + "\n")
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
