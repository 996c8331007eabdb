"""The safe request-rate ceiling of one config: the highest rate that meets the SLO.

``find_ceiling`` brackets the ceiling exponentially from a start rate (x2 while probes
pass, /2 while they fail), then bisects between the highest passing and the lowest
failing rate until they are within ``tol`` (relative) or the probe budget is spent.
Each probe is one full load test (warm-up, measured window, SLO check) run by a
``probe`` callable; the search itself is pure and never knows whether the probe ran
vLLM, an attached endpoint or the simulator in virtual time.

The confidence rule: a probe *passes* only when every limit's percentile is under its
threshold AND so is the one-sided upper confidence bound of that percentile (order
statistics over the probe's samples, failed requests as inf).  A probe whose point
estimate passes but whose bound does not is *uncertain*: it is re-run with more
requests, up to ``max_num_prompts``, and never counts as passing, so the tool never
recommends a rate that met the SLO by luck.

Probes in this module (``SimProbe``, ``HttpProbe``) give every rate the same arrival
seed (common random numbers): two probes differ only in rate, so pass/fail is a
monotone function of rate and bisection is not fooled by the draw.  Repeats (the
``repeats`` boundary re-runs) draw new seeds to measure that noise.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.backends.base import LoadPlan
from autotune.core.errors import AutotuneError
from autotune.core.metrics import Summary
from autotune.core.records import RequestRecord
from autotune.core.slo import SLO, quantile
from autotune.servers.telemetry import TelemetryError, wait_idle
from autotune.tuning.load_unit import RATE, LoadUnit
from autotune.tuning.load_unit import fmt_rate as _rate
from autotune.tuning.sequential import ExceedanceTest
from autotune.tuning.trial import INFEASIBLE, PRUNED, probe
from autotune.tuning.verdict import (
    LimitCheck,
    Prior,
    binding_of,
    check_limits,
    horizon,
    limit_test,
    merge_prior,
    verdict_of,
)
from autotune.workload.sources import Request

# A probe that completes fewer requests per second than this share of its offered
# rate could not keep up: its throughput estimates the service capacity.
OVERLOAD_SHARE = 0.95
SATURATION_REQUESTS = 200
SECANT_SHARE = 0.5
PHASES = ("saturation", "floor", "incumbent", "bracket", "bisect", "more-requests",
          "proof", "repeat")
# Phases that decide no rate of the search: they count toward no probe limit.
UNCOUNTED = ("saturation", "floor", "repeat")
# The light-load test: this many requests, at most this many in flight, decide
# whether any rate can meet the SLO before the search halves its rate toward zero.
FLOOR_REQUESTS = 100
FLOOR_CONCURRENCY = 4
# A closed loop's test plans requests for at most this many times the saturated
# throughput (a short saturation test reads under the capacity a steady one reaches).
CLOSED_RATE_MARGIN = 3.0
# "inconclusive": a load test sized by time that ran to its cap without a certain
# verdict; "uncertain": a fixed-count probe whose point estimate passed but whose bound
# did not.  Neither counts as passing.
VERDICTS = ("pass", "fail", "inconclusive", "uncertain")
# Near the latency floor the share of requests over a limit sits between half the
# allowance and the allowance at every rate (the default config at --slo-p99 10s:
# 0.64% over 10 s at 0.5 req/s, 0.75% at 3 req/s, 1.2% at 5), and a test against half
# the allowance drifts toward neither boundary: halving the rate only shortens the
# tests.  The search then spends what is left of its false-pass rate on one long test
# at the rate that ran to its cap undecided, the *proof*, whose safe hypothesis is
# PROOF_SAFE_SHARE of the allowance: the same false-pass bound at the allowance
# (Ville's inequality holds for any safe hypothesis), and a pass in expectation for any
# share under ~87% of it.
PROOF_SAFE_SHARE = 0.75
# The proof pools the tests at rates up to this factor above its own (chosen by rate
# alone, so the pooled test keeps its error rate): higher ones carry a higher share.
PROOF_POOL = 1.2
# The longest a proof's arrivals last unless --max-duration says otherwise: what the
# default config's proof needs at 10 s (about 15,000 requests at 2.6 req/s, where
# 0.72% exceed), twice over.  It stops as soon as it is decided.
PROOF_CAP_S = 4 * 3600.0
# A proof is run only when this many times the requests it needs in expectation (at
# the share seen so far, one standard error up) fit within its cap.
PROOF_MARGIN = 2.0


class CeilingError(AutotuneError, ValueError):
    """The ceiling search cannot run as asked; the message says what and how to fix."""


class BelowFloor(CeilingError):
    """Even at light load the config misses the SLO: no load can meet it."""


class BudgetSpent(CeilingError):
    """The server-time budget (``--budget``) ran out before the next load test: the
    search ends with what its tests so far support."""


# ----------------------------------------------------------------------------- probe


@dataclass
class ProbeResult:
    """What one load test at one rate returned."""

    summary: Summary
    pruned: bool = False
    prune_reason: str | None = None
    gpu_util: float | None = None  # mean GPU utilization over the probe, 0..1, if known
    # Seconds the probe occupied the server (virtual seconds for the simulator),
    # warm-up and drain included: the cost of the probe.
    server_s: float | None = None
    # Measured completions per second between the first and the last completion
    # (``completion_rate``): an overloaded server completes at its capacity whatever
    # the offered rate, so this estimates the capacity better than the window's req/s.
    completion_rate: float | None = None
    # The steady-state verdict (autotune.tuning.verdict.Evidence) when the probe was sized by
    # time: it decides pass/fail/inconclusive instead of the summary's SLO check.
    evidence: Any = None
    # The server-time budget ran out during this test, which was cut there.
    budget_cut: bool = False
    # Where a test sized by time started in its pool, and which such test it was
    # (BackendProbe.plan's ``at``): enough to replay the requests it sent.
    pool_at: tuple[int, int] | None = None


def completion_rate(records: Sequence[RequestRecord]) -> float | None:
    """Completed measured requests per second between the first and last completion."""
    ends = sorted(r.end_s for r in records if not r.warmup and r.ok and r.end_s is not None)
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return None
    return (len(ends) - 1) / (ends[-1] - ends[0])


def search_looks(max_probes: int) -> int:
    """The pass decisions a ceiling search may make, pooled: they share the
    false-pass rate (Bonferroni), so that the answer, whichever rate it ends on, is
    unsafe at most 5% of the time.  The validation adds none: it runs below a rate the
    search passed, which is safe whenever that pass was right (latency grows with the
    rate), so its own pass cannot make the answer wrong; it can only step the cap
    down."""
    return max(max_probes, 1)


def search_steady(steady: Any, max_probes: int) -> Any:
    """A ceiling search's steady-state rule: the plan's, its pass decisions sharing
    the false-pass rate (``search_looks``); None stays None (fixed-count probes)."""
    if steady is None:
        return None
    return dataclasses.replace(steady, looks=search_looks(max_probes))


def busy_rate(records: Sequence[RequestRecord]) -> float | None:
    """The served rate of a burst (every request sent at once): output tokens per
    second until 90% of the requests completed, in requests of their mean length.
    Completions per second would read the drain of the longest replies, when a few
    streams are left, as the server's capacity."""
    done = [r for r in records if not r.warmup and r.ok and r.end_s is not None]
    sent = [r.sent_s for r in done if r.sent_s is not None]
    if len(done) < 10 or not sent:
        return completion_rate(records)
    ends = sorted(r.end_s for r in done if r.end_s is not None)
    t0, t90 = min(sent), ends[int(0.9 * (len(ends) - 1))]
    if not t90 > t0:
        return completion_rate(records)
    tokens = 0.0
    for r in done:
        if r.end_s is not None and r.end_s <= t90:
            tokens += r.output_tokens
        elif r.chunk_times_s:
            # Each content chunk carries about output_tokens / chunks tokens.
            shown = sum(1 for t in r.chunk_times_s if t <= t90)
            tokens += r.output_tokens * shown / len(r.chunk_times_s)
    mean_out = sum(r.output_tokens for r in done) / len(done)
    return tokens / (t90 - t0) / mean_out if mean_out > 0 else None


# probe(rate, num_prompts) -> ProbeResult; may also accept ``repeat=k`` (new seed),
# ``prior=...`` (evidence pooled from higher rates, SteadyState.prior) and
# ``light=k`` (the light-load floor test: rate inf, at most k requests in flight).
ProbeFn = Callable[..., ProbeResult]


# ----------------------------------------------------------------------------- checks


def min_samples_for_bound(percentile: float, confidence: float) -> int:
    """Fewest samples for which the upper bound of a percentile is finite.

    The bound is the largest sample at best, which covers the percentile with
    probability 1 - (p/100)^n: n >= log(1 - confidence) / log(p/100).
    """
    p = percentile / 100.0
    return int(math.floor(math.log(1.0 - confidence) / math.log(p) + 1e-9)) + 1


def floor_verdict(summary: Summary, slo: SLO, in_flight: int = 1) -> str | None:
    """Why no load can meet ``slo``, from a light-load test's ``summary`` with at most
    ``in_flight`` requests in flight (None when its limits' sequential tests do not show
    that): a limit whose exceedance is shown over its allowance with 95% confidence even
    with almost nothing queued."""
    for limit in slo.limits:
        values = np.asarray(summary.samples.get(limit.metric, ()), dtype=float)
        n = int(values.size)
        k = int(np.sum(values > limit.threshold_s))
        test = limit_test(limit)
        if n and test.decide(n, k) == "fail":
            return (f"{limit.label}: {k} of {n} requests over {format_seconds(limit.threshold_s)} "
                    f"({k / n:.1%}) at light load ({_at_most(in_flight)}), "
                    f"shown over the {test.allowance:.1%} allowed with 95% confidence: the "
                    "latency floor of this config and workload is above the SLO, so no "
                    "load can meet it")
    return None


