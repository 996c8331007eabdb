"""Helpers shared by the CLI commands: one-line errors, atomic files, summary tables."""

from __future__ import annotations

import contextlib
import csv
import io
import math
from collections.abc import Iterator, Sequence

import typer
from rich.table import Table

from autotune.core.errors import AutotuneError
from autotune.core.metrics import LatencyStats, Summary
from autotune.core.records import RequestRecord
from autotune.core.terminal import err_console


class UsageError(AutotuneError):
    """Bad input the user can fix; the message says what and how."""


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear line and return the Exit to raise."""
    from autotune.study.storage import mask_url

    # A library message may quote a storage URL as given (autotune.study.study does for
    # SQLite-style URLs of any scheme): its password never reaches the terminal.
    err_console.print(f"[bold red]error:[/] {mask_url(message)}", soft_wrap=True)
    return typer.Exit(code)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception classes whose message is meant for the user: the ``AutotuneError``
    tree, caught once here."""
    return (AutotuneError,)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn the user-facing exceptions of the library into one line and exit 2."""
    try:
        yield
    except user_errors() as exc:
        raise fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


RECORD_COLUMNS = (
    "index", "warmup", "scheduled_s", "dispatched_s", "sent_s", "first_token_s", "end_s",
    "prompt_tokens", "output_tokens", "expected_output_tokens", "status", "error",
    "ttft_s", "tpot_s", "e2e_s", "send_lag_s", "num_chunks",
)


def records_csv(records: Sequence[RequestRecord]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(RECORD_COLUMNS)
    for r in records:
        writer.writerow([
            r.index, r.warmup, r.scheduled_s, r.dispatched_s, r.sent_s, r.first_token_s,
            r.end_s, r.prompt_tokens, r.output_tokens, r.expected_output_tokens, r.status,
            r.error or "", r.ttft_s, r.tpot_s, r.e2e_s, r.send_lag_s, len(r.chunk_times_s),
        ])
    return buf.getvalue()


def ms(value: float) -> str:
    if value is None or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "∞"
    return f"{value * 1e3:,.1f}"


def _latency_row(name: str, stats: LatencyStats) -> list[str]:
    bound = f"[{ms(stats.p99_lo)}, {ms(stats.p99_hi)}]"
    return [name, ms(stats.mean), ms(stats.p50), ms(stats.p90), ms(stats.p99), bound,
            ms(stats.max), str(stats.count)]


def summary_tables(summary: Summary, *, title: str) -> list[Table]:
    """The throughput table and the latency table of one load test."""
    top = Table(title=title, show_header=False, title_justify="left")
    top.add_column("figure")
    top.add_column("value", justify="right")
    rate = "unlimited" if summary.offered_rate in (None, math.inf) else f"{summary.offered_rate:g}"
    rows = [
        ("Offered rate (req/s)", rate),
        # The whole schedule (warm-up included) has the offered mean gap; its measured
        # part, a sample of it, need not, so it is named for what it is.
        ("Measured arrivals: scheduled / sent rate (req/s)",
         f"{summary.scheduled_rate:.2f} / {summary.achieved_send_rate:.2f}"),
        ("Measured requests", f"{summary.num_measured}"),
        ("Successful / failed", f"{summary.num_completed} / {summary.num_failed}"),
        ("Warm-up excluded", f"{summary.num_warmup_excluded}"),
        ("Measured window (s)", f"{summary.duration_s:.2f}"),
        ("Request throughput (req/s)", f"{summary.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{summary.output_throughput:,.1f}"),
        ("Total token throughput (tok/s)", f"{summary.total_token_throughput:,.1f}"),
        ("Total input / output tokens",
         f"{summary.total_input_tokens:,} / {summary.total_output_tokens:,}"),
        ("Send lag p99 (ms)", ms(summary.send_lag_p99_s)),
    ]
    if summary.failure_reasons:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(summary.failure_reasons.items()))
        rows.append(("Failures by reason", reasons))
    if summary.slo is not None and summary.slo_check is not None:
        verdict = "met" if summary.slo_check.met else "MISSED (" + ", ".join(
            summary.slo_check.failed) + ")"
        rows += [
            ("SLO", f"{summary.slo}: {verdict}"),
            ("Goodput (req/s)", f"{summary.goodput_requests:.2f}"),
            ("Goodput (output tok/s)", f"{summary.goodput_tokens:,.1f}"),
            ("SLO attainment", f"{summary.attainment:.1%}"),
        ]
    for name, value in rows:
        top.add_row(name, value)

    lat = Table(title="Latency (ms); p99 bound = 95% distribution-free interval",
                title_justify="left")
    for col in ("metric", "mean", "p50", "p90", "p99", "p99 95% bound", "max", "n"):
        lat.add_column(col, justify="right" if col != "metric" else "left")
    for name in ("ttft", "tpot", "itl", "e2e"):
        lat.add_row(*_latency_row(name.upper(), getattr(summary, name)))
    return [top, lat]
