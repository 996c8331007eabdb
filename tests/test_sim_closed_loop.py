"""Closed-loop load in the simulator: virtual users who send, wait, think and send again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from autotune.backends.base import LoadPlan
from autotune.backends.sim import SimBackend
from autotune.core.records import RequestRecord
from autotune.core.slo import parse_slo
from autotune.sim import EngineConfig, HardwareProfile, SimResult, load_hardware, simulate
from autotune.sim.engine import ABORTED, _Run
from autotune.workload.arrivals import ClosedLoop
from autotune.workload.sources import Request

A100 = load_hardware("a100-80gb")
# A front end with a cost: ends reach the client later than the engine's step, and
# stretches must stop before the sends those ends lead to.
FRONT = replace(A100, frontend_request_ms=3.0, frontend_token_us=60.0,
                frontend_engine_share=0.3)
TOO_LONG = Request("", 9000, 10)  # refused with a 400 (llama-3-8b: 8192 tokens)


def lognormal(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(np.log(110) - 0.5, 1.0, n), 4, 1500).astype(int)
    o = np.clip(rng.lognormal(np.log(200) - 0.32, 0.8, n), 4, 1500).astype(int)
    return [Request("", int(a), int(b)) for a, b in zip(p, o, strict=True)]


def closed(users: int, requests: Sequence[Request], loop: ClosedLoop, *, seed: int = 0,
           hw: HardwareProfile = A100, cfg: EngineConfig | None = None,
           **kw: object) -> tuple[SimResult, np.ndarray, np.ndarray]:
    """A closed-loop run; also the users' first sends and the think times it used."""
    starts = loop.starts(users, seed)
    think = loop.think_times(len(requests), seed)
    res = simulate(cfg or EngineConfig("llama-3-8b"), hw, None, requests, starts,
                   think_s=think, **kw)  # type: ignore[arg-type]
    return res, starts, think


def send_order(res: SimResult, warmup: int = 0) -> list[RequestRecord]:
    """Records by send number k (``index = k - warmup``)."""
    recs = sorted(res.records, key=lambda r: r.index)
    assert [r.index + warmup for r in recs] == list(range(len(recs)))
    return recs


