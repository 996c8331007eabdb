"""Validation of an answer: the recommended config at its cap, for a long run.

The ceiling search's probes last a minute or more each; the answer a user deploys
must hold for an hour.  So the cap is run once more for ``duration_s`` (5 minutes by
default, the seed chapter's rule; virtual time on the simulator), judged by the same
steady-state verdict with the minimum duration set to the whole run (and its cap as
long as the limits' sequential tests need at that rate, within the hard cap).  A cap that does
not pass steps down 5% and is run again, and the output says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autotune.backends.base import Backend, LoadPlan
from autotune.tuning.ceiling import PROOF_SAFE_SHARE
from autotune.tuning.trial import TrialResult, evaluate
from autotune.tuning.verdict import PASS, Prior, SteadyState, merge_prior

DEFAULT_VALIDATE_S = 300.0
STEP_DOWN = 0.05
# Runs at most: the cap and its step-downs (each one pooled pass decision).
VALIDATION_RUNS = 3


@dataclass(frozen=True)
class ValidationRun:
    rate: float
    verdict: str
    duration_s: float  # seconds of arrivals judged
    requests: int  # measured requests judged
    percentiles: dict[str, float]  # limit label -> observed seconds
    reasons: tuple[str, ...]
    source: str
    # Steady-state goodput (the verdict's cohort), the figure a trial's value is.
    goodput_tokens: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "verdict": self.verdict, "duration_s": self.duration_s,
                "requests": self.requests, "goodput_tokens": self.goodput_tokens,
                "percentiles": {k: (v if math.isfinite(v) else None)
                                for k, v in self.percentiles.items()},
                "reasons": list(self.reasons), "source": self.source}


@dataclass
class Validation:
    """The validated cap (None when every step failed) and each run."""

    duration_s: float
    runs: list[ValidationRun] = field(default_factory=list)
    unit: str = "req/s"  # what a run's rate counts: "users" or "in flight" in a closed loop

    @property
    def passed(self) -> bool:
        return bool(self.runs) and self.runs[-1].verdict == PASS

    @property
    def rate(self) -> float | None:
        return self.runs[-1].rate if self.passed else None

    @property
    def stepped_down(self) -> int:
        return max(len(self.runs) - 1, 0)

    def _at(self, level: float) -> str:
        return f"{level:.4g} {self.unit}" if self.unit == "req/s" else f"{level:.0f} {self.unit}"

    def sentence(self) -> str:
        if not self.runs:
            return "not validated"
        last = self.runs[-1]
        where = "simulated, " if "simulated" in last.source else ""
        # "P99 e2e 8.29 s, P99 ttft 65.1 ms": with two limits, a bare "P99" is ambiguous.
        figures = ", ".join(f"{label.split(':', 1)[0].upper()} {label.split(':', 1)[-1]} "
                            f"{_s(v)}" for label, v in last.percentiles.items())
        text = (f"validated ({where}{self.duration_s / 60:g} min): {figures} over "
                f"{last.requests} requests in {last.duration_s / 60:.1f} min at "
                f"{self._at(last.rate)}") if self.passed else (
            f"not validated: {len(self.runs)} runs of {self.duration_s / 60:g} min down to "
            f"{self._at(last.rate)} all failed ({'; '.join(last.reasons)[:200]})")
        if self.passed and self.stepped_down:
            first = self.runs[0]
            text += (f"; the cap stepped down {self.stepped_down} x {STEP_DOWN:.0%} from "
                     f"{self._at(first.rate)}, which failed its run "
                     f"({first.reasons[0][:120]})")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"duration_s": self.duration_s, "passed": self.passed, "rate": self.rate,
                "unit": self.unit,
                "sentence": self.sentence(), "runs": [r.to_dict() for r in self.runs]}


def _s(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def validate_cap(
    backend: Backend,
    flags: Mapping[str, Any],
    cap: float,
    plan: LoadPlan,
    *,
    duration_s: float = DEFAULT_VALIDATE_S,
    max_steps: int = VALIDATION_RUNS - 1,
    prior_for: Callable[[float], Prior] | None = None,
    on_run: Callable[[ValidationRun], None] | None = None,
    on_result: Callable[[TrialResult], None] | None = None,
) -> Validation:
    """Run ``flags`` at ``cap`` for ``duration_s``; on a fail or an inconclusive run,
    step the rate down 5% and run again (at most ``max_steps`` more times).

    ``prior_for(rate)``: the ceiling search's evidence at rates at or above ``rate``
    (``ceiling.lent_evidence``); each run pools it with what the earlier runs lend."""
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"the cap to validate must be a positive rate, got {cap}")
    if not duration_s > 0:
        raise ValueError(f"validation duration must be > 0 s, got {duration_s}")
    base = plan.steady or SteadyState()
    # At least the whole duration; longer when the limits' sequential tests need more
    # requests at this rate (up to the hard cap).  The plan's ``prior`` (the ceiling
    # search's tests at rates at or above the cap) and ``looks`` (its share of the
    # search's false-pass rate) come with it: each run is one more pooled look.
    # Safe at 75% of the allowance, as the proof near the floor: the cap sits 10% under a
    # ceiling whose share over the limit may already be between half the allowance and
    # the allowance, where a test against half decides neither way.  The false-pass
    # bound at the allowance does not depend on the safe share.
    steady = replace(base, min_duration_s=duration_s, max_duration_s=None,
                     safe_share=PROOF_SAFE_SHARE)
    long_plan = replace(plan, steady=steady)
    closed = plan.closed
    out = Validation(duration_s=duration_s,
                     unit="req/s" if closed is None else closed.unit)
    rate = cap
    lent: list[Prior] = []
    for _ in range(max_steps + 1):
        prior = merge_prior([prior_for(rate) if prior_for is not None else (), *lent])
        res = evaluate(backend, flags, rate,
                       replace(long_plan, steady=replace(steady, prior=prior)))
        if res.evidence is not None:
            lent.append(res.evidence.lent())
        run = _run_of(res, rate, backend.source)
        if res.budget_cut:
            run = replace(run, reasons=(*run.reasons, "cut where the --budget ran out"))
        out.runs.append(run)
        if on_result is not None:  # the whole result, e.g. for experiments.csv
            on_result(res)
        if on_run is not None:
            on_run(run)
        # The plan's ``deadline_s`` (a --budget) ends the validation where it ends: no
        # run starts after it, so an undecided run cannot take three hard caps' time.
        if run.verdict == PASS or res.summary is None or res.budget_cut:
            break
        if closed is None:
            rate = round(rate * (1.0 - STEP_DOWN), 4)
        elif rate > 1:  # whole users: 5% down, and at least one fewer
            rate = float(min(math.floor(rate * (1.0 - STEP_DOWN)), rate - 1))
        else:
            break
    return out


def _run_of(res: TrialResult, rate: float, source: str) -> ValidationRun:
    ev = res.evidence
    if ev is None or res.summary is None:
        return ValidationRun(rate, "fail", 0.0, 0, {}, (res.reason or "failed",
                                                        res.detail or ""), source)
    return ValidationRun(
        rate=rate, verdict=ev.verdict, duration_s=ev.cohort_span_s, requests=ev.cohort,
        percentiles={lim.label: lim.observed_s for lim in ev.limits}, reasons=ev.reasons,
        source=source, goodput_tokens=ev.goodput_tokens)
