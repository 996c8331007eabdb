"""Virtual-time simulation: records, gates, windows, and the seed chapter's phenomena."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from autotune.core.metrics import summarize
from autotune.core.records import RequestRecord
from autotune.sim import ConfigRefused, EngineConfig, SimResult, load_hardware, simulate
from autotune.workload.arrivals import arrival_offsets
from autotune.workload.sources import Request


def sharegpt_like(n: int, seed: int = 0) -> list[Request]:
    """Lognormal lengths with ShareGPT's means (prompt ~110, output ~277 tokens)."""
    rng = np.random.default_rng(seed)

    def draw(mean: float, sigma: float) -> np.ndarray:
        x = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
        return np.clip(x, 4, 1500).astype(int)

    return [Request("hello " * int(p), int(p), int(o))
            for p, o in zip(draw(110, 1.0), draw(277, 0.8), strict=True)]


def run(rate: float, n: int = 400, *, cfg: EngineConfig | None = None, hw: str = "a100-80gb",
        seed: int = 0, **kw: object) -> SimResult:
    cfg = cfg or EngineConfig("llama-3-8b")
    return simulate(cfg, hw, None, sharegpt_like(n, seed), arrival_offsets(n, rate, seed=seed),
                    **kw)  # type: ignore[arg-type]


def summary(result: SimResult):
    return summarize(result.records, source="simulated (virtual time)")


def test_records_are_complete_and_consistent() -> None:
    reqs = sharegpt_like(200)
    arr = arrival_offsets(200, 8.0, seed=1)
    res = simulate(EngineConfig("llama-3-8b"), "a100-80gb", None, reqs, arr, warmup=20)
    assert len(res.records) == 200 and not res.aborted
    for rec in res.records:
        req = reqs[rec.index + 20]
        assert rec.ok and rec.status == 200
        assert rec.scheduled_s == pytest.approx(arr[rec.index + 20])
        assert rec.sent_s == rec.dispatched_s == rec.scheduled_s
        assert rec.output_tokens == rec.expected_output_tokens == req.output_tokens
        assert rec.prompt_tokens == req.prompt_tokens
        assert len(rec.chunk_times_s) == rec.output_tokens
        assert rec.first_token_s == rec.chunk_times_s[0] > rec.sent_s
        assert rec.end_s == rec.chunk_times_s[-1]
        assert np.all(np.diff(rec.chunk_times_s) > 0)
    assert sum(r.warmup for r in res.records) == 20
    assert sorted(r.index for r in res.records if not r.warmup) == list(range(180))
    s = summary(res)
    assert s.num_completed == 180 and s.output_throughput > 0 and s.ttft.p99 > 0
    assert res.simulated and res.stats_dict()["simulated"] is True


def test_same_inputs_same_result() -> None:
    a, b = run(10, 150), run(10, 150)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]


def test_too_long_requests_get_vllms_400() -> None:
    reqs = [Request("x", 8000, 500), Request("y", 10, 10)]
    res = simulate(EngineConfig("llama-3-8b"), "a100-80gb", None, reqs, [0.0, 0.0])
    bad, good = sorted(res.records, key=lambda r: r.index)
    assert bad.status == 400 and "maximum context length is 8192 tokens" in (bad.error or "")
    assert good.ok


def test_refusal_raises_before_anything_runs() -> None:
    with pytest.raises(ConfigRefused, match="divisible"):
        run(1, 10, cfg=EngineConfig("llama-3-8b", tensor_parallel_size=3), hw="4xa100-80gb")


def inflight_max(records: Sequence[RequestRecord]) -> int:
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def test_max_concurrency_gates_sends() -> None:
    res = run(50, 300, max_concurrency=8)
    assert inflight_max(res.records) == 8
    lagged = [r for r in res.records if r.sent_s > r.dispatched_s]
    assert lagged  # some waited at the gate ...
    assert all(r.dispatched_s == r.scheduled_s for r in res.records)  # ... not the client


def test_window_callback_sees_state_at_each_boundary_and_can_abort() -> None:
    calls: list[tuple[float, int, int]] = []

    def on_window(now: float, recs: Sequence[RequestRecord]) -> bool:
        unfinished = [r for r in recs if r.end_s is None]
        for r in recs:
            assert r.sent_s is not None and r.sent_s <= now
            assert all(t <= now for t in r.chunk_times_s)
            assert r.end_s is None or r.end_s <= now
        calls.append((now, len(recs), len(unfinished)))
        return now >= 5.0

    res = run(40, 2000, on_window=on_window, window_s=0.5)
    assert res.aborted
    times = [c[0] for c in calls]
    assert times == pytest.approx([0.5 * (i + 1) for i in range(10)])
    assert calls[-1][2] > 0
    aborted = [r for r in res.records if r.error == "aborted: pruned"]
    assert aborted and all(r.end_s == pytest.approx(5.0) for r in aborted)
    assert all(r.scheduled_s <= 5.0 for r in res.records)  # nothing sent after the abort
    assert summary(res).num_failed == len(aborted)


