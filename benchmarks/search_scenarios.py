"""Search methods on a scenario suite, all judged on one truth (issue 15, benchmarks 1-2;
the twin's search, issue 18).

Every figure is **simulated** (autotune's engine simulator, virtual seconds).  For each
scenario (hardware, model, workload, SLO and a small config space):

* **truth**: every config's steady-state ceiling, by bisection on the rate to ~1% with
  long fixed-count load tests (no steady-state stop rule, no pruning): a rate passes
  when every limit's P99 point estimate is under its threshold and, over the second
  half of the arrivals, requests complete at >= 97% of the rate they arrive.  Its
  goodput there is the good output tokens per measured request x the rate.  Cached in
  ``benchmarks/results/search_scenarios_truth.json`` keyed by scenario (and a
  fingerprint of its definition and sizes), so it is computed once;
* **methods**, each charged server time (90 s per (re)start plus every load test from
  its first send to its last end):

  - ``autotune``: ``autotune search``'s defaults (issue 32): a screened study (TPE,
    beat-the-incumbent, 30 trials on the simulator, each config's ceiling to 15% in at
    most 4 short tests judged on point estimates), then the proof (the pooled sequential
    ceiling search of the 2 best screened configs, tol 3%, 8 probes) on the same server
    clock; the run answers once, with the proven config and its cap (10% headroom);
  - ``autotune_sh``: vLLM's ``auto_tune.sh`` grid (per config: restart, 1000 prompts
    at rate inf, then 100-prompt probes from int(throughput)+1 down by 1 req/s);
  - ``grid_ceiling``: every config once, its ceiling searched on one start
    (``sampler='grid'``, ``beat_incumbent=False``), like vLLM's ``bench sweep``;
  - ``random_ceiling``: random configs, the same per-config search with
    beat-the-incumbent;
  - ``joint_tpe``: the old objective, TPE over (config, rate), one fixed-count test of
    1000 requests (100 warm-up) per trial, overload pruner on, 60 trials;
  - ``prescreen``: ``--prescreen sim`` on a mis-specified profile (compute x0.8,
    bandwidth x1.15, step overhead x1.5), its top 3 configs enqueued into the autotune
    study on the true profile (the pre-screen costs CPU, not server time);
  - ``twin``: ``run_study`` as ``autotune search --twin`` runs it (the library's
    ``StudyTwin.hooks``, as the CLI passes them) on the true profile, the twin starting
    from the same mis-specified profile: after every trial it refits, its best config
    (of 12 simulated trials) is measured next, and each trial starts at its predicted
    ceiling.  To keep the benchmark affordable a twin run stops after 12 trials (not
    30); a run not within 3% by then counts at its total.  The twin costs CPU, not
    server time: its CPU seconds are reported beside the server time.

  A method *holds*, after each of its steps, the config it would recommend then; a run
  is judged by the truth goodput of that config (at the config's true ceiling) against
  the scenario's best.  The two grids are order-independent per config (the simulator
  is deterministic and, without an incumbent, each config's search starts the same
  way), so each is run once per config and the seeds shuffle its visiting order.
* **safety**: every run's final answer, whatever the method (auto_tune.sh's included),
  is run at its cap for 20,000 requests on the true profile and must pass the truth
  rule.  A run *reaches* only with an answer within 3% whose cap passes; auto_tune.sh's
  time is to its unchecked pick, as issue 32 compares it.  A cap of inf (rate inf met
  the SLO) is no cap: unsafe.
* **merging**: ``--methods`` runs some methods only; ``--merge-with`` takes the other
  methods' judged rows from an earlier run's JSON, refused unless it was judged on the
  same truth at the same sizes with every seed of this run.  The page then says which
  run each method's rows come from (each ran on the code of its own day).

    python benchmarks/search_scenarios.py --output benchmarks/results/search_scenarios.json
    python benchmarks/search_scenarios.py --smoke --output /tmp/search_scenarios.json
    python benchmarks/search_scenarios.py --seeds 2 --methods twin \
        --merge-with benchmarks/results/search_scenarios.json \
        --output benchmarks/results/search_scenarios.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import multiprocessing
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import optuna  # noqa: E402

from autotune.backends.base import LoadPlan, TrialFailed  # noqa: E402
from autotune.backends.sim import SimBackend  # noqa: E402
from autotune.core.files import atomic_write, json_safe  # noqa: E402
from autotune.core.slo import SLO, parse_slo  # noqa: E402
from autotune.sim.profiles import HardwareProfile, load_hardware, load_model  # noqa: E402
from autotune.study.space import CLIENT_PARAMS, SearchSpace  # noqa: E402
from autotune.study.study import (  # noqa: E402
    StudySettings,
    make_sampler,
    prescreen_enqueue,
    rows_from_study,
    run_study,
)
from autotune.study.study_twin import StudyTwin  # noqa: E402
from autotune.tuning.trial import evaluate, probe  # noqa: E402
from autotune.tuning.verdict import SteadyState  # noqa: E402
from autotune.workload.sources import Request, sample_lengths  # noqa: E402
from benchmarks.results import committed_label  # noqa: E402

RESTART_S = 90.0
PROVE_TOP = 2  # autotune search --prove-top's default
TOL = 0.03
HEADROOM = 0.10
BUDGETS_S = (3600.0, 10800.0)
MISSPEC = {"compute_efficiency": 0.8, "bandwidth_efficiency": 1.15, "step_overhead_ms": 1.5}
# auto_tune.sh: `sleep 5` before each stepped test, `sleep 10` after each config.
STEP_SLEEP_S, CONFIG_SLEEP_S = 5.0, 10.0
STUDY_METHODS = ("autotune", "random_ceiling", "prescreen", "joint_tpe", "twin")
GRID_METHODS = ("autotune_sh", "grid_ceiling")
METHODS = ("autotune", "autotune_sh", "grid_ceiling", "random_ceiling", "joint_tpe",
           "prescreen", "twin")
# Every method's final answer (config and cap) gets the long safety run.
ANSWERING = METHODS
# auto_tune.sh's time is to its pick, unchecked (its cap is still checked and shown); every
# other method reaches only with an answer that holds in the long run.
UNCHECKED_TIME = ("autotune_sh",)
# Every ratio of median server time to within 3% that the page reports (a / b).
RATIOS = tuple([("autotune", b) for b in ("autotune_sh", "grid_ceiling", "random_ceiling",
                                          "joint_tpe", "prescreen")]
               + [("twin", b) for b in ("grid_ceiling", "autotune", "prescreen")])
TARGETS = {"autotune/grid_ceiling": 0.25, "autotune/autotune_sh": 2.0,
           "twin/grid_ceiling": 0.15}
CAP_SHARE_TARGET = 0.85  # the recommended cap / that config's true ceiling (median)
TRUTH_FILE = "search_scenarios_truth.json"

Key = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    hardware: str
    model: str
    slo: str
    workload: str  # "sharegpt" | "long" | "tiny"
    params: dict[str, list[Any]]
    fixed: dict[str, Any]
    baseline: dict[str, Any]
    rate: tuple[float, float]

    def space(self) -> SearchSpace:
        params: dict[str, Any] = {k: {"type": "categorical", "choices": v}
                                  for k, v in self.params.items()}
        params["request_rate"] = {"type": "float", "low": self.rate[0], "high": self.rate[1],
                                  "log": True}
        return SearchSpace.from_dict({
            "name": self.name, "fixed": self.fixed, "parameters": params,
            "baseline": {**self.baseline, "request_rate": self.rate[0] * 2},
            "rules": ["tp_divides_heads", "tp_fits_gpus", "batched_tokens_cover_model_len"],
        }, source=f"<scenario {self.name}>")

    @property
    def gpus(self) -> int:
        return int(self.hardware.split("x", 1)[0])


SCENARIOS = [
    Scenario("a100-8b-e2e", "the seed's 4xA100 Llama-3-8B, ShareGPT, P99 E2E <= 10 s",
             "4xa100-80gb", "llama-3-8b", "10s", "sharegpt",
             {"tensor_parallel_size": [1, 2, 4], "max_num_seqs": [64, 256, 512],
              "max_num_batched_tokens": [2048, 8192]},
             {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "max_model_len": 8192},
             {"tensor_parallel_size": 1, "max_num_seqs": 256, "max_num_batched_tokens": 2048},
             (1.0, 128.0)),
    Scenario("h100x8-70b-ttft-tpot", "Llama-3-70B on 8xH100, ShareGPT, P99 TTFT <= 2 s and "
             "P99 TPOT <= 100 ms", "8xh100-80gb", "llama-3-70b",
             "p99:ttft<=2s,p99:tpot<=100ms", "sharegpt",
             {"tensor_parallel_size": [2, 4, 8], "max_num_seqs": [64, 128, 256],
              "max_num_batched_tokens": [2048, 8192]},
             {"model": "meta-llama/Meta-Llama-3-70B-Instruct", "max_model_len": 8192},
             {"tensor_parallel_size": 4, "max_num_seqs": 256, "max_num_batched_tokens": 8192},
             (0.5, 64.0)),
    # P99 E2E <= 20 s sat on this GPU's floor (ShareGPT's longest replies at its
    # per-token time): every config's truth ceiling was 0.23 req/s, under the range, and
    # memory never mattered.  30 s leaves room for load, where memory decides.
    Scenario("l40s-8b-memory", "one L40S (PCIe) short of memory: Llama-3-8B, ShareGPT, "
             "gpu_memory_utilization 0.5-0.9, P99 E2E <= 30 s", "1xl40s", "llama-3-8b",
             "30s", "sharegpt",
             {"gpu_memory_utilization": [0.5, 0.6, 0.75, 0.9],
              "max_num_seqs": [64, 128, 256, 512], "max_num_batched_tokens": [2048]},
             {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "max_model_len": 8192},
             {"gpu_memory_utilization": 0.9, "max_num_seqs": 256,
              "max_num_batched_tokens": 2048},
             (0.25, 32.0)),
    Scenario("h100-qwen-long-prompts", "Qwen2.5-7B on 1xH100, synthetic prompts of "
             "2000-4000 tokens with 32-128 output tokens, P99 TTFT <= 1 s and E2E <= 5 s",
             "1xh100-80gb", "qwen2.5-7b", "p99:ttft<=1s,p99:e2e<=5s", "long",
             {"enable_chunked_prefill": [True, False],
              "max_num_batched_tokens": [2048, 4096, 8192, 16384],
              "max_num_seqs": [32, 128]},
             {"model": "Qwen/Qwen2.5-7B-Instruct", "max_model_len": 8192},
             {"enable_chunked_prefill": True, "max_num_seqs": 128,
              "max_num_batched_tokens": 8192},
             (0.5, 64.0)),
]
ALL_SCENARIOS = tuple(SCENARIOS)
SMOKE_SCENARIO = Scenario(
    "cpu-tiny-smoke", "smoke: the tiny model on the CPU profile", "1xcpu-tiny", "tiny",
    "p99:e2e<=4s", "tiny", {"max_num_seqs": [2, 8], "max_num_batched_tokens": [512, 2048]},
    {"model": "tiny", "max_model_len": 512},
    {"max_num_seqs": 8, "max_num_batched_tokens": 2048}, (0.25, 64.0))


@dataclass(frozen=True)
class Sizes:
    seeds: tuple[int, ...] = tuple(range(10))
    n_trials: int = 30  # `autotune search` on the simulator
    prescreen_trials: int = 40
    joint_trials: int = 60
    # The twin run stops after this many trials (its CPU, not server time, is what keeps
    # it shorter than the others' 30): a run that has not come within 3% by then counts
    # at its total server time, as any other run that never does.
    twin_trials: int = 12
    twin_candidates: int = 12  # simulated trials behind each of the twin's picks
    pool: int = 1100  # requests sampled (100 warm-up + 1000 measured)
    warmup: int = 100
    min_requests: int = 1000  # --num-prompts: fewest measured requests a pass needs
    grid_inf_prompts: int = 1000
    grid_step_prompts: int = 100
    truth_min_requests: int = 1500
    truth_max_requests: int = 4000
    truth_span_s: float = 120.0  # truth tests last at least this long (within the counts)
    truth_tol: float = 0.01
    safety_requests: int = 20000
    steady_min_s: float | None = None  # None: SteadyState's default minimum duration
    jobs: int = 2
    smoke: bool = False


SMOKE = Sizes(seeds=(0,), n_trials=3, prescreen_trials=2, joint_trials=4, twin_trials=3,
              twin_candidates=2, pool=220,
              warmup=20, min_requests=100, grid_inf_prompts=100, grid_step_prompts=20,
              truth_min_requests=300, truth_max_requests=600, truth_span_s=60.0,
              truth_tol=0.03, safety_requests=600, steady_min_s=20.0, smoke=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- pure parts


def ckey(params: Mapping[str, Any], space: SearchSpace) -> Key:
    """A config's identity: its searched server parameters (Optuna may hand back
    binary-noisy floats, so they are rounded)."""
    return tuple(sorted((k, round(v, 6) if isinstance(v, float) else v)
                        for k, v in params.items()
                        if k in space.params and k not in CLIENT_PARAMS))


def key_str(key: Key) -> str:
    return ",".join(f"{k}={v}" for k, v in key)


def time_to_within(events: Sequence[tuple[float, float]], best: float, tol: float
                   ) -> float | None:
    """Server time at which the held truth value first reaches (1 - tol) x best."""
    for t, value in events:
        if best > 0 and value >= (1.0 - tol) * best:
            return t
    return None


def value_at(events: Sequence[tuple[float, float]], budget_s: float) -> float:
    """The held truth value once ``budget_s`` of server time is spent (0 before any)."""
    out = 0.0
    for t, value in events:
        if t > budget_s:
            break
        out = value
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """numpy's linear quantile with inf allowed (inf x 0 must not give nan)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi or v[lo] == v[hi]:
        return v[lo]
    return math.inf if math.isinf(v[hi]) else v[lo] + (pos - lo) * (v[hi] - v[lo])


