"""The pure parts of ``benchmarks/sim_fidelity.py``: fitting the front end and the engine
from calibration measurements, the targets, the headline, and the --model choice.

The measurements are made from a known profile (the simulator's own cost model, known
front-end costs and share, a known background wait), so the fit must give them back.
The benchmark's runs on real vLLM are in tests/test_sim_calibrate.py.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autotune.sim import load_hardware, load_model  # noqa: E402
from autotune.sim.calibrate import StepSample, predict  # noqa: E402
from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import sim_fidelity as fid  # noqa: E402

TINY = load_model("tiny")
CPU = load_hardware("cpu-tiny")
TRUTH = replace(CPU, compute_efficiency=0.5, step_overhead_ms=3.0, per_seq_overhead_us=150.0)
REQUEST_S, TOKEN_S, SHARE, BACKGROUND = 6e-3, 150e-6, 0.25, 0.1
OUTPUT = 128


def decode_runs(batch: int, context: float, rounds: int = 3) -> list[dict[str, float]]:
    """Runs of one decode shape as ``shape_run`` reports them, from the truth: the engine
    step plus the front end's part, the API server's CPU, and the engine's wait (other
    work x wall + share x API CPU)."""
    engine = float(predict([StepSample.decode(batch, context, 1.0)], TRUTH, TINY)[0])
    step = engine + SHARE * batch * TOKEN_S
    api = REQUEST_S * batch + TOKEN_S * batch * OUTPUT
    wall = step * OUTPUT * (1 + 0.1 * batch)  # runs differ in API CPU per wall second
    return [{"step_s": step, "client_tpot_s": step, "engine_steps": OUTPUT,
             "tokens_per_step": batch, "requests": batch, "output_tokens": batch * OUTPUT,
             "wall_s": wall, "api_cpu_s": api,
             "engine_wait_s": BACKGROUND * wall + SHARE * api}] * rounds


def calibration() -> dict[str, Any]:
    """What ``measure_steps`` would return on a server that behaves as the truth."""
    decode = [{"batch": b, "prompt_tokens": p, "output_tokens": OUTPUT,
               "mean_context": p + OUTPUT / 2, **fid.shape_row(decode_runs(b, p + OUTPUT / 2))}
              for b, p in [(1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (4, 480), (16, 480)]]
    prefill = []
    for p in (16, 64, 256, 512, 896):
        step = float(predict([StepSample.prefill(p, 1.0)], TRUTH, TINY)[0])
        prefill.append({"prompt_tokens": p, "served_prompt_tokens": p, "step_s": step,
                        "client_ttft_s": step + REQUEST_S + TOKEN_S,
                        "front_end_s": REQUEST_S + TOKEN_S})
    intake_run = {**decode_runs(16, 40.0, 1)[0], "requests": 64, "output_tokens": 64 * 16,
                  "api_cpu_s": 64 * REQUEST_S + 64 * 16 * TOKEN_S}
    intake = {"batch": 16, "prompt_tokens": 32, "output_tokens": 16,
              **fid.shape_row([intake_run] * 3)}
    return {"decode": decode, "prefill": prefill, "intake": intake}


# ----------------------------------------------------------------------------- fitting


def test_front_end_samples_are_the_api_cpu_of_every_run_at_the_largest_batch() -> None:
    samples = fid.front_end_samples(calibration())
    assert len(samples) == 3 * 3  # x16 short, x16 long, intake; three rounds each
    assert all(s.label.startswith("API CPU") and "(16 at once)" in s.label for s in samples)
    intake = [s for s in samples if s.requests == 64]
    assert len(intake) == 3 and intake[0].output_tokens == 64 * 16
    assert intake[0].seconds == pytest.approx(64 * REQUEST_S + 64 * 16 * TOKEN_S)


def test_front_end_samples_skip_runs_without_figures() -> None:
    cal = calibration()
    cal["intake"]["api_cpu_s_runs"] = [math.nan, 0.5, math.nan]  # no schedstat twice
    assert len(fid.front_end_samples(cal)) == 6 + 1


def test_first_token_check_says_what_the_front_end_does_not_hold() -> None:
    cal = calibration()
    check = fid.first_token_check(cal, REQUEST_S, TOKEN_S)
    assert check is not None and check["probes"] == 5
    assert check["unmodelled_s"] == pytest.approx(0.0, abs=1e-12)
    for p in cal["prefill"]:
        p["front_end_s"] += 0.003  # 3 ms of IPC and HTTP on the way
    cal["prefill"][0]["front_end_s"] = math.nan
    check = fid.first_token_check(cal, REQUEST_S, TOKEN_S)
    assert check is not None and check["probes"] == 4
    assert check["unmodelled_s"] == pytest.approx(0.003)
    for p in cal["prefill"]:
        p["front_end_s"] = math.nan
    assert fid.first_token_check(cal, REQUEST_S, TOKEN_S) is None


def test_engine_share_recovers_share_and_background() -> None:
    share = fid.engine_share(calibration()["decode"])
    assert share is not None
    assert share["share"] == pytest.approx(SHARE, rel=1e-9)
    assert share["background"] == pytest.approx(BACKGROUND, rel=1e-9)
    assert share["runs"] == 21 and share["dof"] == 19 and share["se"] < 1e-9


def test_engine_share_is_held_to_one_and_says_what_it_was() -> None:
    rows = calibration()["decode"]
    for row in rows:
        row["engine_wait_s_runs"] = [3.0 * a for a in row["api_cpu_s_runs"]]
    share = fid.engine_share(rows)
    assert share is not None and share["share"] == 1.0
    assert share["unclipped"] == pytest.approx(3.0)


def test_engine_share_needs_runs_that_tell_background_from_front_end() -> None:
    rows = calibration()["decode"][:1]
    rows[0] = {**rows[0], "wall_s_runs": rows[0]["wall_s_runs"][:1],
               "api_cpu_s_runs": rows[0]["api_cpu_s_runs"][:1],
               "engine_wait_s_runs": rows[0]["engine_wait_s_runs"][:1]}
    assert fid.engine_share(rows) is None  # one run
    same = calibration()["decode"][:1]  # three runs, each with the same API CPU per second
    assert fid.engine_share(same) is None
    nan = calibration()["decode"]
    for row in nan:
        row["engine_wait_s_runs"] = [math.nan] * len(row["engine_wait_s_runs"])
    assert fid.engine_share(nan) is None


def test_engine_only_step_takes_out_what_the_simulator_adds_back() -> None:
    assert fid.engine_only_step(0.010, 16, 0.25, 150e-6) == pytest.approx(0.010 - 0.0006)
    assert fid.engine_only_step(0.010, 1, 0.0, 150e-6) == 0.010
    assert fid.engine_only_step(0.010, 16, 1.0, 5e-3) == pytest.approx(0.001)  # floor


def test_fit_profile_recovers_engine_and_front_end() -> None:
    engine, hw, front = fid.fit_profile(calibration(), CPU, TINY)
    assert hw.frontend_request_ms == pytest.approx(REQUEST_S * 1e3, rel=1e-6)
    assert hw.frontend_token_us == pytest.approx(TOKEN_S * 1e6, rel=1e-6)
    assert hw.frontend_engine_share == pytest.approx(SHARE, rel=1e-6)
    assert front["fitted"] == ["frontend_engine_share", "frontend_request_ms",
                               "frontend_token_us"]
    assert not front["notes"]
    assert front["first_token"]["unmodelled_s"] == pytest.approx(0.0, abs=1e-9)
    # The engine was fitted to the steps less the front end's part: the simulator's
    # step (cost model + share x batch x token cost) is the measured one again.
    assert engine.r2 > 0.999
    for d, part in zip(calibration()["decode"], front["decode_part_s"], strict=True):
        assert part == pytest.approx(SHARE * d["batch"] * TOKEN_S)
        model = float(predict([StepSample.decode(d["batch"], d["mean_context"], 1.0)],
                              hw, TINY)[0])
        assert model + part == pytest.approx(d["step_s"], rel=0.02)
    json.dumps(fid._jsonable(front))  # JSON-ready


def test_fit_profile_keeps_the_profile_share_when_the_waits_cannot_tell() -> None:
    """Other work on the machine swamps the engine's wait (runs alternately 1 s over and
    under): the share's standard error is over SHARE_SE_MAX, the profile's share stays,
    and the page says what was measured and that it was not used."""
    cal = calibration()
    for row in cal["decode"]:
        row["engine_wait_s_runs"] = [w + (1.0 if i % 2 else 0.0)
                                     for i, w in enumerate(row["engine_wait_s_runs"])]
    _, hw, front = fid.fit_profile(cal, CPU, TINY)
    assert front["share"]["se"] > fid.SHARE_SE_MAX and not front["share"]["identified"]
    assert hw.frontend_engine_share == CPU.frontend_engine_share
    assert "frontend_engine_share" not in front["fitted"]
    assert any("NOT identified" in n for n in front["notes"])
    # The engine's steps lose the part the simulator adds back with the share it uses.
    assert front["decode_part_s"][-1] == pytest.approx(
        CPU.frontend_engine_share * 16 * TOKEN_S, rel=1e-6)
    text = "\n".join(fid._md_front({"prefill": cal["prefill"], "front_end": front}))
    assert "NOT used" in text and "NOT identified" in text


def test_a_share_on_few_runs_is_not_used() -> None:
    """Three runs (a smoke run) leave 1 degree of freedom: however small the standard
    error comes out, it is no evidence; the profile's share stays."""
    cal = calibration()
    for row in cal["decode"]:
        for key in ("wall_s_runs", "api_cpu_s_runs", "engine_wait_s_runs"):
            row[key] = row[key][:1]
    cal["decode"] = cal["decode"][:3]
    _, hw, front = fid.fit_profile(cal, CPU, TINY)
    assert front["share"]["dof"] == 1 and front["share"]["se"] < 1e-6
    assert not front["share"]["identified"]
    assert hw.frontend_engine_share == CPU.frontend_engine_share


