"""One config's ceiling as a library call: ``run_ceiling(CeilingOptions(...))``.

``autotune ceiling`` parses its options (and what ``--study``/``--trial`` inherit) into
one :class:`CeilingOptions` and calls :func:`run_ceiling` once: it builds the backend and
the workload, searches the highest rate that meets the SLO
(:func:`autotune.tuning.ceiling.find_ceiling`), validates the cap, prints every probe
as it ends and writes ``--output``/``--csv``.  Exit code 0 with an answer, 1 when even
the lowest rate tried misses the SLO.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.backends.base import Backend
from autotune.backends.factory import BackendSpec, create_backend, describe, server_backend
from autotune.core.files import atomic_write, check_writable, write_json
from autotune.core.slo import SLO
from autotune.core.terminal import console, err_console
from autotune.servers.process import interrupted_code
from autotune.tuning.ceiling import (
    PROOF_CAP_S,
    BackendProbe,
    CeilingResult,
    Probe,
    check_settings,
    find_ceiling,
    format_seconds,
    lent_evidence,
)
from autotune.tuning.load_unit import RATE, LoadUnit
from autotune.tuning.options import (
    OptionsError,
    RateSearch,
    ServerOptions,
    SimProfile,
    WorkloadOptions,
    at_least,
)
from autotune.tuning.validation import validate_cap
from autotune.tuning.verdict import SteadyState
from autotune.workload.arrivals import trace_offsets, trace_rate
from autotune.workload.pool import PoolOptions, pool_workload
from autotune.workload.sources import pool_size


@dataclass(frozen=True, kw_only=True)
class CeilingOptions:
    """One config's ceiling search, every value parsed: the SLO, the config and where it
    runs, the workload, each probe's steady-state rule, the search, and the outputs."""

    slo: SLO
    backend: str = "sim"  # sim, vllm or attach
    flags: dict[str, Any] = field(default_factory=dict)  # the server config
    profile: SimProfile = field(default_factory=SimProfile)  # the simulator's node
    server: ServerOptions = field(default_factory=ServerOptions)
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    context: int = 8192  # longest prompt + output kept from the dataset
    pool: PoolOptions = field(default_factory=PoolOptions)  # --dataset and its shape
    input_len: int = 256
    output_len: int = 128
    steady: SteadyState = field(default_factory=SteadyState)
    rates: RateSearch = field(default_factory=RateSearch)
    start_rate: float | None = None  # None: a saturation probe first
    unit: LoadUnit = RATE  # what the levels count: req/s, or users of a closed loop
    first_must_pass: bool = False  # a replayed trial's first rate had to beat the best
    max_num_prompts: int = 2400
    repeats: int = 1
    confidence: float = 0.95
    min_rate: float | None = None
    max_rate: float | None = None
    prune: bool = True
    validate_s: float | None = 300.0  # None: no validation run
    output: Path | None = None
    csv_path: Path | None = None
    studies_dir: Path = Path("studies")  # the launched server's logs: ceiling/logs

    def __post_init__(self) -> None:
        if self.unit.by != "rate":
            given = [flag for flag, value in (("--start-rate", self.start_rate),
                                              ("--min-rate", self.min_rate),
                                              ("--max-rate", self.max_rate))
                     if value is not None]
            if given:
                one = len(given) == 1
                raise OptionsError(f"{', '.join(given)} {'takes' if one else 'take'} req/s: "
                                   f"with --by {self.unit.by} the search starts from a "
                                   f"saturation probe; drop {'it' if one else 'them'}, or "
                                   "use --by rate")
        if self.start_rate is not None and not (self.start_rate > 0
                                                and math.isfinite(self.start_rate)):
            raise OptionsError(f"--start-rate must be a finite rate above 0 req/s, got "
                               f"{self.start_rate:g}")
        for flag, value in (("--repeats", self.repeats), ("--input-len", self.input_len),
                            ("--output-len", self.output_len)):
            at_least(flag, value, 1)
        if self.backend == "attach" and self.flags:
            raise OptionsError(
                f"the server at {self.server.url} is attached: autotune cannot restart it "
                f"with {', '.join(sorted(self.flags))}; drop the config flags, or use "
                "--backend vllm")

    @property
    def simulated(self) -> bool:
        return self.backend == "sim"