def _at_most(in_flight: int) -> str:
    return "one request at a time" if in_flight == 1 else f"at most {in_flight} in flight"


# ----------------------------------------------------------------------------- results


@dataclass
class Probe:
    """One load test of the search, as the result reports it."""

    index: int
    rate: float
    num_prompts: int
    phase: str  # one of PHASES
    verdict: str  # one of VERDICTS
    checks: list[LimitCheck]
    binding: str | None
    request_throughput: float
    output_throughput: float
    num_measured: int
    pruned: bool
    prune_reason: str | None
    overloaded: bool
    gpu_util: float | None
    server_s: float | None
    repeat: int = 0
    note: str | None = None
    completion_rate: float | None = None
    # The service rate this probe saw, in offered-rate units (meaningful when
    # ``overloaded``): completions per second scaled by offered / achieved send rate.
    capacity_seen: float = math.nan
    summary: Summary | None = field(default=None, repr=False)
    evidence: Any = field(default=None, repr=False)
    pool_at: tuple[int, int] | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def slack(self) -> float:
        """The tightest limit's slack (see ``LimitCheck.slack``); 0 for a pruned probe,
        whose partial samples say little beyond "failed"."""
        if self.pruned or not self.checks:
            return 0.0
        return min(c.slack for c in self.checks)

    def check(self, label: str) -> LimitCheck | None:
        return next((c for c in self.checks if c.label == label), None)

    def to_dict(self, *, with_summary: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index, "rate": _num(self.rate), "num_prompts": self.num_prompts,
            "phase": self.phase, "verdict": self.verdict, "binding": self.binding,
            "checks": [c.to_dict() for c in self.checks],
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "num_measured": self.num_measured, "pruned": self.pruned,
            "prune_reason": self.prune_reason, "overloaded": self.overloaded,
            "gpu_util": self.gpu_util, "server_s": self.server_s, "repeat": self.repeat,
            "completion_rate": self.completion_rate,
            "capacity_seen": _num(self.capacity_seen), "slack": _num(self.slack),
            "note": self.note,
            "pool_at": None if self.pool_at is None else list(self.pool_at),
        }
        if self.evidence is not None:
            data["evidence"] = self.evidence.to_dict()
        if with_summary and self.summary is not None:
            data["summary"] = self.summary.to_dict()
        return data


@dataclass
class Spread:
    """The boundary probes re-run ``repeats`` times: how much they moved."""

    rate: float
    label: str  # the limit the figures are of (the binding one)
    runs: int
    passes: int
    observed_min_s: float
    observed_max_s: float
    bound_min_s: float
    bound_max_s: float
    throughput_min: float
    throughput_max: float

    def to_dict(self) -> dict[str, Any]:
        return {k: _num(v) if isinstance(v, float) else v for k, v in self.__dict__.items()}


@dataclass
class CeilingResult:
    slo: SLO
    confidence: float
    tol: float
    headroom: float
    source: str  # metrics.SIMULATED or metrics.MEASURED
    feasible: bool  # some rate passed
    feasible_max: float | None
    infeasible_min: float | None
    converged: bool  # infeasible_min / feasible_max - 1 <= tol
    binding: str | None
    probes: list[Probe]
    search_probes: int  # load tests the search used (repeats excluded)
    saturated_throughput: float | None
    saturated_how: str | None  # "measured at rate inf" or "estimated from overloaded probes"
    stepdown_probes: int | None  # what vLLM auto_tune.sh's 1 req/s step-down would need
    stepdown_rate: float | None = None  # ...and the rate it would end at
    spread: list[Spread] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The first probe had to pass (the rate needed to beat the incumbent) and did not.
    below_start: bool = False
    # The long run at the cap (autotune.tuning.validation.Validation), when one was made.
    validation: Any = None
    # The server-time budget ran out during the search: the answer is partial.
    budget_spent: bool = False
    # A light-load test showed that no rate can meet the SLO.
    below_floor: bool = False
    # The proof near the floor, when the search ran one (feasible_max is its rate; it
    # stands as the long run: no validation follows it).
    proof: Proof | None = None
    # What the levels (feasible_max, infeasible_min, each probe's rate) count.
    unit: LoadUnit = RATE
    # The lowest level whose test could pass within its time cap (--max-duration), when
    # it kept the search from going lower.
    time_floor: float | None = None

    @property
    def recommended_cap(self) -> float | None:
        """``headroom`` under the ceiling; after a validation, the level it validated
        (None when no run passed)."""
        if self.feasible_max is None:
            return None
        if self.validation is not None:
            return self.validation.rate
        return self.unit.cap(self.feasible_max, self.headroom)

    @property
    def lowest_rate(self) -> float | None:
        rates = [p.rate for p in self.probes if math.isfinite(p.rate)]
        return min(rates) if rates else None

    @property
    def simulated(self) -> bool:
        return "simulated" in self.source

    @property
    def server_s(self) -> float | None:
        costs = [p.server_s for p in self.probes]
        return None if any(c is None for c in costs) else float(sum(costs))  # type: ignore[arg-type]

    def feasible_probe(self) -> Probe | None:
        """The passing probe at feasible_max (the one with the most requests)."""
        if self.feasible_max is None:
            return None
        at = [p for p in self.probes if p.rate == self.feasible_max and p.passed]
        return max(at, key=lambda p: (p.num_prompts, -p.index)) if at else None

    def sentence(self) -> str:
        """The answer in one sentence."""
        prefix = "simulated: " if self.simulated else ""
        if not self.feasible:
            low = self.lowest_rate
            shown = self.unit.fmt(low) if low is not None else "the lowest rate"
            at_low = [p for p in self.probes if p.rate == low]
            if self.unit.by != "rate" and at_low and at_low[-1].summary is not None:
                shown += f" ({other_units(at_low[-1])})"
            if self.budget_spent and not any(p.verdict == "fail" for p in at_low):
                if not at_low:
                    return (f"{prefix}not measured: the --budget ran out before its first "
                            "load test")
                return (f"{prefix}not established: the --budget ran out during the load "
                        f"test at {shown}, before it could pass ({self.slo})")
            if self.below_floor:
                floor = next((p for p in reversed(self.probes) if p.phase == "floor"), None)
                why = floor.note if floor is not None and floor.note else "light load fails"
                return f"{prefix}{self.unit.none} can meet the SLO ({self.slo}): {why}"
            if self.below_start:
                return (f"{prefix}does not sustain {shown}, the level it needs to beat "
                        f"the best config so far ({self.slo})")
            if at_low and all(p.verdict == "inconclusive" for p in at_low):
                return (f"{prefix}not shown to meet the SLO ({self.slo}) at any "
                        f"{self.unit.noun} down to {shown}: its load test reached its time "
                        "cap without steady-state evidence that the SLO holds (a fail for "
                        "the ceiling; see the notes for the lowest rate planned)")
            if at_low and all(p.verdict == "uncertain" for p in at_low):
                return (f"{prefix}even {shown} meets the SLO ({self.slo}) only by its "
                        f"point estimate, not with {self.confidence:.0%} confidence: more "
                        "requests needed (raise max_num_prompts)")
            if (self.time_floor is not None and low is not None
                    and low <= self.time_floor * (1.0 + 1e-9)):
                return (f"{prefix}even {shown} misses the SLO ({self.slo}), and no lower "
                        f"{self.unit.noun} was tested: its test could not gather the "
                        "requests a pass needs within its time cap (raise --max-duration)")
            return (f"{prefix}even {shown} misses the SLO; the config cannot meet it "
                    f"({self.slo})")
        probe = self.feasible_probe()
        assert probe is not None and self.feasible_max is not None
        cap = self.recommended_cap
        limits = _limits_phrase(self.slo, probe, self.confidence)
        others = "" if not self.unit.whole else f" ({other_units(probe)})"
        head = "sustains" if self.infeasible_min is not None else "sustains at least"
        if cap is None:
            return (f"{prefix}{head} {self.unit.fmt(self.feasible_max)}{others} with "
                    f"{limits}; no cap: {self.validation.sentence()}")
        text = (f"{prefix}{head} {self.unit.fmt(self.feasible_max)}{others} with "
                f"{limits}; cap at {self.unit.fmt(cap)}")
        if self.budget_spent:
            text += " (partial: the --budget ran out before the search converged)"
        elif self.infeasible_min is None:
            text += " (no failing rate found within the probe budget)"
        if self.validation is not None:
            text += f"; {self.validation.sentence()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        probe = self.feasible_probe()
        return {
            "answer": self.sentence(),
            "by": self.unit.by,
            "unit": self.unit.label,
            "think_s": None if self.unit.closed is None else self.unit.closed.think_s,
            "think": None if self.unit.closed is None else self.unit.closed.think,
            "at_feasible_max": None if probe is None else load_figures(probe),
            "source": self.source,
            "slo": str(self.slo),
            "confidence": self.confidence,
            "tol": self.tol,
            "headroom": self.headroom,
            "feasible": self.feasible,
            "feasible_max": self.feasible_max,
            "infeasible_min": self.infeasible_min,
            "converged": self.converged,
            "binding": self.binding,
            "recommended_cap": self.recommended_cap,
            "search_probes": self.search_probes,
            "total_probes": len(self.probes),
            "server_s": self.server_s,
            "saturated_throughput": self.saturated_throughput,
            "saturated_how": self.saturated_how,
            "stepdown_probes": self.stepdown_probes,
            "stepdown_rate": self.stepdown_rate,
            "spread": [s.to_dict() for s in self.spread],
            "below_start": self.below_start,
            "below_floor": self.below_floor,
            "time_floor": _num(self.time_floor),
            "proof": None if self.proof is None else self.proof.to_dict(),
            "budget_spent": self.budget_spent,
            "validation": None if self.validation is None else self.validation.to_dict(),
            "notes": list(self.notes),
            "probes": [p.to_dict() for p in self.probes],
        }


