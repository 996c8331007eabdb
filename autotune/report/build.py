"""``write_report``: study -> ``report.html``, ``report.md``, PNG plots, ``trials.csv``."""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from autotune.analysis.deploy import ReplicaResult, serve_command
from autotune.analysis.recommend import equal_gpus
from autotune.core.files import atomic_write
from autotune.core.flags import config_key
from autotune.report import plots
from autotune.report.data import (
    ReportError,
    StudyData,
    ceiling_probe_rows,
    config_label,
    default_storage,
    load_study,
    read_ceilings,
    read_recommendation,
    read_timeline,
    trial_row,
    varying_keys,
)
from autotune.report.render import Figure, Page, Text, html_page, markdown, table_from
from autotune.study.optuna_adapter import quiet_logging
from autotune.tuning.load_unit import cap_word
from autotune.tuning.record import as_mapping

DEFAULT_HEADROOM = 0.1
MIN_TRIALS_FOR_IMPORTANCE = 4


@dataclass
class ReportPaths:
    out_dir: Path
    html: Path
    markdown: Path
    trials_csv: Path
    plots: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- gather


def gather(study_name: str, storage: str | None = None, out_dir: Path | None = None,
           *, imported: Sequence[Mapping[str, Any]] = ()) -> StudyData:
    """Everything the report shows, or a ReportError (unknown or empty study)."""
    storage = storage or default_storage(study_name)
    out_dir = Path(out_dir) if out_dir is not None else Path("studies") / study_name
    study = load_study(study_name, storage)
    trials = [t for t in study.get_trials(deepcopy=False)
              if t.state.name not in ("RUNNING", "WAITING")]
    if not trials:
        raise ReportError(
            f"study {study_name!r} has no finished trials yet: run `autotune search "
            f"--study-name {study_name}` (or wait for the running one) and try again")
    rows = [trial_row(t, study_name) for t in trials]
    ceilings = read_ceilings(out_dir)
    # A search with --refine-top may keep its ceiling results in the study's attrs.
    for c in study.user_attrs.get("ceilings") or []:
        if isinstance(c, Mapping) and isinstance(c.get("probes"), list):
            ceilings.append(dict(c))
    data = StudyData(name=study_name, storage=storage, attrs=dict(study.user_attrs),
                     rows=rows, ceilings=ceilings, imported=list(imported),
                     recommendation=read_recommendation(out_dir))
    with contextlib.suppress(Exception):
        data.direction = study.direction.name.lower()
    data.importances, data.importance_note = param_importances(study)
    return data


def param_importances(study: Any) -> tuple[dict[str, float] | None, str]:
    """Optuna's default evaluator (PED-ANOVA in Optuna 5) over what the study optimises:
    every finished config with its goodput at its ceiling when it met the SLO, and 0 when
    it did not (infeasible, or pruned below the incumbent).  Over the completed trials
    alone, the configs that fail are left out and hide the parameters that make them
    fail.  Returns the importances and a note saying over which trials (or why none)."""
    done = [t for t in study.get_trials(deepcopy=False)
            if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
            and t.params and "repeat_of" not in (t.user_attrs.get("result") or {})]
    if len(done) < MIN_TRIALS_FOR_IMPORTANCE:
        return None, (f"parameter importances need at least {MIN_TRIALS_FOR_IMPORTANCE} "
                      f"completed trials; this study has {len(done)}")
    met = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE
           and t.user_attrs.get("feasible") and t.value is not None]
    values = {t.number: (float(t.value) if t in met else 0.0) for t in done}
    if len(set(values.values())) < 2:
        return None, ("parameter importances: every completed trial has the same objective "
                      f"value ({next(iter(values.values())):g}), so no parameter explains "
                      "any change")
    quiet_logging()  # a scratch study: Optuna's "A new study created in memory" is noise
    scored = optuna.create_study(direction="maximize")
    for t in done:
        scored.add_trial(optuna.trial.create_trial(
            params=dict(t.params), distributions=dict(t.distributions),
            value=values[t.number]))
    try:
        found = optuna.importance.get_param_importances(scored)
    except Exception as exc:  # too little variation, a single distribution, ...
        return None, f"parameter importances could not be computed: {exc}"
    if not found:
        return None, "parameter importances: no parameter varied across completed trials"
    note = (f"parameter importances over {len(done)} finished trials: {len(met)} met the "
            f"SLO (their goodput at their ceiling); the {len(done) - len(met)} that did not, "
            "or were pruned below the incumbent, count as 0")
    return {k: float(v) for k, v in found.items()}, note