def test_chunk_times_flushed_at_windows_match_an_unwatched_run() -> None:
    plain = run(15, 200)
    watched = run(15, 200, on_window=lambda now, recs: False, window_s=0.25)
    for a, b in zip(plain.records, watched.records, strict=True):
        assert len(a.chunk_times_s) == len(b.chunk_times_s)
        # Cutting decode stretches at boundaries only changes float summation order
        assert np.allclose(a.chunk_times_s, b.chunk_times_s, rtol=0, atol=1e-9)


@pytest.mark.parametrize("cfg", [EngineConfig("llama-3-8b"),
                                 EngineConfig("llama-3-8b", gpu_memory_utilization=0.235)])
def test_short_stretches_in_python_match_numpy_exactly(cfg: EngineConfig,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode stretches go step by step in Python or at once in numpy; only speed differs."""
    from autotune.sim.engine import _Run

    results = []
    for scalar_steps in (0, 10**9):  # all in numpy, then all in Python
        monkeypatch.setattr(_Run, "SCALAR_STEPS", scalar_steps)
        results.append(run(30, 300, cfg=cfg, on_window=lambda now, recs: False, window_s=0.7))
    numpy_run, python_run = results
    assert numpy_run.stats_dict() == python_run.stats_dict()
    assert [(r.first_token_s, r.chunk_times_s, r.end_s) for r in numpy_run.records] == [
        (r.first_token_s, r.chunk_times_s, r.end_s) for r in python_run.records]
    if cfg.gpu_memory_utilization < 0.5:
        assert numpy_run.total_preemptions > 0  # the small cache cut stretches short


def test_engine_stats_and_timeline() -> None:
    res = run(20, 400)
    assert 0 < res.busy_fraction <= 1 and 0 < res.kv_usage_mean <= res.kv_usage_max <= 1
    assert res.steps > 0 and res.kv_capacity_tokens > 100_000 and res.max_concurrency > 1
    assert res.timeline and res.timeline[0].time_s == 1.0
    assert max(p.running for p in res.timeline) > 1
    assert all(0 <= p.busy_fraction <= 1 for p in res.timeline)


# ---- behaviour: the seed chapter's phenomena, qualitatively (all simulated) ----------

def test_rate_up_throughput_saturates_while_p99_climbs_past_a_knee() -> None:
    # The 4xA100 case study: Llama-3-8B, TP=4, max-num-seqs=128, ShareGPT, rising rate.
    cfg = EngineConfig("llama-3-8b", tensor_parallel_size=4, max_num_seqs=128)
    rows = []
    for rate in (5, 10, 40, 80, 120):
        s = summary(run(rate, 1500, cfg=cfg, hw="4xa100-80gb"))
        rows.append((rate, s.output_throughput, s.e2e.p99, s.ttft.p99))
    tput = [r[1] for r in rows]
    p99 = [r[2] for r in rows]
    ttft = [r[3] for r in rows]
    assert tput[1] > 1.7 * tput[0]  # below the knee: throughput follows the rate
    assert tput[4] < 1.1 * tput[3]  # above it: tokens/s saturates ...
    assert p99[4] > 1.5 * p99[2] and p99[4] > 2.5 * p99[0]  # ... while P99 climbs
    assert ttft[2] < 0.5 < 5 < ttft[4]  # requests queue once past the knee


def test_tp4_faster_than_tp1_but_less_than_4x() -> None:
    one = summary(run(200, 600, cfg=EngineConfig("llama-3-8b", max_num_seqs=64)))
    four = summary(run(200, 600, cfg=EngineConfig("llama-3-8b", tensor_parallel_size=4,
                                                    max_num_seqs=64), hw="4xa100-80gb"))
    ratio = four.output_throughput / one.output_throughput
    assert 1.2 < ratio < 4.0
    assert four.tpot.p50 < one.tpot.p50


def test_larger_max_num_seqs_raises_saturated_throughput_and_per_token_latency() -> None:
    small = summary(run(200, 600, cfg=EngineConfig("llama-3-8b", max_num_seqs=32)))
    large = summary(run(200, 600, cfg=EngineConfig("llama-3-8b", max_num_seqs=256)))
    assert large.output_throughput > 1.3 * small.output_throughput
    assert large.tpot.p50 > small.tpot.p50


def test_kv_exhaustion_causes_preemptions() -> None:
    # A small KV cache: gpu_memory_utilization just above what 8 B weights need.
    roomy = run(30, 300, cfg=EngineConfig("llama-3-8b"))
    tight = run(30, 300, cfg=EngineConfig("llama-3-8b", gpu_memory_utilization=0.225,
                                          max_model_len=2048))
    assert roomy.preemptions == 0
    assert tight.preemptions > 10 and tight.kv_usage_max > 0.95
    assert tight.kv_capacity_tokens < roomy.kv_capacity_tokens / 10
    assert all(r.ok and len(r.chunk_times_s) == r.output_tokens for r in tight.records)


def test_hardware_order_is_plausible() -> None:
    tput = {}
    for hw in ("l40s", "a100-80gb", "h100-80gb", "h200"):
        tput[hw] = summary(run(100, 400, hw=hw)).output_throughput
    assert tput["l40s"] < tput["a100-80gb"] < tput["h100-80gb"] <= tput["h200"] * 1.01
    assert load_hardware("h200").memory_gib > load_hardware("h100-80gb").memory_gib
