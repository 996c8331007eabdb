"""Fault injection: each way a server can fail a load test leaves its requests counted
as failures by reason in the summary, never as goodput; a server that dies mid-test
makes the trial infeasible ("crashed", with its log tail) and leaves nothing behind.

The per-request faults (500, cut, reset, slow first token) are also covered per
transport in test_loadgen.py; here each issue-16 fault is one short case, timed by the
request timeout rather than by sleeps."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from autotune.backends.base import LoadPlan
from autotune.backends.http import ServerBackend
from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
from autotune.core.metrics import Summary, summarize
from autotune.core.slo import parse_slo
from autotune.servers.process import descendants, group_members, pid_alive, port_bindable
from autotune.servers.vllm import SimServer
from autotune.testing.fake_server import FakeServerProcess
from autotune.tuning.trial import INFEASIBLE, evaluate
from autotune.workload.sources import Request

TIMEOUT_S = 0.5  # every request's limit: a silent server costs this, not minutes


def _requests(n: int, out: int = 6) -> list[Request]:
    return [Request("one two three", 3, out) for _ in range(n)]


def _run(url: str, n: int, *, rate: float = 200.0, timeout_s: float = TIMEOUT_S,
         out: int = 6) -> Summary:
    config = LoadTestConfig(url=url, model="fake-model", rate=rate, warmup=0,
                            request_timeout_s=timeout_s, process="constant", seed=1)
    return summarize(run_load_test_sync(config, _requests(n, out)).records,
                     slo=parse_slo("10s"))


def _no_goodput_from_failures(s: Summary, out: int = 6) -> None:
    # Goodput counts only requests that completed within the SLO: every failure is out.
    assert s.num_good <= s.num_completed
    assert s.num_good + s.num_failed == s.num_measured
    assert s.goodput_tokens * s.duration_s <= s.num_good * out + 1e-6
    assert sum(s.failure_reasons.values()) == s.num_failed


def test_http_500s(fake_server) -> None:
    server = fake_server(fault="500", fail_every=2)
    s = _run(server.url, 8)
    assert s.failure_reasons == {"http 500": 4}
    assert s.num_good == 4
    _no_goodput_from_failures(s)


@pytest.mark.parametrize(("fault", "reason"), [("cut", "incomplete"), ("reset", "connection")])
def test_stream_cut_mid_reply(fake_server, fault: str, reason: str) -> None:
    # cut: the body ends cleanly after half the tokens; reset: the TCP connection drops.
    server = fake_server(fault=fault, fail_every=2, token_delay_s=0.002)
    s = _run(server.url, 8, out=10)
    assert s.failure_reasons == {reason: 4}
    assert server.stats()["tokens_sent"] == 4 * 10 + 4 * 5  # half of each cut reply sent
    _no_goodput_from_failures(s, out=10)


def test_first_token_later_than_the_request_timeout(fake_server) -> None:
    server = fake_server(fault="slow", fail_every=2, slow_first_token_s=5.0)
    t0 = time.monotonic()
    s = _run(server.url, 6)
    assert s.failure_reasons == {"timeout": 3}
    assert s.num_good == 3
    assert time.monotonic() - t0 < 5.0  # the client gave up at its timeout
    _no_goodput_from_failures(s)


def test_hang_in_mid_test(fake_server) -> None:
    # The engine wedges after 4 requests: the streams in flight stop mid-reply and the
    # rest are never answered.  Tokens every 20 ms keep some replies in flight.
    server = fake_server(hang_after=4, token_delay_s=0.02)
    s = _run(server.url, 10, rate=100.0, out=10)
    assert set(s.failure_reasons) == {"timeout"}
    assert s.num_failed >= 6 and s.num_completed <= 4
    assert server.stats()["requests_started"] == 10  # each was read, none answered
    _no_goodput_from_failures(s, out=10)


def test_accepts_connections_but_never_answers(fake_server) -> None:
    server = fake_server(mute=True)
    s = _run(server.url, 4)
    assert s.failure_reasons == {"timeout": 4}
    assert s.num_completed == 0 and s.num_good == 0 and s.goodput_tokens == 0
    assert server.stats()["requests_started"] == 0  # not one byte was read


def test_crash_in_mid_test_is_an_infeasible_trial_with_a_log_tail(tmp_path: Path) -> None:
    # The simulator's server exits (code 3, "Engine core died") after 3 finished
    # requests; 30 at 30 req/s cannot all finish before that.
    server = SimServer("tiny", profile="cpu-tiny", startup_delay_s=0,
                       log_dir=tmp_path / "logs", grace_s=5.0, startup_timeout_s=60.0,
                       extra_args=["--crash-after", "3"])
    backend = ServerBackend(server, nvml=False)
    plan = LoadPlan(slo=parse_slo("10s"), requests=_requests(30), warmup=0,
                    process="constant", request_timeout_s=5.0)
    try:
        result = evaluate(backend, {}, 30.0, plan)
        pid, port = server.pid, server.port
    finally:
        backend.close()
    assert result.status == INFEASIBLE and result.reason == "crashed"
    assert "log tail" in (result.detail or "") and "Engine core died" in (result.detail or "")
    s = result.summary
    assert s is not None and s.num_failed > 0
    assert sum(s.failure_reasons.values()) == s.num_failed
    assert s.num_good <= s.num_completed <= 3
    # Nothing left behind: no process of the server's group, and its port is free.
    assert pid is not None and port is not None
    assert not pid_alive(pid) and not group_members(pid)
    assert port_bindable("127.0.0.1", port)


def test_fake_server_process_runs_under_the_process_owner() -> None:
    # The guard leads a group of its own with the server in it, and stop() leaves
    # neither behind.
    before = set(descendants(os.getpid()))
    with FakeServerProcess(["--token-delay-ms", "1"]) as server:
        port = int(server.url.rsplit(":", 1)[1])
        mine = set(descendants(os.getpid())) - before
        assert len(mine) >= 2, mine  # the guard and the server
        leaders = {p for p in mine if os.getpgid(p) == p}
        assert len(leaders) == 1 and {os.getpgid(p) for p in mine} == leaders  # one group
        assert leaders != {os.getpgid(0)}  # not the test's group
    assert not any(pid_alive(p) for p in mine)
    assert port_bindable("127.0.0.1", port)
