"""The search pipeline as a library call: ``run_search(SearchOptions(...))``.

Prescreen on the simulator (optional), the Optuna study (each trial one config, one
server start, its ceiling searched on the running server), refinement (optional),
validation of the recommended cap, the recommendation and the report.  The CLI parses
its options into :class:`SearchOptions` and calls :func:`run_search` once.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from autotune.analysis import recommend as rec_mod
from autotune.analysis.recommend import flags_line, table_row, view_of
from autotune.analysis.tiers import TIERS_ATTR, TierAnswer, answer_tiers, proven_tier
from autotune.backends.base import LoadPlan
from autotune.backends.factory import BackendSpec, create_backend
from autotune.core.files import atomic_write, json_safe, write_json
from autotune.core.metrics import MEASURED, SIMULATED
from autotune.core.terminal import console, err_console, mask_url
from autotune.report.trackers import make_trackers, optuna_callback
from autotune.search.options import SearchOptions
from autotune.servers.process import interrupted_code
from autotune.study.optuna_adapter import quiet_logging
from autotune.study.seats import TAKEN_OVER_WHY
from autotune.study.space import CLIENT_PARAMS, SearchSpace
from autotune.study.storage import open_storage
from autotune.study.study import (
    SCREEN_PROBES,
    SETTINGS_ATTR,
    StudySettings,
    append_load_test,
    make_sampler,
    prescreen_enqueue,
    rate_bounds,
    refine_ceilings,
    rows_from_study,
    run_study,
)
from autotune.study.study_twin import PROFILE_FILE, StudyTwin
from autotune.study.worker import StudySpec, load_spec, space_to_dict
from autotune.tuning.ceiling import closed_plan, lent_evidence, search_steady
from autotune.tuning.floor import LightTest, advice, floors, light_tests_of
from autotune.tuning.load_unit import RATE, LoadUnit
from autotune.tuning.options import DEFAULT_CONTEXT, OptionsError
from autotune.tuning.record import stored_trials
from autotune.tuning.validation import validate_cap
from autotune.tuning.verdict import screening
from autotune.workload.pool import pool_workload
from autotune.workload.sources import pool_size

if TYPE_CHECKING:
    from autotune.analysis.recommend import RecommendError
    from autotune.backends.base import Backend


@dataclass(frozen=True)
class ProofSize:
    """The proof after a screened study, for the time estimate: ``configs`` proven
    (--prove-top), each by 1 to ``max_probes`` full tests of ``min_s`` to ``max_s``."""

    configs: int
    min_s: float
    max_s: float
    max_probes: int


def _span_s(lo: float, hi: float) -> str:
    return f"{lo:g} s" if lo == hi else f"{lo:g} to {hi:g} s"


def time_estimate(*, n_trials: int, min_s: float, max_s: float, max_probes: int,
                  validate_s: float | None, budget_s: float | None, virtual: bool,
                  proof: ProofSize | None = None) -> str:
    """How long a study may take, before it starts: each trial is one server start and
    its load tests; a config that cannot beat the best so far stops after one test, the
    first ones (no incumbent) run a saturation probe and a whole rate search.  With
    ``proof``, the trials' tests are screening tests and the proof's full tests follow."""
    def span(seconds: float) -> str:
        return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"

    low = (n_trials + 3) * min_s
    high = n_trials * max_probes * max_s
    tests = f"1 to {max_probes} (--max-probes) load tests of {_span_s(min_s, max_s)}"
    if proof is not None:
        tests = (f"1 to {max_probes} screening tests of {_span_s(min_s, max_s)}, then the "
                 f"{proof.configs} best proven by 1 to {proof.max_probes} (--max-probes) "
                 f"tests of {_span_s(proof.min_s, proof.max_s)} each")
        low += proof.configs * proof.min_s
        high += proof.configs * proof.max_probes * proof.max_s
    text = (f"time: {n_trials} trials of {tests}: about {span(low)} to {span(high)} of "
            "load tests, plus a server start per trial")
    if validate_s:
        text += f" and the {span(validate_s)} validation"
    if budget_s is not None:
        text += (f"; --budget stops it at {span(budget_s)}"
                 + (" (validation included)" if validate_s else ""))
        if budget_s < high + (validate_s or 0.0):
            text += ", before the longest case"
    return text + (" (virtual time: the simulator runs it in seconds)" if virtual else "")


def _settings(o: SearchOptions) -> StudySettings:
    """The study's settings: everything :class:`SearchOptions` implies that needs a file
    read (the simulator's profiles, the sampler's packages, the storage's driver), so a
    bad one fails here, before anything is written."""
    make_sampler(o.sampler, seed=o.workload.seed, space=o.space)  # e.g. GP without PyTorch
    url = o.storage_url
    if o.storage:
        _check_storage_url(url)
    # The default simulated study must finish in well under two minutes even on a busy
    # 2-core machine: without --n-trials/--timeout it stops starting trials at 75 s.
    timeout_s = o.timeout_s if (o.timeout_s is not None or o.n_trials
                                or o.backend != "sim") else 75.0
    budget_s = o.budget_s
    if budget_s is not None and o.validate_s is not None:
        budget_s -= o.validate_s  # the validation run is paid from the same budget
    return StudySettings(
        name=o.name, slo=o.slo, space=_fit_space(o), sampler=o.sampler, storage=url,
        studies_dir=o.studies_dir, objective=o.objective, per_gpu=o.per_gpu, gpus=o.sim.gpus,
        seed=o.workload.seed, n_trials=o.n_trials or (30 if o.backend == "sim" else 20),
        timeout_s=timeout_s, budget_s=budget_s, prune=o.prune, beat_incumbent=o.prune,
        attention_heads=_attention_heads(o), tol=o.rates.tol, max_probes=o.rates.max_probes,
        headroom=o.rates.headroom, screen=o.prove_top > 0, unit=o.unit)


def _attention_heads(o: SearchOptions) -> int | None:
    """The model's attention heads (for TP rules), checking every simulator profile the
    run will load so a bad one fails before anything starts."""
    if not (o.backend == "sim" or o.prescreened or o.twin is not None
            or (o.backend == "vllm" and o.profile_given)):
        return o.space.attention_heads
    heads = o.sim.load()[1].num_attention_heads
    if o.twin is not None:
        o.twin.node(o.sim).load("--twin-prior")
    return heads


def _study_attrs(o: SearchOptions, settings: StudySettings, wl: Any, load_plan: Any
                 ) -> dict[str, Any]:
    """What the study stores of how it is measured, beside the SLO and space: plain
    attributes for people (optuna-dashboard), and the settings another command needs to
    measure a trial's config the same way."""
    sim, w, rule = o.backend == "sim", o.workload, o.steady
    inherited = {
        "slo": str(o.slo), "profile": o.sim.hardware, "sim_model": o.sim.model,
        "gpus": o.sim.gpus, "num_prompts": w.num_prompts, "warmup": w.warmup, "seed": w.seed,
        "tol": o.rates.tol, "max_probes": o.rates.max_probes, "headroom": o.rates.headroom,
        "tokenizer": w.tokenizer, "max_model_len": _sample_max_len(o, settings),
        # As the options read them, so `ceiling --study` parses them as its own.
        "min_duration": _seconds_text(rule.min_duration_s),
        "max_duration": _seconds_text(rule.max_duration_s),
        "backlog_share": rule.backlog_share}
    bounds = rate_bounds(settings.space)
    if bounds is not None:
        inherited["min_rate"], inherited["max_rate"] = bounds
    return {"backend": o.backend, "source": SIMULATED if sim else MEASURED,
            "profile": f"{o.sim.node}, {o.sim.model}" if sim else None,
            "workload": f"{wl.source} ({len(load_plan.requests)} requests, "
                        f"{load_plan.warmup} warm-up)",
            "tokenizer": wl.tokenizer, SETTINGS_ATTR: inherited,
            **_worker_spec(o, settings)}


def _seconds_text(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds:g}s"


def _worker_spec(o: SearchOptions, settings: StudySettings) -> dict[str, Any]:
    """The spec an ``autotune worker`` given only --study runs this study's trials with
    (without it, a worker started beside its search had no space to join with)."""
    w = o.workload
    workload = {"kind": "pool", **o.pool.spec(), "total": pool_size(w.num_prompts) + w.warmup,
                "num_prompts": w.num_prompts,
                "max_model_len": _sample_max_len(o, settings), "seed": w.seed}
    if w.tokenizer:
        workload["tokenizer"] = w.tokenizer
    spec = StudySpec(
        space=space_to_dict(settings.space), slo=str(o.slo), objective=o.objective,
        per_gpu=o.per_gpu, sampler=settings.sampler, seed=w.seed,
        n_trials=settings.n_trials, gpus=o.sim.gpus, prune=settings.prune,
        workload=workload, sim={"hardware": o.sim.hardware, "model": o.sim.model},
        load=load_spec(warmup=w.warmup, seed=w.seed,
                       min_duration_s=o.steady.min_duration_s,
                       max_duration_s=o.steady.max_duration_s,
                       backlog_share=o.steady.backlog_share,
                       max_probes=o.rates.max_probes, tol=o.rates.tol,
                       unit=o.unit.spec()))
    return spec.attrs()


def _sample_max_len(o: SearchOptions, settings: StudySettings) -> int:
    """The longest ShareGPT pair (prompt + output tokens) the workload keeps."""
    fixed = settings.space.fixed.get("max_model_len")
    return o.workload.max_model_len or int(fixed or DEFAULT_CONTEXT)


def _check_storage_url(url: str) -> None:
    """A URL sqlalchemy cannot even parse, or whose database driver is missing, fails
    here before the workload is built (reachability is checked when it is opened)."""
    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ImportError) as exc:
        raise OptionsError(f"cannot open storage {url}: {exc}") from None


