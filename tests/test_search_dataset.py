"""``autotune search --dataset FILE``: a search on the user's own requests, whose stored
spec lets a worker rebuild the same pool."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from typer.testing import CliRunner

from autotune.cli import app
from autotune.study.worker import build_plan, stored_spec


def _prompt(i: int) -> int:
    return 100 + (i * 37) % 400


def test_a_search_on_a_users_file_and_a_worker_rebuilds_the_same_requests(
        tmp_path: Path) -> None:
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(
        # Replies far under the SLO's reach: each test decides in its minimum time (with
        # 200-600 token replies a 10 s P99 sat at the floor and the tests ran to their
        # caps: 568 s of a loaded CI run for three trials).
        json.dumps({"prompt_tokens": _prompt(i), "output_tokens": 20 + (i * 11) % 120})
        + "\n" for i in range(300)))
    studies = tmp_path / "studies"
    result = CliRunner().invoke(app, [
        "search", "--slo-p99", "10s", "--dataset", str(traffic), "--n-trials", "3",
        "--study-name", "mine", "--studies-dir", str(studies), "--validate", "off",
        "--prove-top", "0"])
    assert result.exit_code == 0, result.stderr
    rec = json.loads((studies / "mine" / "recommendation.json").read_text())
    assert rec["best"]["goodput_tokens"] > 0
    study = optuna.load_study(study_name="mine", storage=f"sqlite:///{studies / 'mine.db'}")
    spec = stored_spec(study.user_attrs)
    assert spec is not None and spec.workload["kind"] == "pool"
    assert spec.workload["dataset"] == str(traffic.resolve())
    plan = build_plan(spec)
    # The file's 300 requests, cycled to the pool the search drew, in the file's order.
    lengths = [r.prompt_tokens for r in plan.warmup_requests + plan.requests]
    assert lengths[:300] == [_prompt(i) for i in range(300)]


def test_search_refuses_a_missing_file_and_multi_turn_of_a_file(tmp_path: Path) -> None:
    for args, message in ((["--dataset", "nope.jsonl"], "--dataset nope.jsonl: no such file"),
                          (["--dataset", "synthetic", "--multi-turn"],
                           "--multi-turn builds conversations from ShareGPT")):
        result = CliRunner().invoke(app, ["search", "--slo-p99", "10s", *args,
                                          "--studies-dir", str(tmp_path)])
        assert result.exit_code == 2 and message in result.stderr, result.stderr
        assert not any(tmp_path.iterdir())
