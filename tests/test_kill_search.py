"""`kill -9` of a running `autotune search` with a real-server backend leaves no server
process behind and its port free (issue 16: before the process owner, the simulator's
server was still up on its port 5 s after the kill)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from autotune.servers.process import descendants, pid_alive, port_bindable, port_listening
from autotune.servers.vllm import free_port

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


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_search_prints_one_line_and_exits_128_plus_it(
        tmp_path: Path, sig: signal.Signals, code: int) -> None:
    """Ctrl-C or SIGTERM in the middle of a load test: the server is stopped, nothing is
    left, and the output after the signal is one line that says what was kept and how to
    resume (no traceback from asyncio or Optuna), with exit code 128 + the signal."""
    search, log = _start_search(tmp_path)
    left: list[int] = []
    try:
        _, port = _wait("server listening", lambda: _server(search.pid), 120,
                        search, log)  # type: ignore[misc]
        left = descendants(search.pid)
        before = len(log.read_bytes())
        search.send_signal(sig)
        assert search.wait(60) == code, log.read_text()[-3000:]
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


def test_sigterm_in_a_ceiling_probe_keeps_every_ended_probe(tmp_path: Path) -> None:
    """SIGTERM while `ceiling --backend attach` runs its second probe: it ended the
    command without a word before (the signal's exception was raised inside the event
    loop's transport callback, which logged it and went on).  Now one line says what was
    kept, the --output JSON holds the first probe's evidence, and the exit is 143."""
    out = tmp_path / "c.json"
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "autotune.sim.serve", "--model", "tiny", "--profile",
         "cpu-tiny", "--port", str(port), "--startup-delay-s", "0"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "ceiling.log"
    ceiling = None
    try:
        deadline = time.monotonic() + 60
        while not port_listening("127.0.0.1", port):
            assert server.poll() is None and time.monotonic() < deadline, "no sim server"
            time.sleep(0.05)
        with log.open("wb") as sink:
            ceiling = subprocess.Popen(
                [sys.executable, "-m", "autotune", "ceiling", "--backend", "attach", "--url",
                 f"http://127.0.0.1:{port}", "--slo", "p90:e2e<=1s", "--dataset", "synthetic",
                 "--input-len", "16", "--output-len", "12", "--num-prompts", "100",
                 "--max-num-prompts", "300", "--warmup", "10",
                 "--start-rate", "40", "--max-probes", "3", "--min-duration", "8s",
                 "--max-duration", "20s", "--validate", "off", "--output", str(out)],
                cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=sink,
                stderr=subprocess.STDOUT)
        # The first probe's line: the second probe is running (8 s at least) now.
        _wait("the first probe", lambda: "  1 bracket" in log.read_text(), 120, ceiling, log)
        ceiling.send_signal(signal.SIGTERM)
        assert ceiling.wait(60) == 143, log.read_text()[-3000:]
        text = log.read_text()
        assert "Traceback" not in text and "Fatal error" not in text, text[-3000:]
        last = [line for line in text.splitlines() if line.strip()][-1]
        assert last == f"interrupted after 1 probes: each one's evidence is kept in {out}"
        data = json.loads(out.read_text())
        assert data["interrupted"] is True and data["backend"]["kind"] == "attach"
        (probe,) = data["probes"]
        # Its evidence is kept whatever it decided: on a busy host the real-time server
        # runs slower and the first probe may end inconclusive instead of passing.
        ev = probe["evidence"]
        assert probe["rate"] == 40 and ev["verdict"] in ("pass", "fail", "inconclusive")
        assert ev["cohort"] > 0 and ev["reasons"]
    finally:
        for proc in (ceiling, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
