from __future__ import annotations

import heapq

import numpy as np
import optuna
import pytest

from autotune.core.records import RequestRecord
from autotune.core.slo import parse_slo, quantile
from autotune.tuning.pruning import (
    CERTAIN_VIOLATION,
    UNBOUNDED_BACKLOG,
    OverloadPruner,
    PrunerSettings,
    allowed_late,
    backlog_growing,
    certain_violation,
    decide,
    window_evidence,
)
from autotune.workload.arrivals import arrival_offsets

SLO10 = parse_slo("10s")


def test_allowed_late_matches_the_percentile_definition() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 10, 99, 100, 101, 1000, 1234):
        k = allowed_late(n, 99.0)
        base = rng.uniform(0, 5, size=n)
        # k late samples can leave p99 under the limit (here: just over it at 5+)...
        ok = np.concatenate([base[: n - k], np.full(k, 100.0)]) if k else base
        assert quantile(ok, 99.0) <= 100.0
        # ...k + 1 late samples make p99 exceed a limit of 10 for sure.
        if k + 1 <= n:
            bad = np.concatenate([base[: n - k - 1], np.full(k + 1, 11.0)])
            assert quantile(bad, 99.0) > 10.0
    assert allowed_late(1000, 99.0) == 10
    assert not certain_violation(10, 1000, 99.0)
    assert certain_violation(11, 1000, 99.0)


def test_backlog_growing_needs_significance_and_windows() -> None:
    t = np.arange(20, dtype=float)
    rng = np.random.default_rng(1)
    flat = 100 + rng.normal(0, 8, size=t.size)
    assert not backlog_growing(t, flat)
    growing = 100 + 5 * t + rng.normal(0, 8, size=t.size)
    assert backlog_growing(t, growing)
    assert not backlog_growing(t[:5], growing[:5])  # too few windows
    assert not backlog_growing(t, 100 - 5 * t)


def _queue(rate: float, *, servers: int, service_s: float, n: int, seed: int = 0
           ) -> list[RequestRecord]:
    """Records of an M/D/c queue: requests wait for one of ``servers`` slots."""
    arrivals = arrival_offsets(n, rate, seed=seed)
    free = [0.0] * servers
    heapq.heapify(free)
    out = []
    for i, a in enumerate(arrivals):
        start = max(a, heapq.heappop(free))
        end = start + service_s
        heapq.heappush(free, end)
        out.append(RequestRecord(index=i, scheduled_s=float(a), dispatched_s=float(a),
                                 sent_s=float(a), first_token_s=start + 0.05,
                                 chunk_times_s=[], end_s=end, output_tokens=100))
    return out


def _snapshot(records: list[RequestRecord], now: float) -> list[RequestRecord]:
    snap = []
    for r in records:
        if r.scheduled_s > now:
            continue
        done = r.end_s is not None and r.end_s <= now
        first = r.first_token_s if r.first_token_s is not None and r.first_token_s <= now else None
        snap.append(RequestRecord(index=r.index, scheduled_s=r.scheduled_s,
                                  dispatched_s=r.dispatched_s, sent_s=r.sent_s,
                                  first_token_s=first, end_s=r.end_s if done else None,
                                  output_tokens=r.output_tokens if done else 0))
    return snap


def _replay(records: list[RequestRecord], settings: PrunerSettings | None = None,
            window_s: float = 1.0):
    planned = len(records)
    windows = []
    end = max(r.end_s for r in records)
    now = window_s
    while now <= end + window_s:
        windows.append(window_evidence(now, _snapshot(records, now), SLO10, planned=planned,
                                       t0=0.0))
        d = decide(windows, SLO10, planned=planned, settings=settings)
        if d is not None:
            return d, end
        now += window_s
    return None, end


@pytest.mark.parametrize("seed", range(20))
def test_stable_queue_is_never_pruned(seed: int) -> None:
    # 64 slots x 4 s service = 16 req/s capacity; offered 12 req/s (75% load).
    recs = _queue(12.0, servers=64, service_s=4.0, n=600, seed=seed)
    assert quantile([r.e2e_s for r in recs], 99.0) <= 10.0
    decision, _ = _replay(recs)
    assert decision is None


@pytest.mark.parametrize("seed", range(3))
def test_overloaded_queue_is_pruned_early(seed: int) -> None:
    recs = _queue(24.0, servers=64, service_s=4.0, n=600, seed=seed)  # 150% load
    assert quantile([r.e2e_s for r in recs], 99.0) > 10.0
    decision, end = _replay(recs)
    assert decision is not None
    assert decision.rule in (CERTAIN_VIOLATION, UNBOUNDED_BACKLOG)
    assert decision.at_s < 0.75 * end


def test_backlog_rule_alone_fires_before_the_violation_is_certain() -> None:
    # Many planned requests: rule (a) needs > 1% of 4000 late; rule (b) sees the growth.
    recs = _queue(20.0, servers=64, service_s=4.0, n=4000)
    only_backlog = PrunerSettings(rules=(UNBOUNDED_BACKLOG,))
    decision, end = _replay(recs, only_backlog)
    assert decision is not None and decision.rule == UNBOUNDED_BACKLOG
    assert decision.at_s < 0.25 * end


def test_failed_and_stuck_requests_count_as_late() -> None:
    recs = [RequestRecord(index=i, scheduled_s=0.0, sent_s=0.0) for i in range(5)]
    recs[0].end_s, recs[0].error = 1.0, "http 500"
    w = window_evidence(11.0, recs, SLO10, planned=100, t0=0.0)
    assert w.late == {"p99:e2e": 5}
    assert w.in_flight == 4 and w.finished == 1
    assert decide([w], SLO10, planned=100).rule == CERTAIN_VIOLATION
    w = window_evidence(9.0, recs, SLO10, planned=100, t0=0.0)
    assert w.late == {"p99:e2e": 1}
    assert decide([w], SLO10, planned=100) is None


def test_optuna_pruner_records_rule_and_time() -> None:
    pruner = OverloadPruner(SLO10)
    study = optuna.create_study(direction="maximize", pruner=pruner)
    recs = _queue(30.0, servers=64, service_s=4.0, n=600)
    trial = study.ask()
    pruner.begin(trial.number, planned=len(recs))
    pruned_at = None
    for step in range(1, 60):
        pruner.observe(trial.number, window_evidence(float(step), _snapshot(recs, step), SLO10,
                                                     planned=len(recs), t0=0.0))
        trial.report(0.0, step)
        if trial.should_prune():
            pruned_at = step
            break
    assert pruned_at is not None
    decision = pruner.decisions[trial.number]
    assert decision.at_s == pruned_at
    assert decision.rule in (CERTAIN_VIOLATION, UNBOUNDED_BACKLOG)
    assert str(len(recs)) in decision.detail or "backlog" in decision.detail