def closed_plan(plan: LoadPlan, unit: LoadUnit, proof: CeilingResult | None) -> LoadPlan:
    """``plan`` as a closed loop of ``unit``'s users (a validation after a search by
    users), its tests sized as the search's were: for at most CLOSED_RATE_MARGIN times
    the throughput the proof's saturation test measured."""
    return dataclasses.replace(plan, closed=unit.closed, closed_rate_cap=closed_rate_cap(
        None if proof is None else proof.saturated_throughput))


def closed_rate_cap(saturated_rps: float | None) -> float | None:
    """The request rate a closed loop's tests are planned for at most: its users
    complete no faster than a few times the saturation test's throughput."""
    return None if not saturated_rps else CLOSED_RATE_MARGIN * saturated_rps


def load_figures(p: Probe) -> dict[str, float | None]:
    """A probe's load in every unit, over its judged requests: the rate they were sent
    at (by the users, or the arrival process), the requests in flight on average while
    they were sent and their P99 end-to-end latency."""
    s = p.summary
    rate = (s.scheduled_rate if s is not None and s.scheduled_rate > 0
            else p.request_throughput)
    e2e = None if s is None else s.e2e
    return {"request_rate": _num(rate),
            "in_flight_mean": None if s is None else _num(s.in_flight_mean),
            "e2e_p99_s": None if e2e is None else _num(e2e.p99)}


def other_units(p: Probe) -> str:
    """"= 7.4 req/s, 38 in flight on average, P99 E2E 8.1 s": a probe's load in the
    units its level is not in."""
    f = load_figures(p)
    parts = []
    if f["request_rate"] is not None:
        parts.append(f"= {_rate(f['request_rate'])} req/s")
    if f["in_flight_mean"] is not None:
        parts.append(f"{f['in_flight_mean']:.3g} in flight on average")
    if f["e2e_p99_s"] is not None:
        parts.append(f"P99 E2E {format_seconds(f['e2e_p99_s'])}")
    return ", ".join(parts)


def _num(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and (math.isinf(x) or math.isnan(x))):
        return None
    return x




def format_seconds(s: float) -> str:
    """``10 s``, ``9.1 s``, ``850 ms``, ``∞`` (a bound that needs more samples)."""
    if math.isinf(s) or math.isnan(s):
        return "∞"
    if s >= 1000:
        return f"{s:,.0f} s"
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms"


def _limits_phrase(slo: SLO, probe: Probe, confidence: float) -> str:
    single_e2e = len(slo.limits) == 1 and slo.limits[0].metric == "e2e"
    ev = probe.evidence
    parts = []
    for limit in slo.limits:
        name = f"P{limit.percentile:g}" + ("" if single_e2e else f" {limit.metric.upper()}")
        lim = None if ev is None else next(
            (x for x in ev.limits if x.label == limit.label), None)
        if lim is not None:
            n, k = (lim.pooled_n, lim.pooled_exceed) if lim.pooled_n else (lim.n, lim.exceed)
            pooled = ", pooled with higher rates" if lim.pooled_n else ""
            how = (f"{k} of {n} requests over it{pooled}: under "
                   f"{1 - limit.percentile / 100:.1%} at {confidence * 100:g}% confidence")
        else:
            c = probe.check(limit.label)
            how = (f"{confidence * 100:g}% bound "
                   f"{format_seconds(c.bound_s) if c is not None else '?'}")
        parts.append(f"{name} ≤ {format_seconds(limit.threshold_s)} ({how})")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- comparison


def stepdown_rate(saturated_throughput: float, ceiling: float) -> float | None:
    """The rate that step-down ends at: its first passing integer (None if none does).
    When int(throughput) + 1 already passes it stops there, however far below."""
    start = int(saturated_throughput) + 1
    if start <= ceiling + 1e-9:
        return float(start)
    first_pass = int(math.floor(ceiling + 1e-9))
    return float(first_pass) if first_pass >= 1 else None


def stepdown_probe_count(saturated_throughput: float, ceiling: float) -> int:
    """Load tests vLLM's ``auto_tune.sh`` would run to find ``ceiling``: one at rate inf,
    then int(throughput) + 1, int(throughput), ... down by 1 req/s until a rate at or
    below the ceiling (the first integer that passes), or down to 1 req/s."""
    start = int(saturated_throughput) + 1
    first_pass = int(math.floor(ceiling + 1e-9))
    if start <= ceiling + 1e-9:
        return 2
    if first_pass < 1:
        return 1 + start
    return 1 + max(start - first_pass + 1, 1)


# ----------------------------------------------------------------------------- search


def _takes(probe: ProbeFn, name: str) -> bool:
    try:
        params = inspect.signature(probe).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass(frozen=True)
class Proof:
    """How the proof near the floor is judged (see PROOF_SAFE_SHARE): the safe
    hypothesis as a share of the allowance, the pass decisions whose false-pass rate it
    takes (a fraction: the search's remaining share), and its cap on arrivals."""

    safe_share: float
    looks: float
    max_duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _call(probe: ProbeFn, rate: float, n: int, repeat: int,
          prior: Prior = (), proof: Proof | None = None) -> ProbeResult:
    kwargs: dict[str, Any] = {}
    if repeat and _takes(probe, "repeat"):
        kwargs["repeat"] = repeat
    if prior and _takes(probe, "prior"):
        kwargs["prior"] = prior
    if proof is not None:
        kwargs["proof"] = proof
    return probe(rate, n, **kwargs)


def lent_evidence(probes: Sequence[Probe], rate: float, upto: float = math.inf
                  ) -> Prior:
    """Evidence for a pass at ``rate`` from every test of a config at a rate at or
    above it: latency grows with the rate, so their exceedances bound this rate's.
    Each lends its requests up to the moment its own evidence first leaned unsafe by a
    factor 4 (``ExceedanceTest.lent``: a stopping time, so the pooled test keeps its
    error rate), so a failed test above costs a little, not all its exceedances.
    Which tests pool is fixed by their rates alone (at most ``upto``), never by their
    outcomes; the search's pass decisions share the false-pass rate (``search_looks``)."""
    if not math.isfinite(rate):
        return ()
    return merge_prior([p.evidence.lent() for p in probes
                        if p.evidence is not None and p.phase not in UNCOUNTED
                        and math.isfinite(p.rate) and rate <= p.rate <= upto])