# ----------------------------------------------------------------------------- derived


def provenance(data: StudyData, rows: Sequence[Mapping[str, Any]] | None = None) -> str:
    rows = data.rows if rows is None else rows
    sources = sorted({str(r.get("source")) for r in rows if r.get("source")})
    measured = any("measured" in s for s in sources)
    simulated = any("simulated" in s for s in sources)
    kind = ("simulated and measured" if measured and simulated
            else "SIMULATED" if simulated else "measured" if measured else "unknown source")
    backends = sorted({str(r.get("backend")) for r in rows if r.get("backend")})
    hw = hardware(data)
    tests = sum(int(r.get("load_tests") or (1 if r.get("num_measured") else 0))
                for r in rows)
    parts = [kind + (f" ({'; '.join(sources)})" if sources else ""),
             f"backend {', '.join(backends) or 'not recorded'}", f"hardware {hw}",
             f"study {data.name}: {tests} load tests, warm-up excluded"]
    if data.slo:
        parts.append(f"SLO {data.slo}")
    return " · ".join(parts)


def hardware(data: StudyData) -> str:
    a = data.attrs
    prof = as_mapping(a.get("profile"))
    hw = a.get("hardware") or prof.get("hardware")
    model = a.get("model") or prof.get("model")
    gpus = a.get("gpus") or prof.get("gpus")
    if not hw:
        # The simulator records its profile in each trial's telemetry.
        engine: Mapping[str, Any] = next(
            (r["telemetry"]["engine"] for r in data.rows
             if isinstance((r.get("telemetry") or {}).get("engine"), Mapping)), {})
        hw, model = engine.get("hardware"), model or engine.get("model")
        if hw:
            return f"{hw}" + (f", model {model}" if model else "")
    if not hw:
        return f"not recorded ({gpus} GPUs)" if gpus else "not recorded"
    text = f"{hw}" + (f" x{gpus}" if gpus else "")
    return text + (f", model {model}" if model else "")


def ceilings_by_config(data: StudyData, *, bracketed: bool = False) -> dict[str, float]:
    """config_key -> ceiling: the ceiling search's feasible_max, else the highest
    offered rate of that config that met the SLO.

    ``bracketed``: keep a trial-based ceiling only when a higher rate of the same
    config missed the SLO (otherwise the knee was never seen, just one passing rate).
    """
    out: dict[str, float] = {}
    failed_above: dict[str, float] = {}
    for r in data.rows:
        rate = r.get("rate")
        if not isinstance(rate, float | int):
            continue
        if r.get("feasible"):
            out[r["config_key"]] = max(out.get(r["config_key"], 0.0), float(rate))
        elif r.get("launched", True) and r.get("num_measured"):
            failed_above[r["config_key"]] = max(failed_above.get(r["config_key"], 0.0),
                                                float(rate))
    if bracketed:
        out = {k: v for k, v in out.items() if failed_above.get(k, 0.0) > v}
    for c in data.ceilings:
        cfg = c.get("config") or c.get("flags")
        if cfg is None and c.get("trial") is not None:
            cfg = next((r["config"] for r in data.rows if r["trial"] == c["trial"]), None)
        fm = c.get("feasible_max")
        if cfg is not None and isinstance(fm, int | float):
            out[config_key(cfg)] = float(fm)
    return out


