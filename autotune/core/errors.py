"""The one base of every error autotune reports to its user.

An ``AutotuneError``'s message is one line the user can act on; the CLI catches the
base once (``cli._common.one_line_errors``), prints that line and exits 2.  Anything
else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """An error meant for the user: its first line says what went wrong and how to fix it."""

    exit_code = 2