def test_fit_profile_keeps_the_profile_where_the_front_end_cannot_be_fitted() -> None:
    cal = calibration()
    for row in [*cal["decode"], cal["intake"]]:
        row["api_cpu_s_runs"] = [math.nan] * len(row["api_cpu_s_runs"])
        row["engine_wait_s_runs"] = [math.nan] * len(row["engine_wait_s_runs"])
    _, hw, front = fid.fit_profile(cal, CPU, TINY)
    assert (hw.frontend_request_ms, hw.frontend_token_us, hw.frontend_engine_share) == (
        CPU.frontend_request_ms, CPU.frontend_token_us, CPU.frontend_engine_share)
    assert front["fitted"] == [] and len(front["notes"]) == 2
    # The first token is checked against the profile's front end then.
    assert front["first_token"]["model_s"] == pytest.approx(
        CPU.frontend_request_ms * 1e-3 + CPU.frontend_token_us * 1e-6)
    comments = fid.profile_comments({"machine": {}, "calibration": {"front_end": front}},
                                    bandwidth_fitted=False)
    assert comments["frontend_engine_share"].startswith("NOT fitted")


# ----------------------------------------------------------------------------- targets


def rate(tput: float, e2e: float, ttft: float | None, drift: float | None = 1.0
         ) -> dict[str, Any]:
    return {"error": {"output_throughput": tput, "e2e_p99": e2e, "ttft_p99": ttft},
            "reference_vs_calibration": drift,
            "sim": {"simulated_s_per_cpu_s": 500.0}}


