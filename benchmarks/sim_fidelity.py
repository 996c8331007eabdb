"""Benchmark 6 (fidelity): calibrate ``cpu-tiny`` on real vLLM-CPU, then compare, one run.

    python benchmarks/sim_fidelity.py [--smoke] [--model PATH|tiny|smollm2] [--label NAME]
        --output FILE.json [--write-profile YAML]

1. **Start** real vLLM for the CPU (``vllm-cpu``, from ``AUTOTUNE_VLLM_PYTHON``) with a
   model (default the tiny test model, ``AUTOTUNE_TINY_MODEL``; ``--model smollm2`` is
   SmolLM2-135M from ``AUTOTUNE_SMOLLM_MODEL``) through autotune's own launcher
   (``autotune.servers.vllm.VllmServer``, as ``tests/test_vllm_cpu.py`` starts it), and warm it up.
2. **Measure step times**: the load comes from autotune's own load generator, the
   timings from vLLM's engine-side histograms on /metrics (engine clock, so neither the
   client's nor the HTTP front end's CPU time is in them): decode steps of B = 1, 2, 4,
   8, 16 sequences (and 4, 8, 16 over long contexts) from
   ``vllm:request_decode_time_seconds`` of B concurrent streams of one length
   (``max_concurrency=B``, rate inf), per output token; prefill steps of P-token prompts
   from ``vllm:request_prefill_time_seconds`` of single requests on the idle engine;
   and an *intake* shape (many short requests, B at a time) that makes the API server
   take requests in while the engine is busy.  Every shape once per round, rounds
   interleaved, medians over rounds; the client's TPOT and TTFT are kept beside them,
   and per run the API-server process's CPU time and the engine process's run-queue
   wait (``/proc/PID/task/*/schedstat``: time runnable but kept off a core).
3. **Fit the front end** (``autotune.sim.calibrate.fit_front_end``): per-request and
   per-output-token API-server costs, with standard errors, from the API server's CPU
   in every run of the load shapes at the largest batch; TTFT less the prefill step of
   the lone probes is set beside the fit (it also holds latency that is no CPU).  Its
   share of the engine's core (``frontend_engine_share``) from the engine's run-queue
   wait in the decode runs (the engine is busy throughout them): background x wall
   seconds + share x API-server CPU seconds, used where its standard error is small.
4. **Fit the engine** (``autotune.sim.calibrate.fit_step_times``): ``step_overhead_ms``,
   ``per_seq_overhead_us``, the achieved FLOP/s and memory bandwidth by least squares
   through the simulator's own cost model, on the decode steps less what the simulator
   adds back to them for the front end's share (share x batch x token cost).
5. **Knee**: the fitted simulator's saturation throughput on the validation workload.
6. **Validate** on *other* requests than the calibration's: a Poisson load test at
   fractions of the knee on real vLLM (``trial.evaluate`` on a ``ServerBackend``: the
   path a user's trial takes) and the same requests, warm-up and arrival seed in virtual
   time on the freshly fitted profile (``trial.evaluate`` on a ``SimBackend``).  Per
   rate: output throughput, P99 E2E and P99 TTFT, real vs simulated, and the errors
   against the targets (throughput <= 5%, P99 E2E and P99 TTFT <= 15%); and the
   simulator's speed on the same test (simulated seconds per CPU-second) against the
   real server's wall seconds.  Before each rate one calibration shape is measured
   again: how fast the (shared, virtual) machine was at that moment compared with the
   calibration (its drift, shown beside the errors).

Without the vllm-cpu venv or the model it writes ``{"skipped": true, "reason": ...}``
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_THROUGHPUT = 0.05  # output tokens/s, relative
TARGET_P99 = 0.15  # P99 E2E, relative
TARGET_TTFT = 0.15  # P99 TTFT, relative
TARGETS = {"throughput": TARGET_THROUGHPUT, "e2e_p99": TARGET_P99, "ttft_p99": TARGET_TTFT}
# Which error each target reads (compare_rate's "error" keys), and its name on the page.
TARGET_ERRORS = {"throughput": "output_throughput", "e2e_p99": "e2e_p99",
                 "ttft_p99": "ttft_p99"}
TARGET_NAMES = {"throughput": "tput", "e2e_p99": "P99 E2E", "ttft_p99": "P99 TTFT"}
FRONT_END_FIELDS = ("frontend_request_ms", "frontend_token_us", "frontend_engine_share")
# --model's names for the models the CI setup builds: (environment variable, default
# folder under the repository, how to make it).
MODELS = {
    "tiny": ("AUTOTUNE_TINY_MODEL", ".cache/tiny-llama", "bash .ci/setup_vllm_cpu.sh"),
    "smollm2": ("AUTOTUNE_SMOLLM_MODEL", ".cache/smollm2-135m-instruct",
                "bash .ci/setup_vllm_cpu.sh --smollm"),
}
# The front end's share is used only when its standard error is under this (a 95%
# interval narrower than about +-0.5); else the profile's is kept, as the twin keeps a
# factor its tests cannot see.
SHARE_SE_MAX = 0.25
SHARE_MIN_DOF = 5  # a standard error on fewer is itself a guess (a smoke run has 1)
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
EXTRA_ARGS = ["--enforce-eager", "--distributed-executor-backend", "uni"]


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
    intake_requests: int  # the intake shape: this many short requests, max(batches) at once
    intake_output: int
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
            intake_requests=64, intake_output=16, warmup_requests=32, num_prompts=500,
            load_warmup=20,
            fractions=(0.5, 0.75, 1.1, 1.3), input_len=64, output_len=128, spread=0.5,
            seed=0)
SMOKE = Plan(max_num_seqs=16, max_model_len=1024, batches=(1, 4), decode_prompt=32,
             decode_output=48, rounds=1, long_prompt=240, long_batches=(4,),
             prefill_prompts=(16, 256), intake_requests=16, intake_output=8,
             warmup_requests=8, num_prompts=30, load_warmup=4,
             fractions=(0.5, 1.2), input_len=48, output_len=48, spread=0.5, seed=0)
# A model of ~100 M parameters (SmolLM2-135M) steps ~20x slower than the tiny one on this
# CPU (a decode step of 16 sequences took ~50 ms against ~2.4 ms, and ~160 ms over 500
# tokens of context): fewer rounds, shorter streams, shorter long contexts and fewer
# requests keep the calibration near 90 s and the whole run near a quarter of an hour.
SMALL_MODEL_PARAMS = 50e6
FULL_SMALL = replace(FULL, decode_output=48, rounds=3, long_prompt=240, long_batches=(4, 16),
                     prefill_prompts=(16, 64, 256, 512), intake_requests=48,
                     warmup_requests=16, num_prompts=300, load_warmup=10, output_len=64)
SMOKE_SMALL = replace(SMOKE, decode_output=16, prefill_prompts=(16, 64), intake_requests=8,
                      num_prompts=12, output_len=16, input_len=32)


def plan_for(params: float, smoke: bool) -> Plan:
    """The run's sizes for a model of ``params`` parameters."""
    if params >= SMALL_MODEL_PARAMS:
        return SMOKE_SMALL if smoke else FULL_SMALL
    return SMOKE if smoke else FULL


# ----------------------------------------------------------------------------- setup


def model_folder(model: str | None) -> tuple[str, str]:
    """(folder, how to make it) of ``--model``: a name of ``MODELS`` (its environment
    variable, else its folder under the repository) or a path; None is the tiny model."""
    name = model or "tiny"
    if name not in MODELS:
        return name, "a Hugging Face model folder with config.json"
    env, default, setup = MODELS[name]
    return os.environ.get(env) or str(ROOT / default), f"run `{setup}`"


