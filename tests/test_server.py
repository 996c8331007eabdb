"""Server lifecycle: launch, health wait, classified failures, clean stop, exit paths.

No vLLM needed: the fake OpenAI server (``autotune.testing.fake_server``, which
ignores unknown vLLM flags) and small scripts stand in for the binary.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from autotune.servers.vllm import (
    REASONS,
    AttachedServer,
    ServerConfigError,
    ServerStartError,
    SimServer,
    VllmServer,
    classify_failure,
    config_to_flags,
    descendants,
    failure_excerpt,
    free_port,
    live_servers,
    looks_local,
    parse_startup_log,
    pid_alive,
    port_listening,
)

FAKE = [sys.executable, "-m", "autotune.testing.fake_server"]
REPO = Path(__file__).resolve().parents[1]


def wait_until(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test must leave no child process of ours and no live server behind."""
    before = set(descendants(os.getpid()))
    yield
    assert live_servers() == []
    assert wait_until(lambda: not (set(descendants(os.getpid())) - before), 10.0), (
        f"processes left behind: {set(descendants(os.getpid())) - before}")


def fake(tmp_path: Path, *args: str, **kw) -> VllmServer:
    kw.setdefault("startup_timeout_s", 30.0)
    kw.setdefault("grace_s", 5.0)
    return VllmServer("tiny-fake", vllm_cmd=FAKE, model_as_flag=True,
                      log_dir=tmp_path / "logs", extra_args=list(args), **kw)


# ----------------------------------------------------------------------------- pure


def test_config_to_flags_kebab_bools_none_lists():
    flags = config_to_flags({
        "max_num_seqs": 8, "enable_chunked_prefill": True, "enable_prefix_caching": False,
        "max_num_batched_tokens": None, "gpu_memory_utilization": 0.9,
        "cuda_graph_sizes": [1, 2], "compilation_config": {"level": 0},
    })
    assert flags == ["--max-num-seqs", "8", "--enable-chunked-prefill",
                     "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.9",
                     "--cuda-graph-sizes", "1", "2", "--compilation-config", '{"level":0}']


def test_parse_startup_log_cpu_one_line_and_gpu_two_lines():
    cpu = ("(EngineCore pid=1) INFO 12-02 [kv_cache_utils.py:2327] CPU KV cache size: "
           "1,048,576 tokens, Maximum concurrency for 1,024 tokens per request: 1024.00x")
    assert parse_startup_log(cpu) == {"kv_cache_tokens": 1048576, "max_concurrency": 1024.0,
                                      "max_concurrency_tokens": 1024}
    gpu = ("INFO [kv_cache_utils.py:716] GPU KV cache size: 12,345 tokens\n"
           "INFO [kv_cache_utils.py:720] Maximum concurrency for 2,048 tokens per request: "
           "6.03x\n")
    assert parse_startup_log(gpu) == {"kv_cache_tokens": 12345, "max_concurrency": 6.03,
                                      "max_concurrency_tokens": 2048}
    assert parse_startup_log("nothing here")["kv_cache_tokens"] is None


@pytest.mark.parametrize("text,rc,reason", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1,
     "out_of_memory"),
    ("ValueError: No available memory for the cache blocks. Try increasing "
     "`gpu_memory_utilization`", 1, "out_of_memory"),
    ("pydantic_core._pydantic_core.ValidationError: 1 validation error for "
     "SchedulerConfig\nmax_num_seqs\n  Input should be greater than or equal to 1", 1,
     "invalid_argument"),
    ("api_server.py: error: argument --max-num-seqs: invalid int value: 'x'", 2,
     "invalid_argument"),
    ("RuntimeError: CUDA error: invalid device ordinal", 1, "device_error"),
    ("RuntimeError: No CUDA GPUs are available", 1, "device_error"),
    ("OSError: [Errno 98] error while attempting to bind on address: address already "
     "in use", 1, "port_in_use"),
    ("OSError: foo is not a local folder and is not a valid model identifier", 1,
     "missing_model"),
    ("importlib.metadata.PackageNotFoundError: No package metadata was found for vllm", 1,
     "missing_binary"),
    ("sh: 1: vllm: not found", 127, "missing_binary"),
    ("", -9, "out_of_memory"),
    ("something odd", 3, "unknown"),
])
def test_classify_failure(text, rc, reason):
    assert reason in REASONS
    assert classify_failure(text, rc) == reason