def run_ceiling(o: CeilingOptions) -> int:
    """Search, validate, print and write; 0 with an answer, 1 without, 130 (or 128 + the
    signal) when interrupted, after saying what was kept."""
    # Fail on search settings before any workload is built or server touched.
    check_settings(o.slo, start_rate=o.start_rate, tol=o.rates.tol,
                   max_probes=o.rates.max_probes, num_prompts=o.workload.num_prompts,
                   max_num_prompts=o.max_num_prompts, repeats=o.repeats,
                   confidence=o.confidence, headroom=o.rates.headroom, min_rate=o.min_rate)
    check_writable(o.output, "--output")
    check_writable(o.csv_path, "--csv")
    backend, where = _backend(o)
    seen: list[Probe] = []  # every probe that ended, kept if the command is interrupted
    result: CeilingResult | None = None
    try:
        # The pool: at least POOL_REQUESTS distinct requests after the warm-up ones, so
        # that the search's tests, each taking up where the last stopped, judge the
        # workload's tail and not a thousand requests' few longest replies again.
        wl = _workload(o)
        pool = list(wl.requests)
        probe = _start_probe(o, backend, where, wl, pool)
        result = _search(o, probe, seen)
        _validate_cap(o, result, backend, probe)
    except (KeyboardInterrupt, SystemExit) as exc:
        code = interrupted_code(exc)
        if code is None:
            raise
        about: dict[str, Any] = {"config": o.flags,
                                 "backend": {"kind": o.backend, "where": where}}
        if result is not None:  # interrupted in the validation: the search is whole
            about = {**result.to_dict(), **about}
        _keep_interrupted(o, seen, about)
        return code
    finally:
        backend.close()
    _drain_notes(probe, result)
    _print_answer(result)
    _write_files(o, result, where, wl, pool)
    return 0 if result.feasible else 1


# ----------------------------------------------------------------------------- build


def _workload(o: CeilingOptions) -> Any:
    w = o.workload
    p = o.pool
    return pool_workload(dataset=p.dataset, tokenizer_path=w.tokenizer,
                         url=o.server.url if o.backend == "attach" else None,
                         model=o.server.model, total=pool_size(w.num_prompts) + w.warmup,
                         seed=w.seed, context=o.context, input_len=o.input_len,
                         output_len=o.output_len, multi_turn=p.multi_turn,
                         prefix_share=p.prefix_share)


def _backend(o: CeilingOptions) -> tuple[Backend, str]:
    """The trial backend and a one-line description of where probes run."""
    if o.simulated:
        node = o.profile
        node.load("simulator profile")
        spec = BackendSpec(kind="sim", hardware=node.node, sim_model=node.model)
        return create_backend(spec), describe(spec)
    s = o.server
    return server_backend(o.backend, url=s.url, model=s.model, vllm_cmd=s.vllm_cmd,
                          env=dict(s.env), log_dir=o.studies_dir / "ceiling" / "logs")


