"""Telemetry: Prometheus parsing, the /metrics scraper, wait_idle, and the NVML sampler
(faked only at the pynvml boundary)."""

from __future__ import annotations

import logging
import math
import threading
import time
import types

import pytest

from autotune.servers import telemetry
from autotune.servers.telemetry import (
    MetricsPoint,
    MetricsScraper,
    NvmlSampler,
    TelemetryError,
    engine_figures,
    parse_prometheus,
    parse_prometheus_samples,
    summarize_metrics,
    wait_idle,
)

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/tmp/tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="/tmp/tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="/tmp/tiny"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="/tmp/tiny"} 0.75
vllm:num_preemptions_total{engine="0",model_name="/tmp/tiny"} 4.0
vllm:generation_tokens_total{engine="0",model_name="/tmp/tiny"} 1.5e3
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0
vllm:weird{label="with \\"quote\\" and, comma"} NaN
vllm:cache_config_info{block_size="128",num_gpu_blocks="8192"} 1.0 1700000000000
garbage line without value
"""


def test_parse_prometheus_sums_counts_averages_fractions_skips_buckets():
    p = parse_prometheus(VLLM_TEXT)
    assert p["vllm:num_requests_running"] == 5.0  # two engines summed
    assert p["vllm:kv_cache_usage_perc"] == 0.5  # fractions averaged
    assert p["vllm:generation_tokens_total"] == 1500.0
    assert p["vllm:time_to_first_token_seconds_count"] == 7.0
    assert not any(k.endswith("_bucket") for k in p)
    assert "vllm:weird" not in p  # NaN only
    assert p["vllm:cache_config_info"] == 1.0  # timestamp ignored


def test_parse_prometheus_samples_keeps_labels():
    samples = parse_prometheus_samples(VLLM_TEXT)
    info = next(s for s in samples if s.name == "vllm:cache_config_info")
    assert info.labels == {"block_size": "128", "num_gpu_blocks": "8192"}
    weird = next(s for s in samples if s.name == "vllm:weird")
    assert weird.labels["label"] == 'with \\"quote\\" and, comma' and math.isnan(weird.value)
    inf = [s for s in samples if s.labels.get("le") == "+Inf"]
    assert inf and inf[0].value == 7.0


def test_engine_figures_falls_back_to_old_names():
    old = parse_prometheus("vllm:gpu_cache_usage_perc 0.4\nvllm:num_requests_running 1\n")
    f = engine_figures(old)
    assert f["kv_cache_usage"] == 0.4 and f["running"] == 1.0 and f["waiting"] is None


def test_summarize_metrics_gauges_and_counter_increase():
    pts = [MetricsPoint(0.0, {"running": 2.0, "waiting": 0.0, "kv_cache_usage": 0.1,
                              "preemptions": 1.0, "generation_tokens": 100.0}),
           MetricsPoint(1.0, {"running": 4.0, "waiting": 3.0, "kv_cache_usage": 0.3,
                              "preemptions": 3.0, "generation_tokens": 400.0})]
    s = summarize_metrics(pts, interval_s=1.0)
    assert s.mean["running"] == 3.0 and s.max["waiting"] == 3.0
    assert s.mean["kv_cache_usage"] == pytest.approx(0.2)
    assert s.increase["preemptions"] == 2.0 and s.increase["generation_tokens"] == 300.0
    assert s.increase["prompt_tokens"] is None
    assert "2 scrapes" in s.note


def test_scraper_against_fake_server_sees_running_requests():
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.testing.fake_server import FakeServer, FakeServerConfig
    from autotune.workload.sources import Request

    with FakeServer(FakeServerConfig(token_delay_s=0.01, max_concurrency=2)) as fs:
        with MetricsScraper(fs.url, interval_s=0.05) as sc:
            run_load_test_sync(LoadTestConfig(url=fs.url, warmup=0, rate=math.inf),
                               [Request("a b c", 3, 30)] * 6)
            assert _until(lambda: len(sc.points) >= 5)
        s = sc.summary()
        assert s.scrapes >= 5 and s.failures == 0
        assert s.max["running"] == 2.0  # the fake's limit, seen through /metrics
        assert s.max["waiting"] >= 1.0
        assert s.increase["generation_tokens"] > 0
        rows = sc.timeline()
        assert rows[0].keys() >= {"t_s", "running", "waiting"}
        assert wait_idle(fs.url, timeout_s=5.0) < 5.0


def test_scraper_counts_failures_and_wait_idle_raises(caplog):
    from autotune.servers.vllm import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, "autotune.servers.telemetry"):
        with MetricsScraper(url, interval_s=0.05) as sc:
            deadline = time.monotonic() + 10
            while sc.failures < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
    s = sc.summary()
    assert s.scrapes == 0 and s.failures >= 2 and "failed" in s.note
    assert sum("cannot scrape" in r.message for r in caplog.records) == 1  # said once
    with pytest.raises(TelemetryError):
        wait_idle(url, timeout_s=0.3)


def test_wait_idle_waits_for_the_backlog_to_drain():
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.testing.fake_server import FakeServer, FakeServerConfig
    from autotune.workload.sources import Request

    with FakeServer(FakeServerConfig(token_delay_s=0.01, max_concurrency=1)) as fs:
        cfg = LoadTestConfig(url=fs.url, warmup=0, rate=math.inf, request_timeout_s=30)
        t = threading.Thread(target=run_load_test_sync, args=(cfg, [Request("x", 1, 20)] * 4))
        t.start()
        try:
            assert wait_until_busy(fs.url)
            with pytest.raises(TimeoutError, match="still busy"):
                wait_idle(fs.url, timeout_s=0.1, interval_s=0.02)
            waited = wait_idle(fs.url, timeout_s=10.0, interval_s=0.02)
            assert waited > 0.05
        finally:
            t.join(30)


def wait_until_busy(url: str) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        f = engine_figures(telemetry.scrape(url))
        if (f["running"] or 0) + (f["waiting"] or 0) > 0:
            return True
        time.sleep(0.01)
    return False


def test_a_metrics_endpoint_too_slow_to_answer_by_the_deadline_is_busy_not_gone():
    """A loaded server answers /metrics late: past the deadline that is "still busy"
    (the full suite once failed here, its fake server starved for over 0.5 s), and a
    refused connection is still a TelemetryError."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    release = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            release.wait(5.0)  # answers only once the test has seen the timeout
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")

        def log_message(self, *args: object) -> None:
            return None

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with pytest.raises(TimeoutError, match="did not answer within 0.5s"):
            wait_idle(url, timeout_s=0.1, interval_s=0.02)
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()
    with pytest.raises(TelemetryError, match="cannot scrape"):
        wait_idle(url, timeout_s=0.1, interval_s=0.02)