def test_failure_excerpt_keeps_pydantic_field_and_rule():
    log = ("Traceback...\npydantic_core._pydantic_core.ValidationError: 1 validation error "
           "for SchedulerConfig\nmax_num_seqs\n  Input should be greater than or equal to 1"
           "\n    For further information visit https://errors.pydantic.dev/x\n")
    ex = failure_excerpt(log, "invalid_argument")
    assert "max_num_seqs" in ex and "greater than or equal to 1" in ex
    assert "further information" not in ex


@pytest.mark.parametrize("model,local", [
    ("/models/llama", True), ("./m", True), ("~/m", True), ("a/b/c", True),
    ("x.gguf", True), ("meta-llama/Llama-3.1-8B-Instruct", False), ("gpt2", False),
])
def test_looks_local(model, local):
    assert looks_local(model) is local


# ----------------------------------------------------------------------------- lifecycle


def test_start_stop_fake_server_leaves_nothing(tmp_path):
    server = fake(tmp_path)
    info = server.start({"max_num_seqs": 4, "enable_chunked_prefill": False}, trial=7)
    pid, port = info.pid, server.port
    assert info.served_models == ["tiny-fake"]
    assert info.argv[:3] == FAKE[:3] and "--max-num-seqs" in info.argv
    assert "--no-enable-chunked-prefill" in info.argv
    assert Path(info.log_path) == tmp_path / "logs" / "trial-7.log"
    assert server.alive() and live_servers() == [server]
    assert httpx.get(server.endpoint + "/health").status_code == 200
    assert "listening" in server.log_tail()
    stop = server.stop()
    assert stop.how == "SIGTERM"
    assert not pid_alive(pid) and not port_listening("127.0.0.1", port)
    assert not server.alive()
    # A second start restarts with the next trial number and a new log.
    with server:
        info2 = server.start({"max_num_seqs": 2})
        assert Path(info2.log_path).name == "trial-8.log" and info2.pid != pid
    assert not pid_alive(info2.pid)


def test_restart_stops_the_running_one(tmp_path):
    with fake(tmp_path) as server:
        a = server.start({})
        b = server.start({})
        assert not pid_alive(a.pid) and pid_alive(b.pid)


def test_missing_binary_path_and_name(tmp_path):
    for cmd in (["/nonexistent/bin/vllm", "serve"], ["no-such-vllm-binary-x1", "serve"]):
        server = VllmServer("gpt2", vllm_cmd=cmd, log_dir=tmp_path)
        with pytest.raises(ServerStartError) as e:
            server.start({})
        assert e.value.reason == "missing_binary"
        assert cmd[0] in str(e.value)


def test_missing_model_path(tmp_path):
    server = VllmServer(str(tmp_path / "no-such-model"), vllm_cmd=FAKE, model_as_flag=True,
                        log_dir=tmp_path)
    with pytest.raises(ServerStartError) as e:
        server.start({})
    assert e.value.reason == "missing_model"
    assert "no-such-model" in str(e.value)


def test_port_taken_before_launch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = fake(tmp_path, port=port)
        with pytest.raises(ServerStartError) as e:
            server.start({})
        assert e.value.reason == "port_in_use" and str(port) in str(e.value)


def test_port_taken_between_check_and_bind_is_classified_from_the_log(tmp_path, monkeypatch):
    """The race a free-port pick cannot exclude: the child fails to bind."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = fake(tmp_path)
        monkeypatch.setattr(server, "_choose_port", lambda: setattr(server, "port", port)
                            or port)
        with pytest.raises(ServerStartError) as e:
            server.start({})
    assert e.value.reason == "port_in_use"
    assert e.value.returncode == 1 and "already in use" in e.value.log_tail.lower()


def test_invalid_flag_value_is_classified(tmp_path):
    with pytest.raises(ServerStartError) as e:
        fake(tmp_path).start({"fault": "no-such-fault"})  # argparse rejects it, exit 2
    assert e.value.reason == "invalid_argument"
    assert "invalid choice" in str(e.value)


def test_log_unwritable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    server = VllmServer("m", vllm_cmd=FAKE, model_as_flag=True, log_dir=blocker / "logs")
    with pytest.raises(ServerStartError) as e:
        server.start({})
    assert e.value.reason == "log_unwritable"
    assert str(blocker / "logs") in str(e.value)


HANG = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A grandchild, as vLLM's engine core would be: the group kill must reach it too.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    print("loading weights...", flush=True)
    time.sleep(120)
""")


