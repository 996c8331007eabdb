"""Many GPU hosts, one study: a worker joins a study and runs trials until it is full.

Optuna's storage is the distributed engine; there is no scheduler.  Each worker

* opens the storage (:func:`autotune.study.storage.open_storage`: heartbeats, retries);
* joins the study after checking that its search space and SLO are the study's
  (:class:`StudySpec`, stored in the study's user attrs when it is created) and
  refuses otherwise, naming the difference;
* runs its own server on its own GPUs (``CUDA_VISIBLE_DEVICES``), through the process
  owner (:mod:`autotune.servers.process`), whose guard takes the server down when the
  worker dies, even by ``kill -9``;
* claims one trial at a time until the study holds ``n_trials`` finished
  (COMPLETE or PRUNED) trials.  FAILED trials do not count: a trial of a killed
  worker is failed after the grace period and its config retried once, and the retry
  counts when it finishes, so the study never stops short.

Ctrl-C or SIGTERM stops the server, marks the running trial FAILED with reason
"interrupted" (its config is queued again) and exits 130 or 143.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from autotune.backends.base import LoadPlan
from autotune.backends.factory import BackendSpec, create_backend
from autotune.core.errors import AutotuneError
from autotune.core.slo import parse_slo
from autotune.core.terminal import mask_url
from autotune.sim.profiles import load_hardware
from autotune.study.optuna_adapter import (
    fail_running_trial,
    fail_stale_heartbeats,
    heartbeat_enabled,
    storage_of,
    trial_now,
)
from autotune.study.seats import (
    TAKEN_OVER_WHY,
    finished_count,
    requeue,
    requeue_number,
    run_seated_trial,
    should_wait,
)
from autotune.study.space import SearchSpace
from autotune.study.storage import StudyError, open_storage
from autotune.study.study import (
    Objective,
    StudySettings,
    enqueue_baseline,
    open_study,
    process_running,
    validate_name,
)
from autotune.tuning.load_unit import RATE, LoadUnit
from autotune.tuning.verdict import SteadyState
from autotune.workload.pool import pool_workload
from autotune.workload.sources import build_workload
from autotune.workload.tokenizer import load_tokenizer

SPEC_ATTR = "autotune:spec"
INTERRUPTED = "interrupted"

if TYPE_CHECKING:
    from autotune.backends.base import Backend


class IncompatibleStudy(StudyError, AutotuneError):
    """The worker's space or SLO is not the study's."""


# ----------------------------------------------------------------------------- spec


def space_to_dict(space: SearchSpace) -> dict[str, Any]:
    """The YAML mapping of ``space`` (``SearchSpace.from_dict`` reads it back)."""
    params: dict[str, Any] = {}
    for name, p in space.params.items():
        spec: dict[str, Any] = {"type": p.type}
        if p.type == "categorical":
            spec["choices"] = list(p.choices)
        elif p.type in ("int", "float"):
            spec.update(low=p.low, high=p.high)
            if p.step is not None:
                spec["step"] = p.step
            if p.log:
                spec["log"] = True
        params[name] = spec
    out: dict[str, Any] = {"name": space.name, "parameters": params, "fixed": dict(space.fixed),
                           "baseline": dict(space.baseline), "rules": list(space.rules)}
    if space.attention_heads is not None:
        out["attention_heads"] = space.attention_heads
    if space.profile:
        out["profile"] = dict(space.profile)
    return out


def load_spec(*, warmup: int, seed: int, min_duration_s: float | None,
              max_duration_s: float | None, backlog_share: float, max_probes: int,
              tol: float, unit: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A spec's ``load`` block: how each load test runs (Poisson arrivals, 1 s windows,
    600 s per request, no concurrency cap) and how each config's ceiling is searched,
    as :func:`build_plan` reads it back."""
    return {"warmup": warmup, "process": "poisson", "burstiness": 1.0, "window_s": 1.0,
            "request_timeout_s": 600.0, "max_concurrency": None, "seed": seed,
            "min_duration_s": min_duration_s, "max_duration_s": max_duration_s,
            "backlog_share": backlog_share, "max_probes": max_probes, "tol": tol,
            "unit": dict(unit or RATE.spec())}