def vllm_paths(model: str | None = None) -> tuple[str, str] | str:
    """(vllm-cpu python, model folder), or why they are not usable."""
    py = os.environ.get("AUTOTUNE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    folder, how = model_folder(model)
    if not Path(py).is_file():
        return (f"real vLLM not set up: no vllm-cpu python at {py} (run "
                "`eval \"$(bash .ci/setup_vllm_cpu.sh)\"`, which sets AUTOTUNE_VLLM_PYTHON "
                "and AUTOTUNE_TINY_MODEL)")
    if not (Path(folder) / "config.json").is_file():
        return f"real vLLM not set up: no model at {folder} (no config.json; {how})"
    return py, folder


def default_label(model: str | None) -> str:
    """The run's label when --label is not given: the model's name or folder name."""
    if model is None:
        return "tiny"
    return model if model in MODELS else Path(model).name


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


def _proc_key(pid: int) -> str | None:
    """``cpu_seconds``' name of a server process: its engine, or one of its others."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return "engine_core" if "EngineCor" in name else f"server_{pid}"


def _schedstat(path: Path) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of one thread."""
    run_ns, wait_ns = path.read_text().split()[:2]
    return int(run_ns) * 1e-9, int(wait_ns) * 1e-9


def sched_times(pids: Sequence[int]) -> dict[str, tuple[float, float]]:
    """Per server process, by ``cpu_seconds``' names: (CPU seconds of all its threads,
    run-queue wait seconds of its main thread) so far; empty where the kernel keeps no
    schedstat.

    Nanoseconds (``/proc/PID/task/TID/schedstat``), not the 10 ms ticks of
    ``/proc/PID/stat``: a lone decode stream costs the API server tens of milliseconds.
    The wait is time the thread was runnable while other work held the cores: for the
    engine's main thread, which runs the steps, what the front end (and whatever else
    ran) took from the engine.  Its other threads (OpenMP, ZMQ) are left out of the
    wait: they idle or spin, and their waits do not lengthen a step."""
    out: dict[str, tuple[float, float]] = {}
    for pid in pids:
        key = _proc_key(pid)
        try:
            cpu = sum(_schedstat(t / "schedstat")[0]
                      for t in Path(f"/proc/{pid}/task").iterdir())
            wait = _schedstat(Path(f"/proc/{pid}/schedstat"))[1]
        except (OSError, ValueError):
            continue  # gone, or no schedstat: the caller's figures say n/a
        if key is not None:
            out[key] = (cpu, wait)
    return out


def front_end_load(before: dict[str, tuple[float, float]],
                   after: dict[str, tuple[float, float]]) -> tuple[float, float] | None:
    """(API-server CPU seconds, engine run-queue wait seconds) between two
    ``sched_times`` reads, or None when either side is missing.  Every server process
    but the engine counts as the API server (the launcher's guard idles)."""
    if "engine_core" not in after or "engine_core" not in before:
        return None
    api = sum(after[k][0] - before[k][0] for k in after
              if k.startswith("server_") and k in before)
    wait = after["engine_core"][1] - before["engine_core"][1]
    return (api, wait) if api > 0 else None


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
    from autotune.servers.telemetry import scrape

    return {k: v for k, v in scrape(url).items() if k.endswith(("_sum", "_count"))}


def _delta(before: dict[str, float], after: dict[str, float], name: str
           ) -> tuple[float, float]:
    """(increase of the sum, increase of the count) of histogram ``name``."""
    s, c = f"{name}_sum", f"{name}_count"
    if s not in after or c not in after:
        raise RuntimeError(f"the server's /metrics has no {name}: this vLLM does not export "
                           "the engine-side timings the calibration reads")
    return after[s] - before.get(s, 0.0), after[c] - before.get(c, 0.0)


def shape_run(url: str, pids: Sequence[int], tok: Any, *, requests: int, concurrency: int,
              prompt: int, output: int, seed: int) -> dict[str, float]:
    """One load shape: ``requests`` streams of one length, ``concurrency`` at a time
    (rate inf).  The engine's own decode time per output token
    (``vllm:request_decode_time_seconds``: last minus first token on the engine's clock,
    over output tokens - 1), the client's TPOT beside it, the engine's step count, and
    (``sched_times``) the API server's CPU and the engine's run-queue wait over the run."""
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.workload.sources import synthetic_workload

    wl = synthetic_workload(tok, num_prompts=requests, input_len=prompt, output_len=output,
                            seed=seed)
    before = _histograms(url)
    sched0 = sched_times(pids)  # after the scrape: /metrics costs the API server CPU too
    t0 = time.perf_counter()
    res = run_load_test_sync(LoadTestConfig(url=url, rate=math.inf,
                                            max_concurrency=concurrency, warmup=0,
                                            request_timeout_s=300), wl.requests)
    wall = time.perf_counter() - t0
    load = front_end_load(sched0, sched_times(pids))
    after = _histograms(url)
    if not all(r.ok for r in res.records):
        raise RuntimeError(f"load shape {requests} x {prompt}+{output} (x{concurrency} at "
                           f"once) failed: {[r.error for r in res.records if r.error][:3]}")
    total, n = _delta(before, after, "vllm:request_decode_time_seconds")
    tokens, steps = _delta(before, after, "vllm:iteration_tokens_total")
    return {"step_s": total / n / (output - 1),
            "client_tpot_s": _median([t for r in res.records if (t := r.tpot_s) is not None]),
            "engine_steps": steps, "tokens_per_step": tokens / steps if steps else math.nan,
            "requests": len(res.records), "wall_s": wall,
            "output_tokens": sum(r.output_tokens for r in res.records),
            "api_cpu_s": load[0] if load else math.nan,
            "engine_wait_s": load[1] if load else math.nan}


def decode_run(url: str, pids: Sequence[int], tok: Any, batch: int, prompt: int,
               output: int, seed: int) -> dict[str, float]:
    """One run of ``batch`` concurrent streams of one length: one decode step shape."""
    return shape_run(url, pids, tok, requests=batch, concurrency=batch, prompt=prompt,
                     output=output, seed=seed)


def prefill_run(url: str, tok: Any, prompt: int, seed: int) -> dict[str, float]:
    """One ``prompt``-token request (2 output tokens) alone on the idle engine: its
    ``vllm:request_prefill_time_seconds`` (scheduled to first token, engine clock), the
    client's TTFT, and the prompt length the server counted."""
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.workload.sources import synthetic_workload

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


def _finite(xs: Sequence[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def shape_row(runs: Sequence[dict[str, float]]) -> dict[str, Any]:
    """A load shape's runs as one calibration row: medians, and the runs themselves for
    the front end's share (``engine_share`` pools them)."""
    api = [r["api_cpu_s"] for r in runs]
    wait = [r["engine_wait_s"] for r in runs]
    return {"runs": len(runs), "step_s": _median([r["step_s"] for r in runs]),
            "step_s_runs": [r["step_s"] for r in runs],
            "client_tpot_s": _median([r["client_tpot_s"] for r in runs]),
            "engine_steps_per_run": _median([r["engine_steps"] for r in runs]),
            "tokens_per_step": _median([r["tokens_per_step"] for r in runs]),
            "requests": int(_median([r["requests"] for r in runs])),
            "output_tokens_per_run": int(_median([r["output_tokens"] for r in runs])),
            "api_cpu_s": _median(_finite(api)), "api_cpu_s_runs": api,
            "engine_wait_s": _median(_finite(wait)), "engine_wait_s_runs": wait,
            "wall_s_runs": [r["wall_s"] for r in runs]}


def measure_steps(url: str, pids: Sequence[int], tok: Any, plan: Plan) -> dict[str, Any]:
    """Every calibration shape: decodes of B sequences (short and long contexts), lone
    prefills of P tokens and the intake shape, in ``rounds`` interleaved rounds, one run
    of every shape a round, medians over rounds.  Interleaving spreads each shape over
    the whole calibration, so a stretch of slow machine (this VM's speed drifts by tens
    of per cent within a minute) moves every shape alike instead of bending the fit."""
    shapes = [(b, plan.decode_prompt) for b in plan.batches]
    shapes += [(b, plan.long_prompt) for b in plan.long_batches]
    dec_runs: dict[tuple[int, int], list[dict[str, float]]] = {s: [] for s in shapes}
    pre_runs: dict[int, list[dict[str, float]]] = {p: [] for p in plan.prefill_prompts}
    intake_runs: list[dict[str, float]] = []
    for k in range(plan.rounds):
        for b, prompt in shapes:
            dec_runs[(b, prompt)].append(
                decode_run(url, pids, tok, b, prompt, plan.decode_output,
                           seed=10_000 * k + 10 * b + prompt))
        for p in plan.prefill_prompts:
            pre_runs[p].append(prefill_run(url, tok, p, seed=20_000 + 1000 * k + p))
        intake_runs.append(shape_run(url, pids, tok, requests=plan.intake_requests,
                                     concurrency=max(plan.batches),
                                     prompt=plan.decode_prompt, output=plan.intake_output,
                                     seed=40_000 + k))
    decode = [{"batch": b, "prompt_tokens": prompt, "output_tokens": plan.decode_output,
               "mean_context": prompt + plan.decode_output / 2, **shape_row(runs)}
              for (b, prompt), runs in dec_runs.items()]
    prefill = []
    for p, runs in pre_runs.items():
        step = _median([r["step_s"] for r in runs])
        ttft = _median(_finite([r["client_ttft_s"] for r in runs]))
        prefill.append({"prompt_tokens": p, "reps": len(runs), "step_s": step,
                        "step_s_reps": [r["step_s"] for r in runs], "client_ttft_s": ttft,
                        "front_end_s": ttft - step,
                        "served_prompt_tokens": int(_median([r["served_prompt_tokens"]
                                                             for r in runs]))})
    intake = {"batch": max(plan.batches), "prompt_tokens": plan.decode_prompt,
              "output_tokens": plan.intake_output, **shape_row(intake_runs)}
    return {"decode": decode, "prefill": prefill, "intake": intake}


def reference_step(url: str, tok: Any, plan: Plan, seed: int) -> float:
    """The machine's speed now: one decode run of the reference shape (the calibration's
    largest short-context batch), to set beside its calibration median."""
    return decode_run(url, (), tok, max(plan.batches), plan.decode_prompt,
                      plan.decode_output, seed)["step_s"]


def warm_up(url: str, tok: Any, plan: Plan) -> float:
    """A few mixed requests so that first-call costs stay out of every figure."""
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.workload.sources import synthetic_workload

    wl = synthetic_workload(tok, num_prompts=plan.warmup_requests, input_len=64,
                            output_len=32, distribution="uniform", input_spread=0.9,
                            output_spread=0.5, seed=999)
    t0 = time.perf_counter()
    run_load_test_sync(LoadTestConfig(url=url, rate=math.inf, max_concurrency=8, warmup=0,
                                      request_timeout_s=300), wl.requests)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- fitting


def front_end_samples(cal: dict[str, Any]) -> list[Any]:
    """The calibration's evidence on the API server's costs, as ``fit_front_end`` takes
    it: its CPU seconds (schedstat) in every run of the load shapes at the largest batch
    (the decodes over short and long contexts: mostly per-token work; the intake shape:
    mostly per-request work).

    Only the largest batch: the API server also pays per engine step (one message of
    outputs each), which the simulator's front end prices per token; near the knee,
    where fidelity matters, steps carry the largest batches, so that is the per-token
    cost to fit.  TTFT less the prefill step of the lone probes is not fitted but
    checked (``first_token_check``): it also holds IPC and HTTP latency, which is no
    front-end CPU, and fitted beside the CPU it pulls the per-token cost towards 0."""
    from autotune.sim.calibrate import FrontEndSample

    big = max(d["batch"] for d in cal["decode"])
    out = []
    for row in [*(d for d in cal["decode"] if d["batch"] == big), cal["intake"]]:
        label = (f"API CPU: {row['requests']} x {row['prompt_tokens']}+"
                 f"{row['output_tokens']} ({row['batch']} at once)")
        for cpu in row["api_cpu_s_runs"]:
            if cpu is not None and math.isfinite(cpu) and cpu > 0:
                out.append(FrontEndSample.load_test(
                    row["requests"], row["output_tokens_per_run"], cpu, label))
    return out


def first_token_check(cal: dict[str, Any], request_s: float, token_s: float
                      ) -> dict[str, float] | None:
    """TTFT less the prefill step of the lone probes (median over them) against what
    the simulator's front end puts there (one request's intake plus one token): the
    difference is time on the first token's path that is no front-end CPU."""
    gaps = [g for p in cal["prefill"]
            if (g := p.get("front_end_s")) is not None and math.isfinite(g)]
    if not gaps:
        return None
    measured = _median(gaps)
    model = request_s + token_s
    return {"measured_s": measured, "model_s": model, "unmodelled_s": measured - model,
            "probes": len(gaps)}


def _runs(rows: Sequence[dict[str, Any]]) -> np.ndarray:
    """(wall s, API CPU s, engine wait s) of every run of ``rows`` that has all three."""
    out = [(t, a, w) for row in rows
           for t, a, w in zip(row["wall_s_runs"], row["api_cpu_s_runs"],
                              row["engine_wait_s_runs"], strict=True)
           if all(x is not None and math.isfinite(x) and x >= 0 for x in (t, a, w)) and t > 0]
    return np.array(out, dtype=float).reshape(-1, 3)


def engine_share(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """The front end's share of the engine's core from the decode runs (each keeps the
    engine busy throughout): the engine's run-queue wait in each run as background x
    wall seconds + share x the API server's CPU seconds, least squares held >= 0, share
    held to <= 1, with standard errors.  The background term takes out other people's
    work on the shared machine, which grows with the run's length rather than with the
    front end's work (the runs differ in API CPU per second: a lone stream keeps the
    API server a few per cent busy, 16 streams tens of per cent).  None when fewer than
    2 runs have the figures or their API CPU per second does not differ.

    The load generator in this process counts in the share: its CPU grows with the
    tokens just as the front end's does, and the simulator has no stage for it."""
    from scipy.optimize import nnls

    runs = _runs(rows)
    if len(runs) < 2:
        return None
    x, y = runs[:, :2], runs[:, 2]
    if np.linalg.matrix_rank(x / np.abs(x).max(axis=0).clip(min=1e-12)) < 2:
        return None
    coef, _ = nnls(x, y)
    dof = len(runs) - 2
    se = [math.nan, math.nan]
    if dof > 0:
        resid = y - x @ coef
        cov = float(resid @ resid) / dof * np.linalg.inv(x.T @ x)
        se = list(np.sqrt(np.maximum(np.diag(cov), 0.0)))
    return {"share": min(float(coef[1]), 1.0), "unclipped": float(coef[1]),
            "se": float(se[1]), "background": float(coef[0]), "background_se": float(se[0]),
            "runs": len(runs), "dof": dof, "wall_s": float(runs[:, 0].sum()),
            "api_cpu_s": float(runs[:, 1].sum()), "wait_s": float(runs[:, 2].sum())}


def engine_only_step(step_s: float, batch: int, share: float, token_s: float) -> float:
    """A measured decode step less the front end's part of it: the simulator prices a
    step by the cost model and then lengthens it by share x (tokens x token cost) of
    front-end work, so the cost model must be fitted to what is left (else that part
    counts twice).  Never below a tenth of the step (a share that large is an outlier,
    and the fit needs a positive time)."""
    return max(step_s - share * batch * token_s, 0.1 * step_s)


def fit_front(cal: dict[str, Any]) -> tuple[Any, dict[str, float] | None, list[str]]:
    """(front-end cost fit or None, measured share or None, notes on what was kept)."""
    from autotune.sim.calibrate import fit_front_end

    notes: list[str] = []
    fe_fit = None
    try:
        fe_fit = fit_front_end(front_end_samples(cal))
    except ValueError as exc:
        notes.append(f"front-end costs NOT fitted (kept from the profile): {exc}")
    share = engine_share(cal["decode"])
    if share is None:
        notes.append("frontend_engine_share NOT fitted (no schedstat for the engine and "
                     "API server, or too few decode runs): kept from the profile")
    elif share["dof"] < SHARE_MIN_DOF or not share["se"] <= SHARE_SE_MAX:
        notes.append(f"frontend_engine_share NOT identified: {share['unclipped']:.3g} +- "
                     f"{share['se']:.2g} on {_dof(share['dof'])} (it needs a standard error "
                     f"under {SHARE_SE_MAX} on {SHARE_MIN_DOF} or more): kept from the "
                     "profile")
        share = {**share, "identified": False}
    return fe_fit, share, notes


def fit_profile(cal: dict[str, Any], previous: Any, model: Any
                ) -> tuple[Any, Any, dict[str, Any]]:
    """(Calibration of the engine, the whole fitted profile, the front end's figures)
    from the calibration's measurements: the front end first (its costs and share do
    not depend on the engine's fit), then the engine on the decode steps less the front
    end's part.  Where the front end cannot be fitted, the profile's figures are kept
    and a note says why."""
    from autotune.sim.calibrate import StepSample, fit_step_times

    fe_fit, share, notes = fit_front(cal)
    token_s = fe_fit.token_s if fe_fit else previous.frontend_token_us * 1e-6
    request_s = fe_fit.request_s if fe_fit else previous.frontend_request_ms * 1e-3
    used = share is not None and share.get("identified", True)
    s = share["share"] if used and share is not None else previous.frontend_engine_share
    samples = [StepSample.decode(d["batch"], d["mean_context"],
                                 engine_only_step(d["step_s"], d["batch"], s, token_s),
                                 f"decode x{d['batch']} ctx {d['mean_context']:.0f}")
               for d in cal["decode"]]
    parts = [d["step_s"] - x.seconds for d, x in zip(cal["decode"], samples, strict=True)]
    samples += [StepSample.prefill(p["served_prompt_tokens"], p["step_s"])
                for p in cal["prefill"]]
    engine = fit_step_times(samples, previous, model, fit_bandwidth=True)
    hardware = replace(fe_fit.profile(engine.hardware) if fe_fit else engine.hardware,
                       frontend_engine_share=s)
    front = {"fit": fe_fit.to_dict() if fe_fit else None, "share": share,
             "share_used": s, "token_s_used": token_s, "notes": notes,
             "decode_part_s": parts,
             "first_token": first_token_check(cal, request_s, token_s),
             "fitted": sorted((["frontend_request_ms", "frontend_token_us"] if fe_fit
                               else []) + (["frontend_engine_share"] if used else []))}
    return engine, hardware, front


# ----------------------------------------------------------------------------- simulating


def sim_backend(model_dir: str, hardware: Any) -> Any:
    from autotune.backends.sim import SimBackend

    backend = SimBackend("cpu-tiny", model_dir)
    backend.hardware = hardware  # the freshly fitted profile, not the shipped file
    return backend


def capacity(model_dir: str, hardware: Any, flags: dict[str, Any], requests: list[Any]
             ) -> dict[str, float]:
    """The fitted simulator's saturation throughput: every request sent at once."""
    from autotune.core.metrics import summarize
    from autotune.sim import EngineConfig, load_model, simulate

    model = load_model(model_dir)
    cfg = EngineConfig.from_flags({"model": model.hf_id, **flags})
    res = simulate(cfg, hardware, model, requests, [0.0] * len(requests))
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


def silent_share(records: Sequence[Any]) -> float | None:
    """Share of the completed requests' output tokens that sent no text chunk (a special
    token, part of a UTF-8 byte sequence: its text goes out with a later token's).  A
    request's first token is as likely to be one, and then the client's TTFT counts
    from a later token; the simulator's tokens all arrive.  None without tokens."""
    done = [r for r in records if r.ok and r.output_tokens > 0]
    tokens = sum(r.output_tokens for r in done)
    if not tokens:
        return None
    return sum(max(r.output_tokens - len(r.chunk_times_s), 0) for r in done) / tokens


def _rel(sim: float, real: float) -> float:
    return (sim - real) / real if real else float("nan")


def targets_met(error: Mapping[str, float | None]) -> dict[str, bool]:
    """Per target (``TARGETS``): whether the relative error is within it; a missing or
    non-finite error (no TTFT measured) misses."""
    out = {}
    for name, limit in TARGETS.items():
        e = error.get(TARGET_ERRORS[name])
        out[name] = e is not None and math.isfinite(e) and abs(e) <= limit
    return out


def compare_rate(rate: float, fraction: float, real_backend: Any, model_dir: str,
                 hardware: Any, flags: dict[str, Any], load: Any) -> dict[str, Any]:
    """One rate: the real load test, then the same requests and seed in virtual time."""
    from autotune.tuning.trial import evaluate

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
                 "silent_token_share": silent_share(real.records),
                 "engine_s_per_decode_token": decode_s / _decode_tokens(real.records)},
        "sim": {**s_fig, "cpu_s": sim_cpu, "simulated_s": sim_span,
                "engine_s_per_decode_token": _sim_decode_s(virt.records)
                / _decode_tokens(virt.records),
                "simulated_s_per_cpu_s": sim_span / sim_cpu if sim_cpu > 0 else None},
        "error": err,
        "met": targets_met(err),
        "speed_vs_real": real_wall / sim_cpu if sim_cpu > 0 else None,
    }


# ----------------------------------------------------------------------------- the run


def run(plan: Plan, py: str, model_dir: str, log_dir: Path, max_wall_s: float = math.inf,
        extra_env: dict[str, str] | None = None
        ) -> tuple[dict[str, Any], Any, Any, dict[str, Any]]:
    """The whole benchmark on one server: (JSON-ready figures, the engine's Calibration,
    the whole fitted profile, the front end's figures)."""
    from autotune.backends.base import LoadPlan
    from autotune.backends.http import ServerBackend
    from autotune.core.slo import parse_slo
    from autotune.servers.vllm import VllmServer
    from autotune.sim import load_hardware
    from autotune.sim.profiles import load_model
    from autotune.workload.sources import synthetic_workload
    from autotune.workload.tokenizer import tokenizer_from_path

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
    cal = hardware = None
    front: dict[str, Any] = {}
    try:
        startup = backend.prepare(flags)
        url = server.endpoint
        pids = server.group_pids()
        out["server"] = {"argv": startup.get("argv"), "env": env,
                         "startup_s": startup.get("startup_s"),
                         "kv_cache_tokens": startup.get("kv_cache_tokens"),
                         "pids": pids}
        out["server"]["vllm_version"] = vllm_version(startup.get("log_path"))
        warm_s = warm_up(url, tok, plan)
        out["server"]["affinity"] = affinity(pids)

        # -- calibration: step times and front-end costs on the real server -----------
        t_cal, mach0 = time.perf_counter(), machine_cpu()
        measured = measure_steps(url, pids, tok, plan)
        cal_wall = time.perf_counter() - t_cal
        cal_machine = machine_shares(mach0, machine_cpu())
        model = load_model(model_dir)
        out["model"] = {"path": model_dir, "params": model.num_params,
                        "weight_bytes": model.weight_bytes, "dtype": model.dtype}
        previous = load_hardware("cpu-tiny")
        cal, hardware, front = fit_profile(measured, previous, model)
        out["calibration"] = {
            "wall_s": cal_wall, "warmup_wall_s": warm_s, "machine_cpu_pct": cal_machine,
            **measured, "fit": cal.to_dict(), "front_end": front,
            "previous": {k: getattr(previous, k) for k in
                         [*cal.fitted_fields(), *FRONT_END_FIELDS]},
            "fitted_profile": {k: getattr(hardware, k) for k in
                               [*cal.fitted_fields(), *FRONT_END_FIELDS]},
        }
        decode = measured["decode"]

        # -- validation: other requests, Poisson, real vs virtual time ------------------
        wl = synthetic_workload(tok, num_prompts=plan.num_prompts, input_len=plan.input_len,
                                output_len=plan.output_len, distribution="uniform",
                                input_spread=plan.spread, output_spread=plan.spread,
                                seed=plan.seed + 7)
        warm = synthetic_workload(tok, num_prompts=max(plan.load_warmup, 1),
                                  input_len=plan.input_len, output_len=plan.output_len,
                                  distribution="uniform", input_spread=plan.spread,
                                  output_spread=plan.spread, seed=plan.seed + 8)
        knee = capacity(model_dir, hardware, flags, wl.requests)
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
            row = compare_rate(r, f, backend, model_dir, hardware, flags, load)
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
    return out, cal, hardware, front


def _abs_err(r: dict[str, Any], name: str) -> float | None:
    e = r["error"].get(TARGET_ERRORS[name])
    return abs(e) if e is not None and math.isfinite(e) else None


def drift_over_errors(r: dict[str, Any]) -> list[str]:
    """The targets a rate missed by less than the machine's own drift then (its
    reference step over the calibration's, less 1): misses the machine alone could
    explain, to be shown beside the error."""
    ratio = r.get("reference_vs_calibration")
    if ratio is None or not math.isfinite(ratio):
        return []
    met = targets_met(r["error"])
    return [n for n in TARGETS if not met[n]
            and (e := _abs_err(r, n)) is not None and e < abs(ratio - 1)]


def headline(data: dict[str, Any]) -> dict[str, Any]:
    """The run in a few figures: the largest error per target over the rates, how many
    rates met every target, and how far the machine itself drifted meanwhile."""
    rates = data.get("rates") or []
    if not rates:
        return {}
    worst = {}
    for name in TARGETS:
        errs = [e for r in rates if (e := _abs_err(r, name)) is not None]
        worst[name] = max(errs) if errs else None
    met = [targets_met(r["error"]) for r in rates]
    drift = [x for r in rates if (x := r.get("reference_vs_calibration")) is not None]
    speed = [r["sim"]["simulated_s_per_cpu_s"] for r in rates if r["sim"]["simulated_s_per_cpu_s"]]
    return {"label": data.get("label"),
            "throughput_error_max": worst["throughput"],
            "e2e_p99_error_max": worst["e2e_p99"], "ttft_p99_error_max": worst["ttft_p99"],
            "targets_met": {n: all(m[n] for m in met) for n in TARGETS},
            "rates_meeting_all": sum(all(m.values()) for m in met), "rates": len(rates),
            "drift_min": min(drift) if drift else None,
            "drift_max": max(drift) if drift else None,
            "rates_drift_over_error": sum(bool(drift_over_errors(r)) for r in rates),
            "simulated_s_per_cpu_s_min": min(speed) if speed else None}


def headline_line(h: dict[str, Any]) -> str:
    """The headline as the page's one bold line (README quotes it)."""
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    text = (f"{h['label'] + ': ' if h.get('label') else ''}throughput error max "
            f"{pct(h['throughput_error_max'])}, P99 E2E error max "
            f"{pct(h['e2e_p99_error_max'])}, P99 TTFT error max "
            f"{pct(h['ttft_p99_error_max'])} (targets {TARGET_THROUGHPUT:.0%} / "
            f"{TARGET_P99:.0%} / {TARGET_TTFT:.0%}); {h['rates_meeting_all']} of "
            f"{h['rates']} rates meet all three")
    if h.get("drift_min") is not None:
        text += (f"; the machine's own step time before the rates was "
                 f"{h['drift_min']:.2f}-{h['drift_max']:.2f}x the calibration's")
        if h.get("rates_drift_over_error"):
            text += (f", more than a missed target's error at {h['rates_drift_over_error']} "
                     "rate(s)")
    return f"**Headline (same run): {text}.**"


NOTE_CLIENT = ("The load generator runs in this benchmark's own process on the same 2 "
               "cores as vLLM's API server and engine: the simulator has no stage for it; "
               "what it takes from the engine counts in the measured front-end share.")

HOW = [
    "Calibration and validation come from the same run, on one real vLLM-CPU server "
    "started by autotune.servers.vllm.VllmServer; the validation requests differ from the "
    "calibration's (no in-sample validation: the calibration's own requests have other "
    "seeds and shapes, and the front end is fitted from calibration shapes only).",
    "Step times come from vLLM's engine-side histograms on /metrics while autotune's "
    "load generator offers the load: decode = vllm:request_decode_time_seconds per output "
    "token of B concurrent equal streams (short and long contexts), prefill = "
    "vllm:request_prefill_time_seconds of single requests on the idle engine; every "
    "shape once per round, rounds interleaved, medians over rounds.",
    "Front end (vLLM's API server), fitted by autotune.sim.calibrate.fit_front_end "
    "(weighted least squares, with standard errors): the per-request and per-output-token "
    "costs from the API-server process's CPU time (schedstat, ns) in every run of the "
    "calibration load shapes at the largest batch (the decodes, and an intake shape of "
    "many short requests that has the front end take requests in while the engine is "
    "busy). TTFT less the prefill step of the lone prefill probes is set beside the fit, "
    "not in it: it also holds IPC and HTTP latency that is no CPU (fitted beside the CPU "
    "in trial runs on this machine, it pulled the per-token cost to 0). Its share of the "
    "engine's core "
    "(frontend_engine_share): the run-queue wait of the engine's main thread (time "
    "runnable but kept off a core) in every decode run, as background x the run's wall "
    "seconds (other work on the shared machine) + share x the API server's CPU seconds, "
    "by least squares held >= 0; used where its standard error is under "
    f"{SHARE_SE_MAX} on {SHARE_MIN_DOF} or more degrees of freedom, else the profile's "
    "is kept.",
    "Engine fit: least squares on relative error through the simulator's cost model "
    "(autotune.sim.calibrate.fit_step_times) of the achieved FLOP/s, the achieved memory "
    "bandwidth (seen in decodes over short and long contexts), and the per-step and "
    "per-sequence host overheads, on the decode steps less the front end's part "
    "(share x batch x token cost, which the simulator adds back to each step).",
    NOTE_CLIENT,
    "Targets per rate: output throughput within 5%, P99 E2E and P99 TTFT within 15% of "
    "real vLLM's. Before each rate one calibration shape is run again: its step time over "
    "the calibration's says how much faster or slower the shared machine was then; where "
    "that drift is larger than a missed target's error, the page says so beside it.",
    "Tokens whose text is empty (the random-weight tiny model emits special tokens and "
    "partial UTF-8) send no chunk, and TTFT counts to the first chunk with text (as vLLM's "
    "benchmark does): a real request may show its first token many steps late, which the "
    "simulator cannot know. E2E and token counts (from the usage chunk) are unaffected.",
    "Speed is compared against real time, not against Microsoft's vidur: vidur installs "
    "from PyPI but cannot simulate offline (its profiling data comes from a model hub).",
]


def _front_paragraph(front: dict[str, Any]) -> str:
    """The front end's fit in one sentence or two, for the profile's header."""
    fit, share = front.get("fit"), _used_share(front)
    parts = []
    if fit:
        parts.append(
            "Front end (vLLM's API server) FITTED by autotune.sim.calibrate.fit_front_end "
            f"to the API server's CPU in {len(fit['samples'])} calibration runs at the "
            "largest batch: frontend_request_ms "
            f"{fit['frontend_request_ms']:.3g} +- {_se(fit['frontend_request_ms_se'])}, "
            f"frontend_token_us {fit['frontend_token_us']:.3g} +- "
            f"{_se(fit['frontend_token_us_se'])} (standard errors, {_dof(fit['dof'])}; "
            f"largest relative error {fit['max_rel_error']:.1%}).")
    if share:
        parts.append(
            f"frontend_engine_share {share['share']:.3g} +- {_se(share['se'])} FITTED to "
            f"the engine's run-queue wait in {share['runs']} decode runs ("
            f"{share['wait_s']:.3g} s in all, beside {share['api_cpu_s']:.3g} s of API-server "
            f"CPU and {share['wall_s']:.3g} s of wall; background {share['background']:.3g} "
            "s of wait per s from other work; the load generator counts in the share).")
    check = front.get("first_token")
    if check:
        parts.append(f"TTFT less the prefill step on the idle server: "
                     f"{check['measured_s'] * 1e3:.3g} ms measured, "
                     f"{check['model_s'] * 1e3:.3g} ms of front-end CPU in the profile.")
    parts += front.get("notes") or []
    return " ".join(parts)


def _used_share(front: dict[str, Any]) -> dict[str, Any] | None:
    """The measured share when the profile uses it (identified), else None."""
    share = front.get("share")
    return share if share and share.get("identified", True) else None


def _dof(n: int) -> str:
    return f"{n} degree{'' if n == 1 else 's'} of freedom"


def _se(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2g}"


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
        f"{data['server'].get('vllm_version') or 'version unknown'}) with the model "
        f"'{data.get('label', 'tiny')}' ({data['model']['path']}). SIMULATOR "
        "PROFILE whose step_overhead_ms, per_seq_overhead_us and achieved FLOP/s "
        "(peak_tflops x compute_efficiency)"
        + (" and memory bandwidth" if fit.get("bandwidth_fitted") else "")
        + " were FITTED to step times measured on that server, by `"
        f"{data.get('command', 'python benchmarks/sim_fidelity.py')}` "
        "(autotune.sim.calibrate: least squares on relative error through "
        "autotune.sim.costmodel), and whose front-end figures were fitted and measured "
        "in the same run (below).",
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
        f"Server: autotune.servers.vllm.VllmServer, {' '.join(EXTRA_ARGS)}, env "
        f"{' '.join(f'{k}={v}' for k, v in data['server']['env'].items())}, max_num_seqs "
        f"{data['validation']['flags']['max_num_seqs']}, max_model_len "
        f"{data['validation']['flags']['max_model_len']}.",
        "Measurements (vLLM's engine-side histograms on /metrics, load from "
        "autotune.client.loadgen): decode step per output token of B concurrent equal streams "
        f"({dec}); prefill step of a lone P-token prompt ({pre}). The engine was fitted "
        "to the decode steps less the front end's part (share x B x token cost), which "
        "the simulator adds back.",
        f"Engine fit: R^2 {fit['r2']:.4f}, RMSE {fit['rmse_s'] * 1e3:.2f} ms, largest "
        f"relative error {fit['max_rel_error']:.1%}; achieved {fit['achieved_tflops']:.3g} "
        f"TFLOP/s and {fit['achieved_bandwidth_gbs']:.3g} GB/s"
        + (" (the bandwidth stands for what a decode step pays per KV entry read, which "
           "on this CPU is far more than the FLOP count says)" if fit.get("bandwidth_fitted")
           else " (bandwidth kept)")
        + ". Interconnect figures are not fitted (one device)." + (
            " Notes: " + "; ".join(fit["notes"]) + "." if fit.get("notes") else ""),
        _front_paragraph(cal.get("front_end") or {}),
    ]
    h = data.get("headline") or {}
    if h:
        paragraphs.append(
            f"Validated in the same run on other requests (Poisson, {h['rates']} rates "
            "around the knee) against real vLLM (benchmarks/sim_fidelity.py): "
            + headline_line(h).removeprefix("**Headline (same run): ").removesuffix("**"))
    lines: list[str] = []
    for i, text in enumerate(p for p in paragraphs if p):
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
DESCRIPTION = "2-core x86 CPU running vLLM-CPU (simulated; fitted to real vLLM-CPU)"


def profile_comments(data: dict[str, Any], bandwidth_fitted: bool) -> dict[str, str]:
    """Each field's comment in the profile's YAML: what was fitted from what, with the
    front end's standard errors (the fitted ones say "fitted" on their own)."""
    isa = ", ".join(data["machine"].get("cpu_isa") or ["unknown ISA"])
    out = {**COMMENTS, "peak_tflops": f"CPU with {isa}"}
    if bandwidth_fitted:
        for key in ("peak_bandwidth_gbs", "bandwidth_efficiency"):
            out[key] = "from decodes over short and long contexts"
    front = data["calibration"].get("front_end") or {}
    fit, share = front.get("fit"), _used_share(front)
    if fit:
        out["frontend_request_ms"] = (f"+- {_se(fit['frontend_request_ms_se'])}: HTTP, "
                                      "tokenise, hand-over (API-server CPU)")
        out["frontend_token_us"] = (f"+- {_se(fit['frontend_token_us_se'])}: detokenise, "
                                    "one SSE chunk (API-server CPU)")
    if share:
        out["frontend_engine_share"] = (f"+- {_se(share['se'])}: engine run-queue wait "
                                        "per API-server CPU s")
    return out


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
    p.add_argument("--model", default=None, metavar="PATH",
                   help="model folder vLLM serves, or a name the CI setup builds: "
                        f"{', '.join(MODELS)} (default: tiny, from AUTOTUNE_TINY_MODEL)")
    p.add_argument("--label", default=None,
                   help="the run's name on the page (default: the model's name)")
    p.add_argument("--write-profile", type=Path, default=None,
                   help="also write the fitted profile as this hardware YAML file")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="measured requests per rate (default 500, 300 for models of 50 M "
                        "parameters or more; smoke 30 and 12)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: temp)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the vLLM server (e.g. OMP_NUM_THREADS=1); "
                        "repeatable; the default is the tests' environment only")
    p.add_argument("--max-wall-s", type=float, default=1200.0,
                   help="start no further rate after this many seconds (default 1200)")
    a = p.parse_args(argv)
    bad = [e for e in a.server_env if "=" not in e]
    if bad:
        p.error(f"--server-env wants KEY=VALUE, got {bad[0]!r}")
    extra_env = dict(e.split("=", 1) for e in a.server_env)
    command = " ".join(["python", "benchmarks/sim_fidelity.py",
                        *(sys.argv[1:] if argv is None else argv)])
    label = a.label or default_label(a.model)
    paths = vllm_paths(a.model)
    data: dict[str, Any]
    if isinstance(paths, str):
        data = {"skipped": True, "reason": paths, "command": command, "label": label,
                "machine": {"cpu_model": cpu_model(), "load_at_end": machine_load()}}
    else:
        import tempfile

        from autotune.sim.profiles import load_model

        plan = plan_for(load_model(paths[1]).num_params, a.smoke)
        if a.num_prompts is not None:
            plan = replace(plan, num_prompts=a.num_prompts)
        with tempfile.TemporaryDirectory(prefix="sim-fidelity-") as tmp:
            data, cal, hardware, _ = run(plan, *paths, a.log_dir or Path(tmp), a.max_wall_s,
                                         extra_env)
        data.update(command=command, label=label, smoke=a.smoke, how=HOW,
                    plan={k: getattr(plan, k) for k in plan.__dataclass_fields__},
                    targets={"throughput_rel": TARGET_THROUGHPUT, "e2e_p99_rel": TARGET_P99,
                             "ttft_p99_rel": TARGET_TTFT})
        data["headline"] = headline(data)
        if a.write_profile is not None and hardware is not None:
            write_profile(a.write_profile, data, cal, hardware)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(_jsonable(data), indent=2))
    print(json.dumps(_jsonable({k: data.get(k) for k in ("skipped", "reason", "headline")}),
                     indent=2))
    return 0


