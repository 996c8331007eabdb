"""Optional experiment trackers: wandb and MLflow, each used only when installed.

Neither is a dependency.  ``make_trackers(wandb_project=..., mlflow_uri=...)`` returns
one tracker per service asked for, or raises :class:`TrackerUnavailable` with one line
that says how to install the missing package.  Each tracker logs one load test (an
``experiments.csv`` row) per ``log`` call; ``optuna_callback`` logs every finished
trial of a study.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from autotune.core.errors import AutotuneError
from autotune.report.data import trial_row
from autotune.study.experiments import COLUMNS


class TrackerUnavailable(AutotuneError, RuntimeError):
    """The tracker's package is not installed (the message says what to pip install)."""


class Tracker(Protocol):
    name: str

    def log(self, row: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


def _import(package: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError:
        raise TrackerUnavailable(f"{package} is not installed: pip install {package}") from None


def metrics_of(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite figures of a row (what a tracker can chart)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, int | float) and math.isfinite(v):
            out[k] = float(v)
    return out


def params_of(row: Mapping[str, Any]) -> dict[str, Any]:
    config = row.get("config_json") or row.get("config") or {}
    params = {str(k): v for k, v in dict(config).items()} if isinstance(config, Mapping) else {}
    for k in ("study", "backend", "source", "slo", "pruned_reason"):
        if row.get(k) is not None:
            params[k] = row[k]
    return params


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str, *, run_name: str | None = None) -> None:
        self._wandb = _import("wandb")
        self._run = self._wandb.init(project=project, name=run_name, reinit=True,
                                     job_type="autotune")
        self._step = 0

    def log(self, row: Mapping[str, Any]) -> None:
        data = metrics_of(row)
        for k, v in params_of(row).items():
            data[f"config/{k}"] = v
        self._run.log(data, step=self._step)
        self._step += 1

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """One MLflow run per load test (nested under one parent run per session)."""

    name = "mlflow"

    def __init__(self, uri: str, *, experiment: str = "autotune") -> None:
        self._mlflow = _import("mlflow")
        self._mlflow.set_tracking_uri(uri)
        self._mlflow.set_experiment(experiment)

    def log(self, row: Mapping[str, Any]) -> None:
        name = f"{row.get('study') or 'load-test'}-{row.get('trial')}"
        with self._mlflow.start_run(run_name=name):
            self._mlflow.log_params({k: str(v) for k, v in params_of(row).items()})
            self._mlflow.log_metrics(metrics_of(row))

    def close(self) -> None:
        pass


def make_trackers(*, wandb_project: str | None = None, mlflow_uri: str | None = None
                  ) -> list[Tracker]:
    """The trackers asked for; TrackerUnavailable before any is started if one is
    missing, so a study never runs half-tracked."""
    if wandb_project:
        _import("wandb")
    if mlflow_uri:
        _import("mlflow")
    trackers: list[Tracker] = []
    if wandb_project:
        trackers.append(WandbTracker(wandb_project))
    if mlflow_uri:
        trackers.append(MlflowTracker(mlflow_uri))
    return trackers


def optuna_callback(trackers: Sequence[Tracker], study_name: str
                    ) -> Callable[[Any, Any], None]:
    """``study.optimize(callbacks=[...])``: log each finished trial's load test."""
    def callback(study: Any, trial: Any) -> None:
        row = trial_row(trial, study_name)
        if not row.get("num_measured"):
            return
        flat = {k: row.get(k) for k in COLUMNS if k in row}
        for t in trackers:
            t.log(flat)

    return callback
