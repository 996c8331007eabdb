"""The load generator against the fake server, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

import numpy as np
import pytest
from scipy import stats

from autotune.client.loadgen import (
    LoadGenError,
    LoadTestConfig,
    check_server,
    fetch_model,
    run_load_test,
    run_load_test_sync,
)
from autotune.core.metrics import summarize
from autotune.core.records import RequestRecord
from autotune.workload.arrivals import arrival_offsets
from autotune.workload.sources import Request


def _requests(n: int, out: int = 8, prompt: str = "one two three") -> list[Request]:
    return [Request(prompt=prompt, prompt_tokens=len(prompt.split()), output_tokens=out)
            for _ in range(n)]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _p50(values: Sequence[float]) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), 50))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- what the client measured is what the server did ---------------------------------


def _healthy_within(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                return response.status == 200
        except urllib.error.HTTPError as exc:
            assert exc.code == 503, exc
        time.sleep(0.02)
    return False


def _settled_stats(server, completed: int, timeout_s: float = 2.0) -> dict:
    """The in-process server's counters once its thread has booked the last response:
    the client can read the final byte before that thread runs again."""
    deadline = time.monotonic() + timeout_s
    stats = server.stats()
    while stats["requests_completed"] < completed and time.monotonic() < deadline:
        time.sleep(0.01)
        stats = server.stats()
    return stats


def test_rates_and_tokens_match_server_counts(fake_server) -> None:
    server = fake_server(token_delay_s=0.001, first_token_delay_s=0.002)
    config = LoadTestConfig(url=server.url, rate=120.0, warmup=0, seed=3)
    result = run_load_test_sync(config, _requests(180, out=8))
    truth = _settled_stats(server, 180)
    summary = summarize(result.records, offered_rate=config.rate)

    assert summary.num_completed == 180 == truth["requests_completed"]
    assert summary.total_output_tokens == truth["tokens_sent"] == 180 * 8
    assert sum(len(r.chunk_times_s) for r in result.records) == truth["tokens_sent"]
    assert summary.total_input_tokens == truth["prompt_tokens"]
    server_window = truth["last_end_s"] - truth["first_start_s"]
    assert summary.request_throughput == pytest.approx(
        truth["requests_completed"] / server_window, rel=0.02)
    assert summary.output_throughput == pytest.approx(
        truth["tokens_sent"] / server_window, rel=0.02)


def test_latencies_match_injected_delays(fake_server_process) -> None:
    # A separate process, so the server does not share the client's GIL.  On a shared
    # machine noise only ever adds latency: so each request's TTFT and E2E are checked
    # against the injected delays as hard lower bounds, and the medians against a
    # ceiling that a systematic error (a wrong start time, a unit slip) would break.
    server = fake_server_process("--first-token-delay-ms", "20", "--token-delay-ms", "4")
    out = 8
    result = run_load_test_sync(LoadTestConfig(url=server.url, rate=40.0, warmup=5, seed=1),
                                _requests(40, out=out))
    ok = [r for r in result.records if r.ok and not r.warmup]
    assert len(ok) == 40
    summary = summarize(result.records)
    assert summary.ttft.p50 == pytest.approx(_p50([r.ttft_s for r in ok]))
    ttft, e2e = 0.020, 0.020 + (out - 1) * 0.004
    # 1 ms slack: the client stamps the send once its write returns, and the server may
    # have begun counting the delay by then.
    for r in ok:
        assert r.ttft_s >= ttft - 0.001 and r.e2e_s >= e2e - 0.001, (r.ttft_s, r.e2e_s)
        assert len(r.itls_s) == out - 1
        assert sum(r.itls_s) <= r.e2e_s - r.ttft_s + 1e-9  # the stream ends after them
    assert _p50([r.ttft_s for r in ok]) < ttft + 0.030
    assert _p50([r.e2e_s for r in ok]) < e2e + 0.030
    assert 0.002 < _p50([r.tpot_s for r in ok]) < 0.004 + 0.010


def test_chat_endpoint_counts_content_chunks_only(fake_server) -> None:
    server = fake_server(model="chat-model")
    config = LoadTestConfig(url=server.url + "/v1/", endpoint="chat", rate=math.inf, warmup=0)
    result = run_load_test_sync(config, _requests(5, out=6))
    assert result.model == "chat-model"  # asked of /v1/models
    assert all(r.ok for r in result.records)
    # The role-only first chunk carries no content: not a token.
    assert [len(r.chunk_times_s) for r in result.records] == [6] * 5
    assert [r.output_tokens for r in result.records] == [6] * 5


# -- arrivals -----------------------------------------------------------------------


def test_schedule_gaps_follow_the_chosen_process() -> None:
    rate = 50.0
    gaps = np.diff(arrival_offsets(2000, rate, process="poisson", seed=7))
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    # The test has power: the same gaps are not exponential at twice the rate.
    assert stats.kstest(gaps, "expon", args=(0, 0.5 / rate)).pvalue < 1e-6
    bursty = np.diff(arrival_offsets(2000, rate, process="gamma", burstiness=0.5, seed=7))
    assert stats.kstest(bursty, "gamma", args=(0.5, 0, 1 / (rate * 0.5))).pvalue > 0.01
    assert stats.kstest(bursty, "expon", args=(0, 1 / rate)).pvalue < 1e-6
    assert np.allclose(np.diff(arrival_offsets(50, rate, process="constant")), 1 / rate)


def test_dispatched_gaps_are_exponential(fake_server_process) -> None:
    # The server in its own process: an in-process one would hold the GIL at times.
    # Gaps of 50 ms on average: a few ms of scheduling noise on a shared machine cannot
    # change their distribution, so one run decides.
    server = fake_server_process()
    rate = 20.0
    config = LoadTestConfig(url=server.url, rate=rate, warmup=0, seed=11)
    result = run_load_test_sync(config, _requests(150, out=2))
    records = sorted(result.records, key=lambda r: r.scheduled_s)
    dispatched = [r.dispatched_s for r in records]
    assert dispatched == sorted(dispatched)  # sent in the order of the schedule
    lags = [r.send_lag_s for r in records]
    assert min(lags) >= 0.0  # never early
    pvalue = stats.kstest(np.diff(dispatched), "expon", args=(0, 1 / rate)).pvalue
    assert pvalue > 0.001, pvalue
    assert _p50(lags) < 0.005  # the dispatcher keeps up (generous: shared CPU)


# -- warm-up --------------------------------------------------------------------------


def test_warmup_is_sent_first_and_appears_in_no_figure(fake_server) -> None:
    server = fake_server(token_delay_s=0.001)
    warm_pool = _requests(3, out=4, prompt="warm")
    config = LoadTestConfig(url=server.url, rate=200.0, warmup=20, seed=2)
    result = run_load_test_sync(config, _requests(30, out=8), warmup_requests=warm_pool)

    assert server.stats()["requests_started"] == 50  # the server saw the warm-up
    warm = [r for r in result.records if r.warmup]
    measured = result.measured
    assert len(warm) == 20 and len(measured) == 30
    assert sorted(r.index for r in measured) == list(range(30))
    assert all(r.expected_output_tokens == 4 for r in warm)
    assert max(r.scheduled_s for r in warm) <= min(r.scheduled_s for r in measured)

    summary = summarize(result.records)
    assert summary.num_measured == 30 and summary.num_warmup_excluded == 20
    assert summary.total_output_tokens == 30 * 8  # no warm-up token counted
    assert summary.window_start_s == min(r.sent_s for r in measured)


# -- failures -------------------------------------------------------------------------

FAULT_CASES = [
    ("500", "http 500"),
    ("drop", "connection"),
    ("cut", "incomplete"),
    ("reset", "connection"),
    ("slow", "timeout"),
    ("short", "truncated"),
]


@pytest.mark.parametrize("transport", ["native", "aiohttp"])
@pytest.mark.parametrize(("fault", "kind"), FAULT_CASES)
def test_each_fault_is_a_failure_and_never_goodput(fake_server, fault: str, kind: str,
                                                   transport: str) -> None:
    # A healthy request must finish within the timeout on a machine the other test
    # workers keep busy (at 0.4 s, a full run timed one out), and a slow one must not.
    server = fake_server(fault=fault, fail_every=3, slow_first_token_s=6.0)
    config = LoadTestConfig(url=server.url, rate=300.0, warmup=0, request_timeout_s=2.0,
                            process="constant", seed=4, transport=transport)
    result = run_load_test_sync(config, _requests(9, out=6))
    failed = [r for r in result.records if not r.ok]
    assert len(failed) == 3, [r.error for r in result.records]
    assert all(r.error is not None and r.error.startswith(kind) for r in failed), [
        r.error for r in failed]
    summary = summarize(result.records)
    assert summary.num_failed == 3 and summary.num_good == 6
    assert summary.failure_reasons == {kind: 3}
    assert summary.attainment == pytest.approx(6 / 9)


def test_no_server_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(LoadGenError, match=r"no server at .*connection refused; is it running\?"):
        check_server(url)
    with pytest.raises(LoadGenError, match="no server at"):
        run_load_test_sync(LoadTestConfig(url=url, warmup=0), _requests(1))


def test_connection_refused_during_a_run_is_recorded(fake_server) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    result = run_load_test_sync(LoadTestConfig(url=url, model="m", warmup=0), _requests(2))
    assert [r.error.split(":")[0] for r in result.records] == ["connection", "connection"]


def test_check_server_and_api_key(fake_server) -> None:
    server = fake_server(model="m1", api_key="s3cret")
    served = check_server(server.url, api_key="s3cret")
    assert served.models == ["m1"] and not served.simulated
    assert fetch_model(server.url, api_key="s3cret") == "m1"
    with pytest.raises(LoadGenError, match="refused the API key"):
        check_server(server.url, api_key="wrong")
    config = LoadTestConfig(url=server.url, api_key="s3cret", warmup=0)
    assert "s3cret" not in repr(config) and "api_key='***'" in repr(config)
    assert "s3cret" not in json.dumps(config.to_dict())
    result = run_load_test_sync(config, _requests(2))
    assert all(r.ok for r in result.records)
    assert "s3cret" not in json.dumps(result.config)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate": 0.0}, "rate must be > 0"),
        ({"rate": -1.0}, "rate must be > 0"),
        ({"rate": math.nan}, "rate must be > 0"),
        ({"url": "localhost:8000"}, "must start with http"),
        ({"endpoint": "embeddings"}, "unknown endpoint"),
        ({"process": "weibull"}, "unknown arrival process"),
        ({"max_concurrency": 0}, "max concurrency"),
        ({"request_timeout_s": 0.0}, "timeout"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict, match: str) -> None:
    args = {"url": "http://127.0.0.1:1", **kwargs}
    with pytest.raises(LoadGenError, match=match):
        LoadTestConfig(**args)


def test_empty_workload_is_rejected() -> None:
    with pytest.raises(LoadGenError, match="no requests"):
        run_load_test_sync(LoadTestConfig(url="http://127.0.0.1:1", model="m"), [])


# -- overload and concurrency ------------------------------------------------------------


def test_server_concurrency_limit_makes_latency_grow(fake_server) -> None:
    # 1 slot x ~25 ms per request: ~40 req/s of service against 100 req/s offered (a
    # rate this client sustains even on a busy machine).
    server = fake_server(token_delay_s=0.005, max_concurrency=1)
    config = LoadTestConfig(url=server.url, rate=100.0, process="constant", warmup=0)
    result = run_load_test_sync(config, _requests(50, out=6))
    assert all(r.ok for r in result.records)
    e2e = [r.e2e_s for r in sorted(result.records, key=lambda r: r.index)]
    assert _p50(e2e[-10:]) > 2 * _p50(e2e[:10])  # ~1 without overload
    assert server.stats()["max_running"] == 1 and server.stats()["max_waiting"] > 10


def test_client_max_concurrency_caps_in_flight(fake_server) -> None:
    server = fake_server(token_delay_s=0.004)  # ~20 ms a request: 2 slots ~100 req/s
    config = LoadTestConfig(url=server.url, rate=250.0, process="constant", warmup=0,
                            max_concurrency=2)
    result = run_load_test_sync(config, _requests(50, out=6))
    assert all(r.ok for r in result.records)
    assert server.stats()["max_running"] <= 2
    ordered = sorted(result.records, key=lambda r: r.index)
    gate_wait = [r.sent_s - r.dispatched_s for r in ordered]
    assert _p50(gate_wait[-15:]) > _p50(gate_wait[:15]) + 0.02  # the queue is the client's
    e2e = [r.e2e_s for r in ordered]
    assert _p50(e2e[-15:]) < 2 * _p50(e2e[:15]) + 0.005  # the server is not overloaded


# -- windows, abort, progress --------------------------------------------------------------


def test_on_window_abort_cancels_in_flight(fake_server) -> None:
    server = fake_server(token_delay_s=0.5)  # each request ~10 s: none can end on its own
    seen: list[tuple[float, int, bool]] = []

    def on_window(now: float, records: Sequence[RequestRecord]) -> bool:
        seen.append((now, len(records), any(r.warmup for r in records)))
        return len(seen) >= 2

    config = LoadTestConfig(url=server.url, rate=50.0, warmup=5, window_s=0.1, seed=5)
    result = run_load_test_sync(config, _requests(200, out=20), on_window=on_window)
    assert result.aborted and result.abort_reason == "pruned"
    assert len(seen) == 2 and not any(warm for _, _, warm in seen)
    assert seen[1][1] >= seen[0][1] > 0
    # In flight means cancelled, not waited for: every request ends aborted, with its end.
    assert result.records and all(r.error == "aborted: pruned" and r.end_s is not None
                                  for r in result.records)
    stopped_at = seen[-1][0]
    assert all(r.dispatched_s <= stopped_at for r in result.records)  # none after the stop
    assert len(result.measured) < 200
    # The server sees at most the requests whose bytes went out; one already on the wire
    # may still reach it after the stop, so its count is read once it has stopped.
    server.stop()
    sent = sum(r.sent_s is not None for r in result.records)
    assert 0 < server.stats()["requests_started"] <= sent


def test_on_window_exception_propagates(fake_server) -> None:
    server = fake_server(token_delay_s=0.02)

    def broken(now: float, records: Sequence[RequestRecord]) -> bool:
        raise KeyError("boom")

    config = LoadTestConfig(url=server.url, rate=100.0, warmup=0, window_s=0.05)
    with pytest.raises(KeyError):
        run_load_test_sync(config, _requests(100, out=10), on_window=broken)


def test_progress_and_async_entry_point(fake_server) -> None:
    server = fake_server()
    calls: list[tuple[int, int]] = []
    config = LoadTestConfig(url=server.url, rate=math.inf, warmup=3)
    result = asyncio.run(run_load_test(config, _requests(7), on_progress=lambda d, t:
                                       calls.append((d, t))))
    assert calls == [(i, 7) for i in range(1, 8)]  # measured requests only
    assert len(result.records) == 10 and result.num_warmup == 3 and not result.aborted


# -- the fake server itself ----------------------------------------------------------------


def test_fake_server_endpoints(fake_server) -> None:
    server = fake_server(model="m", startup_delay_s=0.3, max_concurrency=3)
    with pytest.raises(urllib.error.HTTPError) as excinfo:
        urllib.request.urlopen(server.url + "/health", timeout=5)
    assert excinfo.value.code == 503
    assert _healthy_within(server.url, 10.0)  # 503 until the start-up delay has passed
    body = json.dumps({"prompt": "a b c d"}).encode()
    req = urllib.request.Request(server.url + "/tokenize", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as response:
        assert json.loads(response.read())["count"] == 4
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 5, "ignore_eos": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as response:
        reply = json.loads(response.read())
    assert reply["usage"]["completion_tokens"] == 5
    assert reply["choices"][0]["text"].split() == ["tok"] * 5
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'vllm:num_requests_running{model_name="m"} 0.0' in text
    assert "vllm:num_requests_waiting" in text
    assert _get_json(server.url + "/stats")["requests_completed"] == 1


def test_fake_server_cli_ignores_vllm_flags_and_exits_on_sigterm() -> None:
    argv = [sys.executable, "-m", "autotune.testing.fake_server", "--port", "0",
            "--model", "tiny", "--max-num-seqs", "8", "--enforce-eager", "--token-delay-ms",
            "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.split("listening on ", 1)[1].split()[0]
        assert [m["id"] for m in _get_json(url + "/v1/models")["data"]] == ["tiny"]
        proc.terminate()
        assert proc.wait(5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("transport", ["native", "aiohttp", "httpx"])
def test_every_transport_counts_the_same(fake_server, transport: str) -> None:
    server = fake_server(fault="500", fail_every=4)
    result = run_load_test_sync(
        LoadTestConfig(url=server.url, model="m", rate=200.0, warmup=0, transport=transport),
        _requests(12))
    errors = [r.error for r in result.records]
    assert sum(e is None for e in errors) == 9
    assert all(e.startswith("http 500") for e in errors if e is not None)
    sent = server.stats()["tokens_sent"]
    assert sum(r.output_tokens for r in result.records if r.ok) == sent == 9 * 8


def test_unknown_transport_is_refused() -> None:
    with pytest.raises(LoadGenError, match="transport"):
        LoadTestConfig(url="http://127.0.0.1:1", transport="curl")


def test_a_stop_signal_ends_a_running_load_test(fake_server_process) -> None:
    """SIGTERM while replies stream: the process's handler raises (as autotune's own
    does) and the load test ends there with that exception.  Raised inside uvloop's
    transport callback, it was logged ("Fatal error on transport") and lost, and the
    command ran to its end (a real `ceiling --backend attach` here); where the handler
    happens to run is up to the interpreter, so this test checks the outcome, the loop
    taking the signal, whichever callback is running."""
    import os
    import signal
    import threading

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)  # the main thread: pytest's own
    streaming = threading.Event()
    threading.Thread(target=lambda: streaming.wait(30) and os.kill(os.getpid(),
                                                                    signal.SIGTERM),
                     daemon=True).start()
    server = fake_server_process("--token-delay-ms", "1")
    windows = []

    def on_window(now: float, records: Sequence[RequestRecord]) -> bool:
        windows.append(now)
        streaming.set()
        return False

    try:
        with pytest.raises(SystemExit) as stopped:
            run_load_test_sync(LoadTestConfig(url=server.url, rate=300.0, seed=1),
                               _requests(9000, out=64), on_window=on_window)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    # 30 s of arrivals were planned; it stopped within a few windows of the signal.
    assert 1 <= len(windows) < 10
