from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import expon

from autotune.core.metrics import quantile_upper_bound, summarize
from autotune.core.records import RequestRecord
from autotune.core.slo import parse_slo, quantile
from autotune.tuning.ceiling import (
    CeilingError,
    ProbeResult,
    completion_rate,
    find_ceiling,
    min_samples_for_bound,
    stepdown_probe_count,
    stepdown_rate,
)
from autotune.tuning.verdict import check_limits, verdict_of

SLO10 = parse_slo("10s")


# ----------------------------------------------------------------------------- synthetic


def _records(sent: np.ndarray, latencies: np.ndarray) -> list[RequestRecord]:
    """Records sent at ``sent`` with e2e ``latencies`` (inf = a failed request)."""
    recs = []
    for i, (t, lat) in enumerate(zip(sent.tolist(), latencies.tolist(), strict=True)):
        if math.isinf(lat):
            recs.append(RequestRecord(index=i, scheduled_s=t, dispatched_s=t, sent_s=t,
                                      end_s=t + 1.0, error="timeout: test"))
            continue
        recs.append(RequestRecord(index=i, scheduled_s=t, dispatched_s=t, sent_s=t,
                                  first_token_s=t + 0.1 * lat, end_s=t + lat,
                                  output_tokens=10, prompt_tokens=5))
    return recs


class QueueModel:
    """p-th latency = base / (1 - rate / capacity) * (exponential quantile): a
    deterministic function of rate, monotone, overloaded (failures) at capacity."""

    def __init__(self, capacity: float = 20.0, base: float = 0.8) -> None:
        self.capacity = capacity
        self.base = base
        self.calls: list[tuple[float, int]] = []

    def unit(self, n: int) -> np.ndarray:
        # Exponential quantiles in a fixed shuffled order (latency not sorted by time).
        u = expon.ppf((np.arange(n) + 0.5) / n)
        return np.random.default_rng(0).permutation(u)

    def __call__(self, rate: float, n: int) -> ProbeResult:
        self.calls.append((rate, n))
        sent = np.arange(n) / rate
        if rate >= self.capacity:
            # Completions leave at the capacity, the backlog grows: the pruner stops it.
            lat = 0.1 + np.arange(n) * (1.0 / self.capacity - 1.0 / rate)
            recs = _records(sent, lat)
            s = summarize(recs, slo=SLO10, offered_rate=rate,
                          source="synthetic (test)")
            return ProbeResult(s, pruned=True, prune_reason="unbounded_backlog: grows",
                               server_s=float(sent[-1] + lat[-1]),
                               completion_rate=completion_rate(recs))
        lat = self.base / (1.0 - rate / self.capacity) * self.unit(n)
        recs = _records(sent, lat)
        s = summarize(recs, slo=SLO10, offered_rate=rate, source="synthetic (test)")
        return ProbeResult(s, server_s=float(sent[-1] + lat[-1]),
                           completion_rate=completion_rate(recs))

    def true_ceiling(self, n: int, threshold: float, confidence: float = 0.95) -> float:
        u = self.unit(n)
        worst = max(quantile(u, 99.0), quantile_upper_bound(u, 99.0, confidence))
        return self.capacity * (1.0 - self.base * worst / threshold)


def test_min_samples_for_bound_is_where_the_bound_becomes_finite() -> None:
    n = min_samples_for_bound(99.0, 0.95)
    assert n == 299
    assert math.isinf(quantile_upper_bound(np.arange(n - 1.0), 99.0, 0.95))
    assert math.isfinite(quantile_upper_bound(np.arange(float(n)), 99.0, 0.95))


@pytest.mark.parametrize("start_factor", [0.3, 0.55, 0.8, 1.3, 2.5])
def test_lands_within_tol_below_the_true_ceiling(start_factor: float) -> None:
    model = QueueModel()
    truth = model.true_ceiling(400, 10.0)
    res = find_ceiling(model, slo=SLO10, start_rate=start_factor * truth, num_prompts=400,
                       max_num_prompts=400, max_probes=12)
    assert res.feasible and res.converged
    assert res.feasible_max <= truth + 1e-9  # never above
    assert res.feasible_max >= truth * (1 - 0.03)  # within 3% below
    assert res.infeasible_min > truth
    assert res.infeasible_min / res.feasible_max - 1 <= 0.03 + 1e-12
    assert res.binding == "p99:e2e"
    assert res.search_probes == len(model.calls)
    assert res.recommended_cap == pytest.approx(res.feasible_max * 0.9)


