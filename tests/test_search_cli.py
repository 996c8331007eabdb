from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.servers.process import live, port_listening

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
    import subprocess

    # A real process: the retry line reaches the user through logging, which pytest
    # would capture in-process.  The retry (up to 30 s) is kept: a starting database
    # refuses connections too.
    url = f"postgresql://u:hunter2@127.0.0.1:{port}/db"
    res = subprocess.run([sys.executable, "-m", "autotune", "search", "--slo-p99", "10s",
                          "--studies-dir", str(tmp_path / "studies"), "--storage", url],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "1000"})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "hunter2" not in res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, res.stderr  # once "retrying", then the error: not per attempt
    assert lines[0].startswith("database unreachable during connect: "), lines[0]
    assert "retrying for up to 30 s" in lines[0], lines[0]
    shown = f"postgresql://u:***@127.0.0.1:{port}/db"
    assert lines[1].startswith(f"error: cannot open storage {shown}: "), lines[1]
    assert lines[1].count("cannot open storage") == 1, lines[1]
    assert not (tmp_path / "studies").exists(), "a study was written on bad input"


def test_search_screens_fast_and_proves_the_best_once(tmp_path: Path) -> None:
    """The default: every trial a short screening search (point estimates, at most 4
    tests, to 15%), then the 2 best configs proven by the full ceiling search, whose
    ceiling the recommendation and its cap stand on; vLLM's defaults compared at
    their own (screened) ceiling."""
    code, out, err = search(tmp_path, "--slo-p99", "10s", "--space", "llama3-8b-4xa100",
                            "--n-trials", "6", "--study-name", "sp")
    assert code == 0, err
    rec = json.loads((tmp_path / "studies" / "sp" / "recommendation.json").read_text())
    study = optuna.load_study(study_name="sp",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'sp.db'}")
    trials = [t.user_attrs["result"] for t in study.trials if "result" in t.user_attrs]
    assert all(len(r["ceiling"]["probes"]) <= 4 + 2 for r in trials if r.get("ceiling"))
    screened = [p for r in trials if r.get("ceiling") for p in r["ceiling"]["probes"]
                if p.get("evidence")]
    assert screened and all(p["evidence"]["min_duration_s"] <= 20.0 for p in screened)
    assert "proving the 2 best screened configs" in out
    proven = rec["ceilings"]
    assert 1 <= len(proven) <= 2
    best = next(c for c in proven if c["trial"] == rec["best"]["trial"])
    assert rec["best"]["max_feasible_rate"] == pytest.approx(best["feasible_max"])
    assert rec["validation"]["runs"][0]["rate"] == pytest.approx(
        round(0.9 * best["feasible_max"], 2), abs=0.01)
    assert any(n.startswith("ranked on proven ceilings") for n in rec["notes"])
    # The defaults at their own ceiling: a ratio, or the reason there is none.
    vs = rec["vs_baseline"]
    assert vs.get("objective_ratio") or vs.get("note")
    assert "server time in all (study, proof and validation)" in out