@dataclass
class StudySpec:
    """Everything a worker needs to evaluate trials exactly as the study's creator
    does: the space, the SLO, the objective and the load test."""

    space: dict[str, Any]
    slo: str
    objective: str = "tokens"
    per_gpu: bool = False
    sampler: str = "tpe"
    seed: int = 0
    n_trials: int | None = 30
    gpus: int | None = None  # GPUs per worker the study was planned for
    prune: bool = True
    workload: dict[str, Any] = field(default_factory=lambda: {
        "kind": "synthetic", "num_prompts": 200, "input_len": 256, "output_len": 128,
        "distribution": "fixed", "seed": 0})
    load: dict[str, Any] = field(default_factory=lambda: {
        "warmup": 20, "process": "poisson", "burstiness": 1.0, "window_s": 1.0,
        "request_timeout_s": 600.0, "max_concurrency": None, "seed": 0,
        "min_duration_s": None, "max_duration_s": None, "backlog_share": 0.02,
        "max_probes": 8, "tol": 0.03})
    sim: dict[str, Any] = field(default_factory=dict)  # {"hardware": ..., "model": ...}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StudySpec:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def search_space(self) -> SearchSpace:
        return SearchSpace.from_dict(self.space, source=f"study space {self.space.get('name')}")

    def fingerprint(self) -> str:
        text = json.dumps({"space": _comparable_space(self.space), "slo": self.slo},
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def attrs(self) -> dict[str, Any]:
        """The study user attributes that store this spec (read by :func:`stored_spec`)."""
        return {SPEC_ATTR: self.to_dict(), "space_fingerprint": self.fingerprint()}


def _comparable_space(space: Mapping[str, Any]) -> dict[str, Any]:
    # The name and description do not change what a trial means.
    return {k: v for k, v in space.items() if k not in ("name", "description")}


def _canon_slo(text: str) -> str:
    try:
        return str(parse_slo(text))
    except Exception:
        return text


def spec_differences(study: StudySpec, mine: StudySpec) -> list[str]:
    """What differs between the study's space/SLO/objective and the worker's, in words."""
    out: list[str] = []
    if _canon_slo(study.slo) != _canon_slo(mine.slo):
        out.append(f"SLO: the study has {study.slo!r}, this worker {mine.slo!r}")
    for key in ("objective", "per_gpu"):
        a, b = getattr(study, key), getattr(mine, key)
        if a != b:
            out.append(f"{key}: the study has {a!r}, this worker {b!r}")
    sa, sb = _comparable_space(study.space), _comparable_space(mine.space)
    pa, pb = sa.get("parameters", {}), sb.get("parameters", {})
    for name in sorted(set(pa) | set(pb)):
        if name not in pb:
            out.append(f"parameters.{name}: searched by the study, missing in this worker's space")
        elif name not in pa:
            out.append(f"parameters.{name}: not a parameter of the study's space")
        elif pa[name] != pb[name]:
            out.append(f"parameters.{name}: the study has {_short(pa[name])}, this worker "
                       f"{_short(pb[name])}")
    for key in sorted((set(sa) | set(sb)) - {"parameters"}):
        if sa.get(key) != sb.get(key):
            out.append(f"{key}: the study has {_short(sa.get(key))}, this worker "
                       f"{_short(sb.get(key))}")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def stored_spec(attrs: Mapping[str, Any]) -> StudySpec | None:
    data = attrs.get(SPEC_ATTR)
    return StudySpec.from_dict(data) if isinstance(data, dict) else None


def check_compatible(attrs: Mapping[str, Any], mine: StudySpec | None, name: str, *,
                     waited_s: float = 0.0) -> StudySpec:
    """The spec to run with: the study's, after checking ``mine`` against it."""
    stored = stored_spec(attrs)
    if stored is None:
        # A study made before specs were stored: at least compare what it recorded.
        if mine is None:
            waited = f" (waited {waited_s:.3g} s)" if waited_s > 0 else ""
            raise IncompatibleStudy(
                f"study {name!r} stores no search space{waited}: give --space and --slo (the "
                "ones it was created with) or recreate it with `autotune search --storage`")
        old_slo = attrs.get("slo")
        if old_slo is not None and _canon_slo(str(old_slo)) != _canon_slo(mine.slo):
            raise IncompatibleStudy(f"refusing to join study {name!r}: SLO: the study has "
                                    f"{old_slo!r}, this worker {mine.slo!r}")
        old_space = attrs.get("space")
        if old_space is not None and old_space != mine.space.get("name"):
            raise IncompatibleStudy(f"refusing to join study {name!r}: space: the study has "
                                    f"{old_space!r}, this worker {mine.space.get('name')!r}")
        return mine
    if mine is not None:
        diffs = spec_differences(stored, mine)
        if diffs:
            more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
            raise IncompatibleStudy(f"refusing to join study {name!r}: {diffs[0]}{more}; "
                                    "join with the study's --space and --slo, or omit them")
    return stored


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """Everything ``autotune worker`` was told, parsed by the CLI into typed values."""

    study: str
    storage: str
    spec: StudySpec | None = None  # from --space/--slo: create the study or check it
    gpus: tuple[int, ...] | None = None  # --gpu-ids; None: all of this host's
    n_trials: int | None = None  # study-wide; None: the study's
    backend: str = "sim"  # "sim" | "vllm"
    vllm_cmd: str = "vllm serve"
    model: str | None = None
    studies_dir: Path = Path("studies")
    heartbeat_interval: int = 60
    grace_period: int = 180
    retry_s: float = 120.0
    startup_timeout_s: float = 900.0
    pace_s: float = 0.0  # real seconds added to each load test (tests and demos)
    poll_s: float = 1.0  # how often a worker that waits for others looks again
    wait_s: float = 600.0  # how long to wait for a study that does not exist yet


@dataclass
class WorkerRun:
    worker: str
    ran: list[int]
    finished: int
    n_trials: int | None
    stopped_by: str  # "n_trials" | "interrupted" | "terminated"
    exit_code: int


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# ----------------------------------------------------------------------------- joining


def join_study(storage: optuna.storages.BaseStorage, name: str, mine: StudySpec | None, *,
               wait_spec_s: float = 15.0, wait_s: float = 0.0, poll_s: float = 1.0,
               say: Callable[[str], None] | None = None) -> tuple[StudySpec, bool]:
    """(the spec to run with, whether this worker created the study).

    Creating is a race all workers may run at once: exactly one ``create_new_study``
    wins; the others wait for the winner's spec before comparing theirs with it.  A
    worker that cannot create the study (no ``mine``) waits up to ``wait_s`` for
    someone else to: workers and a search are often started together, and the search
    creates the study only once its workload is loaded.
    """
    validate_name(name)
    created = False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            storage.get_study_id_from_name(name)
            break
        except KeyError:
            if mine is not None:
                break
            if time.monotonic() >= deadline:
                waited = f" (waited {wait_s:g} s)" if wait_s > 0 else ""
                raise StudyError(
                    f"no study {name!r} in this storage{waited}: create it with `autotune "
                    f"search --storage URL --study-name {name}`, or give --space and --slo "
                    "so the first worker creates it") from None
            if say is not None:
                say(f"waiting up to {wait_s:g} s for study {name!r} to be created (by "
                    "`autotune search` or a worker given --space and --slo)")
                say = None  # once is enough
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
    try:
        storage.get_study_id_from_name(name)
    except KeyError:
        assert mine is not None
        try:
            sid = storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], name)
        except optuna.exceptions.DuplicatedStudyError:
            pass
        else:
            created = True
            spec = dataclasses.replace(mine)
            for key, value in spec.attrs().items():
                storage.set_study_user_attr(sid, key, value)
            return spec, created
    sid = storage.get_study_id_from_name(name)
    # The creator is between create_new_study and writing its spec (a search writes its
    # SLO first, then the spec), so a worker without a spec of its own waits as long as
    # it would for the study itself.
    limit_s = max(wait_spec_s, deadline - time.monotonic()) if mine is None else wait_spec_s
    spec_deadline = time.monotonic() + limit_s
    attrs = storage.get_study_user_attrs(sid)
    while (not _configured(attrs, mine) and time.monotonic() < spec_deadline
           and not storage.get_all_trials(sid, deepcopy=False)):  # with trials: an old study
        if say is not None and mine is None:
            say(f"study {name!r} exists; waiting up to {limit_s:.3g} s for its search to "
                "record its search space and SLO")
            say = None
        time.sleep(min(0.2, poll_s, max(spec_deadline - time.monotonic(), 0.0)))
        attrs = storage.get_study_user_attrs(sid)
    waited_s = limit_s if time.monotonic() >= spec_deadline else 0.0
    return check_compatible(attrs, mine, name, waited_s=waited_s), created


