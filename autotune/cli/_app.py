"""The Typer application every command module registers itself on."""

from __future__ import annotations

import typer

from autotune.servers.process import install_signal_handlers

app = typer.Typer(
    name="autotune",
    help="SLO-aware auto-tuner for vLLM: goodput under a P99 latency SLO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _before_every_command() -> None:
    # search, sweep, ceiling, worker and bench start servers: Ctrl-C, SIGTERM and SIGHUP
    # must stop them in order, from the command's first line on, not only once the
    # first server is up.
    install_signal_handlers()