def test_targets_met_names_all_three() -> None:
    assert fid.targets_met(rate(0.05, -0.15, 0.149)["error"]) == {
        "throughput": True, "e2e_p99": True, "ttft_p99": True}
    assert fid.targets_met(rate(-0.051, 0.2, -0.16)["error"]) == {
        "throughput": False, "e2e_p99": False, "ttft_p99": False}
    # No TTFT measured (every first chunk empty): the target is not met.
    assert not fid.targets_met(rate(0.0, 0.0, None)["error"])["ttft_p99"]
    assert not fid.targets_met(rate(0.0, 0.0, math.nan)["error"])["ttft_p99"]


def test_drift_over_errors_names_the_misses_the_machine_could_explain() -> None:
    # The machine ran 27% slower than calibrated: a 10% throughput miss and a 20% TTFT
    # miss are within that drift, a 50% E2E miss is not.
    assert fid.drift_over_errors(rate(0.10, -0.5, 0.2, 1.27)) == ["throughput", "ttft_p99"]
    assert fid.drift_over_errors(rate(0.10, -0.5, 0.2, 0.73)) == ["throughput", "ttft_p99"]
    assert fid.drift_over_errors(rate(0.01, 0.0, 0.0, 1.27)) == []  # nothing missed
    assert fid.drift_over_errors(rate(0.10, -0.5, 0.2, None)) == []


