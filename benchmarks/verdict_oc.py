"""The verdict's operating characteristic: how often a limit's sequential test passes,
and how many requests it needs, against the true share of requests over the limit.

    python benchmarks/verdict_oc.py [--smoke] [--output FILE] [--seeds 300]

Three parts, all pure (no server):

* exact, on independent requests (``autotune.tuning.sequential.operating_point``, a dynamic
  programme over the exceedance count, a look after every request): P(pass), P(fail),
  P(pass within 1,500 and 3,000 judged requests) and the expected requests to a
  decision, for a P99 alone and for a P99 inside a ceiling search (its pass decisions
  share the 5% among ``search_looks(8)``);
* Monte Carlo on heavy-tailed independent latencies (Pareto 1.5, as long-tailed as
  ShareGPT's replies), with the clustering the verdict estimates from the data;
* Monte Carlo on an M/M/1 queue at 90% and 95% load (correlated latencies; the limit
  set where exactly the given share of sojourns exceed it), with and without the
  clustering correction: the false-pass rate a binomial test would have there.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.testing.queues import mm1_sojourns  # noqa: E402
from autotune.tuning.ceiling import search_looks  # noqa: E402
from autotune.tuning.sequential import (  # noqa: E402
    PASS,
    ExceedanceTest,
    judge_series,
    operating_point,
)
from benchmarks.results import emit, fmt, table  # noqa: E402

SHARES = (0.2, 0.35, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0)  # true exceedance / allowance


def exact_rows(test: ExceedanceTest) -> list[dict[str, Any]]:
    rows = []
    for share in SHARES:
        op = operating_point(test, share * test.allowance, n_max=40000, at=(1500, 3000))
        rows.append({"share": share, "exceedance": share * test.allowance,
                     "p_pass": op.p_pass, "p_fail": op.p_fail,
                     "p_pass_1500": op.p_pass_by[1500], "p_pass_3000": op.p_pass_by[3000],
                     "expected_n": op.expected_n})
    return rows


def heavy_tail(test: ExceedanceTest, seeds: int, n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(7)
    x = rng.pareto(1.5, (seeds, n)) + 1.0
    rows = []
    for share in (0.5, 1.0):
        limit = (1.0 / (share * test.allowance)) ** (1 / 1.5)
        got = [judge_series(test, row, limit, look=100) for row in x]
        rows.append({"share": share, "p_pass": sum(g == PASS for g, _ in got) / seeds,
                     "p_pass_1500": sum(g == PASS and m <= 1500 for g, m in got) / seeds,
                     "median_n": float(np.median([m for _, m in got])), "seeds": seeds,
                     "requests": n})
    return rows


def queue(test: ExceedanceTest, seeds: int, n: int) -> list[dict[str, Any]]:
    rows = []
    for rho in (0.9, 0.95):
        t = mm1_sojourns(rho, n, seeds, np.random.default_rng(int(rho * 100)))
        for share in (1.0, 0.5):
            # M/M/1 sojourns are exponential with rate 1 - rho: P(T > L) = share x a.
            limit = math.log(1.0 / (share * test.allowance)) / (1.0 - rho)
            for correct in (True, False):
                got = [judge_series(test, t[:, j], limit, look=400,
                                    clustered="whole" if correct else "none")
                       for j in range(seeds)]
                rows.append({"rho": rho, "share": share, "clustering": correct,
                             "p_pass": sum(g == PASS for g, _ in got) / seeds,
                             "p_fail": sum(g == "fail" for g, _ in got) / seeds,
                             "seeds": seeds, "requests": n})
    return rows


def best_any_test(n: int, allowance: float, risk: float = 0.05, share: float = 0.5
                  ) -> float:
    """The most P(pass) any test can have at ``share`` x the allowance using at most ``n``
    independent requests while passing at most ``risk`` of the time at the allowance:
    the Neyman-Pearson test of the two points (pass on few exceedances, randomised at
    the edge).  A sequential test stopped by ``n`` uses a subset of the same requests,
    so it can do no better."""
    from scipy.stats import binom

    edge = int(binom.ppf(risk, n, allowance))  # first count whose tail passes the risk
    while edge >= 0 and binom.cdf(edge, n, allowance) > risk:
        edge -= 1
    below = binom.cdf(edge, n, allowance) if edge >= 0 else 0.0
    lean = (risk - below) / binom.pmf(edge + 1, n, allowance)
    safe = share * allowance
    return float((binom.cdf(edge, n, safe) if edge >= 0 else 0.0)
                 + lean * binom.pmf(edge + 1, n, safe))


def requests_for(power: float, allowance: float, risk: float = 0.05, share: float = 0.5
                 ) -> int:
    """The fewest requests with which any test reaches ``power`` (see best_any_test)."""
    n = 100
    while best_any_test(n, allowance, risk, share) < power:
        n += 10
    return n


def run(smoke: bool, seeds: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    p99 = ExceedanceTest.for_percentile(99)
    looks = search_looks(8)
    pooled = ExceedanceTest.for_percentile(99, false_pass=0.05 / looks)
    seeds = 40 if smoke else seeds
    return {
        "exact": {"p99": exact_rows(p99), "p99_in_a_search": exact_rows(pooled),
                  "search_looks": looks, "min_pass_n": p99.min_pass_n(),
                  "min_pass_n_in_a_search": pooled.min_pass_n(),
                  # What the contract's "80% within 1,500 at half the allowance" can be.
                  "best_any_test_1500": best_any_test(1500, p99.allowance),
                  "requests_for_80pct_any_test": requests_for(0.8, p99.allowance)},
        "heavy_tail": heavy_tail(p99, seeds, 1500 if smoke else 6000),
        "queue": queue(p99, seeds, 2000 if smoke else 8000),
        "smoke": smoke,
        "total_wall_s": time.perf_counter() - t0,
    }


def markdown(d: dict[str, Any]) -> list[str]:
    ex = d["exact"]
    lines = [
        "A P99 limit passes when its sequential test shows the share of judged requests "
        "over the limit under 1% (the safe hypothesis: 0.5%); the table is exact for "
        "independent requests, a look after every request (pure: no server). `share` is "
        "the true exceedance over the allowance.",
        "",
    ]
    for key, name in (("p99", "one test (5% false passes)"),
                      ("p99_in_a_search", f"a pass inside a ceiling search (5% shared by "
                                          f"{ex['search_looks']} pass decisions)")):
        lines += [f"**{name}**", ""]
        lines += table(["share", "exceedance", "P(pass)", "P(fail)", "P(pass ≤ 1,500)",
                        "P(pass ≤ 3,000)", "E[requests]"],
                       [[fmt(r["share"]), f"{r['exceedance']:.2%}", f"{r['p_pass']:.3f}",
                         f"{r['p_fail']:.3f}", f"{r['p_pass_1500']:.3f}",
                         f"{r['p_pass_3000']:.3f}", f"{r['expected_n']:,.0f}"]
                        for r in ex[key]])
        lines.append("")
    lines += [f"The fewest requests that can pass: {ex['min_pass_n']:,} alone, "
              f"{ex['min_pass_n_in_a_search']:,} inside a search.", ""]
    if "best_any_test_1500" in ex:
        lines += [f"No test can do much better at half the allowance: with 5% false passes "
                  f"at the allowance, the most P(pass) any test of at most 1,500 "
                  f"independent requests has at 0.5% is {ex['best_any_test_1500']:.3f} (the "
                  "Neyman-Pearson test of the two points, randomised at its edge); 80% "
                  f"takes {ex['requests_for_80pct_any_test']:,} requests. The sequential "
                  "test pays for deciding at any look and at every exceedance share with "
                  "the rest of the gap.", ""]
    lines += [
              "**Heavy tails** (Pareto 1.5, independent; the clustering estimated from the "
              "data as the verdict does, a look every 100 requests):", ""]
    lines += table(["share", "P(pass)", "P(pass ≤ 1,500)", "median requests", "seeds"],
                   [[fmt(r["share"]), f"{r['p_pass']:.3f}", f"{r['p_pass_1500']:.3f}",
                     f"{r['median_n']:,.0f}", str(r["seeds"])] for r in d["heavy_tail"]])
    lines += ["", "**A queue near capacity** (M/M/1; latencies correlated over hundreds of "
              "requests; a look every 400 requests):", ""]
    lines += table(["load", "share", "clustering correction", "P(pass)", "P(fail)", "seeds",
                    "requests"],
                   [[f"{r['rho']:.0%}", fmt(r["share"]), "on" if r["clustering"] else "off",
                     f"{r['p_pass']:.3f}", f"{r['p_fail']:.3f}", str(r["seeds"]),
                     f"{r['requests']:,}"] for r in d["queue"]])
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    return emit(run(args.smoke, args.seeds), args.output)


if __name__ == "__main__":
    raise SystemExit(main())
