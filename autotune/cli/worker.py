"""``autotune worker``: join a study from any host and run its trials on this host's GPUs.

This module only parses: every option becomes a typed value of one
:class:`autotune.study.worker.WorkerOptions` (with ``--space``/``--slo``, the
:class:`autotune.study.worker.StudySpec` that creates or checks the study), and
:func:`autotune.study.worker.run_worker` runs the worker with it.
"""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

import typer

from autotune.cli._app import app
from autotune.cli._common import fail, one_line_errors
from autotune.cli._options import (
    NUM_PROMPTS,
    VLLM_CMD,
    WARMUP,
    BacklogShare,
    InputLen,
    MaxDuration,
    MaxModelLen,
    MinDuration,
    NumPrompts,
    OutputLen,
    Seed,
    Warmup,
)
from autotune.cli._parse import duration, load_space, parse_gpu_ids
from autotune.core.slo import SLOError, parse_duration, parse_slo
from autotune.core.terminal import console, err_console
from autotune.study.optuna_adapter import quiet_logging
from autotune.study.storage import scrub
from autotune.study.worker import StudySpec, WorkerOptions, load_spec, run_worker, space_to_dict
from autotune.tuning.options import DEFAULT_CONTEXT, OptionsError


class WorkerBackend(str, Enum):
    sim = "sim"
    vllm = "vllm"


# The options only `worker` takes, or takes with its own help, one line each in its
# signature.
StudyOpt = Annotated[str, typer.Option(help="Name of the study to join.")]
StorageOpt = Annotated[str, typer.Option(
    envvar="AUTOTUNE_STORAGE",
    help="postgresql://USER@HOST/DB, mysql://..., or journal:PATH (a file on a shared "
         "filesystem). Keep the password out of the command line: libpq reads "
         "PGPASSWORD, or set the whole URL in AUTOTUNE_STORAGE.")]
GpuIdsOpt = Annotated[str | None, typer.Option(
    help="GPU ids this worker's server uses, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES), "
         "as in `search --gpu-ids`; configs needing more GPUs are never launched.")]
NTrialsOpt = Annotated[int | None, typer.Option(
    help="Finished trials the whole study should reach (all workers together); "
         "default: the study's.")]
BackendOpt = Annotated[WorkerBackend, typer.Option(
    help="sim: the simulator in virtual time; vllm: launch a server per config.")]
VllmCmdOpt = Annotated[str, typer.Option(
    help="Command that starts the server ('vllm serve', or '.../python -m "
         "vllm.entrypoints.openai.api_server', which takes --model).")]
ModelOpt = Annotated[str | None, typer.Option(
    help="Model path or name for the server (default: the space's fixed model).")]
SpaceOpt = Annotated[str | None, typer.Option(
    help="Search space (name or YAML). Creates the study if it does not exist; if it "
         "does, must be the study's.")]
SloOpt = Annotated[str | None, typer.Option(
    help="SLO, e.g. '10s' or 'p99:e2e<=10s,p99:ttft<=2s' (with --space).")]
ObjectiveOpt = Annotated[str, typer.Option(help="tokens or requests (with --space).")]
SamplerOpt = Annotated[str, typer.Option(help="tpe, gp, random or grid (with --space).")]
Dataset = Annotated[str, typer.Option(
    help="sharegpt (the realistic mixed workload every command uses by default) or "
         "synthetic (--input-len/--output-len).")]
StudiesDirOpt = Annotated[Path, typer.Option(help="Where this host writes logs and records.")]
HeartbeatInterval = Annotated[int, typer.Option(
    help="Seconds between a running trial's heartbeats.")]
GracePeriod = Annotated[int, typer.Option(
    help="Seconds without a heartbeat after which a trial is failed and retried.")]
DbRetry = Annotated[float, typer.Option(
    help="How long a storage call retries an unreachable database.")]
Wait = Annotated[str, typer.Option(
    help="How long to wait for the study to be created by someone else (a search or "
         "a worker given --space/--slo), e.g. 10m, 30s; 0: do not wait.")]
MaxProbesOpt = Annotated[int, typer.Option(
    help="With --space: load tests one trial's rate search may run.")]
TolOpt = Annotated[float, typer.Option(
    help="With --space: each rate search stops at this relative gap.")]
Hidden = Annotated[float, typer.Option(hidden=True)]  # pacing for tests and demos


