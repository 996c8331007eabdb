"""What a report shows, read from a study (and ceiling files, and imported results).

Everything here turns storage into plain rows (dicts with the
``autotune.study.experiments.COLUMNS`` keys plus a few of the report's own); the plots and
the pages never touch Optuna.  Trials are read through ``autotune.tuning.record.StoredTrial``,
the one reader the recommendation uses too, so both show the same goodput (the
steady-state one of the judged arrivals); the study's ``user_attrs`` hold the SLO, the
objective and the GPU count.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna

from autotune.core.errors import AutotuneError
from autotune.core.flags import CLIENT_PARAMS, config_key
from autotune.core.terminal import mask_url
from autotune.study.experiments import CONFIG_COLUMNS
from autotune.study.storage import StorageError, open_storage
from autotune.tuning.load_unit import LoadUnit
from autotune.tuning.record import StoredTrial, as_mapping, as_number, goodput_of

# Flags people recognise by short names in labels and legends.
SHORT = {
    "tensor_parallel_size": "TP",
    "pipeline_parallel_size": "PP",
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "batched",
    "enable_chunked_prefill": "chunked",
    "gpu_memory_utilization": "gpu_mem",
    "max_concurrency": "conc",
}


class ReportError(AutotuneError, ValueError):
    """The report cannot be made as asked (unknown or empty study, unreadable file)."""


@dataclass
class StudyData:
    name: str
    storage: str
    attrs: dict[str, Any]
    rows: list[dict[str, Any]]  # one per trial, in trial order
    ceilings: list[dict[str, Any]] = field(default_factory=list)
    imported: list[Mapping[str, Any]] = field(default_factory=list)
    recommendation: dict[str, Any] | None = None
    direction: str = "maximize"
    importances: dict[str, float] | None = None
    importance_note: str = ""

    @property
    def slo(self) -> str | None:
        slo = self.attrs.get("slo")
        if slo:
            return str(slo)
        return next((r["slo"] for r in self.rows if r.get("slo")), None)

    @property
    def unit(self) -> str:
        """What a trial's rate, ceiling and cap count: req/s, or the users (or requests
        in flight) of a search --by users (or concurrency)."""
        spec = self.attrs.get("load_unit")
        return LoadUnit.from_spec(spec if isinstance(spec, Mapping) else None).label

    @property
    def feasible(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("feasible")]


# ----------------------------------------------------------------------------- storage


def default_storage(name: str, studies_dir: Path = Path("studies")) -> str:
    return f"sqlite:///{(studies_dir / f'{name}.db').as_posix()}"


def load_study(name: str, storage: str) -> Any:
    """The Optuna study, or a ReportError naming the studies that do exist.

    Any storage ``autotune search`` takes (SQLite, PostgreSQL/MySQL, ``journal:PATH``)
    opens through ``autotune.study.storage``; a URL is only ever shown with its password masked.
    """

    shown = mask_url(storage)
    if storage.startswith("sqlite:///"):
        path = Path(storage[len("sqlite:///"):])
        if not path.exists():
            # Opening a missing sqlite file would create an empty database.
            raise ReportError(
                f"no study database at {path}: run `autotune search --study-name {name}` "
                "first, or pass --storage URL")
    try:
        opened = open_storage(storage, heartbeat_interval=None, grace_period=None)
        names = optuna.get_all_study_names(storage=opened)
    except StorageError as exc:  # its line already names the storage, masked
        raise ReportError(str(exc)) from None
    except Exception as exc:  # sqlalchemy errors come in many kinds
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ReportError(f"cannot open storage {shown}: {mask_url(first)}") from None
    if name not in names:
        known = ", ".join(sorted(names)) or "none"
        raise ReportError(f"no study named {name!r} in {shown} (studies there: {known})")
    return optuna.load_study(study_name=name, storage=opened)


# ----------------------------------------------------------------------------- rows


_f = as_number
_mapping = as_mapping


def config_label(config: Mapping[str, Any], keys: Sequence[str] | None = None) -> str:
    """``TP=4 seqs=192 chunked`` from the flags in ``keys`` (all server flags if None)."""
    parts = []
    for k in keys if keys is not None else sorted(config):
        if k in ("model", "max_model_len") or k not in config:
            continue
        v = config[k]
        name = SHORT.get(k, k)
        if v is True:
            parts.append(name)
        elif v is False:
            parts.append(f"no-{name}")
        else:
            parts.append(f"{name}={v:g}" if isinstance(v, float) else f"{name}={v}")
    return " ".join(parts) or "defaults"


def trial_row(trial: Any, study_name: str) -> dict[str, Any]:
    """One Optuna FrozenTrial as a report row (read through ``StoredTrial``, as the
    recommendation reads it)."""
    t = StoredTrial.of(trial)
    res, summary = t.result, t.summary
    config = t.flags
    if t.params.get("max_concurrency") is not None:
        config["max_concurrency"] = t.params["max_concurrency"]
    status, reason = t.status, t.reason
    check = _mapping(summary.get("slo_check"))
    pruned = t.state == "PRUNED" or status == "pruned"
    when = trial.datetime_complete or trial.datetime_start
    row: dict[str, Any] = {
        "time": when.isoformat(timespec="seconds") if isinstance(when, datetime) else None,
        "study": study_name,
        "trial": t.number,
        "config_json": config,
        "rate": t.rate,
        # Every load test of the trial's rate search (its row shows the one at its rate).
        "load_tests": len(t.ceiling.get("probes") or []) or None,
        "request_throughput": t.measured("request_throughput"),
        "output_throughput": t.measured("output_throughput"),
        "total_token_throughput": t.measured("total_token_throughput"),
        "ttft_p50_s": t.stat("ttft", "p50"),
        "ttft_p99_s": t.stat("ttft", "p99"),
        "tpot_p50_s": t.stat("tpot", "p50"),
        "tpot_p99_s": t.stat("tpot", "p99"),
        "e2e_p50_s": t.stat("e2e", "p50"),
        "e2e_p99_s": t.stat("e2e", "p99"),
        "goodput_requests": t.goodput_requests,
        "goodput_tokens": t.goodput_tokens,
        "attainment": t.measured("attainment"),
        "meets_slo": check.get("met") if check else None,
        "slo": summary.get("slo"),
        "gpu_util_mean_pct": t.gpu_util_pct,
        "gpu_util_max_pct": _f(t.telemetry.get("gpu_util_max_pct")),
        "pruned": pruned,
        "pruned_reason": reason if pruned else None,
        "backend": res.get("backend") or t.attrs.get("backend"),
        "source": t.source,
        "num_measured": summary.get("num_measured"),
        "duration_s": t.measured("duration_s"),
        # The report's own columns.
        "state": t.state,
        "status": status,
        "reason": reason,
        "detail": res.get("detail"),
        "feasible": t.feasible,
        "value": t.objective_value,
        "baseline": t.baseline,
        "gpus": t.gpus,
        "config": config,
        "config_key": config_key(config),
        "margins": dict(check.get("margins") or {}) if check else {},
        "binding": check.get("binding") if check else None,
        "how": res.get("how"),
        "telemetry": dict(t.telemetry),
        "windows": list(res.get("windows") or []),
        "records_path": res.get("records_path"),
        "launched": res.get("launched", t.state != "FAIL"),
        "predicted": t.predicted,
    }
    for key in CONFIG_COLUMNS:
        if key in config:
            row[key] = config[key]
    return row


def varying_keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The config flags that differ between rows (the ones worth naming)."""
    values: dict[str, set[str]] = {}
    for r in rows:
        for k, v in (r.get("config") or r.get("config_json") or {}).items():
            if k not in CLIENT_PARAMS:
                values.setdefault(k, set()).add(repr(v))
    keys = [k for k, vs in values.items() if len(vs) > 1]
    order = list(SHORT)
    return sorted(keys, key=lambda k: (order.index(k) if k in order else len(order), k))