def test_search_sim_writes_recommendation(tmp_path: Path) -> None:
    code, out, err = search(tmp_path, "--slo-p99", "10s", "--space", "llama3-8b-4xa100",
                            "--num-prompts", "400", "--warmup", "20", "--n-trials", "6",
                            "--study-name", "e2e", "--prove-top", "0")
    assert code == 0, err
    folder = tmp_path / "studies" / "e2e"
    rec = json.loads((folder / "recommendation.json").read_text())
    assert rec["best"]["command"].startswith("vllm serve ")
    assert rec["source"].startswith("simulated")
    study = optuna.load_study(study_name="e2e",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'e2e.db'}")
    best = study.trials[rec["best"]["trial"]].user_attrs["result"]
    # The trial found its config's ceiling; the recommendation is at that ceiling.
    assert best["feasible"] and best["rate"] == best["ceiling"]["feasible_max"]
    assert rec["best"]["max_feasible_rate"] == pytest.approx(best["rate"])
    # The cap was validated by a 5-minute run (virtual time) and says so.
    val = rec["validation"]
    assert val["runs"][0]["rate"] == pytest.approx(round(0.9 * best["rate"], 2), abs=0.01)
    if val["passed"]:
        assert rec["rate_cap"] == pytest.approx(val["rate"], abs=0.01)
        assert rec["rate_cap"] <= rec["best"]["max_feasible_rate"]
        assert any(n.startswith("validated (simulated, 5 min)") for n in rec["notes"])
    # The seed-style table is the trial's own load tests plus the validation runs.
    phases = [row["phase"] for row in rec["table"]]
    assert "validation" in phases and len(phases) == len(best["ceiling"]["probes"]) + len(
        val["runs"])
    assert {"rate", "goodput_tokens", "p99_e2e_s", "gpu_util_pct",
            "verdict"} <= set(rec["table"][0])
    # One definition, one number: the table's row at the recommended rate shows the
    # goodput the headline gives (before, the table's tok/s was over a window with the
    # drain tail, so it read lower than the goodput of the same test).
    at_best = [row for row in rec["table"] if row["phase"] != "validation"
               and row["rate"] == pytest.approx(rec["best"]["max_feasible_rate"])
               and row["verdict"] == "pass"]
    assert at_best and at_best[-1]["goodput_tokens"] == pytest.approx(
        rec["best"]["goodput_tokens"], rel=1e-9)
    assert all((row["goodput_tokens"] is not None and row["goodput_tokens"] > 0)
               == (row["verdict"] == "pass") for row in rec["table"])
    # ... and so does the trial's own progress line (it printed the window's figure).
    line = next(ln for ln in out.splitlines()
                if ln.startswith(f"trial {rec['best']['trial']:>3} "))
    assert f"goodput {rec['best']['goodput_tokens']:>8,.0f}" in line
    md = (folder / "recommendation.md").read_text()
    assert "vllm serve" in md and "Rate cap" in md
    assert "Recommended" in out and "rate cap at the gateway" in out
    assert "sized by time" not in err  # one-line header goes to stdout
    # The report is written at the end, and says where.
    assert (folder / "report.html").is_file() and (folder / "report.md").is_file()
    assert "report.html" in out and "report.md" in out
    if rec["baseline"]["feasible"]:
        assert rec["best"]["value"] >= rec["baseline"]["value"]
    # Same command again: the study is complete, nothing new runs, same answer.
    code, out, err = search(tmp_path, "--slo-p99", "10s", "--space", "llama3-8b-4xa100",
                            "--num-prompts", "400", "--warmup", "20", "--n-trials", "6",
                            "--study-name", "e2e", "--validate", "off")
    assert code == 0, err
    assert "0 new trials" in out
    assert json.loads((folder / "recommendation.json").read_text())[
        "best"]["trial"] == rec["best"]["trial"]


def test_search_vllm_backend_with_the_simulator_as_vllm(tmp_path: Path) -> None:
    """Real restarts and real HTTP: the simulator's server launched as 'vLLM'."""
    space = tmp_path / "small.yaml"
    space.write_text(
        "name: small\nattention_heads: 32\n"
        "fixed: {max_model_len: 4096}\n"
        "parameters:\n"
        "  max_num_seqs: {type: categorical, choices: [8, 32]}\n"
        "  request_rate: {type: float, low: 1.0, high: 40.0, log: true}\n"
        "baseline: {max_num_seqs: 32, request_rate: 4.0}\n")
    cmd = f"{sys.executable} -m autotune.sim.serve --profile 1xa100-80gb --startup-delay-s 0.2"
    code, out, err = search(tmp_path, *REAL_TIME, "--space", str(space),
                            "--backend", "vllm", "--model", "llama-3-8b", "--vllm-cmd", cmd,
                            "--num-prompts", "30", "--warmup", "5", "--n-trials", "2",
                            "--max-model-len", "512", "--dataset", str(short_replies(tmp_path)),
                            "--validate", "off", "--sampler", "grid", "--study-name", "real")
    assert code == 0, err + out
    study = optuna.load_study(study_name="real",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'real.db'}")
    results = [t.user_attrs["result"] for t in study.trials]
    assert all(r["mode"] == "real" for r in results)
    launches = [r["launch"] for r in results if r.get("launch")]
    assert len(launches) == 2  # one server start per config, a restart between them
    assert len({tuple(x["argv"]) for x in launches}) == 2
    for t in study.trials:
        for p in t.user_attrs["result"]["ceiling"]["probes"]:
            if p["rate"] is not None:  # the saturation probe (rate inf) has no verdict
                assert p["evidence"]["verdict"] == p["verdict"]
    # The command printed for the best config is the one that was launched and measured.
    rec = json.loads((tmp_path / "studies" / "real" / "recommendation.json").read_text())
    best = study.trials[rec["best"]["trial"]].user_attrs["result"]
    assert rec["best"]["command"] == shlex.join(best["launch"]["argv"])
    assert shlex.split(rec["best"]["command"])[:3] == shlex.split(cmd)[:3]
    for launch in launches:  # every server the study started is gone, its port free
        port = int(launch["argv"][launch["argv"].index("--port") + 1])
        assert not port_listening("127.0.0.1", port)
    assert live() == []
    assert all(r["summary"]["source"].startswith("measured") for r in results if r["summary"])
    logs = list((tmp_path / "studies" / "real" / "logs").glob("*"))
    assert logs
    # Deploying is running the printed command: the server comes up with the tested flags.
    _start_recommended(rec["best"]["command"], best["flags"]["max_num_seqs"], tmp_path)


