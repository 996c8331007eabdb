"""The stored trial record: the one reader of what a trial leaves in Optuna.

``autotune.study.study`` writes each trial's ``user_attrs``: ``result`` holds
``StoredTrial.result_attrs(result)`` (status, feasible, reason, flags, rate, gpus, summary,
evidence, telemetry, the ceiling search with its probes, the launch), next to
``status``, ``reason``, ``feasible``, ``predicted`` and ``baseline``.  The
recommendation, the report, the trackers, the rate table and ``ceiling --study`` read
trials back through :class:`StoredTrial` only, so a figure cannot mean one thing in the
recommendation and another in the report: goodput, above all, is the steady-state
figure of the judged arrivals wherever the test was sized by time, never the whole
window's drain-biased one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autotune.core.files import json_safe
from autotune.core.flags import CLIENT_PARAMS
from autotune.core.metrics import SIMULATED
from autotune.tuning.trial import TrialResult


def as_mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def as_number(value: Any) -> float | None:
    """A stored figure as a float; None for missing, non-numeric, boolean or NaN."""
    if value is None or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def goodput_of(test: Mapping[str, Any], key: str = "goodput_tokens") -> float | None:
    """``goodput_tokens`` or ``goodput_requests`` of a stored load test (a trial's
    result or a ceiling probe).  A test sized by time: goodput over its judged arrivals
    (the figure a trial's value is), not the whole window's, which the drain biases
    low."""
    evidence = as_mapping(test.get("evidence"))
    if evidence:
        return as_number(evidence.get(key))
    return as_number(as_mapping(test.get("summary")).get(key))


@dataclass(frozen=True, kw_only=True)
class StoredTrial:
    """One finished (or failed) trial as stored: Optuna's fields and autotune's attrs."""

    number: int
    state: str  # Optuna's TrialState name: COMPLETE, PRUNED, FAIL, RUNNING, WAITING
    value: float | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, trial: Any) -> StoredTrial:
        """From an Optuna ``FrozenTrial`` (or anything with its fields)."""
        values = getattr(trial, "values", None)
        return cls(number=int(trial.number), state=trial.state.name,
                   value=as_number(trial.value) if values else None,
                   params=dict(trial.params), attrs=dict(trial.user_attrs))

    @staticmethod
    def result_attrs(result: TrialResult) -> dict[str, Any]:
        """What a trial stores as its ``result`` block: the one writer of what
        :class:`StoredTrial` reads back, JSON-able."""
        s = result.summary
        return json_safe({
            "status": result.status,
            "feasible": result.feasible,
            "mode": result.mode,
            "backend": result.backend,
            "reason": result.reason,
            "detail": result.detail,
            "flags": result.flags,
            "rate": result.rate,
            "gpus": result.gpus,
            "summary": None if s is None else s.to_dict(),
            "how": None if s is None else s.how(),
            "prune": None if result.prune is None else result.prune.to_dict(),
            "startup": result.startup,
            "telemetry": result.telemetry,
            "log_path": result.log_path,
            "records_path": result.records_path,
            "load_test_s": result.load_test_s,
            "planned_s": result.planned_s,
            "windows": [[w.t_s, w.in_flight, w.finished] for w in result.windows],
            "verdict": result.verdict,
            "evidence": None if result.evidence is None else result.evidence.to_dict(),
            "budget_cut": result.budget_cut,
        })

    # -- the blocks ---------------------------------------------------------------------
    @property
    def result(self) -> Mapping[str, Any]:
        return as_mapping(self.attrs.get("result"))

    @property
    def summary(self) -> Mapping[str, Any]:
        return as_mapping(self.result.get("summary"))

    @property
    def evidence(self) -> Mapping[str, Any]:
        return as_mapping(self.result.get("evidence"))

    @property
    def telemetry(self) -> Mapping[str, Any]:
        return as_mapping(self.result.get("telemetry"))

    @property
    def ceiling(self) -> Mapping[str, Any]:
        return as_mapping(self.result.get("ceiling"))

    # -- what everyone asks -------------------------------------------------------------
    @property
    def flags(self) -> dict[str, Any]:
        """The server config: as launched, else the sampled server parameters."""
        flags = self.result.get("flags")
        if isinstance(flags, Mapping):
            return dict(flags)
        return {k: v for k, v in self.params.items() if k not in CLIENT_PARAMS}

    @property
    def rate(self) -> float | None:
        return as_number(self.result.get("rate", self.params.get(
            "request_rate", self.summary.get("offered_rate"))))

    @property
    def status(self) -> str:
        found = self.result.get("status") or self.attrs.get("status")
        if found:
            return str(found)
        return {"PRUNED": "pruned", "FAIL": "failed"}.get(self.state, self.state.lower())

    @property
    def reason(self) -> str | None:
        found = self.result.get("reason") or self.attrs.get("reason")
        return None if found is None else str(found)

    @property
    def feasible(self) -> bool:
        """Met the SLO, and Optuna counts the trial (a pruned or failed one never is)."""
        stated = self.result.get("feasible", self.attrs.get("feasible", False))
        return bool(stated) and self.state == "COMPLETE"

    @property
    def objective_value(self) -> float | None:
        return self.value if self.state == "COMPLETE" else None

    @property
    def goodput_tokens(self) -> float | None:
        return self._goodput("goodput_tokens")

    @property
    def goodput_requests(self) -> float | None:
        return self._goodput("goodput_requests")

    def _goodput(self, key: str) -> float | None:
        return goodput_of(self.result, key)

    def measured(self, key: str) -> float | None:
        """A scalar of the trial's load-test summary (``output_throughput``, ...)."""
        return as_number(self.summary.get(key))

    def stat(self, metric: str, key: str) -> float | None:
        """``stat("e2e", "p99")``: a latency statistic of the trial's load test."""
        return as_number(as_mapping(self.summary.get(metric)).get(key))

    @property
    def gpu_util_pct(self) -> float | None:
        return as_number(self.telemetry.get("gpu_util_mean_pct"))

    @property
    def gpus(self) -> int:
        stated = self.result.get("gpus")
        if stated:
            return int(stated)
        flags = self.flags
        return int(flags.get("tensor_parallel_size", 1) or 1) * int(
            flags.get("pipeline_parallel_size", 1) or 1)

    @property
    def source(self) -> str | None:
        found = self.summary.get("source")
        if found:
            return str(found)
        return SIMULATED if self.result.get("mode") == "virtual" else None

    @property
    def baseline(self) -> bool:
        return bool(self.attrs.get("baseline"))

    @property
    def predicted(self) -> dict[str, Any] | None:
        found = self.attrs.get("predicted")
        return dict(found) if isinstance(found, Mapping) else None

    @property
    def launch(self) -> dict[str, Any] | None:
        found = self.result.get("launch")
        return dict(found) if isinstance(found, Mapping) else None

    @property
    def repeat_of(self) -> int | None:
        found = self.result.get("repeat_of")
        return None if found is None else int(found)

    def probes(self, trials: Sequence[StoredTrial] = ()) -> list[dict[str, Any]]:
        """The ceiling search's load tests; a repeated config's are its twin's (found
        among ``trials``)."""
        own = self.ceiling.get("probes")
        if own:
            return [dict(p) for p in own]
        twin = next((t for t in trials if t.number == self.repeat_of), None)
        return twin.probes() if twin is not None else []


def stored_trials(study: Any, *, finished: bool = True) -> list[StoredTrial]:
    """Every trial of an Optuna study, in trial order (``finished``: not the running or
    waiting ones)."""
    out = []
    for t in study.get_trials(deepcopy=False):
        if finished and t.state.name in ("RUNNING", "WAITING"):
            continue
        out.append(StoredTrial.of(t))
    return out
