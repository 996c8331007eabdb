from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autotune.study.space import RULES, SearchSpace, SpaceError, serve_command, vllm_args

SHIPPED = ("default", "llama3-8b-4xa100")


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spaces_load_and_baseline_obeys_rules(name: str) -> None:
    space = SearchSpace.load(name)
    assert "request_rate" in space.params
    base = space.baseline_params()
    assert set(base) == set(space.params)
    assert space.violations(base, gpus=4) == []
    assert space.server_flags(base)["model"].startswith("meta-llama/")
    assert "request_rate" not in space.server_flags(base)


def test_case_study_space_matches_seed() -> None:
    space = SearchSpace.load("llama3-8b-4xa100")
    assert space.params["tensor_parallel_size"].choices == (1, 2, 4)
    seqs = space.params["max_num_seqs"].grid()
    assert 128 in seqs and 192 in seqs
    rate = space.params["request_rate"]
    assert rate.low == 5 and rate.high == 128
    assert space.profile == {"hardware": "a100-80gb", "model": "llama-3-8b", "gpus": 4}


def test_load_by_path_and_name_from_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "search_spaces").mkdir()
    (tmp_path / "search_spaces" / "mine.yaml").write_text(
        "parameters:\n  max_num_seqs: {type: int, low: 8, high: 64}\n")
    monkeypatch.chdir(tmp_path)
    assert SearchSpace.load("mine").name == "mine"
    by_path = SearchSpace.load(tmp_path / "search_spaces" / "mine.yaml")
    assert by_path.params["max_num_seqs"].high == 64


def test_rules_name_the_rule() -> None:
    space = SearchSpace.load("default")
    params = dict(space.baseline_params(), tensor_parallel_size=8, enable_chunked_prefill=False,
                  max_num_batched_tokens=2048)
    rules = {v.rule for v in space.violations(params, gpus=4)}
    assert rules == {"tp_fits_gpus", "batched_tokens_cover_model_len"}
    # TP=3 does not divide 32 heads.
    assert [v.rule for v in space.violations({"tensor_parallel_size": 3}, gpus=8)] == [
        "tp_divides_heads"]
    assert set(RULES) == {"tp_divides_heads", "tp_fits_gpus", "batched_tokens_cover_model_len"}
    # Chunked prefill lifts the token-budget rule.
    ok = dict(params, tensor_parallel_size=2, enable_chunked_prefill=True)
    assert space.violations(ok, gpus=4) == []


def test_suggest_through_optuna_respects_types() -> None:
    space = SearchSpace.load("llama3-8b-4xa100")
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        trial = study.ask()
        p = space.suggest(trial)
        assert p["tensor_parallel_size"] in (1, 2, 4)
        assert p["max_num_seqs"] % 64 == 0 and 64 <= p["max_num_seqs"] <= 512
        assert isinstance(p["enable_chunked_prefill"], bool)
        assert 5.0 <= p["request_rate"] <= 128.0
        study.tell(trial, 0.0)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("parameters: {max_num_seqs: {type: int, low: 8, high: [}", "malformed YAML"),
        ("parameters:\n  max_num_sqes: {type: int, low: 8, high: 64}\n",
         "parameters.max_num_sqes: unknown parameter"),
        ("parameters:\n  max_num_seqs: {type: int, low: 64, high: 64}\n", "empty range"),
        ("parameters:\n  max_num_seqs: {type: integer, low: 1, high: 4}\n",
         "parameters.max_num_seqs.type"),
        ("parameters:\n  tensor_parallel_size: {type: categorical, choices: []}\n",
         "parameters.tensor_parallel_size.choices"),
        ("parameters:\n  request_rate: {type: float, low: 0, high: 4, log: true}\n",
         "log scale needs low > 0"),
        ("parameters:\n  max_num_seqs: {type: int, low: 8, high: 64}\nrules: [nope]\n",
         "unknown rule 'nope'"),
        ("parameters:\n  max_num_seqs: {type: int, low: 8, high: 64}\n"
         "baseline: {max_num_seqs: 999}\n", "baseline.max_num_seqs"),
        ("parameters:\n  max_num_seqs: {type: int, low: 8, high: 64}\nfixed: {foo: 1}\n",
         "fixed.foo"),
        ("just a string\n", "expected a mapping"),
    ],
)
def test_bad_files_name_file_key_and_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SpaceError) as info:
        SearchSpace.load(path)
    msg = str(info.value)
    assert str(path) in msg
    assert needle in msg
    assert "\n" not in msg


def test_unknown_name_lists_available() -> None:
    with pytest.raises(SpaceError, match="llama3-8b-4xa100"):
        SearchSpace.load("no-such-space")


def test_vllm_args_and_serve_command() -> None:
    flags = {"model": "m/x", "tensor_parallel_size": 4, "enable_chunked_prefill": False,
             "gpu_memory_utilization": 0.9}
    assert vllm_args(flags) == ["--tensor-parallel-size", "4", "--no-enable-chunked-prefill",
                                "--gpu-memory-utilization", "0.9"]
    assert serve_command(flags).startswith("vllm serve m/x --tensor-parallel-size 4")


def test_grid_covers_choices_and_steps() -> None:
    space = SearchSpace.load("llama3-8b-4xa100")
    grid = space.grid(points=3)
    assert grid["tensor_parallel_size"] == [1, 2, 4]
    assert grid["enable_chunked_prefill"] == [False, True]
    assert grid["gpu_memory_utilization"] == [0.8, 0.85, 0.9, 0.95]
    assert len(grid["request_rate"]) == 3
