"""Is the verdict's clustering correction the truth?  The estimate that a test makes
from its own requests, against the variance inflation of the count over a limit seen
across many independent runs, on the scenario suite's best configs.

    python benchmarks/clustering_truth.py [--smoke] [--output FILE] [--seeds 40]

For each scenario of ``search_scenarios`` (its truth cached in
``results/search_scenarios_truth.json``), the best config runs ``--seeds`` (40) fixed-count
tests on the simulator at 64% and 90% of its true ceiling (64%: the median cap of the
suite; 90%: a cap with the 10% headroom), each with its own draw of ShareGPT (or
synthetic) requests from a pool of 12,000 and its own arrival seed, and at least
``--requests`` judged requests (and twice the verdict's minimum duration of arrivals) in
arrival order.  Per limit, over the first three quarters of each run (the last drains
it):

* **estimated**: the clustering the verdict divides its evidence by
  (``autotune.tuning.sequential.clustering`` at the limit), median over the runs;
* **true**: at the levels that 1% and 0.5% of all runs' requests exceed, the variance
  of the per-run exceedance count over its binomial variance (what the estimate is
  meant to be), with its relative standard error sqrt(2 / (runs - 1)).

An estimate under the truth would let a clustered tail pass too easily; one far over it
costs requests.  (Pure simulation, virtual time; no server.)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.search_scenarios as sc_mod  # noqa: E402
from autotune.backends.base import LoadPlan
from autotune.backends.sim import SimBackend
from autotune.core.slo import parse_slo  # noqa: E402
from autotune.tuning.ceiling import search_looks  # noqa: E402
from autotune.tuning.sequential import (  # noqa: E402
    PASS,
    Clustered,
    ExceedanceTest,
    clustering,
    dispersion,
    judge_series,
    local_clustering,
)
from autotune.tuning.trial import evaluate  # noqa: E402
from autotune.tuning.verdict import SteadyState, _Arrays, _limit_values, horizon  # noqa: E402
from benchmarks.results import emit, table  # noqa: E402

HERE = Path(__file__).resolve().parent
TRUTH = HERE / "results" / "search_scenarios_truth.json"
HEADLINE = "**Headline (same run):"
LOADS = (0.64, 0.9, 1.0)
LOOK = 200  # judged requests between two looks (the verdict's 5 s at 40 req/s)
LEVELS = (0.01, 0.005)  # the shares of requests over the levels the truth is read at
WARMUP = 100
POOL = 12000  # requests sampled per scenario; each run draws its own from them


@functools.cache
def _best(name: str) -> dict[str, Any]:
    """The scenario's best config and its true ceiling, read once per process."""
    t = json.loads(TRUTH.read_text())[name]
    return next(c for c in t["configs"] if c["key"] == t["best_config"])


@functools.lru_cache(maxsize=2)
def _world(name: str, size: int) -> Any:
    sc = next(s for s in sc_mod.ALL_SCENARIOS if s.name == name)
    return sc_mod.make_world(sc_mod.Sizes(pool=size), [sc])


def _run(task: tuple[str, float, int, int]) -> dict[str, Any]:
    """One fixed-count test; the limits' latencies in arrival order."""
    name, load, seed, n = task
    sc = next(s for s in sc_mod.ALL_SCENARIOS if s.name == name)
    world = _world(name, POOL)
    pool = world.pools[name]
    best = _best(name)
    slo = parse_slo(sc.slo)
    rate = best["ceiling"] * load
    # A verdict passes only after its minimum duration of arrivals: a run lasts twice
    # that (at least ``n`` requests), and a pass before it is not allowed.
    min_n = math.ceil(rate * SteadyState().min_s(slo))
    # A warm-up as long as the SLO's horizon: the requests of its first seconds.
    settle = math.ceil(rate * horizon(slo))
    n = max(n, 2 * min_n + settle)
    # Each run its own draw from the pool (ShareGPT holds about 15,000 usable pairs):
    # requests independent between runs, as a test's fresh requests are.
    pick = np.random.default_rng(1000 + seed).choice(len(pool) - WARMUP, n,
                                                     replace=n > len(pool) - WARMUP)
    reqs = [pool[WARMUP + int(i)] for i in pick]
    plan = LoadPlan(slo=slo, requests=reqs, warmup_requests=pool[:WARMUP], warmup=WARMUP,
                    seed=seed)
    res = evaluate(SimBackend(sc.hardware, sc.model), world.spaces[name].server_flags(
        best["params"]), rate, plan)
    a = _Arrays.of([r for r in res.records if not r.warmup])
    idx = np.argsort(a.sched, kind="stable")
    limits = {}
    for lim in slo.limits:
        hi, _ = _limit_values(a, idx, lim, math.inf)
        limits[lim.label] = {"threshold_s": lim.threshold_s, "values": hi.tolist()}
    return {"name": name, "load": load, "seed": seed, "limits": limits, "min_n": min_n}


