"""From a finished study to a recommendation (pure).

The best feasible trial (highest objective among trials that met every SLO limit),
how it compares with the vLLM-defaults baseline, the next best configs, the exact
``vllm serve`` command, and the rate cap to enforce at the gateway: ``headroom``
(default 10%) under the highest feasible rate seen for the recommended config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from autotune.analysis.pareto import pareto_points
from autotune.core.errors import AutotuneError
from autotune.core.files import json_safe
from autotune.core.flags import command_line, config_key
from autotune.study.space import CLIENT_PARAMS, serve_command
from autotune.tuning.load_unit import cap_word
from autotune.tuning.record import StoredTrial

DEFAULT_HEADROOM = 0.10


class RecommendError(AutotuneError, ValueError):
    """There is nothing to recommend from (no trial finished, none feasible)."""


class NothingFeasible(RecommendError):
    """No trial met the SLO: ``finding`` says how many ended how, ``advice`` what to
    try (a caller that knows better, such as an SLO under the floor, replaces it)."""

    def __init__(self, finding: str, advice: str) -> None:
        super().__init__(f"{finding}: {advice}")
        self.finding = finding
        self.advice = advice


@dataclass(frozen=True)
class TrialView:
    """What the recommendation needs of one trial (built from Optuna rows)."""

    number: int
    flags: dict[str, Any]
    rate: float | None
    status: str  # complete | pruned | infeasible | failed
    feasible: bool
    value: float | None  # the objective (goodput), None when not complete
    goodput_tokens: float | None
    goodput_requests: float | None
    output_throughput: float | None
    p99_e2e_s: float | None
    attainment: float | None
    gpu_util_pct: float | None
    gpus: int
    reason: str | None = None
    baseline: bool = False
    source: str = ""
    predicted: dict[str, Any] | None = None
    # What the server was launched with: {"argv": [...], "env": {...}} (None: simulated)
    launch: dict[str, Any] | None = None
    tpot_p50_s: float | None = None  # median time per output token of its load test

    @property
    def config_key(self) -> str:
        return config_key(self.flags)


def view_of(t: StoredTrial) -> TrialView:
    """What the recommendation needs of one stored trial."""
    return TrialView(
        number=t.number, flags=t.flags, rate=t.rate, status=t.status, feasible=t.feasible,
        value=t.objective_value, goodput_tokens=t.goodput_tokens,
        goodput_requests=t.goodput_requests,
        output_throughput=t.measured("output_throughput"), p99_e2e_s=t.stat("e2e", "p99"),
        attainment=t.measured("attainment"), gpu_util_pct=t.gpu_util_pct, gpus=t.gpus,
        reason=t.reason, baseline=t.baseline, source=t.source or "",
        predicted=t.predicted, launch=t.launch, tpot_p50_s=t.stat("tpot", "p50"))


@dataclass
class Pick:
    trial: int
    flags: dict[str, Any]
    rate: float | None
    value: float
    goodput_tokens: float | None
    goodput_requests: float | None
    p99_e2e_s: float | None
    attainment: float | None
    gpus: int
    max_feasible_rate: float | None
    command: str
    predicted: dict[str, Any] | None = None
    ceiling: dict[str, Any] | None = None  # the refined ceiling search, when run
    # ``vllm serve MODEL flags``: the same config as ``command`` when the server was
    # launched some other way (a venv's module, extra arguments, environment).
    plain_command: str | None = None


@dataclass
class Recommendation:
    slo: str
    objective: str  # "output tok/s" / "req/s", "per GPU" appended when asked
    best: Pick
    baseline: TrialView | None
    vs_baseline: dict[str, Any]
    next_best: list[Pick]
    rate_cap: float | None
    headroom: float
    trials: dict[str, int]  # counts by status
    source: str  # how the figures were obtained
    notes: list[str] = field(default_factory=list)
    table: list[dict[str, Any]] = field(default_factory=list)  # seed-style rate table
    table_how: str = ""
    ceilings: list[dict[str, Any]] = field(default_factory=list)  # refined, one per config
    # Pre-screened trials: the simulator's prediction next to what was measured.
    predictions: list[dict[str, Any]] = field(default_factory=list)
    # The long run of the recommended config at its cap (autotune.tuning.validation).
    validation: dict[str, Any] | None = None
    # Every feasible config as a point of goodput per GPU against tokens per user
    # (analysis.pareto), the front marked.
    pareto: list[dict[str, Any]] = field(default_factory=list)
    # --tier: each tier's best proven config, re-judged from the proof's load tests
    # (analysis.tiers).
    tiers: list[dict[str, Any]] = field(default_factory=list)
    # What a rate, a ceiling and the cap count: req/s, or the users (or requests in
    # flight) of a search --by users (or concurrency).
    unit: str = "req/s"
    # Why there is no cap (``rate_cap`` None): no proof showed a level, or no
    # validation run passed.
    no_cap: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))

    def level(self, x: float | None) -> str:
        """A rate or a number of users, with its unit: "2.59 req/s", "42 users"."""
        return f"{self.level_value(x)} {self.unit}"

    def level_value(self, x: float | None) -> str:
        """The number alone: a rate to 0.01, users whole."""
        return _num(x, '.2f' if self.unit == 'req/s' else ',.0f')

    @property
    def cap_word(self) -> str:
        """What the gateway caps: a request rate, or the load of users in flight."""
        return cap_word(self.unit)

    @property
    def measure(self) -> str:
        """What the recommendation is compared with the baseline by."""
        return "goodput" if self.unit == "req/s" else f"ceiling ({self.unit})"

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False, default=str) + "\n"


def _pick(view: TrialView, views: Sequence[TrialView]) -> Pick:
    same = [v.rate for v in views
            if v.feasible and v.config_key == view.config_key and v.rate is not None]
    return Pick(trial=view.number, flags=view.flags, rate=view.rate, value=view.value or 0.0,
                goodput_tokens=view.goodput_tokens, goodput_requests=view.goodput_requests,
                p99_e2e_s=view.p99_e2e_s, attainment=view.attainment, gpus=view.gpus,
                max_feasible_rate=max(same) if same else view.rate,
                command=deploy_command(view.flags, view.launch), predicted=view.predicted,
                plain_command=serve_command(view.flags))


def deploy_command(flags: Mapping[str, Any], launch: Mapping[str, Any] | None) -> str:
    """The command as it was launched and measured (prefix, arguments, environment
    exactly), or, for a simulated config, ``vllm serve`` with its flags."""
    if launch and launch.get("argv"):
        return command_line(list(launch["argv"]), dict(launch.get("env") or {}))
    return serve_command(flags)


def cap_with_headroom(rate: float | None, headroom: float = DEFAULT_HEADROOM) -> float | None:
    """The gateway rate cap: ``headroom`` under the highest feasible rate seen."""
    if rate is None:
        return None
    if not 0 <= headroom < 1:
        raise RecommendError(f"headroom must be in [0, 1), got {headroom}")
    return round(rate * (1.0 - headroom), 2)


def recommend(
    views: Sequence[TrialView],
    *,
    slo: str,
    objective: str = "output tok/s",
    headroom: float = DEFAULT_HEADROOM,
    top: int = 3,
    rate_high: float | None = None,
) -> Recommendation:
    """Rank feasible trials; one pick per config (its best trial)."""
    counts: dict[str, int] = {}
    for v in views:
        key = "feasible" if v.feasible else v.status
        counts[key] = counts.get(key, 0) + 1
    feasible = sorted((v for v in views if v.feasible and v.value is not None),
                      key=lambda v: (-(v.value or 0.0), v.number))
    if not feasible:
        why = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no trials"
        raise NothingFeasible(
            f"no trial met the SLO {slo} ({why})",
            "relax the SLO, widen the search space (lower request_rate), or run more trials")
    picks: list[Pick] = []
    seen: set[str] = set()
    for v in feasible:
        if v.config_key in seen:
            continue
        seen.add(v.config_key)
        picks.append(_pick(v, views))
        if len(picks) > top:
            break
    best = picks[0]
    baseline = next((v for v in views if v.baseline), None)
    vs = _versus(best, baseline)
    notes = []
    if rate_high is not None and best.max_feasible_rate is not None and (
            best.max_feasible_rate >= 0.98 * rate_high):
        notes.append(f"the best config met the SLO at the top of the searched rate range "
                     f"({rate_high:g} req/s): its ceiling may be higher; widen request_rate")
    source = feasible[0].source or "unknown source"
    return Recommendation(
        slo=slo, objective=objective, best=best, baseline=baseline, vs_baseline=vs,
        next_best=picks[1:], rate_cap=cap_with_headroom(best.max_feasible_rate, headroom),
        headroom=headroom, trials=counts, source=source, notes=notes,
        predictions=predictions_vs_measured(views),
        pareto=[p.to_dict() for p in pareto_points(views, headroom=headroom)])


def predictions_vs_measured(views: Sequence[TrialView]) -> list[dict[str, Any]]:
    """One row per trial that had a prediction (the pre-screen's or the twin's):
    predicted (simulated) and measured figures."""
    rows = []
    for v in sorted((v for v in views if v.predicted), key=lambda v: v.number):
        p = v.predicted or {}
        rows.append({
            "trial": v.number, "config": {k: x for k, x in v.flags.items()
                                          if k not in CLIENT_PARAMS},
            "predicted": {"source": p.get("source"), "by": p.get("by"),
                          "ceiling_rate": p.get("ceiling_rate"),
                          "goodput_tokens": p.get("goodput_tokens"),
                          "p99_e2e_s": p.get("p99_e2e_s")},
            "measured": {"source": v.source or None, "rate": v.rate, "feasible": v.feasible,
                         "status": v.status, "goodput_tokens": v.goodput_tokens,
                         "p99_e2e_s": v.p99_e2e_s},
        })
    return rows


def equal_gpus(best_tokens: float | None, best_gpus: int | None, base_tokens: float | None,
               base_gpus: int | None) -> dict[str, Any] | None:
    """The goodput comparison with vLLM's defaults on the same GPUs, when the two use
    different GPU counts: the defaults run as replicas on the recommendation's GPUs (as
    many whole replicas as fit), and per GPU.  None when the counts are equal or a figure
    is missing."""
    gb, g0 = max(int(best_gpus or 1), 1), max(int(base_gpus or 1), 1)
    if gb == g0 or not best_tokens or not base_tokens:
        return None
    replicas = gb // g0
    out: dict[str, Any] = {
        "gpus": gb, "baseline_gpus": g0,
        "goodput_ratio_per_gpu": (best_tokens / gb) / (base_tokens / g0)}
    if replicas >= 1:
        out["baseline_replicas"] = replicas
        out["goodput_ratio_equal_gpus"] = best_tokens / (base_tokens * replicas)
        out["equal_gpus_note"] = (
            f"on {gb} GPUs, vLLM's defaults run as {replicas} replica(s) of {g0} GPU(s): "
            f"{out['goodput_ratio_equal_gpus']:.2f}x their goodput; "
            f"{out['goodput_ratio_per_gpu']:.2f}x per GPU")
    else:
        out["equal_gpus_note"] = (f"per GPU ({gb} vs {g0}): "
                                  f"{out['goodput_ratio_per_gpu']:.2f}x the defaults' goodput")
    return out


def _versus(best: Pick, baseline: TrialView | None) -> dict[str, Any]:
    if baseline is None:
        return {"note": "no baseline trial in this study"}
    out: dict[str, Any] = {
        "baseline_trial": baseline.number, "baseline_feasible": baseline.feasible,
        "baseline_rate": baseline.rate, "baseline_p99_e2e_s": baseline.p99_e2e_s,
        "baseline_goodput_tokens": baseline.goodput_tokens,
        "baseline_attainment": baseline.attainment, "baseline_status": baseline.status,
        "baseline_reason": baseline.reason,
    }
    same = config_key(best.flags) == baseline.config_key
    if same:
        out["same_config"] = True
        out["objective_ratio"] = 1.0
        out["note"] = ("vLLM's defaults were already the best config found: the "
                       "recommendation is the baseline itself, at its own ceiling")
    elif baseline.feasible and baseline.value:
        out["objective_ratio"] = best.value / baseline.value
        out["compared"] = "each config at its own ceiling"
        out.update(equal_gpus(best.goodput_tokens, best.gpus, baseline.goodput_tokens,
                              baseline.gpus) or {})
    else:
        out["objective_ratio"] = None
        out["note"] = (f"the vLLM-defaults baseline did not meet the SLO at "
                       f"{baseline.rate} req/s ({baseline.reason or baseline.status}): any "
                       "feasible config beats it")
    return out


# ----------------------------------------------------------------------------- ceilings


def _ceiling_pick(c: Mapping[str, Any], views: Sequence[TrialView], objective: str,
                  per_gpu: bool) -> Pick | None:
    """A pick at a refined ceiling: the passing probe at ``feasible_max``."""
    top = c.get("feasible_max")
    if not c.get("feasible") or top is None:
        return None
    passing = [p for p in c.get("probes") or [] if p.get("rate") == top
               and p.get("verdict") == "pass"]
    if not passing:
        return None
    probe = max(passing, key=lambda p: p.get("num_prompts") or 0)
    summ = probe.get("summary") or {}
    view = next((v for v in views if v.number == c.get("trial")), None)
    gpus = view.gpus if view is not None else 1
    value = (float(top) if objective == "level" else
             summ.get("goodput_tokens" if objective == "tokens" else "goodput_requests") or 0.0)
    if per_gpu:
        value /= max(gpus, 1)
    flags = dict(view.flags) if view is not None else dict(c.get("config") or {})
    brief = {k: c.get(k) for k in ("answer", "source", "feasible_max", "infeasible_min",
                                   "converged", "binding", "recommended_cap",
                                   "search_probes", "total_probes", "start_rate")}
    return Pick(trial=int(c.get("trial") or 0), flags=flags, rate=top, value=value,
                goodput_tokens=summ.get("goodput_tokens"),
                goodput_requests=summ.get("goodput_requests"),
                p99_e2e_s=(summ.get("e2e") or {}).get("p99"), attainment=summ.get("attainment"),
                gpus=gpus, max_feasible_rate=top,
                command=deploy_command(flags, view.launch if view is not None else None),
                plain_command=serve_command(flags),
                predicted=view.predicted if view is not None else None, ceiling=brief)


def coarse_note(c: Mapping[str, Any], unit: str = "req/s") -> str | None:
    """A ceiling whose bracket did not close to its tolerance, said with its bracket."""
    lo, hi, tol = c.get("feasible_max"), c.get("infeasible_min"), c.get("tol")
    if c.get("converged") or lo is None or hi is None or not lo > 0:
        return None
    return (f"the ceiling is coarse: between {lo:.4g} {unit} (passed) and {hi:.4g} {unit} "
            f"(did not), {hi / lo - 1:.0%} apart"
            + (f", wider than --tol {tol:.0%}" if tol else "")
            + "; raise --max-probes for a tighter answer")


def _proven_baseline(base: TrialView, c: Mapping[str, Any], picks: Sequence[Pick]
                     ) -> TrialView:
    """vLLM's defaults at the ceiling their own proof found (not the rate their
    screening tried), or, when none passed, why."""
    got = next((p for p in picks if p.trial == base.number), None)
    if got is None:
        return replace(base, feasible=False, value=None, status="infeasible",
                       reason=f"its own ceiling search: {c.get('answer')}")
    return replace(base, rate=got.rate, value=got.value, feasible=True, status="complete",
                   goodput_tokens=got.goodput_tokens, goodput_requests=got.goodput_requests,
                   p99_e2e_s=got.p99_e2e_s, attainment=got.attainment, reason=None)


def apply_ceilings(rec: Recommendation, views: Sequence[TrialView],
                   ceilings: Sequence[Mapping[str, Any]], *, objective: str = "tokens",
                   per_gpu: bool = False) -> Recommendation:
    """Re-rank on refined ceilings (``RefinedCeiling.to_dict()``): the best config is
    the one with the highest objective at its own ceiling, and the rate cap is
    ``headroom`` under that ceiling, not under the one rate a trial happened to try.
    Configs without a feasible ceiling keep their trial figures, after the refined ones."""
    picks = [p for p in (_ceiling_pick(c, views, objective, per_gpu) for c in ceilings) if p]
    rec.ceilings = [{"trial": c.get("trial"), "answer": c.get("answer"),
                     "feasible_max": c.get("feasible_max"),
                     "recommended_cap": c.get("recommended_cap"),
                     "infeasible_min": c.get("infeasible_min"),
                     "total_probes": c.get("total_probes"), "source": c.get("source")}
                    for c in ceilings]
    by_trial = {c.get("trial"): c for c in ceilings}
    for row in rec.predictions:
        c = by_trial.get(row["trial"])
        if c is not None:
            row["measured"]["ceiling_rate"] = c.get("feasible_max")
    if rec.baseline is not None and rec.baseline.number in by_trial:
        rec.baseline = _proven_baseline(rec.baseline, by_trial[rec.baseline.number], picks)
        rec.vs_baseline = _versus(rec.best, rec.baseline)
    if not picks:
        if ceilings:
            # The screen's short tests are point estimates: a cap under them would stand
            # on exactly what the proof could not show.
            rec.rate_cap = None
            rec.no_cap = (
                f"the proof (the full ceiling search of the {len(ceilings)} best screened "
                "configs) showed no level meeting the SLO; the screened figures are short "
                "tests' point estimates, not a cap")
            rec.notes.append(rec.no_cap + ": " + "; ".join(
                f"trial {c.get('trial')}: {c.get('answer')}" for c in ceilings))
        return rec
    picks.sort(key=lambda p: (-p.value, p.trial))
    refined = {config_key(p.flags) for p in picks}
    rest = [p for p in [rec.best, *rec.next_best] if config_key(p.flags) not in refined]
    keep = max(len(rec.next_best), len(picks) - 1)
    rec.best, rec.next_best = picks[0], [*picks[1:], *rest][:keep]
    rec.rate_cap = cap_with_headroom(rec.best.max_feasible_rate, rec.headroom)
    rec.vs_baseline = _versus(rec.best, rec.baseline)
    coarse = coarse_note(by_trial.get(rec.best.trial) or {}, rec.unit)
    if coarse:
        if rec.best.ceiling is not None:
            rec.best.ceiling["coarse"] = True
        rec.notes.append(coarse)
    rec.notes.append(
        f"ranked on proven ceilings: the full ceiling search ran on the {len(ceilings)} best "
        "screened configs (each test a sequential test of every limit, pooled across the "
        "config's rates, unsafe at most 5% of the time); the rate cap is the headroom under "
        "the recommended config's proven ceiling; every other config, vLLM's defaults "
        "included unless proven, is at its screened ceiling (short tests, point estimates)")
    return rec


# ----------------------------------------------------------------------------- text


def _num(x: Any, fmt: str = ",.0f", none: str = "-") -> str:
    if x is None or isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return none
    return format(x, fmt)


def flags_line(flags: Mapping[str, Any]) -> str:
    short = {"tensor_parallel_size": "TP", "max_num_seqs": "seqs",
             "max_num_batched_tokens": "batch-tok", "enable_chunked_prefill": "chunked",
             "gpu_memory_utilization": "mem"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in flags.items()
                    if k in short)


def to_markdown(rec: Recommendation) -> str:
    lines = [*_md_best(rec), *_md_baseline(rec), *_md_predicted(rec), *_md_ceilings(rec),
             *_md_tiers(rec), *_md_pareto(rec), *_md_predictions(rec), *_md_rates(rec)]
    counts = ", ".join(f"{n} {k}" for k, n in sorted(rec.trials.items()))
    lines += ["", f"Trials: {counts}."]
    for note in rec.notes:
        lines.append(f"Note: {note}.")
    return "\n".join(lines) + "\n"


def _md_best(rec: Recommendation) -> list[str]:
    """What to deploy and at what rate cap, then the best config beside the next best:
    the part a reader acts on, so it comes first."""
    b = rec.best
    lines = [
        "# autotune recommendation",
        "",
        f"SLO: `{rec.slo}`; objective: {_objective(rec)}.  ",
        f"Figures: {rec.source}; each is one load test at the trial's rate "
        "(warm-up excluded).",
        "",
        "## Deploy",
        "",
        "```",
        b.command,
        "```",
        "",
        (f"{rec.cap_word.capitalize()} cap at the gateway: "
         f"**{rec.level(rec.rate_cap)}** ({rec.headroom:.0%} under "
         f"{rec.level(b.max_feasible_rate)}, the highest level at which this config met the "
         "SLO).") if rec.rate_cap is not None else f"**No cap**: {rec.no_cap}.",
        "",
        "## Best config",
        "",
        f"| trial | config | level ({rec.unit}) | goodput (tok/s) | goodput (req/s) | "
        "P99 e2e (s) | attainment |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in [b, *rec.next_best]:
        lines.append(
            f"| {p.trial} | {flags_line(p.flags)} | {rec.level_value(p.rate)} | "
            f"{_num(p.goodput_tokens)} | {_num(p.goodput_requests, '.2f')} | "
            f"{_num(p.p99_e2e_s, '.2f')} | {_num(p.attainment, '.1%')} |")
    lines += ["", "The first row is the recommendation; the others are the next best "
              "configs (one row per config, its best trial).", ""]
    return lines


def _objective(rec: Recommendation) -> str:
    if rec.unit != "req/s":
        what = rec.objective.replace("in flight", "requests in flight", 1)
        return f"the {what} each config sustains"
    return f"goodput in {rec.objective}"


def _md_baseline(rec: Recommendation) -> list[str]:
    """The recommendation against vLLM's defaults, at the baseline trial's rate and,
    where measured, at the defaults' own ceiling (the fair comparison)."""
    base = rec.baseline
    lines = ["## Against vLLM's defaults", ""]
    if base is None:
        lines.append("No baseline trial.")
        return lines
    lines.append(
        f"Baseline (trial {base.number}, {flags_line(base.flags)} at "
        f"{rec.level(base.rate)}): goodput {_num(base.goodput_tokens)} tok/s, "
        f"P99 e2e {_num(base.p99_e2e_s, '.2f')} s, attainment "
        f"{_num(base.attainment, '.1%')}, "
        f"{'met the SLO' if base.feasible else 'did not meet the SLO'}.")
    ratio = rec.vs_baseline.get("objective_ratio")
    if ratio is not None:
        lines.append(f"The recommendation gives {ratio:.2f}x the baseline's {rec.measure}"
                     + (f" ({rec.vs_baseline['gpus']} GPUs vs "
                        f"{rec.vs_baseline['baseline_gpus']})"
                        if "gpus" in rec.vs_baseline else "") + ".")
        if rec.vs_baseline.get("equal_gpus_note"):
            lines.append(f"Compared fairly, {rec.vs_baseline['equal_gpus_note']}.")
    elif rec.vs_baseline.get("note"):
        lines.append(rec.vs_baseline["note"] + ".")
    vs = rec.vs_baseline
    if vs.get("goodput_ratio_at_ceilings") is not None:
        lines.append(
            f"At equal footing, vLLM's defaults at their own ceiling "
            f"({rec.level(vs.get('baseline_ceiling_rate'))}) give "
            f"{_num(vs.get('baseline_ceiling_goodput_tokens'))} tok/s: the recommendation "
            f"is {vs['goodput_ratio_at_ceilings']:.2f}x that "
            f"({vs.get('baseline_ceiling_note', '')}).")
    elif vs.get("baseline_ceiling_note"):
        lines.append(vs["baseline_ceiling_note"] + ".")
    return lines