def in_flight(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight as a step function: (event times, count from each on).  At one
    instant ends come before sends (a user without think time sends as its request
    ends)."""
    events = sorted([(r.end_s, -1) for r in records] + [(r.sent_s, 1) for r in records])
    return np.array([t for t, _ in events]), np.cumsum([d for _, d in events])


# ---- who is in flight ------------------------------------------------------------------

@pytest.mark.parametrize("hw", [A100, FRONT], ids=["plain", "front-end"])
def test_never_more_than_users_in_flight_and_all_of_them_without_think_time(
        hw: HardwareProfile) -> None:
    users = 24
    res, _, _ = closed(users, lognormal(400, seed=1), ClosedLoop(think_s=0.0), hw=hw)
    recs = send_order(res)
    assert len(recs) == 400 and all(r.ok for r in recs)
    times, count = in_flight(recs)
    assert count.max() == users
    # Until the last send every user has its request in flight at every instant.
    last_send = max(r.sent_s for r in recs if r.sent_s is not None)
    busy = np.diff(times)
    upto = times[1:] <= last_send
    full = busy[upto & (count[:-1] == users)].sum()
    assert full == pytest.approx(last_send - min(times), rel=1e-12)
    # With think time, fewer are in flight, never more.
    res, _, _ = closed(users, lognormal(400, seed=1), ClosedLoop(think_s=2.0), hw=hw)
    times, count = in_flight(res.records)
    mean = (np.diff(times) * count[:-1]).sum() / (times[-1] - times[0])
    assert count.max() <= users and mean < 0.9 * users


def test_a_single_user_sends_one_request_after_another() -> None:
    res, _, think = closed(1, lognormal(60, seed=2), ClosedLoop(think_s=0.3, think="fixed"))
    recs = send_order(res)
    for prev, nxt in zip(recs, recs[1:], strict=False):
        assert prev.end_s is not None
        assert nxt.sent_s == prev.end_s + 0.3
    assert np.all(think == 0.3)


@pytest.mark.parametrize("hw", [A100, FRONT], ids=["plain", "front-end"])
@pytest.mark.parametrize("think", ["fixed", "exponential"])
def test_each_send_is_an_end_plus_its_think_time(hw: HardwareProfile, think: str) -> None:
    """The sends are the users' first sends and, after them, each end plus the think time
    of the request that ended (``think_s[k]`` for the k-th sent), earliest first, until
    the requests run out; refusals end and lead to a send like the others."""
    users, n, warmup = 16, 300, 7
    reqs = lognormal(n, seed=3)
    reqs[40] = reqs[41] = reqs[200] = TOO_LONG
    res, starts, think_s = closed(users, reqs, ClosedLoop(think_s=0.5, think=think),
                                  hw=hw, warmup=warmup)
    recs = send_order(res, warmup)
    assert len(recs) == n and sum(r.warmup for r in recs) == warmup
    assert sum(r.status == 400 for r in recs) == 3
    for k, r in enumerate(recs):
        assert r.sent_s == r.dispatched_s == r.scheduled_s
        assert r.expected_output_tokens == reqs[k].output_tokens  # k-th sent: requests[k]
        assert r.end_s is not None and r.sent_s is not None
        # Without a front end a refusal ends as it is sent.
        assert r.end_s > r.sent_s or (r.status == 400 and r.end_s == r.sent_s and hw is A100)
    # An end after the last send leads to none, and comes later than every send.
    wanted = sorted([*starts.tolist(), *(r.end_s + think_s[k] for k, r in enumerate(recs))])
    assert [r.sent_s for r in recs] == wanted[:n]


def test_ends_lead_to_sends_the_engine_has_not_stepped_past(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A send pushed when a request ends never falls before a step the engine already
    began (with the front end, a decode stretch must stop before it); at worst inside
    the step just taken, as an open-loop arrival may."""
    seen: list[float] = []
    dispatch = _Run._dispatch_closed_until

    def checked(self: _Run, t: float) -> None:
        steps, left = self.steps, self.next_arrival < len(self.requests)
        # The loop and the stretches stop at t_arrival: the earliest pending send.
        assert self.t_arrival == (min(self.pending)[0] if self.pending and left else np.inf)
        if steps.n and left and self.t_arrival <= t:
            seen.append(self.t_arrival - (steps.end[-1] - steps.dur[-1]))
        dispatch(self, t)

    monkeypatch.setattr(_Run, "_dispatch_closed_until", checked)
    for hw in (A100, FRONT):
        for loop in (ClosedLoop(think_s=0.0), ClosedLoop(think_s=1.0)):
            reqs = lognormal(300, seed=4)
            reqs[10] = TOO_LONG
            closed(48, reqs, loop, hw=hw, on_window=lambda now, recs: False, window_s=0.37)
    assert len(seen) > 500 and min(seen) > 0


# ---- laws of a closed loop -------------------------------------------------------------

def test_littles_law_over_a_long_run() -> None:
    users, n = 32, 3000
    res, _, think = closed(users, lognormal(n, seed=5), ClosedLoop(think_s=2.0))
    recs = send_order(res)
    span = max(r.end_s for r in recs if r.end_s) - min(r.sent_s for r in recs if r.sent_s)
    throughput = n / span
    e2e = np.mean([r.end_s - r.sent_s for r in recs if r.end_s and r.sent_s])
    assert users == pytest.approx(throughput * (e2e + think.mean()), rel=0.03)
    # Had the users not waited for their ends, or not thought, this would be far off.
    assert e2e > 0.2 * think.mean()


def test_more_users_more_throughput_and_latency_until_saturation() -> None:
    loop = ClosedLoop(think_s=1.0)
    rows = []
    for users in (4, 16, 64):
        res, _, _ = closed(users, lognormal(600, seed=6), loop)
        recs = res.records
        span = max(r.end_s for r in recs if r.end_s) - min(r.sent_s for r in recs if r.sent_s)
        e2e = float(np.mean([r.end_s - r.sent_s for r in recs if r.end_s and r.sent_s]))
        rows.append((len(recs) / span, e2e))
    (x4, r4), (x16, r16), (x64, r64) = rows
    assert x4 < x16 < x64 and r4 < r16 < r64
    assert x16 > 2.5 * x4  # far below saturation: nearly proportional to users


def test_past_saturation_throughput_stays_and_latency_grows_with_users() -> None:
    cfg = EngineConfig("llama-3-8b", max_num_seqs=8)  # saturates at 8 in flight
    rows = []
    for users in (16, 32, 64):
        res, _, _ = closed(users, lognormal(500, seed=7), ClosedLoop(think_s=0.0), cfg=cfg)
        recs = res.records
        span = max(r.end_s for r in recs if r.end_s) - min(r.sent_s for r in recs if r.sent_s)
        e2e = float(np.mean([r.end_s - r.sent_s for r in recs if r.end_s and r.sent_s]))
        rows.append((len(recs) / span, e2e))
    (x16, r16), (x32, r32), (x64, r64) = rows
    assert x32 == pytest.approx(x16, rel=0.15) and x64 == pytest.approx(x16, rel=0.15)
    assert r32 > 1.6 * r16 and r64 > 1.6 * r32  # the extra users wait in the queue


# ---- windows, abort, consistency ------------------------------------------------------

@pytest.mark.parametrize("hw", [A100, FRONT], ids=["plain", "front-end"])
def test_a_window_that_returns_true_stops_the_run(hw: HardwareProfile) -> None:
    calls: list[float] = []

    def on_window(now: float, recs: Sequence[RequestRecord]) -> bool:
        for r in recs:
            assert r.sent_s is not None and r.sent_s <= now
            assert r.end_s is None or r.end_s <= now
        calls.append(now)
        return now >= 3.0

    n = 2000
    res, _, _ = closed(40, lognormal(n, seed=8), ClosedLoop(think_s=0.5), hw=hw,
                       on_window=on_window, window_s=0.5)
    assert res.aborted and calls[-1] == pytest.approx(3.0)
    recs = send_order(res)  # only what was sent is recorded, numbered from 0
    assert 40 < len(recs) < n
    assert all(r.sent_s is not None and r.sent_s <= 3.0 for r in recs)
    aborted = [r for r in recs if r.error == ABORTED]
    assert aborted and all(r.end_s == pytest.approx(3.0) for r in aborted)
    assert all(r.end_s is not None and r.end_s <= 3.0 for r in recs)
    # The ones in flight at the abort are exactly those aborted.
    assert {id(r) for r in aborted} == {id(r) for r in recs if not r.ok}


@pytest.mark.parametrize("hw", [A100, FRONT], ids=["plain", "front-end"])
def test_stretches_in_python_and_numpy_agree_in_a_closed_loop(
        hw: HardwareProfile, monkeypatch: pytest.MonkeyPatch) -> None:
    results = []
    for scalar_steps in (0, 10**9):  # all in numpy, then all in Python
        monkeypatch.setattr(_Run, "SCALAR_STEPS", scalar_steps)
        cfg = EngineConfig("llama-3-8b", gpu_memory_utilization=0.225, max_model_len=2048)
        res, _, _ = closed(64, lognormal(300, seed=9), ClosedLoop(think_s=1.0), hw=hw,
                           cfg=cfg, on_window=lambda now, recs: False, window_s=0.7)
        results.append(res)
    numpy_run, python_run = results
    assert numpy_run.total_preemptions > 0  # the small cache cuts stretches short
    assert numpy_run.stats_dict() == python_run.stats_dict()
    assert [r.to_dict() for r in numpy_run.records] == [r.to_dict()
                                                        for r in python_run.records]


def test_more_users_than_requests_and_stats_cover_the_run() -> None:
    res, starts, _ = closed(50, lognormal(20, seed=10), ClosedLoop(think_s=4.0), warmup=5)
    recs = send_order(res, 5)
    assert len(recs) == 20  # 30 users never send
    assert [r.sent_s for r in recs] == sorted(starts.tolist())[:20]
    measured = [r for r in recs if not r.warmup]
    assert res.window_start_s == min(r.sent_s for r in measured if r.sent_s is not None)
    assert res.window_end_s == max(r.end_s for r in measured if r.end_s is not None)
    assert 0 < res.busy_fraction <= 1


def test_bad_closed_loop_input_is_refused() -> None:
    cfg, reqs = EngineConfig("llama-3-8b"), lognormal(10)
    with pytest.raises(ValueError, match="10 requests but 9 think times"):
        simulate(cfg, A100, None, reqs, [0.0, 0.0], think_s=[0.0] * 9)
    with pytest.raises(ValueError, match="think times must be finite and >= 0"):
        simulate(cfg, A100, None, reqs, [0.0, 0.0], think_s=[0.0] * 9 + [-1.0])
    with pytest.raises(ValueError, match="think times must be finite and >= 0"):
        simulate(cfg, A100, None, reqs, [0.0, 0.0], think_s=[0.0] * 9 + [np.inf])
    with pytest.raises(ValueError, match="max_concurrency must be None in a closed loop"):
        simulate(cfg, A100, None, reqs, [0.0, 0.0], think_s=[0.0] * 10, max_concurrency=4)
    with pytest.raises(ValueError, match="at least 1 user"):
        simulate(cfg, A100, None, reqs, [], think_s=[0.0] * 10)
    with pytest.raises(ValueError, match="arrival offsets must be finite and >= 0"):
        simulate(cfg, A100, None, reqs, [0.0, -1.0], think_s=[0.0] * 10)
    with pytest.raises(ValueError, match="warmup must be between 0 and 10"):
        simulate(cfg, A100, None, reqs, [0.0], think_s=[0.0] * 10, warmup=11)
    # Open loop as before: one arrival per request.
    with pytest.raises(ValueError, match="10 requests but 2 arrival offsets"):
        simulate(cfg, A100, None, reqs, [0.0, 0.0])


def test_each_users_first_request_is_warm_up_while_the_loop_ramps_up() -> None:

    backend = SimBackend("a100-80gb", "llama-3-8b")
    backend.prepare({"max_num_seqs": 64})
    plan = LoadPlan(slo=parse_slo("p99:e2e<=10s"), requests=lognormal(400), warmup=10, seed=1,
                    closed=ClosedLoop(think_s=5.0))
    assert plan.warmup_at(40) == 40 and plan.warmup_at(4) == 10
    records = sorted(backend.load_test(40, plan, None).records, key=lambda r: r.sent_s)
    warm = [r for r in records if r.warmup]
    assert len(warm) == 40
    # The warm-up is the first 40 sends: about one per user, as the users start spread
    # over one 5 s think time.
    assert all(r.warmup for r in records[:40]) and not any(r.warmup for r in records[40:])


def test_a_multi_turn_loops_warm_up_holds_each_users_first_conversation_whole() -> None:
    """A user takes a conversation's turns in order: one warm-up request per user left
    most users' first turns judged in the start-up burst.  The warm-up now holds the
    first conversation of every user, and on the simulator every user's first request
    is warm-up."""
    # Conversations of 3, 1 and 2 turns, cycled.
    shape = [(c, t) for c, n in enumerate([3, 1, 2] * 100) for t in range(n)]
    reqs = [replace(r, conversation=f"c{c}", turn=t)
            for r, (c, t) in zip(lognormal(600), shape, strict=True)]
    plan = LoadPlan(slo=parse_slo("p99:e2e<=10s"), requests=reqs, warmup=5, seed=1,
                    closed=ClosedLoop(think_s=5.0))
    # 12 users: the first 12 conversations are 4 rounds of (3, 1, 2) = 24 requests.
    assert plan.warmup_at(12) == 24
    single = replace(plan, requests=lognormal(600))
    assert single.warmup_at(12) == 12
    backend = SimBackend("a100-80gb", "llama-3-8b")
    backend.prepare({"max_num_seqs": 64})
    records = sorted(backend.load_test(12, plan, None).records, key=lambda r: r.sent_s)
    assert sum(r.warmup for r in records) == 24
    # Each of the 12 users' first sends is warm-up (the first 12 sends of the test).
    assert all(r.warmup for r in records[:12])
