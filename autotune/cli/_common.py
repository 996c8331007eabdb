"""Helpers shared by the CLI commands: one-line errors, atomic files, summary tables."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer

from autotune.core.errors import AutotuneError
from autotune.core.terminal import err_console, mask_url


class UsageError(AutotuneError):
    """Bad input the user can fix; the message says what and how."""


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear line and return the Exit to raise."""
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


