"""`autotune bench` end to end: real HTTP against the fake server, real files."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.testing.fake_server import FakeServer

runner = CliRunner()
SECRET = "sk-test-secret-4242"


def bench(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["bench", *args])
    return result.exit_code, result.stdout, result.stderr


def synthetic(url: str, *extra: str) -> list[str]:
    return ["--url", url, "--dataset", "synthetic", "--input-len", "8", "--output-len", "6",
            "--num-prompts", "30", "--warmup", "5", "--rate", "50", *extra]


def test_bench_writes_summary_records_and_csv(
        fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server(token_delay_s=0.001, api_key=SECRET)
    out, rows = tmp_path / "results.json", tmp_path / "records.csv"
    code, stdout, stderr = bench(*synthetic(server.url, "--api-key", SECRET,
                                            "--output", str(out), "--csv", str(rows)))
    assert code == 0, stderr
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["num_measured"] == 30 and summary["num_warmup_excluded"] == 5
    assert summary["num_completed"] == 30 and summary["total_output_tokens"] == 30 * 6
    assert data["verdict"] is None  # no SLO, no verdict: a fixed-count test
    assert len(data["records"]) == 35
    assert sum(r["warmup"] for r in data["records"]) == 5
    # The server really did all 35 requests, and we counted only the measured ones.
    assert server.stats()["requests_completed"] == 35
    with rows.open() as f:
        assert len(list(csv.DictReader(f))) == 35
    # How the figures were obtained is said in the output itself.
    assert "warm-up requests excluded" in stdout and "tokens counted with" in stdout
    # The API key is used, never printed or saved.
    assert SECRET not in stdout + stderr + out.read_text() + rows.read_text()


def test_with_an_slo_the_test_is_sized_by_time_and_judged(
        fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server(token_delay_s=0.001)
    out = tmp_path / "results.json"
    code, stdout, stderr = bench(*synthetic(server.url, "--slo", "p90:e2e<=2s",
                                            "--min-duration", "2s", "--max-duration", "6s",
                                            "--output", str(out)))
    assert code == 0, stderr
    data = json.loads(out.read_text())
    ev = data["verdict"]
    assert ev["verdict"] in ("pass", "inconclusive") and ev["reasons"]
    if ev["verdict"] == "pass":
        assert ev["at_s"] >= 2.0  # never before the minimum duration
    assert ev["at_s"] <= 6.0 + 1.0  # stopped at the cap at the latest
    # Arrivals were sized by time (50 req/s for seconds), not by the 30 prompts.
    assert data["summary"]["num_measured"] == ev["cohort"] > 30
    assert data["run"]["steady_state"]["min_duration_s"] == 2.0
    assert "verdict: " in stdout and "sized by time" in stdout
    assert "s of arrivals" in stderr  # progress lines while it runs


def test_bench_sim_backend_is_a_what_if_in_virtual_time(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code, stdout, stderr = bench("--backend", "sim", "--profile", "1xa100-80gb:llama-3-8b",
                                 "--param", "max_num_seqs=64", "--dataset", "synthetic",
                                 "--input-len", "64", "--output-len", "32", "--rate", "20",
                                 "--num-prompts", "200", "--warmup", "10",
                                 "--slo-p99", "5s", "--duration", "2m", "--output", str(out))
    assert code == 0, stderr
    data = json.loads(out.read_text())
    assert data["summary"]["source"].startswith("simulated")
    assert data["run"]["backend"] == "sim" and data["run"]["config"]["max_num_seqs"] == 64
    ev = data["verdict"]
    # 20 req/s of short requests is far under capacity, and two minutes of them give the
    # sequential test the judged requests it needs (595 times the clustering, about 3).
    assert ev["verdict"] == "pass"
    assert 115.0 <= ev["at_s"] <= 122.0  # --duration 2m: exactly two minutes judged
    assert "simulated" in stdout


def test_bench_sharegpt_through_the_server_tokenizer(
        fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server()
    out = tmp_path / "r.json"
    code, stdout, stderr = bench("--url", server.url, "--num-prompts", "20", "--warmup", "2",
                                 "--rate", "100", "--output", str(out))
    assert code == 0, stderr
    run = json.loads(out.read_text())["run"]
    assert "ShareGPT" in run["dataset"] or "sharegpt" in run["dataset"].lower()
    assert "/tokenize" in run["tokenizer"]
    assert any("ended early" in note for note in run["notes"])


def _no_file_and_one_line(code: int, stderr: str, out: Path) -> None:
    assert code != 0
    assert not out.exists()
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr


def test_bad_slo(fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server()
    out = tmp_path / "r.json"
    code, _, stderr = bench(*synthetic(server.url, "--slo-p99", "fast", "--output", str(out)))
    _no_file_and_one_line(code, stderr, out)
    assert "accepted forms" in stderr


def test_missing_dataset_path(fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server()
    out = tmp_path / "r.json"
    code, _, stderr = bench("--url", server.url, "--dataset-path", str(tmp_path / "nope.json"),
                            "--output", str(out))
    _no_file_and_one_line(code, stderr, out)
    assert "nope.json" in stderr


def test_no_server_at_url(tmp_path: Path) -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.json"
    code, _, stderr = bench(*synthetic(f"http://127.0.0.1:{port}", "--output", str(out)))
    _no_file_and_one_line(code, stderr, out)
    assert str(port) in stderr


@pytest.mark.parametrize("rate", ["0", "-3"])
def test_rate_not_positive(fake_server: Callable[..., FakeServer], tmp_path: Path,
                           rate: str) -> None:
    server = fake_server()
    out = tmp_path / "r.json"
    code, _, stderr = bench(*synthetic(server.url, "--output", str(out)), "--rate", rate)
    _no_file_and_one_line(code, stderr, out)
    assert "--rate" in stderr


def test_dataset_with_no_usable_pairs(
        fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server()
    data = tmp_path / "tiny.json"
    # Complete records, but every reply is shorter than 4 tokens.
    data.write_text(json.dumps([
        {"id": str(i), "conversations": [{"from": "human", "value": "hi there friend ok"},
                                         {"from": "gpt", "value": "no"}]} for i in range(5)]))
    out = tmp_path / "r.json"
    code, _, stderr = bench("--url", server.url, "--dataset-path", str(data),
                            "--output", str(out))
    _no_file_and_one_line(code, stderr, out)
    assert "no usable" in stderr


def test_failures_show_in_the_summary(
        fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server(fault="500", fail_every=3)
    out = tmp_path / "r.json"
    code, _, stderr = bench(*synthetic(server.url, "--warmup", "0", "--output", str(out)))
    assert code == 0, stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_failed"] == 10 and summary["num_completed"] == 20


def test_pitfalls_are_flagged(fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server()
    out = tmp_path / "r.json"
    code, stdout, stderr = bench(*synthetic(server.url, "--warmup", "0", "--output", str(out),
                                            "--max-concurrency", "1"))
    assert code == 0, stderr
    codes = {d["code"] for d in json.loads(out.read_text())["run"]["diagnoses"]}
    assert {"no_warmup", "single_stream", "fixed_short_prompts"} <= codes
    assert "WARNING" in stdout


def test_infinite_rate_writes_valid_json(
        fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    server = fake_server()
    out = tmp_path / "r.json"
    code, _, stderr = bench(*synthetic(server.url, "--output", str(out)), "--rate", "inf")
    assert code == 0, stderr
    data = json.loads(out.read_text())
    assert data["run"]["rate"] is None and data["summary"]["num_completed"] == 30


def test_console_script_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "autotune", "bench", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--slo-p99" in proc.stdout


def test_vllm_result_layout(fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    from autotune.analysis.vllm_results import load_vllm_results
    server = fake_server()
    out = tmp_path / "vllm.json"
    code, _, stderr = bench(*synthetic(server.url, "--output", str(out), "--format", "vllm"))
    assert code == 0, stderr
    data = json.loads(out.read_text())
    assert data["completed"] == 30 and data["total_output_tokens"] == 180
    assert {"mean_ttft_ms", "p99_e2el_ms", "request_throughput"} <= set(data)
    assert len(load_vllm_results(out)) == 1
