"""How fast the simulator runs a load test in virtual time (CPU time of this process).

    python benchmarks/sim_speed.py [--smoke] [--num-prompts 2000] [--rate 10 ...]

Workload: ShareGPT sampled as vLLM samples it (``autotune.workload.load_sharegpt``,
tekken tokenizer offline) when it loads, else lognormal lengths with ShareGPT's means
(prompt ~110, output ~277 tokens); the output says which.  Engine: Llama-3-8B on one
A100-80GB profile, vLLM defaults.  Prints one JSON object; the engine figures inside
are simulated, the speed figures are measured CPU time of this process.
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

from autotune.arrivals import arrival_offsets  # noqa: E402
from autotune.sim import EngineConfig, simulate  # noqa: E402
from autotune.workload import Request  # noqa: E402
from benchmarks.results import fmt, table  # noqa: E402


def lognormal_workload(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)

    def draw(mean: float, sigma: float) -> np.ndarray:
        return np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n), 4, 4000)

    prompts, outputs = draw(110, 1.2), draw(277, 0.9)
    return [Request("", int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


def workload(n: int) -> tuple[list[Request], str]:
    try:
        from autotune.tokenizer import load_tokenizer
        from autotune.workload import load_sharegpt

        wl = load_sharegpt(tokenizer=load_tokenizer(), num_prompts=n, seed=0)
        if len(wl.requests) >= n:
            return wl.requests[:n], f"{wl.source}, tokens counted by {wl.tokenizer}"
        reason = f"only {len(wl.requests)} ShareGPT requests"
    except Exception as exc:  # any failure: fall back, and say so
        reason = f"ShareGPT not loadable ({type(exc).__name__}: {exc})"
    return lognormal_workload(n), f"lognormal (prompt mean 110, output mean 277); {reason}"


def bench(requests: list[Request], rate: float, repeat: int) -> dict[str, Any]:
    arr = arrival_offsets(len(requests), rate, seed=1)
    best = float("inf")
    result = None
    for _ in range(repeat):
        t0 = time.process_time()
        result = simulate(EngineConfig("llama-3-8b"), "a100-80gb", None, requests, arr)
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
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="200 requests, one rate (for CI)")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--rate", type=float, nargs="+", default=[2.0, 10.0, 30.0, 100.0])
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    n = 200 if a.smoke else a.num_prompts
    rates = [10.0] if a.smoke else a.rate
    requests, source = workload(n)
    out = {
        "what": "CPU time to simulate one load test of Llama-3-8B on one A100-80GB profile "
                "in virtual time (best of --repeat); engine figures are simulated",
        "num_prompts": n,
        "workload": source,
        "mean_prompt_tokens": round(float(np.mean([r.prompt_tokens for r in requests])), 1),
        "mean_output_tokens": round(float(np.mean([r.output_tokens for r in requests])), 1),
        "runs": [bench(requests, r, 1 if a.smoke else a.repeat) for r in rates],
    }
    print(json.dumps(out, indent=2))


def markdown(d: dict[str, Any]) -> list[str]:
    """This benchmark's section of benchmarks/RESULTS.md."""
    out = [f"{d['what']}. {d['num_prompts']} requests; workload {d['workload']} (mean "
           f"prompt {d['mean_prompt_tokens']}, mean output {d['mean_output_tokens']} "
           "tokens). CPU time is measured; everything about the engine is simulated.", ""]
    runs = d["runs"]
    out += table(["offered req/s", "CPU s", "simulated requests / CPU s",
                  "simulated s / CPU s", "simulated duration s", "simulated output tok/s",
                  "steps", "preemptions"],
                 [[r["rate_req_s"], r["cpu_s"], r["requests_per_cpu_s"],
                   r["simulated_s_per_cpu_s"], r["simulated_duration_s"],
                   r["simulated_output_tok_s"], r["simulated_steps"],
                   r["simulated_preemptions"]] for r in runs])
    if runs:
        worst = max(runs, key=lambda r: r["cpu_s"])
        out += ["", f"**Headline (same run): a {d['num_prompts']}-request load test "
                f"simulates in at most {fmt(worst['cpu_s'])} CPU s (at "
                f"{fmt(worst['rate_req_s'])} req/s), "
                f"{fmt(min(r['simulated_s_per_cpu_s'] for r in runs))}x to "
                f"{fmt(max(r['simulated_s_per_cpu_s'] for r in runs))}x faster than real "
                "time**."]
    return out


if __name__ == "__main__":
    main()