def _md_predicted(rec: Recommendation) -> list[str]:
    """The best config's simulated prediction beside its measurement (empty when it
    was not predicted), so a reader sees how far the simulator can be trusted."""
    b = rec.best
    if not b.predicted:
        return []
    told = b.predicted
    return ["", f"## Predicted ({told.get('by') or 'the simulator pre-screen'}, "
            "simulated) vs measured", "",
            "| figure | predicted | measured |", "| --- | --- | --- |",
            f"| ceiling ({rec.unit}) | {rec.level_value(told.get('ceiling_rate'))} | "
            f"{rec.level_value(b.max_feasible_rate)} |",
            f"| goodput (tok/s) | {_num(told.get('goodput_tokens'))} | "
            f"{_num(b.goodput_tokens)} |",
            f"| P99 e2e (s) | {_num(told.get('p99_e2e_s'), '.2f')} | "
            f"{_num(b.p99_e2e_s, '.2f')} |"]


def _md_ceilings(rec: Recommendation) -> list[str]:
    """The refined ceilings the rate cap comes from (empty when none was searched)."""
    if not rec.ceilings:
        return []
    lines = ["", "## Refined ceilings", "",
             "The ceiling search on the best configs, from each trial's rate; the "
             "recommendation and its rate cap come from these.", ""]
    for c in rec.ceilings:
        lines.append(f"- trial {c.get('trial')}: {c.get('answer')} "
                     f"({c.get('total_probes')} load tests, {c.get('source')})")
    return lines