def test_headline_takes_the_largest_error_per_target() -> None:
    data = {"label": "tiny", "rates": [rate(0.02, -0.1, 0.05, 0.95),
                                       rate(-0.14, -0.5, None, 1.27)]}
    h = fid.headline(data)
    assert h["throughput_error_max"] == pytest.approx(0.14)
    assert h["e2e_p99_error_max"] == pytest.approx(0.5)
    assert h["ttft_p99_error_max"] == pytest.approx(0.05)
    assert h["targets_met"] == {"throughput": False, "e2e_p99": False, "ttft_p99": False}
    assert h["rates_meeting_all"] == 1 and h["rates"] == 2
    assert (h["drift_min"], h["drift_max"]) == (0.95, 1.27)
    assert h["rates_drift_over_error"] == 1  # the 14% throughput miss, 27% drift
    line = fid.headline_line(h)
    assert line.startswith("**Headline (same run): tiny: throughput error max 14.0%")
    assert "P99 E2E error max 50.0%" in line and "P99 TTFT error max 5.0%" in line
    assert "(targets 5% / 15% / 15%)" in line and "1 of 2 rates meet all three" in line
    assert "0.95-1.27x the calibration's" in line and "at 1 rate(s)" in line
    assert line.endswith(".**")
    assert fid.headline({"rates": []}) == {}


def test_silent_share_counts_requests_whose_tokens_did_not_all_send_text() -> None:
    from autotune.core.records import RequestRecord

    def rec(chunks: int, tokens: int, error: str | None = None) -> RequestRecord:
        return RequestRecord(index=0, scheduled_s=0.0, sent_s=0.0, end_s=1.0,
                             chunk_times_s=[0.1] * chunks, output_tokens=tokens, error=error)

    records = [rec(4, 4), rec(3, 4), rec(4, 4), rec(0, 4, "http 500"), rec(1, 1)]
    assert fid.silent_share(records) == pytest.approx(1 / 13)  # 1 of 13 tokens, errors out
    assert fid.silent_share([rec(0, 4, "timeout")]) is None


def test_met_cell_says_each_target_and_the_drift() -> None:
    cell = fid._met_cell(rate(0.10, -0.5, 0.01, 1.27))
    assert cell == "tput NO (drift larger), P99 E2E NO, P99 TTFT yes"


# ----------------------------------------------------------------------------- models


def test_model_names_resolve_through_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("AUTOTUNE_SMOLLM_MODEL", str(tmp_path / "smol"))
    monkeypatch.delenv("AUTOTUNE_TINY_MODEL", raising=False)
    assert fid.model_folder("smollm2")[0] == str(tmp_path / "smol")
    assert fid.model_folder(None)[0] == str(ROOT / ".cache" / "tiny-llama")
    assert fid.model_folder("/some/where")[0] == "/some/where"
    assert [fid.default_label(m) for m in (None, "smollm2", "/x/my-model/")] == [
        "tiny", "smollm2", "my-model"]
    py = tmp_path / "python"
    py.write_text("")
    monkeypatch.setenv("AUTOTUNE_VLLM_PYTHON", str(py))
    reason = fid.vllm_paths("smollm2")
    assert isinstance(reason, str) and "setup_vllm_cpu.sh --smollm" in reason
    (tmp_path / "smol").mkdir()
    (tmp_path / "smol" / "config.json").write_text("{}")
    assert fid.vllm_paths("smollm2") == (str(py), str(tmp_path / "smol"))