class _Search:
    """The mutable state of one search; ``find_ceiling`` drives it."""

    def __init__(self, probe: ProbeFn, slo: SLO, *, num_prompts: int, max_num_prompts: int,
                 max_probes: int, confidence: float,
                 on_probe: Callable[[Probe], None] | None,
                 proof_cap_s: float | None = None, unit: LoadUnit = RATE) -> None:
        self.probe = probe
        self.unit = unit
        self.slo = slo
        self.n = num_prompts
        self.max_n = max_num_prompts
        self.budget = max_probes
        self.confidence = confidence
        self.on_probe = on_probe
        self.probes: list[Probe] = []
        self.verdicts: dict[float, str] = {}  # final verdict per rate of the search
        self.cap_est: float | None = None  # service capacity seen by overloaded probes
        self.notes: list[str] = []
        self.source: str | None = None
        self.cut_at: float | None = None  # the rate whose test the budget cut short
        self.floor_checked = False
        # The lowest level whose test could pass within its time cap, when it stopped
        # the search's descent above min_rate.
        self.time_floor: float | None = None
        # The longest proof near the floor (None: none is run), and the one that ran.
        self.proof_cap_s = proof_cap_s
        self.proof: Proof | None = None

    @property
    def used(self) -> int:
        return sum(1 for p in self.probes if p.phase not in UNCOUNTED)

    @property
    def left(self) -> int:
        return self.budget - self.used

    def prior_for(self, rate: float, proof: bool = False) -> Prior:
        """What the search's tests lend a test at ``rate``; a proof pools only those up
        to PROOF_POOL times its rate."""
        return lent_evidence(self.probes, rate, rate * PROOF_POOL if proof else math.inf)

    def run_one(self, rate: float, n: int, phase: str, repeat: int = 0,
                note: str | None = None, proof: Proof | None = None,
                light: int = FLOOR_CONCURRENCY) -> Probe:
        prior = () if phase in UNCOUNTED else self.prior_for(rate, proof is not None)
        if phase == "floor":
            res = self.probe(rate, n, light=light)
        else:
            res = _call(self.probe, rate, n, repeat, prior, proof)
        s = res.summary
        if self.source is None:
            self.source = s.source
        checks = check_limits(s, self.slo, self.confidence)
        ev = res.evidence
        floor_fail: str | None = None
        if phase == "floor":
            floor_fail = floor_verdict(s, self.slo, light)
            verdict = "fail" if floor_fail else "pass"
            sent, backlog, slow = rate, False, False
            seen = res.completion_rate or s.request_throughput
            note = floor_fail or note
        elif ev is not None:
            checks = [LimitCheck(e.label, e.threshold_s, e.observed_s, e.upper_s, e.n)
                      for e in ev.limits] or checks
            verdict = "fail" if res.pruned else ev.verdict
            sent = ev.arrival_rate if ev.arrival_rate > 0 else rate
            backlog = ev.backlog_lower is not None and ev.backlog_lower > ev.backlog_allowed
            slow = ev.arrival_rate > 0 and ev.served_rate < OVERLOAD_SHARE * ev.arrival_rate
            seen = ev.served_rate
        else:
            verdict = verdict_of(checks, res.pruned)
            # Compare completions with the schedule's own arrival rate: a Poisson draw of
            # a few hundred arrivals is several percent off the offered rate.
            sent = s.achieved_send_rate if s.achieved_send_rate > 0 else rate
            backlog = res.pruned and "backlog" in (res.prune_reason or "")
            slow = (res.completion_rate is not None
                    and res.completion_rate < OVERLOAD_SHARE * sent)
            seen = (res.completion_rate if res.completion_rate is not None
                    else s.request_throughput)
        # A closed loop cannot overload: its users wait for the server.
        overloaded = bool(math.isfinite(rate) and not self.unit.whole and verdict != "pass"
                          and (backlog or slow))
        # The capacity in offered-rate units, the units every probe rate is in.
        capacity = seen * rate / sent if math.isfinite(rate) and sent > 0 else seen
        p = Probe(
            index=len(self.probes), rate=rate, num_prompts=n, phase=phase, verdict=verdict,
            checks=checks, binding=binding_of(checks, verdict),
            request_throughput=s.request_throughput, output_throughput=s.output_throughput,
            num_measured=s.num_measured, pruned=res.pruned, prune_reason=res.prune_reason,
            overloaded=overloaded, gpu_util=res.gpu_util, server_s=res.server_s,
            repeat=repeat, note=note, completion_rate=res.completion_rate,
            capacity_seen=capacity, summary=s, evidence=ev, pool_at=res.pool_at)
        self.probes.append(p)
        if self.on_probe is not None:
            self.on_probe(p)
        if res.budget_cut:
            self.cut_at = rate
        return p

    def stop_if_cut(self) -> None:
        """After a test the budget cut short, nothing more can run."""
        if self.cut_at is not None:
            raise BudgetSpent(f"the --budget ran out during the load test at "
                              f"{self.unit.fmt(self.cut_at)}, which was cut there")

    def check_floor(self) -> Probe | None:
        """Before the search halves its rate: once, a light-load test of whether any
        rate can meet the SLO (raises BelowFloor when none can); the test, when it ran
        now."""
        if self.floor_checked or not _takes(self.probe, "light"):
            return None
        self.floor_checked = True
        p = self.run_one(math.inf, FLOOR_REQUESTS, "floor",
                         note=f"light load: {_at_most(FLOOR_CONCURRENCY)}")
        self.stop_if_cut()
        if p.verdict == "fail" and FLOOR_CONCURRENCY > 1:
            # A server with few slots (--max-num-seqs 4) runs FLOOR_CONCURRENCY requests
            # as a full batch: its floor is one request at a time, which the search could
            # still reach, so only that test may say no load can meet the SLO.
            p = self.run_one(math.inf, FLOOR_REQUESTS, "floor", light=1,
                             note=f"light load: {_at_most(1)}")
            self.stop_if_cut()
        if p.verdict == "fail":
            raise BelowFloor(p.note or "the SLO is under the latency floor")
        return p

    def evaluate(self, rate: float, phase: str) -> str:
        """Run one rate (re-running with more requests while uncertain); its verdict."""
        p = self.run_one(rate, self.n, phase)
        while p.verdict == "uncertain" and self.n < self.max_n and self.left > 0:
            bad = ", ".join(f"{c.label} bound {format_seconds(c.bound_s)} > "
                            f"{format_seconds(c.threshold_s)}"
                            for c in p.checks if not c.bound_ok)
            new_n = min(2 * self.n, self.max_n)
            self.notes.append(
                f"at {self.unit.fmt(rate)} the SLO was met but not with "
                f"{self.confidence:.0%} confidence ({bad}): more requests needed; "
                f"re-ran with {new_n} instead of {self.n} requests")
            self.n = new_n
            p = self.run_one(rate, self.n, "more-requests",
                             note=f"more requests needed ({bad})")
        if p.verdict == "uncertain":
            self.notes.append(
                f"at {self.unit.fmt(rate)} the SLO was met but its {self.confidence:.0%} "
                f"bound was not, with {p.num_prompts} requests: not counted as passing "
                f"(more requests needed; raise max_num_prompts above {self.max_n})")
        if p.overloaded and p.capacity_seen > 0:
            est = p.capacity_seen
            self.cap_est = est if self.cap_est is None else min(self.cap_est, est)
        if p.passed and self.cap_est is not None and rate >= self.cap_est:
            self.cap_est = None  # the estimate was too low: forget it
        self.verdicts[rate] = p.verdict
        self.stop_if_cut()
        return p.verdict

    def proof_at(self, rate: float) -> Proof | None:
        """The proof to run at ``rate`` when its test ran to its cap undecided with
        every limit's share under the allowance, and the proof is expected to pass
        within the cap (None otherwise: the search steps down as before)."""
        if (self.proof_cap_s is None or self.left <= 0 or self.proof is not None
                or not _takes(self.probe, "proof")):
            return None
        last = self.last_at(rate)
        if last is None or last.verdict != "inconclusive" or last.overloaded \
                or self.cut_at is not None or last.evidence is None:
            return None
        # The remaining share of the search's false-pass rate: the proof is its last
        # pass decision, so the shares of all its decisions still sum to the whole.
        looks = self.budget / self.left
        pooled = {label: (n, k, d) for label, n, k, d in self.prior_for(rate, proof=True)}
        need = 0.0
        for limit in self.slo.limits:
            if limit.label not in pooled:
                return None
            n, k, d = pooled[limit.label]
            test = ExceedanceTest.for_percentile(
                limit.percentile, false_pass=(1.0 - self.confidence) / looks,
                safe_share=PROOF_SAFE_SHARE)
            share = (k + math.sqrt(max(k, 1) * d)) / n
            drift = test.llr(1.0, share)  # per request
            if k / n >= test.allowance or drift >= 0.0:
                return None
            need = max(need, (d * math.log(test.false_pass) - test.llr(n, k)) / drift)
        # Requests arrive at the level's rate, or at the rate a closed loop's users reached.
        per_s = rate if self.unit.by == "rate" else last.evidence.arrival_rate
        if not per_s > 0 or PROOF_MARGIN * need / per_s + horizon(self.slo) > self.proof_cap_s:
            return None
        return Proof(safe_share=PROOF_SAFE_SHARE, looks=looks,
                     max_duration_s=self.proof_cap_s)

    def last_at(self, rate: float) -> Probe | None:
        """The last test of the search itself at ``rate`` (saturation, floor and repeat
        tests left out)."""
        at = [p for p in self.probes if p.rate == rate and p.phase not in UNCOUNTED]
        return at[-1] if at else None

    def leans_pass(self, rate: float) -> bool:
        """The last test at ``rate`` ran to its cap undecided with every limit's share
        under half its allowance: the test was too short for how its latencies cluster,
        not near the floor, so a higher level may hold too."""
        last = self.last_at(rate)
        if last is None or last.verdict != "inconclusive" or last.overloaded:
            return False
        ev = last.evidence
        if ev is None or not ev.limits:
            return False
        return all(lim.n > 0 and lim.exceedance < 0.5 * _allowance(self.slo, lim.label)
                   for lim in ev.limits)

    def prove(self, rate: float, proof: Proof) -> None:
        """Run the proof at ``rate``; whatever it shows ends the search (it took the
        rest of the false-pass rate)."""
        self.proof = proof
        last = self.last_at(rate)
        if last is not None and self.leans_pass(rate):
            cluster = max(lim.dispersion for lim in last.evidence.limits)
            why = (f"with every limit's share under half its allowance, but with latencies "
                   f"that cluster (x{cluster:.2g}), so it needed more requests than its cap "
                   f"let it judge")
        else:
            why = "with every limit's share under its allowance but not under half of it"
        self.notes.append(
            f"near the latency floor: the test at {self.unit.fmt(rate)} ran to its cap "
            f"{why}; one "
            f"long test there (the proof, stopped when decided, at most "
            f"{format_seconds(proof.max_duration_s)} of arrivals) judged it against "
            f"{proof.safe_share:.0%} of the allowance instead of half, with the search's "
            f"remaining false-pass rate "
            f"({(1.0 - self.confidence) / proof.looks:.2%}), pooled with the tests up to "
            f"{PROOF_POOL:g}x its rate")
        p = self.run_one(rate, self.n, "proof", proof=proof,
                         note=f"safe at {proof.safe_share:.0%} of the allowance")
        self.verdicts[rate] = p.verdict
        self.stop_if_cut()

    def slack_at(self, rate: float) -> float | None:
        """Slack of the last probe at ``rate`` in the search (repeats excluded); None
        when unknown: a pruned probe, or one whose failures make the latency inf."""
        at = [p for p in self.probes if p.rate == rate and p.phase != "repeat"]
        if not at or at[-1].pruned or not at[-1].slack > 0:
            return None
        return at[-1].slack

    def lo(self) -> float | None:
        ok = [r for r, v in self.verdicts.items() if v == "pass"]
        return max(ok) if ok else None

    def hi(self) -> float | None:
        lo = self.lo()
        bad = [r for r, v in self.verdicts.items()
               if v != "pass" and (lo is None or r > lo)]
        return min(bad) if bad else None


