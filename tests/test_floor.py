"""autotune.tuning.floor: an SLO under the floor is named as such, not as overload."""

from __future__ import annotations

import os
from pathlib import Path

from typer.testing import CliRunner

from autotune.cli import app
from autotune.core.slo import parse_slo
from autotune.tuning.floor import LightTest, advice, floors


def _evidence(p99: float, share: float, backlog_lower: float = 0.0) -> dict[str, object]:
    return {"limits": [{"label": "p99:e2e", "observed_s": p99}], "served_share": share,
            "backlog_lower": backlog_lower, "backlog_allowed": 1.0}


def test_a_limit_missed_where_the_server_kept_up_is_under_the_floor() -> None:
    slo = parse_slo("10s")
    kept = LightTest.of(3, 0.5, _evidence(12.0, 1.0))
    behind = LightTest.of(4, 0.5, _evidence(9.0, 0.8))  # fell behind: says nothing
    assert kept is not None and kept.kept_up and behind is not None and not behind.kept_up
    (f,) = floors(slo, [kept, behind])
    assert (f.trial, f.floor_s, f.rate) == (3, 12.0, 0.5)
    text = advice([f], output_tokens=[100] * 98 + [1000, 1000])
    assert "A lower request rate cannot help" in text and "TPOT limit" in text
    assert "p99 reply is 1000 tokens" in text
    # One config that kept up and met the limit: the floor is under it.
    assert floors(slo, [kept, LightTest.of(5, 0.5, _evidence(8.0, 0.99))]) == []
    # A growing backlog is queueing, not a floor.
    growing = LightTest.of(6, 0.5, _evidence(12.0, 0.99, backlog_lower=5.0))
    assert growing is not None and floors(slo, [growing]) == []


def test_tests_without_evidence_are_skipped() -> None:
    assert LightTest.of(1, None, _evidence(1.0, 1.0)) is None
    assert LightTest.of(1, 2.0, {}) is None


def test_search_below_the_floor_says_so_instead_of_lower_the_rate(tmp_path: Path) -> None:
    """The simulator with ShareGPT's long replies: P99 E2E <= 1 s is under the floor of
    every config (the longest replies alone take longer), and the output says so."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        res = CliRunner().invoke(app, [
            "search", "--slo-p99", "1s", "--n-trials", "2", "--validate", "off",
            "--num-prompts", "300", "--warmup", "20",
            "--studies-dir", str(tmp_path / "studies")])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 1, res.stdout + res.stderr
    assert "no recommendation" in res.stderr
    assert "the SLO is below what the server reaches without queueing" in res.stderr
    assert "p99:e2e <= 1s is under its floor" in res.stderr