def test_wait_idle_rejects_endpoint_without_vllm_metrics(monkeypatch):
    monkeypatch.setattr(telemetry, "scrape", lambda url, client=None, timeout_s=5.0: {})
    with pytest.raises(TelemetryError, match="num_requests_running"):
        wait_idle("http://127.0.0.1:1", timeout_s=1.0)


# ----------------------------------------------------------------------------- NVML


class FakeNVMLError(Exception):
    pass


def fake_pynvml(monkeypatch, *, gpus: int = 2, fail_init: bool = False):
    """Replace the functions of the pynvml module (the boundary) with a fake driver."""
    import pynvml

    state = {"t": 0, "inits": 0, "shutdowns": 0}

    def init():
        if fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")
        state["inits"] += 1

    def shutdown():
        state["shutdowns"] += 1

    def util(h):
        state["t"] += 1
        return types.SimpleNamespace(gpu=50 + 10 * h, memory=0)

    fns = {
        "nvmlInit": init,
        "nvmlShutdown": shutdown,
        "nvmlDeviceGetCount": lambda: gpus,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: f"FakeGPU-{h}".encode(),
        "nvmlDeviceGetUtilizationRates": util,
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            used=(h + 1) * 2**30, total=80 * 2**30, free=0),
        "nvmlDeviceGetPowerUsage": lambda h: 100_000 + 50_000 * h,  # mW
        "nvmlDeviceGetComputeRunningProcesses": lambda h: [types.SimpleNamespace(pid=4242)],
        "nvmlDeviceGetGraphicsRunningProcesses": lambda h: [],
    }
    for name, fn in fns.items():
        monkeypatch.setattr(pynvml, name, fn)
    return state