def _validate(slo: SLO, start_rate: float | None, tol: float, max_probes: int,
              num_prompts: int, max_num_prompts: int, repeats: int, confidence: float,
              headroom: float, min_rate: float | None) -> None:
    if not slo.limits:
        raise CeilingError("the SLO has no limits: pass --slo-p99 10s or --slo LIMITS")
    if not (tol > 0 and tol < 1):
        raise CeilingError(f"tolerance must be between 0 and 1 (e.g. 0.03 for 3%), got {tol:g}")
    if start_rate is not None and not (start_rate > 0 and math.isfinite(start_rate)):
        raise CeilingError(
            f"start rate must be a finite number of req/s greater than 0, got {start_rate:g}")
    if min_rate is not None and not min_rate > 0:
        raise CeilingError(f"minimum rate must be greater than 0 req/s, got {min_rate:g}")
    if max_probes < 1:
        raise CeilingError(f"probe budget must be at least 1 load test, got {max_probes}")
    if num_prompts < 1:
        raise CeilingError(f"num_prompts must be at least 1, got {num_prompts}")
    if max_num_prompts < num_prompts:
        raise CeilingError(f"max_num_prompts ({max_num_prompts}) must be at least "
                           f"num_prompts ({num_prompts})")
    if repeats < 1:
        raise CeilingError(f"repeats must be at least 1 (1 = no re-runs), got {repeats}")
    if not 0 < confidence < 1:
        raise CeilingError(f"confidence must be between 0 and 1, got {confidence:g}")
    if not 0 <= headroom < 1:
        raise CeilingError(f"headroom must be in [0, 1) (e.g. 0.1 for 10%), got {headroom:g}")
    for limit in slo.limits:
        # The steady-state verdict's test of a limit needs an allowance under one half:
        # said before the first probe, not after it.
        try:
            limit_test(limit)
        except ValueError as exc:
            raise CeilingError(f"{limit.label}: a steady-state test cannot judge this "
                               f"percentile ({exc}); use P51 to P99.9") from None


def check_settings(slo: SLO, *, start_rate: float | None, tol: float = 0.03,
                   max_probes: int = 8, num_prompts: int = 300, max_num_prompts: int = 2400,
                   repeats: int = 1, confidence: float = 0.95, headroom: float = 0.10,
                   min_rate: float | None = None) -> int:
    """Raise ``CeilingError`` for settings ``find_ceiling`` cannot run with; return the
    fewest measured requests per probe the confidence bound needs."""
    _validate(slo, start_rate, tol, max_probes, num_prompts, max_num_prompts, repeats,
              confidence, headroom, min_rate)
    need = max(min_samples_for_bound(lim.percentile, confidence) for lim in slo.limits)
    if max_num_prompts < need:
        worst = max(slo.limits, key=lambda lim: lim.percentile)
        raise CeilingError(
            f"a {confidence:.0%} upper bound on {worst.label} needs at least {need} measured "
            f"requests per probe; raise max_num_prompts (now {max_num_prompts}) to {need}")
    return need


def find_ceiling(
    probe: ProbeFn,
    *,
    slo: SLO,
    start_rate: float | None,
    tol: float = 0.03,
    max_probes: int = 8,
    num_prompts: int = 300,
    max_num_prompts: int = 2400,
    repeats: int = 1,
    confidence: float = 0.95,
    headroom: float = 0.10,
    min_rate: float | None = None,
    max_rate: float | None = None,
    lowest_rate: float | None = None,
    first_must_pass: bool = False,
    then_down: bool = False,
    on_probe: Callable[[Probe], None] | None = None,
    proof_cap_s: float | None = None,
    unit: LoadUnit = RATE,
) -> CeilingResult:
    """Search the highest rate that meets ``slo`` with ``confidence``; see the module doc.

    ``first_must_pass`` (beat-the-incumbent): ``start_rate`` is what this config needs to
    beat the best one so far; failing there ends the search (``below_start``), or with
    ``then_down`` brackets downward (a search's trial replayed on its own).
    ``max_rate`` caps the bracket (the space's highest rate): a config that passes there
    is reported as sustaining at least it.

    ``start_rate=None``: one saturation probe first (every request at once, as vLLM's
    ``auto_tune.sh``), then 70% of its throughput.  ``max_probes`` counts every load
    test, re-runs with more requests included; ``repeats - 1`` re-runs of each
    boundary come on top.  Halving stops at ``min_rate`` (default start / 32) and at
    ``lowest_rate`` (SteadyState.lowest_rate: a lower rate's test cannot pass in its
    time cap).  Before halving, a light-load test (a probe that takes ``light``) may
    end the search ``below_floor``.  A pass may pool the tests at higher rates
    (``_Search.prior_for``).  ``on_probe`` sees each probe as it ends.  ``proof_cap_s``
    (None: never): near the latency floor, one long test of at most this many seconds
    may decide a rate that ran to its cap undecided (``PROOF_SAFE_SHARE``).  ``unit``:
    what the levels count (``load_unit``): users are whole, start from the saturation
    and light-load tests by Little's law, and have no step-down comparison.
    """
    need = check_settings(slo, start_rate=start_rate, tol=tol, max_probes=max_probes,
                          num_prompts=num_prompts, max_num_prompts=max_num_prompts,
                          repeats=repeats, confidence=confidence, headroom=headroom,
                          min_rate=min_rate)
    search = _Search(probe, slo, num_prompts=max(num_prompts, need),
                     max_num_prompts=max_num_prompts, max_probes=max_probes,
                     confidence=confidence, on_probe=on_probe, proof_cap_s=proof_cap_s,
                     unit=unit)
    if num_prompts < need:
        search.notes.append(
            f"num_prompts raised from {num_prompts} to {need}: a {confidence:.0%} bound on "
            f"the SLO's percentile needs at least {need} measured requests")
    run = _run_search(search, start_rate=start_rate, tol=tol, repeats=repeats,
                      min_rate=min_rate, max_rate=max_rate, lowest_rate=lowest_rate,
                      first_must_pass=first_must_pass, then_down=then_down)

    lo, hi = search.lo(), search.hi()
    converged = _bracket_notes(search, lo, hi, tol=tol, max_probes=max_probes,
                               below_floor=run.below_floor)
    binding = _binding(search, hi)
    saturated, saturated_how = _saturation(search, run)
    # vLLM's auto_tune.sh steps down in req/s: a comparison for rates only.
    stepdown = (stepdown_probe_count(saturated, lo)
                if saturated is not None and lo is not None and unit.by == "rate" else None)

    return CeilingResult(
        slo=slo, confidence=confidence, tol=tol, headroom=headroom,
        source=search.source or "unknown", feasible=lo is not None,
        feasible_max=lo, infeasible_min=hi, converged=converged, binding=binding,
        probes=search.probes, search_probes=search.used,
        saturated_throughput=saturated, saturated_how=saturated_how,
        stepdown_probes=stepdown,
        stepdown_rate=(stepdown_rate(saturated, lo)
                       if saturated is not None and lo is not None and unit.by == "rate"
                       else None),
        spread=run.spread, notes=search.notes, below_start=run.below_start,
        budget_spent=run.budget_spent, below_floor=run.below_floor, proof=search.proof,
        unit=unit, time_floor=search.time_floor)


@dataclass(frozen=True)
class _Run:
    """How the rate search itself ended, which the result reports whether it ran to
    the end or was stopped (under the floor, out of budget)."""

    saturated: float | None
    saturated_how: str | None
    below_start: bool
    budget_spent: bool
    below_floor: bool
    spread: list[Spread]


def _run_search(search: _Search, *, start_rate: float | None, tol: float, repeats: int,
                min_rate: float | None, max_rate: float | None, lowest_rate: float | None,
                first_must_pass: bool, then_down: bool) -> _Run:
    """The probes of the search, from its starting rate to the closed bracket and its
    repeats; a search stopped by the floor or the budget keeps what its tests so far
    support, with the reason among the notes."""
    saturated: float | None = None
    saturated_how: str | None = None
    below_start = budget_spent = below_floor = False
    spread: list[Spread] = []
    try:
        if start_rate is None:
            # Its only use is a starting rate: a few hundred requests at once measure the
            # service rate; the whole (time-sized) request count would make a real server
            # drain minutes of work before the search even starts.
            sat = search.run_one(math.inf, min(search.n, SATURATION_REQUESTS), "saturation",
                                 note="every request at once: measures saturated throughput")
            saturated = sat.completion_rate or sat.request_throughput
            saturated_how = "served at rate inf"
            search.stop_if_cut()
            if not saturated > 0:
                raise CeilingError(
                    "the saturation probe completed no request: check the server")
            search.cap_est = search.unit.capacity(saturated)
            service = _service_s(sat)
            if search.unit.whole:
                # A user's cycle is its think time and its request's latency, which at
                # light load the floor test measures (a token's time times the output
                # length misses the first token's, which can be most of it).
                floor = search.check_floor()
                if floor is not None and floor.summary is not None and math.isfinite(
                        floor.summary.e2e.p50):
                    service = max(service, floor.summary.e2e.p50)
            start_rate = search.unit.start(saturated, service)
            if lowest_rate is not None:
                lowest_rate = search.unit.level_of_rate(lowest_rate, service)
        floor_rate = _floor_rate(search, start_rate, min_rate, lowest_rate)
        if max_rate is not None:
            start_rate = min(start_rate, max_rate)
        start_rate = search.unit.at(max(start_rate, floor_rate))

        if first_must_pass:
            if search.evaluate(start_rate, "incumbent") == "pass":
                _bracket(search, start_rate, floor_rate, tol, max_rate=max_rate, started=True)
            elif then_down:
                _bracket(search, start_rate, floor_rate, tol, max_rate=max_rate, failed=True)
            else:
                below_start = True
        else:
            _bracket(search, start_rate, floor_rate, tol, max_rate=max_rate)
        _bisect(search, tol)
        spread = _repeat_boundaries(search, repeats) if not below_start else []
    except BelowFloor as exc:
        below_floor = True
        search.notes.append(str(exc))
    except BudgetSpent as exc:
        # What the tests so far support stands; an incumbent test cut short proves
        # nothing either way, so the config is not called below the incumbent.
        budget_spent = True
        below_start = (first_must_pass and not then_down and start_rate is not None
                       and search.verdicts.get(start_rate) == "fail")
        search.notes.append(str(exc))
    return _Run(saturated, saturated_how, below_start, budget_spent, below_floor, spread)