def test_budget_ends_a_real_time_study_inside_it_and_leaves_nothing(tmp_path: Path) -> None:
    """--budget 25s with a 5 s validation: 20 s of server time for the search, real
    processes and real time.  The running load test is cut at the end of that share,
    the trial says it is partial, and no server is left behind."""
    cmd = f"{sys.executable} -m autotune.sim.serve --profile 1xa100-80gb --startup-delay-s 0.2"
    # A pass needs 10 s of arrivals: the first trial's second test is cut by the budget.
    args = [{"3s": "10s", "8s": "60s"}.get(a, a) for a in REAL_TIME]
    code, out, err = search(tmp_path, *args, "--backend", "vllm", "--model", "llama-3-8b",
                            "--vllm-cmd", cmd, "--num-prompts", "30", "--warmup", "5",
                            "--n-trials", "5", "--max-model-len", "512", "--budget", "25s",
                            "--study-name", "budget")
    assert code in (0, 1), err + out
    assert "stopped by budget" in out + err
    study = optuna.load_study(study_name="budget",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'budget.db'}")
    last = study.trials[-1].user_attrs["result"]
    assert last["ceiling"]["budget_spent"] is True, last.get("detail")
    assert "the --budget ran out" in last["ceiling"]["answer"]
    spent = sum(t.user_attrs["result"].get("server_s") or 0.0 for t in study.trials)
    assert spent <= 20.0 + 1.0  # within one window of the search's share
    assert live() == []


def _start_recommended(command: str, max_num_seqs: int, tmp_path: Path) -> None:
    import subprocess
    import time
    import urllib.request

    argv = shlex.split(command)
    port = int(argv[argv.index("--port") + 1])
    log = tmp_path / "deployed.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)  # polling a port: there is no event to wait on
        assert f"max_num_seqs={max_num_seqs}," in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


SMALL = ("--slo-p99", "10s", "--space", "llama3-8b-4xa100", "--num-prompts", "60",
         "--warmup", "5", "--n-trials", "3", "--validate", "off")