def curve_rows(data: StudyData) -> list[dict[str, Any]]:
    """Trials plus ceiling probes as points (rate, throughput, P99) per config."""
    rows = [dict(r) for r in data.rows]
    by_trial = {r["trial"]: r for r in data.rows}
    for p in ceiling_probe_rows(data.ceilings):
        cfg = p.get("config") or (by_trial.get(p.get("trial")) or {}).get("config")
        if not cfg:
            continue
        rows.append({"config": cfg, "config_key": config_key(cfg), "rate": p.get("rate"),
                     "output_throughput": p.get("output_throughput"),
                     "goodput_tokens": p.get("goodput_tokens"),
                     "feasible": p.get("verdict") == "pass", "e2e_p99_s": p.get("e2e_p99_s"),
                     "pruned": p.get("pruned"), "probe": True})
    return rows


def best_row(data: StudyData) -> dict[str, Any] | None:
    feas = [r for r in data.feasible if isinstance(r.get("value"), int | float)]
    if not feas:
        return None
    sign = -1.0 if data.direction == "minimize" else 1.0
    return max(feas, key=lambda r: sign * r["value"])


def closest_row(data: StudyData) -> dict[str, Any] | None:
    """The trial nearest to meeting the SLO: the smallest worst margin."""
    ran = [r for r in data.rows if r.get("margins")]
    if ran:
        return min(ran, key=lambda r: (max(r["margins"].values()), -(r.get("rate") or 0)))
    timed = [r for r in data.rows if isinstance(r.get("e2e_p99_s"), int | float)]
    return min(timed, key=lambda r: r["e2e_p99_s"]) if timed else None


def baseline_row(data: StudyData) -> dict[str, Any] | None:
    return next((r for r in data.rows if r.get("baseline")), None)


# ----------------------------------------------------------------------------- tables


def trials_table(rows: Sequence[Mapping[str, Any]], keys: Sequence[str],
                 unit: str = "req/s") -> Any:
    headers = ["trial", "config", "status", _level(unit), "req/s", "output tok/s",
               "goodput tok/s", "P99 TTFT (s)", "P99 E2E (s)", "attainment",
               "GPU util", "why"]
    body = []
    for r in rows:
        why = r.get("reason") or ""
        detail = str(r.get("detail") or "")
        if detail and not r.get("feasible"):
            # A broken rule's detail already starts with the rule's name.
            why = detail if not why or detail.startswith(f"{why}:") else f"{why}: {detail}"
        status = "met SLO" if r.get("feasible") else str(r.get("status") or r.get("state"))
        if r.get("baseline"):
            status += " (baseline)"
        body.append([r["trial"], config_label(r.get("config") or {}, keys), status,
                     r.get("rate"), r.get("request_throughput"), r.get("output_throughput"),
                     r.get("goodput_tokens") if r.get("feasible") else None,
                     r.get("ttft_p99_s"), r.get("e2e_p99_s"), r.get("attainment"),
                     r.get("gpu_util_mean_pct"), why[:120]])
    return table_from(headers, body, left=3,
                      title="Every trial (a row each: its load test at the rate shown)",
                      kinds={3: "rate", 4: "rate", 7: "s", 8: "s", 9: "frac", 10: "pct"},
                      note="goodput counts only requests that finished without error and "
                           "within every SLO limit, per second of the measured window; it "
                           "is shown only for trials whose load test met the SLO")


def _level(unit: str) -> str:
    return "rate (req/s)" if unit == "req/s" else f"level ({unit})"