def test_plan_sizes_itself_for_the_model() -> None:
    assert fid.plan_for(TINY.num_params, smoke=False) is fid.FULL
    assert fid.plan_for(TINY.num_params, smoke=True) is fid.SMOKE
    small = fid.plan_for(135e6, smoke=False)
    assert small is fid.FULL_SMALL and small.rounds < fid.FULL.rounds
    assert fid.plan_for(135e6, smoke=True) is fid.SMOKE_SMALL
    for plan in (fid.FULL, fid.SMOKE, fid.FULL_SMALL, fid.SMOKE_SMALL):
        assert plan.fractions and plan.intake_requests >= max(plan.batches)


def test_smollm2_is_its_own_benchmark_entry(tmp_path: Path) -> None:
    """A second entry of the same script: its own JSON, its own section, rendered by
    sim_fidelity's own markdown; without the model it says skipped and exits 0."""
    b = {x.name: x for x in bench_main.BENCHMARKS}["sim_fidelity_smollm2"]
    assert b.script == "sim_fidelity.py" and b.module == "sim_fidelity"
    out = tmp_path / "sim_fidelity_smollm2.json"
    for smoke in (True, False):
        cmd = bench_main.command_for(b, smoke, out)
        assert cmd[2:6] == ["--model", "smollm2", "--label", "smollm2"]
        assert ("--smoke" in cmd) == smoke and "--write-profile" not in cmd
    env = {"AUTOTUNE_SMOLLM_MODEL": str(tmp_path / "none"),
           "AUTOTUNE_VLLM_PYTHON": os.environ.get("AUTOTUNE_VLLM_PYTHON", sys.executable)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        page = tmp_path / "RESULTS.md"
        rc = bench_main.main(["--smoke", "--only", "sim_fidelity_smollm2", "--json-dir",
                              str(tmp_path), "--results", str(page), "--no-readme"])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = page.read_text()
    assert rc == 0, text
    assert json.loads(out.read_text())["skipped"] is True
    assert "## 6b. Simulator fidelity against real vLLM on this CPU: SmolLM2-135M" in text
    assert "Skipped (smollm2): real vLLM not set up" in text


# ----------------------------------------------------------------------------- page, profile


def run_data() -> tuple[dict[str, Any], Any, Any]:
    """A whole run's JSON as ``main`` writes it, from the fit of ``calibration()`` and
    two made-up rates (every figure the page and the profile header read)."""
    cal = calibration()
    engine, hw, front = fid.fit_profile(cal, CPU, TINY)
    load = {"loadavg_1_5_15": [0.5, 0.5, 0.5], "nproc": 2, "busy_processes": [],
            "at": "2026-12-05 08:00:00 UTC"}
    figures = {"output_throughput": 1000.0, "e2e_p99_s": 1.0, "ttft_p99_s": 0.05,
               "engine_s_per_decode_token": 0.005}
    rates = []
    for frac, drift in ((0.5, 1.02), (1.3, 1.2)):
        real = {**figures, "wall_s": 30.0, "cpu_cores": {"engine_core": 1.0,
                                                         "server_1": 0.3, "client": 0.1},
                "silent_token_share": 0.12}
        sim = {**figures, "output_throughput": 1000.0 * (1 + frac / 10), "cpu_s": 0.1,
               "simulated_s_per_cpu_s": 300.0}
        rates.append({"rate_req_s": 10 * frac, "fraction_of_knee": frac, "real": real,
                      "sim": sim, "error": {"output_throughput": frac / 10, "e2e_p99": 0.0,
                                            "ttft_p99": -0.18},
                      "reference_vs_calibration": drift, "speed_vs_real": 300.0})
    data = {
        "skipped": False, "label": "tiny", "command": "python benchmarks/sim_fidelity.py",
        "model": {"path": "/models/tiny", "params": TINY.num_params, "dtype": "bfloat16"},
        "server": {"startup_s": 20.0, "env": fid.ENV, "vllm_version": "0.32.0"},
        "calibration": {"wall_s": 30.0, "machine_cpu_pct": {"nice": 0.0, "steal": 0.0},
                        **cal, "fit": engine.to_dict(), "front_end": front,
                        "previous": {k: getattr(CPU, k) for k in [*engine.fitted_fields(),
                                                                   *fid.FRONT_END_FIELDS]},
                        "fitted_profile": {k: getattr(hw, k) for k in
                                           [*engine.fitted_fields(), *fid.FRONT_END_FIELDS]}},
        "knee": {"request_rate": 10.0, "output_tok_s": 1280.0},
        "validation": {"num_prompts": 500, "warmup": 20, "workload": "synthetic",
                       "arrival": "poisson, seed 11",
                       "flags": {"max_num_seqs": 16, "max_model_len": 1024}},
        "rates": rates, "machine": {"cpu_model": "x86", "cpu_isa": ["avx2"],
                                    "load_at_start": load, "load_at_end": load},
        "total_wall_s": 200.0,
    }
    data["headline"] = fid.headline(data)
    return fid._jsonable(data), engine, hw


def test_markdown_reports_every_part_of_the_run() -> None:
    data, _, _ = run_data()
    text = "\n".join(fid.markdown(data))
    assert text.startswith("Model: tiny (/models/tiny")
    assert "**Engine fit**" in text and "| decode x16 ctx 96 | 16 | 16 |" in text
    assert "**Front end**" in text and "| API CPU: 64 x 32+16 (16 at once) | 3 | 64 |" in text
    assert "First token on the idle server" in text and "0.00 ms of the first token" in text
    assert "frontend_engine_share 0.25" in text and "used." in text
    assert "| P99 TTFT ms | sim P99 TTFT ms | error | targets met |" in text.replace(
        "real P99 TTFT", "P99 TTFT")
    assert "tput NO (drift larger), P99 E2E yes, P99 TTFT NO (drift larger)" in text
    assert "sent no text" in text and "12% at 13.00 req/s" in text
    assert text.count("**Headline (same run): tiny: ") == 1
    json.dumps(data)  # the JSON main writes


def test_written_profile_loads_back_with_the_front_end(tmp_path: Path) -> None:
    data, engine, hw = run_data()
    path = tmp_path / "hardware.cpu-tiny.yaml"
    fid.write_profile(path, data, engine, hw)
    assert data["profile_written"] == str(path)
    back = load_hardware(str(path))
    assert back.frontend_request_ms == pytest.approx(REQUEST_S * 1e3, rel=1e-5)
    assert back.frontend_token_us == pytest.approx(TOKEN_S * 1e6, rel=1e-5)
    assert back.frontend_engine_share == pytest.approx(SHARE, rel=1e-5)
    assert back.step_overhead_ms == pytest.approx(hw.step_overhead_ms, rel=1e-5)
    text = path.read_text()
    line = next(x for x in text.splitlines() if x.startswith("frontend_token_us:"))
    assert "# fitted; +- " in line and "SSE chunk" in line
    assert "Front end (vLLM's API server) FITTED" in text and "NOT fitted" not in line


def test_capacity_gap_sets_the_simulated_knee_beside_the_most_the_server_served() -> None:
    def rate(real_tok_s: float, real_s: float, sim_s: float) -> dict[str, Any]:
        return {"real": {"output_throughput": real_tok_s, "engine_s_per_decode_token": real_s},
                "sim": {"engine_s_per_decode_token": sim_s}}

    data = {"knee": {"output_tok_s": 1000.0},
            "rates": [rate(500.0, 2e-3, 2.1e-3), rate(1100.0, 2.5e-3, 2.75e-3)]}
    g = fid.capacity_gap(data)
    assert g is not None
    assert g["real_max_tok_s"] == 1100.0 and g["gap"] == pytest.approx(0.10)
    assert (g["per_token_min"], g["per_token_max"]) == (pytest.approx(0.05),
                                                        pytest.approx(0.10))
    assert "served up to 1,100 (+10.0%)" in fid.capacity_lines(data)[1]
    assert fid.capacity_gap({"rates": []}) is None
