"""The one owner of every server process autotune starts.

A server (vLLM, the simulator's HTTP server, the fake server) holds GPUs, a port and
minutes of start-up; nothing may outlive the autotune process that started it.  So
every server is started by :func:`spawn`, which gives it

* its own process group (a new session), led by a small **guard** process that runs
  the server as its child.  The guard holds the read end of a *lifeline* pipe whose
  only writer is the autotune process: when autotune dies, however it dies
  (``kill -9`` included), the kernel closes the write end, the guard reads EOF and
  takes the whole group down (SIGTERM, grace, SIGKILL).  A pipe rather than
  ``PR_SET_PDEATHSIG``: that signal fires when the *thread* that forked exits, and
  servers are started from whatever thread runs the trial;
* a place in the registry of live processes, which :func:`stop_all` empties at
  interpreter exit (atexit) and on the signals that :func:`install_signal_handlers`
  turns into an orderly exit.

:func:`stop_group` stops one: SIGTERM to the group, ``grace_s``, SIGKILL, then it
checks that no process of the group (or descendant that left it) remains and that
the port no longer accepts connections.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, Protocol

log = logging.getLogger("autotune.servers.process")

# ----------------------------------------------------------------------------- /proc


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), None if
    gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rfind(")") + 2 :].split()


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, None if gone."""
    rest = _stat_fields(pid)
    return None if rest is None else (rest[0], int(rest[1]), int(rest[2]))


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out = []
    for pid in all_pids():
        st = proc_stat(pid)
        if st and st[2] == pgid and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (they may have left its group with setsid)."""
    children: dict[int, list[int]] = {}
    for p in all_pids():
        st = proc_stat(p)
        if st and st[0] not in ("Z", "X"):
            children.setdefault(st[1], []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def pid_alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def rss_bytes(pids: Sequence[int]) -> int:
    """Sum of VmRSS over ``pids`` (shared pages counted once per process)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def cpu_seconds(pids: Sequence[int]) -> float:
    """User and system CPU seconds ``pids`` have used (those gone since are skipped)."""
    ticks = 0
    for pid in pids:
        rest = _stat_fields(pid)
        if rest is not None:
            ticks += int(rest[11]) + int(rest[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


# ----------------------------------------------------------------------------- ports


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_listening(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def port_bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ----------------------------------------------------------------------------- guard

# Runs as ``python -c GUARD_CODE FD GRACE ARGV...``, the leader of the server's group.
# The server gets SIGTERM/SIGINT/SIGHUP at their defaults (the guard may have been
# started with them ignored, e.g. under nohup).  The guard exits with the server's own
# status (a signal death re-raised as one), so a start that fails is classified from
# the server's exit, not the guard's.  A SIGTERM from the owner's stop gets a few
# seconds beyond the grace before the guard's own SIGKILL: the owner escalates itself,
# and the guard's timer only covers an owner that dies half-way through its stop.
#
# The owner's death is handled by the thread that reads the lifeline, not by a signal
# to the guard itself: a signal lands on any thread, and one taken by the reader left
# the main thread blocked in waitpid with the stop never run.  The lock makes "start
# the server" and "stop the group" exclusive, so a server is never started after the
# stop was sent (it would have run, unsignalled, for the whole grace).
GUARD_CODE = """\
import os, signal, sys, threading
fd, grace, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
stopping, orphaned = threading.Event(), threading.Event()
lock = threading.RLock()
def kill_all():
    os.killpg(0, signal.SIGKILL)
def down(signum=None, frame=None):
    with lock:
        if stopping.is_set():
            return
        stopping.set()
        try:
            os.killpg(0, signal.SIGTERM)
        except OSError:
            pass
    timer = threading.Timer(grace if orphaned.is_set() else grace + 5.0, kill_all)
    timer.daemon = True
    timer.start()
def watch():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    while True:
        try:
            if not os.read(fd, 64):
                break
        except OSError:
            break
    orphaned.set()
    down()
signal.signal(signal.SIGTERM, down)
threading.Thread(target=watch, daemon=True).start()
pid = None
with lock:
    if not stopping.is_set():
        try:
            pid = os.posix_spawnp(argv[0], argv, os.environ, setsigdef=(
                signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
        except OSError as e:
            print(f"autotune guard: cannot run {argv[0]}: {e}", file=sys.stderr, flush=True)
            sys.exit(127)
        if stopping.is_set():
            os.kill(pid, signal.SIGTERM)
status = int(signal.SIGTERM)
while pid is not None:
    try:
        status = os.waitpid(pid, 0)[1]
        break
    except ChildProcessError:
        status = 0
        break
if stopping.is_set():
    kill_all()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
try:
    os.killpg(0, signal.SIGTERM)
except OSError:
    pass
code = os.waitstatus_to_exitcode(status)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""

_LIFELINE: tuple[int, int] | None = None
_LIFELINE_PID = 0
_LIFELINE_LOCK = threading.Lock()


def _lifeline_fd() -> int:
    """The read end of this process's lifeline pipe.  Both ends are close-on-exec, so
    only the guards (through ``pass_fds``) hold the read end, and only this process
    the write end: its death is the guards' EOF.  A forked child makes its own pipe,
    or its parent's death would be its guards' EOF."""
    global _LIFELINE, _LIFELINE_PID
    with _LIFELINE_LOCK:
        if _LIFELINE is None or _LIFELINE_PID != os.getpid():
            _LIFELINE = os.pipe()
            _LIFELINE_PID = os.getpid()
        return _LIFELINE[0]


def guarded_argv(argv: Sequence[str], *, grace_s: float) -> tuple[list[str], int]:
    """``argv`` wrapped in the guard, and the fd the guard must inherit."""
    fd = _lifeline_fd()
    return [sys.executable, "-c", GUARD_CODE, str(fd), f"{grace_s:g}", *argv], fd


def spawn(
    argv: Sequence[str],
    *,
    stdout: IO[bytes] | int | None = None,
    stderr: IO[bytes] | int | None = None,
    env: Mapping[str, str] | None = None,
    grace_s: float = 10.0,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new process group under the guard.

    The returned process is the guard: its pid is the group id, and it exits with the
    server's status.  ``grace_s`` is how long the guard lets the server shut down
    after SIGTERM when autotune itself is gone.
    """
    full, fd = guarded_argv(argv, grace_s=grace_s)
    return subprocess.Popen(
        full,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=dict(env) if env is not None else None,
        start_new_session=True,
        close_fds=True,
        pass_fds=(fd,),
    )


# ----------------------------------------------------------------------------- stop


@dataclass
class GroupStop:
    """What stopping one group took and found."""

    how: str  # "exited" (already gone), "SIGTERM", "SIGKILL"
    duration_s: float
    pids: list[int]
    left: list[int] = field(default_factory=list)  # processes that survived SIGKILL
    port_busy: bool = False  # the port still accepted connections afterwards

    @property
    def clean(self) -> bool:
        return not self.left and not self.port_busy

    def problems(self, port: int | None = None) -> list[str]:
        out = []
        if self.left:
            out.append(f"processes {sorted(set(self.left))} survived SIGKILL")
        if self.port_busy:
            out.append(f"port {port} still accepts connections")
        return out


def group_pids(proc: subprocess.Popen[Any]) -> list[int]:
    """The live processes of ``proc``'s group and its descendants."""
    return sorted(set(group_members(proc.pid)) | set(descendants(proc.pid)))


def stop_group(proc: subprocess.Popen[Any], *, grace_s: float, host: str = "127.0.0.1",
               port: int | None = None, kill_wait_s: float = 10.0,
               port_wait_s: float = 5.0) -> GroupStop:
    """SIGTERM ``proc``'s group, wait ``grace_s``, SIGKILL what is left; then check
    that nothing of it remains and that ``port`` (if given) is free."""
    t0 = time.monotonic()
    pgid = proc.pid
    seen = set(group_pids(proc)) | {proc.pid}
    how = "exited" if proc.poll() is not None else "SIGTERM"
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    signal_pids(seen - set(group_members(pgid)), signal.SIGTERM)
    if not _wait_gone(proc, pgid, seen, grace_s):
        how = "SIGKILL"
        seen |= set(group_members(pgid)) | set(descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        signal_pids(seen, signal.SIGKILL)
        _wait_gone(proc, pgid, seen, kill_wait_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)
    left = sorted({p for p in seen if pid_alive(p)} | set(group_members(pgid)))
    busy = port is not None and not wait_port_free(host, port, port_wait_s)
    return GroupStop(how, time.monotonic() - t0, sorted(seen), left, busy)


def _wait_gone(proc: subprocess.Popen[Any], pgid: int, pids: set[int], timeout_s: float
               ) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()  # reap the leader so it does not linger as a zombie
        if not group_members(pgid) and not any(pid_alive(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def wait_port_free(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while port_listening(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


# ----------------------------------------------------------------------------- registry


class Owned(Protocol):
    """Something holding live processes that :func:`stop_all` must stop."""

    def stop_now(self, *, fast: bool) -> None: ...


_LIVE: list[Owned] = []
_LIVE_LOCK = threading.Lock()


def track(owned: Owned) -> None:
    with _LIVE_LOCK:
        if owned not in _LIVE:
            _LIVE.append(owned)


def untrack(owned: Owned) -> None:
    with _LIVE_LOCK, contextlib.suppress(ValueError):
        _LIVE.remove(owned)


def live() -> list[Owned]:
    with _LIVE_LOCK:
        return list(_LIVE)


def stop_all(*, fast: bool = False) -> None:
    """Stop everything live.  ``fast`` SIGKILLs without a grace period."""
    for owned in live():
        try:
            owned.stop_now(fast=fast)
        except Exception as e:  # noqa: BLE001 - the others must stop too; it is logged
            log.warning("could not stop %r: %s", owned, e)
        untrack(owned)


# Normal ends, exceptions and Ctrl-C (KeyboardInterrupt unwinds to the interpreter's
# exit) all run atexit.  Registered on import, not on the first start: a start that is
# interrupted half-way must already be covered.
atexit.register(stop_all)


# ----------------------------------------------------------------------------- signals

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_EXITING = False
_INSTALLED: dict[int, Any] = {}


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """First signal: unwind as an exit (``with`` blocks and atexit stop the servers
    after the load generator has closed its streams).  A second one while exiting:
    SIGKILL every group and leave at once."""
    global _EXITING
    if _EXITING:
        stop_all(fast=True)
        os._exit(128 + signum)
    _EXITING = True
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends, then handle them.

    Starting a server and recording it for :func:`stop_all` must not be split by a
    handler that unwinds: one that raised inside ``Popen`` (the child already forked)
    left a guard and its server that no one stopped before exit, only the lifeline did,
    after it (CI of 2026-12-05, a worker's SIGTERM during a start).  Python runs
    handlers in the main thread only, so a block elsewhere cannot be split and needs no
    deferral.  A signal at its default or ignored is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous: dict[signal.Signals, Any] = {}
    for sig in HANDLED:
        handler = signal.getsignal(sig)
        if callable(handler):
            previous[sig] = handler
            signal.signal(sig, lambda signum, _frame: pending.append(signum))
    try:
        yield
    finally:
        for held, restored in previous.items():
            signal.signal(held, restored)
        for signum in pending:
            signal.raise_signal(signum)


def exiting() -> bool:
    """A stop signal has arrived and the process is unwinding."""
    return _EXITING


def interrupted_code(exc: BaseException) -> int | None:
    """The exit status of a command that ``exc`` interrupts: 130 for Ctrl-C, 128 +
    the signal for SIGTERM and SIGHUP (what :func:`install_signal_handlers` raises);
    None for any other exit, which is not an interruption to report."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, SystemExit) and _EXITING and isinstance(exc.code, int):
        return exc.code
    return None


def install_signal_handlers() -> bool:
    """Make SIGINT, SIGTERM and SIGHUP end this process through its ``finally``
    blocks and atexit, so that every server it started is stopped.  Without this,
    SIGTERM and SIGHUP would end the process without running either (the guards
    would still take the servers down, but without the grace of an orderly stop).

    Commands that start servers call it first thing.  A signal that is ignored (as
    under ``nohup``) stays ignored.  Returns False off the main thread, where Python
    cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in HANDLED:
        prev = signal.getsignal(sig)
        if prev is signal.SIG_IGN or prev is _on_signal:
            continue
        _INSTALLED[sig] = prev
        signal.signal(sig, _on_signal)
    return True


def restore_signal_handlers() -> None:
    """Put back what :func:`install_signal_handlers` replaced (tests, embedding)."""
    global _EXITING
    for sig, prev in list(_INSTALLED.items()):
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(sig, prev)
        del _INSTALLED[sig]
    _EXITING = False