def _start_probe(o: CeilingOptions, backend: Backend, where: str, wl: Any,
                 pool: list[Any]) -> BackendProbe:
    """Say what is measured and how each probe is judged, around building the probe."""
    slo, steady, w = o.slo, o.steady, o.workload
    unit = _unit(o, pool)  # before any line: a trace without timestamps is bad input
    out = console
    out.print(f"ceiling of {o.flags or 'the default config'} on {where}; SLO {slo}; "
              f"workload {wl.source} ({len(pool)} requests, tokens counted with "
              f"{wl.tokenizer}); {w.warmup} warm-up requests per probe excluded"
              + ("; every figure is simulated" if o.simulated else ""), soft_wrap=True)
    closed = unit.closed
    if closed is not None:
        out.print(f"load: a closed loop of {closed.describe()} (each sends its next request "
                  "when its reply ends" + (" and its think time passes" if closed.think_s
                                           else "") + "); the search counts "
                  f"{unit.label}, and its saturation and light-load tests are open loop; "
                  "each user's first request is warm-up too (the loop ramps up until "
                  "every user has sent once)",
                  soft_wrap=True)
    if unit.by == "speed":
        out.print(f"load: the trace's {len(pool)} requests replayed at their logged times "
                  f"({unit.trace_rps:.3g} req/s on average), sped up or slowed down by the "
                  f"level; the first {min(w.warmup, len(pool) - 1)} are the warm-up",
                  soft_wrap=True)
    out.print(header(o.simulated, unit), soft_wrap=True, highlight=False)
    probe = BackendProbe(backend, o.flags, slo, pool, warmup=w.warmup, seed=w.seed,
                         prune=o.prune, steady=steady, unit=unit)
    out.print(f"each probe: at least {steady.min_s(slo):g} s of arrivals before it may "
              f"pass, up to {_cap_phrase(steady, slo)}, stopped when its steady-state "
              f"verdict is certain; each limit passes when a sequential test shows "
              f"its exceedance under the percentile's allowance (at most "
              f"{1 - steady.confidence:.0%} false passes)", soft_wrap=True)
    return probe


def _unit(o: CeilingOptions, pool: Sequence[Any]) -> LoadUnit:
    """The search's unit; a trace replay learns its trace's rate from the pool."""
    if o.unit.by != "speed":
        return o.unit
    if any(r.arrival_s is None for r in pool):
        raise OptionsError("--by speed replays a trace at its logged times: give "
                           "--dataset FILE whose requests have a timestamp")
    try:
        trace_offsets(pool, 1.0)
    except ValueError as exc:
        raise OptionsError(f"--by speed: {exc}") from None
    return replace(o.unit, trace_rps=trace_rate(pool))


def _cap_phrase(steady: SteadyState, slo: SLO) -> str:
    if steady.max_duration_s is not None:
        return f"{steady.max_s(slo):g} s"
    return (f"what its rate needs ({steady.decide_n(slo)} judged requests pass a safe "
            f"rate 80% of the time), between {steady.max_s(slo):g} and "
            f"{steady.hard_cap_s(slo):g} s")


# ----------------------------------------------------------------------------- search


def _search(o: CeilingOptions, probe: BackendProbe, seen: list[Probe]) -> CeilingResult:
    """Run the rate search, printing and keeping each probe as it ends."""
    slo, steady = o.slo, o.steady

    def on_probe(p: Probe) -> None:
        seen.append(p)
        console.print(probe_line(p, o.simulated, probe.unit), soft_wrap=True,
                      highlight=False)

    return find_ceiling(
        probe, slo=slo, start_rate=o.start_rate, tol=o.rates.tol,
        max_probes=o.rates.max_probes, first_must_pass=o.first_must_pass, then_down=True,
        num_prompts=o.workload.num_prompts, max_num_prompts=o.max_num_prompts,
        repeats=o.repeats, confidence=o.confidence, headroom=o.rates.headroom,
        min_rate=o.min_rate, max_rate=o.max_rate,
        lowest_rate=steady.lowest_rate(slo),
        on_probe=on_probe,
        proof_cap_s=PROOF_CAP_S if steady.max_duration_s is None else steady.max_s(slo),
        unit=probe.unit)


def _validate_cap(o: CeilingOptions, result: CeilingResult, backend: Backend,
                  probe: BackendProbe) -> None:
    """Validate the cap with its own run, unless the proof already ran long at a rate
    above it."""
    if not (o.validate_s and result.recommended_cap):
        return
    if result.proof is not None:
        # A run of a few minutes at the cap cannot decide near the floor; the proof
        # is already the long run, at a rate above the cap.
        result.notes.append(
            f"no separate validation: the proof is the long run ("
            f"{_proof_span(result)} of arrivals at "
            f"{result.unit.fmt(result.feasible_max or math.nan)}, "
            f"above the cap)")
        return
    cap = float(result.recommended_cap)
    console.print(f"validating the cap {result.unit.fmt(cap)} for {o.validate_s / 60:g} min"
                  + (" (virtual time)" if o.simulated else ""), soft_wrap=True)
    result.validation = validate_cap(
        backend, o.flags, cap, probe.plan(o.workload.num_prompts, 0, cap),
        duration_s=o.validate_s, prior_for=lambda rate: lent_evidence(result.probes, rate),
        on_run=lambda r: console.print(f"  {result.unit.fmt(r.rate)}: {r.verdict} "
                                       f"({r.requests} requests judged)", soft_wrap=True,
                                       highlight=False))


