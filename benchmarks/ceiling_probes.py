"""Probes and server time of the steady-state ceiling search vs auto_tune.sh's 1 req/s step-down.

For several simulated configs (virtual time; every figure here is **simulated**):

1. the true steady-state ceiling: bisection on the rate to 1% with long fixed-count
   load tests (``TRUTH_N`` measured requests, no stop rule), passing when every limit's
   P99 point estimate holds and completions keep up with >= 97% of arrivals over the
   second half (``benchmarks.search_scenarios.truth_passes``);
2. ``find_ceiling`` with ``BackendProbe(steady=SteadyState())`` (each probe sized by
   time and stopped when its verdict is certain) from its default start (one
   saturation probe, then 70% of it): probes, virtual server time, the ceiling found,
   its recommended cap (10% under) and both against the truth;
3. the step-down as auto_tune.sh runs it, on the same steady-state probe: one load test
   at rate inf, then int(throughput) + 1, down by 1 req/s to the first rate that passes
   (and the same walk started at 1.5x the true ceiling, for a fairer probe count).

Usage: ``python benchmarks/ceiling_probes.py [--smoke] [--output FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.backends.base import LoadPlan
from autotune.backends.sim import SimBackend
from autotune.core.slo import SLO, parse_slo  # noqa: E402
from autotune.tuning.ceiling import BackendProbe, ProbeResult, find_ceiling  # noqa: E402
from autotune.tuning.trial import evaluate  # noqa: E402
from autotune.tuning.verdict import PASS, SteadyState  # noqa: E402
from autotune.workload.sources import Request  # noqa: E402
from benchmarks.results import fmt, table  # noqa: E402
from benchmarks.search_scenarios import truth_passes  # noqa: E402

N = 300  # measured requests of the saturation probe (the steady probes size by time)
WARMUP = 30
TRUTH_N = 6000  # measured requests per truth test
TRUTH_TOL = 0.01
# (hardware, model, flags, SLO)
CONFIGS: list[tuple[str, str, dict[str, Any], str]] = [
    ("1xa100-80gb", "llama-3-8b", {"max_num_seqs": 32}, "4s"),
    ("1xa100-80gb", "llama-3-8b", {"max_num_seqs": 128}, "6s"),
    ("1xa100-80gb", "llama-3-8b", {"max_num_seqs": 16}, "p99:e2e<=5s,p99:ttft<=1s"),
    ("1xh100-80gb", "llama-3-8b", {"max_num_seqs": 64}, "3s"),
    ("2xa100-80gb", "llama-3-8b", {"max_num_seqs": 64, "tensor_parallel_size": 2}, "4s"),
]


def pool(n: int = 400, seed: int = 0) -> list[Request]:
    """Token counts only (the simulator needs nothing else): prompts 32-511, replies
    16-255 tokens, uniform."""
    rng = np.random.default_rng(seed)
    return [Request("x", int(p), int(o))
            for p, o in zip(rng.integers(32, 512, n), rng.integers(16, 256, n), strict=True)]


class Counter:
    """Wraps a probe: counts load tests and their virtual server seconds."""

    def __init__(self, probe: BackendProbe) -> None:
        self.probe = probe
        self.calls = 0
        self.server_s = 0.0

    def __call__(self, rate: float, n: int, *, repeat: int = 0) -> ProbeResult:
        res = self.probe(rate, n, repeat=repeat)
        self.calls += 1
        self.server_s += res.server_s or 0.0
        return res

    def passes(self, rate: float) -> bool:
        res = self(rate, N)
        return res.evidence is not None and res.evidence.verdict == PASS


def true_ceiling(hw: str, model: str, flags: dict[str, Any], slo: SLO, requests: list[Request],
                 sat: float, truth_n: int) -> tuple[float, float, int]:
    """(last pass, first fail, tests) of the long fixed-count truth, by bisection."""
    backend = SimBackend(hw, model)
    tests = 0

    def ok(rate: float) -> bool:
        nonlocal tests
        tests += 1
        reqs = [requests[(WARMUP + i) % len(requests)] for i in range(truth_n)]
        plan = LoadPlan(slo=slo, requests=reqs, warmup_requests=requests[:WARMUP],
                        warmup=WARMUP, seed=0)
        res = evaluate(backend, flags, rate, plan)
        return res.summary is not None and truth_passes(res.records, slo, rate)[0]

    lo, hi = 0.5 * sat, 1.05 * sat
    while ok(hi):
        lo, hi = hi, 1.5 * hi
    while not ok(lo):
        hi, lo = lo, lo / 2
    while hi / lo - 1.0 > TRUTH_TOL:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, hi, tests


def stepdown_from(c: Counter, start: int) -> float | None:
    """auto_tune.sh's walk: ``start``, then down by 1 req/s to the first pass."""
    for rate in range(start, 0, -1):
        if c.passes(float(rate)):
            return float(rate)
    return None


