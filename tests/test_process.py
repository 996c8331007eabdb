"""The process owner (``autotune.servers.process``): every way the process that started
a server can end, and the server's own crash, leave no process and a free port.

The parent is a real Python process that starts the simulator's HTTP server through
``SimServer`` (as ``search --vllm-cmd`` would), prints the group it owns once the server
is healthy, and then ends the way the case says.  The test reads that line (no fixed
sleeps) and, after the parent is gone, checks /proc for every pid of the group and the
port for a listener.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from autotune.servers import process
from autotune.servers.process import (
    descendants,
    group_members,
    install_signal_handlers,
    pid_alive,
    port_bindable,
    port_listening,
    restore_signal_handlers,
)

REPO = Path(__file__).resolve().parents[1]

PARENT = textwrap.dedent("""
    import json, signal, sys, time
    # A user's process at a terminal: a test run started in the background (`cmd &`,
    # nohup) would otherwise hand down SIGINT/SIGHUP ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    sys.path.insert(0, {repo!r})
    from autotune.servers.process import install_signal_handlers
    from autotune.servers.vllm import SimServer
    mode = sys.argv[1]
    install_signal_handlers()  # what every CLI command does first
    extra = ["--crash-after", "1"] if mode == "server-crash" else []
    server = SimServer("tiny", profile="cpu-tiny", startup_delay_s=0, log_dir={logs!r},
                       grace_s=5.0, startup_timeout_s=60.0, extra_args=extra)
    server.start({{}})
    print(json.dumps({{"pgid": server.pid, "pids": server.group_pids(),
                      "port": server.port}}), flush=True)
    if mode == "normal":
        sys.exit(0)
    if mode == "exception":
        raise RuntimeError("boom")
    if mode == "server-crash":
        import contextlib, httpx
        with contextlib.suppress(httpx.HTTPError):  # it may die before it answers
            httpx.post(server.endpoint + "/v1/completions", timeout=30,
                       json={{"model": "tiny", "prompt": "hi", "max_tokens": 2}})
        deadline = time.monotonic() + 30
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        status = server._proc.poll()
        stop = server.stop()
        print(json.dumps({{"status": status, "how": stop.how}}), flush=True)
        sys.exit(0)
    print("ready", flush=True)
    time.sleep(120)
    sys.exit(5)
""")


def wait_until(pred: Callable[[], bool], timeout_s: float) -> bool:
    """Poll a condition up to a deadline: what is awaited is the event, not a delay."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def left_behind(owned: dict) -> list[int]:
    return sorted(set(group_members(owned["pgid"]))
                  | {p for p in owned["pids"] if pid_alive(p)})


CASES = [
    # mode, signal sent to the parent once the server is up, parent exit statuses
    ("normal", None, {0}),
    ("exception", None, {1}),
    ("wait", signal.SIGINT, {130, -signal.SIGINT}),
    ("wait", signal.SIGTERM, {128 + signal.SIGTERM}),
    ("wait", signal.SIGHUP, {128 + signal.SIGHUP}),
    ("wait", signal.SIGKILL, {-signal.SIGKILL}),
    ("server-crash", None, {0}),
]


@pytest.mark.parametrize("mode,sig,codes", CASES,
                         ids=["normal", "exception", "sigint", "sigterm", "sighup", "sigkill",
                              "server-crash"])