def test_refine_top_zero_and_a_failed_report_keep_the_study(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune.report

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("plots exploded\nsecond line")

    monkeypatch.setattr(autotune.report, "write_report", broken)
    code, out, err = search(tmp_path, *SMALL, "--refine-top", "0", "--study-name", "s")
    assert code == 0, err
    folder = tmp_path / "studies" / "s"
    assert (folder / "recommendation.json").is_file()
    assert not list(folder.glob("ceiling*.json"))
    rec = json.loads((folder / "recommendation.json").read_text())
    assert rec["ceilings"] == [] and rec["validation"] is None
    warn = [line for line in err.splitlines() if "warning" in line]
    assert len(warn) == 1 and "plots exploded" in warn[0] and "second line" not in err
    assert "refining" not in out


def test_missing_tracker_package_stops_before_any_trial(tmp_path: Path) -> None:
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    code, _, err = search(tmp_path, *SMALL, "--wandb", "proj")
    _bad(tmp_path, code, err, "pip install wandb")
    assert code == 2


def test_wandb_logs_every_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import autotune.report.trackers as trackers

    logged: list[dict[str, object]] = []
    finished: list[bool] = []

    class Run:
        def log(self, data: dict[str, object], step: int) -> None:
            logged.append(data)

        def finish(self) -> None:
            finished.append(True)

    fake = types.SimpleNamespace(init=lambda **kw: Run())
    monkeypatch.setattr(trackers, "_import", lambda package: fake)
    code, _, err = search(tmp_path, *SMALL, "--refine-top", "0", "--wandb", "proj",
                          "--study-name", "w")
    assert code == 0, err
    study = optuna.load_study(study_name="w",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'w.db'}")
    ran = [t for t in study.trials if (t.user_attrs.get("result") or {}).get("summary")]
    assert ran and len(logged) == len(ran)
    assert all("config/study" in row for row in logged)
    assert finished == [True]


# Real-time studies in seconds: short steady-state load tests (3-8 s of arrivals),
# a p90 first-token limit (its bound needs few requests, and it is decided within 2 s
# of each arrival), a short validation run.  A few seconds cannot bound the backlog's
# slope to 2% of a few req/s, so these plumbing tests allow 50%; the 2% rule itself is
# tested in virtual time (tests/test_verdict.py).
REAL_TIME = ("--slo", "p90:ttft<=2s", "--min-duration", "3s", "--max-duration", "8s",
             "--validate", "5s", "--max-probes", "3", "--tol", "0.3",
             "--backlog-share", "0.5")


def short_replies(tmp_path: Path) -> Path:
    """A user's file of 300 requests with 20-140 token replies: a real-time test's
    saturation test drains in seconds, not the minute ShareGPT's long replies take a
    32-slot simulated A100 (and no ShareGPT pool is tokenised first)."""
    path = tmp_path / "short.jsonl"
    path.write_text("".join(
        json.dumps({"prompt_tokens": 100 + (i * 37) % 250,
                    "output_tokens": 20 + (i * 11) % 120}) + "\n" for i in range(300)))
    return path


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--vllm-env", "NOEQUALS"], "--vllm-env 'NOEQUALS': give KEY=VALUE"),
        (["--gpu-ids", "0,x"], "--gpu-ids '0,x'"),
        (["--gpu-ids", "1,1"], "listed twice"),
        (["--startup-timeout", "0"], "--startup-timeout"),
        (["--refine-top", "-1"], "--prove-top"),
        (["--prove-top", "-1"], "--prove-top"),
    ],
)
def test_bad_server_options_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    code, _, err = search(tmp_path, "--slo-p99", "10s", *args)
    _bad(tmp_path, code, err, needle)