def _configured(attrs: Mapping[str, Any], mine: StudySpec | None) -> bool:
    """Whether the study says enough to join it: a worker with no spec of its own runs
    the study's, so the SLO alone (what a search writes first) is not enough."""
    return SPEC_ATTR in attrs or (mine is not None and "slo" in attrs)


# ----------------------------------------------------------------------------- signals


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so Optuna fails the running trial."""


class StopSignals:
    """SIGINT and SIGTERM raise in the main thread (KeyboardInterrupt, Terminated).

    Python drops an exception a handler raises while a finalizer or weakref callback
    runs, so until the worker says it has handled the stop, the signal is raised again
    every second (through SIGINT, whose handler this is: another module may have
    chained SIGTERM to os._exit)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.handled = False
        self._prev: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum or signal.SIGINT)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.handled:
            return
        if self.signum is None:
            self.signum = signum
            threading.Thread(target=self._rearm, daemon=True, name="stop-rearm").start()
        raise Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()

    def _rearm(self) -> None:
        import _thread  # private: interrupt_main from the watchdog thread

        while True:
            time.sleep(1.0)
            if self.handled:
                return
            _thread.interrupt_main()

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread
                self._prev[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handled = True
        for sig, prev in self._prev.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, prev)


# ----------------------------------------------------------------------------- servers