def _md_tiers(rec: Recommendation) -> list[str]:
    """Each --tier's best proven config (empty without tiers)."""
    if not rec.tiers:
        return []
    lines = ["", "## SLO tiers", "",
             "Re-judged: each tier's limits checked on the requests of the proof's load "
             "tests (every limit's percentile and its 95% upper bound within it; not "
             "corrected for the tests looked at): the config with the most requests per "
             "second within the tier, at the highest rate it passed, a lower bound of its "
             "ceiling there; the command proves it. Proved: no test of the proof met the "
             "tier, so the ceiling search ran under the tier's own SLO.", "",
             f"| tier | SLO | how | trial | config | passed at ({rec.unit}) | cap "
             f"({rec.unit}) | within the tier (req/s) | command |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in rec.tiers:
        how = "proved" if t.get("proved") else "re-judged"
        if t.get("trial") is None:
            lines.append(f"| {t['tier']} | `{t['slo']}` | {how} | - | no config met it | "
                         "- | - | - | - |")
            continue
        lines.append(
            f"| {t['tier']} | `{t['slo']}` | {how} | {t['trial']} | "
            f"{flags_line(t['flags']) or 'defaults'} | {rec.level_value(t.get('rate'))} | "
            f"{rec.level_value(t.get('cap'))} | {_num(t.get('goodput_requests'), '.2f')} | "
            f"`{t.get('command')}` |")
    return lines


def _md_pareto(rec: Recommendation) -> list[str]:
    """Goodput per GPU against what each user gets, one row per feasible config (empty
    with fewer than two: there is no trade-off to show)."""
    if len(rec.pareto) < 2:
        return []
    by_user = all(p.get("tokens_per_user") is not None for p in rec.pareto)
    lines = ["", "## Goodput per GPU against tokens per user (Pareto front)", "",
             "Each feasible config at its best trial: goodput per GPU (output tok/s of the "
             "requests within the SLO, per GPU) against one user's stream (output tok/s "
             "per user, 1 / median TPOT) and P99 end-to-end latency. On the front (*): no "
             "other config is better on both goodput per GPU and "
             + ("tokens per user." if by_user else "P99 (no TPOT was measured)."), "",
             "| front | trial | config | GPUs | goodput tok/s/GPU | tok/s per user | "
             "P99 e2e (s) | passed at (req/s) | cap (req/s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in rec.pareto:
        lines.append(
            f"| {'*' if p.get('on_front') else ''} | {p['trial']} | "
            f"{flags_line(p['flags']) or 'defaults'} | {p['gpus']} | "
            f"{_num(p.get('goodput_per_gpu'))} | {_num(p.get('tokens_per_user'), '.1f')} | "
            f"{_num(p.get('p99_e2e_s'), '.2f')} | {_num(p.get('rate'), '.2f')} | "
            f"{_num(p.get('cap'), '.2f')} |")
    return lines


def _md_predictions(rec: Recommendation) -> list[str]:
    """Every pre-screened trial's prediction beside its measurement (empty when no
    trial was predicted)."""
    if not rec.predictions:
        return []
    lines = ["", "## Predicted (simulated) vs measured, trial by trial", "",
             f"| trial | predicted by | config | predicted ceiling ({rec.unit}) | "
             f"measured at ({rec.unit}) | "
             "predicted goodput (tok/s) | measured goodput (tok/s) | predicted P99 (s) "
             "| measured P99 (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rec.predictions:
        p, m = r["predicted"], r["measured"]
        lines.append(
            f"| {r['trial']} | {p.get('by') or 'the simulator pre-screen'} | "
            f"{flags_line(r['config']) or r['config']} | "
            f"{rec.level_value(p.get('ceiling_rate'))} | {rec.level_value(m.get('rate'))} | "
            f"{_num(p.get('goodput_tokens'))} | {_num(m.get('goodput_tokens'))} | "
            f"{_num(p.get('p99_e2e_s'), '.2f')} | {_num(m.get('p99_e2e_s'), '.2f')} |")
    return lines


def _md_rates(rec: Recommendation) -> list[str]:
    """The recommended config across rates, the seed-style table (empty when none)."""
    if not rec.table:
        return []
    lines = ["", "## The recommended config across rates", "", rec.table_how, "",
             "| rate (req/s) | goodput tok/s | P99 e2e (s) | GPU util | verdict |",
             "| --- | --- | --- | --- | --- |"]
    for row in rec.table:
        lines.append(
            f"| {_num(row['rate'], '.1f')} | {_num(row['goodput_tokens'])} | "
            f"{_num(row['p99_e2e_s'], '.1f')} | {_num(row.get('gpu_util_pct'), '.0f')}% | "
            f"{row['verdict']} |")
    return lines


def table_row(rate: float, *, goodput_tokens: float | None, p99_e2e_s: float | None,
              gpu_util_pct: float | None, feasible: bool, pruned_by: str | None,
              measured: bool) -> dict[str, Any]:
    """One row of the seed-style table: ``verdict`` is the load test's steady-state
    verdict (pass, fail, or inconclusive via ``pruned_by``)."""
    if feasible:
        verdict = "pass"
    elif pruned_by == "inconclusive":
        verdict = "inconclusive"
    elif pruned_by:
        verdict = f"fail (pruned: {pruned_by})"
    else:
        verdict = "fail (SLO missed)"
    return {"rate": rate, "goodput_tokens": goodput_tokens, "p99_e2e_s": p99_e2e_s,
            "gpu_util_pct": gpu_util_pct, "verdict": verdict,
            "source": "measured" if measured else "simulated"}