def probes_table(probe_rows: Sequence[Mapping[str, Any]], keys: Sequence[str],
                 unit: str = "req/s") -> Any:
    headers = ["config", "probe", "phase", _level(unit), "requests", "verdict", "binding",
               "req/s", "output tok/s", "P99 E2E (s)", "GPU util", "pruned"]
    body = [[config_label(p.get("config") or {}, keys) if p.get("config") else
             (f"trial {p['trial']}" if p.get("trial") is not None else "-"),
             p.get("index"), p.get("phase"), p.get("rate"), p.get("num_prompts"),
             p.get("verdict"), p.get("binding"), p.get("request_throughput"),
             p.get("output_throughput"), p.get("e2e_p99_s"), p.get("gpu_util_pct"),
             p.get("prune_reason") if p.get("pruned") else "no"] for p in probe_rows]
    return table_from(headers, body, title="Ceiling probes", left=1,
                      kinds={3: "rate", 7: "rate", 9: "s", 10: "pct"})


def imported_table(rows: Sequence[Mapping[str, Any]]) -> Any:
    headers = ["run", "rate (req/s)", "req/s", "output tok/s", "P99 TTFT (s)",
               "P99 E2E (s)", "completed + failed"]
    body = [[r.get("study"), r.get("rate"), r.get("request_throughput"),
             r.get("output_throughput"), r.get("ttft_p99_s"), r.get("e2e_p99_s"),
             r.get("num_measured")] for r in rows]
    return table_from(headers, body, title="Imported vllm bench serve results",
                      kinds={1: "rate", 2: "rate", 4: "s", 5: "s"},
                      note="measured by vLLM's own client; P99 E2E from detailed files is "
                           "TTFT plus the sum of inter-token gaps")


# ----------------------------------------------------------------------------- page


def recommendation_blocks(data: StudyData, keys: Sequence[str]) -> list[Any]:
    best = best_row(data)
    blocks: list[Any] = []
    if best is None:
        closest = closest_row(data)
        msg = (f"Nothing met the SLO ({data.slo or 'not recorded'}): none of the "
               f"{len(data.rows)} trials is feasible, so there is no recommendation.")
        blocks.append(Text(msg, "warn"))
        if closest is not None:
            margins = ", ".join(f"{k} {v:+.0%}" for k, v in
                                sorted((closest.get("margins") or {}).items()))
            blocks.append(Text(
                f"Closest trial: #{closest['trial']} "
                f"({config_label(closest.get('config') or {}, keys)}) at "
                f"{fmt_rate(closest.get('rate'))} {data.unit}: P99 E2E "
                f"{fmt_s(closest.get('e2e_p99_s'))} s, attainment "
                f"{fmt_frac(closest.get('attainment'))}"
                + (f"; over the limits by {margins}" if margins else "")
                + (f"; {closest.get('reason')}" if closest.get("reason") else "")
                + ". Try lower rates or more GPUs."))
        return blocks
    ceiling = ceilings_by_config(data).get(best["config_key"], best.get("rate") or 0.0)
    headroom = DEFAULT_HEADROOM
    rec = data.recommendation or {}
    if isinstance(rec.get("headroom"), int | float):
        headroom = float(rec["headroom"])
    cap = ceiling * (1 - headroom)
    # `autotune search` writes recommendation.json; where it speaks of the same trial,
    # its ceiling, cap and command are used so the report and it never disagree.
    rec_best = as_mapping(rec.get("best"))
    same = rec_best.get("trial") == best["trial"]
    if same and isinstance(rec_best.get("max_feasible_rate"), int | float):
        ceiling = float(rec_best["max_feasible_rate"])
        cap = ceiling * (1 - headroom)
    if same and isinstance(rec.get("rate_cap"), int | float):
        cap = float(rec["rate_cap"])
    base = baseline_row(data)
    what = cap_word(data.unit)
    rows = [["config", config_label(best.get("config") or {})],
            ["trial", str(best["trial"])],
            [f"{what} tried ({data.unit})", fmt_rate(best.get("rate"))],
            [f"ceiling ({data.unit})", fmt_rate(ceiling)],
            [f"{what} cap with {headroom:.0%} headroom ({data.unit})", fmt_rate(cap)],
            ["goodput (output tok/s)", f"{best.get('goodput_tokens') or 0:,.0f}"],
            ["goodput (req/s)", fmt_rate(best.get("goodput_requests"))],
            ["P99 E2E (s)", fmt_s(best.get("e2e_p99_s"))],
            ["P99 TTFT (s)", fmt_s(best.get("ttft_p99_s"))],
            ["attainment", fmt_frac(best.get("attainment"))],
            ["GPUs per replica", str(best.get("gpus"))]]
    if base is not None:
        if base.get("feasible") and base.get("goodput_tokens"):
            gain = (best.get("goodput_tokens") or 0) / base["goodput_tokens"] - 1
            fair = equal_gpus(best.get("goodput_tokens"), best.get("gpus"),
                              base["goodput_tokens"], base.get("gpus"))
            rows.append(["vs vLLM defaults (baseline)",
                         f"{gain:+.0%} goodput (baseline #{base['trial']}: "
                         f"{base['goodput_tokens']:,.0f} tok/s"
                         + (f" on {fair['baseline_gpus']} GPU(s) vs {fair['gpus']}"
                            if fair else "") + ")"])
            if fair:
                rows.append(["vs vLLM defaults on equal GPUs", fair["equal_gpus_note"]])
        else:
            rows.append(["vs vLLM defaults (baseline)",
                         f"baseline #{base['trial']} did not meet the SLO "
                         f"({base.get('reason') or base.get('status')})"])
    blocks.append(table_from(["", "recommended"], rows, title="Recommendation", left=2))
    if best.get("how"):
        blocks.append(Text(f"How obtained: {best['how']}.", "note"))
    command = (rec_best.get("command") if same else None) or rec.get("command")
    if not command:
        with contextlib.suppress(Exception):
            cfg = dict(best.get("config") or {})
            command = serve_command(cfg, gpus=range(int(best.get("gpus") or 1)), port=8000,
                                    model=None if cfg.get("model") else "MODEL")
    if command:
        blocks.append(Text(str(command), "pre"))
    return blocks


