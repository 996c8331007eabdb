"""The simulator's real-time HTTP server (``python -m autotune.sim.serve``)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from autotune.core.metrics import summarize
from autotune.sim import EngineConfig, simulate
from autotune.sim.serve import parse, prompt_token_count
from autotune.workload.arrivals import arrival_offsets
from autotune.workload.sources import Request

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "autotune.sim.serve", "--model", "tiny", "--profile",
            "cpu-tiny", "--port", str(port), "--startup-delay-s", "0", *extra]


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def server(*extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    proc = subprocess.Popen(argv(port, *extra), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("server did not become healthy")
            time.sleep(0.05)
        yield url, proc
    finally:
        stop(proc)


def sse_events(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def test_prompt_token_count_is_whitespace_words_or_ids() -> None:
    assert prompt_token_count({"prompt": "a b  c\nd"}, chat=False) == 4
    assert prompt_token_count({"prompt": [5, 6, 7]}, chat=False) == 3
    assert prompt_token_count({"messages": [{"role": "user", "content": "x y"},
                                            {"role": "user", "content": "z"}]}, chat=True) == 3


def test_unknown_vllm_flags_are_collected_not_fatal() -> None:
    args, unknown = parse(["--model", "m", "--enforce-eager", "--dtype", "bfloat16",
                           "--no-enable-chunked-prefill", "--max-num-seqs", "8",
                           "--api-server-count", "2"])
    assert unknown == ["--enforce-eager", "--dtype", "bfloat16"]
    assert args.enable_chunked_prefill is False and args.max_num_seqs == 8
    assert args.api_server_count == 2  # modelled: the front end's servers


def test_impossible_config_exits_1_with_vllms_message() -> None:
    proc = subprocess.run(argv(free_port(), "--model", "llama-3-8b", "--profile",
                               "a100-80gb", "--tensor-parallel-size", "3"),
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "must be divisible by tensor parallel size (3)" in proc.stderr
    assert "simulat" in proc.stdout.lower()


def test_endpoints_behave_like_vllm() -> None:
    with server("--enforce-eager", "--max-num-seqs", "8") as (url, proc):
        models = httpx.get(url + "/v1/models").json()["data"]
        assert models[0]["id"] == "tiny" and models[0]["owned_by"] == "autotune-simulator"
        body = {"model": "tiny", "prompt": "one two three", "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert len(texts) == 5 and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 8,
                                       "completion_tokens": 5}
        chat = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
        cev = [json.loads(e) for e in sse_events(chat.text)[:-1]]
        assert cev[0]["choices"][0]["delta"]["role"] == "assistant"
        assert sum(bool(c["choices"] and c["choices"][0]["delta"].get("content"))
                   for c in cev) == 3
        plain = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "a b", "max_tokens": 4}).json()
        assert plain["usage"]["completion_tokens"] == 4
        assert len(plain["choices"][0]["text"].split()) == 4
        too_long = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "w " * 2000, "max_tokens": 100})
        assert too_long.status_code == 400
        assert "maximum context length is 2048" in too_long.json()["message"]
        assert httpx.post(url + "/v1/completions", json={
            "model": "nope", "prompt": "x", "max_tokens": 1}).status_code == 404
        tok = httpx.post(url + "/tokenize", json={"prompt": "a b c"}).json()
        assert tok["count"] == 3 and len(tok["tokens"]) == 3
        metrics = httpx.get(url + "/metrics").text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                     "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            assert f'{name}{{engine="0",model_name="tiny"}}' in metrics
        assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 12.0' in metrics
        assert 'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 7.0' in metrics
        # Three generating requests: one server-side TTFT each, cumulative buckets.
        ttft = [line for line in metrics.splitlines()
                if line.startswith("vllm:time_to_first_token_seconds")]
        assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 3.0' in ttft
        buckets = [float(line.rsplit(" ", 1)[1]) for line in ttft if "_bucket" in line]
        assert buckets == sorted(buckets) and buckets[-1] == 3.0 and buckets[0] < 3.0
        assert float(ttft[-1].rsplit(" ", 1)[1]) > 0  # the sum
    out = proc.stdout.read() if proc.stdout else ""
    assert "GPU KV cache size: " in out and "Maximum concurrency for 2,048 tokens" in out
    assert "ignoring flags the simulator does not model: --enforce-eager" in out
    assert proc.returncode == 0


def _cache_counters(url: str) -> tuple[float, float]:
    from autotune.servers.telemetry import scrape

    m = scrape(url)
    return m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]


@pytest.mark.parametrize("caching", [True, False])
def test_a_resent_prefix_hits_the_prefix_cache_as_in_vllm(caching: bool) -> None:
    """A chat turn resends the first turn's 600 words: with prefix caching (vLLM's
    default) its full 128-token blocks (cpu-tiny's, as vLLM-CPU's) are hits, counted
    in vLLM's /metrics names; without it, none are."""
    history = " ".join(f"w{i}" for i in range(600))
    turns = [history, history + " and then what happened next"]
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    with server(flag) as (url, _):
        for text in turns:  # one after the other: the first is cached when the next comes
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
                "model": "tiny", "messages": [{"role": "user", "content": text}],
                "max_tokens": 2})
            assert r.status_code == 200
        queries, hits = _cache_counters(url)
    if caching:
        assert queries == 600 + 605 and hits == 4 * 128
    else:
        assert hits == 0