def test_every_exit_path_leaves_no_process_and_a_free_port(
        tmp_path: Path, mode: str, sig: int | None, codes: set[int]) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(repo=str(REPO), logs=str(tmp_path / "logs")))
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert parent.stdout is not None and parent.stderr is not None
    owned: dict = {}
    leftover: list[int] = []
    try:
        line = parent.stdout.readline()
        assert line, f"parent ended before its server was up: {parent.stderr.read()}"
        owned = json.loads(line)
        assert owned["pids"] and all(pid_alive(p) for p in owned["pids"])
        assert port_listening("127.0.0.1", owned["port"])
        if sig is not None:
            assert parent.stdout.readline().strip() == "ready"
            parent.send_signal(sig)
        out = parent.stdout.read()
        rc = parent.wait(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        err = parent.stderr.read()
        parent.stdout.close()
        parent.stderr.close()
        # After SIGKILL the parent ran no code at all: the guard alone stops the server,
        # a moment after the parent's death, so wait for the group to go.
        if owned and not wait_until(lambda: not left_behind(owned), 20.0):
            leftover = left_behind(owned)
            process.signal_pids(leftover, signal.SIGKILL)  # leave nothing, then fail
    assert rc in codes, err
    assert leftover == [], f"{mode}/{sig}: processes left behind"
    assert wait_until(lambda: not port_listening("127.0.0.1", owned["port"]), 5.0)
    assert port_bindable("127.0.0.1", owned["port"])
    if mode == "server-crash":
        # The guard exits with the server's own status (``--crash-after`` exits 3).
        assert json.loads(out.splitlines()[-1]) == {"status": 3, "how": "exited"}
        assert "Engine core died" in (tmp_path / "logs" / "trial-0.log").read_text()


HANG = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A grandchild, as vLLM's engine core would be: the group kill must reach it too.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    time.sleep(120)
""")


def test_guard_sigkills_a_server_that_ignores_sigterm_when_the_owner_dies(
        tmp_path: Path) -> None:
    """A parent killed with -9, a server that ignores SIGTERM: after the grace the guard
    SIGKILLs the whole group, grandchildren included."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    runner = textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from autotune.servers.process import spawn
        proc = spawn([sys.executable, {str(script)!r}], stdout=subprocess.PIPE, grace_s=0.5)
        print(proc.pid, proc.stdout.readline().decode().strip(), flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE,
                              text=True)
    assert parent.stdout is not None
    try:
        pgid, grandchild = (int(x) for x in parent.stdout.readline().split())
        members = group_members(pgid)
        assert grandchild in members and len(members) == 3  # guard, server, grandchild
        parent.kill()
        parent.wait(timeout=10)
        assert wait_until(lambda: not group_members(pgid), 20.0), group_members(pgid)
        assert not pid_alive(grandchild)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()


def test_a_guard_whose_owner_is_already_gone_leaves_no_server_running_for_the_grace(
        tmp_path: Path) -> None:
    """The owner dies while its guard is still starting: the lifeline is closed before the
    server is spawned.  The server must not start after the stop went out (it would then
    run, unsignalled, until the grace's SIGKILL); the whole group goes at once."""
    r, w = os.pipe()
    os.close(w)  # the owner's end: gone before the guard ever reads
    started = tmp_path / "started"
    server = [sys.executable, "-c",
              f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(300)"]
    guard = subprocess.Popen([sys.executable, "-c", process.GUARD_CODE, str(r), "120",
                              *server], pass_fds=(r,), start_new_session=True)
    os.close(r)
    try:
        guard.wait(timeout=60)  # half the grace: the group must not wait for it
        assert wait_until(lambda: not group_members(guard.pid), 10.0), \
            group_members(guard.pid)
    finally:
        if guard.poll() is None or group_members(guard.pid):
            os.killpg(guard.pid, signal.SIGKILL)
            guard.wait()


def test_stop_group_reports_sigkill_for_a_server_that_ignores_sigterm(tmp_path: Path
                                                                        ) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    proc = process.spawn([sys.executable, str(script)], stdout=subprocess.PIPE, grace_s=0.3)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    stop = process.stop_group(proc, grace_s=0.3)
    proc.stdout.close()
    assert stop.how == "SIGKILL" and stop.clean and grandchild in stop.pids
    assert not pid_alive(grandchild) and not group_members(proc.pid)
    assert os.getpid() not in descendants(os.getpid())


def test_a_failed_exec_is_exit_127_from_the_guard() -> None:
    proc = process.spawn(["/nonexistent/autotune-no-such-binary"], stderr=subprocess.PIPE)
    assert proc.wait(timeout=30) == 127
    assert proc.stderr is not None and b"cannot run" in proc.stderr.read()
    proc.stderr.close()


def test_signal_handlers_are_explicit_and_respect_ignored_signals() -> None:
    before = {s: signal.getsignal(s) for s in process.HANDLED}
    assert all(h is not process._on_signal for h in before.values())  # not on import
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        assert install_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) is process._on_signal
        assert signal.getsignal(signal.SIGINT) is process._on_signal
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        with pytest.raises(SystemExit) as e:
            process._on_signal(signal.SIGTERM, None)
        assert e.value.code == 128 + signal.SIGTERM
    finally:
        restore_signal_handlers()
        for s, h in before.items():
            signal.signal(s, h)
    off_main: list[bool] = []
    t = threading.Thread(target=lambda: off_main.append(install_signal_handlers()))
    t.start()
    t.join()
    assert off_main == [False]


def test_cpu_seconds_counts_what_a_process_spent_and_skips_one_gone() -> None:
    """The CPU a process group used, as the prefix-caching test compares two servers
    by: it grows by what this process spends, and a pid gone since is no error."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is gone
    before = process.cpu_seconds([os.getpid(), child.pid])
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        sum(range(10_000))
    spent = process.cpu_seconds([os.getpid(), child.pid]) - before
    assert 0.2 < spent < 5.0
