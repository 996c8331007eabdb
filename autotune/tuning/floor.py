"""The SLO floor: the latency a server shows when it keeps up with the load (pure).

Lowering the request rate only removes queueing.  A reply of N tokens still takes about
TTFT + (N - 1) x TPOT, so with ShareGPT's longest replies a P99 end-to-end limit can
sit under what any rate reaches: every config then fails, and "lower the rate" is the
wrong advice.  The evidence is direct: the lightest load each config was tested at, where
it served every arrival with no growing backlog (so the latency there is not queueing),
still missed the limit.  :func:`floors` finds such limits from those tests;
:func:`advice` says what could reach them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autotune.core.slo import SLO
from autotune.tuning.verdict import SteadyState

# A test "kept up" when it served the share of its arrivals that a steady-state pass
# needs over its steady part (the verdict's own default, not a second constant).
KEPT_UP = SteadyState.served_share


@dataclass(frozen=True, kw_only=True)
class LightTest:
    """A config's lowest-rate load test, as its steady-state evidence tells it."""

    trial: int
    rate: float
    observed_s: Mapping[str, float]  # limit label -> percentile observed
    kept_up: bool  # served >= 97% of arrivals and the backlog was not growing

    @classmethod
    def of(cls, trial: int, rate: float | None, evidence: Mapping[str, object]
           ) -> LightTest | None:
        """From a stored test's evidence (``Evidence.to_dict()``); None without one."""
        limits = evidence.get("limits")
        if rate is None or not isinstance(limits, list):
            return None
        observed = {str(lim["label"]): float(lim["observed_s"]) for lim in limits
                    if isinstance(lim, Mapping) and lim.get("observed_s") is not None}
        share = evidence.get("served_share")
        lower, allowed = evidence.get("backlog_lower"), evidence.get("backlog_allowed")
        growing = (isinstance(lower, int | float) and isinstance(allowed, int | float)
                   and lower > allowed)
        kept = isinstance(share, int | float) and share >= KEPT_UP and not growing
        return cls(trial=trial, rate=float(rate), observed_s=observed, kept_up=kept)


def light_tests_of(trial: int, probes: Sequence[Mapping[str, object]]) -> list[LightTest]:
    """A trial's light-load floor tests (``Probe.to_dict()`` of phase "floor": at most
    four requests in flight, so nothing queues), at the rate they served."""
    out = []
    for p in probes:
        checks = p.get("checks")
        served = p.get("request_throughput")
        if p.get("phase") != "floor" or not isinstance(checks, list) or not isinstance(
                served, int | float):
            continue
        observed = {str(c["label"]): float(c["observed_s"]) for c in checks
                    if isinstance(c, Mapping) and isinstance(c.get("observed_s"), int | float)}
        out.append(LightTest(trial=trial, rate=float(served), observed_s=observed,
                             kept_up=True))
    return out


@dataclass(frozen=True, kw_only=True)
class Floor:
    """A limit that the lightest load tested, kept up with, still missed."""

    label: str  # e.g. "p99:e2e"
    threshold_s: float
    floor_s: float  # the best (lowest) percentile over the kept-up light tests
    trial: int
    rate: float


def floors(slo: SLO, tests: Sequence[LightTest]) -> list[Floor]:
    """The limits under their floor: missed by every config's light test that kept up
    (at least one such test needed; a config that fell behind says nothing)."""
    out: list[Floor] = []
    for lim in slo.limits:
        seen = [(t.observed_s[lim.label], t) for t in tests
                if t.kept_up and math.isfinite(t.observed_s.get(lim.label, math.nan))]
        if not seen:
            continue
        best, test = min(seen, key=lambda x: x[0])
        if best > lim.threshold_s:
            out.append(Floor(label=lim.label, threshold_s=lim.threshold_s, floor_s=best,
                             trial=test.trial, rate=test.rate))
    return out


def advice(under: Sequence[Floor], *, output_tokens: Sequence[int] = ()) -> str:
    """One sentence: which limits are under their floor, why, and what could reach them."""
    parts = [f"{f.label} <= {f.threshold_s:g}s is under its floor: even trial {f.trial} at "
             f"{f.rate:.3g} req/s, which served every arrival with no growing backlog, had "
             f"{f.label} {f.floor_s:.3g} s" for f in under]
    why = ""
    fixes = []
    if any(f.label.endswith(":e2e") for f in under):
        if output_tokens:
            q = max(float(f.label[1:].split(":")[0]) for f in under
                    if f.label.endswith(":e2e"))
            longest = float(np.quantile(np.asarray(output_tokens, dtype=float), q / 100.0))
            why = (f" (the workload's p{q:g} reply is {longest:.0f} tokens: its tokens "
                   "alone take that long)")
        fixes += ["a TPOT limit instead of an end-to-end one",
                  "shorter replies (a lower max_tokens)"]
    fixes += ["faster hardware", "a config with a shorter step time (a larger TP)"]
    return ("the SLO is below what the server reaches without queueing: " + "; ".join(parts)
            + why + ". A lower request rate cannot help; what could: " + ", ".join(fixes)
            + ".")
