"""How much load-test time the overload pruner saves, and that the best result stays.

Runs the same simulated study twice, pruning on and off, with the random sampler and
one seed, so both runs try exactly the same (config, rate) sequence: any difference in
the best trial would be the pruner's doing.  Load-test time is virtual seconds of the
measured window (first measured send to last end, or to the abort when pruned), as
the simulator reports it.  Prints a table and one JSON line.

    python benchmarks/pruning_savings.py            # 60 trials, 1000 requests each
    python benchmarks/pruning_savings.py --smoke    # 12 trials, 200 requests each
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from autotune.slo import parse_slo  # noqa: E402
from autotune.space import SearchSpace  # noqa: E402
from autotune.study import StudySettings, run_study, storage_url  # noqa: E402
from autotune.tokenizer import load_tokenizer  # noqa: E402
from autotune.trial import LoadPlan, SimBackend  # noqa: E402
from autotune.workload import load_sharegpt  # noqa: E402


def one_run(prune: bool, *, space: SearchSpace, plan: LoadPlan, n_trials: int, seed: int,
            sampler: str, folder: Path) -> dict[str, object]:
    name = f"prune-{'on' if prune else 'off'}"
    settings = StudySettings(
        name=name, slo=plan.slo, space=space, sampler=sampler,
        storage=storage_url(name, None, folder), studies_dir=folder, gpus=4, seed=seed,
        n_trials=n_trials, prune=prune)
    t0 = time.perf_counter()
    run = run_study(settings, SimBackend("4xa100-80gb", "llama-3-8b"), plan)
    wall = time.perf_counter() - t0
    best = max((r for r in run.rows if r.feasible), key=lambda r: r.value or 0.0)
    pruned = sum(1 for r in run.rows if r.state == "PRUNED")
    per_trial = {r.number: float((r.attrs.get("result") or {}).get("load_test_s") or 0.0)
                 for r in run.rows}
    return {"per_trial": per_trial, "pruned_numbers": [r.number for r in run.rows
                                                       if r.state == "PRUNED"],
            "prune": prune, "load_test_s": run.load_test_s, "wall_s": wall,
            "pruned": pruned, "trials": len(run.rows), "best_trial": best.number,
            "best_value": best.value, "best_params": best.params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a few small trials")
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampler", default="random",
                    help="random keeps both runs on the same trial sequence")
    ap.add_argument("--space", default="default")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.num_prompts = 12, 200
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warm = max(args.num_prompts // 10, 1)
    wl = load_sharegpt(tokenizer=load_tokenizer(), num_prompts=args.num_prompts + warm,
                       max_model_len=8192, seed=args.seed)
    plan = LoadPlan(slo=parse_slo("10s"), requests=wl.requests[warm:],
                    warmup_requests=wl.requests[:warm], warmup=warm, seed=args.seed)
    space = SearchSpace.load(args.space)
    with tempfile.TemporaryDirectory() as tmp:
        on = one_run(True, space=space, plan=plan, n_trials=args.trials, seed=args.seed,
                     sampler=args.sampler, folder=Path(tmp))
        off = one_run(False, space=space, plan=plan, n_trials=args.trials, seed=args.seed,
                      sampler=args.sampler, folder=Path(tmp))
    saved = 1.0 - on["load_test_s"] / off["load_test_s"] if off["load_test_s"] else 0.0
    hit = on["pruned_numbers"]
    hit_on = sum(on["per_trial"][n] for n in hit)
    hit_off = sum(off["per_trial"][n] for n in hit)
    same = on["best_params"] == off["best_params"] and on["best_value"] == off["best_value"]
    print(f"simulated study, space {args.space}, sampler {args.sampler}, seed {args.seed}, "
          f"{args.trials} trials of {len(plan.requests)} measured + {warm} warm-up ShareGPT "
          "requests, SLO p99 e2e <= 10s; load-test time = virtual seconds of the measured "
          "window (to the abort when pruned)")
    print(f"{'pruning':<8} {'load-test s':>12} {'pruned':>7} {'wall s':>7} {'best trial':>10} "
          f"{'best goodput tok/s':>19}")
    for r in (on, off):
        print(f"{'on' if r['prune'] else 'off':<8} {r['load_test_s']:>12.0f} {r['pruned']:>7} "
              f"{r['wall_s']:>7.1f} {r['best_trial']:>10} {r['best_value']:>19,.0f}")
    print(f"pruning saved {saved:.1%} of all load-test time; on the {len(hit)} trials it "
          f"pruned, {hit_off:.0f} s -> {hit_on:.0f} s "
          f"({1 - hit_on / hit_off if hit_off else 0:.1%} saved); best result "
          f"{'unchanged' if same else 'CHANGED'}")
    for r in (on, off):
        r.pop("per_trial")
    print(json.dumps({"saved_share": saved, "pruned_trials_saved_s": hit_off - hit_on,
                      "best_unchanged": same, "on": on, "off": off}, default=str))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