def _workload(o: SearchOptions, settings: StudySettings) -> Any:
    w, p = o.workload, o.pool
    return pool_workload(dataset=p.dataset, tokenizer_path=w.tokenizer, url=None, model=None,
                         total=pool_size(w.num_prompts) + w.warmup,
                         context=_sample_max_len(o, settings), seed=w.seed,
                         input_len=256, output_len=128, multi_turn=p.multi_turn,
                         prefix_share=p.prefix_share)


def _load_plan(slo: Any, wl: Any, warmup: int, seed: int, steady: Any = None) -> Any:
    reqs = list(wl.requests)
    n_warm = min(warmup, max(len(reqs) - 1, 0))
    return LoadPlan(slo=slo, requests=reqs[n_warm:], warmup_requests=reqs[:n_warm],
                    warmup=n_warm, seed=seed, window_s=1.0, steady=steady)


def _backend(o: SearchOptions, settings: StudySettings) -> Backend:
    model = settings.space.fixed.get("model")
    server = o.server
    return create_backend(BackendSpec(
        kind=o.backend, hardware=o.sim.node, sim_model=o.sim.model, url=server.url,
        model=None if model is None else str(model), vllm_cmd=server.vllm_cmd,
        log_dir=settings.out_dir / "logs", env=dict(server.env),
        startup_timeout_s=server.startup_timeout_s,
        gpu_ids=None if server.gpu_ids is None else list(server.gpu_ids), gpus=o.sim.gpus))