def fmt_rate(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, int | float) and math.isfinite(x) else "-"


def fmt_s(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, int | float) and math.isfinite(x) else "-"


def fmt_frac(x: Any) -> str:
    return f"{x:.1%}" if isinstance(x, int | float) and math.isfinite(x) else "-"


def build(data: StudyData, plot_dir: Path, rel: str = "plots") -> tuple[Page, dict[str, Path],
                                                                       list[str]]:
    """Draw every figure that has data and lay out the page."""
    prov = provenance(data)
    keys = varying_keys(data.rows)
    page = Page(title=f"autotune report: {data.name}", provenance=prov)

    page.add("Recommendation", *recommendation_blocks(data, keys))
    figs, notes = _draw_figures(data, plot_dir, prov)
    page.add("Figures", *_figure_blocks(figs, notes, rel, prov))
    _add_tables(page, data, keys)
    return page, figs, notes


def _draw_figures(data: StudyData, plot_dir: Path, prov: str
                  ) -> tuple[dict[str, Path], list[str]]:
    """Each figure the study has data for, by name, and the notes on those it lacks,
    so the page says why a figure is missing rather than leaving a gap."""
    figs: dict[str, Path] = {}
    notes: list[str] = []
    ceilings = ceilings_by_config(data, bracketed=True)
    figs["rate_curves"] = plots.rate_curves(
        curve_rows(data), plot_dir / "rate_curves.png", slo=data.slo, provenance=prov,
        ceilings=ceilings, imported=data.imported)
    figs["history"] = plots.history(data.rows, plot_dir / "history.png", provenance=prov)
    figs["pareto"] = plots.pareto(data.rows, plot_dir / "pareto.png", slo=data.slo,
                                  provenance=prov)
    if data.importances:
        figs["importances"] = plots.importances(
            data.importances, plot_dir / "importances.png", provenance=prov,
            evaluator="Optuna's default evaluator, PED-ANOVA")
    notes.append(data.importance_note)  # over which trials, or why there is no plot
    _draw_timeline(data, plot_dir, prov, figs, notes)
    return figs, notes