def test_at_most_eight_probes_from_a_start_within_a_factor_two() -> None:
    for factor in (0.5, 0.7, 1.0, 1.4, 2.0):
        model = QueueModel()
        truth = model.true_ceiling(400, 10.0)
        res = find_ceiling(model, slo=SLO10, start_rate=factor * truth, num_prompts=400,
                           max_num_prompts=400)
        assert res.converged, (factor, [(p.rate, p.verdict) for p in res.probes])
        assert res.search_probes <= 8
        assert truth * 0.97 <= res.feasible_max <= truth


def test_overloaded_probe_caps_the_next_guess() -> None:
    model = QueueModel(capacity=20.0)
    res = find_ceiling(model, slo=SLO10, start_rate=64.0, num_prompts=400,
                       max_num_prompts=400, max_probes=12)
    rates = [r for r, _ in model.calls]
    # After failing at 64 with 20 req/s completed, the next probe goes to the capacity
    # seen (20), not to 32, which would be as overloaded.
    assert rates[1] == pytest.approx(20.0)
    assert res.probes[0].overloaded
    assert res.saturated_throughput == pytest.approx(20.0, rel=0.02)
    assert res.saturated_how == "estimated from overloaded probes"
    assert res.stepdown_probes == stepdown_probe_count(res.saturated_throughput,
                                                       res.feasible_max)


def test_budget_spent_reports_the_open_bracket() -> None:
    model = QueueModel()
    res = find_ceiling(model, slo=SLO10, start_rate=1.0, num_prompts=400,
                       max_num_prompts=400, max_probes=3)
    assert len(model.calls) == 3
    assert not res.converged
    assert res.feasible_max == 4.0 and res.infeasible_min is None
    assert "at least" in res.sentence()
    assert any("budget" in n for n in res.notes) or res.infeasible_min is None


def test_sentence_names_rate_bound_and_cap() -> None:
    model = QueueModel()
    res = find_ceiling(model, slo=SLO10, start_rate=10.0, num_prompts=400,
                       max_num_prompts=400)
    text = res.sentence()
    probe = res.feasible_probe()
    assert probe is not None
    bound = probe.check("p99:e2e").bound_s
    assert bound <= 10.0
    assert text.startswith("sustains ")
    assert "with P99 ≤ 10 s (95% bound " in text
    assert f"cap at {res.recommended_cap:.2f} req/s" in text
    assert "simulated" not in text


def test_infeasible_says_even_the_lowest_rate_misses() -> None:
    calls: list[float] = []

    def probe(rate: float, n: int) -> ProbeResult:
        calls.append(rate)  # even an idle request takes 12 s: slower than the SLO
        sent = np.arange(n) / rate
        recs = _records(sent, np.full(n, 12.0))
        return ProbeResult(summarize(recs, slo=SLO10, source="synthetic (test)"),
                           completion_rate=completion_rate(recs))

    res = find_ceiling(probe, slo=SLO10, start_rate=4.0, num_prompts=300,
                       max_num_prompts=300, min_rate=0.5)
    assert not res.feasible
    assert res.feasible_max is None and res.recommended_cap is None
    assert res.lowest_rate == pytest.approx(0.5)
    assert res.sentence().startswith("even 0.5 req/s misses the SLO; the config cannot meet it")
    assert calls == [4.0, 2.0, 1.0, 0.5]
    assert res.binding == "p99:e2e"


# ----------------------------------------------------------------------------- confidence


