"""The search as a library call, its options object, and the one flag renderer."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autotune.analysis.recommend import deploy_command
from autotune.cli import app
from autotune.cli._parse import load_space, parse_slo
from autotune.core.flags import command_line, config_to_argv, flag_value, serve_argv
from autotune.search.options import SearchOptions
from autotune.search.pipeline import run_search
from autotune.servers.vllm import VllmServer
from autotune.tuning.options import (
    OptionsError,
    RateSearch,
    ServerOptions,
    SimProfile,
    WorkloadOptions,
)


def _options(**kw: Any) -> SearchOptions:
    return SearchOptions(slo=parse_slo("10s", None), space=load_space(kw.pop("space", "default")),
                         **kw)


def test_options_are_typed_frozen_keyword_only_and_checked_when_made() -> None:
    o = _options(server=ServerOptions(env={"A": "1"}))
    assert o.server.env == {"A": "1"} and isinstance(o.studies_dir, Path)
    assert o.name == "default-sim-p99e2e10s"  # space, backend, SLO
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.prove_top = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        SearchOptions(parse_slo("10s", None))  # type: ignore[misc]
    # Each group checks its own ranges, naming the flag.
    with pytest.raises(OptionsError, match="--max-probes must be at least 1"):
        RateSearch(max_probes=0)
    with pytest.raises(OptionsError, match="--num-prompts must be at least 1"):
        WorkloadOptions(num_prompts=0)
    # The budget covers the validation run: one shorter than it leaves no search.
    with pytest.raises(OptionsError, match="leaves no server time for the search"):
        _options(budget_s=240.0, validate_s=300.0)
    with pytest.raises(OptionsError, match="--backend attach needs --url"):
        _options(backend="attach")


def test_the_cli_parses_every_option_and_calls_the_library_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune.search.pipeline

    calls: list[SearchOptions] = []

    def fake(options: SearchOptions) -> int:
        calls.append(options)
        return 0

    monkeypatch.setattr(autotune.search.pipeline, "run_search", fake)
    res = CliRunner().invoke(app, ["search", "--slo-p99", "7s", "--n-trials", "3",
                                   "--vllm-env", "K=V", "--min-duration", "90s",
                                   "--budget", "2h", "--validate", "off",
                                   "--studies-dir", str(tmp_path)])
    assert res.exit_code == 0, res.stderr
    (o,) = calls
    # Typed values only: the SLO, seconds, the space's model, the environment's pairs.
    assert str(o.slo) == "p99:e2e<=7s" and o.n_trials == 3 and o.server.env == {"K": "V"}
    assert o.steady.min_duration_s == 90.0 and o.budget_s == 7200.0 and o.validate_s is None
    assert o.space.name == "default" and o.sim.node == "4xa100-80gb"
    assert not (tmp_path / "studies").exists()  # nothing of its own was written


def test_the_library_example_of_the_search_page_runs_as_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """docs/search.md's library call, run as the page shows it."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "search.md").read_text()
    code = page.split("## As a library", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/search.md", "exec"), {})  # its own assert checks the exit code
    # Before it starts, the search says how long it may take (plain text: no terminal).
    said = capsys.readouterr().out
    assert "time: 3 trials of 1 to 4 screening tests of " in said  # screen, then prove
    assert "then the 2 best proven by 1 to 8 (--max-probes) tests of " in said
    name = "llama3-8b-4xa100-sim-p99e2e10s"
    rec = json.loads((tmp_path / "studies" / name / "recommendation.json").read_text())
    assert rec["best"]["max_feasible_rate"] > 0 and rec["validation"] is None
    # The Optuna study itself says how it was measured (optuna-dashboard shows these).
    import optuna

    db = tmp_path / "studies" / f"{name}.db"
    attrs = optuna.load_study(study_name=name, storage=f"sqlite:///{db}").user_attrs
    assert attrs["backend"] == "sim" and attrs["source"] == "simulated (virtual time)"
    assert attrs["profile"].startswith("4xa100-80gb") and attrs["slo"] == "p99:e2e<=10s"
    assert attrs["workload"].startswith("sharegpt") and "20 warm-up" in attrs["workload"]


def test_bad_options_raise_one_error_before_anything_is_written(tmp_path: Path) -> None:
    from autotune.core.errors import AutotuneError

    with pytest.raises(AutotuneError, match="--profile nosuch-gpu"):
        run_search(_options(profile=SimProfile(hardware="nosuch-gpu"),
                            studies_dir=tmp_path / "studies"))
    with pytest.raises(AutotuneError, match="unknown sampler"):
        run_search(_options(sampler="annealing", studies_dir=tmp_path / "studies"))
    assert not (tmp_path / "studies").exists()


# ----------------------------------------------------------------------------- flags

def test_flag_values_read_back_as_vllm_parses_them() -> None:
    assert flag_value(16384.0) == "16384"  # never 1.638e+04, never 16384.0
    assert flag_value(0.9) == "0.9" and flag_value(0.8500000000000001) == "0.8500000000000001"
    assert config_to_argv({"max_num_batched_tokens": 16384.0, "enable_chunked_prefill": False,
                           "request_rate": 3.0, "model": "m", "block_size": None}) == [
        "--max-num-batched-tokens", "16384", "--no-enable-chunked-prefill"]


def test_printed_command_is_the_launched_argv(tmp_path: Path) -> None:
    """The recommendation prints exactly what VllmServer launches: prefix, model as a
    flag, extra arguments, flags, quoting, and the environment."""
    server = VllmServer("/models/my model", vllm_cmd=["python", "-m",
                                                      "vllm.entrypoints.openai.api_server"],
                        model_as_flag=True, log_dir=tmp_path, env={"VLLM_X": "a b"})
    config: dict[str, Any] = {"max_num_seqs": 8, "gpu_memory_utilization": 0.9,
                              "max_num_batched_tokens": 4096.0}
    argv = server.build_argv(config, port=8123)
    printed = deploy_command(config, {"argv": argv, "env": server.env})
    assert printed == "VLLM_X='a b' " + shlex.join(argv)
    assert shlex.split(printed)[1:] == argv  # pasting it runs exactly argv
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "4096"
    # Simulated configs (nothing launched) get vLLM's own command from the same renderer.
    plain = deploy_command({"model": "m", **config}, None)
    assert shlex.split(plain) == serve_argv({"model": "m", **config})
    assert command_line(["a b", "c"], {"K": "1"}) == "K=1 'a b' c"


def test_time_estimate_names_the_range_and_the_budget() -> None:
    from autotune.search.pipeline import time_estimate

    text = time_estimate(n_trials=8, min_s=120, max_s=360, max_probes=4, validate_s=300,
                         budget_s=1500, virtual=False)
    # (8 + 3) x 120 s = 22 min if most configs stop after one test; 8 x 4 x 360 s = 3.2 h.
    assert "about 22 min to 3.2 h of load tests" in text
    assert "--budget stops it at 25 min (validation included), before the longest case" in text
    roomy = time_estimate(n_trials=2, min_s=60, max_s=180, max_probes=2, validate_s=None,
                          budget_s=7200, virtual=True)
    assert "before the longest case" not in roomy and "virtual time" in roomy


def test_a_screened_study_estimates_its_screening_and_its_proof() -> None:
    """The real study's line described full tests of 120-360 s for trials that ran
    40 s screening tests, and left the proof out."""
    from autotune.search.pipeline import ProofSize, time_estimate

    text = time_estimate(n_trials=8, min_s=40, max_s=40, max_probes=4, validate_s=300,
                         budget_s=1500, virtual=False,
                         proof=ProofSize(configs=2, min_s=120, max_s=360, max_probes=4))
    assert ("8 trials of 1 to 4 screening tests of 40 s, then the 2 best proven by 1 "
            "to 4 (--max-probes) tests of 120 to 360 s each") in text
    # (8 + 3) x 40 s + 2 x 120 s = 11 min; 8 x 4 x 40 s + 2 x 4 x 360 s = 69 min.
    assert "about 11 min to 69 min of load tests" in text


def test_a_running_real_load_test_prints_a_plain_progress_line_every_30_s() -> None:
    """Into a log file (no terminal): one line per 30 s of arrivals while a real test
    runs, with what it judged so far; none for the simulator's virtual time."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from autotune.core.slo import parse_slo
    from autotune.search.pipeline import LiveView

    def ev(at_s: float) -> Any:
        lim = SimpleNamespace(label="p99:e2e", observed_s=4.2)
        return SimpleNamespace(at_s=at_s, cohort=int(at_s * 2), served_share=0.99,
                               limits=[lim], verdict="inconclusive", sent=int(at_s * 2) + 9,
                               completed=int(at_s * 2) + 1)

    log = io.StringIO()
    view = LiveView(Console(file=log, force_terminal=False), parse_slo("10s"), "vllm")
    with view:
        for t in (5.0, 29.0, 31.0, 45.0, 62.0, 70.0):
            view.progress(0, 2.0, ev(t))
    lines = log.getvalue().splitlines()
    assert [line.split(": ")[1].split(",")[0] for line in lines] == [
        "31 s of arrivals", "62 s of arrivals"]
    assert lines[0] == ("  trial 0 at 2 req/s: 31 s of arrivals, 71 sent, 63 completed, 8 in "
                        "flight, 62 judged, 99% of arrivals served, p99:e2e 4.2 s so far: "
                        "inconclusive so far")
    sim = io.StringIO()
    LiveView(Console(file=sim, force_terminal=False), parse_slo("10s"), "sim").progress(
        0, 2.0, ev(100.0))
    assert sim.getvalue() == ""