def _service_s(sat: Probe) -> float:
    """How long a request takes at the saturated server's batch, its queue left out:
    the median time per output token times the mean output length."""
    s = sat.summary
    if s is None or not s.num_completed or not math.isfinite(s.tpot.p50):
        return 0.0
    return s.tpot.p50 * s.total_output_tokens / s.num_completed


def _floor_rate(search: _Search, start_rate: float, min_rate: float | None,
                lowest_rate: float | None) -> float:
    """Where halving stops: ``min_rate`` (default start / 32; one user), raised to the
    lowest rate whose test can still pass within its time cap, with a note saying why."""
    floor_rate = min_rate if min_rate is not None else start_rate / 32.0
    if search.unit.whole:
        floor_rate = max(floor_rate, 1.0)
        if lowest_rate is not None and math.isfinite(lowest_rate):
            lowest_rate = math.ceil(lowest_rate - 1e-9)  # whole users, enough of them
    if lowest_rate is not None and not math.isfinite(lowest_rate):
        search.notes.append(
            "no test can pass within its time cap (--max-duration): the cap ends "
            "before the requests a pass needs are judged; every test will end "
            "inconclusive, which the ceiling counts as a fail")
    elif lowest_rate is not None and lowest_rate > floor_rate:
        floor_rate = search.time_floor = lowest_rate
        search.notes.append(
            f"no {search.unit.noun} under {search.unit.fmt(lowest_rate)} is planned: its "
            "test could not gather the requests a pass needs within its time cap "
            "(--max-duration)")
    return floor_rate


def _bracket_notes(search: _Search, lo: float | None, hi: float | None, *, tol: float,
                   max_probes: int, below_floor: bool) -> bool:
    """Whether the bracket closed within ``tol``; when it did not, or no rate passed,
    the notes say why, so an open answer is never read as a converged one."""
    if lo is None and not below_floor:
        # The test the budget cut (the last) says nothing of the floor: its note says why.
        search.notes.extend(zone_notes(search.probes[:-1] if search.cut_at is not None
                                       else search.probes, search.slo, search.unit))
    converged = lo is not None and hi is not None and search.unit.closed_bracket(lo, hi, tol)
    if lo is not None and hi is not None and not converged and search.proof is not None:
        search.notes.append(
            f"coarse: the proof took the search's last pass decision, so the bracket "
            f"stays open: the ceiling lies between {_rate(lo)} and {search.unit.fmt(hi)} "
            f"({hi / lo - 1:.1%} apart, tol {tol:.1%})")
    elif lo is not None and hi is not None and not converged:
        search.notes.append(
            f"probe budget ({max_probes}) spent before the bracket closed: the ceiling lies "
            f"between {_rate(lo)} and {search.unit.fmt(hi)} ({hi / lo - 1:.1%} apart, tol "
            f"{tol:.1%}); raise max_probes for a tighter answer")
    return converged


def _saturation(search: _Search, run: _Run) -> tuple[float | None, str | None]:
    """The saturated throughput and how it was found: the saturation probe's, else the
    most that overloaded probes served (what the step-down estimate needs)."""
    saturated, saturated_how = run.saturated, run.saturated_how
    if saturated is None:
        over = [p.capacity_seen for p in search.probes if p.overloaded]
        if over:
            saturated, saturated_how = max(over), "estimated from overloaded probes"
    return saturated, saturated_how


def zone_notes(probes: Sequence[Probe], slo: SLO, unit: LoadUnit = RATE) -> list[str]:
    """Why no rate passed although none clearly failed: the tests that ran to their
    cap undecided show a share over the limit between half the allowance and the
    allowance (the sequential test's indifference zone) at every rate, i.e. the SLO
    sits at the config's latency floor.  Says which limit could be shown instead."""
    undecided = [p for p in probes if p.phase not in UNCOUNTED and p.evidence is not None
                 and p.verdict == "inconclusive" and p.summary is not None]
    out = []
    for limit in slo.limits:
        evs = [lim for p in undecided for lim in p.evidence.limits if lim.label == limit.label]
        n, k = sum(e.n for e in evs), sum(e.exceed for e in evs)
        allowance = 1.0 - limit.percentile / 100.0
        if not n or k / n >= allowance:
            continue
        if k / n < allowance / 2:
            # Under the safe share, yet undecided: the tests were too short for how
            # their latencies cluster (or were cut), not at the config's floor.
            d = max(e.dispersion for e in evs)
            rates = ", ".join(_rate(p.rate) for p in undecided)
            out.append(f"{limit.label}: {k} of {n} requests ({k / n:.2%}) exceeded "
                       f"{format_seconds(limit.threshold_s)} in the tests that ran to "
                       f"their cap undecided ({rates} {unit.label}): "
                       f"under half the allowance ({allowance / 2:.1%}), but their latencies "
                       f"cluster (x{d:.2g}), so a pass needs about {d:.2g} times the "
                       "requests of independent ones: raise --max-duration")
            continue
        values = np.concatenate([np.asarray(s.samples.get(limit.metric, ()), float)
                                 for p in undecided if (s := p.summary) is not None])
        tight = quantile(values, 100.0 - 40.0 * allowance) if values.size else math.nan
        out.append(
            f"{limit.label}: {k} of {n} requests ({k / n:.2%}) exceeded "
            f"{format_seconds(limit.threshold_s)} in the tests that ran to their cap "
            f"undecided ({', '.join(_rate(p.rate) for p in undecided)} {unit.label}): "
            "between half "
            f"the allowance ({allowance / 2:.1%}) and the allowance ({allowance:.1%}), where "
            "a test needs many thousands of requests to decide.  The SLO sits at this "
            "config's latency floor: it may hold, but cannot be shown with 95% confidence "
            f"in tests this long.  A limit of {format_seconds(tight)} (exceeded by "
            f"{0.4 * allowance:.1%} of these requests) could be shown, or raise "
            "--max-duration")
    return out


def _bracket(search: _Search, start: float, floor_rate: float, tol: float, *,
             max_rate: float | None = None, started: bool = False,
             failed: bool = False) -> None:
    """x2 up while passing (not past a known capacity or ``max_rate``), /2 down while
    failing.  ``started``: ``start`` already passed; ``failed``: it already did not."""
    if search.left <= 0:
        return
    rate = start
    first_step = started
    rising = started
    if not failed and not started:
        rate, verdict = _climb(search, rate, search.evaluate(rate, "bracket"),
                               max_rate=max_rate)
        rising = verdict == "pass"
    if rising:
        while search.left > 0:
            if max_rate is not None and rate >= max_rate * (1.0 - 1e-9):
                return
            # From the incumbent's rate, first ask whether this config beats it by more
            # than the tolerance: a tie then costs two probes, not a whole bracket.
            nxt = rate * (1.0 + tol) if first_step else 2.0 * rate
            first_step = False
            guess = _extrapolate(search, rate, tol)
            if guess is not None:
                nxt = min(nxt, guess)
            cap = search.cap_est
            if cap is not None and cap > rate * (1.0 + tol):
                nxt = min(nxt, cap)
            if max_rate is not None:
                nxt = min(nxt, max_rate)
            rate = search.unit.up(rate, nxt)
            if search.evaluate(rate, "bracket") != "pass":
                return
    else:
        if not search.leans_pass(rate):
            search.check_floor()
        while search.left > 0:
            proof = search.proof_at(rate)
            if proof is not None:
                search.prove(rate, proof)
                return
            nxt = rate * _down_factor(search, rate)
            cap = search.cap_est
            if cap is not None and cap < nxt:
                nxt = cap  # an overloaded probe showed the capacity: the ceiling is below
            if nxt < floor_rate * (1.0 - 1e-9):
                if rate <= floor_rate * (1.0 + 1e-9):
                    return
                nxt = floor_rate
            rate = search.unit.down(rate, nxt)
            if search.evaluate(rate, "bracket") == "pass":
                return


def _climb(search: _Search, rate: float, verdict: str, *,
           max_rate: float | None) -> tuple[float, str]:
    """From a first test that ran to its cap undecided but leaning to pass (every share
    under half its allowance), go up while the tests keep passing or leaning: such a
    test says its time cap was short for the clustering, not that the ceiling is below,
    and proving it at once would end the search there.  The level to go on from and its
    verdict: the first that passed, else the highest that leaned (proved next)."""
    while (verdict == "inconclusive" and search.leans_pass(rate) and search.left > 0
           and (max_rate is None or rate < max_rate * (1.0 - 1e-9))):
        nxt = 2.0 * rate
        cap = search.cap_est
        if cap is not None:
            if cap <= rate * (1.0 + 1e-9):
                break  # the saturated throughput: no higher rate can hold
            nxt = min(nxt, cap)
        if max_rate is not None:
            nxt = min(nxt, max_rate)
        nxt = search.unit.up(rate, nxt)
        seen = search.evaluate(nxt, "bracket")
        if seen == "pass" or (seen == "inconclusive" and search.leans_pass(nxt)):
            rate, verdict = nxt, seen
            continue
        break
    return rate, verdict