def make_backend(opts: WorkerOptions, spec: StudySpec, n_gpus: int | None, wid: str
                 ) -> Backend:
    if opts.backend == "sim":
        sim = spec.sim or {}
        profile = spec.space.get("profile") or {}
        hardware = sim.get("hardware") or profile.get("hardware") or "a100-80gb"
        model = sim.get("model") or profile.get("model") or "llama-3-8b"
        # This host's GPUs, whatever the profile's count.
        return create_backend(BackendSpec(
            kind="sim", sim_model=model,
            hardware=hardware if n_gpus is None else load_hardware(hardware).with_gpus(n_gpus)))
    if opts.backend != "vllm":
        raise StudyError(f"--backend must be sim or vllm, got {opts.backend!r}")
    cmd = shlex.split(opts.vllm_cmd)
    if not cmd or shutil.which(cmd[0]) is None:
        raise StudyError(f"--vllm-cmd {opts.vllm_cmd!r}: {cmd[0] if cmd else '(empty)'} is "
                         "not an executable on PATH")
    model = opts.model or str((spec.space.get("fixed") or {}).get("model") or "")
    if not model:
        raise StudyError("--backend vllm needs --model (the space fixes none)")
    # The server starts through the process owner, whose guard takes it down when this
    # worker dies, even by kill -9.
    return create_backend(BackendSpec(
        kind="vllm", model=model, request_model=model, vllm_cmd=opts.vllm_cmd,
        gpu_ids=opts.gpus, startup_timeout_s=opts.startup_timeout_s, gpus=n_gpus,
        log_dir=opts.studies_dir / opts.study / "logs" / wid.replace(":", "-")))


def build_plan(spec: StudySpec) -> Any:
    w = dict(spec.workload)
    kind = w.pop("kind", "synthetic")
    if kind == "pool":  # a search's own pool: --dataset, --multi-turn, --prefix-share
        workload = pool_workload(
            dataset=str(w.get("dataset", "sharegpt")), tokenizer_path=w.get("tokenizer"),
            url=None, model=None, total=int(w["total"]), seed=int(w.get("seed", 0)),
            context=int(w["max_model_len"]), input_len=256, output_len=128,
            multi_turn=bool(w.get("multi_turn")),
            prefix_share=float(w.get("prefix_share", 0.0)))
    else:
        tok = load_tokenizer(w.pop("tokenizer", None))
        workload = build_workload(kind, tokenizer=tok, **w)
    load = dict(spec.load)
    steady = SteadyState(min_duration_s=load.get("min_duration_s"),
                         max_duration_s=load.get("max_duration_s"),
                         min_requests=int(spec.workload.get("num_prompts", 0) or 0),
                         backlog_share=float(load.get("backlog_share", 0.02)))
    return LoadPlan(slo=parse_slo(spec.slo), requests=list(workload.requests), steady=steady,
                    warmup=int(load.get("warmup", 0)), seed=int(load.get("seed", 0)),
                    process=str(load.get("process", "poisson")),
                    burstiness=float(load.get("burstiness", 1.0)),
                    window_s=float(load.get("window_s", 1.0)),
                    request_timeout_s=float(load.get("request_timeout_s", 600.0)),
                    max_concurrency=load.get("max_concurrency"))


