"""vLLM ``--save-result`` JSON: written from a Summary, read back into report rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from autotune.analysis.vllm_results import (
    VllmResultError,
    load_vllm_results,
    read_vllm_rows,
    records_from_vllm_result,
    save_vllm_result,
    write_vllm_result,
)
from autotune.core.metrics import summarize
from autotune.core.records import RequestRecord
from autotune.core.slo import parse_slo
from autotune.report.sample import synthetic_records

# Every key `vllm bench serve --save-result --save-detailed` writes for a generation
# benchmark with the default percentile metrics (vllm/benchmarks/serve.py).
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
    "itls", "latencies", "start_times", "generated_texts", "errors",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "std",
                                                                 "p99")),
}


def _records(rate: float = 4.0) -> list[RequestRecord]:
    recs = synthetic_records(rate, 10.0, n=50, out_tokens=40)
    warm = synthetic_records(rate, 10.0, n=5, out_tokens=40)
    for r in warm:
        r.warmup = True
        r.index += 1000
    failed = RequestRecord(index=999, scheduled_s=1.0, dispatched_s=1.0, sent_s=1.0,
                           end_s=2.0, prompt_tokens=100, error="http_500: boom")
    return warm + recs + [failed]


def test_written_dict_has_vllms_keys_and_our_figures():
    recs = _records()
    s = summarize(recs, slo=parse_slo("10s"), offered_rate=4.0)
    d = write_vllm_result(s, recs, {"model": "m/x", "rate": 4.0, "max_concurrency": None,
                                    "burstiness": 1.0, "num_prompts": 51,
                                    "url": "http://127.0.0.1:1", "metadata": {"tp": 2}})
    assert VLLM_KEYS <= set(d)
    assert d["tp"] == 2 and d["model_id"] == "m/x" and d["backend"] == "openai"
    assert d["completed"] == 50 and d["failed"] == 1
    assert len(d["ttfts"]) == len(d["itls"]) == len(d["errors"]) == 51  # warm-up left out
    assert d["errors"][-1] == "http_500: boom" and d["ttfts"][-1] == 0.0
    assert d["p99_e2el_ms"] == pytest.approx(s.e2e.p99 * 1000)
    assert d["median_ttft_ms"] == pytest.approx(s.ttft.p50 * 1000)
    ttfts = [r.ttft_s for r in recs if r.ok and not r.warmup]
    assert d["std_ttft_ms"] == pytest.approx(np.std(ttfts) * 1000)
    assert d["request_throughput"] == pytest.approx(s.request_throughput)
    assert d["request_goodput"] == pytest.approx(s.goodput_requests)
    assert d["output_lens"][0] == 40 and d["max_concurrent_requests"] >= 1
    # One failure in 51 is more than p99 allows: failed requests count as late.
    assert d["autotune"]["meets_slo"] is False and s.meets_slo is False


def test_unlimited_rate_is_written_as_vllm_does_and_chat_endpoint_maps():
    recs = _records()
    s = summarize(recs, offered_rate=math.inf)
    d = write_vllm_result(s, recs, {"model": "m", "rate": math.inf, "endpoint": "chat"})
    assert d["request_rate"] == "inf" and d["backend"] == "openai-chat"
    assert d["request_goodput"] is None  # no SLO given, as vLLM without --goodput


def test_round_trip_into_report_rows(tmp_path: Path):
    recs = _records()
    s = summarize(recs, slo=parse_slo("10s"), offered_rate=4.0)
    path = tmp_path / "run.json"
    save_vllm_result(path, write_vllm_result(s, recs, {"model": "m", "rate": 4.0,
                                                       "metadata": {"tp": "2"}}))
    json.loads(path.read_text())  # valid strict JSON
    [row] = read_vllm_rows(path)
    assert row["rate"] == 4.0
    assert row["e2e_p99_s"] == pytest.approx(s.e2e.p99)
    assert row["ttft_p99_s"] == pytest.approx(s.ttft.p99)
    assert row["output_throughput"] == pytest.approx(s.output_throughput)
    assert row["tensor_parallel_size"] == 2 and row["meets_slo"] is False


def _vllm_file(rate: float, p99_ttft: float, detailed: bool) -> dict:
    """A result shaped as vLLM writes it (no autotune key, percentiles of ttft/tpot/itl)."""
    obj = {"date": "20250102-030405", "endpoint_type": "openai", "backend": "openai",
           "label": None, "model_id": "meta-llama/Llama-3-8B", "tokenizer_id": "x",
           "num_prompts": 3, "tp": "4", "request_rate": rate, "burstiness": 1.0,
           "max_concurrency": None, "duration": 10.0, "completed": 3, "failed": 0,
           "total_input_tokens": 30, "total_output_tokens": 60, "request_throughput": 0.3,
           "request_goodput": None, "output_throughput": 6.0,
           "total_token_throughput": 9.0, "max_output_tokens_per_s": 3.0,
           "max_concurrent_requests": 2, "mean_ttft_ms": 100.0, "median_ttft_ms": 90.0,
           "std_ttft_ms": 5.0, "p99_ttft_ms": p99_ttft, "mean_tpot_ms": 10.0,
           "median_tpot_ms": 10.0, "std_tpot_ms": 1.0, "p99_tpot_ms": 12.0}
    if detailed:
        obj.update(input_lens=[10, 10, 10], output_lens=[20, 20, 20],
                   ttfts=[0.1, 0.2, 0.3], itls=[[0.5] * 19, [0.5] * 19, [1.0] * 19],
                   generated_texts=["a", "b", "c"], errors=["", "", ""])
    return obj


def test_reads_vllm_files_including_append_result_and_folders(tmp_path: Path):
    (tmp_path / "a.json").write_text(json.dumps(_vllm_file(2.0, 150.0, True)))
    # --append-result: several objects, one per line.
    (tmp_path / "b.json").write_text(json.dumps(_vllm_file(4.0, 300.0, False)) + "\n"
                                     + json.dumps(_vllm_file(8.0, 900.0, False)))
    (tmp_path / "a.pytorch.json").write_text("[]")  # vLLM's side file: skipped
    rows = read_vllm_rows(tmp_path)
    assert [r["rate"] for r in rows] == [2.0, 4.0, 8.0]
    assert rows[0]["ttft_p99_s"] == pytest.approx(0.15)
    # E2E from a detailed file: TTFT + sum of ITLs; p99 of [9.6, 9.7, 19.3].
    assert rows[0]["e2e_p99_s"] == pytest.approx(np.percentile([9.6, 9.7, 19.3], 99))
    assert rows[1]["e2e_p99_s"] is None  # not selected in that run: not invented
    assert rows[0]["tensor_parallel_size"] == 4
    assert rows[0]["time"] == "2025-01-02T03:04:05"
    assert all("vllm bench serve" in r["source"] for r in rows)


@pytest.mark.parametrize("text,match", [
    ("", "is empty"), ("{", "not JSON"), ("[1, 2]", "not an object"),
    ('{"completed": 1}', "lacks 'request_throughput'")])
def test_bad_files_say_what_is_wrong(tmp_path: Path, text: str, match: str):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(VllmResultError, match=match):
        load_vllm_results(path)


def test_missing_paths(tmp_path: Path):
    with pytest.raises(VllmResultError, match="no such"):
        read_vllm_rows(tmp_path / "nope.json")
    with pytest.raises(VllmResultError, match=r"no vLLM result files"):
        read_vllm_rows(tmp_path)


def test_detailed_result_gives_back_records_with_the_same_figures():
    records = _records()
    summary = summarize(records)
    back = records_from_vllm_result(write_vllm_result(summary, records, {"model": "m"}))
    again = summarize(back)
    assert again.num_completed == summary.num_completed
    assert again.num_failed == summary.num_failed
    for name in ("ttft", "tpot", "itl", "e2e"):
        a, b = getattr(summary, name), getattr(again, name)
        assert (a.p50, a.p99, a.count) == pytest.approx((b.p50, b.p99, b.count), rel=1e-9)
    assert again.request_throughput == pytest.approx(summary.request_throughput, rel=1e-9)


def test_summary_only_result_is_not_taken_for_detailed():
    obj = {"request_throughput": 1.0, "output_throughput": 1.0, "completed": 1}
    with pytest.raises(VllmResultError, match="--save-detailed"):
        records_from_vllm_result(obj)
