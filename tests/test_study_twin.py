"""``autotune search --twin``: the study's twin learns the server trial by trial.

The "real" server is the simulator in virtual time on a hidden profile (one A100 with
compute x0.7, bandwidth x1.2 and host overheads x2); the twin starts from the shipped
A100 profile and sees only the study's own load tests.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.sim.calibrate import hardware_yaml
from autotune.sim.profiles import load_hardware
from autotune.tuning.twin import apply_factors

runner = CliRunner()
HIDDEN = {"compute": 0.7, "bandwidth": 1.2, "overheads": 2.0}
SPACE = ("name: a100-twin\nattention_heads: 32\n"
         "fixed: {tensor_parallel_size: 1, max_model_len: 2048}\n"
         "parameters:\n"
         "  max_num_seqs: {type: categorical, choices: [8, 32, 128]}\n"
         "  request_rate: {type: float, low: 0.5, high: 60.0, log: true}\n"
         "baseline: {max_num_seqs: 8, request_rate: 2.0}\n")


def test_the_twin_learns_the_hidden_server_and_guides_the_study(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden.yaml"
    hidden.write_text(hardware_yaml(
        replace(apply_factors(load_hardware("a100-80gb"), HIDDEN), name="hidden"), ["test"]))
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    studies = tmp_path / "studies"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        res = runner.invoke(app, [
            "search", "--slo-p99", "20s", "--space", str(space), "--profile",
            f"{hidden}:llama-3-8b", "--gpus", "1", "--twin", "--twin-prior", "a100-80gb",
            "--twin-candidates", "2", "--n-trials", "3", "--num-prompts", "60",
            "--warmup", "10", "--max-probes", "4", "--tol", "0.1", "--validate", "off",
            # Full ceilings per trial: the twin predicts what a trial's search finds.
            "--prove-top", "0", "--study-name", "tw", "--studies-dir", str(studies)])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, res.stdout + res.stderr
    folder = studies / "tw"
    history = json.loads((folder / "twin.json").read_text())
    steps = history["steps"]
    assert [s["trial"] for s in steps] == [0, 1, 2]
    assert history["source"].startswith("simulated")
    for s in steps:
        assert f"twin after trial {s['trial']} (simulated" in res.stdout
    # Each trial's load tests are scored before the trial ran, on the twin fitted to the
    # trials before it (out of sample), beside the shipped profile.  Trial 0 had only the
    # prior.  One trial (a single config) can leave the factors in a valley that fits it
    # and misleads elsewhere; after two, the twin predicted the third config's tests
    # several times better than the shipped profile.
    assert steps[0]["before_rms_log_error"] == steps[0]["prior_rms_log_error"]
    assert steps[-1]["before_rms_log_error"] < steps[-1]["prior_rms_log_error"] / 3
    assert steps[-1]["before_rms_log_error"] < steps[0]["before_rms_log_error"]
    assert all(s["fit_rms_log_error"] < 0.05 for s in steps)
    # The profile it wrote is one the simulator reads, with the fitted factors.
    last = steps[-1]["factors"]
    fitted = load_hardware(str(folder / "profile.fitted.yaml"))
    prior = load_hardware("a100-80gb")
    assert fitted.compute_efficiency == pytest.approx(
        prior.compute_efficiency * last["compute"]["value"], rel=1e-4)
    assert last["compute"]["value"] != 1.0
    # Trial 1 on are the twin's: its best config, queued with its prediction, and the
    # rate search started at the predicted ceiling; predicted and measured stay side by
    # side in the study and the recommendation.
    study = optuna.load_study(study_name="tw", storage=f"sqlite:///{studies / 'tw.db'}")
    for t in study.trials[1:]:
        predicted = t.user_attrs["predicted"]
        assert predicted["source"].startswith("simulated")
        assert "twin fitted to" in predicted["by"]
        first = t.user_attrs["result"]["ceiling"]["probes"][0]
        assert first["rate"] == predicted["ceiling_rate"]
        assert t.user_attrs["twin"]["predicted_ceiling"] == predicted["ceiling_rate"]
    rec = json.loads((folder / "recommendation.json").read_text())
    assert {r["trial"] for r in rec["predictions"]} >= {1, 2}
    by = {r["trial"]: r["predicted"]["by"] for r in rec["predictions"]}
    assert by[0].startswith("the prior profile a100-80gb")  # nothing fitted before trial 0
    assert all("twin fitted to" in by[n] for n in by if n > 0)
    assert "Predicted (simulated) vs measured, trial by trial" in (
        folder / "recommendation.md").read_text()


def test_for_study_scores_one_pass_over_the_pool_and_hooks_into_run_study(
        tmp_path: Path) -> None:
    from types import SimpleNamespace

    from autotune.sim.profiles import load_model
    from autotune.study.study_twin import StudyTwin

    twin = StudyTwin.for_study(prior=load_hardware("a100-80gb"),
                               model=load_model("llama-3-8b"),
                               settings=SimpleNamespace(out_dir=tmp_path),
                               plan=SimpleNamespace(requests=[None] * 40), candidates=0)
    assert twin.cap == 40 and twin.out_dir == tmp_path and twin.candidates == 0
    # run_study's own keyword names, so `autotune search --twin` and the scenario
    # benchmark pass the same hooks.
    assert set(twin.hooks()) == {"predict", "on_searched"}
    assert twin.hooks()["predict"] == twin.predict


def test_the_twins_picks_are_seeded_by_the_search_seed_and_the_trial() -> None:
    from autotune.study.study_twin import pick_seed

    seeds = {(s, n): pick_seed(s, n) for s in range(3) for n in range(5)}
    assert len(set(seeds.values())) == len(seeds)  # no two (seed, trial) share picks
    assert pick_seed(7, 3) == pick_seed(7, 3)  # a rerun repeats them
