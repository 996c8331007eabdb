"""The one pair of rich consoles that every command prints through."""

from __future__ import annotations

import os
import re
import sys
from typing import TextIO

from rich.console import Console

# Rich sizes a console to its terminal and, with none (a pipe, a file, a CI log), to 80
# columns, where the wider tables cut numbers short with "…" (a P99 of "8,165…").  A log
# has room: without a terminal and without COLUMNS, print to this width instead.
LOG_WIDTH = 160


def _width(stream: TextIO) -> int | None:
    if os.environ.get("COLUMNS"):
        return None  # the user's (or the shell's) choice
    try:
        return None if stream.isatty() else LOG_WIDTH
    except (AttributeError, ValueError):  # a closed or unusual stream
        return LOG_WIDTH


console = Console(stderr=False, highlight=False, width=_width(sys.stdout))
err_console = Console(stderr=True, highlight=False, width=_width(sys.stderr))


# A URL's password never reaches the terminal, whichever command prints it.
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/@\s]*:)(?P<pw>[^@\s]*)@")


def mask_url(url: str) -> str:
    """``postgresql://user:secret@host/db`` -> ``postgresql://user:***@host/db``."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}***@", url)


def url_password(url: str) -> str | None:
    """The password a URL holds, to scrub it from what a server prints (None: none)."""
    m = _URL_PASSWORD.search(url)
    return m.group("pw") if m and m.group("pw") else None