def rows_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["name"], r["load"]) for r in runs})
    for name, load in keys:
        mine = [r for r in runs if r["name"] == name and r["load"] == load and r["limits"]]
        if len(mine) < 3:
            continue
        for label in mine[0]["limits"]:
            thr = mine[0]["limits"][label]["threshold_s"]
            # The first three quarters: the last drains a fixed-count run (a trend no
            # test sized by time judges, which an estimate would read as clustering).
            m = 3 * min(len(r["limits"][label]["values"]) for r in mine) // 4
            x = np.array([r["limits"][label]["values"][:m] for r in mine])
            finite = x[np.isfinite(x)]
            row: dict[str, Any] = {
                "scenario": name, "load": load, "limit": label, "runs": len(mine),
                "requests": m, "over_limit": float(np.mean(x > thr)),
                "estimated": float(np.median([clustering(v, thr) for v in x])),
                "estimated_local": float(np.median([local_clustering(v, thr) for v in x])),
                "rel_se": math.sqrt(2.0 / (len(mine) - 1))}
            for p in LEVELS:
                level = float(np.quantile(finite, 1.0 - p))
                k = (x > level).sum(axis=1)
                share = k.sum() / k.size / m
                binom = m * share * (1.0 - share)
                row[f"true_{p:g}"] = float(k.var(ddof=1) / binom) if binom > 0 else None
                row[f"estimated_at_{p:g}"] = float(np.median([dispersion(v > level)
                                                              for v in x]))
            out.append(row)
    return out


def false_passes(runs: list[dict[str, Any]], pool: Any) -> list[dict[str, Any]]:
    """P(pass) with each limit moved to where exactly the allowance (1%) of all runs'
    requests exceed it: as one test, as a pass inside a ceiling search (the proof's 5%
    shared by ``search_looks(8)``), with the clustering over short batches only (the
    verdict's before this benchmark), and without the correction; and P(pass) within
    the run at half the allowance, with its median requests (what the safety costs).
    One cell per worker."""
    cells = []
    for name, load in sorted({(r["name"], r["load"]) for r in runs}):
        mine = [r for r in runs if r["name"] == name and r["load"] == load and r["limits"]]
        if len(mine) >= 3:
            cells += [(name, load, label, [r["limits"][label]["values"] for r in mine],
                       [r["min_n"] for r in mine]) for label in mine[0]["limits"]]
    return list(pool.map(_false_pass_row, cells))


