"""The Typer application every command module registers itself on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

from autotune.servers.process import install_signal_handlers, restore_signal_handlers

# Click's UsageError (unknown option, bad value, missing option).  Recent Typer vendors
# Click as a private module, older Typer uses Click itself; either way it is the base of
# the public typer.BadParameter, which is where it is taken from.
_UsageError: type[Exception] = typer.BadParameter.__mro__[1]


@contextlib.contextmanager
def _one_line_usage_errors(ctx: Any) -> Iterator[None]:
    try:
        yield
    except _UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            raise  # `autotune` alone: the help text is the answer
        # Click's default is a usage line, a hint and a boxed error: five lines where
        # every other bad input gives one.  The message already names the option.
        where = getattr(getattr(exc, "ctx", None) or ctx, "command_path", None) or "autotune"
        typer.echo(f"error: {exc.format_message()} (see {where} --help)",  # type: ignore[attr-defined]
                   err=True)
        raise typer.Exit(getattr(exc, "exit_code", 2)) from None


class OneLineGroup(TyperGroup):
    """autotune's command group: a usage error (unknown flag, bad value type, missing
    option) is one line on stderr and exit 2, like every other bad input."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None,
                     **extra: Any) -> Any:
        with _one_line_usage_errors(parent):
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with _one_line_usage_errors(ctx):
            return super().invoke(ctx)


app = typer.Typer(
    name="autotune",
    cls=OneLineGroup,
    help="SLO-aware auto-tuner for vLLM: goodput under a P99 latency SLO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _before_every_command(ctx: typer.Context) -> None:
    # search, sweep, ceiling, worker and bench start servers: Ctrl-C, SIGTERM and SIGHUP
    # must stop them in order, from the command's first line on, not only once the
    # first server is up.  When the command returns, the handlers that were there
    # before come back (the CLI run in-process, by a test or a notebook, leaves none).
    if install_signal_handlers():
        ctx.call_on_close(restore_signal_handlers)
