"""Trace replay: a logged trace's requests sent at their own arrival times, sped up or
slowed down by a factor, and the ceiling in that factor (``ceiling --by speed``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from autotune.backends.base import LoadPlan
from autotune.backends.sim import SimBackend
from autotune.cli import app
from autotune.client.loadgen import LoadGenError, LoadTestConfig, run_load_test_sync
from autotune.core.slo import parse_slo
from autotune.tuning.ceiling import BackendProbe, find_ceiling
from autotune.tuning.load_unit import LoadUnit
from autotune.tuning.verdict import SteadyState
from autotune.workload.arrivals import arrival_offsets, schedule, trace_offsets, trace_rate
from autotune.workload.sources import Request


def _trace(n: int, rate: float, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    times = arrival_offsets(n, rate, seed=seed) + 1000.0  # logged clock: not from zero
    return [Request("x", int(p), int(o), arrival_s=float(t))
            for p, o, t in zip(rng.integers(32, 512, n), rng.integers(16, 256, n), times,
                               strict=True)]


def test_a_trace_is_sent_at_its_own_times_faster_or_slower() -> None:
    trace = _trace(50, 4.0)
    base = trace_offsets(trace, 1.0)
    assert base[0] == 0 and np.all(np.diff(base) >= 0)
    assert np.allclose(trace_offsets(trace, 2.0), base / 2)
    assert np.allclose(schedule(trace, 0.5, process="trace"), base * 2)
    assert trace_rate(trace) == pytest.approx(4.0, rel=1e-9)  # the schedule's own rate
    backwards = [replace(trace[0], arrival_s=5.0), replace(trace[1], arrival_s=4.0)]
    with pytest.raises(ValueError, match="must not go backwards"):
        trace_offsets(backwards, 1.0)
    with pytest.raises(ValueError, match="needs every request's arrival time"):
        trace_offsets([Request("x", 1, 1)], 1.0)


def test_the_load_generator_replays_the_trace_warm_up_included(fake_server) -> None:
    server = fake_server(token_delay_s=0.001)
    trace = _trace(30, 20.0)
    config = LoadTestConfig(url=server.url, rate=2.0, process="trace", warmup=5)
    result = run_load_test_sync(config, trace[5:], warmup_requests=trace[:5])
    records = sorted(result.records, key=lambda r: r.index)
    assert [r.warmup for r in records] == [True] * 5 + [False] * 25
    sched = np.array([r.scheduled_s for r in records])
    assert np.allclose(sched - sched[0], trace_offsets(trace, 2.0), atol=1e-6)
    sent = np.array([r.sent_s for r in records])
    # Never before its time, and spread as the trace is, not all at once.
    assert np.all(sent >= sched - 1e-6)
    assert sent.max() - sent.min() >= 0.9 * (sched.max() - sched.min())
    with pytest.raises(LoadGenError, match="arrival time"):
        run_load_test_sync(LoadTestConfig(url=server.url, process="trace", rate=1.0,
                                          warmup=0), [Request("x", 1, 1)])


def test_a_poisson_trace_sped_up_is_poisson_arrivals_at_the_faster_rate() -> None:
    """Replaying x times faster a trace whose arrivals are a Poisson draw at 1 req/s is
    the same load as that draw at x req/s: in the simulator the two tests agree."""
    slo = parse_slo("4s")
    trace = _trace(600, 1.0, seed=3)
    backend = SimBackend("1xa100-80gb", "llama-3-8b")
    backend.prepare({"max_num_seqs": 32})
    speed = 7.0
    replay = LoadPlan(slo=slo, requests=trace[20:], warmup_requests=trace[:20], warmup=20,
                      process="trace")
    drawn = LoadPlan(slo=slo, requests=trace[20:], warmup_requests=trace[:20], warmup=20,
                     seed=3)
    a = backend.load_test(speed, replay, None).records
    b = backend.load_test(speed, drawn, None).records
    assert replay.offered_rate(speed) == pytest.approx(speed * trace_rate(trace[20:]))
    assert len(a) == len(b) == 600
    for x, y in zip(a, b, strict=True):
        assert x.scheduled_s == pytest.approx(y.scheduled_s, abs=1e-6)
        assert x.end_s == pytest.approx(y.end_s, abs=1e-6)


def test_the_ceiling_by_speed_says_how_fast_the_trace_can_be_replayed() -> None:
    slo = parse_slo("4s")
    steady = SteadyState(min_duration_s=40.0, max_duration_s=120.0)
    trace = _trace(2400, 1.0)  # 40 minutes at 1 req/s: long enough at any speed tried
    unit = LoadUnit(by="speed", trace_rps=trace_rate(trace))
    backend = SimBackend("1xa100-80gb", "llama-3-8b")
    probe = BackendProbe(backend, {"max_num_seqs": 32}, slo, trace, warmup=30,
                         steady=steady, unit=unit)
    result = find_ceiling(probe, slo=slo, start_rate=None, max_probes=10, tol=0.05,
                          num_prompts=300, unit=unit, lowest_rate=None)
    x = result.feasible_max
    assert x is not None and x > 1.0, result.notes
    assert result.sentence().startswith(f"simulated: sustains {unit.fmt(x)}")
    for p in result.probes:
        if p.phase in ("saturation", "floor"):
            continue
        # Every test replays the trace from its start, at the level's speed.
        assert p.evidence.arrival_rate == pytest.approx(p.rate * trace_rate(trace), rel=0.1)
    assert result.stepdown_probes is None  # auto_tune.sh's step-down is in req/s


def _write_trace(path: Path, trace: list[Request]) -> Path:
    with path.open("w") as f:
        for r in trace:
            f.write(json.dumps({"timestamp": 1.7e9 + (r.arrival_s or 0.0),
                                "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens}) + "\n")
    return path


def test_ceiling_by_speed_of_a_users_trace_file(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl", _trace(1500, 1.0, seed=4))
    out = tmp_path / "c.json"
    result = CliRunner().invoke(app, [
        "ceiling", "--backend", "sim", "--profile", "a100-80gb", "--model-profile",
        "llama-3-8b", "--gpus", "1", "--max-num-seqs", "32", "--dataset", str(trace),
        "--by", "speed", "--slo", "p90:e2e<=3s", "--min-duration", "30s", "--max-duration",
        "90s", "--warmup", "30", "--validate", "off", "--output", str(out)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["by"] == "speed" and data["workload"]["requests"] == 1500
    assert "the trace's 1500 requests replayed at their logged times" in result.stdout
    x = data["feasible_max"]
    assert data["answer"].startswith(f"simulated: sustains {x:.2f}x the trace's speed")
    assert f"feasible_max {x:.2f}x the trace's speed" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--by", "speed"], "--by speed replays a trace at its logged times"),
    (["--dataset", "no-such-file.jsonl"], "--dataset no-such-file.jsonl: no such file"),
    (["--by", "speed", "--start-rate", "2"], "--start-rate takes req/s"),
])
def test_bad_trace_options_are_one_line(tmp_path: Path, args: list[str], message: str
                                        ) -> None:
    out = tmp_path / "c.json"
    result = CliRunner().invoke(app, ["ceiling", "--slo-p99", "2s", "--dataset", "synthetic",
                                      *args, "--output", str(out)])
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