def _paced(backend: Any, pace_s: float) -> Any:
    if pace_s <= 0:
        return backend
    load_test = backend.load_test

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(pace_s)  # mid-trial: the server runs, the params are set
        return load_test(*args, **kwargs)

    backend.load_test = slow
    return backend


# ----------------------------------------------------------------------------- loop


def run_worker(opts: WorkerOptions, *, say: Callable[[str], None] = print) -> WorkerRun:
    """Join ``opts.study`` and run trials until it holds n_trials finished ones."""
    wid = worker_id()
    shown = mask_url(opts.storage)
    storage = open_storage(opts.storage, heartbeat_interval=opts.heartbeat_interval,
                           grace_period=opts.grace_period, retry_s=opts.retry_s)
    spec, created = join_study(storage, opts.study, opts.spec, wait_s=opts.wait_s,
                               poll_s=opts.poll_s, say=say)
    n_trials = opts.n_trials if opts.n_trials is not None else spec.n_trials
    space = spec.search_space()
    slo = parse_slo(spec.slo)
    n_gpus = len(opts.gpus) if opts.gpus is not None else spec.gpus
    settings = _worker_settings(opts, spec, wid, n_trials, space, slo)
    pruner = None  # each trial's load tests stop on their own steady-state verdicts
    study = _open_worker_study(settings, storage, pruner, spec, space, created)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    _announce(opts, spec, wid, created, shown, space, slo, n_trials, n_gpus, storage, say)

    plan = build_plan(spec)
    backend = _paced(make_backend(opts, spec, n_gpus, wid), opts.pace_s)
    trial_settings = dataclasses.replace(settings, gpus=n_gpus)

    def on_result(number: int, result: Any, violations: Sequence[Any]) -> None:
        say(_result_line(number, result, violations))

    objective = Objective(trial_settings, backend, plan, pruner, on_result)
    current: dict[str, int] = {}
    run_one = _trial_runner(objective, wid, current)
    ran: list[int] = []
    code, stopped = _run_trials(study, run_one, n_trials, opts, backend, current, ran, say)
    finished = finished_count(study)
    say(f"worker {wid} ran {len(ran)} trial(s); the study has {finished} finished "
        f"(n_trials {n_trials}); stopped: {stopped}")
    return WorkerRun(worker=wid, ran=ran, finished=finished, n_trials=n_trials,
                     stopped_by=stopped, exit_code=code)


def _worker_settings(opts: WorkerOptions, spec: StudySpec, wid: str, n_trials: int | None,
                     space: Any, slo: Any) -> StudySettings:
    """The study's settings as the spec stores them, with this worker's own seed so
    workers do not sample the same configs."""
    return StudySettings(
        name=opts.study, slo=slo, space=space, sampler=spec.sampler, storage=None,
        studies_dir=opts.studies_dir, objective=spec.objective, per_gpu=spec.per_gpu,
        gpus=spec.gpus, seed=_worker_seed(spec.seed, wid), n_trials=n_trials,
        prune=spec.prune, attention_heads=space.attention_heads,
        tol=float(spec.load.get("tol", 0.03)),
        max_probes=int(spec.load.get("max_probes", 8)),
        unit=LoadUnit.from_spec(spec.load.get("unit")))


def _open_worker_study(settings: StudySettings, storage: Any, pruner: Any,
                       spec: StudySpec, space: Any, created: bool) -> optuna.Study:
    """Open the study over the config space; the worker that created it queues the
    baseline first, as a search would."""
    # What trials sample: the server parameters (each trial searches its own rate).
    config_space = space.for_configs(gpus=spec.gpus, attention_heads=space.attention_heads)
    study = open_study(settings, storage, pruner, space=config_space)
    if created:
        enqueue_baseline(study, config_space)
    return study


