"""SLO tiers (``search --tier NAME=SLO``): each tier's best config and rate, re-judged
from the load tests the search already ran.

The study runs against the search's SLO.  Its proof runs a full ceiling search on the
best configs, and every probe of it keeps each request's latencies.  A tier's limits are
checked on those same requests: a probe passes a tier when every limit's percentile
and its one-sided upper confidence bound (order statistics, failed requests as inf) are
within the tier's threshold, the fixed-sample rule of ``tuning.verdict.check_limits``.
The highest rate a config passes is a lower bound of its ceiling under that tier.

A re-judged answer proves nothing new: the check looks at many probes (its multiplicity
is not corrected), and each answer names the command that proves it (``autotune ceiling
--study S --trial N --slo ...``).  A tier no probe meets is proved where the evidence
does not allow: the search runs the full ceiling search under the tier's own SLO on the
proven configs (:func:`proven_tier` reads the answer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from autotune.analysis.deploy import Plan, ReplicaResult, plan_deployment
from autotune.core.errors import AutotuneError
from autotune.core.slo import SLO, parse_slo
from autotune.tuning.load_unit import RATE, LoadUnit
from autotune.tuning.verdict import check_limits, verdict_of

# Where a search keeps its tiers' answers in the study, for ``recommend --tier-gpus``.
TIERS_ATTR = "autotune:tiers"


class TierError(AutotuneError, ValueError):
    """A --tier that cannot be read: the message says how to write one."""


@dataclass(frozen=True)
class Tier:
    name: str
    slo: SLO


_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")


def parse_tier(text: str) -> Tier:
    """``interactive='p99:ttft<=500ms,p99:tpot<=50ms'`` or ``batch=60s`` (a P99 end-to-end
    limit) as a tier."""
    name, sep, spec = text.partition("=")
    name, spec = name.strip(), spec.strip().strip("'\"")
    if not sep or not _NAME.match(name) or not spec:
        raise TierError(f"--tier {text!r}: give NAME=SLO, e.g. "
                        "interactive='p99:ttft<=500ms,p99:tpot<=50ms' or batch=60s")
    try:
        slo = parse_slo(spec)
    except ValueError as exc:
        raise TierError(f"--tier {name}: {exc}") from None
    return Tier(name, slo)


def check_tiers(tiers: Sequence[Tier]) -> None:
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise TierError(f"--tier names must differ, got {', '.join(names)}")


@dataclass
class TierAnswer:
    """A tier's best config among the proven ones, at the highest rate it passed."""

    tier: str
    slo: str
    trial: int | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    rate: float | None = None  # the level (req/s, or users) of the probe it passed at
    cap: float | None = None
    unit: str = "req/s"  # what ``rate`` and ``cap`` count
    good_share: float | None = None  # requests within every tier limit
    goodput_requests: float | None = None  # req/s within the tier's limits
    goodput_tokens: float | None = None  # output tok/s of those requests (their share)
    checks: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    command: str | None = None  # proves it
    sentence: str = ""
    proved: bool = False  # a ceiling search under the tier's own SLO, not a re-judgement

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _good_share(summary: Any, slo: SLO) -> float | None:
    """The share of the probe's requests within every limit of ``slo``."""
    masks = []
    for limit in slo.limits:
        values = np.asarray(summary.samples.get(limit.metric, ()), dtype=float)
        if not values.size:
            return None
        masks.append(values <= limit.threshold_s)
    n = min(m.size for m in masks)
    if not n:
        return None
    good = np.ones(n, dtype=bool)
    for m in masks:
        good &= m[:n]
    return float(good.mean())


def answer_tiers(tiers: Sequence[Tier], ceilings: Sequence[Any], *, study: str,
                 headroom: float, confidence: float = 0.95,
                 unit: LoadUnit = RATE) -> list[TierAnswer]:
    """Each tier's best proven config: among every probe of the proof's ceiling
    searches (``RefinedCeiling``: ``trial``, ``config``, ``result.probes``), the
    passing one with the most requests per second within the tier's limits.  ``unit``:
    what the probes' levels count (a search --by users: whole users, capped whole)."""
    answers = []
    for tier in tiers:
        best: tuple[float, TierAnswer] | None = None
        for c in ceilings:
            for p in getattr(c.result, "probes", ()):
                if p.summary is None or not math.isfinite(p.rate) or p.phase in (
                        "saturation", "floor"):
                    continue
                checks = check_limits(p.summary, tier.slo, confidence)
                if verdict_of(checks, p.pruned) != "pass":
                    continue
                share = _good_share(p.summary, tier.slo) or 0.0
                value = p.request_throughput * share
                if best is None or value > best[0]:
                    best = (value, TierAnswer(
                        tier=tier.name, slo=str(tier.slo), trial=c.trial,
                        flags=dict(c.config), rate=p.rate, unit=unit.label,
                        cap=unit.cap(p.rate, headroom), good_share=share,
                        goodput_requests=value,
                        goodput_tokens=p.summary.output_throughput * share,
                        checks=[ch.to_dict() for ch in checks],
                        requests=p.summary.num_measured))
        answers.append(_finish(tier, best[1] if best else None, study, confidence,
                               len(ceilings), unit))
    return answers


