"""The experiment history: ``studies/<name>/experiments.csv``, one row per load test.

The file is append-only and shared by every study run in its folder (and by several
workers at once), so rows from different days and tuning rounds compare in pandas
with one ``read_csv``.  The column order is fixed; the full config goes into one JSON
column so that a flag a later study adds never changes the header, and the flags
people filter on most also get a column of their own.

Concurrency: each row is written with one ``write()`` of the whole line while holding
an exclusive ``fcntl.flock`` on the file; the header is written under the same lock
only when the file is empty.  Two processes appending at once never tear a line.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import math
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from autotune.core.errors import AutotuneError

# Flags that get their own column (the rest live in ``config_json``).
CONFIG_COLUMNS: tuple[str, ...] = (
    "tensor_parallel_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "gpu_memory_utilization",
    "max_concurrency",
)

COLUMNS: tuple[str, ...] = (
    "time",
    "study",
    "trial",
    *CONFIG_COLUMNS,
    "config_json",
    "rate",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "goodput_requests",
    "goodput_tokens",
    "attainment",
    "meets_slo",
    "slo",
    "gpu_util_mean_pct",
    "gpu_util_max_pct",
    "pruned",
    "pruned_reason",
    "backend",
    "source",
    "num_measured",
    "duration_s",
    "purpose",  # what the load test was for: PURPOSES
)
# Why a load test ran: a trial's own rate search, the refinement of a top config's
# ceiling after the study, or the validation run of the recommended cap.  The rate table
# is read from the trial's and the validation's rows (it runs no test of its own).
PURPOSES = ("trial", "refinement", "validation")


class ExperimentsError(AutotuneError, ValueError):
    """An experiments.csv row or file is not what this module writes."""


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return str(value)


def format_row(row: Mapping[str, Any]) -> str:
    """One CSV line (with its newline) in :data:`COLUMNS` order.

    Keys not in :data:`COLUMNS` are refused, so a typo never silently drops a figure.
    Missing keys are empty cells; ``time`` defaults to now (UTC, ISO 8601).
    """
    unknown = sorted(set(row) - set(COLUMNS))
    if unknown:
        raise ExperimentsError(
            f"unknown experiments.csv column(s) {', '.join(unknown)}; "
            f"known: {', '.join(COLUMNS)}"
        )
    values = dict(row)
    values.setdefault("time", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([_cell(values.get(c)) for c in COLUMNS])
    return buf.getvalue()


def header_line() -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(COLUMNS)
    return buf.getvalue()


def append_experiment(path: str | os.PathLike[str], row: Mapping[str, Any]) -> None:
    """Append one load test to ``path`` (created with its header when absent)."""
    path = Path(path)
    line = format_row(row).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                line = header_line().encode("utf-8") + line
            else:
                _check_header(path)
            _write_all(fd, line)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    # O_APPEND puts each write() at the end; a short write (rare, e.g. a full disk)
    # is finished while still holding the lock so the line stays whole.
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _check_header(path: Path) -> None:
    with path.open("r", encoding="utf-8", newline="") as f:
        first = f.readline()
    if first != header_line():
        raise ExperimentsError(
            f"{path} does not start with the experiments.csv header of this version; "
            "move it aside (it is never rewritten) and a new one is started"
        )


def row_from_summary(
    summary: Mapping[str, Any],
    *,
    study: str | None = None,
    trial: int | None = None,
    config: Mapping[str, Any] | None = None,
    rate: float | None = None,
    backend: str | None = None,
    gpu: Mapping[str, Any] | None = None,
    pruned_reason: str | None = None,
    time: str | None = None,
    purpose: str = "trial",
) -> dict[str, Any]:
    """An experiments row from a ``Summary.to_dict()`` and the trial's context.

    ``gpu``: a ``GpuSummary.to_dict()`` (or anything with ``util_mean_pct`` and
    ``util_max_pct``).
    """
    config = dict(config or {})

    def stat(metric: str, key: str) -> Any:
        value = summary.get(metric) or {}
        return value.get(key) if isinstance(value, Mapping) else None

    check = summary.get("slo_check") or {}
    row: dict[str, Any] = {
        "study": study,
        "trial": trial,
        "config_json": config,
        "rate": rate if rate is not None else summary.get("offered_rate"),
        "request_throughput": summary.get("request_throughput"),
        "output_throughput": summary.get("output_throughput"),
        "total_token_throughput": summary.get("total_token_throughput"),
        "ttft_p50_s": stat("ttft", "p50"),
        "ttft_p99_s": stat("ttft", "p99"),
        "tpot_p50_s": stat("tpot", "p50"),
        "tpot_p99_s": stat("tpot", "p99"),
        "e2e_p50_s": stat("e2e", "p50"),
        "e2e_p99_s": stat("e2e", "p99"),
        "goodput_requests": summary.get("goodput_requests"),
        "goodput_tokens": summary.get("goodput_tokens"),
        "attainment": summary.get("attainment"),
        "meets_slo": check.get("met") if isinstance(check, Mapping) else None,
        "slo": summary.get("slo"),
        "gpu_util_mean_pct": (gpu or {}).get("util_mean_pct"),
        "gpu_util_max_pct": (gpu or {}).get("util_max_pct"),
        "pruned": pruned_reason is not None,
        "pruned_reason": pruned_reason,
        "purpose": purpose,
        "backend": backend,
        "source": summary.get("source"),
        "num_measured": summary.get("num_measured"),
        "duration_s": summary.get("duration_s"),
    }
    for key in CONFIG_COLUMNS:
        if key in config:
            row[key] = config[key]
    if time is not None:
        row["time"] = time
    return row


def read_experiments(path: str | os.PathLike[str]) -> Any:
    """The whole history as a pandas DataFrame (``config_json`` kept as text)."""
    import pandas as pd  # optional and heavy: only this reader needs it

    path = Path(path)
    if not path.exists():
        raise ExperimentsError(f"no experiments file at {path}")
    return pd.read_csv(path, dtype={"config_json": str, "pruned_reason": str, "study": str})