class TailProbe:
    """Exactly two slow requests (20 s) whatever n: at n=299 the p99 point estimate
    passes a 10 s limit but its 95% bound (the maximum) does not; with more requests
    the bound drops below the two outliers and the probe passes."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []

    def __call__(self, rate: float, n: int) -> ProbeResult:
        self.calls.append((rate, n))
        lat = np.full(n, 5.0 if rate <= 8 else 12.0)
        lat[-2:] = 20.0
        sent = np.arange(n) / rate
        return ProbeResult(summarize(_records(sent, lat), slo=SLO10, offered_rate=rate,
                                     source="synthetic (test)"))


def test_point_pass_without_the_bound_is_uncertain() -> None:
    probe = TailProbe()
    s = probe(4.0, 299).summary
    assert s.slo_check is not None and s.slo_check.met  # point estimate passes
    checks = check_limits(s, SLO10, 0.95)
    assert checks[0].point_ok and not checks[0].bound_ok
    assert verdict_of(checks, pruned=False) == "uncertain"
    assert verdict_of(checks, pruned=True) == "fail"


def test_uncertain_probe_is_rerun_with_more_requests() -> None:
    probe = TailProbe()
    res = find_ceiling(probe, slo=SLO10, start_rate=4.0, tol=0.3, num_prompts=100,
                       max_num_prompts=2000, max_probes=10)
    ns = [n for _, n in probe.calls]
    assert ns[0] == 299  # raised up front to where the bound is finite
    assert ns[:3] == [299, 598, 1196]  # doubled while "more requests needed"
    assert probe.calls[1][0] == probe.calls[0][0] == 4.0
    assert any("more requests needed" in note for note in res.notes)
    assert [p.phase for p in res.probes[:3]] == ["bracket", "more-requests", "more-requests"]
    assert res.probes[2].verdict == "pass"
    assert res.feasible_max is not None and 4.0 <= res.feasible_max <= 8.0


def test_never_passes_on_luck_when_requests_run_out() -> None:
    probe = TailProbe()
    res = find_ceiling(probe, slo=SLO10, start_rate=4.0, num_prompts=299,
                       max_num_prompts=600, max_probes=6, min_rate=1.0)
    assert all(p.verdict != "pass" for p in res.probes)
    assert not res.feasible
    assert any("not counted as passing" in note for note in res.notes)
    assert "only by its point estimate, not with 95% confidence" in res.sentence()


def test_repeats_demote_a_lucky_boundary_and_report_spread() -> None:
    model = QueueModel()
    flaky_rate: list[float] = []

    def probe(rate: float, n: int, *, repeat: int = 0) -> ProbeResult:
        # Repeats of the first feasible_max fail: it met the SLO by luck.
        if repeat and (not flaky_rate or flaky_rate[0] == rate):
            flaky_rate[:1] = [rate]
            return model(model.capacity * 1.5, n)
        return model(rate, n)

    res = find_ceiling(probe, slo=SLO10, start_rate=10.0, num_prompts=400,
                       max_num_prompts=400, repeats=3)
    assert flaky_rate, "repeats ran"
    assert res.feasible_max is not None and res.feasible_max < flaky_rate[0]
    assert any("repeats" in note for note in res.notes)
    assert res.spread[0].rate == flaky_rate[0] and res.spread[0].passes == 1
    assert res.spread[0].runs == 3
    assert sum(p.phase == "repeat" for p in res.probes) >= 4
    # Repeats do not count against the search budget.
    assert res.search_probes == sum(p.phase != "repeat" for p in res.probes)


def test_saturation_probe_when_no_start_rate() -> None:
    model = QueueModel()
    truth = model.true_ceiling(400, 10.0)

    def probe(rate: float, n: int) -> ProbeResult:
        if math.isinf(rate):
            return model(model.capacity * 2, n)  # all at once: saturated
        return model(rate, n)

    res = find_ceiling(probe, slo=SLO10, start_rate=None, num_prompts=400,
                       max_num_prompts=400)
    assert res.probes[0].phase == "saturation"
    assert res.saturated_how == "served at rate inf"
    assert res.saturated_throughput == pytest.approx(20.0, rel=0.02)
    assert res.probes[1].rate == pytest.approx(0.7 * res.saturated_throughput)
    assert res.converged and truth * 0.97 <= res.feasible_max <= truth
    assert res.search_probes <= 8


# ----------------------------------------------------------------------------- misc


def test_stepdown_probe_count_follows_auto_tune() -> None:
    # inf, then 21, 20, ..., 14 (the first integer <= 14.6 passes): 1 + 8.
    assert stepdown_probe_count(20.3, 14.6) == 9
    assert stepdown_probe_count(5.0, 6.2) == 2  # inf, then 6 passes
    assert stepdown_probe_count(5.0, 5.9) == 3  # inf, 6 fails, 5 passes
    assert stepdown_probe_count(3.2, 0.4) == 1 + 4  # 4, 3, 2, 1 all fail
    # Saturated throughput below the ceiling: int + 1 passes at once, far below it.
    assert stepdown_probe_count(13.0, 16.5) == 2
    assert stepdown_rate(13.0, 16.5) == 14.0
    assert stepdown_rate(20.3, 14.6) == 14.0
    assert stepdown_rate(3.2, 0.4) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tol": 0.0}, "tolerance"),
        ({"tol": -0.1}, "tolerance"),
        ({"start_rate": 0.0}, "start rate"),
        ({"start_rate": -2.0}, "start rate"),
        ({"start_rate": math.inf}, "start rate"),
        ({"max_probes": 0}, "probe budget"),
        ({"repeats": 0}, "repeats"),
        ({"headroom": 1.0}, "headroom"),
        ({"max_num_prompts": 100, "num_prompts": 50}, "needs at least 299"),
        ({"max_num_prompts": 10, "num_prompts": 50}, "max_num_prompts"),
    ],
)
def test_bad_input_raises_ceiling_error(kwargs: dict, message: str) -> None:
    args = {"slo": SLO10, "start_rate": 1.0, "num_prompts": 300, "max_num_prompts": 600}
    args.update(kwargs)
    model = QueueModel()
    with pytest.raises(CeilingError, match=message):
        find_ceiling(model, **args)
    assert model.calls == []  # nothing ran


def test_to_dict_is_json_safe() -> None:
    import json

    model = QueueModel()
    res = find_ceiling(model, slo=SLO10, start_rate=25.0, num_prompts=300,
                       max_num_prompts=300)
    data = res.to_dict()
    text = json.dumps(data, allow_nan=False)
    assert '"answer"' in text
    assert data["probes"][0]["checks"][0]["label"] == "p99:e2e"
    assert data["total_probes"] == len(res.probes)


# ----------------------------------------------------------------------------- simulator


SIM_SLO = parse_slo("4s")
SIM_N = 300


def _sim_pool() -> list:
    from autotune.workload.sources import Request

    rng = np.random.default_rng(0)
    return [Request("x", int(p), int(o))
            for p, o in zip(rng.integers(32, 512, 400), rng.integers(16, 256, 400),
                            strict=True)]


@pytest.fixture(scope="module")
def sim_truth() -> dict:
    """The true ceiling of one simulated config, by sweeping the rate finely in
    virtual time with the same probe (same workload, seed and pass rule).

    Near the boundary pass/fail flickers over about 1% of rate (the 95% bound is one
    order statistic, so it moves in steps), so the truth is a band: ``first_fail`` is
    the lowest failing rate of the fine sweep, ``last_pass`` the highest passing one.
    """
    from autotune.backends.sim import SimBackend
    from autotune.tuning.ceiling import BackendProbe

    backend = SimBackend("1xa100-80gb", "llama-3-8b")
    probe = BackendProbe(backend, {"max_num_seqs": 32}, SIM_SLO, _sim_pool(), warmup=30)

    def verdict(rate: float) -> str:
        res = probe(rate, SIM_N)
        return verdict_of(check_limits(res.summary, SIM_SLO, 0.95), res.pruned)

    sat = probe(math.inf, SIM_N).summary.request_throughput
    coarse = [(r, verdict(r)) for r in np.arange(0.3, 2.0001, 0.03) * sat]
    first = min(r for r, v in coarse if v != "pass")
    last = max(r for r, v in coarse if v == "pass")
    step = 0.0025 * first
    fine = [(r, verdict(r)) for r in np.arange(first / 1.03, last * 1.03 + step, step)]
    sweep = sorted(coarse + fine)
    return {
        "probe": probe,
        "saturated": sat,
        "first_fail": min(r for r, v in sweep if v != "pass"),
        "last_pass": max(r for r, v in sweep if v == "pass"),
        "sweep_probes": len(sweep) + 1,
    }


# (start as a share of the true ceiling, None = the default saturation probe; budget)
@pytest.mark.parametrize(("start", "budget"), [(None, 8), (0.5, 8), (0.8, 8), (1.0, 8),
                                               (1.5, 12), (3.0, 12)])
def test_simulated_ceiling_matches_the_fine_sweep(sim_truth: dict, start: float | None,
                                                  budget: int) -> None:
    truth_lo, truth_hi = sim_truth["first_fail"], sim_truth["last_pass"]
    assert truth_hi / truth_lo - 1 < 0.02  # the flicker band is narrow
    start_rate = None if start is None else start * truth_lo
    res = find_ceiling(sim_truth["probe"], slo=SIM_SLO, start_rate=start_rate,
                       num_prompts=SIM_N, max_num_prompts=SIM_N, max_probes=budget)
    assert res.search_probes <= budget
    assert res.converged
    # Never above what the sweep saw pass; within 3% below the lowest failing rate.
    assert res.feasible_max <= truth_hi * (1 + 1e-9)
    assert res.feasible_max >= truth_lo * 0.97
    assert res.simulated and res.sentence().startswith("simulated: sustains ")
    # The 1 req/s step-down from the saturated throughput, for comparison.
    sat = res.saturated_throughput or sim_truth["saturated"]
    steps = stepdown_probe_count(sat, res.feasible_max)
    print(f"start {start}: {res.search_probes} probes (truth band {truth_lo:.2f}-"
          f"{truth_hi:.2f} req/s, found {res.feasible_max:.2f}); a 1 req/s step-down from "
          f"{sat:.2f} req/s needs {steps}; the fine sweep took {sim_truth['sweep_probes']}")
    assert steps >= 1


def test_a_replayed_start_that_fails_still_finds_a_ceiling_below_it() -> None:
    """``then_down``: the search stops a trial that fails the incumbent's rate; the
    same start replayed on its own (``ceiling --study --trial``) goes on downward."""
    truth = QueueModel().true_ceiling(400, 10.0)
    res = find_ceiling(QueueModel(), slo=SLO10, start_rate=1.5 * truth, num_prompts=400,
                       max_num_prompts=400, max_probes=12, first_must_pass=True,
                       then_down=True)
    assert not res.below_start and res.feasible and res.converged
    assert res.probes[0].phase == "incumbent" and not res.probes[0].passed
    assert truth * 0.97 <= res.feasible_max <= truth < res.infeasible_min
    stopped = find_ceiling(QueueModel(), slo=SLO10, start_rate=1.5 * truth,
                           num_prompts=400, max_num_prompts=400, first_must_pass=True)
    assert stopped.below_start and len(stopped.probes) == 1


def test_a_replayed_start_that_passes_probes_as_the_search_did() -> None:
    truth = QueueModel().true_ceiling(400, 10.0)
    kw = dict(slo=SLO10, start_rate=0.6 * truth, num_prompts=400, max_num_prompts=400,
              max_probes=12, first_must_pass=True)
    searched = find_ceiling(QueueModel(), **kw)
    replayed = find_ceiling(QueueModel(), **kw, then_down=True)
    assert ([(p.rate, p.verdict) for p in replayed.probes]
            == [(p.rate, p.verdict) for p in searched.probes])


# ----------------------------------------------------------------------------- pooled


class ExceedanceServer:
    """A config whose share of requests over 10 s at ``rate`` is ``share(rate)``
    (independent requests, growing with the rate): each test sized by time sends
    Poisson arrivals for as long as its steady-state rule needs, judged by the real
    verdict, with the evidence the search pools handed in (``prior``)."""

    def __init__(self, share: object, seed: int) -> None:
        self.share = share
        self.rng = np.random.default_rng(seed)

    def __call__(self, rate: float, n: int, *, prior: tuple = ()) -> ProbeResult:
        from autotune.tuning.verdict import SteadyState

        rule = SteadyState(min_duration_s=60.0, looks=8, prior=prior)
        span = rule.max_s(SLO10, rate)
        count = int(rate * span)
        sent = np.cumsum(self.rng.exponential(1.0 / rate, count))
        over = self.rng.random(count) < self.share(rate)  # type: ignore[operator]
        return _timed_test(sent, over, rate, rule, until=span + 10.0)


def _timed_test(sent: np.ndarray, over: np.ndarray, rate: float, rule: object,
                until: float) -> ProbeResult:
    """Requests sent at ``sent``, 12 s where ``over`` and 2 s elsewhere, judged as the
    stop rule does, at every 10 s of arrivals from 70 s to ``until``: it stops at the
    first certain verdict."""
    from autotune.tuning.verdict import judge

    recs = _records(sent, np.where(over, 12.0, 2.0))
    ev = None
    for now in np.arange(70.0, until, 10.0):
        seen = [r for r in recs if r.scheduled_s <= now]
        ev = judge([_at(r, now) for r in seen], slo=SLO10, offered_rate=rate, now=now,
                   rule=rule)  # type: ignore[arg-type]
        if ev.verdict != "inconclusive":
            break
    assert ev is not None
    judged = [r for r in recs if r.scheduled_s <= ev.at_s]
    s = summarize(judged, slo=SLO10, offered_rate=rate, source="synthetic (test)")
    return ProbeResult(s, evidence=ev, server_s=ev.at_s,
                       completion_rate=completion_rate(judged))


def _at(r: RequestRecord, now: float) -> RequestRecord:
    if r.end_s is not None and r.end_s > now:
        return RequestRecord(index=r.index, scheduled_s=r.scheduled_s,
                             dispatched_s=r.dispatched_s, sent_s=r.sent_s)
    return r


def test_pooled_ceilings_are_unsafe_at_most_five_percent_of_the_time() -> None:
    """The share over the limit creeps from 0.6% to 1.4% between 4 and 12 req/s: the
    true ceiling (1%) is 8 req/s, and every rate near it sits in the sequential test's
    indifference zone, where pooling the tests at higher rates is what lets a rate
    pass at all.  Over 40 searches the answer is never above the true ceiling more
    than the 5% allows (plus sampling error), and most searches find a ceiling."""
    def share(rate: float) -> float:
        return 0.006 + 0.001 * (rate - 4.0)

    found = unsafe = 0
    for seed in range(40):
        res = find_ceiling(ExceedanceServer(share, seed), slo=SLO10, start_rate=8.0,
                           tol=0.05, max_probes=8, min_rate=1.0)
        if res.feasible_max is not None:
            found += 1
            unsafe += res.feasible_max > 8.0
            pooled = res.feasible_probe()
            assert pooled is not None and pooled.evidence.verdict == "pass"
    assert unsafe <= 4  # 5% of 40 is 2; 4 is past the binomial's 95th percentile
    assert found >= 20


def _undecided(rate: float, n: int, k: int, dispersion: float) -> object:
    """What zone_notes reads of a test that ran to its cap undecided."""
    from types import SimpleNamespace

    lim = SimpleNamespace(label="p99:e2e", n=n, exceed=k, dispersion=dispersion)
    samples = np.linspace(1.0, 9.0, n)
    return SimpleNamespace(phase="bracket", verdict="inconclusive", rate=rate,
                           evidence=SimpleNamespace(limits=[lim]),
                           summary=SimpleNamespace(samples={"e2e": samples}))


def test_an_undecided_share_is_called_the_floor_only_between_half_and_the_allowance(
        ) -> None:
    from autotune.tuning.ceiling import zone_notes

    slo = parse_slo("p99:e2e<=10s")
    at_floor = zone_notes([_undecided(2.0, 4000, 28, 1.2)], slo)  # type: ignore[list-item]
    assert len(at_floor) == 1 and "latency floor" in at_floor[0]
    # 0.1% over the limit is far under half the allowance: the tests were too short for
    # how their latencies cluster, which says nothing about a floor.
    short = zone_notes([_undecided(2.0, 4000, 4, 6.0)], slo)  # type: ignore[list-item]
    assert len(short) == 1 and "floor" not in short[0]
    assert "cluster (x6)" in short[0] and "--max-duration" in short[0]
    assert zone_notes([_undecided(2.0, 4000, 60, 1.0)], slo) == []  # type: ignore[list-item]


def test_no_test_of_a_search_sends_another_tests_requests_again() -> None:
    """A real server with prefix caching serves a prompt it saw before from its cache:
    the saturation, light-load and bracketing tests each take fresh requests from the
    pool (the first bracketing test used to re-send the saturation test's)."""
    from autotune.backends.sim import SimBackend
    from autotune.tuning.ceiling import BackendProbe
    from autotune.tuning.verdict import SteadyState

    class Recording(SimBackend):
        def __init__(self) -> None:
            super().__init__("1xa100-80gb", "llama-3-8b")
            self.sent: list[set[int]] = []

        def load_test(self, rate, plan, on_window):  # type: ignore[no-untyped-def]
            run = super().load_test(rate, plan, on_window)
            measured = plan.measured_for(rate)
            self.sent.append({id(measured[r.index]) for r in run.records
                              if not r.warmup and r.sent_s is not None})
            return run

    backend = Recording()
    steady = SteadyState(min_duration_s=20.0, max_duration_s=30.0, min_requests=50)
    probe = BackendProbe(backend, {"max_num_seqs": 32}, SIM_SLO, _sim_pool(), warmup=30,
                         steady=steady)
    probe(math.inf, 120)
    probe(math.inf, 40, light=True)
    probe(2.0, 100)
    probe(3.0, 100)
    assert len(backend.sent) == 4 and all(backend.sent)
    for i, a in enumerate(backend.sent):
        for b in backend.sent[i + 1:]:
            assert not a & b


class ClusteredServer:
    """0.2% of requests over 10 s below ``knee`` req/s (5% at and above it), in bursts of
    ``burst`` in a row, as a server that stalls now and then: a test capped at 120 s of
    arrivals sees too few requests at a low rate to rule the bursts out, so it ends
    undecided with its share far under half the allowance."""

    def __init__(self, seed: int, *, knee: float = 40.0, burst: int = 25) -> None:
        self.rng = np.random.default_rng(seed)
        self.knee = knee
        self.burst = burst
        self.proved: list[float] = []

    def __call__(self, rate: float, n: int, *, prior: tuple = (),
                 proof: object = None) -> ProbeResult:
        from autotune.tuning.verdict import SteadyState

        cap_s = 120.0 if proof is None else float(proof.max_duration_s)  # type: ignore[attr-defined]
        rule = SteadyState(min_duration_s=60.0, max_duration_s=cap_s, looks=8, prior=prior,
                           safe_share=0.5 if proof is None else proof.safe_share)  # type: ignore[attr-defined]
        if proof is not None:
            self.proved.append(rate)
        count = int(rate * rule.max_s(SLO10, rate))
        sent = np.cumsum(self.rng.exponential(1.0 / rate, count))
        share = 0.002 if rate < self.knee else 0.05
        over = np.zeros(count, dtype=bool)
        for i in np.flatnonzero(self.rng.random(count) < share / self.burst):
            over[i:i + self.burst] = True
        return _timed_test(sent, over, rate, rule, until=sent[-1] + 20.0)


def test_a_first_test_undecided_far_under_half_the_allowance_climbs_instead_of_proving(
        ) -> None:
    """The first test ran to its cap undecided with none of its requests over the limit
    (its latencies cluster, so a pass needs more than 120 s of them): that says the cap
    was short, not that the ceiling is near.  The search goes up while tests pass or
    lean that way, and finds the ceiling far above the start (it used to prove the start
    level at once and stop there)."""
    server = ClusteredServer(0)
    res = find_ceiling(server, slo=SLO10, start_rate=4.0, tol=0.1, max_probes=8,
                       min_rate=1.0, proof_cap_s=3600.0)
    first = res.probes[0]
    assert first.verdict == "inconclusive" and first.evidence.limits[0].exceed == 0
    assert res.probes[1].rate == 8.0
    assert res.feasible_max is not None and 16.0 <= res.feasible_max < server.knee
    assert 4.0 not in server.proved


def test_a_climb_that_meets_a_fail_proves_the_highest_level_that_leaned() -> None:
    """Undecided but leaning at the start, and 5% over the limit one step up: the proof goes
    to the level that leaned, and its note says why its test was undecided (clustering,
    not the floor)."""
    server = ClusteredServer(0, knee=6.0)
    res = find_ceiling(server, slo=SLO10, start_rate=4.0, tol=0.1, max_probes=8,
                       min_rate=1.0, proof_cap_s=3600.0)
    assert [p.phase for p in res.probes][:3] == ["bracket", "bracket", "proof"]
    assert res.probes[1].verdict != "pass" and server.proved == [4.0]
    assert res.feasible_max == 4.0 and res.infeasible_min == 8.0
    assert any("cluster" in n and "under half its allowance" in n for n in res.notes)


class FourSlots(QueueModel):
    """A server with 4 slots: 4 requests in flight fill its batch and each takes 12 s,
    one at a time takes 0.8 s; open-loop rates behave as QueueModel."""

    def __init__(self) -> None:
        super().__init__(capacity=2.0, base=0.4)
        self.light: list[int] = []

    def __call__(self, rate: float, n: int, *, light: int = 0) -> ProbeResult:  # type: ignore[override]
        if not light:
            return super().__call__(rate, n)
        self.light.append(light)
        lat = np.full(n, 12.0 if light > 1 else 0.8)
        sent = np.arange(n) * lat[0] / light
        recs = _records(sent, lat)
        s = summarize(recs, slo=SLO10, offered_rate=math.inf, source="synthetic (test)")
        return ProbeResult(s, server_s=float(sent[-1] + lat[-1]),
                           completion_rate=completion_rate(recs))


def test_a_floor_test_that_fills_a_small_batch_is_confirmed_one_request_at_a_time() -> None:
    """4 in flight are a full batch on a 4-slot server, not light load: their fail
    leads to a test one request at a time, which passes, so the search goes on down and
    finds the rate that holds instead of saying no load can."""
    server = FourSlots()
    res = find_ceiling(server, slo=SLO10, start_rate=4.0, tol=0.1, max_probes=8,
                       min_rate=0.05)
    assert server.light == [4, 1]
    floors = [p for p in res.probes if p.phase == "floor"]
    assert [p.verdict for p in floors] == ["fail", "pass"]
    assert "one request at a time" in (floors[1].note or "")
    assert not res.below_floor and res.feasible_max is not None
    assert res.feasible_max <= server.true_ceiling(res.probes[-1].num_prompts, 10.0) * 1.2


def test_a_fail_at_the_lowest_rate_a_time_cap_allows_does_not_say_the_config_cannot() -> None:
    """No test under 8 req/s could gather the requests a pass needs in its time cap: a
    fail at 8 says nothing of 4, where this server holds, so the answer says what
    stopped the search instead of "the config cannot meet it"."""
    server = QueueModel(capacity=6.0)
    res = find_ceiling(server, slo=SLO10, start_rate=8.0, lowest_rate=8.0, min_rate=1.0)
    assert [r for r, _ in server.calls] == [8.0] and not res.feasible
    assert res.time_floor == 8.0 and res.to_dict()["time_floor"] == 8.0
    sentence = res.sentence()
    assert "cannot meet it" not in sentence and "--max-duration" in sentence
    # Where lower rates were open to it, the search went on down and found one.
    free = find_ceiling(QueueModel(capacity=6.0), slo=SLO10, start_rate=8.0, min_rate=1.0)
    assert free.feasible and free.time_floor is None