# ----------------------------------------------------------------------------- files


def read_ceilings(out_dir: Path) -> list[dict[str, Any]]:
    """Ceiling results (``autotune ceiling`` JSON) found in the study's folder."""
    found: list[dict[str, Any]] = []
    if not out_dir.is_dir():
        return found
    for path in sorted(out_dir.glob("**/ceiling*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        items = data if isinstance(data, list) else data.get("ceilings", [data]) \
            if isinstance(data, Mapping) else []
        for item in items:
            if isinstance(item, Mapping) and isinstance(item.get("probes"), list):
                found.append({**item, "path": str(path)})
    return found


def ceiling_probe_rows(ceilings: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for c in ceilings:
        config = c.get("config") or c.get("flags") or {}
        for p in c.get("probes", []):
            if not isinstance(p, Mapping):
                continue
            summary = _mapping(p.get("summary"))
            checks = p.get("checks") or []
            rows.append({
                "config": config,
                "config_key": config_key(config) if config else None,
                "trial": c.get("trial"),
                "index": p.get("index"),
                "phase": p.get("phase"),
                "rate": _f(p.get("rate")),
                "num_prompts": p.get("num_prompts"),
                "verdict": p.get("verdict"),
                "binding": p.get("binding"),
                "request_throughput": _f(p.get("request_throughput")),
                "output_throughput": _f(p.get("output_throughput")),
                "goodput_tokens": goodput_of(p),
                "e2e_p99_s": _f(_mapping(summary.get("e2e")).get("p99")),
                "checks": checks,
                # A probe stores its mean utilisation as 0..1; every table shows percent.
                "gpu_util_pct": (None if _f(p.get("gpu_util")) is None
                                 else 100.0 * float(p["gpu_util"])),
                "pruned": bool(p.get("pruned")),
                "prune_reason": p.get("prune_reason"),
                "source": c.get("source"),
                "feasible_max": _f(c.get("feasible_max")),
                "infeasible_min": _f(c.get("infeasible_min")),
                "recommended_cap": _f(c.get("recommended_cap")),
            })
    return rows


def read_recommendation(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / "recommendation.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_timeline(row: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Series over the load test of one trial: GPU util, KV-cache usage, in flight.

    Read from the trial's telemetry (``timeline``: rows with ``t_s`` and
    ``kv_cache_usage``/``running``/``waiting``, or the simulator's ``time_s``/``kv_usage``/
    ``busy_fraction``; ``gpu_samples``: rows with ``t_s`` and
    ``util_pct``) and from the pruner's windows (``[t_s, in_flight, finished]``).
    """
    tel = row.get("telemetry") or {}
    out: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, t: Any, v: Any) -> None:
        tf, vf = _f(t), _f(v)
        if tf is not None and vf is not None:
            out.setdefault(name, []).append((tf, vf))

    timeline = tel.get("timeline") or tel.get("engine_timeline") or []
    for p in timeline if isinstance(timeline, list) else []:
        if not isinstance(p, Mapping):
            continue
        # MetricsScraper.timeline() rows (t_s, kv_cache_usage 0..1, running, waiting) and
        # the simulator's TimelinePoint (time_s, kv_usage 0..1, busy_fraction 0..1).
        t = p.get("t_s", p.get("time_s"))
        kv = _f(p.get("kv_cache_usage", p.get("kv_usage")))
        add("kv_cache_usage_pct", t, None if kv is None else 100.0 * kv)
        add("running", t, p.get("running"))
        add("waiting", t, p.get("waiting"))
        busy = _f(p.get("busy_fraction"))
        add("gpu_util_pct", t, p.get("gpu_util_pct", None if busy is None else 100 * busy))
    samples = tel.get("gpu_samples") or []
    for p in samples if isinstance(samples, list) else []:
        if isinstance(p, Mapping):
            add("gpu_util_pct", p.get("t_s"), p.get("util_pct"))
    for w in row.get("windows") or []:
        if isinstance(w, list | tuple) and len(w) >= 2:
            add("in_flight", w[0], w[1])
    for key, series in out.items():
        t0 = min(t for t, _ in series)
        out[key] = sorted((t - t0, v) for t, v in series)
    return out