def one(hw: str, model: str, flags: dict[str, Any], slo_text: str, truth_n: int
        ) -> dict[str, Any]:
    slo = parse_slo(slo_text)
    requests = pool()

    def fresh() -> Counter:
        return Counter(BackendProbe(SimBackend(hw, model), flags, slo, requests,
                                    warmup=WARMUP, steady=SteadyState()))

    t0 = time.perf_counter()
    sat = fresh()(math.inf, N).summary.request_throughput
    last_pass, first_fail, tests = true_ceiling(hw, model, flags, slo, requests, sat, truth_n)
    truth_wall = time.perf_counter() - t0

    ours = fresh()
    res = find_ceiling(ours, slo=slo, start_rate=None, num_prompts=N, max_num_prompts=2400)
    found, cap = res.feasible_max, res.recommended_cap
    steps = fresh()
    steps_sat = steps(math.inf, N).summary.request_throughput
    sd_rate = stepdown_from(steps, int(steps_sat) + 1)
    above = fresh()
    start = int(1.5 * last_pass) + 1
    above_rate = stepdown_from(above, start)

    def below(r: float | None) -> float | None:
        return None if r is None else 1 - r / last_pass

    return {
        "config": {"hardware": hw, "model": model, "flags": flags, "slo": str(slo)},
        "truth": {"last_pass": last_pass, "first_fail": first_fail, "tests": tests,
                  "requests_per_test": truth_n, "wall_s": truth_wall,
                  "saturated_throughput": sat},
        "ceiling": {
            "probes": ours.calls, "server_s": ours.server_s, "feasible_max": found,
            "recommended_cap": cap, "infeasible_min": res.infeasible_min,
            "converged": res.converged, "below_truth": below(found),
            "cap_never_above": cap is not None and cap <= last_pass * (1 + 1e-9),
            "within_5pct_below": found is not None and 0.95 * last_pass <= found
            <= first_fail * (1 + 1e-9),
            "answer": res.sentence()},
        "stepdown": {
            "probes": steps.calls, "server_s": steps.server_s, "rate": sd_rate,
            "start": int(steps_sat) + 1, "below_truth": below(sd_rate),
            "within_5pct_below": sd_rate is not None and 0.95 * last_pass <= sd_rate
            <= first_fail},
        "stepdown_from_above": {
            "start": start, "probes": above.calls, "server_s": above.server_s,
            "rate": above_rate, "below_truth": below(above_rate),
            "within_5pct_below": above_rate is not None and 0.95 * last_pass <= above_rate
            <= first_fail},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one config, short truth tests")
    ap.add_argument("--output", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args(argv)
    configs = CONFIGS[:1] if args.smoke else CONFIGS
    truth_n = 1500 if args.smoke else TRUTH_N
    rows = []
    t0 = time.perf_counter()
    for hw, model, flags, slo in configs:
        row = one(hw, model, flags, slo, truth_n)
        rows.append(row)
        t, c, s = row["truth"], row["ceiling"], row["stepdown_from_above"]
        print(f"{hw} {model} {flags} SLO {slo}: true ceiling {t['last_pass']:.2f} "
              f"(fails at {t['first_fail']:.2f}) | ceiling: {c['probes']} probes, "
              f"{c['server_s']:.0f} s, found {c['feasible_max']}, cap {c['recommended_cap']} "
              f"| step-down from {s['start']}: {s['probes']} probes, {s['server_s']:.0f} s, "
              f"ends at {s['rate']} [simulated, virtual seconds]", file=sys.stderr, flush=True)
    data = {"how": ("simulated (virtual time); find_ceiling's probes are steady-state load "
                    "tests (SteadyState() defaults: arrivals >= max(60 s, 6x the largest "
                    f"limit), stopped when the verdict is certain) after {WARMUP} warm-up "
                    "requests; the step-downs use the same probe; truth: bisection to "
                    f"{TRUTH_TOL:.0%} with {truth_n:,}-request fixed-count tests (P99 point "
                    "estimates and >= 97% served over the second half); server time = "
                    "virtual seconds from the first warm-up send to the last end"),
            "rows": rows, "total_wall_s": time.perf_counter() - t0}
    text = json.dumps(data, indent=2, default=float)
    if args.output is not None:
        args.output.write_text(text + "\n")
    else:
        print(text)
    return 0


def markdown(d: dict[str, Any]) -> list[str]:
    """This benchmark's section of benchmarks/RESULTS.md."""
    out = [f"How: {d['how']}. 'step-down' is auto_tune.sh's walk (saturation probe at rate "
           "inf, then int(throughput) + 1 down by 1 req/s); 'from above' starts the same "
           "walk at 1.5x the true ceiling, for a fairer probe count.", ""]
    rows = []
    for r in d["rows"]:
        c, t = r["config"], r["truth"]
        name = f"{c['hardware']} {c['model']} {c['flags']} SLO {c['slo']}"
        for method in ("ceiling", "stepdown", "stepdown_from_above"):
            m = r[method]
            found = m.get("feasible_max", m.get("rate"))
            below = m.get("below_truth")
            rows.append([name, method, f"{fmt(t['last_pass'])} [{fmt(t['first_fail'])}]",
                         m["probes"], m["server_s"], found, m.get("recommended_cap", ""),
                         "" if below is None else f"{below:.1%}",
                         m["within_5pct_below"], m.get("cap_never_above", "")])
    out += table(["config", "method", "true ceiling [first fail]", "probes", "server s",
                  "rate found", "cap", "below truth", "within 5% below", "cap <= truth"],
                 rows)
    ours = [r["ceiling"] for r in d["rows"]]
    walk = [r["stepdown_from_above"] for r in d["rows"]]
    if ours:
        med = statistics.median
        within = sum(bool(m["within_5pct_below"]) for m in ours)
        safe = sum(bool(m["cap_never_above"]) for m in ours)
        walk_within = sum(bool(m["within_5pct_below"]) for m in walk)
        ratio = med(m["server_s"] for m in ours) / med(m["server_s"] for m in walk)
        out += ["", f"**Headline (same run): the steady-state ceiling search's cap was never "
                f"above the true ceiling in {safe}/{len(ours)} configs and its ceiling was "
                f"within 5% below the truth in {within}/{len(ours)}, with a median "
                f"{fmt(med(m['probes'] for m in ours))} probes, {fmt(ratio)}x the server "
                f"time of the 1 req/s step-down from above ({walk_within}/{len(walk)} "
                f"within 5%, median {fmt(med(m['probes'] for m in walk))} probes)** "
                "(simulated, virtual seconds)."]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