def test_nvml_sampler_per_gpu_and_overall(monkeypatch):
    state = fake_pynvml(monkeypatch, gpus=2)
    with NvmlSampler(interval_s=0.02) as s:
        assert _until(lambda: len(s.samples) >= 6)  # 3 instants of 2 GPUs
    summary = s.summary()
    assert summary.available and len(summary.per_gpu) == 2
    g0, g1 = summary.per_gpu
    assert (g0.name, g1.name) == ("FakeGPU-0", "FakeGPU-1")
    assert g0.util_mean_pct == 50.0 and g1.util_max_pct == 60.0
    assert g1.mem_used_max_bytes == 2 * 2**30 and g0.mem_total_bytes == 80 * 2**30
    assert g0.power_mean_w == 100.0 and g1.power_max_w == 150.0
    assert summary.util_mean_pct == 55.0
    assert summary.power_mean_w == 250.0  # node total per instant
    assert g0.samples >= 3 and g0.samples == g1.samples
    assert state["shutdowns"] >= 1
    assert "2 GPU(s)" in summary.note


def test_nvml_sampler_only_selected_gpus(monkeypatch):
    fake_pynvml(monkeypatch, gpus=4)
    with NvmlSampler(interval_s=0.02, gpus=[2, 9]) as s:
        assert _until(lambda: len(s.samples) >= 1)
    assert [g.gpu for g in s.summary().per_gpu] == [2]
    assert telemetry.gpu_memory_used([1, 3]) == {1: 2 * 2**30, 3: 4 * 2**30}
    assert telemetry.gpu_process_pids() == {4242}


def test_no_nvml_says_so_once_and_returns_empty(monkeypatch, caplog):
    fake_pynvml(monkeypatch, fail_init=True)
    monkeypatch.setattr(telemetry, "_NVML_WARNED", False)
    with caplog.at_level(logging.WARNING, "autotune.servers.telemetry"):
        for _ in range(3):
            with NvmlSampler(interval_s=0.01) as s:
                pass
    summary = s.summary()
    assert not summary.available and summary.per_gpu == []
    assert summary.util_mean_pct is None
    assert summary.note.startswith("no GPU telemetry (NVML not available:")
    assert "Shared Library Not Found" in summary.note
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("no GPU telemetry" in m for m in msgs) == 1
    assert telemetry.gpu_memory_used() is None and telemetry.gpu_process_pids() == set()
    assert list(telemetry.gpu_summary_lines(summary)) == [summary.note]


def test_server_waits_for_gpu_memory_release(monkeypatch):
    """stop() polls NVML until none of its pids holds GPU memory."""
    from autotune.servers.vllm import VllmServer

    calls = {"n": 0}

    def holders(gpus=None):
        calls["n"] += 1
        return {777} if calls["n"] < 3 else set()

    monkeypatch.setattr(telemetry, "gpu_process_pids", holders)
    monkeypatch.setattr(telemetry, "gpu_memory_used", lambda gpus=None: {0: 100})
    srv = VllmServer("m", gpus=[0], gpu_release_timeout_s=5.0)
    srv._gpu_baseline = {0: 100}
    monkeypatch.setattr(time, "sleep", lambda s: None)
    srv._wait_gpu_released({777})
    assert calls["n"] == 3


def _until(pred, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    """Poll ``pred`` up to a deadline: the test waits for the event, not a delay."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