def _proof_span(result: CeilingResult) -> str:
    proof = next(p for p in result.probes if p.phase == "proof")
    return format_seconds(proof.evidence.at_s if proof.evidence is not None else math.nan)


# ----------------------------------------------------------------------------- output


def _keep_interrupted(o: CeilingOptions, probes: Sequence[Probe], about: dict[str, Any]
                      ) -> None:
    """One line saying what an interrupted search keeps: with ``--output``, every probe
    that ended, written there; without, nothing on disk."""
    if o.output is None:
        err_console.print(f"interrupted after {len(probes)} probes: nothing kept (no "
                          "--output was given)", soft_wrap=True)
        return
    write_json(o.output, {"interrupted": True, "feasible": None, **about,
                          "total_probes": len(probes),
                          "probes": [p.to_dict() for p in probes]})
    err_console.print(f"interrupted after {len(probes)} probes: each one's evidence is "
                      f"kept in {o.output}", soft_wrap=True)


def _drain_notes(probe: BackendProbe, result: CeilingResult) -> None:
    """Note how the server was drained between probes, since it bears on each figure."""
    if probe.drain_note:
        result.notes.append(probe.drain_note)
    elif probe.drain:
        result.notes.append(
            f"between probes the server drained: /metrics showed vllm:num_requests_running "
            f"and vllm:num_requests_waiting both 0 ({probe.drain_s:.1f} s waited in all)")


def _print_answer(result: CeilingResult) -> None:
    """Print the answer and its details, on stderr when no rate met the SLO."""
    out = console if result.feasible else err_console
    out.print(result.sentence(), soft_wrap=True, highlight=False)
    for line in details(result):
        out.print(line, soft_wrap=True, highlight=False)


def _write_files(o: CeilingOptions, result: CeilingResult, where: str, wl: Any,
                 pool: list[Any]) -> None:
    """Keep every probe's evidence in --output and --csv, answer or not."""
    if o.output is not None:
        data = result.to_dict()
        data["config"] = o.flags
        data["backend"] = {"kind": o.backend, "where": where}
        data["workload"] = {"source": wl.source, "tokenizer": wl.tokenizer,
                            "requests": len(pool), "notes": list(wl.notes),
                            "warmup_per_probe": o.workload.warmup, "seed": o.workload.seed}
        write_json(o.output, data)
        console.print(f"wrote {o.output}")
    if o.csv_path is not None:
        atomic_write(o.csv_path, probes_csv(result))
        console.print(f"wrote {o.csv_path}")


CSV_COLUMNS = (
    "index", "phase", "rate", "num_prompts", "num_measured", "verdict", "pruned",
    "prune_reason", "request_throughput", "output_throughput", "binding", "limit",
    "observed_s", "bound_s", "threshold_s", "gpu_util", "server_s", "repeat", "source",
    "unit",  # what "rate" counts: req/s, in flight, users, x the trace's speed
)


def _s(x: float) -> str:
    return format_seconds(x).replace(" ", "")


def probe_line(p: Any, simulated: bool, unit: LoadUnit = RATE) -> str:
    """One probe as a table row (printed as it finishes)."""
    rate = ("inf" if math.isinf(p.rate) else f"{p.rate:.0f}" if unit.whole
            else f"{p.rate:.3f}")
    if unit.by == "speed" and math.isfinite(p.rate):
        rate = f"x{p.rate:.3f}"
    lims = "  ".join(f"{c.label} {_s(c.observed_s)} (≤{_s(c.bound_s)})" for c in p.checks)
    util = "-" if p.gpu_util is None else f"{p.gpu_util:.0%}"
    verdict = {"pass": "PASS"}.get(p.verdict, p.verdict)
    ev = p.evidence
    secs = "-" if ev is None else f"{ev.at_s:.0f}"
    why = ""
    if p.pruned:
        why = f"pruned: {p.prune_reason.split(':', 1)[0]}"
    elif ev is not None and p.verdict != "pass":
        why = ev.reasons[0][:90]
    return (f"{p.index + 1:>3} {p.phase:<11} {rate:>9} {p.num_measured:>6} {secs:>5} "
            f"{p.request_throughput:>8.2f} {p.output_throughput:>9.0f}  {lims:<40} "
            f"{util:>5}{'*' if simulated and p.gpu_util is not None else ' '} "
            f"{verdict:<12} {why}").rstrip()