def _down_factor(search: _Search, rate: float) -> float:
    """How far below a rate that did not pass to try next.  A test that ran to its cap
    undecided, its exceedance under the allowance, or one that failed by little, says
    the ceiling is close below: a short step keeps the bracket tight, and the next
    test pools this one's evidence.  A clear fail halves the rate."""
    last = search.last_at(rate)
    ev = last.evidence if last is not None else None
    if last is None or ev is None or last.overloaded or not ev.limits:
        return 0.5
    worst = max((lim.exceedance / _allowance(search.slo, lim.label)
                 for lim in ev.limits if lim.n), default=math.inf)
    if last.verdict == "inconclusive" and worst < 1.0:
        return 0.85
    return 0.7 if worst <= 2.0 else 0.5


def _allowance(slo: SLO, label: str) -> float:
    """The share of requests the limit ``label`` lets over it (1% for a P99)."""
    return 1.0 - next(lim.percentile for lim in slo.limits if lim.label == label) / 100.0


def _bisect(search: _Search, tol: float) -> None:
    """Shrink [feasible_max, infeasible_min] to within ``tol``.

    Each step aims where the line through the two ends' slack crosses 1 (a queue's
    1/latency falls about linearly with rate), a little on the passing side, so a good
    aim closes the bracket in two probes.  When the same end moves twice in a row, the
    other end's slack is halved (the Illinois rule of regula falsi) so the aims cannot
    creep; three in a row, or no usable slack, fall back to plain bisection.
    """
    # The bracket ended on a failure: the failing end moved last.
    last: str | None = "hi" if search.probes and not search.probes[-1].passed else None
    run = 1 if last else 0
    weight = {"lo": 1.0, "hi": 1.0}
    while search.left > 0 and search.proof is None:
        lo, hi = search.lo(), search.hi()
        if lo is None or hi is None or search.unit.closed_bracket(lo, hi, tol):
            return
        mid = 0.5 * (lo + hi)
        cap = search.cap_est
        aim: float | None = None
        if hi / lo - 1.0 <= 2.0 * tol:
            aim = mid  # either half is within tol: one probe closes the bracket
        elif cap is not None and lo * (1.0 + tol) < cap < mid:
            aim = cap  # a capacity seen inside the bracket: the ceiling lies below it
        elif run < 3:
            aim = _interpolate(search, lo, hi, tol, weight["lo"], weight["hi"])
        if aim is None:
            aim, run = mid, 0
        aim = search.unit.between(aim, lo, hi)
        moved = "lo" if search.evaluate(aim, "bisect") == "pass" else "hi"
        if moved == last:
            run += 1
            weight["hi" if moved == "lo" else "lo"] *= 0.5
        else:
            run, weight = 1, {"lo": 1.0, "hi": 1.0}
        last = moved


def _interpolate(search: _Search, lo: float, hi: float, tol: float, w_lo: float = 1.0,
                 w_hi: float = 1.0) -> float | None:
    """Where slack crosses 1: regula falsi between the bracket's ends when the failing
    end has a finite slack; otherwise (pruned, or failures made it infinite) the secant
    through the two highest passing probes.  Aimed a little on the passing side."""
    s_lo, s_hi = search.slack_at(lo), search.slack_at(hi)
    if s_lo is None or not s_lo >= 1.0 or math.isinf(s_lo):
        return None
    if s_hi is not None and s_hi < 1.0:
        f_lo, f_hi = (s_lo - 1.0) * w_lo, (s_hi - 1.0) * w_hi
        root = lo + (hi - lo) * f_lo / (f_lo - f_hi)
    else:
        ok = sorted(r for r, v in search.verdicts.items() if v == "pass")
        if len(ok) < 2:
            return None
        s1 = search.slack_at(ok[-2])
        # Two passing rates close together give a slope of noise: bisect instead.
        if s1 is None or not s1 > s_lo or lo / ok[-2] - 1.0 < 4.0 * tol:
            return None
        # Illinois again: the failing end kept moving, so step shorter from lo.
        # Latency bends up near capacity, so the passing side's secant overshoots the
        # root: aim part of the way there.
        reach = (s_lo - 1.0) * (lo - ok[-2]) / (s1 - s_lo)
        if lo + reach >= hi:
            return None  # the line misses the failing end: it says nothing here
        # Illinois both ways: a passing end that keeps moving steps further.
        root = lo + min(1.0, SECANT_SHARE * w_lo / w_hi) * reach
    aim = root * (1.0 - 0.5 * tol)
    return min(max(aim, lo * (1.0 + tol)), hi / (1.0 + tol))


def _extrapolate(search: _Search, rate: float, tol: float) -> float | None:
    """Going up: where the line through the two highest passing probes' slack
    crosses 1, a little past it (so the next probe likely fails close above)."""
    ok = sorted(r for r, v in search.verdicts.items() if v == "pass")
    if len(ok) < 2:
        return None
    r1, r2 = ok[-2], ok[-1]
    s1, s2 = search.slack_at(r1), search.slack_at(r2)
    if s1 is None or s2 is None or not s1 > s2 >= 1.0 or math.isinf(s1):
        return None  # flat latency (low load) says nothing about where it turns
    root = r2 + (s2 - 1.0) * (r2 - r1) / (s1 - s2)
    if root <= rate * (1.0 + tol):
        return None
    return root


def _repeat_boundaries(search: _Search, repeats: int) -> list[Spread]:
    """Re-run feasible_max and infeasible_min; a feasible_max that fails a repeat is
    demoted (it met the SLO by luck) and the next lower passing rate is repeated."""
    if repeats <= 1 or search.proof is not None:
        return []
    spreads: list[Spread] = []
    done: set[float] = set()
    while True:
        lo = search.lo()
        if lo is None or lo in done:
            break
        done.add(lo)
        runs = [search.run_one(lo, search.n, "repeat", repeat=k) for k in range(1, repeats)]
        spreads.append(_spread(search, lo))
        if all(r.passed for r in runs):
            break
        search.verdicts[lo] = "fail"
        search.notes.append(
            f"{search.unit.fmt(lo)} passed once but failed {sum(not r.passed for r in runs)} of "
            f"{repeats - 1} repeats: not counted as feasible")
    hi = search.hi()
    if hi is not None and hi not in done:
        for k in range(1, repeats):
            search.run_one(hi, search.n, "repeat", repeat=k)
        spreads.append(_spread(search, hi))
    return spreads


def _spread(search: _Search, rate: float) -> Spread:
    at = [p for p in search.probes if p.rate == rate and p.num_prompts == search.n]
    if not at:
        at = [p for p in search.probes if p.rate == rate]
    label = _binding(search, search.hi()) or search.slo.limits[0].label
    obs = [c.observed_s for p in at if (c := p.check(label)) is not None]
    bnd = [c.bound_s for p in at if (c := p.check(label)) is not None]
    thr = [p.request_throughput for p in at]
    return Spread(rate=rate, label=label, runs=len(at), passes=sum(p.passed for p in at),
                  observed_min_s=min(obs), observed_max_s=max(obs), bound_min_s=min(bnd),
                  bound_max_s=max(bnd), throughput_min=min(thr), throughput_max=max(thr))


def _binding(search: _Search, hi: float | None) -> str | None:
    """Which limit failed first: the binding limit of the lowest failing rate."""
    if hi is None:
        failing = [p for p in search.probes if not p.passed]
        return failing[-1].binding if failing else (
            search.probes[-1].binding if search.probes else None)
    at = [p for p in search.probes if p.rate == hi and not p.passed]
    return at[-1].binding if at else None


# ----------------------------------------------------------------------------- probes