def test_hang_at_startup_times_out_and_kills_the_group(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    pids_file = tmp_path / "pids"
    server = VllmServer("m", vllm_cmd=[sys.executable, str(script), str(pids_file)],
                        model_as_flag=True, log_dir=tmp_path, startup_timeout_s=1.5,
                        grace_s=2.0, health_interval_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as e:
        server.start({})
    assert e.value.reason == "timeout"
    assert "loading weights" in e.value.log_tail
    assert time.monotonic() - t0 < 10
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)


def test_sigterm_ignored_falls_back_to_sigkill(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    pids_file = tmp_path / "pids"
    # The "server" ignores SIGTERM: health never answers, so start it by hand.
    server = VllmServer("m", vllm_cmd=[sys.executable, str(script), str(pids_file),
                                       "--ignore-term"],
                        model_as_flag=True, log_dir=tmp_path, grace_s=0.5)
    server._preflight()
    server._open_log(0)
    server._launch(server.build_argv({}, free_port()), 0)
    server.port = None
    assert wait_until(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 2)
    pids = [int(p) for p in pids_file.read_text().split()]
    stop = server.stop()
    assert stop.how == "SIGKILL" and set(pids) <= set(stop.pids)
    assert not any(pid_alive(p) for p in pids)


def test_stop_hooks_run_before_the_signal(tmp_path):
    server = fake(tmp_path)
    server.start({})
    seen: list[bool] = []
    server.add_stop_hook(lambda: seen.append(server.alive()))
    server.stop()
    assert seen == [True]


def test_health_ok_but_completions_fail(tmp_path):
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.core.metrics import summarize
    from autotune.workload.sources import Request

    with fake(tmp_path, "--fault", "500") as server:
        info = server.start({})
        assert info.served_models  # healthy as far as /health and /v1/models go
        res = run_load_test_sync(LoadTestConfig(url=server.endpoint, warmup=0, rate=math.inf),
                                 [Request("hi there", 2, 8)] * 6)
    summary = summarize(res.records)
    assert summary.num_failed == 6 and summary.num_completed == 0
    assert all(r.status == 500 and r.error for r in res.records)


def test_server_crash_mid_load_test_counts_failures(tmp_path):
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.core.metrics import summarize
    from autotune.workload.sources import Request

    with fake(tmp_path, "--token-delay-ms", "20") as server:
        server.start({})
        killer = threading.Timer(0.6, os.killpg, (server.pid, signal.SIGKILL))
        killer.start()
        try:
            res = run_load_test_sync(
                LoadTestConfig(url=server.endpoint, warmup=0, rate=20.0,
                               request_timeout_s=10.0),
                [Request("tell me", 2, 100)] * 30)
        finally:
            killer.cancel()
        assert not server.alive()
        stop = server.stop()
        assert stop.how == "exited"
    summary = summarize(res.records)
    assert summary.num_failed > 0 and summary.num_completed < 30
    assert sum(summary.failure_reasons.values()) == summary.num_failed
    assert all(r.error for r in res.records if not r.ok)


# ----------------------------------------------------------------------------- other servers


def test_attached_server(tmp_path):
    from autotune.testing.fake_server import FakeServer, FakeServerConfig

    with FakeServer(FakeServerConfig(model="theirs")) as fs:
        att = AttachedServer(fs.url + "/v1")
        assert att.restartable is False and att.endpoint == fs.url.rstrip("/")
        info = att.start({})
        assert info.served_models == ["theirs"] and att.alive()
        with pytest.raises(ServerConfigError, match="cannot be restarted"):
            att.start({"max_num_seqs": 8})
        att.stop()
        assert att.alive()  # stop() does nothing to someone else's server
    with pytest.raises(ServerStartError) as e:
        AttachedServer(f"http://127.0.0.1:{free_port()}", timeout_s=1.0).start()
    assert e.value.reason == "unreachable"


def test_sim_server_uses_the_same_code_path(tmp_path):
    with SimServer("sim-model", sim_cmd=FAKE, log_dir=tmp_path, startup_delay_s=0.3) as sim:
        info = sim.start({"max_num_seqs": 16})
        assert isinstance(sim, VllmServer)
        assert info.argv[:3] == FAKE[:3] and "--startup-delay-s" in info.argv
        assert info.served_models == ["sim-model"]


def test_sim_server_real_simulator(tmp_path):
    with SimServer("sim-model", log_dir=tmp_path, startup_timeout_s=60) as sim:
        info = sim.start({"max_num_seqs": 8})
        assert info.served_models
        assert "vllm:num_requests_running" in httpx.get(sim.endpoint + "/metrics").text


# ----------------------------------------------------------------------------- exit paths
# Every way the parent can end, SIGKILL and a server crash included: tests/test_process.py


# ----------------------------------------------------------------------------- tiny model
# (what real vLLM loads in tests/test_vllm_cpu.py; built here without torch)


def test_tiny_model_folder_is_complete_and_idempotent(tmp_path):
    import json
    import struct

    import numpy as np
    from tokenizers import Tokenizer

    from autotune.testing.tiny_model import TinyLlamaSpec, build

    spec = TinyLlamaSpec(vocab_size=400, hidden_size=64, intermediate_size=128)
    text = " ".join(f"word{i % 97} the cat sat on the mat." for i in range(3000))
    out = build(tmp_path / "m", spec, text=text)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert cfg["vocab_size"] % 64 == 0 and cfg["rope_theta"] == 10000.0
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"] and tcfg["eos_token"] == "<|im_end|>"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() <= cfg["vocab_size"]
    assert tok.decode(tok.encode("the cat sat").ids) == "the cat sat"
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")
    raw = (out / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    emb = header["model.embed_tokens.weight"]
    assert emb["dtype"] == "BF16" and emb["shape"] == [cfg["vocab_size"], 64]
    norm = header["model.norm.weight"]
    a, b = norm["data_offsets"]
    ones = np.frombuffer(raw[8 + n + a : 8 + n + b], "<u2").astype(np.uint32) << 16
    assert np.all(ones.view(np.float32) == 1.0)  # bf16 of 1.0 written exactly
    assert max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__") \
        == len(raw) - 8 - n
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert build(out, spec, text=text) == out  # same spec: kept as it is
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


class _Stopped(Exception):
    pass


def test_a_stop_signal_during_a_start_waits_until_the_server_is_ours_to_stop(
        tmp_path, monkeypatch):
    """SIGTERM lands while the server is being spawned (the guard already forked): the
    handler's unwinding waits until the server is recorded, so stop_all (atexit, the
    worker's exit) stops it before the process leaves, not the lifeline after it."""
    from autotune.servers import process

    real_spawn = process.spawn

    def spawn_then_signal(*args, **kwargs):
        proc = real_spawn(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # before spawn has returned
        return proc

    def stop(signum, frame):
        raise _Stopped

    monkeypatch.setattr(process, "spawn", spawn_then_signal)
    previous = signal.signal(signal.SIGTERM, stop)
    server = fake(tmp_path)
    try:
        with pytest.raises(_Stopped):
            server.start({})
        assert live_servers() == [server]  # recorded: stop_all reaches it
    finally:
        signal.signal(signal.SIGTERM, previous)
        process.stop_all()
    assert not server.alive()


def test_signals_deferred_runs_the_handler_when_the_block_ends():
    from autotune.servers.process import signals_deferred

    seen: list[str] = []

    def stop(signum, frame):
        seen.append("handler")
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(_Stopped):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                seen.append("block ran to its end")
        assert seen == ["block ran to its end", "handler"]
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, previous)