def header(simulated: bool, unit: LoadUnit = RATE) -> str:
    column = unit.by if unit.by in ("rate", "speed") else unit.label
    how = "simulated, virtual time" if simulated else "measured over HTTP"
    return (f"probes ({how}; n = requests judged, s = seconds of arrivals; P99 with its "
            "one-sided 95% upper bound in parentheses; req/s and tok/s: vLLM's throughput "
            "over each probe's judged requests, i.e. completed / (first send to last "
            "completion), so the drain of a long-latency probe reads under its rate "
            "even when it keeps up (the verdict judges keeping up); warm-up excluded; "
            "GPU = mean utilization, * = the "
            "simulator's busy share)\n"
            f"{'#':>3} {'phase':<11} {column:>9} {'n':>6} "
            f"{'s':>5} {'req/s':>8} {'tok/s':>9}  "
            f"{'latency (bound)':<40} {'GPU':>5}  result")


def probes_csv(result: Any) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for p in result.probes:
        for c in p.checks:
            w.writerow([
                p.index, p.phase, p.rate, p.num_prompts, p.num_measured, p.verdict,
                p.pruned, p.prune_reason or "", p.request_throughput, p.output_throughput,
                p.binding or "", c.label, c.observed_s, c.bound_s, c.threshold_s,
                "" if p.gpu_util is None else p.gpu_util,
                "" if p.server_s is None else p.server_s, p.repeat, result.source,
                result.unit.label])
    return buf.getvalue()


def details(result: Any) -> list[str]:
    """The lines after the answer: bracket, cost, the step-down comparison, notes."""
    lines = []
    unit = "virtual" if result.simulated else "wall"
    cost = "" if result.server_s is None else f", {result.server_s:.0f} s server time ({unit})"
    level = result.unit.fmt if result.unit.by != "rate" else (lambda x: f"{x:.3f} req/s")
    if result.feasible_max is not None:
        hi = ("none found" if result.infeasible_min is None
              else level(result.infeasible_min))
        lines.append(
            f"ceiling: feasible_max {level(result.feasible_max)}, infeasible_min {hi} "
            f"({'converged' if result.converged else 'not converged'} to tol "
            f"{result.tol:.1%}); binding limit {result.binding}; "
            f"{result.search_probes} search probes + "
            f"{len(result.probes) - result.search_probes} others (saturation, light-load "
            f"floor, repeats){cost}")
    if result.saturated_throughput is not None and result.stepdown_probes is not None:
        lines.append(
            f"for comparison: a 1 req/s step-down from the saturated throughput "
            f"{result.saturated_throughput:.2f} req/s ({result.saturated_how}), as vLLM's "
            f"auto_tune.sh does it, needs {result.stepdown_probes} load tests and ends at "
            + ("no passing rate" if result.stepdown_rate is None else
               f"{result.stepdown_rate:g} req/s "
               f"({1 - result.stepdown_rate / result.feasible_max:.0%} below feasible_max)"))
    for sp in result.spread:
        lines.append(
            f"repeats at {sp.rate:.3f} req/s: {sp.passes}/{sp.runs} passed; {sp.label} "
            f"{_s(sp.observed_min_s)}..{_s(sp.observed_max_s)}, bound "
            f"{_s(sp.bound_min_s)}..{_s(sp.bound_max_s)}, req/s "
            f"{sp.throughput_min:.2f}..{sp.throughput_max:.2f}")
    lines += [f"note: {n}" for n in result.notes]
    return lines
