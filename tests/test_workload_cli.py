"""``autotune workload PATH``: a traffic file described beside ShareGPT, with a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app

PNG = b"\x89PNG\r\n\x1a\n"


def _file(tmp_path: Path) -> Path:
    rows = [{"timestamp": 100.0 + 2 * i, "prompt_tokens": 100 + 10 * i,
             "output_tokens": 20 + i, "session_id": f"s{i // 3}"} for i in range(12)]
    path = tmp_path / "traffic.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_describes_lengths_conversations_and_arrivals_beside_sharegpt(tmp_path: Path) -> None:
    out, plot = tmp_path / "w.json", tmp_path / "w.png"
    result = CliRunner().invoke(app, ["workload", str(_file(tmp_path)), "--compare", "300",
                                      "--output", str(out), "--plot", str(plot)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(out.read_text())
    ours = data["workload"]
    assert ours["requests"] == 12
    assert ours["prompt_tokens"]["max"] == 210 and ours["output_tokens"]["p50"] == 25.5
    assert ours["conversations"]["conversations"] == 4
    assert ours["conversations"]["turns_mean"] == 3
    assert ours["arrivals"]["rate_per_s"] == pytest.approx(0.5)
    assert ours["arrivals"]["gap_cv"] == pytest.approx(0.0)  # evenly spaced
    assert data["sharegpt"]["requests"] == 300
    assert set(data["simulator"]) == {"lengths", "conversations", "prefixes", "arrivals"}
    text = result.stdout
    assert "4 conversations" not in text and "conversations: 4, 3.00 turns" in text
    assert "ShareGPT (300 first turns)" in text and text.count("  simulator: ") == 4
    assert plot.read_bytes().startswith(PNG)


@pytest.mark.parametrize(("args", "message"), [
    (["missing.jsonl"], "missing.jsonl"),
    (["{file}", "--compare", "-1"], "--compare must be 0 or more"),
])
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    plot = tmp_path / "p.png"
    argv = [a.replace("{file}", str(_file(tmp_path))) for a in args]
    result = CliRunner().invoke(app, ["workload", *argv, "--plot", str(plot)])
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not plot.exists()