def censored_median(times: Sequence[float | None], totals: Sequence[float]
                    ) -> dict[str, float]:
    """The median time to a target when some runs never got there (None): those count
    at their total (a lower bound) or at infinity (an upper bound)."""
    low = [t if t is not None else tot for t, tot in zip(times, totals, strict=True)]
    high = [t if t is not None else math.inf for t in times]
    return {"low": quantile(low, 0.5), "high": quantile(high, 0.5)}


def bounded_ratio(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    def div(x: float, y: float) -> float:
        if y == 0 or math.isinf(x) and math.isinf(y):
            return math.nan
        return x / y

    return {"low": div(a["low"], b["high"]), "high": div(a["high"], b["low"])}


def fmt_bound(b: Mapping[str, float], digits: str = ",.0f") -> str:
    lo, hi = b["low"], b["high"]
    if lo is None or isinstance(lo, float) and math.isnan(lo):
        return "n/a"
    if hi is None or math.isinf(hi):
        return f">{lo:{digits}}"
    if math.isclose(lo, hi, rel_tol=1e-9):
        return f"{hi:{digits}}"
    return f"{lo:{digits}}..{hi:{digits}}"


def truth_passes(records: Sequence[Any], slo: SLO, offered: float) -> tuple[bool, dict[str, Any]]:
    """The truth rule on a long fixed-count test: every limit's P99 point estimate under
    its threshold (failed requests as inf) and, over the second half of the arrivals,
    completions at >= 97% of arrivals (so a queue that still grows cannot pass)."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        return False, {"why": "no requests"}
    observed: dict[str, float] = {}
    ok = True
    for lim in slo.limits:
        vals = [math.inf if not r.ok or (v := getattr(r, f"{lim.metric}_s", None)) is None
                and lim.metric != "tpot" else (0.0 if v is None else v) for r in measured]
        p = float(np.percentile(np.asarray(vals, dtype=float), lim.percentile,
                                method="linear")) if vals else math.inf
        observed[lim.label] = p
        ok = ok and p <= lim.threshold_s
    sched = np.array([r.scheduled_s for r in measured])
    ends = np.array([math.inf if r.end_s is None else r.end_s for r in measured])
    t0, t1 = float(sched.min()), float(sched.max())
    mid = 0.5 * (t0 + t1)
    arrived = int(np.sum(sched > mid))
    served = int(np.sum((ends > mid) & (ends <= t1)))
    share = served / arrived if arrived else 0.0
    ok = ok and share >= 0.97
    good = [r for r in measured if _good(r, slo)]
    tokens_per_req = sum(r.output_tokens for r in good) / len(measured)
    return ok, {"p99": observed, "served_share": share,
                "goodput_tokens": tokens_per_req * offered, "requests": len(measured)}


def _good(r: Any, slo: SLO) -> bool:
    from autotune.core.metrics import is_good

    return bool(is_good(r, slo))


# ----------------------------------------------------------------------------- setup


@dataclass
class World:
    """What every worker needs; built before the pool forks, so workers inherit it."""

    sizes: Sizes
    scenarios: list[Scenario]
    pools: dict[str, list[Request]]
    spaces: dict[str, SearchSpace]
    truth: dict[str, dict[str, Any]]


_W: World | None = None


def _w() -> World:
    if _W is None:
        raise RuntimeError("benchmark state not set")
    return _W


def make_world(sizes: Sizes, scenarios: Sequence[Scenario]) -> World:
    """The shared state for ``scenarios`` (set it as ``_W`` before running tasks)."""
    return World(sizes, list(scenarios), {sc.name: build_pool(sc, sizes) for sc in scenarios},
                 {sc.name: sc.space() for sc in scenarios}, {})


def build_pool(sc: Scenario, sizes: Sizes) -> list[Request]:
    rng = np.random.default_rng(0)
    if sc.workload == "sharegpt":
        from autotune.workload.sources import load_sharegpt
        from autotune.workload.tokenizer import load_tokenizer

        wl = load_sharegpt(tokenizer=load_tokenizer(), num_prompts=sizes.pool,
                           max_model_len=int(sc.fixed["max_model_len"]), seed=0)
        return list(wl.requests)
    # The simulator reads only token counts, so the long prompts are lengths alone
    # (building 3000-token texts would cost minutes of tokenizer time and change nothing).
    if sc.workload == "long":
        ins = sample_lengths(3000, sizes.pool, distribution="uniform", spread=1 / 3, rng=rng)
        outs = sample_lengths(80, sizes.pool, distribution="uniform", spread=0.6, rng=rng)
    else:
        ins = sample_lengths(96, sizes.pool, distribution="uniform", spread=0.6, rng=rng)
        outs = sample_lengths(24, sizes.pool, distribution="uniform", spread=0.5, rng=rng)
    return [Request("x", int(i), int(o)) for i, o in zip(ins, outs, strict=True)]


def configs_of(sc: Scenario, space: SearchSpace) -> tuple[list[dict[str, Any]], int]:
    """Every config of the scenario's grid that obeys the space's rules, and how many
    broke one (never launched by any method)."""
    out, broken = [], 0
    for combo in itertools.product(*sc.params.values()):
        params = dict(zip(sc.params, combo, strict=True))
        if space.violations(params, gpus=sc.gpus):
            broken += 1
        else:
            out.append(params)
    return out, broken


def misspecified(hw_name: str) -> HardwareProfile:
    hw = load_hardware(hw_name)
    changed = {k: getattr(hw, k) * f for k, f in MISSPEC.items()}
    return dataclasses.replace(hw, name=hw.name + "-misspecified", **changed)


def study_plan(sc: Scenario, w: World) -> LoadPlan:
    pool = w.pools[sc.name]
    z = w.sizes
    return LoadPlan(slo=parse_slo(sc.slo), requests=pool[z.warmup:],
                    warmup_requests=pool[:z.warmup], warmup=z.warmup, seed=0,
                    steady=SteadyState(min_duration_s=z.steady_min_s,
                                       min_requests=z.min_requests))


def fixed_plan(sc: Scenario, w: World, n: int, warmup: int) -> LoadPlan:
    pool = w.pools[sc.name]
    reqs = [pool[(warmup + i) % len(pool)] for i in range(n)]
    return LoadPlan(slo=parse_slo(sc.slo), requests=reqs, warmup_requests=pool[:warmup],
                    warmup=warmup, seed=0)


def fingerprint(sc: Scenario, z: Sizes) -> str:
    blob = json.dumps([dataclasses.asdict(sc), z.pool, z.warmup, z.grid_inf_prompts,
                       z.truth_min_requests, z.truth_max_requests, z.truth_span_s,
                       z.truth_tol], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- truth


def truth_test(sc: Scenario, params: Mapping[str, Any], rate: float, n: int | None = None
               ) -> tuple[bool, dict[str, Any]]:
    """One long fixed-count test of ``params`` at ``rate`` on the true profile."""
    w = _w()
    z = w.sizes
    if n is None:
        n = int(min(max(math.ceil(z.truth_span_s * rate), z.truth_min_requests),
                    z.truth_max_requests))
    backend = SimBackend(sc.hardware, sc.model)
    flags = w.spaces[sc.name].server_flags(params)
    res = evaluate(backend, flags, rate, fixed_plan(sc, w, n, z.warmup))
    if res.summary is None:
        return False, {"refused": res.reason, "detail": (res.detail or "")[:200]}
    return truth_passes(res.records, parse_slo(sc.slo), rate)


def truth_config(arg: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """A config's ceiling by bisection on the rate (geometric, to ``truth_tol``)."""
    name, params = arg
    w = _w()
    sc = next(s for s in w.scenarios if s.name == name)
    z = w.sizes
    backend = SimBackend(sc.hardware, sc.model)
    flags = w.spaces[name].server_flags(params)
    try:
        sat_res = evaluate(backend, flags, math.inf,
                           fixed_plan(sc, w, z.grid_inf_prompts, z.warmup))
    except TrialFailed as exc:  # pragma: no cover - evaluate reports, never raises
        return {"scenario": name, "params": params, "refused": str(exc), "ceiling": 0.0,
                "goodput_tokens": 0.0, "tests": 0}
    if sat_res.summary is None:
        return {"scenario": name, "params": params, "refused": sat_res.reason,
                "ceiling": 0.0, "goodput_tokens": 0.0, "tests": 1}
    sat = float(sat_res.summary.request_throughput)
    tests = 1
    seen: dict[float, tuple[bool, dict[str, Any]]] = {}

    def ok(rate: float) -> bool:
        nonlocal tests
        if rate not in seen:
            seen[rate] = truth_test(sc, params, rate)
            tests += 1
        return seen[rate][0]

    hi, lo = 1.05 * sat, 0.6 * sat
    while ok(hi) and hi < 50 * sat:  # rare: Poisson beats a burst; look higher
        lo, hi = hi, 1.5 * hi
    if not ok(lo):
        hi = lo
        lo = hi / 2
        while not ok(lo):
            hi, lo = lo, lo / 2
            if lo < 0.01 * sat:
                return {"scenario": name, "params": params, "ceiling": 0.0,
                        "goodput_tokens": 0.0, "tests": tests, "saturated": sat,
                        "note": "no rate down to 1% of saturation passes"}
    while hi / lo - 1.0 > z.truth_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    info = seen[lo][1]
    return {"scenario": name, "params": params, "ceiling": lo, "first_fail": hi,
            "goodput_tokens": info["goodput_tokens"], "p99_at_ceiling": info["p99"],
            "served_share": info["served_share"], "requests_at_ceiling": info["requests"],
            "tests": tests, "saturated": sat}


# ----------------------------------------------------------------------------- methods


def held_events_study(study: optuna.Study, space: SearchSpace
                      ) -> tuple[list[tuple[float, Key | None, float | None]], float]:
    """(cumulative server s, held config, its cap) after each trial of an autotune study:
    the held config is what ``recommend`` would pick then (best feasible value, earliest
    trial on ties)."""
    t, best, held = 0.0, -math.inf, (None, None)
    out: list[tuple[float, Key | None, float | None]] = []
    for tr in sorted(study.get_trials(deepcopy=False), key=lambda x: x.number):
        res = tr.user_attrs.get("result") or {}
        t += float(res.get("server_s") or 0.0)
        if (tr.state == optuna.trial.TrialState.COMPLETE and res.get("feasible")
                and tr.value is not None and tr.value > best):
            best = float(tr.value)
            held = (ckey(tr.params, space), res.get("rate_cap"))
        out.append((t, *held))
    return out, t


def run_method(arg: tuple[str, str, int]) -> dict[str, Any]:
    name, method, seed = arg
    w = _w()
    sc = next(s for s in w.scenarios if s.name == name)
    t0 = time.process_time()
    out = _joint_tpe(sc, seed) if method == "joint_tpe" else _study(sc, method, seed)
    out.update(scenario=name, method=method, seed=seed, cpu_s=time.process_time() - t0)
    return out


def _settings(sc: Scenario, method: str, seed: int, folder: Path) -> StudySettings:
    z = _w().sizes
    sampler = {"random_ceiling": "random", "grid_ceiling": "grid"}.get(method, "tpe")
    return StudySettings(
        name=f"{sc.name}-{method}-{seed}", slo=parse_slo(sc.slo), space=_w().spaces[sc.name],
        sampler=sampler, studies_dir=folder, gpus=sc.gpus, seed=seed,
        n_trials=z.n_trials, tol=TOL, max_probes=8, headroom=HEADROOM,
        beat_incumbent=method != "grid_ceiling")


def _study(sc: Scenario, method: str, seed: int) -> dict[str, Any]:
    w = _w()
    space = w.spaces[sc.name]
    plan = study_plan(sc, w)
    storage = optuna.storages.InMemoryStorage()
    picks: list[tuple[dict[str, Any], dict[str, Any]]] = []
    pre: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        settings = _settings(sc, method, seed, Path(tmp))
        if method == "grid_ceiling":
            n = len(configs_of(sc, space)[0]) + configs_of(sc, space)[1]
            settings = dataclasses.replace(settings, n_trials=n)
        if method == "prescreen":
            sim = SimBackend(misspecified(sc.hardware), sc.model)
            pre_s = dataclasses.replace(settings, name=settings.name + "-pre",
                                        n_trials=w.sizes.prescreen_trials)
            cpu0 = time.process_time()
            pre_run = run_study(pre_s, sim, plan, storage=storage)
            picks = prescreen_enqueue(rows_from_study(pre_run.study), space, top_k=3)
            pre = {"cpu_s": time.process_time() - cpu0, "virtual_s_not_charged": sim.server_s,
                   "picks": [{"config": key_str(ckey(p, space)),
                              "predicted_ceiling": (a.get("predicted") or {}).get(
                                  "ceiling_rate")} for p, a in picks]}
        twin: StudyTwin | None = None
        hooks: dict[str, Any] = {}
        clock = CpuClock()
        if method == "twin":
            settings = dataclasses.replace(settings, n_trials=w.sizes.twin_trials)
            twin = StudyTwin.for_study(prior=misspecified(sc.hardware),
                                       model=load_model(sc.model), settings=settings,
                                       plan=plan, candidates=w.sizes.twin_candidates)
            # The library's own hooks, as `autotune search --twin` passes them; timed,
            # because the twin costs CPU and no server time.
            hooks = {k: clock.timed(fn) for k, fn in twin.hooks().items()}
        backend = SimBackend(sc.hardware, sc.model, startup_s=RESTART_S)
        if method == "autotune":
            settings = dataclasses.replace(settings, screen=True)
        run = run_study(settings, backend, plan, storage=storage, enqueue=picks, **hooks)
        proof = prove(run, backend, plan, sc) if method == "autotune" else None
    events, total = held_events_study(run.study, space)
    trials = len(events)
    if proof is not None:
        # Screening caps are point estimates, never an answer: the run answers once, when
        # its proof ends, with the proven config and cap.
        events, total = [(backend.server_s, proof["config"], proof["cap"])], backend.server_s
    per_config = {}
    for tr in run.study.get_trials(deepcopy=False):
        res = tr.user_attrs.get("result") or {}
        if res.get("launched") and "repeat_of" not in res:
            per_config[key_str(ckey(tr.params, space))] = {
                "server_s": float(res.get("server_s") or 0.0), "feasible": bool(
                    res.get("feasible")) and tr.state == optuna.trial.TrialState.COMPLETE,
                "value": tr.value, "rate_cap": res.get("rate_cap"), "rate": res.get("rate")}
    return {"events": [[t, None if k is None else key_str(k), c] for t, k, c in events],
            "total_server_s": total, "backend_server_s": backend.server_s,
            "restarts": backend.restarts, "trials": trials, "prescreen": pre,
            "proof": None if proof is None else {**proof, "config": None if proof[
                "config"] is None else key_str(proof["config"])},
            "twin": None if twin is None else twin_summary(twin, clock.seconds),
            "per_config": per_config}


def prove(run: Any, backend: SimBackend, plan: LoadPlan, sc: Scenario
          ) -> dict[str, Any]:
    """``autotune search``'s proof on a screened study: the full pooled ceiling search of
    the PROVE_TOP best screened configs on the same backend (its server time counted),
    the recommendation re-ranked on the proven ceilings as the pipeline does."""
    from autotune.analysis.recommend import RecommendError, apply_ceilings, recommend, view_of
    from autotune.study.study import refine_ceilings
    from autotune.tuning.record import stored_trials

    ceilings = refine_ceilings(run.rows, backend, plan, top_k=PROVE_TOP, headroom=HEADROOM,
                               tol=TOL, max_probes=8)
    proven = [{"trial": c.trial, **{k: c.to_dict().get(k) for k in (
        "answer", "feasible_max", "infeasible_min", "total_probes")}} for c in ceilings]
    views = [view_of(t) for t in stored_trials(run.study)]
    try:
        rec = recommend(views, slo=str(plan.slo), headroom=HEADROOM)
    except RecommendError:
        return {"config": None, "cap": None, "proven": proven}
    rec = apply_ceilings(rec, views, [c.to_dict() for c in ceilings])
    space = _w().spaces[sc.name]
    trial = next(t for t in run.study.get_trials(deepcopy=False)
                 if t.number == rec.best.trial)
    return {"config": ckey(trial.params, space), "cap": rec.rate_cap, "proven": proven}


class CpuClock:
    """CPU seconds spent inside the callables it wraps (this process only)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_fn(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - t0

        return timed_fn


def twin_summary(twin: StudyTwin, cpu_s: float) -> dict[str, Any]:
    """What a twin run reports besides its server time: the twin's CPU and what it
    learned (the factors are relative to the mis-specified prior, so x1/0.8 = 1.25 on
    compute would undo MISSPEC exactly)."""
    last = twin.steps[-1] if twin.steps else None
    return {"cpu_s": cpu_s, "refits": len(twin.steps), "picks": len(twin.queued),
            "candidates": twin.candidates, "prior": twin.prior.name,
            "factors": {} if last is None else {n: v for n, (v, _) in last.factors.items()},
            "out_of_sample_rms_log_error": [s.before_error for s in twin.steps],
            "prior_rms_log_error": [s.prior_error for s in twin.steps]}


def _joint_tpe(sc: Scenario, seed: int) -> dict[str, Any]:
    """The old objective: one trial = one (config, rate) and one fixed-count load test,
    the overload pruner on; the server restarts only when the config changes."""
    w = _w()
    z = w.sizes
    space = w.spaces[sc.name]
    plan = fixed_plan(sc, w, z.min_requests, z.warmup)
    backend = SimBackend(sc.hardware, sc.model, startup_s=RESTART_S)
    study = optuna.create_study(direction="maximize",
                                sampler=make_sampler("tpe", seed=seed, space=space))
    study.enqueue_trial(space.baseline_params())
    events: list[list[Any]] = []
    best = (-math.inf, None, None)

    def objective(trial: optuna.Trial) -> float:
        nonlocal best
        params = space.suggest(trial)
        value = 0.0
        if not space.violations(params, gpus=sc.gpus):
            res = probe(backend, space.server_flags(params), float(params["request_rate"]),
                        plan, prune=True)
            value = res.goodput("tokens") if res.feasible else 0.0
            if res.feasible and value > best[0]:
                best = (value, key_str(ckey(params, space)), float(params["request_rate"]))
        events.append([backend.server_s, best[1], best[2]])
        return value

    study.optimize(objective, n_trials=z.joint_trials)
    return {"events": events, "total_server_s": backend.server_s,
            "restarts": backend.restarts, "trials": len(events)}


def grid_walk(arg: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """auto_tune.sh on one config: restart, rate inf, then 1 req/s steps down."""
    name, params = arg
    w = _w()
    sc = next(s for s in w.scenarios if s.name == name)
    z = w.sizes
    slo = parse_slo(sc.slo)
    backend = SimBackend(sc.hardware, sc.model, startup_s=RESTART_S)
    flags = w.spaces[name].server_flags(params)
    first = evaluate(backend, flags, math.inf, fixed_plan(sc, w, z.grid_inf_prompts, 0))
    out: dict[str, Any] = {"scenario": name, "config": key_str(ckey(params, w.spaces[name])),
                           "chosen_rate": None, "own_throughput": 0.0, "probes": 1}
    if first.summary is None:
        out["server_s"] = backend.server_s + CONFIG_SLEEP_S
        out["refused"] = first.reason
        return out
    thr = float(first.summary.request_throughput)
    if first.summary.slo_check is not None and first.summary.slo_check.met:
        out.update(chosen_rate=math.inf, own_throughput=thr)
    rate = int(thr) + 1
    steps = 0
    while out["chosen_rate"] is None and rate > 0:
        res = evaluate(backend, flags, float(rate), fixed_plan(sc, w, z.grid_step_prompts, 0))
        steps += 1
        s = res.summary
        if s is not None and s.slo_check is not None and s.slo_check.met:
            out.update(chosen_rate=float(rate), own_throughput=float(s.request_throughput))
        rate -= 1
    del slo
    out["probes"] = 1 + steps
    out["server_s"] = backend.server_s + STEP_SLEEP_S * steps + CONFIG_SLEEP_S
    return out


def safety(arg: tuple[str, str, float]) -> dict[str, Any]:
    """An answer's cap in a long run of the true profile."""
    name, cfg, cap = arg
    if not math.isfinite(cap):  # auto_tune.sh's pick when rate inf met the SLO
        return {"scenario": name, "config": cfg, "cap": cap, "passed": False,
                "note": "no finite cap to enforce"}
    w = _w()
    sc = next(s for s in w.scenarios if s.name == name)
    params = dict(_parse_key(cfg))
    ok, info = truth_test(sc, params, cap, n=w.sizes.safety_requests)
    return {"scenario": name, "config": cfg, "cap": cap, "passed": ok, **info}


def _parse_key(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for part in text.split(","):
        k, v = part.split("=", 1)
        out.append((k, json.loads(v.lower()) if v not in ("True", "False") else v == "True"))
    return out


def _work(task: tuple[str, Any]) -> dict[str, Any]:
    kind, arg = task
    fn = {"truth": truth_config, "walk": grid_walk, "method": run_method,
          "safety": safety}[kind]
    return fn(arg)


# Optional JSONL of finished tasks: a run stopped part-way (this shared machine) is
# resumed by the next one with the same scenarios and sizes instead of redone.
_TASK_CACHE: Path | None = None
_FIRST_CACHED_AT: float | None = None  # epoch s of the oldest reused task: the run's start


def _task_key(task: tuple[str, Any]) -> str:
    w = _w()
    z = dataclasses.replace(w.sizes, seeds=(), jobs=1)
    # Every suite scenario's fingerprint, whichever run this is: a run of some scenarios
    # (--only-scenarios) then reuses what a run of all of them finished, and back.
    every = [SMOKE_SCENARIO] if w.sizes.smoke else ALL_SCENARIOS
    return json.dumps([task[0], task[1], [fingerprint(sc, z) for sc in every],
                       dataclasses.asdict(z)], sort_keys=True, default=str)


def run_tasks(tasks: Sequence[tuple[str, Any]], jobs: int) -> Iterator[dict[str, Any]]:
    global _FIRST_CACHED_AT
    done: dict[str, dict[str, Any]] = {}
    if _TASK_CACHE is not None and _TASK_CACHE.exists():
        for line in _TASK_CACHE.read_text().splitlines():
            with_key = json.loads(line)
            res = with_key["result"]
            if res.get("chosen_rate") is None and res.get("own_throughput"):
                continue  # written by an older version that lost a rate of inf: redo it
            done[with_key["key"]] = res
            # An entry without a time (older version) leaves the run's start unknown.
            at = float(with_key.get("at", -math.inf))
            _FIRST_CACHED_AT = at if _FIRST_CACHED_AT is None else min(_FIRST_CACHED_AT, at)
    keys = [_task_key(t) for t in tasks]
    todo = [t for t, k in zip(tasks, keys, strict=True) if k not in done]
    for k in keys:
        if k in done:
            yield done[k]
    if not todo:
        return
    results: Iterator[dict[str, Any]]
    if jobs <= 1:
        results = map(_work, todo)
        yield from _cached(todo, results)
        return
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        yield from _cached(todo, pool.imap(_work, todo, chunksize=1))


def _cached(tasks: Sequence[tuple[str, Any]], results: Iterator[dict[str, Any]]
            ) -> Iterator[dict[str, Any]]:
    for task, res in zip(tasks, results, strict=True):
        if _TASK_CACHE is not None:
            with open(_TASK_CACHE, "a", encoding="utf-8") as f:
                # Plain json keeps inf (auto_tune.sh passing at rate inf) as Infinity.
                f.write(json.dumps({"key": _task_key(task), "result": res,
                                    "at": time.time()}) + "\n")
        yield res


# ----------------------------------------------------------------------------- phases


def load_truth(path: Path | None, w: World) -> None:
    if path is None or not path.exists():
        return
    saved = json.loads(path.read_text())
    for sc in w.scenarios:
        got = saved.get(sc.name)
        if got and got.get("fingerprint") == fingerprint(sc, w.sizes):
            w.truth[sc.name] = got


def phase_truth(w: World, cache: Path | None) -> dict[str, float]:
    load_truth(cache, w)
    todo = [sc for sc in w.scenarios if sc.name not in w.truth]
    walls: dict[str, float] = {}
    if not todo:
        return walls
    tasks = [("truth", (sc.name, p)) for sc in todo for p in configs_of(sc, w.spaces[sc.name])[0]]
    t0 = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {sc.name: [] for sc in todo}
    for i, r in enumerate(run_tasks(tasks, w.sizes.jobs)):
        rows[r["scenario"]].append(r)
        if (i + 1) % 8 == 0:
            log(f"truth: {i + 1}/{len(tasks)} configs, {time.perf_counter() - t0:.0f} s")
    for sc in todo:
        space = w.spaces[sc.name]
        cfgs = sorted(rows[sc.name], key=lambda r: -r["goodput_tokens"])
        for c in cfgs:
            c["key"] = key_str(ckey(c["params"], space))
        broken = configs_of(sc, space)[1]
        w.truth[sc.name] = {
            "fingerprint": fingerprint(sc, w.sizes), "configs": cfgs,
            "rule_broken_configs": broken,
            "best_goodput_tokens": cfgs[0]["goodput_tokens"] if cfgs else 0.0,
            "best_config": cfgs[0]["key"] if cfgs else None,
            "tests": sum(c["tests"] for c in cfgs),
            "wall_s": time.perf_counter() - t0,
            "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        walls[sc.name] = time.perf_counter() - t0
    if cache is not None:
        old = json.loads(cache.read_text()) if cache.exists() else {}
        old.update({sc.name: w.truth[sc.name] for sc in todo})
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cache, json.dumps(json_safe(old), indent=1) + "\n")
    return walls


def grid_runs(w: World, walks: Sequence[Mapping[str, Any]],
              grid_studies: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Both grids per seed: the per-config results in that seed's shuffled order (a grid
    not run this time has no runs)."""
    out = []
    for sc in w.scenarios:
        mine = sorted((x for x in walks if x["scenario"] == sc.name), key=lambda x: x["config"])
        for seed in w.sizes.seeds:
            if mine:
                out.append(_sh_run(sc.name, seed, mine))
            if sc.name in grid_studies:
                out.append(_grid_ceiling_run(sc.name, seed,
                                             grid_studies[sc.name]["per_config"]))
    return out


def _sh_run(name: str, seed: int, walks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    order = list(walks)
    random.Random(seed).shuffle(order)
    # auto_tune.sh: best by its own measured throughput at its chosen rate.
    t, best, held, ev = RESTART_S, -math.inf, (None, None), []
    for x in order:
        t += x["server_s"]
        if x["chosen_rate"] is not None and x["own_throughput"] > best:
            best, held = x["own_throughput"], (x["config"], x["chosen_rate"])
        ev.append([t, *held])
    return {"scenario": name, "method": "autotune_sh", "seed": seed, "events": ev,
            "total_server_s": t}


def _grid_ceiling_run(name: str, seed: int, per_config: Mapping[str, Mapping[str, Any]]
                      ) -> dict[str, Any]:
    keys = sorted(per_config)
    random.Random(seed).shuffle(keys)
    t, bestv, held, ev = 0.0, -math.inf, (None, None), []
    for k in keys:
        c = per_config[k]
        t += c["server_s"]
        if c["feasible"] and c["value"] is not None and c["value"] > bestv:
            bestv, held = c["value"], (k, c["rate_cap"])
        ev.append([t, *held])
    return {"scenario": name, "method": "grid_ceiling", "seed": seed, "events": ev,
            "total_server_s": t}


# ----------------------------------------------------------------------------- judging


def judge(w: World, runs: Sequence[Mapping[str, Any]], safety_rows: Mapping[tuple[str, str,
          float], Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: when it came within 3%, its shares at the budgets, its answer
    and whether that answer was safe."""
    per_run = []
    for r in runs:
        truth = w.truth[r["scenario"]]
        best = truth["best_goodput_tokens"]
        value = {c["key"]: c["goodput_tokens"] for c in truth["configs"]}
        ev = [(t, value.get(k, 0.0) if k else 0.0) for t, k, _ in r["events"]]
        hit = time_to_within(ev, best, TOL)
        final_key, final_cap = (r["events"][-1][1], r["events"][-1][2]) if r["events"] else (
            None, None)
        row = {"scenario": r["scenario"], "method": r["method"], "seed": r["seed"],
               "reached": hit is not None, "server_s_to_within": hit,
               "total_server_s": r["total_server_s"],
               **{f"share_at_{int(b / 3600)}h": value_at(ev, b) / best if best else 0.0
                  for b in BUDGETS_S},
               "final_config": final_key, "final_cap": final_cap,
               "final_share": (ev[-1][1] / best) if ev and best else 0.0}
        if r["method"] in ANSWERING and final_key and final_cap:
            s = safety_rows.get((r["scenario"], final_key, round(float(final_cap), 6)))
            row["safe"] = None if s is None else s["passed"]
            ceiling = next((c["ceiling"] for c in truth["configs"] if c["key"] == final_key),
                           None)
            row["cap_share"] = float(final_cap) / ceiling if ceiling else None
        if r["method"] not in UNCHECKED_TIME and row.get("safe") is not True:
            # An answer not shown to hold in the long run is no answer yet.
            row.update(reached=False, server_s_to_within=None, reached_unsafe=hit is not None)
        for extra in ("prescreen", "twin", "proof"):
            if r.get(extra):
                row[extra] = r[extra]
        if "trials" in r:
            row["trials"] = r["trials"]
        per_run.append(row)
    return per_run


def summarise(scenarios: Sequence[str], per_run: Sequence[Mapping[str, Any]]
              ) -> dict[str, Any]:
    """Per method medians, the ratios between methods and the targets, from the per-run
    rows alone (so rows of an earlier run can be summarised with this run's)."""
    methods = {m: method_summary(scenarios, [x for x in per_run if x["method"] == m])
               for m in METHODS if any(x["method"] == m for x in per_run)}
    med = {m: v["server_s_to_within_median"] for m, v in methods.items()}
    ratios = {f"{a}/{b}": bounded_ratio(med[a], med[b]) for a, b in RATIOS
              if a in med and b in med}
    targets: dict[str, Any] = {k: {"target": v, "ratio": ratios[k],
                                   "met": ratios[k]["high"] <= v}
                               for k, v in TARGETS.items() if k in ratios}
    if "autotune" in methods:
        a = methods["autotune"]
        targets["within_3pct_share"] = {"target": 0.95, "value": a["reached"] / a["runs"],
                                        "met": a["reached"] / a["runs"] >= 0.95}
        targets["unsafe_answers"] = {"target": 0, "value": a["safety"]["unsafe"],
                                     "checked": a["safety"]["checked"],
                                     "met": a["safety"]["unsafe"] == 0
                                     and a["safety"]["unchecked"] == 0}
        share = a.get("cap_share_median")
        targets["cap_share"] = {"target": CAP_SHARE_TARGET, "value": share,
                                "met": share is not None and share >= CAP_SHARE_TARGET}
    return {"methods": methods, "ratios": ratios, "targets": targets}


def method_summary(scenarios: Sequence[str], rows: Sequence[Mapping[str, Any]]
                   ) -> dict[str, Any]:
    out: dict[str, Any] = {
        "runs": len(rows), "reached": sum(x["reached"] for x in rows),
        "server_s_to_within_median": censored_median(
            [x["server_s_to_within"] for x in rows], [x["total_server_s"] for x in rows]),
        **{f"share_at_{int(b / 3600)}h_median": quantile(
            [x[f"share_at_{int(b / 3600)}h"] for x in rows], 0.5) for b in BUDGETS_S},
        "total_server_s_median": quantile([x["total_server_s"] for x in rows], 0.5),
        "per_scenario": {n: censored_median(
            [x["server_s_to_within"] for x in rows if x["scenario"] == n],
            [x["total_server_s"] for x in rows if x["scenario"] == n])
            for n in scenarios if any(x["scenario"] == n for x in rows)}}
    if rows and rows[0]["method"] in ANSWERING:
        checked = [x["safe"] for x in rows if x.get("safe") is not None]
        out["safety"] = {"checked": len(checked), "unsafe": sum(not s for s in checked),
                         "unchecked": sum(1 for x in rows if x.get("safe") is None)}
        shares = [x["cap_share"] for x in rows if x.get("cap_share") is not None]
        out["cap_share_median"] = quantile(shares, 0.5) if shares else None
    return out


# ----------------------------------------------------------------------------- run


def run(sizes: Sizes, truth_cache: Path | None, methods: Sequence[str] = METHODS,
        earlier: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run ``methods`` on the suite; the other methods' rows come from ``earlier`` (an
    earlier run's JSON, see :func:`merge_earlier`) when given."""
    global _W
    t0 = time.perf_counter()
    scenarios = [SMOKE_SCENARIO] if sizes.smoke else SCENARIOS
    w = _W = make_world(sizes, scenarios)
    try:
        truth_walls = phase_truth(w, truth_cache)
        for sc in scenarios:
            t = w.truth[sc.name]
            log(f"truth {sc.name}: best {t['best_goodput_tokens']:,.0f} tok/s "
                f"({t['best_config']}), {len(t['configs'])} configs, {t['tests']} tests")
        t1 = time.perf_counter()
        walks, studies, grid_studies = run_methods(w, methods, t1)
        runs = studies + grid_runs(w, walks, grid_studies)
        answers = sorted({(r["scenario"], r["events"][-1][1], round(float(r["events"][-1][2]),
                                                                     6))
                          for r in runs if r["method"] in ANSWERING
                          and r["events"] and r["events"][-1][1] and r["events"][-1][2]})
        t2 = time.perf_counter()
        safety_rows = {(x["scenario"], x["config"], x["cap"]): x
                       for x in run_tasks([("safety", a) for a in answers], sizes.jobs)}
        log(f"safety: {len(answers)} distinct answers, {time.perf_counter() - t2:.0f} s")
        per_run = judge(w, runs, safety_rows)
        now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        out: dict[str, Any] = {
            "how": how(sizes), "sizes": dataclasses.asdict(sizes), "written": now,
            "scenarios": [dataclasses.asdict(sc) for sc in scenarios],
            "truth": {sc.name: {k: v for k, v in w.truth[sc.name].items()} for sc in scenarios},
            "truth_wall_s_this_run": truth_walls,
            "walks": walks, "grid_ceiling_per_config": {k: v["per_config"]
                                                        for k, v in grid_studies.items()},
            "safety": list(safety_rows.values()), "per_run": per_run,
            "rows_from": {m: f"this run ({now})" for m in methods},
            "methods_wall_s": time.perf_counter() - t1, "total_wall_s": time.perf_counter() - t0,
            # A resumed run counts from its first cached task (it ran in an earlier process).
            "wall_s_since_first_task": None if _FIRST_CACHED_AT is None
            or math.isinf(_FIRST_CACHED_AT) else time.time() - _FIRST_CACHED_AT}
        if earlier is not None:
            merge_earlier(out, earlier, w)
        out.update(summarise([sc.name for sc in scenarios], out["per_run"]))
        return out
    finally:
        _W = None


def run_methods(w: World, methods: Sequence[str], t1: float
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The grids' per-config tasks and every study of ``methods``: (walks, studies,
    grid_ceiling's study per scenario)."""
    scenarios, sizes = w.scenarios, w.sizes
    tasks: list[tuple[str, Any]] = []
    if "autotune_sh" in methods:
        tasks += [("walk", (sc.name, p)) for sc in scenarios
                  for p in configs_of(sc, w.spaces[sc.name])[0]]
    if "grid_ceiling" in methods:
        tasks += [("method", (sc.name, "grid_ceiling", 0)) for sc in scenarios]
    # Seed by seed, so a run stopped part-way has whole seeds in its task cache.
    tasks += [("method", (sc.name, m, s)) for s in sizes.seeds for sc in scenarios
              for m in STUDY_METHODS if m in methods]
    walks, studies, grid_studies = [], [], {}
    for i, r in enumerate(run_tasks(tasks, sizes.jobs)):
        if "events" not in r:
            walks.append(r)
        elif r["method"] == "grid_ceiling":
            grid_studies[r["scenario"]] = r
        else:
            studies.append(r)
            twin = f", twin {r['twin']['cpu_s']:.0f} CPU s of them" if r.get("twin") else ""
            log(f"{r['scenario']} {r['method']} seed {r['seed']}: {r['trials']} trials, "
                f"{r['total_server_s']:,.0f} server s, {r['cpu_s']:.0f} CPU s{twin} "
                f"({i + 1}/{len(tasks)}, {time.perf_counter() - t1:.0f} s)")
    return walks, studies, grid_studies


class MergeError(ValueError):
    """An earlier run's figures that cannot stand beside this run's."""


def merge_earlier(out: dict[str, Any], earlier: Mapping[str, Any], w: World) -> None:
    """Add to ``out`` the rows of every method it did not run from ``earlier`` (an
    earlier run's JSON), for this run's scenarios and seeds.  Refused unless both runs
    judged against the same truth (fingerprints and best goodput) at the same sizes, and
    the earlier run has every seed of this one: the methods' rows are then comparable
    (one truth), though each comes from the code of its own run."""
    ran = set(out["rows_from"])
    take = [m for m in METHODS if m not in ran]
    check_mergeable(earlier, w)
    names = {sc.name for sc in w.scenarios}
    seeds = set(w.sizes.seeds)
    rows = [r for r in earlier["per_run"] if r["method"] in take
            and r["scenario"] in names and r["seed"] in seeds]
    when = earlier.get("written") or "an earlier run"
    labels = earlier.get("rows_from") or {}
    for m in take:
        got = {(r["scenario"], r["seed"]) for r in rows if r["method"] == m}
        if got and got != {(n, s) for n in names for s in seeds}:
            raise MergeError(f"the earlier run has {len(got)} of {len(names) * len(seeds)} "
                             f"(scenario, seed) runs of {m}: rerun it instead")
        if got:
            out["rows_from"][m] = labels.get(m, f"an earlier run ({when})")
    out["per_run"] += rows
    if "autotune_sh" not in ran:
        out["walks"] = list(earlier.get("walks") or [])
    if "grid_ceiling" not in ran:
        out["grid_ceiling_per_config"] = dict(earlier.get("grid_ceiling_per_config") or {})
    old_safety = [x for x in earlier.get("safety") or [] if x["scenario"] in names]
    seen = {(x["scenario"], x["config"], x["cap"]) for x in out["safety"]}
    out["safety"] += [x for x in old_safety if (x["scenario"], x["config"], x["cap"]) not in seen]
    out["merged"] = {"methods": [m for m in take if m in out["rows_from"]], "written": when,
                     "total_wall_s": earlier.get("total_wall_s"),
                     "wall_s_since_first_task": earlier.get("wall_s_since_first_task"),
                     "command": earlier.get("command")}


def check_mergeable(earlier: Mapping[str, Any], w: World) -> None:
    """Raise :class:`MergeError` unless ``earlier`` was judged on this run's truth at
    its sizes (the processes and seeds aside; new size fields it lacks aside)."""
    mine = dataclasses.asdict(w.sizes)
    theirs = earlier.get("sizes") or {}
    differ = sorted(k for k in theirs if k in mine and k not in ("jobs", "seeds")
                    and theirs[k] != mine[k])
    if differ:
        raise MergeError(f"the earlier run's sizes differ: {', '.join(differ)}")
    missing = sorted(set(w.sizes.seeds) - set(theirs.get("seeds") or ()))
    if missing:
        raise MergeError(f"the earlier run lacks seeds {missing}")
    for sc in w.scenarios:
        old = (earlier.get("truth") or {}).get(sc.name) or {}
        new = w.truth[sc.name]
        if (old.get("fingerprint") != new["fingerprint"]
                or old.get("best_goodput_tokens") != new["best_goodput_tokens"]):
            raise MergeError(f"{sc.name}: the earlier run was judged on another truth")


def how(z: Sizes) -> str:
    return (
        "Simulated (virtual time) on autotune's simulator profiles. Truth per config: "
        f"bisection on the rate to {z.truth_tol:.0%} from a saturation test, each test "
        f"{z.truth_min_requests:,}-{z.truth_max_requests:,} measured requests (at least "
        f"{z.truth_span_s:g} s of arrivals within those counts) after {z.warmup} warm-up, "
        "Poisson seed 0, no stop rule; a rate passes when every limit's P99 point estimate "
        "holds and completions keep up with >= 97% of arrivals over the second half. "
        f"Server time: {RESTART_S:g} s per (re)start plus each test from first send to last "
        f"end. Studies: {z.n_trials} trials, steady-state tests ({z.warmup} warm-up; "
        "autotune: screening tests, then the proof of its 2 best configs). A run reaches "
        f"when the truth goodput of the config it would recommend is within {TOL:.0%} of "
        f"the scenario's best and its cap passes a {z.safety_requests:,}-request run "
        "(auto_tune.sh: its pick, unchecked); a run "
        "that never does counts at its total (lower bound, '>X'). Seeds vary the samplers "
        "and the grids' visiting order; workloads and arrivals are fixed.")


# ----------------------------------------------------------------------------- markdown


def markdown(d: dict[str, Any]) -> list[str]:
    """This benchmark's section of benchmarks/RESULTS.md."""
    out = [d["how"], "", *provenance(d), "",
           "| scenario | configs (rule-broken) | truth tests | best config | best goodput "
           "tok/s | its ceiling req/s | configs within 3% |", "|---|---|---|---|---|---|---|"]
    for sc in d["scenarios"]:
        t = d["truth"][sc["name"]]
        best = t["best_goodput_tokens"]
        top = t["configs"][0] if t["configs"] else {}
        near = len(near_best(t))
        out.append(f"| {sc['name']}: {sc['title']} | {len(t['configs'])} "
                   f"({t['rule_broken_configs']}) | {t['tests']} | {t['best_config']} | "
                   f"{best:,.0f} | {top.get('ceiling', 0):.2f} | {near} |")
    long_run = d["sizes"]["safety_requests"]
    out += ["", "| method | reached within 3% | server s to within (median) | share of best "
            f"at 1 h | at 3 h | total server s (median) | unsafe answers ({long_run:,}-"
            "request run) | cap / true ceiling (median) |",
            "|---|---|---|---|---|---|---|---|"]
    for m, v in d["methods"].items():
        safe = v.get("safety") or {}
        share = v.get("cap_share_median")
        out.append(f"| {m} | {v['reached']}/{v['runs']} | "
                   f"{fmt_bound(v['server_s_to_within_median'])} | "
                   f"{v['share_at_1h_median']:.3f} | {v['share_at_3h_median']:.3f} | "
                   f"{v['total_server_s_median']:,.0f} | "
                   f"{safe.get('unsafe', '-')} of {safe.get('checked', '-')} | "
                   f"{'-' if share is None else format(share, '.2f')} |")
    out += ["", "Reached: the config it would recommend is within 3% of the best by the "
            "truth and its cap passes the long run (auto_tune.sh: its pick, unchecked, as "
            "issue 32 compares it; its cap's check is in its own column)."]
    names = [sc["name"] for sc in d["scenarios"]]
    none = {"low": None, "high": None}
    out += ["", "Per scenario, median server s to within 3%:", "",
            "| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for m, v in d["methods"].items():
        out.append(f"| {m} | " + " | ".join(fmt_bound(v["per_scenario"].get(n, none))
                                           for n in names) + " |")
    out += ["", *answer_lines(d), *twin_lines(d),
            *(grid_floor_lines(d) if "twin" in d["methods"] else []), *headlines(d)]
    out += ["", "Every ratio (bounds where runs never reached): " + "; ".join(
        f"{k} {fmt_bound(r, '.2f')}" for k, r in d["ratios"].items())]
    pre = [r["prescreen"] for r in d["per_run"] if r.get("prescreen")]
    if pre:
        cpu = quantile([p["cpu_s"] for p in pre], 0.5)
        out.append(f"Pre-screen: {len(pre)} runs, median {cpu:.0f}"
                   f" CPU s each (mis-specified profile {MISSPEC}).")
    return out


def provenance(d: Mapping[str, Any]) -> list[str]:
    """Which run each method's rows come from, and how long the runs took."""
    z = d["sizes"]
    wall = (f"wall {d['total_wall_s'] / 60:.1f} min with {z['jobs']} processes"
            + ("" if d.get("wall_s_since_first_task") is None else
               f" ({d['wall_s_since_first_task'] / 60:.1f} min since its first task, resumed "
               "from a task cache)"))
    head = f"Seeds: {len(z['seeds'])} per scenario x {len(d['scenarios'])} scenarios"
    merged = d.get("merged")
    if not merged:
        return [f"{head}; {wall}."]
    ran = [m for m, src in d["rows_from"].items() if src.startswith("this run")]
    lines = [f"{head}. This run ({d.get('written', '?')}"
             + (f", `{d['command']}`" if d.get("command") else "")
             + f") ran only {', '.join(ran)}: {wall}. The rows of "
             f"{', '.join(merged['methods'])} are an earlier run's, merged unchanged from "
             f"its JSON ({merged['written']}; judged on the same truth at the same sizes, "
             "but run by the code of that day)."]
    if merged.get("total_wall_s") is not None:
        lines[0] += f" That run took {merged['total_wall_s'] / 60:.1f} min" + (
            "" if merged.get("wall_s_since_first_task") is None else
            f" ({merged['wall_s_since_first_task'] / 60:.1f} min since its first task)") + "."
    return lines


def answer_lines(d: Mapping[str, Any]) -> list[str]:
    """When each method answers, and autotune's total beside the grid's (the page's
    ratios are of the time to within 3%)."""
    m = d["methods"]
    if "autotune" not in m:
        return []
    out = ["autotune answers once, when its proof ends: its time to within 3% is its "
           "whole server time, screening, restarts and proof. A grid holds an answer after "
           "every config (its best so far, its cap proven by that config's own ceiling "
           "search), so its time is when that answer is first within 3%, though it cannot "
           "know so before it has tried every config."]
    if "grid_ceiling" in m:
        a, g = m["autotune"]["total_server_s_median"], m["grid_ceiling"]["total_server_s_median"]
        out[0] += (f" Whole runs: autotune {a:,.0f} s, the grid with a ceiling per config "
                   f"{g:,.0f} s ({a / g:.2f} of it), medians.")
    runs: dict[str, set[float]] = {}
    for r in d["per_run"]:
        if r["method"] == "autotune":
            runs.setdefault(r["scenario"], set()).add(round(r["total_server_s"], 3))
    if len(d["sizes"]["seeds"]) > 1 and runs and all(len(v) == 1 for v in runs.values()):
        out[0] += (" Every autotune seed gave the same run: each space (at most 18 configs) "
                   "is smaller than its 30 trials, so it is covered in a fixed order and "
                   "the sampler's seed never draws.")
    return [*out, ""]


def twin_lines(d: Mapping[str, Any]) -> list[str]:
    """The twin's runs: trials, server time, its own CPU and what it learned."""
    rows = [r for r in d["per_run"] if r.get("twin")]
    if not rows:
        return []
    z = d["sizes"]
    cpu = quantile([r["twin"]["cpu_s"] for r in rows], 0.5)
    out = [f"Twin (`autotune search --twin` as the CLI wires it): its prior is the "
           f"mis-specified profile {MISSPEC}; each run stops after {z['twin_trials']} "
           "finished trials as --n-trials counts them (a failed trial does not count; a "
           "run not within 3% by then counts at its total), each pick the best of "
           f"{z['twin_candidates']} simulated trials. Each trial the twin learned from queues "
           "its pick next, its short study seeded by the run's seed and the trial's number "
           "(autotune.study.study_twin.pick_seed). The twin costs "
           f"CPU, not server time: median {cpu:.0f} CPU s per run (refits, picks and "
           "predictions; the 'real' server's simulation not included). Undoing the "
           "mis-specification exactly would take compute x1.25, bandwidth x0.87 and "
           "overheads between x0.67 and x1 (it scaled the per-step overhead, not the "
           "per-sequence one the same factor also moves).", "",
           "| scenario | seed | trials | server s to within 3% | total server s | twin CPU s "
           "| fitted factors (vs the prior) | safe |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda x: (x["scenario"], x["seed"])):
        facs = ", ".join(f"{n} x{v:.2f}" for n, v in r["twin"]["factors"].items()) or "-"
        hit = "never" if r["server_s_to_within"] is None else f"{r['server_s_to_within']:,.0f}"
        out.append(f"| {r['scenario']} | {r['seed']} | {r.get('trials', '-')} | {hit} | "
                   f"{r['total_server_s']:,.0f} | {r['twin']['cpu_s']:.0f} | {facs} | "
                   f"{r.get('safe', '-')} |")
    return [*out, ""]


def near_best(truth: Mapping[str, Any]) -> set[str]:
    """The keys of a scenario's configs whose truth goodput is within 3% of its best."""
    return {c["key"] for c in truth["configs"]
            if c["goodput_tokens"] >= (1 - TOL) * truth["best_goodput_tokens"]}


def grid_floor(d: Mapping[str, Any]) -> dict[str, float]:
    """Per scenario, the grid's cheapest ceiling search of a config whose truth goodput is
    within 3% of the best: what measuring a best config first, as the grid measures a
    config, costs (server s)."""
    out = {}
    for sc, costs in d.get("grid_ceiling_per_config", {}).items():
        near = near_best(d["truth"][sc])
        cheapest = [v["server_s"] for k, v in costs.items() if k in near]
        if cheapest:
            out[sc] = min(cheapest)
    return out


def grid_floor_lines(d: Mapping[str, Any]) -> list[str]:
    """What the twin/grid target asks, set beside the cost of one config's ceiling search
    (the miss explained with this run's figures)."""
    target = TARGETS["twin/grid_ceiling"]
    grid = d["methods"].get("grid_ceiling", {}).get("server_s_to_within_median", {})
    floor = grid_floor(d)
    if grid.get("low") is None or len(floor) < len(d["scenarios"]):
        return []
    per_run = [floor[sc["name"]] for sc in d["scenarios"] for _ in d["sizes"]["seeds"]]
    oracle = quantile(per_run, 0.5)
    costs = ", ".join(f"{sc} {v:,.0f} s" for sc, v in floor.items())
    return [f"What the twin/grid target of {target} asks: {target} x the grid's median "
            f"{grid['low']:,.0f} s = {target * grid['low']:,.0f} s of server time to within "
            f"3%. The grid's ceiling search of the cheapest config within 3% of the best "
            f"cost {costs} (one start and its tests, this run): a search that measured such "
            f"a config first, as the grid measures it, would take a median {oracle:,.0f} s, "
            f"{oracle / grid['low']:.2f} of the grid. Only a trial cheaper than the grid's "
            "search of the same config (the twin's starts at its predicted ceiling) can get "
            "under the target, and only if a best config is among the first measured.", ""]


def headlines(d: Mapping[str, Any]) -> list[str]:
    """The headline lines: '(same run)' only where every figure of a line comes from one
    run (the README quotes those alone), with that run named when it is not this one."""
    z = d["sizes"]
    t = d["targets"]
    runs = f"median over {len(d['scenarios'])} scenarios x {len(z['seeds'])} seeds"
    out = []
    for k in TARGETS:
        if k not in t:
            continue
        head, tail = run_labels(d, k)
        out.append(f"**Headline ({head}): {k} = {fmt_bound(t[k]['ratio'], '.2f')} of the "
                   f"server time to within 3% ({runs}; target <= {t[k]['target']}: "
                   f"{'met' if t[k]['met'] else 'NOT met'}{tail})**")
    if "twin/autotune" in d["ratios"]:
        head, tail = run_labels(d, "twin/autotune")
        out.append(f"**Headline ({head}): twin/autotune = "
                   f"{fmt_bound(d['ratios']['twin/autotune'], '.2f')} of the server time to "
                   f"within 3%, with the twin and without it ({runs}; no target{tail})**")
    if "within_3pct_share" in t:
        w3 = t["within_3pct_share"]
        us = t["unsafe_answers"]
        head, tail = run_labels(d, "autotune")
        out.append(f"**Headline ({head}): autotune came within 3% in "
                   f"{w3['value']:.0%} of {d['methods']['autotune']['runs']} runs "
                   f"(target >= 95%: {'met' if w3['met'] else 'NOT met'}); {us['value']} "
                   f"unsafe answers of {us['checked']} checked in {z['safety_requests']:,}-"
                   f"request runs (target 0: {'met' if us['met'] else 'NOT met'}{tail})**")
    if t.get("cap_share", {}).get("value") is not None:
        cs = t["cap_share"]
        head, tail = run_labels(d, "autotune")
        out.append(f"**Headline ({head}): autotune's recommended cap is a median "
                   f"{cs['value']:.2f} of that config's true ceiling (target >= "
                   f"{cs['target']}: {'met' if cs['met'] else 'NOT met'}{tail})**")
    return out


def run_labels(d: Mapping[str, Any], ratio: str) -> tuple[str, str]:
    """(the headline's label, a note for its end) for the methods of ``ratio`` ('a/b' or
    'a'): 'same run' when all their rows come from one run (noted when an earlier one),
    else which run each came from."""
    src = d.get("rows_from") or {}
    parts = ratio.split("/")
    found = {src.get(m) for m in parts}
    if len(found) > 1:
        return "; ".join(f"{m}: {src.get(m, '?')}" for m in parts), ""
    one = found.pop()
    return "same run", "" if one is None or one.startswith("this run") else f"; rows of {one}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one tiny scenario (seconds)")
    ap.add_argument("--output", type=Path, default=None, help="write the figures as JSON")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per scenario (default 10)")
    ap.add_argument("--jobs", type=int, default=None, help="processes (default 2)")
    ap.add_argument("--only-scenarios", default="", help="comma-separated scenario names")
    ap.add_argument("--task-cache", type=Path, default=None,
                    help="JSONL of finished tasks, reused by a rerun (resume a stopped run)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated methods to run (default: all)")
    ap.add_argument("--merge-with", type=Path, default=None,
                    help="an earlier run's JSON: the rows of the methods not run now come "
                         "from it (same truth and sizes required)")
    ap.add_argument("--truth-cache", type=Path, default=None,
                    help=f"truth JSON (default benchmarks/results/{TRUTH_FILE}; none with "
                         "--smoke)")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        ap.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    # Read before the run: --output may name the same file.
    earlier = None
    if args.merge_with:
        earlier = json.loads(args.merge_with.read_text())
        earlier.setdefault("written", committed_label(args.merge_with))
    sizes = SMOKE if args.smoke else Sizes()
    if args.seeds is not None:
        sizes = dataclasses.replace(sizes, seeds=tuple(range(args.seeds)))
    if args.jobs is not None:
        sizes = dataclasses.replace(sizes, jobs=args.jobs)
    elif args.smoke:
        # One process: a forked pool inside a process that already runs threads (pytest,
        # Optuna's storage) can deadlock on a lock held by a thread that was not copied.
        sizes = dataclasses.replace(sizes, jobs=1)
    cache = args.truth_cache or (None if args.smoke else ROOT / "benchmarks" / "results"
                                 / TRUTH_FILE)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    global SCENARIOS, _TASK_CACHE
    _TASK_CACHE = args.task_cache
    if args.only_scenarios:
        keep = set(args.only_scenarios.split(","))
        SCENARIOS = [s for s in SCENARIOS if s.name in keep]
    try:
        data = run(sizes, cache, methods, earlier)
    except MergeError as exc:
        log(f"--merge-with {args.merge_with}: {exc}")
        return 2
    data["command"] = " ".join(["python", "benchmarks/search_scenarios.py",
                                *(sys.argv[1:] if argv is None else argv)])
    text = json.dumps(json_safe(data), indent=1, allow_nan=False)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.output, text + "\n")
    else:
        print(text)
    for line in markdown(data):
        if line.startswith(("**Headline", "Every ratio")):
            log(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