def test_sigterm_closes_streams_and_exits_cleanly() -> None:
    with server() as (url, proc):
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "x", "max_tokens": 1500, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # the stream ends instead of hanging
            assert time.monotonic() - t0 < 5
            assert "data: [DONE]" not in rest
        proc.wait(timeout=10)
        assert proc.returncode == 0


def test_crash_after_n_requests() -> None:
    with server("--crash-after", "2") as (url, proc):
        for _ in range(2):
            try:
                httpx.post(url + "/v1/completions", timeout=10,
                           json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            except httpx.HTTPError:
                pass
        proc.wait(timeout=10)
        assert proc.returncode not in (0, None)
        assert "simulated fault" in (proc.stderr.read() if proc.stderr else "")


def test_hang_at_startup_never_listens_but_stops_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(argv(port, "--hang-at-startup"), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        # The server says it hangs only once its SIGTERM handler is in place: a signal
        # sent before that line would kill it instead of stopping it.
        for line in proc.stdout:
            if "start-up will never finish" in line:
                break
        else:
            raise AssertionError("the server ended without saying it hangs")
        assert proc.poll() is None
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
    finally:
        stop(proc)
    assert proc.returncode == 0


def test_real_time_agrees_with_virtual_time() -> None:
    """Same config, workload and arrival schedule: HTTP vs simulate (both simulated)."""
    import statistics

    from autotune.client import loadgen

    n, rate, seed = 120, 20.0, 7
    reqs = [Request(" ".join(["w"] * (20 + (i * 37) % 60)), 20 + (i * 37) % 60,
                    8 + (i * 13) % 30) for i in range(n)]
    virtual = simulate(EngineConfig("tiny"), "cpu-tiny", None, reqs,
                       arrival_offsets(n, rate, seed=seed))
    v = summarize(virtual.records, source="simulated (virtual time)")
    with server() as (url, _):
        # What the real path adds on this host while the test runs: one HTTP exchange
        # with the same server, timed all through the test (on a quiet host about 1 ms;
        # under CI's parallel tests more).  Timed after the test, a quiet moment set the
        # allowance at 0.65 ms where a busy one had made every request 30 ms late.
        rtts: list[float] = []
        done = threading.Event()

        def ping() -> None:
            with httpx.Client(base_url=url) as client:
                while not done.wait(0.02):
                    t0 = time.perf_counter()
                    client.get("/v1/models")
                    rtts.append(time.perf_counter() - t0)

        pinger = threading.Thread(target=ping)
        pinger.start()
        try:
            res = loadgen.run_load_test_sync(
                loadgen.LoadTestConfig(url=url, model="tiny", rate=rate, warmup=0,
                                       seed=seed), reqs)
        finally:
            done.set()
            pinger.join()
    assert len(rtts) >= 20  # the test lasts about 6 s
    h = summarize(res.records)
    assert h.num_completed == n, h.failure_reasons
    assert [r.output_tokens for r in res.records] == [r.output_tokens
                                                      for r in virtual.records]
    assert h.output_throughput == pytest.approx(v.output_throughput, rel=0.05)
    # Request by request, the real-time server takes what virtual time says plus the
    # transport: never markedly less (it paces by the same model), and over the median
    # not more than 10% plus a few HTTP exchanges.  Not a fixed P99: of 120 requests it
    # is the second-largest, which one late wake-up on a busy host moved by 93 ms.
    excess = statistics.median(r.e2e_s - w.e2e_s
                               for r, w in zip(res.records, virtual.records, strict=True))
    assert excess >= -0.05 * v.e2e.p50
    assert excess <= 0.10 * v.e2e.p50 + 3 * statistics.median(rtts)
    assert h.ttft.p50 == pytest.approx(v.ttft.p50, rel=0.5, abs=0.02)


def test_bench_labels_the_simulators_http_server_as_simulated(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from autotune.cli import app

    out = tmp_path / "results.json"
    with server() as (url, proc):
        result = CliRunner().invoke(app, [
            "bench", "--url", url, "--dataset", "synthetic", "--input-len", "8",
            "--output-len", "4", "--num-prompts", "20", "--warmup", "2", "--rate", "20",
            "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["summary"]["source"].startswith("simulated server")
    assert data["run"]["source"] == data["summary"]["source"]
    assert "measured (HTTP)" not in result.stdout
    # The profile named no GPU count: the log says how many GPUs that default node has.
    assert proc.stdout is not None and proc.stderr is not None
    log = proc.stdout.read() + proc.stderr.read()
    assert "cpu-tiny's default node of" in log, log