def _attach_space(space: SearchSpace) -> SearchSpace:
    """An attached server cannot restart: only client-side parameters are searched."""
    params = {k: v for k, v in space.params.items() if k in CLIENT_PARAMS}
    if not params:
        raise OptionsError(f"space {space.name} has no request_rate to search on an attached "
                         "server")
    base = {k: v for k, v in space.baseline.items() if k in params}
    return replace(space, params=params, baseline=base, rules=())


# ----------------------------------------------------------------------------- live view


# A running real load test prints a progress line this often (seconds of arrivals).
PROGRESS_EVERY_S = 30.0


class LiveView:
    """A rich table of the trials so far (one line per trial when not a terminal)."""

    def __init__(self, out: Console, slo: Any, backend: str, unit: LoadUnit = RATE) -> None:
        self.out = out
        self.slo = slo
        self.unit = unit
        self.rows: list[list[str]] = []
        self.live: Live | None = None
        self.how = (SIMULATED if backend == "sim"
                    else MEASURED)
        self.shown: dict[tuple[str, int, float], float] = {}  # progress line last printed at

    def __enter__(self) -> LiveView:
        if self.out.is_terminal:
            self.live = Live(self._table(), console=self.out, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def _table(self) -> Table:
        t = Table(title=f"trials ({self.how}; SLO {self.slo})", title_justify="left")
        level = "rate" if self.unit.closed is None else self.unit.label
        for col in ("#", "config", level, "goodput tok/s", "P99 e2e s", "result"):
            t.add_column(col, justify="left" if col in ("config", "result") else "right")
        for row in self.rows[-20:]:
            t.add_row(*row)
        return t

    def _level(self, rate: float) -> str:
        if self.unit.closed is None or math.isinf(rate):
            return f"{rate:.3g} req/s"
        return self.unit.fmt(rate)

    def probe(self, number: int, p: Any, what: str = "trial") -> None:
        """Each load test of a trial's rate search as it ends: a plain line, so a log
        file or a pod shows progress while a real trial runs for minutes."""
        if self.how.startswith("simulated"):
            return  # virtual time: a whole study takes seconds, the trial lines suffice
        rate = self._level(p.rate)
        ev = p.evidence
        how = "" if ev is None else (f" after {ev.at_s:.0f} s of arrivals, {ev.cohort} "
                                     f"requests judged: {ev.reasons[0][:100]}")
        self.out.print(f"  {what} {number} load test {p.index + 1} ({p.phase}) at {rate}:"
                       f" {p.verdict}{how}", soft_wrap=True, highlight=False, markup=False)

    def progress(self, number: int, rate: float, ev: Any, what: str = "trial") -> None:
        """A running load test, every ``PROGRESS_EVERY_S`` of its arrivals: a plain line
        (sent, completed, in flight, judged, the served share, each limit so far, the
        verdict so far), so a log shows a real test of minutes moving."""
        if self.how.startswith("simulated") or math.isinf(rate):
            return
        key = (what, number, rate)
        if ev.at_s < self.shown.get(key, 0.0) + PROGRESS_EVERY_S:
            return
        self.shown[key] = ev.at_s
        limits = ", ".join(f"{lim.label} {lim.observed_s:.3g} s" for lim in ev.limits)
        served = (f"{100 * ev.served_share:.0f}% of arrivals served"
                  if math.isfinite(ev.served_share) else "none served yet")
        self.out.print(f"  {what} {number} at {self._level(rate)}: {ev.at_s:.0f} s of "
                       "arrivals, "
                       f"{ev.sent} sent, {ev.completed} completed, "
                       f"{ev.sent - ev.completed} in flight, {ev.cohort} judged, {served}, "
                       f"{limits} so far: {ev.verdict} so far",
                       soft_wrap=True, highlight=False, markup=False)

    def add(self, number: int, result: Any, violations: list[Any]) -> None:
        if result is None:
            row = [str(number), "", "", "-", "-",
                   "not launched: " + "; ".join(str(v) for v in violations)]
        else:
            s = result.summary
            # The trial's value (steady-state), as the recommendation prints it.
            good = "-" if s is None or not result.feasible else f"{result.goodput():,.0f}"
            p99 = "-" if s is None or not math.isfinite(s.e2e.p99) else f"{s.e2e.p99:.2f}"
            if result.feasible:
                verdict = "ceiling"
            elif result.status == "pruned" and result.prune is not None:
                verdict = f"pruned at {result.prune.at_s:.0f}s: {result.reason}"
            elif result.status == "pruned" or result.reason == "below_incumbent":
                verdict = ("below_incumbent: fails the level that beats the best "
                           f"({self.unit.fmt(result.rate)})")
            else:
                verdict = f"infeasible: {result.reason}"
                # Whole: a cut mid-reason hid the part that decided (the steady
                # half's bound, behind "(st").
                if result.detail and result.reason != "slo_missed":
                    verdict += f" ({result.detail})"
            level = (f"{result.rate:.2f}" if self.unit.closed is None
                     else f"{result.rate:.0f}")
            row = [str(number), flags_line(result.flags), level, good, p99, verdict]
        self.rows.append(row)
        if self.live is not None:
            self.live.update(self._table())
        else:
            self.out.print(f"trial {row[0]:>3}  {row[1]:<48} {self.unit.label} {row[2]:>6}  "
                           f"goodput {row[3]:>8}  p99 {row[4]:>6}  {row[5]}",
                           soft_wrap=True, highlight=False)


# ----------------------------------------------------------------------------- main


def run_search(o: SearchOptions) -> int:
    """The whole pipeline: prescreen, study, refinement, validation, recommendation,
    report.  Returns the exit code (0, 1 when no config met the SLO, 130 on Ctrl-C)."""
    quiet_logging()
    settings = _settings(o)
    # A missing tracker package fails here, before anything is written or run.
    trackers = make_trackers(wandb_project=o.wandb, mlflow_uri=o.mlflow)
    on_trial_end = optuna_callback(trackers, settings.name) if trackers else None
    wl = _workload(o, settings)
    load_plan = _load_plan(o.slo, wl, o.workload.warmup, o.workload.seed, o.steady)
    # The first write: everything else is checked.  PostgreSQL/MySQL get heartbeats and
    # retries (autotune.study.storage), so `autotune worker`s can share the study.
    if not o.storage:
        _make_studies_dir(o)
    storage = open_storage(o.storage_url)
    out = console
    _print_header(o, settings, wl, load_plan, out)
    # The first configs come from the simulator whenever a profile is known: a real
    # study given --profile is pre-screened unless told otherwise.
    enqueue = _prescreen(o, settings, load_plan, storage, out) if o.prescreened else []
    backend = _backend(o, settings)
    server0 = backend.server_s
    server_all = 0.0
    twin = _twin(o, settings, load_plan, out)
    phases: dict[str, float] = {}  # wall seconds of each phase, said at the end
    try:
        with LiveView(out, o.slo, o.backend, o.unit) as view:
            run = run_study(settings, backend, load_plan, storage=storage,
                            enqueue=enqueue, on_result=view.add, on_trial_end=on_trial_end,
                            on_probe=view.probe, on_progress=view.progress,
                            attrs=_study_attrs(o, settings, wl, load_plan),
                            **_twin_hooks(twin, out))
        rec = _recommend_proved(o, settings, run, backend, load_plan, out, view, server0,
                                phases)
    except rec_mod.RecommendError as exc:
        _no_recommendation(exc, o, run, load_plan)
        _report(settings, out)  # the trials that ran are still worth a look
        return 1
    except (KeyboardInterrupt, SystemExit) as exc:
        code = interrupted_code(exc)
        if code is None:
            raise
        err_console.print(f"interrupted: the finished trials are kept in "
                          f"{mask_url(settings.storage or '')}; run the same command to "
                          "resume", soft_wrap=True)
        return code
    finally:
        server_all = backend.server_s - server0
        backend.close()
        for t in trackers:
            with contextlib.suppress(Exception):
                t.close()
    _add_run_notes(rec, o, run, server_all)
    _write_answer(settings, rec, out, phases)
    return 0


def _fit_space(o: SearchOptions) -> SearchSpace:
    """The space narrowed or completed to what this backend can start and report."""
    if o.backend == "attach":
        return _attach_space(o.space)
    if o.server.model:
        # --model over the space's: the server launches it, and the recommendation's
        # `vllm serve` line names the model that was measured.
        return replace(o.space, fixed={**o.space.fixed, "model": o.server.model})
    return o.space


def _make_studies_dir(o: SearchOptions) -> None:
    """Create the default storage's folder, failing as an option error if it cannot be."""
    # --studies-dir is autotune's own output folder (only a --storage URL names a
    # folder that must already exist).
    try:
        Path(o.studies_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OptionsError(f"--studies-dir {o.studies_dir}: cannot create it "
                           f"({exc.strerror or exc})") from None


def _print_header(o: SearchOptions, settings: StudySettings, wl: Any, load_plan: Any,
                  out: Console) -> None:
    """Say up front what is measured and how long it may take, before any server starts."""
    rule = o.steady
    out.print(f"study [bold]{settings.name}[/] ({mask_url(settings.storage or '')}); "
              f"backend {o.backend}; "
              f"space {settings.space.name}; SLO {o.slo}; workload {wl.source} "
              f"({len(load_plan.requests)} requests, cycled), tokens counted with "
              f"{wl.tokenizer}; each trial starts its config once and searches its ceiling; "
              f"each load test: {load_plan.warmup} warm-up requests excluded, then at least "
              f"{rule.min_s(o.slo):g} s of arrivals and {rule.min_requests} requests "
              f"before it may pass, up to {rule.max_s(o.slo):g} s, stopped as soon as "
              "its steady-state verdict is certain", soft_wrap=True)
    out.print(_time_line(o, settings), soft_wrap=True)


def _recommend_proved(o: SearchOptions, settings: StudySettings, run: Any, backend: Backend,
                      load_plan: Any, out: Console, view: LiveView, server0: float,
                      phases: dict[str, float]) -> Any:
    """Turn the study into a recommendation, proved and validated where asked, so the
    answer rests on full tests rather than screening ones."""
    views = _views(run.study)
    bounds = rate_bounds(settings.space)
    objective = {"tokens": "output tok/s", "requests": "req/s"}.get(o.objective, o.unit.label)
    rec = rec_mod.recommend(
        views, slo=str(o.slo), objective=objective + (" per GPU" if o.per_gpu else ""),
        headroom=o.rates.headroom,
        rate_high=bounds[1] if bounds and o.unit.closed is None else None)
    rec.unit = o.unit.label
    _whole_cap(rec, o.unit)
    phases["study"] = run.wall_s
    ceilings: list[Any] = []
    if o.prove_top:
        t0 = time.monotonic()
        ceilings = _prove(o, settings, run, backend, load_plan, out, view,
                          deadline_s=None if settings.budget_s is None
                          else server0 + settings.budget_s)
        rec = rec_mod.apply_ceilings(rec, views, [c.to_dict() for c in ceilings],
                                     objective=o.objective, per_gpu=o.per_gpu)
        _whole_cap(rec, o.unit)
        phases["proof"] = time.monotonic() - t0
    if o.tiers:
        rec.tiers = [a.to_dict() for a in _tiers(o, settings, run, backend, load_plan, view,
                                                 ceilings, out, server0)]
    if o.backend == "attach":
        rec.best.command = (f"(attached server at {o.server.url}: autotune did not launch it and "
                            "cannot see its flags; keep them and enforce the rate cap)")
    if o.validate_s and rec.rate_cap:
        t0 = time.monotonic()
        proof = next((c.result for c in ceilings if c.trial == rec.best.trial
                      and hasattr(c.result, "probes")), None)
        _validate_cap(rec, backend, load_plan, o, settings, out, proof=proof,
                      deadline_s=None if settings.budget_s is None
                      else server0 + settings.budget_s + o.validate_s)
        phases["validation"] = time.monotonic() - t0
    _rate_table(rec, run.study, backend)
    return rec


def _whole_cap(rec: Any, unit: LoadUnit) -> None:
    """A cap in users is whole users under the ceiling, as the ceiling search's is."""
    top = rec.best.max_feasible_rate
    if unit.closed is not None and top is not None and rec.rate_cap is not None:
        rec.rate_cap = unit.cap(top, rec.headroom)


def _tiers(o: SearchOptions, settings: StudySettings, run: Any, backend: Backend,
           load_plan: Any, view: LiveView, ceilings: list[Any], out: Console,
           server0: float) -> list[TierAnswer]:
    """Each tier's answer: re-judged from the proof's tests where they allow, else the
    ceiling search under the tier's own SLO on the configs the proof ran."""
    answers = answer_tiers(o.tiers, ceilings, study=settings.name, headroom=o.rates.headroom,
                           unit=o.unit)
    for i, (tier, answer) in enumerate(zip(o.tiers, answers, strict=True)):
        if answer.trial is None and o.prove_top:
            out.print(f"proving tier {tier.name} ({tier.slo}): no test of the proof met it; "
                      "the ceiling search under its own SLO on the proven configs",
                      soft_wrap=True, highlight=False)
            proofs = refine_ceilings(
                run.rows, backend, replace(load_plan, slo=tier.slo), top_k=o.prove_top,
                headroom=o.rates.headroom, tol=o.rates.tol, max_probes=o.rates.max_probes,
                deadline_s=None if settings.budget_s is None else server0 + settings.budget_s,
                on_probe=functools.partial(_tier_probe, view, f"tier {tier.name}, trial"),
                unit=o.unit)
            answers[i] = proven_tier(tier, proofs, study=settings.name)
        out.print(f"tier {answers[i].sentence}", soft_wrap=True, highlight=False)
    # Kept in the study for `autotune recommend --tier-gpus`.
    run.study.set_user_attr(TIERS_ATTR, json_safe([a.to_dict() for a in answers]))
    return answers


def _tier_probe(view: LiveView, label: str, trial: int, probe: Any) -> None:
    view.probe(trial, probe, label)


def _no_recommendation(exc: RecommendError, o: SearchOptions, run: Any, load_plan: Any
                       ) -> None:
    """Say why there is no answer, with how the run ended, since that is what to change."""
    text = str(exc)
    if isinstance(exc, rec_mod.NothingFeasible):
        floor = _floor_note(run.study, o.slo, load_plan, o.unit)
        if floor:  # "lower the rate" is the wrong advice there: say why instead
            text = f"{exc.finding}: {floor}"
    # How the run ended is part of the answer: a budget that ran out is the first
    # thing to raise when nothing met the SLO in time.
    text += (f" (this run: {run.new_trials} new trials, {run.server_s:.0f} s server "
             f"time, stopped by {run.stopped_by})")
    err_console.print(f"[bold red]no recommendation:[/] {text}", soft_wrap=True)


def _add_run_notes(rec: Any, o: SearchOptions, run: Any, server_all: float) -> None:
    """Note how this run went (retries, takeovers, time spent) beside the answer."""
    if run.stale_failed:
        rec.notes.append(f"trials {run.stale_failed} were left running by a killed process: "
                         "marked failed and retried")
    if run.taken_over:
        rec.notes.append(f"trials {run.taken_over} were failed by another process while they "
                         f"ran here ({TAKEN_OVER_WHY}); their configs were queued again")
    pruned = sum(1 for r in run.rows if r.reason == "below_incumbent")
    rec.notes.append(
        f"this run: {run.new_trials} new trials"
        + (f" ({run.ran_here} here, {run.new_trials - run.ran_here} by workers)"
           if run.ran_here < run.new_trials else "")
        + f" in {run.wall_s:.1f} s wall, "
        f"{run.server_s:.0f} s server time ({'virtual' if o.backend == 'sim' else 'wall'}"
        f", restarts included), stopped by {run.stopped_by}; {pruned} trials stopped after "
        "one load test below the incumbent's rate; "
        f"{server_all:.0f} s server time in all (study, proof and validation)")


def _write_answer(settings: StudySettings, rec: Any, out: Console,
                  phases: dict[str, float]) -> None:
    """Write and print the recommendation, then the report, and where the time went."""
    folder = settings.out_dir
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "recommendation.json", rec.to_dict())
    md = rec_mod.to_markdown(rec)
    atomic_write(folder / "recommendation.md", md)
    _print(out, rec, folder)
    t0 = time.monotonic()
    _report(settings, out)
    phases["report"] = time.monotonic() - t0
    out.print("wall time by phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
              + f" ({sum(phases.values()):.1f} s in all)", soft_wrap=True)


def _time_line(o: SearchOptions, s: StudySettings) -> str:
    """The study's time estimate: screening tests then the proof's, or full tests."""
    rule, slo = o.steady, o.slo
    proof, probes = None, s.max_probes
    if s.screen:
        proof = ProofSize(o.prove_top, rule.min_s(slo), rule.max_s(slo), s.max_probes)
        rule, probes = screening(rule, slo), min(s.max_probes, SCREEN_PROBES)
    return time_estimate(
        n_trials=s.n_trials or 0, min_s=rule.min_s(slo), max_s=rule.max_s(slo),
        max_probes=probes,
        validate_s=o.validate_s, budget_s=None if s.budget_s is None
        else s.budget_s + (o.validate_s or 0.0), virtual=o.backend == "sim",
        proof=proof)


def _prove(o: SearchOptions, settings: StudySettings, run: Any, backend: Any, load_plan: Any,
           out: Console, view: LiveView, *, deadline_s: float | None = None) -> list[Any]:
    """Prove once: the full steady-state ceiling search on the best screened configs,
    on the study's backend; its load tests report as the study's do (a real proof runs
    for many minutes)."""
    how = SIMULATED if backend.mode == "virtual" else MEASURED
    out.print(f"proving the {o.prove_top} best screened configs ({how}; the full ceiling "
              "search from each one's screened rate, to --tol, every test a sequential "
              "test of each limit, pooled across the config's rates)", soft_wrap=True)

    def show(c: Any) -> None:
        out.print(f"  ceiling of trial {c.trial}: {c.result.sentence()}", soft_wrap=True,
                  highlight=False)

    return refine_ceilings(run.rows, backend, load_plan, top_k=o.prove_top,
                           headroom=o.rates.headroom, tol=o.rates.tol,
                           max_probes=o.rates.max_probes, unit=o.unit,
                           out_dir=settings.out_dir, on_ceiling=show,
                           deadline_s=deadline_s,
                           on_probe=lambda n, p: view.probe(n, p, "proof of trial"),
                           on_progress=lambda n, r, ev: view.progress(n, r, ev,
                                                                      "proof of trial"))


def _report(settings: StudySettings, out: Console) -> None:
    """The HTML/Markdown report; a failure here must never lose the study."""
    try:
        # Loads matplotlib, only now: a report that cannot be drawn must not lose the study.
        from autotune.report import write_report

        paths = write_report(settings.name, settings.storage, settings.out_dir)
    except Exception as exc:  # the study and recommendation are already saved
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        err_console.print(f"warning: no report written ({type(exc).__name__}: {first}); "
                          f"the study is saved: run autotune report --study-name {settings.name}",
                          soft_wrap=True)
        return
    html, md = getattr(paths, "html", None), getattr(paths, "markdown", None)
    out.print(f"wrote report {html} and {md}", soft_wrap=True)


def _prescreen(o: SearchOptions, settings: StudySettings, load_plan: Any, storage: Any, out: Console
               ) -> list[tuple[dict[str, Any], dict[str, Any]]]:

    sim = create_backend(BackendSpec(kind="sim", hardware=o.sim.node, sim_model=o.sim.model))
    pre = replace(settings, name=settings.name + "-prescreen", n_trials=o.prescreen_trials,
                  timeout_s=None, budget_s=None)
    run = run_study(pre, sim, load_plan, storage=storage)
    picks = prescreen_enqueue(rows_from_study(run.study), settings.space,
                              top_k=o.top_k)
    out.print(f"pre-screen: {run.new_trials} simulated trials in {run.wall_s:.1f} s; "
              f"measuring the top {len(picks)} configs first, each at its predicted "
              "ceiling", soft_wrap=True)
    return picks


def _twin(o: SearchOptions, settings: StudySettings, load_plan: Any, out: Console) -> Any:
    """The study's twin (``--twin``), starting from its prior profile; None without."""
    if o.twin is None:
        return None
    prior = o.twin.node(o.sim)
    hardware, model = prior.load("--twin-prior")
    twin = StudyTwin.for_study(prior=hardware, model=model, settings=settings,
                               plan=load_plan, candidates=o.twin.candidates)
    out.print(f"twin: the simulator on {prior.node}, {prior.model} "
              "learns this server: after each trial its profile is refitted to every load "
              f"test so far ({settings.out_dir / PROFILE_FILE}), the next trial is "
              f"its best of {o.twin.candidates} simulated trials, and each trial starts at "
              "its predicted ceiling (predictions simulated, load tests measured)",
              soft_wrap=True)
    return twin


def _twin_hooks(twin: Any, out: Console) -> dict[str, Any]:
    """``run_study``'s twin hooks, printing what the twin learns and picks."""
    if twin is None:
        return {}

    def say(text: str) -> None:
        out.print(text, soft_wrap=True, highlight=False)

    def warn(text: str) -> None:
        err_console.print(text, soft_wrap=True)

    return twin.hooks(say=say, warn=warn)


def _views(study: Any) -> list[Any]:
    return [view_of(t) for t in stored_trials(study)]


def _floor_note(study: Any, slo: Any, load_plan: Any, unit: LoadUnit = RATE) -> str | None:
    """When no config met the SLO: is a limit missed even where a config kept up with
    the load (so a lower rate cannot help)?  From each trial's lowest-rate test (of a
    search by rate: a search by users has its light-load tests, in req/s)."""
    trials = stored_trials(study)
    tests = ([LightTest.of(t.number, t.rate, t.evidence) for t in trials]
             if unit.closed is None else [])
    tests += [lt for t in trials for lt in light_tests_of(t.number, t.probes(trials))]
    under = floors(slo, [t for t in tests if t is not None])
    if not under:
        return None
    return advice(under, output_tokens=[r.output_tokens for r in load_plan.requests])


def _rate_table(rec: Any, study: Any, backend: Any) -> None:
    """The seed-style table for the recommended config, from its own trial's load tests
    (the rate search) and the validation runs: no extra server time is spent."""
    trials = stored_trials(study)
    probes = next(t for t in trials if t.number == rec.best.trial).probes(trials)
    measured = backend.mode != "virtual"
    for p in sorted((p for p in probes if p.get("rate") is not None),
                    key=lambda p: (p["rate"], p["index"])):
        e2e = next((c for c in p.get("checks") or [] if c.get("label", "").endswith("e2e")),
                   None) or {}
        util = p.get("gpu_util")
        # A failed test's cohort goodput is not one that holds (a test stopped once its
        # fail was certain showed more than the ceiling's): only a pass has a goodput.
        passed = p.get("verdict") == "pass"
        row = table_row(p["rate"], goodput_tokens=(p.get("evidence") or {}).get(
                            "goodput_tokens") if passed else None,
                        p99_e2e_s=e2e.get("observed_s"),
                        gpu_util_pct=None if util is None else 100.0 * util,
                        feasible=p.get("verdict") == "pass",
                        pruned_by=None if p.get("verdict") != "inconclusive"
                        else "inconclusive", measured=measured)
        row["phase"] = p.get("phase")
        rec.table.append(row)
    for run in (rec.validation or {}).get("runs") or []:
        pct = run.get("percentiles") or {}
        p99 = next((v for k, v in pct.items() if k.endswith("e2e")), None)
        row = table_row(run["rate"], goodput_tokens=run.get("goodput_tokens")
                        if run.get("verdict") == "pass" else None, p99_e2e_s=p99,
                        gpu_util_pct=None,
                        feasible=run.get("verdict") == "pass", pruned_by=None,
                        measured=measured)
        row["phase"] = "validation"
        rec.table.append(row)
    rec.table_how = (("Measured" if measured else "Simulated (virtual time)")
                     + f": the load tests of trial {rec.best.trial}'s rate search (each sized by "
                     "time and stopped when its steady-state verdict was certain) and the "
                     "validation runs at the cap. Goodput tok/s: output tokens of the judged "
                     "requests that met the SLO per second of their arrivals, the "
                     "steady-state figure the trial's value is; '-' where the test did "
                     "not pass, as a goodput that does not hold is none.")


def _validate_cap(rec: Any, backend: Any, load_plan: Any, o: SearchOptions,
                  settings: StudySettings, out: Console, *,
                  proof: Any = None, deadline_s: float | None = None) -> None:
    """The recommended config at its cap for ``--validate`` (the seed's 5 minutes);
    with its ``proof`` (a CeilingResult), each run pools the proof's tests at or above
    its rate, as that search's own tests do.  ``deadline_s`` (the backend's server_s
    clock): the --budget's end, where a run is cut and no further run starts."""

    if deadline_s is not None:
        load_plan = replace(load_plan, deadline_s=deadline_s)
    if proof is not None and load_plan.steady is not None:
        load_plan = replace(load_plan, steady=search_steady(load_plan.steady,
                                                            settings.max_probes))
    if o.unit.closed is not None:
        load_plan = closed_plan(load_plan, o.unit, proof)

    how = "virtual time" if backend.mode == "virtual" else "real time"
    duration_s = float(o.validate_s or 300.0)
    out.print(f"validating: the recommended config at its cap {rec.level(rec.rate_cap)} for "
              f"{duration_s / 60:g} min ({how}); a failed run steps the cap down 5%",
              soft_wrap=True)
    val = validate_cap(backend, rec.best.flags, float(rec.rate_cap), load_plan,
                       duration_s=duration_s,
                       prior_for=None if proof is None
                       else (lambda rate: lent_evidence(proof.probes, rate)),
                       on_result=lambda res: append_load_test(
                           settings.out_dir, settings.name, rec.best.trial, res,
                           "validation"),
                       on_run=lambda r: out.print(
                           f"  {rec.level(r.rate)}: {r.verdict} ({r.requests} requests "
                           "judged)",
                           soft_wrap=True, highlight=False))
    rec.validation = val.to_dict()
    closed = o.unit.closed
    rec.rate_cap = None if val.rate is None else (
        round(val.rate, 2) if closed is None else float(closed.users(val.rate)))
    if rec.rate_cap is None:
        rec.no_cap = f"no validation run passed at or below {rec.level(rec.best.max_feasible_rate)}"
    rec.notes.append(val.sentence())


def _print(out: Console, rec: Any, folder: Path) -> None:
    b = rec.best
    out.print()
    head = "Recommended" if rec.rate_cap is not None or rec.validation is not None \
        else "Best screened, not proven"
    out.print(f"[bold]{head}[/] (trial {b.trial}, {rec.source}): {flags_line(b.flags)}",
              soft_wrap=True)
    out.print(f"  goodput {b.goodput_tokens:,.0f} output tok/s ({b.goodput_requests:.2f} "
              f"req/s) at {rec.level(b.rate)}, P99 e2e {b.p99_e2e_s:.2f} s, attainment "
              f"{b.attainment:.1%}", soft_wrap=True)
    if b.predicted:
        p = b.predicted
        # A figure the prediction lacks is left out, never printed as 0.
        p99 = (f", P99 {p['p99_e2e_s']:.2f} s" if p.get("p99_e2e_s") else "")
        out.print(f"  predicted by {p.get('by') or 'the simulator pre-screen'}: ceiling "
                  f"{rec.level(p.get('ceiling_rate') or 0)}, goodput "
                  f"{p.get('goodput_tokens') or 0:,.0f} tok/s{p99}"
                  " (simulated) vs measured above", soft_wrap=True)
    ratio = rec.vs_baseline.get("objective_ratio")
    base = rec.baseline
    if base is not None and rec.vs_baseline.get("same_config"):
        out.print(f"  vs vLLM defaults: {rec.vs_baseline['note']}", soft_wrap=True)
    elif base is not None:
        verdict = (f"{ratio:.2f}x its {rec.measure}" if ratio is not None
                   else rec.vs_baseline.get("note", ""))
        out.print(f"  vs vLLM defaults (trial {base.number}, {flags_line(base.flags)} at "
                  f"{rec.level(base.rate)}): {verdict}", soft_wrap=True)
        if rec.vs_baseline.get("equal_gpus_note"):
            out.print(f"  vs vLLM defaults on equal GPUs: {rec.vs_baseline['equal_gpus_note']}",
                      soft_wrap=True)
        ceil_ratio = rec.vs_baseline.get("goodput_ratio_at_ceilings")
        if ceil_ratio is not None:
            out.print(f"  vs vLLM defaults at their own ceiling "
                      f"({rec.level(rec.vs_baseline['baseline_ceiling_rate'])}, "
                      f"{rec.vs_baseline['baseline_ceiling_goodput_tokens']:,.0f} tok/s, "
                      f"simulated): {ceil_ratio:.2f}x its goodput", soft_wrap=True)
        elif rec.vs_baseline.get("baseline_ceiling_note"):
            out.print("  " + rec.vs_baseline["baseline_ceiling_note"], soft_wrap=True)
    why = ("its ceiling: the highest level whose steady-state load test passed in its "
           "trial's search")
    if rec.validation is not None:
        out.print("  " + str(rec.validation.get("sentence")), soft_wrap=True, highlight=False)
    if rec.rate_cap is None:
        out.print(f"  [bold red]no cap:[/] {rec.no_cap or 'none shown'}", soft_wrap=True)
    else:
        out.print(f"  {rec.cap_word} cap at the gateway: "
                  f"[bold]{rec.level(rec.rate_cap)}[/] ({rec.headroom:.0%} under "
                  f"{rec.level(b.max_feasible_rate)}, {why}"
                  + (", then validated" if rec.validation and rec.validation.get("passed")
                     else "") + ")", soft_wrap=True)
    out.print("  deploy: " + b.command, soft_wrap=True, highlight=False, markup=False)
    for p in rec.next_best:
        out.print(f"  next: trial {p.trial} {flags_line(p.flags)} at {rec.level(p.rate)}: "
                  f"{p.goodput_tokens:,.0f} tok/s, P99 {p.p99_e2e_s:.2f} s", soft_wrap=True)
    if rec.table:
        t = Table(title="recommended config across rates", caption=rec.table_how,
                  title_justify="left", caption_justify="left")
        for col in (f"level ({rec.unit})", "goodput tok/s", "P99 e2e (s)", "GPU util",
                    "verdict"):
            t.add_column(col, justify="left" if col == "verdict" else "right")
        for row in rec.table:
            gpu = row.get("gpu_util_pct")
            t.add_row(f"{row['rate']:.4g}",
                      "-" if row["goodput_tokens"] is None
                      else f"{row['goodput_tokens']:,.0f}",
                      "-" if row["p99_e2e_s"] is None else f"{row['p99_e2e_s']:.1f}",
                      "-" if gpu is None else f"{gpu:.0f}%"
                      + (" (sim)" if row["source"] == "simulated" else ""),
                      row["verdict"])
        out.print(t)
    for note in rec.notes:
        out.print(f"note: {note}", soft_wrap=True)
    out.print(f"wrote {folder / 'recommendation.json'} and {folder / 'recommendation.md'}",
              soft_wrap=True)
