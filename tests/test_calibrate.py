"""``autotune calibrate`` against a server whose hardware differs from the profile.

The server is the simulator's HTTP server launched as vLLM (real process, real time,
real HTTP streaming) on a hidden profile: cpu-tiny with compute x0.7, bandwidth x1.2,
host overheads x2 and front end x1.5.  Calibration starts from the shipped cpu-tiny
profile and must find a profile that reproduces what the server measured.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.servers.process import live
from autotune.sim.calibrate import hardware_yaml
from autotune.sim.profiles import load_hardware
from autotune.tuning.twin import apply_factors

runner = CliRunner()
HIDDEN = {"compute": 0.7, "bandwidth": 1.2, "overheads": 2.0, "front_end": 1.5}


def hidden_profile(folder: Path) -> Path:
    prior = load_hardware("cpu-tiny")
    path = folder / "hidden.yaml"
    path.write_text(hardware_yaml(replace(apply_factors(prior, HIDDEN), name="hidden"),
                                  ["the 'real' server of this test"]))
    return path


# Real time: the fit reads the simulator's HTTP server's own timing, and a loaded host
# stalls it.  CI of 2026-12-08 failed here: its saturation test missed the fitted profile
# by more than 25%, as it did here with the server stopped 120 ms in every 1.4 s (the
# short Poisson tests' mean TTFT rose 50-100%, and the fit chased it with the front end).
# The fit now reads TTFT and TPOT over the fastest 90% of requests: with those stalls,
# the worst figure of 4 runs missed by 7-15%, against 14-27% before.
@pytest.mark.xdist_group("vllm")
def test_calibrate_fits_the_hidden_server_and_writes_a_profile_the_simulator_reads(
        tmp_path: Path) -> None:
    server = (f"{sys.executable} -m autotune.sim.serve --profile "
              f"1x{hidden_profile(tmp_path)} --startup-delay-s 0.1")
    out, fit_json = tmp_path / "fitted.yaml", tmp_path / "fit.json"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        res = runner.invoke(app, [
            "calibrate", "--profile", "cpu-tiny:tiny", "--gpus", "1", "--out", str(out),
            "--json", str(fit_json), "--model", "tiny", "--vllm-cmd", server,
            "--param", "max_num_seqs=8", "--param", "max_model_len=512",
            "--dataset", "synthetic", "--input-len", "64", "--output-len", "24",
            "--num-prompts", "60", "--warmup", "6"])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, res.stdout + res.stderr
    assert live() == []  # the server autotune started is gone
    assert "all at once" in res.stdout and "(60 completed; measured)" in res.stdout
    data = json.loads(fit_json.read_text())
    fit = data["fit"]
    assert [t["label"].split(" at ")[0] for t in fit["tests"]] == [
        "saturation", "poisson", "poisson"]
    # The prior misses the saturated throughput and the latencies by tens of percent;
    # the fitted profile reproduces every measured figure of every test far better.  (In
    # real time the server's own HTTP time, which CI's other tests stretch, is part of
    # what is measured: hence a margin, not a match to the hidden factors' figures.)
    sat = fit["tests"][0]
    assert abs(sat["prior_errors"]["output_throughput"]) > 0.3
    for t in fit["tests"]:
        assert all(abs(e) < 0.25 for e in t["errors"].values()), (t["label"], t["errors"])
        assert t["rms_log_error"] < t["prior_rms_log_error"] / 3
    factors = {f["name"]: f for f in fit["factors"]}
    # What these tests identify moves the right way: the hidden host overheads (x2) and
    # front end (x1.5) slow every step and request.
    assert factors["overheads"]["identified"]
    assert 1.5 < factors["overheads"]["value"] < 2.6
    assert factors["front_end"]["value"] > 1.1
    # The profile is one the simulator reads, with the fitted fields.
    fitted = load_hardware(str(out))
    prior = load_hardware("cpu-tiny")
    assert fitted.step_overhead_ms == pytest.approx(
        prior.step_overhead_ms * factors["overheads"]["value"], rel=1e-4)
    assert fitted.step_overhead_ms != prior.step_overhead_ms