class BackendProbe:
    """A probe on a ``Backend`` (simulator or a running server), reusing
    ``trial.probe``: warm-up, measured window, overload pruner, summary.

    ``pool`` holds the requests; a probe of ``n`` takes ``warmup`` of them for warm-up
    and the next ``n`` as measured requests (cycling when the pool is short).  A test
    sized by time takes its measured requests where the previous one stopped, with an
    arrival seed of its own: the tests of a search judge different requests, so that
    one test's evidence can count toward another's (``prior``) as independent data,
    and a pool's few longest replies are not judged again at every rate.  Fixed-count
    tests get the same seed and requests at every rate; ``repeat=k`` draws a new seed
    and a new order.  On a real server, ``drain`` waits between probes until
    ``/metrics`` shows nothing running or waiting, so no backlog carries over; the
    server is never restarted between probes.
    """

    def __init__(self, backend: Any, flags: Mapping[str, Any], slo: SLO,
                 pool: Sequence[Request], *, warmup: int = 50, seed: int = 0,
                 prune: bool = True, window_s: float = 1.0,
                 request_timeout_s: float = 600.0, drain: bool = True,
                 drain_timeout_s: float = 600.0, steady: Any = None,
                 deadline_s: float | None = None,
                 on_evidence: Callable[[float, Any], None] | None = None,
                 unit: LoadUnit = RATE, fresh: bool = False) -> None:
        if not pool:
            raise CeilingError("the workload is empty: no requests to probe with")
        self.backend = backend
        self.flags = dict(flags)
        self.slo = slo
        self.pool = list(pool)
        self.warmup = warmup
        self.seed = seed
        self.prune = prune
        self.window_s = window_s
        self.request_timeout_s = request_timeout_s
        self.drain = drain and getattr(backend, "mode", "virtual") == "real"
        self.drain_timeout_s = drain_timeout_s
        self.drain_s = 0.0  # total seconds spent draining
        self.drain_note: str | None = None
        self.results: list[Any] = []  # every TrialResult, for callers that want records
        # Where the next test sized by time starts in the pool, and how many ran.
        self.cursor = 0
        self.timed_tests = 0
        # Each result's (cursor, test) as ``plan``'s ``at`` replays it (None: not sized
        # by time), beside ``results``.
        self.pool_ats: list[tuple[int, int] | None] = []
        # autotune.tuning.verdict.SteadyState: each finite-rate probe is sized by time and
        # judged on steady-state evidence; None: ``n`` measured requests.
        self.steady = steady
        # When the server-time budget ends, on the backend's ``server_s`` clock: no test
        # starts after it, and a test sized by time is cut there.
        self.deadline_s = deadline_s
        # Sees (rate, Evidence) at each judgement of a running test (progress lines).
        self.on_evidence = on_evidence
        # What a finite level counts: req/s, or users of a closed loop.  The saturation
        # and light-load tests stay open loop whatever it is.
        self.unit = unit
        # The saturation test's throughput, once it ran: a closed loop's users complete
        # no faster than a few times it, which sizes their tests.
        self.saturated_rps: float | None = None
        # Fixed-count tests at a rate take requests no earlier test sent, as tests sized
        # by time do (False: the same ones at every rate, for what-if comparisons): a
        # server with prefix caching, vLLM's default, serves a resent prompt from its
        # cache, which a replay of the test would not see.
        self.fresh = fresh

    @classmethod
    def for_plan(cls, backend: Any, flags: Mapping[str, Any], plan: LoadPlan, *,
                 steady: Any, deadline_s: float | None = None,
                 unit: LoadUnit = RATE) -> BackendProbe:
        """A probe over ``plan``'s whole pool (its warm-up requests first) with the
        plan's SLO, warm-up, seed, window and request timeout; ``steady``: the verdict
        rule its tests sized by time use (a search's is ``search_steady`` of the
        plan's)."""
        return cls(backend, flags, plan.slo, [*plan.warmup_requests, *plan.requests],
                   warmup=plan.warmup, seed=plan.seed, window_s=plan.window_s,
                   request_timeout_s=plan.request_timeout_s, steady=steady,
                   deadline_s=deadline_s, unit=unit)

    def _from_cursor(self, rate: float) -> bool:
        """Whether a fixed-count test at ``rate`` takes its requests from the cursor:
        the saturation test always, the others when ``fresh``."""
        return math.isinf(rate) or self.fresh

    def _fresh(self, n: int, order: Sequence[int], cursor: int) -> list[Request]:
        """``n`` measured requests from ``cursor`` on, past the warm-up ones: a server
        with prefix caching must not see a test's prompts again in a later test (the
        first bracketing test re-sent the saturation test's, whose prompts a real vLLM
        had cached)."""
        start = self.warmup + cursor
        return [self.pool[order[(start + i) % len(order)]] for i in range(n)]

    def light_plan(self, n: int, at: Sequence[int] | None = None,
                   in_flight: int = FLOOR_CONCURRENCY) -> Any:
        """The floor test: ``n`` requests, at most ``in_flight`` in flight, after a
        short warm-up; judged on its samples, not on a steady-state verdict."""
        warm = [self.pool[i % len(self.pool)] for i in range(in_flight)]
        cursor = self.cursor if at is None else at[0]
        return LoadPlan(slo=self.slo, requests=self._fresh(n, range(len(self.pool)), cursor),
                        warmup_requests=warm, warmup=in_flight,
                        seed=self.seed, window_s=self.window_s,
                        request_timeout_s=self.request_timeout_s,
                        max_concurrency=in_flight)

    def plan(self, n: int, repeat: int = 0, rate: float = math.inf,
             at: Sequence[int] | None = None) -> Any:
        """The load plan of the next test; ``at`` (a Probe's ``pool_at``: where in the
        pool it started, and which timed test it was) replays an earlier one."""
        order = list(range(len(self.pool)))
        if repeat:
            order = np.random.default_rng([self.seed, repeat]).permutation(order).tolist()
        picks = [self.pool[order[i % len(order)]] for i in range(self.warmup + n)]
        seed = self.seed + 7919 * repeat
        cursor, tests = (self.cursor, self.timed_tests) if at is None else at
        if self.steady is not None and math.isfinite(rate):
            # Sized by time: the whole pool from where the last test stopped, cycled as
            # far as the test runs.
            measured = self._fresh(len(order), order, cursor)
            seed += 104729 * tests
        elif self._from_cursor(rate):  # on requests no other test sends
            measured = self._fresh(n, order, cursor)
        else:
            measured = picks[self.warmup:]
        if self.unit.by == "speed" and math.isfinite(rate):
            # A trace is replayed whole and in order, its first requests the warm-up.
            w = min(self.warmup, len(self.pool) - 1)
            return LoadPlan(slo=self.slo, requests=self.pool[w:],
                            warmup_requests=self.pool[:w], warmup=w, process="trace",
                            seed=seed, window_s=self.window_s,
                            request_timeout_s=self.request_timeout_s, steady=self.steady)
        return LoadPlan(slo=self.slo, requests=measured,
                        warmup_requests=picks[: self.warmup], warmup=self.warmup,
                        seed=seed, window_s=self.window_s,
                        request_timeout_s=self.request_timeout_s,
                        steady=self.steady if math.isfinite(rate) else None,
                        closed=self.unit.closed if math.isfinite(rate) else None,
                        closed_rate_cap=closed_rate_cap(self.saturated_rps))

    def __call__(self, rate: float, n: int, *, repeat: int = 0,
                 prior: Prior = (), light: int = 0,
                 proof: Proof | None = None) -> ProbeResult:
        """One load test at ``rate``; ``light``: the floor test, at most that many in
        flight."""
        before = float(getattr(self.backend, "server_s", 0.0))
        plan = self.light_plan(n, in_flight=light) if light else self.plan(n, repeat, rate)
        if prior and plan.steady is not None:
            plan = dataclasses.replace(plan, steady=dataclasses.replace(plan.steady,
                                                                        prior=prior))
        if proof is not None and plan.steady is not None:
            plan = dataclasses.replace(plan, steady=dataclasses.replace(
                plan.steady, safe_share=proof.safe_share, looks=proof.looks,
                max_duration_s=proof.max_duration_s))
        if self.deadline_s is not None:
            left = self.deadline_s - before
            if left <= 0:
                raise BudgetSpent(f"the --budget ran out before the load test at "
                                  f"{self.unit.fmt(rate)}")
            plan = dataclasses.replace(plan, deadline_s=self.deadline_s)
        # The saturation probe sends everything at once: nothing to prune.
        seen = self.on_evidence
        result = probe(self.backend, self.flags, rate, plan,
                       prune=self.prune and math.isfinite(rate) and not light,
                       on_evidence=None if seen is None else (lambda ev: seen(rate, ev)))
        self.results.append(result)
        # Where in the pool this test started; every test moves the cursor past what it
        # sent, so none sends another's requests again.
        pool_at: tuple[int, int] | None = (self.cursor, self.timed_tests)
        if plan.steady is not None and not light:
            self.timed_tests += 1
        elif not (light or self._from_cursor(rate)):
            pool_at = None  # a test of fixed requests: ``picks``, not the cursor
        self.cursor += sum(1 for r in result.records if not r.warmup and r.sent_s is not None)
        self.pool_ats.append(pool_at)
        if math.isinf(rate) and not light and result.summary is not None:
            self.saturated_rps = (completion_rate(result.records) or busy_rate(result.records)
                                  or result.summary.request_throughput)
        if result.summary is None or result.reason == "crashed":
            raise CeilingError(
                f"the probe at {self.unit.fmt(rate)} could not run "
                f"({result.reason}): {result.detail}")
        waited = self._drain()
        server_s = float(getattr(self.backend, "server_s", 0.0)) - before + waited
        util = result.gpu_util()
        pruned = result.status == PRUNED
        return ProbeResult(
            summary=result.summary, pruned=pruned,
            prune_reason=f"{result.reason}: {result.detail}" if pruned else None,
            gpu_util=None if util is None else util / 100.0, server_s=server_s,
            completion_rate=(completion_rate(result.records) if math.isfinite(rate)
                             else busy_rate(result.records)), evidence=result.evidence,
            budget_cut=result.budget_cut, pool_at=pool_at)

    def _drain(self) -> float:
        if not self.drain:
            return 0.0
        url = self.backend.server.endpoint
        report = getattr(self.backend, "exit_report", None)
        try:
            # A server that dies as its test ends (the load test saw it alive a moment
            # before) would otherwise be polled until the drain timeout.
            waited = wait_idle(url, timeout_s=self.drain_timeout_s,
                               alive=None if report is None else (lambda: report() is None))
        except TelemetryError as exc:
            gone = None if report is None else report()
            if gone is not None:
                last = self.results[-1]
                last.status, last.reason, last.detail = INFEASIBLE, "crashed", gone
                raise CeilingError(f"the server exited after the probe: {gone}") from None
            # No vLLM /metrics (some OpenAI-compatible servers): the load generator
            # already waited for or cancelled every request it sent.
            self.drain, self.drain_note = False, f"no drain check: {exc}"
            return 0.0
        except TimeoutError as exc:
            raise CeilingError(f"the server did not drain between probes: {exc}") from None
        self.drain_s += waited
        return waited
