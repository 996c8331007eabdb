from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from autotune.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def search(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        res = runner.invoke(app, ["search", "--studies-dir", str(tmp_path / "studies"), *args])
    finally:
        os.chdir(cwd)
    return res.exit_code, res.stdout, res.stderr


def _bad(tmp_path: Path, code: int, stderr: str, needle: str) -> None:
    assert code != 0
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "studies").exists(), "a study was written on bad input"


def _space(tmp_path: Path, text: str) -> str:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--slo-p99", "0s"], "must be greater than 0"),
        (["--slo-p99", "0"], "cannot read"),
        (["--slo-p99", "10s", "--sampler", "anneal"], "unknown sampler 'anneal'"),
        (["--slo-p99", "10s", "--storage", "sqlite:////no/such/dir/x.db"],
         "cannot open storage"),
        (["--slo-p99", "10s", "--storage", "nosuchdb://127.0.0.1:1/x"],
         "cannot open storage"),
        (["--slo-p99", "10s", "--backend", "tpu"], "unknown backend"),
        (["--slo-p99", "10s", "--profile", "no-such-gpu"], "--profile"),
        ([], "no SLO given"),
    ],
)
def test_bad_input_one_line_no_study(tmp_path: Path, args: list[str], needle: str) -> None:
    code, _, err = search(tmp_path, *args)
    _bad(tmp_path, code, err, needle)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("parameters: {max_num_seqs: {type: int, low: 8, high: [}", "malformed YAML"),
        ("parameters:\n  max_num_sqes: {type: int, low: 8, high: 64}\n", "unknown parameter"),
        ("parameters:\n  max_num_seqs: {type: int, low: 64, high: 8}\n", "empty range"),
    ],
)
def test_bad_space_one_line_no_study(tmp_path: Path, text: str, needle: str) -> None:
    path = _space(tmp_path, text)
    code, _, err = search(tmp_path, "--slo-p99", "10s", "--space", path)
    _bad(tmp_path, code, err, needle)
    assert path in err.replace("\n", "")


def test_unreachable_postgres(tmp_path: Path) -> None:
    if importlib.util.find_spec("psycopg2") is None:
        pytest.skip("psycopg2 not installed")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = search(tmp_path, "--slo-p99", "10s", "--storage",
                          f"postgresql://u:p@127.0.0.1:{port}/db")
    _bad(tmp_path, code, err, "cannot open storage")


def test_search_sim_writes_recommendation(tmp_path: Path) -> None:
    code, out, err = search(tmp_path, "--slo-p99", "10s", "--space", "llama3-8b-4xa100",
                            "--num-prompts", "200", "--warmup", "20", "--n-trials", "10",
                            "--study-name", "e2e")
    assert code == 0, err
    rec = json.loads((tmp_path / "studies" / "e2e" / "recommendation.json").read_text())
    assert rec["best"]["command"].startswith("vllm serve ")
    assert rec["rate_cap"] <= rec["best"]["max_feasible_rate"]
    assert rec["source"].startswith("simulated")
    assert rec["table"] and {"rate", "output_throughput", "p99_e2e_s", "gpu_util_pct",
                             "overloaded"} <= set(rec["table"][0])
    md = (tmp_path / "studies" / "e2e" / "recommendation.md").read_text()
    assert "vllm serve" in md and "Rate cap" in md
    assert "Recommended" in out and "rate cap at the gateway" in out
    study = optuna.load_study(study_name="e2e",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'e2e.db'}")
    best = study.trials[rec["best"]["trial"]]
    assert best.user_attrs["result"]["feasible"]
    if rec["baseline"]["feasible"]:
        assert rec["best"]["value"] >= rec["baseline"]["value"]
    # Same command again: the study is complete, nothing new runs, same answer.
    code, out, err = search(tmp_path, "--slo-p99", "10s", "--space", "llama3-8b-4xa100",
                            "--num-prompts", "200", "--warmup", "20", "--n-trials", "10",
                            "--study-name", "e2e")
    assert code == 0, err
    assert "0 new trials" in out
    assert json.loads((tmp_path / "studies" / "e2e" / "recommendation.json").read_text())[
        "best"]["trial"] == rec["best"]["trial"]


@pytest.mark.skipif(importlib.util.find_spec("autotune.sim.serve") is None,
                    reason="the simulator's HTTP server (autotune.sim.serve) is not there yet")
def test_search_vllm_backend_with_the_simulator_as_vllm(tmp_path: Path) -> None:
    """Real restarts and real HTTP: the simulator's server launched as 'vLLM'."""
    space = tmp_path / "small.yaml"
    space.write_text(
        "name: small\nattention_heads: 32\n"
        "fixed: {max_model_len: 4096}\n"
        "parameters:\n"
        "  max_num_seqs: {type: categorical, choices: [8, 32]}\n"
        "  request_rate: {type: categorical, choices: [20.0, 40.0]}\n"
        "baseline: {max_num_seqs: 32, request_rate: 20.0}\n")
    cmd = f"{sys.executable} -m autotune.sim.serve --profile 1xa100-80gb --startup-delay-s 0.2"
    code, out, err = search(tmp_path, "--slo-p99", "10s", "--space", str(space),
                            "--backend", "vllm", "--model", "llama-3-8b", "--vllm-cmd", cmd,
                            "--num-prompts", "20", "--warmup", "5", "--n-trials", "3",
                            "--sampler", "grid", "--study-name", "real")
    assert code == 0, err + out
    study = optuna.load_study(study_name="real",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'real.db'}")
    results = [t.user_attrs["result"] for t in study.trials]
    assert all(r["mode"] == "real" for r in results)
    launches = [r["startup"] for r in results if r["startup"] and not r["startup"]["reused"]]
    assert len(launches) >= 2  # a real restart between configs
    for info in launches:  # every server the study started is gone
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)
    assert all(r["summary"]["source"].startswith("measured") for r in results if r["summary"])
    logs = list((tmp_path / "studies" / "real" / "logs").glob("*"))
    assert logs