def _draw_timeline(data: StudyData, plot_dir: Path, prov: str, figs: dict[str, Path],
                   notes: list[str]) -> None:
    """The telemetry of the recommended trial (else the closest to it) into ``figs``,
    with a note in ``notes`` for each series the backend did not record."""
    target = best_row(data) or closest_row(data)
    series = read_timeline(target) if target is not None else {}
    if target is not None and series:
        what = "recommended" if target is best_row(data) else "closest"
        figs["timeline"] = plots.timeline(
            series, plot_dir / "timeline.png", provenance=prov,
            title=f"Over the load test of the {what} config (trial #{target['trial']})")
    else:
        notes.append("no telemetry timeline was recorded for the recommended trial")
    missing = [] if target is None else [
        k for k, name in (("gpu_util_pct", "GPU utilisation"),
                          ("kv_cache_usage_pct", "KV-cache usage")) if not series.get(k)]
    if series and missing:
        notes.append("the timeline has no " + " or ".join(
            {"gpu_util_pct": "GPU utilisation", "kv_cache_usage_pct": "KV-cache usage"}[k]
            for k in missing) + " series (not recorded by this backend)")


def _figure_blocks(figs: Mapping[str, Path], notes: Sequence[str], rel: str,
                   prov: str) -> list[Any]:
    """The drawn figures in the page's order, each captioned with how to read it and
    where its figures come from, then the notes."""
    how = ("each point is one load test: open-loop arrivals at the offered rate, "
           "warm-up excluded, figures over the measured window")
    cap = {
        "rate_curves": ("Goodput and P99 against the offered rate",
                        f"{how}; solid: goodput (0 where the SLO was missed), dashed: all "
                        "output tokens; red line: the SLO; dotted: each config's ceiling "
                        "(highest rate that met the SLO, drawn where a higher rate failed or a "
                        "ceiling search ran); ceiling-search probes are included; "
                        "triangles: pruned load tests; "
                        "crosses: imported vllm bench serve results"),
        "history": ("Optimisation history",
                    "one marker per Optuna trial; the line is the best feasible objective "
                    "so far; hollow markers are infeasible trials, by reason"),
        "pareto": ("Goodput per GPU against P99",
                   f"{how}; goodput divided by the GPUs of one replica (TP x PP); the "
                   "line joins the trials no other feasible trial beats on both"),
        "importances": ("Parameter importances",
                        "Optuna's get_param_importances with its default evaluator "
                        "(PED-ANOVA) over every finished trial: its goodput at its "
                        "ceiling when it met the SLO, 0 when it did not or was pruned"),
        "timeline": ("Telemetry over the load test",
                     "GPU utilisation (NVML) and KV-cache usage (vLLM /metrics) where "
                     "recorded; requests in flight from the client's own windows; each "
                     "series starts at its own first sample"),
    }
    order = ("rate_curves", "history", "pareto", "importances", "timeline")
    blocks: list[Any] = []
    for name in order:
        if name in figs:
            title, text = cap[name]
            blocks.append(Figure(name, f"{rel}/{figs[name].name}", title,
                                 f"{text}. Source: {prov}."))
    blocks += [Text(n, "note") for n in notes]
    return blocks


def _add_tables(page: Page, data: StudyData, keys: Sequence[str]) -> None:
    """The sections after the figures: every trial, the ceiling probes (or why there
    are none), imported results, and the commands that reproduce the page."""
    page.add("Trials", trials_table(data.rows, keys, data.unit))
    probe_rows = ceiling_probe_rows(data.ceilings)
    if probe_rows:
        answers = [Text(str(c["answer"]), "p") for c in data.ceilings if c.get("answer")]
        page.add("Ceiling probes", *answers, probes_table(probe_rows, keys, data.unit))
    else:
        page.add("Ceiling probes", Text("no ceiling search was run for this study "
                                        "(`autotune ceiling` or `search --refine-top`)",
                                        "note"))
    if data.imported:
        page.add("Imported results", imported_table(data.imported))
    page.add("Reproduce", Text(
        f"optuna-dashboard {data.storage}\nautotune report {data.name} --storage "
        f"{data.storage}", "pre"))