def _finish(tier: Tier, answer: TierAnswer | None, study: str, confidence: float,
            configs: int, unit: LoadUnit) -> TierAnswer:
    if answer is None:
        return TierAnswer(tier=tier.name, slo=str(tier.slo), sentence=(
            f"{tier.name} ({tier.slo}): not shown by the tests of the {configs} proven "
            "configs (none met every limit with its upper bound); prove it with "
            f"`autotune ceiling --study {study} --trial N --slo '{tier.slo}'`"))
    answer.command = (f"autotune ceiling --study {study} --trial {answer.trial} "
                      f"--slo '{tier.slo}'")
    limits = ", ".join(f"{c['label']} {c['observed_s']:.3g} s (bound {c['bound_s']:.3g} s)"
                       for c in answer.checks)
    answer.sentence = (
        f"{tier.name} ({tier.slo}): trial {answer.trial} at {unit.fmt(answer.rate or 0.0)}, "
        f"cap {unit.fmt(answer.cap or 0.0)}: {limits} over {answer.requests} requests, each "
        "limit's "
        f"{confidence:.0%} upper bound within it; re-judged from the proof's load tests "
        "(not corrected for the tests looked at), a lower bound of its ceiling; prove it "
        f"with `{answer.command}`")
    return answer


def proven_tier(tier: Tier, proofs: Sequence[Any], *, study: str) -> TierAnswer:
    """A tier's answer from ceiling searches under its own SLO (``RefinedCeiling``s):
    the config whose passing probe served the most within the tier, at its ceiling."""
    best: tuple[float, TierAnswer] | None = None
    for c in proofs:
        result = c.result
        probe = result.feasible_probe() if hasattr(result, "feasible_probe") else None
        if probe is None or result.feasible_max is None:
            continue
        share = _good_share(probe.summary, tier.slo) or 0.0
        value = probe.request_throughput * share
        if best is None or value > best[0]:
            best = (value, TierAnswer(
                tier=tier.name, slo=str(tier.slo), trial=c.trial, flags=dict(c.config),
                rate=result.feasible_max, cap=result.recommended_cap, good_share=share,
                unit=result.unit.label,
                goodput_requests=value,
                goodput_tokens=probe.summary.output_throughput * share,
                checks=[ch.to_dict() for ch in probe.checks],
                requests=probe.num_measured, proved=True,
                command=(f"autotune ceiling --study {study} --trial {c.trial} "
                         f"--slo '{tier.slo}'"),
                sentence=f"{tier.name} ({tier.slo}): trial {c.trial}: {result.sentence()}"))
    if best is None:
        return TierAnswer(tier=tier.name, slo=str(tier.slo), proved=True, sentence=(
            f"{tier.name} ({tier.slo}): no proven config meets it: the ceiling search "
            f"under this SLO found no passing rate on any of the {len(proofs)} configs"))
    return best[1]


def parse_tier_gpus(items: Sequence[str]) -> dict[str, int]:
    """``["interactive=4", "batch=4"]`` as each tier's GPUs."""
    out: dict[str, int] = {}
    for item in items:
        name, _, n = item.partition("=")
        if not name.strip() or not n.strip().isdigit() or int(n) < 1:
            raise TierError(f"--tier-gpus {item!r}: give NAME=GPUS, e.g. interactive=4")
        out[name.strip()] = int(n)
    return out


def tier_replicas(stored: Sequence[dict[str, Any]], gpus: dict[str, int]
                  ) -> dict[str, ReplicaResult]:
    """Each tier named in ``gpus`` as the replica its answer recommends (its config at
    the rate it passed), from the answers a search stored (``TIERS_ATTR``)."""
    known = {t.get("tier"): t for t in stored}
    out: dict[str, ReplicaResult] = {}
    for name in gpus:
        t = known.get(name)
        if t is None:
            have = ", ".join(str(k) for k in known) or "none (run the search with --tier)"
            raise TierError(f"--tier-gpus {name}: the study has no tier {name!r}; its tiers: "
                            f"{have}")
        if t.get("trial") is None or not t.get("rate"):
            raise TierError(f"--tier-gpus {name}: no config met tier {name} ({t.get('slo')}) "
                            "in the study: there is nothing to deploy for it")
        if t.get("unit", "req/s") != "req/s":
            # A replica's share of the demand is a request rate; users per replica would
            # need the demand in users, which --rate does not give.
            raise TierError(f"--tier-gpus {name}: the study's tiers count {t['unit']}, and "
                            "replicas are planned by request rate: search --by rate for a "
                            "tier plan")
        flags = dict(t.get("flags") or {})
        out[name] = ReplicaResult(
            tensor_parallel_size=int(flags.get("tensor_parallel_size", 1)),
            pipeline_parallel_size=int(flags.get("pipeline_parallel_size", 1)),
            ceiling_rate=float(t["rate"]), goodput_tokens=float(t.get("goodput_tokens") or 0),
            goodput_requests=float(t.get("goodput_requests") or 0), config=flags,
            trial=t.get("trial"), source="proved" if t.get("proved") else "re-judged")
    return out


def tier_plans(stored: Sequence[dict[str, Any]], gpus: dict[str, int], *, total: int | None,
               headroom: float, gpu_hour_cost: float | None, model: str | None,
               base_port: int) -> list[tuple[str, Plan]]:
    """Each tier on its own replicas: ``gpus[name]`` GPUs laid out with its config, the
    tiers' replicas on consecutive ports and GPUs.  ``total``: the budget they share."""
    if total is not None and sum(gpus.values()) > total:
        raise TierError(f"--tier-gpus asks for {sum(gpus.values())} GPUs in all, more than "
                        f"--gpus {total}")
    replicas = tier_replicas(stored, gpus)
    plans: list[tuple[str, Plan]] = []
    port, first_gpu = base_port, 0
    for name, n in gpus.items():
        # The tiers share one host's numbering: this tier's GPUs follow the last one's.
        plan = plan_deployment([replicas[name]], n, headroom=headroom,
                               gpu_hour_cost=gpu_hour_cost, model=model, base_port=port,
                               first_gpu=first_gpu)
        plans.append((name, plan))
        port += len(plan.replicas)
        first_gpu += n
    return plans
