"""Bad input across every command: one clear line on stderr, exit != 0, no traceback,
no secret printed and nothing written.

Each case runs in its own empty folder (the working directory, so default outputs such
as studies/ would land there) holding only the inputs the case wrote itself; after the
command the folder must hold exactly those inputs.  Cases fail before any server start
or network wait: a storage URL that would be retried points at a scheme or driver that
fails at once, or the worker's retry window is 0."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app

runner = CliRunner()
SECRET = "hunter2pw"  # the password in every storage URL below; never to be printed
SIM = ("--slo-p99", "10s", "--space", "cpu-tiny")  # a search that would run in seconds
CAL = ("--profile", "cpu-tiny:tiny", "--out", "p.yaml")  # a calibration missing its server
NOT_INT = "max_num_seqs='abc': vllm --max-num-seqs takes a whole number"  # names flag and type

# Inputs a case may need, written into its folder first: name -> content.
NOT_A_TOKENIZER = {"tok.json": "this is not a tokenizer\n"}
NO_PAIRS = {"pairs.json": json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}])}
EMPTY_DATASET = {"pairs.json": "[]"}
A_FILE = {"plain.txt": "a file, not a folder\n"}
LIST_SPACE = {"space.yaml": "- max_num_seqs\n- request_rate\n"}
CONTRADICTORY_SPACE = {"space.yaml": (
    "fixed: {max_num_seqs: 64}\n"
    "parameters:\n  max_num_seqs: {type: int, low: 8, high: 128}\n")}
EMPTY_CHOICES = {"space.yaml": "parameters:\n  tensor_parallel_size: {type: categorical, "
                               "choices: []}\n"}
UNKNOWN_TYPE = {"space.yaml": "parameters:\n  max_num_seqs: {type: integer, low: 8, high: 64}\n"}

PG = f"postgresql://tuner:{SECRET}@127.0.0.1:1/autotune"
MYSQL = f"mysql://tuner:{SECRET}@127.0.0.1:1/autotune"
ODD = f"nosuchdb://tuner:{SECRET}@127.0.0.1:1/autotune"

Case = tuple[str, list[str], dict[str, str], str]  # id, argv, inputs, stderr needle

CASES: list[Case] = [
    # -- search ------------------------------------------------------------------------
    ("search-unknown-flag", ["search", *SIM, "--no-such-flag"], {}, "no-such-flag"),
    ("search-n-trials-0", ["search", *SIM, "--n-trials", "0"], {}, "n-trials"),
    ("search-n-trials-neg", ["search", *SIM, "--n-trials", "-3"], {}, "n-trials"),
    ("search-num-prompts-0", ["search", *SIM, "--num-prompts", "0"], {}, "num-prompts"),
    ("search-warmup-neg", ["search", *SIM, "--warmup", "-1"], {}, "warmup"),
    ("search-timeout-0", ["search", *SIM, "--timeout", "0s"], {}, "timeout"),
    ("search-budget-neg", ["search", *SIM, "--budget", "-5m"], {}, "budget"),
    ("search-max-probes-0", ["search", *SIM, "--max-probes", "0"], {}, "max-probes"),
    ("search-headroom-neg", ["search", *SIM, "--headroom", "-0.1"], {}, "headroom"),
    ("search-tol-0", ["search", *SIM, "--tol", "0"], {}, "tol"),
    ("search-min-duration-0", ["search", *SIM, "--min-duration", "0s"], {}, "min-duration"),
    ("search-durations-contradict",
     ["search", *SIM, "--min-duration", "60s", "--max-duration", "10s"], {}, "duration"),
    ("search-gpus-0", ["search", *SIM, "--gpus", "0"], {}, "gpus"),
    ("search-max-model-len-neg", ["search", *SIM, "--max-model-len", "-1"], {},
     "--max-model-len"),
    ("search-prescreen-trials-0",
     ["search", *SIM, "--prescreen", "sim", "--prescreen-trials", "0"], {}, "prescreen"),
    ("search-storage-password", ["search", *SIM, "--storage", ODD], {}, "storage"),
    ("search-storage-no-driver", ["search", *SIM, "--storage", MYSQL], {}, "storage"),
    ("search-space-is-a-list", ["search", "--slo-p99", "10s", "--space", "space.yaml"],
     LIST_SPACE, "space.yaml"),
    ("search-space-fixed-and-searched",
     ["search", "--slo-p99", "10s", "--space", "space.yaml"], CONTRADICTORY_SPACE,
     "max_num_seqs"),
    ("search-space-empty-choices", ["search", "--slo-p99", "10s", "--space", "space.yaml"],
     EMPTY_CHOICES, "tensor_parallel_size"),
    ("search-space-unknown-type", ["search", "--slo-p99", "10s", "--space", "space.yaml"],
     UNKNOWN_TYPE, "integer"),
    ("search-tokenizer-not-a-tokenizer", ["search", *SIM, "--tokenizer", "tok.json"],
     NOT_A_TOKENIZER, "tok.json"),
    ("search-studies-dir-is-a-file", ["search", *SIM, "--studies-dir", "plain.txt"], A_FILE,
     "plain.txt"),
    # -- bench -------------------------------------------------------------------------
    ("bench-unknown-flag", ["bench", "--bogus"], {}, "bogus"),
    ("bench-num-prompts-0", ["bench", "--num-prompts", "0"], {}, "num-prompts"),
    ("bench-warmup-neg", ["bench", "--warmup", "-2"], {}, "warmup"),
    ("bench-rate-0", ["bench", "--rate", "0"], {}, "rate"),
    ("bench-rate-neg", ["bench", "--rate", "-1"], {}, "rate"),
    ("bench-max-concurrency-0", ["bench", "--max-concurrency", "0"], {}, "concurrency"),
    ("bench-request-timeout-0", ["bench", "--request-timeout", "0"], {}, "timeout"),
    ("bench-input-len-0", ["bench", "--dataset", "synthetic", "--input-len", "0"], {},
     "input-len"),
    ("bench-output-len-neg", ["bench", "--dataset", "synthetic", "--output-len", "-4"], {},
     "output-len"),
    ("bench-max-model-len-0", ["bench", "--max-model-len", "0"], {}, "max-model-len"),
    ("bench-param-not-int", ["bench", "--backend", "sim", "--param", "max_num_seqs=abc"], {},
     f"--param {NOT_INT}"),
    ("bench-param-not-bool", ["bench", "--backend", "sim", "--param", "enforce_eager=maybe"],
     {}, "--param enforce_eager='maybe': vllm --enforce-eager takes true or false"),
    ("bench-param-not-number",
     ["bench", "--backend", "sim", "--param", "gpu_memory_utilization=most"], {},
     "--param gpu_memory_utilization='most': vllm --gpu-memory-utilization takes a number"),
    # With --model and --max-model-len given, the files are read before the server is
    # asked anything (without them, bench asks the server for its model's name and
    # context length first, and a dead server is the one line).
    ("bench-dataset-no-usable-pairs",
     ["bench", "--url", "http://127.0.0.1:1", "--model", "m", "--max-model-len", "2048",
      "--dataset-path", "pairs.json", "--tokenizer", "tok.json"],
     {**NO_PAIRS, **NOT_A_TOKENIZER}, "json"),
    ("bench-dataset-empty", ["bench", "--url", "http://127.0.0.1:1", "--model", "m",
                             "--max-model-len", "2048", "--dataset-path", "pairs.json"],
     EMPTY_DATASET, "pairs.json"),
    ("bench-tokenizer-not-a-tokenizer",
     ["bench", "--url", "http://127.0.0.1:1", "--model", "m", "--max-model-len", "2048",
      "--tokenizer", "tok.json"], NOT_A_TOKENIZER, "tok.json"),
    ("bench-output-folder-is-a-file",
     ["bench", "--url", "http://127.0.0.1:1", "--output", "plain.txt/out.json"], A_FILE,
     "plain.txt"),
    ("bench-url-password", ["bench", "--url", f"http://tuner:{SECRET}@127.0.0.1:1",
                            "--model", "m", "--dataset", "synthetic", "--num-prompts", "1",
                            "--warmup", "0", "--request-timeout", "1"], {}, "127.0.0.1"),
    # -- ceiling -----------------------------------------------------------------------
    ("ceiling-unknown-flag", ["ceiling", "--slo-p99", "10s", "--bogus", "1"], {}, "bogus"),
    ("ceiling-max-probes-0", ["ceiling", "--slo-p99", "10s", "--max-probes", "0"], {},
     "max-probes"),
    ("ceiling-num-prompts-neg", ["ceiling", "--slo-p99", "10s", "--num-prompts", "-1"], {},
     "num-prompts"),
    ("ceiling-repeats-0", ["ceiling", "--slo-p99", "10s", "--repeats", "0"], {}, "repeats"),
    ("ceiling-confidence-1", ["ceiling", "--slo-p99", "10s", "--confidence", "1.5"], {},
     "confidence"),
    ("ceiling-start-rate-neg", ["ceiling", "--slo-p99", "10s", "--start-rate", "-2"], {},
     "start-rate"),
    ("ceiling-max-num-seqs-0", ["ceiling", "--slo-p99", "10s", "--max-num-seqs", "0"], {},
     "max-num-seqs"),
    ("ceiling-trial-neg", ["ceiling", "--slo-p99", "10s", "--study", "s", "--trial", "-1"],
     {}, "trial"),
    ("ceiling-storage-password",
     ["ceiling", "--slo-p99", "10s", "--study", "s", "--trial", "0", "--storage", ODD], {},
     "storage"),
    ("ceiling-param-not-int",
     ["ceiling", "--backend", "sim", "--slo-p99", "10s", "--param", "max_num_seqs=abc"], {},
     f"--param {NOT_INT}"),
    ("ceiling-param-api-servers-not-int",  # one the simulator reads as an int
     ["ceiling", "--backend", "sim", "--slo-p99", "10s", "--param", "api_server_count=x"], {},
     "--param api_server_count='x': vllm --api-server-count takes a whole number"),
    ("ceiling-output-folder-is-a-file",
     ["ceiling", "--slo-p99", "10s", "--output", "plain.txt/r.json"], A_FILE, "plain.txt"),
    # -- sweep -------------------------------------------------------------------------
    ("sweep-unknown-flag", ["sweep", "--rate", "1,2", "--bogus"], {}, "bogus"),
    ("sweep-rate-neg", ["sweep", "--rate", "10,-5"], {}, "rate"),
    ("sweep-rate-0", ["sweep", "--rate", "0"], {}, "rate"),
    ("sweep-rate-range-backwards", ["sweep", "--rate", "50:10:10"], {}, "rate"),
    ("sweep-concurrency-0", ["sweep", "--concurrency", "0,8"], {}, "concurrency"),
    ("sweep-num-prompts-0", ["sweep", "--rate", "1,2", "--num-prompts", "0"], {},
     "num-prompts"),
    ("sweep-param-no-values", ["sweep", "--param", "max_num_seqs="], {}, "max_num_seqs"),
    ("sweep-param-not-int",
     ["sweep", "--backend", "sim", "--rate", "1", "--param", "max_num_seqs=64,abc"], {},
     f"--param {NOT_INT}"),
    ("sweep-set-not-int",
     ["sweep", "--backend", "sim", "--rate", "1,2", "--set", "max_num_seqs=abc"], {},
     f"--set {NOT_INT}"),
    ("sweep-out-is-a-file", ["sweep", "--rate", "1,2", "--out", "plain.txt"], A_FILE,
     "plain.txt"),
    # -- report ------------------------------------------------------------------------
    ("report-unknown-flag", ["report", "s", "--bogus"], {}, "bogus"),
    ("report-no-such-study", ["report", "nosuch"], {}, "nosuch"),
    ("report-storage-password", ["report", "s", "--storage", ODD], {}, "storage"),
    ("report-storage-no-driver", ["report", "s", "--storage", MYSQL], {}, "storage"),
    ("report-import-missing", ["report", "--vllm-results", "no-such-folder"], {},
     "no-such-folder"),
    ("report-results-folder-is-a-file", ["report", "--vllm-results", "plain.txt"], A_FILE,
     "plain.txt"),
    # -- recommend ---------------------------------------------------------------------
    ("recommend-unknown-flag", ["recommend", "s", "--bogus"], {}, "bogus"),
    ("recommend-no-such-study", ["recommend", "nosuch"], {}, "nosuch"),
    ("recommend-gpus-0", ["recommend", "s", "--gpus", "0"], {}, "gpus"),
    ("recommend-gpus-neg", ["recommend", "s", "--gpus", "-2"], {}, "gpus"),
    ("recommend-headroom-over-1", ["recommend", "s", "--headroom", "1.5"], {}, "headroom"),
    ("recommend-cost-neg", ["recommend", "s", "--gpu-hour-cost", "-1"], {}, "cost"),
    ("recommend-burst-0", ["recommend", "s", "--burst-seconds", "0"], {}, "burst"),
    ("recommend-base-port-0", ["recommend", "s", "--base-port", "0"], {}, "port"),
    ("recommend-storage-password", ["recommend", "s", "--storage", ODD], {}, "storage"),
    # -- worker ------------------------------------------------------------------------
    ("worker-unknown-flag", ["worker", "--study", "s", "--storage", PG, "--bogus"], {},
     "bogus"),
    ("worker-storage-password-unreachable",
     ["worker", "--study", "s", "--storage", PG, "--db-retry-s", "0", "--wait", "0"], {},
     "storage"),
    ("worker-storage-no-folder",
     ["worker", "--study", "s", "--storage", "sqlite:///no/such/dir/x.db", "--wait", "0"], {},
     "does not exist"),
    ("worker-n-trials-0", ["worker", "--study", "s", "--storage", PG, "--n-trials", "0"], {},
     "n-trials"),
    ("worker-num-prompts-neg",
     ["worker", "--study", "s", "--storage", PG, "--num-prompts", "-1"], {}, "num-prompts"),
    ("worker-heartbeat-0",
     ["worker", "--study", "s", "--storage", PG, "--heartbeat-interval", "0"], {},
     "heartbeat"),
    ("worker-grace-under-heartbeat",
     ["worker", "--study", "s", "--storage", PG, "--heartbeat-interval", "60",
      "--grace-period", "30"], {}, "grace"),
    ("worker-db-retry-neg", ["worker", "--study", "s", "--storage", PG, "--db-retry-s", "-1"],
     {}, "db-retry"),
    ("worker-wait-neg", ["worker", "--study", "s", "--storage", PG, "--wait", "-5s"], {},
     "-5s"),
    ("worker-gpus-not-numbers", ["worker", "--study", "s", "--storage", PG, "--gpu-ids",
                                 "a,b"], {}, "gpu-ids"),
    # -- search --twin -----------------------------------------------------------------
    ("search-twin-attach", ["search", *SIM, "--url", "http://127.0.0.1:9", "--twin"], {},
     "--twin"),
    ("search-twin-prior-without-twin", ["search", *SIM, "--twin-prior", "cpu-tiny"], {},
     "add --twin"),
    ("search-twin-candidates-neg", ["search", *SIM, "--twin", "--twin-candidates", "-1"], {},
     "twin-candidates"),
    ("search-twin-prior-unknown", ["search", *SIM, "--twin", "--twin-prior", "no-such-gpu"],
     {}, "--twin-prior"),
    # -- calibrate ---------------------------------------------------------------------
    ("calibrate-no-server", ["calibrate", *CAL], {}, "no server"),
    ("calibrate-no-profile", ["calibrate", "--out", "p.yaml", "--url", "http://x"], {},
     "--profile"),
    ("calibrate-unknown-profile", ["calibrate", "--profile", "no-such-gpu", "--out", "p.yaml",
                                   "--model", "m"], {}, "--profile"),
    ("calibrate-loads-0", ["calibrate", *CAL, "--model", "m", "--loads", "0"], {}, "--loads"),
    ("calibrate-loads-words", ["calibrate", *CAL, "--model", "m", "--loads", "half"], {},
     "--loads"),
    ("calibrate-num-prompts-0", ["calibrate", *CAL, "--model", "m", "--num-prompts", "0"], {},
     "num-prompts"),
    ("calibrate-warmup-neg", ["calibrate", *CAL, "--model", "m", "--warmup", "-1"], {},
     "warmup"),
    ("calibrate-gpus-0", ["calibrate", *CAL, "--model", "m", "--gpus", "0"], {}, "gpus"),
    ("calibrate-bad-param", ["calibrate", *CAL, "--model", "m", "--param", "seqs"], {},
     "--param"),
    ("calibrate-param-not-int",
     ["calibrate", *CAL, "--model", "m", "--param", "max_num_seqs=abc"], {},
     f"--param {NOT_INT}"),
    ("calibrate-out-folder", ["calibrate", "--profile", "cpu-tiny:tiny", "--out", "sub",
                              "--model", "m"], {"sub/keep.txt": "x"}, "folder"),
    ("calibrate-out-no-folder", ["calibrate", "--profile", "cpu-tiny:tiny", "--out",
                                 "no/such/p.yaml", "--model", "m"], {}, "does not exist"),
    ("calibrate-dead-url", ["calibrate", *CAL, "--url", "http://127.0.0.1:9"], {},
     "127.0.0.1:9"),
]


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _params() -> list[object]:
    return [pytest.param(*case[1:], id=case[0]) for case in CASES]


def _in(folder: Path, fn: Callable[[], object]) -> object:
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return fn()
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(("argv", "inputs", "needle"), _params())
def test_bad_input(tmp_path: Path, argv: list[str], inputs: dict[str, str],
                   needle: str) -> None:
    for name, text in inputs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = _listing(tmp_path)
    res = _in(tmp_path, lambda: runner.invoke(app, argv, env={"AUTOTUNE_STORAGE": ""}))
    err = res.stderr  # type: ignore[attr-defined]
    out = res.stdout  # type: ignore[attr-defined]
    code = res.exit_code  # type: ignore[attr-defined]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, None), (code, out, err)
    assert res.exception is None or isinstance(res.exception, SystemExit), (  # type: ignore[attr-defined]
        f"traceback: {res.exception!r}")  # type: ignore[attr-defined]
    assert "Traceback" not in err + out
    assert SECRET not in err + out, "a password was printed"
    assert len(lines) == 1, err
    assert needle.lower() in lines[0].lower(), lines[0]
    assert _listing(tmp_path) == before, f"files written: {_listing(tmp_path) - before}"


def test_the_corpus_is_large_and_covers_every_command() -> None:
    assert len(CASES) >= 40
    assert {argv[0] for _, argv, _, _ in CASES} == {
        "search", "bench", "ceiling", "calibrate", "sweep", "report", "recommend", "worker"}
    assert len({case[0] for case in CASES}) == len(CASES)