# ----------------------------------------------------------------------------- write


TRIAL_CSV_COLUMNS = ("trial", "state", "status", "feasible", "reason", "rate",
                     "request_throughput", "output_throughput", "goodput_tokens",
                     "goodput_requests", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s",
                     "attainment", "gpu_util_mean_pct", "gpus", "backend", "source",
                     "config_key")


def trials_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(TRIAL_CSV_COLUMNS)
    for r in rows:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in TRIAL_CSV_COLUMNS])
    return buf.getvalue()


def write_report(
    study_name: str,
    storage: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    imported: Sequence[Mapping[str, Any]] = (),
) -> ReportPaths:
    """Write ``report.html``, ``report.md``, ``plots/*.png`` and ``trials.csv``.

    ``storage`` defaults to ``sqlite:///studies/<name>.db``, ``out_dir`` to
    ``studies/<name>/``.  ``imported``: rows from
    :func:`autotune.analysis.vllm_results.read_vllm_rows` to draw next to the trials.
    Raises :class:`ReportError` for an unknown or empty study, before writing anything.
    """
    out = Path(out_dir) if out_dir is not None else Path("studies") / study_name
    data = gather(study_name, storage, out, imported=imported)
    out.mkdir(parents=True, exist_ok=True)
    plot_dir = out / "plots"
    page, figs, notes = build(data, plot_dir)
    html_path, md_path, csv_path = out / "report.html", out / "report.md", out / "trials.csv"
    atomic_write(md_path, markdown(page))
    atomic_write(html_path, html_page(page))
    atomic_write(csv_path, trials_csv(data.rows))
    return ReportPaths(out_dir=out, html=html_path, markdown=md_path, trials_csv=csv_path,
                       plots=figs, notes=notes)


# ----------------------------------------------------------------------------- deploy


def replica_results(data: StudyData) -> list[Any]:
    """Every feasible trial (and ceiling result) as a :class:`deploy.ReplicaResult`.

    Where the ceiling search ran on a config, its ``feasible_max`` and the goodput of
    the passing probe there replace the single rate the trial happened to try.
    """
    probes: dict[str, tuple[float, float | None, float | None]] = {}
    for p in ceiling_probe_rows(data.ceilings):
        key = p.get("config_key")
        if key is None and p.get("trial") is not None:
            key = next((r["config_key"] for r in data.rows if r["trial"] == p["trial"]), None)
        fm = p.get("feasible_max")
        if key and fm is not None and p.get("rate") == fm and p.get("verdict") == "pass":
            probes[key] = (fm, p.get("goodput_tokens"), p.get("request_throughput"))
    out = []
    for r in data.feasible:
        cfg = r.get("config") or {}
        tp = int(cfg.get("tensor_parallel_size", 1) or 1)
        rate, good_t, good_r = r.get("rate"), r.get("goodput_tokens"), r.get("goodput_requests")
        source = r.get("source") or ""
        if r["config_key"] in probes:
            fm, pt, pr = probes[r["config_key"]]
            if pt is not None and pr is not None and fm >= (rate or 0):
                rate, good_t, good_r = fm, pt, pr
                source += " (ceiling search)"
        if not rate or good_t is None or good_r is None:
            continue
        pp = int(cfg.get("pipeline_parallel_size", 1) or 1)
        out.append(ReplicaResult(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 ceiling_rate=float(rate),
                                 goodput_tokens=float(good_t), goodput_requests=float(good_r),
                                 config=cfg, p99_e2e_s=r.get("e2e_p99_s"), trial=r["trial"],
                                 source=source))
    return out