def test_server_options_reach_vllm_server(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune.backends.factory
    from autotune.cli._common import UsageError

    seen: dict[str, object] = {}

    class Recorder:
        def __init__(self, model: str, **kw: object) -> None:
            seen.update(kw, model=model)
            raise UsageError("recorded")

    monkeypatch.setattr(autotune.backends.factory, "VllmServer", Recorder)
    code, _, err = search(tmp_path, *SMALL, "--model", "/models/tiny", "--vllm-cmd",
                          "python -m vllm.entrypoints.openai.api_server --enforce-eager",
                          "--vllm-env", "VLLM_ENABLE_V1_MULTIPROCESSING=0", "--vllm-env",
                          "VLLM_CPU_KVCACHE_SPACE=1", "--gpu-ids", "0,1",
                          "--startup-timeout", "120")
    assert code == 2 and "recorded" in err
    assert seen["model"] == "/models/tiny"
    assert seen["env"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert seen["gpus"] == [0, 1] and seen["startup_timeout_s"] == 120.0
    assert seen["model_as_flag"] is True


def test_prescreen_sim_then_measure_on_the_simulator_as_vllm(tmp_path: Path) -> None:
    """The full path: a study in virtual time, its top config enqueued at its predicted
    ceiling, then measured over HTTP; prediction and measurement side by side."""
    space = tmp_path / "small.yaml"
    space.write_text(
        "name: small\nattention_heads: 32\n"
        "fixed: {max_model_len: 4096}\n"
        "parameters:\n"
        "  max_num_seqs: {type: categorical, choices: [8, 32]}\n"
        "  request_rate: {type: float, low: 5.0, high: 40.0, step: 0.5}\n"
        "baseline: {max_num_seqs: 8, request_rate: 5.0}\n")
    cmd = f"{sys.executable} -m autotune.sim.serve --profile 1xa100-80gb --startup-delay-s 0.2"
    code, out, err = search(tmp_path, *REAL_TIME, "--space", str(space),
                            "--backend", "vllm", "--model", "llama-3-8b", "--vllm-cmd", cmd,
                            "--profile", "1xa100-80gb:llama-3-8b", "--prescreen", "sim",
                            "--prescreen-trials", "4", "--top-k", "1", "--num-prompts", "40",
                            "--warmup", "4", "--n-trials", "2", "--study-name", "pre",
                            "--max-model-len", "512", "--dataset", str(short_replies(tmp_path)),
                            # What is shown is the prediction beside the measurement.
                            "--validate", "off")
    assert code == 0, err + out
    assert "pre-screen: " in out
    rec = json.loads((tmp_path / "studies" / "pre" / "recommendation.json").read_text())
    rows = rec["predictions"]
    assert len(rows) == 1
    row = rows[0]
    assert row["predicted"]["source"].startswith("simulated")
    assert row["measured"]["source"].startswith("measured")
    assert row["predicted"]["ceiling_rate"] is not None
    # The measured trial's rate search started at the predicted ceiling.
    study = optuna.load_study(study_name="pre",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'pre.db'}")
    seeded = next(t for t in study.trials if "predicted" in t.user_attrs)
    assert "repeat_of" not in seeded.user_attrs["result"]  # not the baseline's config
    probes = seeded.user_attrs["result"]["ceiling"]["probes"]
    assert probes[0]["rate"] == pytest.approx(row["predicted"]["ceiling_rate"])
    study = optuna.load_study(study_name="pre",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'pre.db'}")
    seeded = study.trials[row["trial"]]
    assert seeded.user_attrs["predicted"]["prescreen_trial"] is not None
    assert seeded.user_attrs["result"]["mode"] == "real"
    pre = optuna.load_study(study_name="pre-prescreen",
                            storage=f"sqlite:///{tmp_path / 'studies' / 'pre.db'}")
    assert all(t.user_attrs["result"]["mode"] == "virtual" for t in pre.trials
               if t.user_attrs.get("result", {}).get("launched"))


def test_a_server_that_crashes_in_every_trial_fails_each_trial_and_the_study_goes_on(
        tmp_path: Path) -> None:
    """Fault injection at the study level: the simulator's server, launched as vLLM,
    exits ("Engine core died") after 3 requests in every trial.  Each trial is
    infeasible with the reason and the log's tail, the next trial still runs, and no
    process or port is left."""
    space = tmp_path / "small.yaml"
    space.write_text(
        "name: small\nattention_heads: 32\n"
        "fixed: {max_model_len: 4096}\n"
        "parameters:\n"
        "  max_num_seqs: {type: categorical, choices: [8, 32]}\n"
        "  request_rate: {type: float, low: 1.0, high: 40.0, log: true}\n"
        "baseline: {max_num_seqs: 32, request_rate: 4.0}\n")
    cmd = (f"{sys.executable} -m autotune.sim.serve --profile 1xa100-80gb "
           "--startup-delay-s 0.2 --crash-after 3")
    code, out, err = search(tmp_path, *REAL_TIME, "--space", str(space),
                            "--backend", "vllm", "--model", "llama-3-8b", "--vllm-cmd", cmd,
                            "--num-prompts", "30", "--warmup", "5", "--n-trials", "2",
                            "--max-model-len", "512", "--validate", "off",
                            "--dataset", str(short_replies(tmp_path)),
                            "--sampler", "grid", "--study-name", "crash")
    assert "Traceback" not in err + out
    study = optuna.load_study(study_name="crash",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'crash.db'}")
    results = [t.user_attrs["result"] for t in study.trials]
    assert len(results) == 2, out + err
    for r in results:
        assert r["feasible"] is False and r["reason"] == "crashed", r
        assert "Engine core died" in r["detail"] and "log tail" in r["detail"]
        argv = r["startup"]["argv"]  # each trial started its own server
        port = int(argv[argv.index("--port") + 1])
        assert not port_listening("127.0.0.1", port)
    assert live() == []
    assert "no recommendation: no trial met the SLO" in out + err, out + err
    # ...and how the run ended (a --budget that ran out is what to raise first).
    assert "(this run: 2 new trials, " in err and "stopped by n_trials)" in err, err
