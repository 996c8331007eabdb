"""The search as a library call, its options object, and the one flag renderer."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.flags import command_line, config_to_argv, flag_value, serve_argv
from autotune.pipeline import SearchOptions, run_search
from autotune.recommend import deploy_command
from autotune.server import VllmServer


def test_options_are_typed_frozen_and_keyword_only() -> None:
    o = SearchOptions(slo_p99="10s", vllm_env=["A=1"])  # type: ignore[arg-type]
    assert o.vllm_env == ("A=1",) and isinstance(o.studies_dir, Path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.slo_p99 = "5s"  # type: ignore[misc]
    with pytest.raises(TypeError):
        SearchOptions("10s")  # type: ignore[misc]


def test_the_cli_only_parses_and_calls_the_library_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune.pipeline

    calls: list[SearchOptions] = []

    def fake(options: SearchOptions) -> int:
        calls.append(options)
        return 0

    monkeypatch.setattr(autotune.pipeline, "run_search", fake)
    res = CliRunner().invoke(app, ["search", "--slo-p99", "7s", "--n-trials", "3",
                                   "--vllm-env", "K=V", "--min-duration", "90s",
                                   "--studies-dir", str(tmp_path)])
    assert res.exit_code == 0, res.stderr
    (o,) = calls
    assert (o.slo_p99, o.n_trials, o.vllm_env, o.min_duration) == ("7s", 3, ("K=V",), "90s")
    assert not (tmp_path / "studies").exists()  # nothing of its own was written


def test_run_search_as_a_library_writes_the_recommendation(tmp_path: Path) -> None:
    code = run_search(SearchOptions(slo_p99="10s", space="llama3-8b-4xa100", num_prompts=300,
                                    warmup=20, n_trials=3, study_name="lib",
                                    studies_dir=tmp_path / "studies", validate="off"))
    assert code == 0
    rec = json.loads((tmp_path / "studies" / "lib" / "recommendation.json").read_text())
    assert rec["best"]["max_feasible_rate"] > 0 and rec["validation"] is None


def test_bad_options_raise_one_error_before_anything_is_written(tmp_path: Path) -> None:
    from autotune.errors import AutotuneError

    with pytest.raises(AutotuneError, match="--max-probes"):
        run_search(SearchOptions(slo_p99="10s", max_probes=0,
                                 studies_dir=tmp_path / "studies"))
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