def write_profile(path: Path, data: dict[str, Any], cal: Any, hardware: Any) -> None:
    """The whole fitted profile (engine and front end) as a hardware YAML file."""
    from autotune.sim.calibrate import hardware_yaml

    fitted = set(cal.fitted_fields()) | set(data["calibration"]["front_end"]["fitted"])
    text = hardware_yaml(replace(hardware, description=DESCRIPTION), header_for(data),
                         fitted=fitted,
                         comments=profile_comments(data, cal.bandwidth_fitted))
    path.write_text(text)
    data["profile_written"] = str(path)


# ----------------------------------------------------------------------------- markdown


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _others(pct: dict[str, float] | None) -> str:
    if not pct:
        return "n/a"
    return f"{pct.get('nice', 0):.0f} / {pct.get('steal', 0):.0f}"


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}×"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f}"


def _busy(load: dict[str, Any]) -> str:
    procs = load.get("busy_processes") or []
    if not procs:
        return "none"
    return ", ".join(f"{p['name']} (nice {p['nice']}) {p['cpu_pct']}%" for p in procs)


def _md_fit(data: dict[str, Any]) -> list[str]:
    """The engine's fit: measured steps, the front end's part, the fitted model."""
    cal, fit = data["calibration"], data["calibration"]["fit"]
    parts = (cal.get("front_end") or {}).get("decode_part_s") or []
    lines = [
        "**Engine fit** (measured step times, less the front end's part the simulator adds "
        f"back, vs the fitted cost model; R² {fit['r2']:.4f}, RMSE "
        f"{fit['rmse_s'] * 1e3:.2f} ms):", "",
        "| step | tokens | seqs | measured ms | front end's part ms | fitted to ms | "
        "model ms | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(fit["samples"]):
        # Prefills have no part; a JSON from before the front end was fitted says n/a.
        part = parts[i] if i < len(parts) else (0.0 if parts else None)
        lines.append(f"| {s['label']} | {s['tokens']} | {s['seqs']} | "
                     f"{_ms(s['seconds'] + (part or 0.0))} | {_ms(part)} | "
                     f"{_ms(s['seconds'])} | {_ms(s['predicted_s'])} | "
                     f"{_pct(-s['residual_s'] / s['seconds'])} |")
    prev, now = cal["previous"], cal.get("fitted_profile") or fit["fitted"]
    lines += ["", "| field | shipped profile before the run | fitted |", "|---|---|---|"]
    for k, v in now.items():
        lines.append(f"| {k} | {prev.get(k)} | {v:.4g} |")
    return lines


def _fit_rows(fit: dict[str, Any]) -> list[str]:
    """The front-end fit's samples, one table row per load shape (median over runs)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in fit["samples"]:
        by.setdefault(r["label"], []).append(r)
    rows = []
    for label, runs in by.items():
        measured = _median([r["seconds"] for r in runs])
        pred = runs[0]["predicted_s"]
        rows.append(f"| {label} | {len(runs)} | {runs[0]['requests']:.0f} | "
                    f"{runs[0]['output_tokens']:.0f} | {_ms(measured)} | {_ms(pred)} | "
                    f"{_pct(pred / measured - 1)} |")
    return rows


def _md_front(cal: dict[str, Any]) -> list[str]:
    """The front end's fit: each load shape measured vs fitted, the costs with standard
    errors, the first-token check and the share."""
    front = cal.get("front_end")
    if not front:  # a JSON from before the front end was fitted
        fe = [p["front_end_s"] for p in cal["prefill"] if p.get("front_end_s") is not None]
        return ([f"Front end (TTFT minus prefill step, not fitted by that run): median "
                 f"{statistics.median(fe) * 1e3:.1f} ms over the prefill probes."] if fe
                else [])
    fit, share, check = front.get("fit"), front.get("share"), front.get("first_token")
    lines = ["**Front end** (vLLM's API server; autotune.sim.calibrate.fit_front_end on "
             "the API server's CPU in calibration runs only):"]
    if fit:
        lines += ["", f"frontend_request_ms {fit['frontend_request_ms']:.3g} ± "
                  f"{_se(fit['frontend_request_ms_se'])}, frontend_token_us "
                  f"{fit['frontend_token_us']:.3g} ± {_se(fit['frontend_token_us_se'])} "
                  f"(standard errors, {_dof(fit['dof'])}).", "",
                  "| load shape | runs | requests | output tokens | measured API CPU ms "
                  "(median) | fitted ms | error |", "|---|---|---|---|---|---|---|",
                  *_fit_rows(fit)]
    if check:
        lines += ["", f"First token on the idle server: TTFT less the prefill step "
                  f"{check['measured_s'] * 1e3:.2f} ms (median over {check['probes']} "
                  f"probes) against {check['model_s'] * 1e3:.2f} ms of front-end CPU in the "
                  f"profile (one request + one token): {check['unmodelled_s'] * 1e3:+.2f} ms "
                  "of the first token's path (IPC, HTTP) is not in the simulator's TTFT."]
    if share:
        lines += ["", f"frontend_engine_share {share['share']:.3g} ± {_se(share['se'])} "
                  f"(unclipped {share['unclipped']:.3g}): the engine's run-queue wait in "
                  f"{share['runs']} decode runs, {share['wait_s']:.3g} s in all, = background "
                  f"{share['background']:.3g} ± {_se(share['background_se'])} s per wall "
                  f"second ({share['wall_s']:.3g} s) + share x API-server CPU "
                  f"({share['api_cpu_s']:.3g} s); {_dof(share['dof'])}; "
                  + ("used." if _used_share(front) else "NOT used (see below).")]
    lines += [f"- {n}" for n in front.get("notes") or []]
    return lines


def _met_cell(r: dict[str, Any]) -> str:
    """'tput yes, P99 E2E NO (drift larger), ...': every target by name."""
    met, drift = targets_met(r["error"]), drift_over_errors(r)
    return ", ".join(f"{TARGET_NAMES[n]} " + ("yes" if met[n] else "NO")
                     + (" (drift larger)" if n in drift else "") for n in TARGETS)


def _md_validation(data: dict[str, Any]) -> list[str]:
    knee, val = data["knee"], data["validation"]
    lines = [
        f"**Validation** ({val['num_prompts']} requests a rate + {val['warmup']} warm-up, "
        f"{val['workload']}; {val['arrival']}; flags {val['flags']}). Knee (fitted "
        f"simulator's saturation): {knee['request_rate']:.2f} req/s, "
        f"{knee['output_tok_s']:.0f} output tok/s. Real = measured on vLLM, sim = "
        "simulated in virtual time.", "",
        "| rate req/s | × knee | real tok/s | sim tok/s | error | real P99 E2E s | "
        "sim P99 E2E s | error | real P99 TTFT ms | sim P99 TTFT ms | error | targets met | "
        "engine ms per decode token, real / sim | machine step time vs calibration |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rates"]:
        real, sim, err = r["real"], r["sim"], r["error"]
        lines.append(
            f"| {r['rate_req_s']:.2f} | {r['fraction_of_knee']:.2f} | "
            f"{real['output_throughput']:.0f} | {sim['output_throughput']:.0f} | "
            f"{_pct(err['output_throughput'])} | {real['e2e_p99_s']:.3f} | "
            f"{sim['e2e_p99_s']:.3f} | {_pct(err['e2e_p99'])} | {_ms(real['ttft_p99_s'])} | "
            f"{_ms(sim['ttft_p99_s'])} | {_pct(err.get('ttft_p99'))} | {_met_cell(r)} | "
            f"{_ms(real.get('engine_s_per_decode_token'))} / "
            f"{_ms(sim.get('engine_s_per_decode_token'))} | "
            f"{_ratio(r.get('reference_vs_calibration'))} |")
    silent = [r["real"].get("silent_token_share") for r in data["rates"]]
    if any(x is not None for x in silent):
        lines += ["", "Real output tokens that sent no text (a first token among them makes "
                  "the client's TTFT count from a later token; the simulator's tokens all "
                  "arrive): "
                  + ", ".join(f"{_share(x)} at {r['rate_req_s']:.2f} req/s"
                              for x, r in zip(silent, data["rates"], strict=True)) + "."]
    bad = sum(r["real"].get("prompt_token_mismatches") or 0 for r in data["rates"])
    if bad:
        lines += ["", f"**Warning:** {bad} real request(s) had another prompt length on the "
                  "server than the simulator was given."]
    ref = data.get("reference")
    if ref:
        lines += ["", "Engine ms per decode token: vLLM's request_decode_time_seconds over "
                  "the test's decode tokens, against the same figure of the simulated "
                  "records (front end's share included): whether the engine itself ran "
                  "slower or faster than the calibrated model. "
                  f"Last column: {ref['how']} (reference: {ref['shape']}, "
                  f"{ref['calibration_step_s'] * 1e3:.2f} ms per step in the calibration); "
                  "'(drift larger)': the target was missed by less than that drift."]
    return lines


def _md_speed(data: dict[str, Any]) -> list[str]:
    lines = ["**Speed and CPU** (same load tests): the real server's wall seconds against "
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
    return lines


def capacity_gap(data: Mapping[str, Any]) -> dict[str, float] | None:
    """Where the misses above the knee come from: the fitted simulator's saturation
    against the most the real server served (over the rates), in output tok/s, and the
    range of the simulated over the real engine time per decode token."""
    rates = data.get("rates") or []
    if not rates or not data.get("knee"):
        return None
    real_max = max(r["real"]["output_throughput"] for r in rates)
    per_token = [r["sim"]["engine_s_per_decode_token"] / r["real"]["engine_s_per_decode_token"]
                 for r in rates if r["real"].get("engine_s_per_decode_token")]
    return {"sim_knee_tok_s": data["knee"]["output_tok_s"], "real_max_tok_s": real_max,
            "gap": real_max / data["knee"]["output_tok_s"] - 1,
            "per_token_min": min(per_token, default=math.nan) - 1,
            "per_token_max": max(per_token, default=math.nan) - 1}


def capacity_lines(data: Mapping[str, Any]) -> list[str]:
    g = capacity_gap(data)
    if g is None:
        return []
    return ["", f"Where the misses come from (this run's figures): the fitted simulator "
            f"saturates at {g['sim_knee_tok_s']:,.0f} output tok/s, the real server served up "
            f"to {g['real_max_tok_s']:,.0f} ({g['gap']:+.1%}); its engine spent "
            f"{g['per_token_min']:+.1%} to {g['per_token_max']:+.1%} per decode token over "
            "vLLM's request_decode_time. So the rates above the knee overload the simulator "
            "by more than they overload the server, and a queue grows with the excess of "
            "arrivals over capacity: near the knee a few percent of capacity become tens of "
            "percent of P99. The simulator's per-token costs come from the calibration's "
            "shapes (equal decode batches, lone prefills on the idle engine); under this "
            "mixed load they overstate the engine's cost by the range above."]


def markdown(data: dict[str, Any]) -> list[str]:
    """The JSON as Markdown for benchmarks/RESULTS.md (every figure from ``data``)."""
    if data.get("skipped"):
        return [f"Skipped ({data.get('label', 'tiny')}): {data.get('reason')}", ""]
    cal, m = data["calibration"], data["machine"]
    lines = [
        f"Model: {data.get('label', 'tiny')} ({data['model']['path']}, "
        f"{data['model']['params'] / 1e6:.1f} M parameters, {data['model']['dtype']}).", "",
        "How: " + " ".join(data.get("how", HOW)), "",
        f"Machine: {m['cpu_model']}, {m['load_at_start']['nproc']} cores, load average "
        f"{m['load_at_start']['loadavg_1_5_15']} at start and "
        f"{m['load_at_end']['loadavg_1_5_15']} at end (shared machine; other processes "
        f"busy at start: {_busy(m['load_at_start'])}; at end: {_busy(m['load_at_end'])}; "
        f"during the calibration: nice / steal {_others(cal.get('machine_cpu_pct'))} % of "
        "the CPU). Server start "
        f"{data['server'].get('startup_s', float('nan')):.0f} s; calibration "
        f"{cal['wall_s']:.0f} s; whole run {data['total_wall_s']:.0f} s.", "",
    ]
    lines += _md_fit(data) + [""] + _md_front(cal) + [""]
    lines += _md_validation(data) + [""] + _md_speed(data) + capacity_lines(data)
    h = data.get("headline") or {}
    if h:
        lines += ["", headline_line(headline(data))]
    lines += [f"- {n}" for n in data.get("notes", [])]
    if data.get("smoke"):
        lines += ["", "_Smoke sizes: these figures only show that the benchmark runs._"]
    return lines + [""]


if __name__ == "__main__":
    raise SystemExit(main())