def _announce(opts: WorkerOptions, spec: StudySpec, wid: str, created: bool, shown: str,
              space: Any, slo: Any, n_trials: int | None, n_gpus: int | None, storage: Any,
              say: Callable[[str], None]) -> None:
    """Say which study this worker runs and what it cannot do here, before any trial."""
    if n_gpus is not None and spec.gpus is not None and n_gpus < spec.gpus:
        say(f"note: this worker has {n_gpus} GPU(s), the study plans for {spec.gpus}: "
            f"configs needing more are recorded infeasible (rule tp_fits_gpus) here")
    say(f"worker {wid} {'created' if created else 'joined'} study {opts.study!r} at {shown} "
        f"(space {space.name}, SLO {slo}, n_trials {n_trials} study-wide, backend "
        f"{opts.backend}, GPUs {list(opts.gpus) if opts.gpus is not None else 'all'})")
    if not heartbeat_enabled(storage):
        say("note: this storage has no heartbeats: a trial of a worker killed with -9 stays "
            "RUNNING (use PostgreSQL or MySQL for automatic retries)")


def _trial_runner(objective: Any, wid: str, current: dict[str, int]
                  ) -> Callable[[optuna.Trial], float]:
    """One trial, tagged with this worker and marked interrupted if stopped mid-run, so
    the loop knows which trial to queue again."""
    def run_one(trial: optuna.Trial) -> float:
        current["number"] = trial.number
        trial.set_user_attr("worker", wid)
        try:
            return objective(trial)
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):
                trial.set_user_attr("reason", INTERRUPTED)
                trial.set_user_attr("status", "failed")
            raise

    return run_one


def _run_trials(study: optuna.Study, run_one: Callable[[optuna.Trial], float],
                n_trials: int | None, opts: WorkerOptions, backend: Any,
                current: dict[str, int], ran: list[int], say: Callable[[str], None]
                ) -> tuple[int, str]:
    """Take seats until the study is full; on a stop, close the server and queue the
    interrupted trial again.  Returns the exit code and what stopped the worker."""
    code, stopped = 0, "n_trials"
    with StopSignals() as stop:
        try:
            while True:
                _fail_stale(study)
                done, wait = should_wait(study, n_trials)
                if done:
                    break
                if wait:
                    time.sleep(opts.poll_s)  # others hold the last seats; they may die
                    continue
                seated = run_seated_trial(study, run_one, n_trials)
                current.clear()  # a stop from here on interrupts no trial
                if seated.outcome == "finished elsewhere":
                    say(f"trial {seated.number}: failed by another process while it ran here "
                        f"({TAKEN_OVER_WHY}); its config is queued again")
                elif seated.outcome == "ran" and seated.number is not None:
                    ran.append(seated.number)
        except KeyboardInterrupt:
            stop.handled = True
            code = stop.exit_code
            stopped = "terminated" if code == 143 else "interrupted"
            number = current.get("number")
            backend.close()  # stop the server first: the GPU is what costs
            if number is not None:
                requeue_number(study, number, only_failed=True)
                say(f"trial {number}: failed (interrupted); its config is queued again")
        finally:
            backend.close()
    return code, stopped


def _fail_stale(study: optuna.Study) -> None:
    """Heartbeats (RDB): Optuna fails stale trials and retries them.  Without them
    (journal, SQLite) only this host's dead processes can be told apart: their RUNNING
    trials are failed and retried here; another host's stay until a person fails them."""
    if heartbeat_enabled(storage_of(study)):
        fail_stale_heartbeats(study)
        return
    host = socket.gethostname()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.system_attrs.get("autotune:pid")
        if t.system_attrs.get("autotune:host") != host or not isinstance(pid, int):
            continue
        if pid == os.getpid() or process_running(pid):
            continue
        try:
            if fail_running_trial(study, t):
                requeue(study, trial_now(study, t))
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker on this host got there first


def _worker_seed(seed: int, wid: str) -> int:
    # Same seed on every worker would make a random or TPE sampler suggest the same
    # config on each: mix in the worker's identity.
    digest = hashlib.sha256(f"{seed}:{wid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _result_line(number: int, result: Any, violations: Sequence[Any]) -> str:
    if result is None:
        why = "; ".join(str(v) for v in violations) or "a space rule"
        return f"trial {number}: infeasible by rule, not launched ({why})"
    s = result.summary
    head = f"trial {number}: {result.status}"
    if result.reason:
        head += f" ({result.reason})"
    if s is None:
        return f"{head}: {result.detail or 'no load test'}"
    return (f"{head}: goodput {result.measured_goodput():,.1f} output tok/s at "
            f"{result.rate:.3g} req/s "
            f"offered, p99 e2e {s.e2e.p99:.3g}s; {s.how()}")