def _false_pass_row(cell: tuple[str, float, str, list[list[float]], list[int]]
                    ) -> dict[str, Any]:
    name, load, label, values, min_ns = cell
    one = ExceedanceTest.for_percentile(99.0)
    in_search = ExceedanceTest(allowance=0.01, false_pass=0.05 / search_looks(8))
    x = [np.asarray(v, dtype=float) for v in values]
    # The steady state: the middle half of every run, away from its start (the queue
    # still filling) and its end (the drain of a fixed-count run).
    pooled = np.concatenate([v[v.size // 4: 3 * v.size // 4] for v in x])
    pooled = pooled[np.isfinite(pooled)]
    limit = float(np.quantile(pooled, 0.99))
    row: dict[str, Any] = {"scenario": name, "load": load, "limit": label,
                           "limit_s": limit, "runs": len(x)}
    cases: tuple[tuple[str, ExceedanceTest, Clustered], ...] = (
        ("one_test", one, "whole"), ("in_a_search", in_search, "whole"),
        ("local", one, "local"), ("uncorrected", one, "none"))
    for key, test, clustered in cases:
        row[key] = sum(judge_series(test, v, limit, look=LOOK, clustered=clustered,
                                    min_pass_n=m)[0] == PASS
                       for v, m in zip(x, min_ns, strict=True)) / len(x)
    # What the safety costs: passes within the run at half the allowance.
    half = float(np.quantile(pooled, 0.995))
    powers: tuple[tuple[str, Clustered], ...] = (("power", "whole"), ("power_local", "local"))
    for key, clustered in powers:
        got = [judge_series(one, v, half, look=LOOK, clustered=clustered, min_pass_n=m)
               for v, m in zip(x, min_ns, strict=True)]
        passed = [n for g, n in got if g == PASS]
        row[key] = len(passed) / len(x)
        row[f"{key}_median_n"] = float(np.median(passed)) if passed else None
    return row


def _verdict_test(task: tuple[str, float, int, str, float]) -> str:
    """One load test sized by time and judged by the verdict itself (its stop rule,
    served-rate and backlog checks included) against a single limit at ``limit_s``."""
    name, load, seed, label, limit_s = task
    sc = next(s for s in sc_mod.ALL_SCENARIOS if s.name == name)
    world = _world(name, POOL)
    pool = world.pools[name]
    best = _best(name)
    pick = np.random.default_rng(5000 + seed).permutation(len(pool) - WARMUP)
    slo = parse_slo(f"p99:{label.split(':')[1]}<={limit_s * 1000:.3f}ms")
    plan = LoadPlan(slo=slo, requests=[pool[WARMUP + int(i)] for i in pick],
                    warmup_requests=pool[:WARMUP], warmup=WARMUP, seed=5000 + seed,
                    steady=SteadyState())
    res = evaluate(SimBackend(sc.hardware, sc.model), world.spaces[name].server_flags(
        best["params"]), best["ceiling"] * load, plan)
    return res.evidence.verdict if res.evidence is not None else "refused"


def verdict_passes(cells: list[dict[str, Any]], seeds: int, pool: Any
                   ) -> list[dict[str, Any]]:
    """P(pass) of whole load tests (autotune's verdict, one test) with the limit at the
    steady-state allowance, for the cells at 90% of the ceiling and above."""
    todo = [c for c in cells if c["load"] >= 0.9]
    tasks = [(c["scenario"], c["load"], seed, c["limit"], c["limit_s"]) for c in todo
             for seed in range(seeds)]
    got = pool.map(_verdict_test, tasks)
    out = []
    for i, c in enumerate(todo):
        mine = got[i * seeds:(i + 1) * seeds]
        out.append({**{k: c[k] for k in ("scenario", "load", "limit", "limit_s")},
                    "tests": seeds, "passed": mine.count("pass"),
                    "failed": mine.count("fail"), "inconclusive": mine.count("inconclusive")})
    return out


def run(smoke: bool, seeds: int, requests: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    truth = json.loads(TRUTH.read_text())
    names = [s.name for s in sc_mod.ALL_SCENARIOS if s.name in truth]
    if smoke:
        names, seeds, requests = names[:1], 4, 1000
    tasks = [(name, load, seed, requests) for name in names for load in LOADS
             for seed in range(seeds)]
    with multiprocessing.Pool(2) as pool:
        runs = pool.map(_run, tasks)
        fp = false_passes(runs, pool)
        whole = verdict_passes(fp, seeds, pool)
    how = " ".join(__doc__.split("\n\n")[2:4]).replace("\n", " ")
    return {"verdict_tests": whole, "how": how, "seeds": seeds,
            "requests": requests, "loads": list(LOADS), "rows": rows_of(runs),
            "false_passes": fp,
            "smoke": smoke, "total_wall_s": time.perf_counter() - t0}


def _power(row: dict[str, Any], key: str) -> str:
    n = row.get(f"{key}_median_n")
    return f"{row[key]:.2f} ({n:,.0f})" if n is not None else f"{row[key]:.2f}"


def markdown(d: dict[str, Any]) -> list[str]:
    lines = [d["how"], ""]
    lines += table(
        ["scenario", "load", "limit", "runs × requests", "over the limit",
         "estimated (as the verdict)", "over short batches only (before)", "true at 1%",
         "true at 0.5%"],
        [[r["scenario"], f"{r['load']:.0%}", r["limit"], f"{r['runs']} × {r['requests']:,}",
          f"{r['over_limit']:.2%}", f"{r['estimated']:.1f}",
          f"{r.get('estimated_local', float('nan')):.1f}",
          "-" if r["true_0.01"] is None else f"{r['true_0.01']:.1f}",
          "-" if r["true_0.005"] is None else f"{r['true_0.005']:.1f}"]
         for r in d["rows"]])
    fp = d.get("false_passes", [])
    if fp:
        lines += ["", "**False passes at the allowance**: each limit moved to where exactly "
                  "1% of the runs' steady-state requests exceed it (the middle half of each "
                  "run: its start fills the queue, its end drains it), the verdict's "
                  f"sequential test on each run (a look every {LOOK} requests, the "
                  "clustering estimated as the verdict does, no pass before the minimum "
                  "duration of arrivals, as the verdict; each run twice that long, at "
                  "least 3,000 requests); P(pass) within the run. The contract is at "
                  "most 5%.", ""]
        lines += table(["scenario", "load", "limit", "moved to", "runs", "one test",
                        "in a ceiling search", "short batches only (before)",
                        "without the correction", "P(pass) at half (requests)",
                        "before: P(pass) at half (requests)"],
                       [[r["scenario"], f"{r['load']:.0%}", r["limit"], f"{r['limit_s']:.3g} s",
                         str(r["runs"]), f"{r['one_test']:.3f}", f"{r['in_a_search']:.3f}",
                         f"{r['local']:.3f}", f"{r['uncorrected']:.3f}",
                         _power(r, "power"), _power(r, "power_local")]
                        for r in fp])
    vt = d.get("verdict_tests", [])
    if vt:
        lines += ["", "**Whole load tests at the allowance** (autotune's verdict itself: sized "
                  "by time, its stop rule, served-rate and backlog checks; one limit at the "
                  "steady-state level above; fresh requests and arrivals per test):", ""]
        lines += table(["scenario", "load", "limit", "at", "tests", "pass", "fail",
                        "inconclusive"],
                       [[r["scenario"], f"{r['load']:.0%}", r["limit"], f"{r['limit_s']:.3g} s",
                         str(r["tests"]), str(r["passed"]), str(r["failed"]),
                         str(r["inconclusive"])] for r in vt])
    se = d["rows"][0]["rel_se"] if d["rows"] else float("nan")
    ratios = sorted(r["estimated"] / r["true_0.01"] for r in d["rows"] if r["true_0.01"])
    lines += ["", f"The true values are estimates too: relative standard error about "
              f"{se:.0%} with these runs."]
    if ratios and fp:
        under = [r for r in d["rows"] if r["true_0.01"] and r["estimated"] < 0.8 * r["true_0.01"]]
        worst = max(fp, key=lambda r: r["one_test"])
        tests = sum(r["tests"] for r in vt)
        passed = sum(r["passed"] for r in vt)
        top = max(vt, key=lambda r: r["passed"] / r["tests"]) if vt else None
        whole = (f"whole load tests judged by the verdict passed {passed} of {tests} at the "
                 f"steady-state allowance ({passed / tests:.1%}; the most in one cell "
                 f"{top['passed']} of {top['tests']}, {top['scenario']} at {top['load']:.0%}"
                 f" of its ceiling), against the contract's 5%. " if vt and top else "")
        lines += ["", f"{HEADLINE} {whole}The sequential test alone passed "
                  f"{worst['one_test']:.1%} of one cell's runs at most ({worst['scenario']} at "
                  f"{worst['load']:.0%}), {max(r['in_a_search'] for r in fp):.1%} inside a "
                  f"ceiling search ({max(r['local'] for r in fp):.1%} with the clustering over "
                  f"short batches only, as before this benchmark), and up to "
                  f"{max(r['uncorrected'] for r in fp):.0%} without the correction. The "
                  f"clustering estimate is {ratios[0]:.2f}x to "
                  f"{ratios[-1]:.2f}x the run-to-run truth (median "
                  f"{float(np.median(ratios)):.2f}x), under 0.8x in {len(under)} of "
                  f"{len(ratios)} limit-loads.**"]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    return emit(run(args.smoke, args.seeds, args.requests), args.output)


if __name__ == "__main__":
    raise SystemExit(main())