@app.command("worker")
def worker(  # one line per option, each defined above or in cli._options
    study: StudyOpt, storage: StorageOpt, gpu_ids: GpuIdsOpt = None,
    n_trials: NTrialsOpt = None, backend: BackendOpt = WorkerBackend.sim,
    vllm_cmd: VllmCmdOpt = VLLM_CMD, model: ModelOpt = None, space: SpaceOpt = None,
    slo: SloOpt = None, objective: ObjectiveOpt = "tokens", sampler: SamplerOpt = "tpe",
    num_prompts: NumPrompts = NUM_PROMPTS, warmup: Warmup = WARMUP,
    dataset: Dataset = "sharegpt", max_model_len: MaxModelLen = None,
    input_len: InputLen = 256, output_len: OutputLen = 128, seed: Seed = 0,
    studies_dir: StudiesDirOpt = Path("studies"),
    heartbeat_interval: HeartbeatInterval = 60, grace_period: GracePeriod = 180,
    db_retry_s: DbRetry = 120.0, wait: Wait = "10m", min_duration: MinDuration = None,
    max_duration: MaxDuration = None, backlog_share: BacklogShare = 0.02,
    max_probes: MaxProbesOpt = 8, tol: TolOpt = 0.03, pace_s: Hidden = 0.0,
    poll_s: Hidden = 1.0,
) -> None:
    """Join STUDY in a shared storage and run trials until it holds --n-trials."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_logging()
    with _scrubbed(storage), one_line_errors():
        if (space is None) != (slo is None):
            raise fail("give both --space and --slo (to create or check the study), or "
                       "neither (to take the study's)")
        # Checked before the storage is opened: a bad count should not wait out the
        # database retries first.
        _at_least(("--n-trials", n_trials, 1), ("--num-prompts", num_prompts, 1),
                  ("--warmup", warmup, 0), ("--input-len", input_len, 1),
                  ("--output-len", output_len, 1),
                  ("--heartbeat-interval", heartbeat_interval, 1),
                  ("--grace-period", grace_period, 1))
        if dataset not in ("sharegpt", "synthetic"):
            raise fail(f"--dataset {dataset!r}: give sharegpt or synthetic")
        if not db_retry_s >= 0:
            raise fail(f"--db-retry-s must be >= 0 seconds, got {db_retry_s:g}")
        # In the order the options were always read, so a first error stays the first.
        sp = None if space is None else load_space(space)
        the_slo = None if slo is None else parse_slo(slo)
        ids = parse_gpu_ids(gpu_ids)
        spec = None
        if sp is not None and the_slo is not None:
            workload = ({"kind": "sharegpt", "num_prompts": num_prompts,
                         "max_model_len": max_model_len or int(
                             sp.fixed.get("max_model_len") or DEFAULT_CONTEXT), "seed": seed}
                        if dataset == "sharegpt" else
                        {"kind": "synthetic", "num_prompts": num_prompts, "input_len": input_len,
                         "output_len": output_len, "distribution": "fixed", "seed": seed})
            spec = StudySpec(
                space=space_to_dict(sp), slo=str(the_slo), objective=objective,
                sampler=sampler, seed=seed, n_trials=n_trials,
                gpus=len(ids or []) or sp.profile.get("gpus"), workload=workload,
                load=load_spec(warmup=warmup, seed=seed,
                               min_duration_s=duration("--min-duration", min_duration),
                               max_duration_s=duration("--max-duration", max_duration),
                               backlog_share=backlog_share, max_probes=max_probes, tol=tol))
        options = WorkerOptions(
            study=study, storage=storage, spec=spec, gpus=None if ids is None else tuple(ids),
            n_trials=n_trials, backend=backend.value, vllm_cmd=vllm_cmd, model=model,
            studies_dir=studies_dir, heartbeat_interval=heartbeat_interval,
            grace_period=grace_period, retry_s=db_retry_s, pace_s=pace_s, poll_s=poll_s,
            wait_s=parse_wait(wait))
        run = run_worker(options, say=lambda line: console.print(
            scrub(line, storage), soft_wrap=True, markup=False))
    if run.exit_code:
        err_console.print(f"worker stopped ({run.stopped_by})", markup=False)
        raise typer.Exit(run.exit_code)


# ----------------------------------------------------------------------------- parsing


def _at_least(*checks: tuple[str, int | None, int]) -> None:
    """Each (flag, count, floor): refuse a count under its floor (None: not given)."""
    for flag, value, low in checks:
        if value is not None and value < low:
            raise fail(f"{flag} must be >= {low}, got {value}")


def parse_wait(text: str) -> float:
    """--wait: '10m' -> 600.0; a zero ('0', '0s', '0ms', '0m') -> 0.0, do not wait."""
    if text.strip() in ("0", "0s", "0ms", "0m"):
        return 0.0
    try:
        return parse_duration(text.strip())
    except SLOError as exc:
        raise OptionsError(f"--wait: {exc}") from None


class _scrubbed:
    """Any error that escapes says the URL masked, never its password."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> Literal[False]:
        if exc is None or isinstance(exc, typer.Exit | KeyboardInterrupt | SystemExit):
            return False
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise fail(f"{type(exc).__name__}: {scrub(first, self.url)}", code=1) from None
