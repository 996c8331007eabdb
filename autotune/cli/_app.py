"""The Typer application every command module registers itself on."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="autotune",
    help="SLO-aware auto-tuner for vLLM: goodput under a P99 latency SLO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
