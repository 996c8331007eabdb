"""`kill -9` of a running `autotune search` with a real-server backend leaves no server
process behind and its port free (issue 16: before the process owner, the simulator's
server was still up on its port 5 s after the kill)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from autotune.servers.process import descendants, pid_alive, port_bindable, port_listening

ROOT = Path(__file__).resolve().parent.parent


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _wait(what: str, check: Callable[[], object], timeout_s: float, proc: subprocess.Popen[bytes],
          log: Path) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"search exited {proc.returncode} before {what}:\n"
                                 f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _server(search_pid: int) -> tuple[int, int] | None:
    """(pid, port) of the simulator's server under the search, once it listens."""
    for pid in descendants(search_pid):
        argv = _cmdline(pid)
        if "autotune.sim.serve" in argv and "--port" in argv:
            port = int(argv[argv.index("--port") + 1])
            if port_listening("127.0.0.1", port):
                return pid, port
    return None


def _start_search(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """`autotune search` with the simulator's server launched as vLLM, in a session of
    its own, its output in ``search.log``."""
    server_cmd = (f"{shlex.quote(sys.executable)} -m autotune.sim.serve "
                  "--profile 1xa100-80gb --startup-delay-s 0.2")
    log = tmp_path / "search.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        search = subprocess.Popen(
            [sys.executable, "-m", "autotune", "search", "--backend", "vllm",
             "--vllm-cmd", server_cmd, "--model", "llama-3-8b", "--slo-p99", "10s",
             "--n-trials", "1", "--studies-dir", str(tmp_path / "studies")],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    return search, log


def test_kill_9_of_search_leaves_no_server_and_frees_the_port(tmp_path: Path) -> None:
    search, log = _start_search(tmp_path)
    left: list[int] = []
    try:
        server_pid, port = _wait("server listening", lambda: _server(search.pid), 120,
                                 search, log)  # type: ignore[misc]
        left = descendants(search.pid)  # the guard and the server, before the kill
        assert server_pid in left
        search.send_signal(signal.SIGKILL)
        search.wait(10)
        deadline = time.monotonic() + 15
        while any(pid_alive(p) for p in left) or not port_bindable("127.0.0.1", port):
            assert time.monotonic() < deadline, (
                f"left behind after kill -9: {[p for p in left if pid_alive(p)]}, "
                f"port {port} bindable: {port_bindable('127.0.0.1', port)}")
            time.sleep(0.05)
    finally:
        if search.poll() is None:
            search.kill()
            search.wait(10)
        for pid in left:  # only if the test failed: never leave them to the next test
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_of_search_prints_one_line_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C in the middle of a load test: the server is stopped, nothing is left, and
    the output after the signal is one line that says how to resume (no traceback from
    asyncio or Optuna), with exit code 130 (128 + SIGINT)."""
    search, log = _start_search(tmp_path)
    left: list[int] = []
    try:
        _, port = _wait("server listening", lambda: _server(search.pid), 120,
                        search, log)  # type: ignore[misc]
        left = descendants(search.pid)
        before = len(log.read_bytes())
        search.send_signal(signal.SIGINT)
        assert search.wait(60) == 130, log.read_text()[-3000:]
        after = log.read_bytes()[before:].decode(errors="replace")
        lines = [line for line in after.splitlines() if line.strip()]
        assert "Traceback" not in after and "failed because of" not in after, after
        assert lines[-1].startswith("interrupted:") and "resume" in lines[-1], after
        assert not [p for p in left if pid_alive(p)]
        assert port_bindable("127.0.0.1", port)
    finally:
        if search.poll() is None:
            search.kill()
            search.wait(10)
        for pid in left:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
