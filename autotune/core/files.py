"""Result files: whole or not at all, and JSON without inf/nan."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autotune.core.errors import AutotuneError


def json_safe(obj: Any) -> Any:
    """JSON has no inf/nan: they become None (null); keys become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def _umask() -> int:
    """The process umask, read without setting it (os.umask would change it for every
    thread for a moment); 0o022 where /proc does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def atomic_write(path: str | os.PathLike[str], text: str) -> None:
    """Write a whole file or nothing: a crash never leaves half a result behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); a result file gets the umask's mode, as
        # any file the user writes does.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block.

    Processes on one host take turns; the kernel releases the lock when its holder
    dies, so a killed holder never blocks the others.  The file itself stays: deleting
    it would let a late process lock a new file while another holds the old one.
    """
    import fcntl  # POSIX only, like the servers this locks for

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


class OutputError(AutotuneError, ValueError):
    """An output file that cannot be written where the user asked."""


def check_writable(path: Path | None, what: str) -> None:
    """Fail before any work if an output file cannot be written later."""
    if path is None:
        return
    parent = path.resolve().parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {what} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise OutputError(f"cannot write {what} {path}: folder {parent} is not writable")
    if path.is_dir():
        raise OutputError(f"cannot write {what} {path}: it is a folder; give a file name")


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON, whole or not at all; inf and nan as null."""
    atomic_write(path, json.dumps(json_safe(data), indent=2, allow_nan=False, default=str)
                 + "\n")
