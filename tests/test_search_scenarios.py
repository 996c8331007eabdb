"""benchmarks/search_scenarios.py: its pure parts, the truth rule, and a smoke run.

The smoke run checks structure and invariants, never figures or timings.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import search_scenarios as ss


def test_time_to_within_and_value_at_budget() -> None:
    events = [(100.0, 0.0), (250.0, 900.0), (400.0, 975.0), (600.0, 1000.0)]
    assert ss.time_to_within(events, 1000.0, 0.03) == 400.0
    assert ss.time_to_within(events, 1000.0, 0.0) == 600.0
    assert ss.time_to_within(events, 2000.0, 0.03) is None
    assert ss.time_to_within(events, 0.0, 0.03) is None  # no feasible config: never
    assert ss.value_at(events, 50.0) == 0.0
    assert ss.value_at(events, 399.0) == 900.0
    assert ss.value_at(events, 1e9) == 1000.0


def test_censored_median_and_ratio_bounds() -> None:
    exact = ss.censored_median([100.0, None, 300.0], [500.0, 400.0, 600.0])
    assert exact == {"low": 300.0, "high": 300.0}
    lower = ss.censored_median([None, None, 100.0], [200.0, 300.0, 500.0])
    assert lower == {"low": 200.0, "high": math.inf}
    assert ss.fmt_bound(lower) == ">200"
    r = ss.bounded_ratio({"low": 50.0, "high": 50.0}, {"low": 200.0, "high": math.inf})
    assert r == {"low": 0.0, "high": 0.25}
    assert ss.fmt_bound(ss.bounded_ratio(exact, exact), ".2f") == "1.00"


def test_config_keys_round_trip() -> None:
    space = ss.SMOKE_SCENARIO.space()
    key = ss.ckey({"max_num_seqs": 8, "max_num_batched_tokens": 2048, "request_rate": 3.0},
                  space)
    assert dict(ss._parse_key(ss.key_str(key))) == {"max_num_seqs": 8,
                                                    "max_num_batched_tokens": 2048}
    assert dict(ss._parse_key("enable_chunked_prefill=False,max_num_seqs=4")) == {
        "enable_chunked_prefill": False, "max_num_seqs": 4}


def test_every_scenario_space_loads_and_has_launchable_configs() -> None:
    for sc in ss.SCENARIOS:
        configs, broken = ss.configs_of(sc, sc.space())
        assert 16 <= len(configs) + broken <= 48, sc.name
        assert configs, sc.name
    long_prompts = next(s for s in ss.SCENARIOS if s.workload == "long")
    # Without chunked prefill a token budget under max_model_len breaks a rule.
    assert ss.configs_of(long_prompts, long_prompts.space())[1] > 0


def test_truth_rule_is_monotone_in_rate_on_the_trivial_scenario() -> None:
    sizes = ss.SMOKE
    sc = ss.SMOKE_SCENARIO
    ss._W = ss.make_world(sizes, [sc])
    try:
        params = {"max_num_seqs": 8, "max_num_batched_tokens": 2048}
        row = ss.truth_config((sc.name, params))
        ceiling, first_fail = row["ceiling"], row["first_fail"]
        assert 0 < ceiling < first_fail <= ceiling * (1 + sizes.truth_tol) * 1.0001
        rates = [0.25 * ceiling, 0.6 * ceiling, ceiling, 1.5 * first_fail, 3 * first_fail]
        verdicts = [ss.truth_test(sc, params, r)[0] for r in rates]
        assert verdicts == [True, True, True, False, False]
        # Goodput at the ceiling is the rate x good output tokens per request.
        assert 0 < row["goodput_tokens"] <= ceiling * max(
            r.output_tokens for r in ss._W.pools[sc.name])
    finally:
        ss._W = None


def test_smoke_run_has_every_method_and_finite_figures(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    assert ss.main(["--smoke", "--jobs", "1", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["methods"]) == set(ss.METHODS)
    names = {s["name"] for s in data["scenarios"]}
    assert names == {ss.SMOKE_SCENARIO.name}
    runs = {(r["method"], r["scenario"]) for r in data["per_run"]}
    assert runs == {(m, n) for m in ss.METHODS for n in names}
    assert len(data["per_run"]) == len(ss.METHODS) * len(ss.SMOKE.seeds)
    for m, v in data["methods"].items():
        assert 0 <= v["reached"] <= v["runs"], m
        assert v["server_s_to_within_median"]["low"] is not None, m
        assert math.isfinite(v["total_server_s_median"]) and v["total_server_s_median"] > 0
        for b in ("1h", "3h"):
            assert 0.0 <= v[f"share_at_{b}_median"] <= 1.0 + 1e-9, (m, b)
    for r in data["per_run"]:
        # A run reaches within its own server time; shares are of the truth's best.
        assert math.isfinite(r["total_server_s"]) and r["total_server_s"] > 0
        if r["reached"]:
            assert 0 < r["server_s_to_within"] <= r["total_server_s"] + 1e-6
        assert all(0 <= r[k] <= 1 + 1e-9 for k in ("share_at_1h", "share_at_3h", "final_share"))
    truth = data["truth"][ss.SMOKE_SCENARIO.name]
    assert truth["best_goodput_tokens"] == max(c["goodput_tokens"] for c in truth["configs"])
    assert all(c["ceiling"] <= c["first_fail"] for c in truth["configs"] if c["ceiling"])
    # Every autotune answer was run for the safety check.
    assert data["methods"]["autotune"]["safety"]["unchecked"] == 0
    assert set(data["targets"]) >= {"autotune/autotune_sh", "autotune/grid_ceiling",
                                    "within_3pct_share", "unsafe_answers", "cap_share"}
    # autotune answers once, with the proof's config and cap: screening caps never count.
    auto = next(r for r in data["per_run"] if r["method"] == "autotune")
    assert auto["proof"]["proven"] and auto["final_config"] == auto["proof"]["config"]
    assert auto["final_cap"] == auto["proof"]["cap"]
    # Every method's answer got the same long safety run, auto_tune.sh's included.
    assert all(r.get("safe") is not None for r in data["per_run"] if r["final_cap"])
    lines = ss.markdown(data)
    assert any(line.startswith("**Headline (same run): autotune/autotune_sh") for line in lines)
    assert any(line.startswith("**Headline (same run): autotune/grid_ceiling") for line in lines)
    # The page says when each method answers, and autotune's whole run beside the grid's.
    assert any(line.startswith("autotune answers once, when its proof ends") and
               "Whole runs: autotune" in line for line in lines)
    assert any(line.startswith("**Headline (same run): twin/grid_ceiling") for line in lines)
    # The twin stops at its own trial count and reports its CPU beside its server time.
    twin = next(r for r in data["per_run"] if r["method"] == "twin")
    assert 1 <= twin["trials"] <= ss.SMOKE.twin_trials
    assert twin["twin"]["cpu_s"] > 0 and twin["twin"]["refits"] >= 1
    assert twin.get("safe") is not None
    assert data["rows_from"] == {m: f"this run ({data['written']})" for m in ss.METHODS}


@pytest.mark.parametrize("name", [s.name for s in ss.SCENARIOS])
def test_truth_fingerprint_changes_with_the_scenario(name: str) -> None:
    sc = next(s for s in ss.SCENARIOS if s.name == name)
    other = ss.dataclasses.replace(sc, slo="1s")
    assert ss.fingerprint(sc, ss.Sizes()) != ss.fingerprint(other, ss.Sizes())
    assert ss.fingerprint(sc, ss.Sizes()) == ss.fingerprint(sc, ss.Sizes())


def _row(method: str, scenario: str, seed: int, hit: float | None, total: float
         ) -> dict[str, object]:
    return {"method": method, "scenario": scenario, "seed": seed, "reached": hit is not None,
            "server_s_to_within": hit, "total_server_s": total, "share_at_1h": 0.5,
            "share_at_3h": 1.0, "safe": True}


def test_summarise_reads_rows_alone_and_ratios_twin_against_the_grid() -> None:
    rows = [_row("grid_ceiling", "a", 0, 1000.0, 5000.0), _row("grid_ceiling", "b", 0, 3000.0,
                                                               5000.0),
            _row("twin", "a", 0, 100.0, 900.0), _row("twin", "b", 0, None, 800.0),
            _row("autotune", "a", 0, 400.0, 900.0), _row("autotune", "b", 0, 600.0, 900.0)]
    got = ss.summarise(["a", "b"], rows)
    assert list(got["methods"]) == ["autotune", "grid_ceiling", "twin"]
    # The twin's median is censored: (100 + 800) / 2 at least, (100 + inf) / 2 at most.
    assert got["methods"]["twin"]["server_s_to_within_median"] == {"low": 450.0,
                                                                  "high": math.inf}
    assert got["ratios"]["twin/grid_ceiling"] == {"low": 450.0 / 2000.0, "high": math.inf}
    assert got["targets"]["twin/grid_ceiling"]["met"] is False
    assert "autotune/autotune_sh" not in got["ratios"]  # a method without rows: no ratio
    assert got["methods"]["twin"]["safety"] == {"checked": 2, "unsafe": 0, "unchecked": 0}


def test_an_answer_that_fails_the_long_run_never_reaches_but_auto_tune_sh_is_unchecked(
) -> None:
    sc = ss.SMOKE_SCENARIO
    w = _world()
    w.truth[sc.name]["configs"] = [{"key": "a", "goodput_tokens": 1000.0, "ceiling": 10.0}]
    runs = [{"scenario": sc.name, "method": m, "seed": 0, "events": [[50.0, "a", 9.0]],
             "total_server_s": 60.0} for m in ("autotune", "autotune_sh", "grid_ceiling")]
    safety = {(sc.name, "a", 9.0): {"passed": False}}
    rows = {r["method"]: r for r in ss.judge(w, runs, safety)}
    assert rows["autotune"]["reached"] is False and rows["autotune"]["reached_unsafe"]
    assert rows["grid_ceiling"]["server_s_to_within"] is None
    assert rows["autotune_sh"]["server_s_to_within"] == 50.0  # its pick, as issue 32 asks
    assert rows["autotune_sh"]["safe"] is False  # and its cap is still checked
    assert rows["autotune"]["cap_share"] == pytest.approx(0.9)
    safe = ss.judge(w, runs, {(sc.name, "a", 9.0): {"passed": True}})
    assert all(r["server_s_to_within"] == 50.0 for r in safe)


def _world(seeds: tuple[int, ...] = (0,)) -> ss.World:
    sc = ss.SMOKE_SCENARIO
    w = ss.World(ss.dataclasses.replace(ss.SMOKE, seeds=seeds), [sc], {}, {}, {})
    w.truth[sc.name] = {"fingerprint": ss.fingerprint(sc, w.sizes),
                        "best_goodput_tokens": 1000.0}
    return w


def _earlier(w: ss.World) -> dict[str, object]:
    name = ss.SMOKE_SCENARIO.name
    sizes = {k: v for k, v in ss.dataclasses.asdict(w.sizes).items()
             if k not in ("twin_trials", "twin_candidates")}  # an older run lacks them
    return {"sizes": {**sizes, "seeds": [0, 1], "jobs": 2}, "truth": dict(w.truth),
            "written": "2026-12-03 15:51 UTC", "total_wall_s": 60.0,
            "per_run": [_row(m, name, s, 10.0, 20.0) for m in ("autotune", "grid_ceiling",
                                                               "twin") for s in (0, 1)],
            "walks": [{"scenario": name}], "grid_ceiling_per_config": {name: {}},
            "safety": [{"scenario": name, "config": "c", "cap": 1.0, "passed": True}]}


def test_merge_takes_the_methods_not_run_from_an_earlier_run() -> None:
    w = _world()
    name = ss.SMOKE_SCENARIO.name
    out: dict[str, object] = {"per_run": [_row("twin", name, 0, 5.0, 9.0)], "walks": [],
                              "grid_ceiling_per_config": {}, "safety": [],
                              "rows_from": {"twin": "this run (now)"}}
    ss.merge_earlier(out, _earlier(w), w)
    # The earlier twin row is dropped (this run's replaces it), and so is seed 1.
    assert sorted((r["method"], r["seed"]) for r in out["per_run"]) == [
        ("autotune", 0), ("grid_ceiling", 0), ("twin", 0)]
    assert out["rows_from"]["autotune"] == "an earlier run (2026-12-03 15:51 UTC)"
    assert out["merged"]["methods"] == ["autotune", "grid_ceiling"]
    assert out["walks"] and out["safety"]
    lines = ss.headlines({**out, **ss.summarise([name], out["per_run"]),
                          "sizes": ss.dataclasses.asdict(w.sizes),
                          "scenarios": [{"name": name}]})
    twin_line = next(x for x in lines if "twin/grid_ceiling" in x)
    assert twin_line.startswith(
        "**Headline (twin: this run (now); grid_ceiling: an earlier run (2026-12-03")
    # One earlier run's figures stay a same-run headline (the README quotes those), named.
    own = next(x for x in lines if "autotune came within 3%" in x)
    assert own.startswith("**Headline (same run): ")
    assert own.endswith("; rows of an earlier run (2026-12-03 15:51 UTC))**")


@pytest.mark.parametrize("spoil", ["sizes", "seeds", "truth"])
def test_merge_refuses_an_earlier_run_on_another_footing(spoil: str) -> None:
    w = _world(seeds=(0,) if spoil != "seeds" else (0, 2))
    earlier = _earlier(w)
    if spoil == "sizes":
        earlier["sizes"]["n_trials"] = 99  # type: ignore[index]
    if spoil == "truth":
        earlier["truth"] = {ss.SMOKE_SCENARIO.name: {"fingerprint": "x",
                                                     "best_goodput_tokens": 1000.0}}
    out = {"per_run": [], "walks": [], "grid_ceiling_per_config": {}, "safety": [],
           "rows_from": {"twin": "this run"}}
    with pytest.raises(ss.MergeError):
        ss.merge_earlier(out, earlier, w)


def test_cpu_clock_counts_only_the_wrapped_calls() -> None:
    clock = ss.CpuClock()
    spin = clock.timed(lambda n: sum(i * i for i in range(n)))
    assert spin(200_000) > 0
    assert clock.seconds > 0
    before = clock.seconds
    sum(i * i for i in range(200_000))  # not wrapped: not counted
    assert clock.seconds == before


def test_grid_runs_without_the_walks_give_grid_ceiling_alone() -> None:
    w = _world(seeds=(0, 1))
    name = ss.SMOKE_SCENARIO.name
    per_config = {"a": {"server_s": 100.0, "feasible": True, "value": 5.0, "rate_cap": 2.0},
                  "b": {"server_s": 50.0, "feasible": True, "value": 9.0, "rate_cap": 3.0}}
    runs = ss.grid_runs(w, [], {name: {"per_config": per_config}})
    assert [(r["method"], r["seed"]) for r in runs] == [("grid_ceiling", 0), ("grid_ceiling", 1)]
    for r in runs:
        assert r["total_server_s"] == 150.0 and r["events"][-1][1:] == ["b", 3.0]


def test_grid_floor_is_the_cheapest_search_of_a_config_within_3_percent_by_the_truth() -> None:
    """The twin/grid miss is set beside what measuring a best config first would cost:
    'best' by the truth's goodput, the cost the grid's own search of that config."""
    def truth(goodputs: dict[str, float]) -> dict[str, Any]:
        return {"best_goodput_tokens": max(goodputs.values()),
                "configs": [{"key": k, "goodput_tokens": g} for k, g in goodputs.items()]}

    d = {"scenarios": [{"name": "a"}, {"name": "b"}], "sizes": {"seeds": [0, 1]},
         "truth": {"a": truth({"x": 100.0, "y": 98.0, "z": 50.0}),
                   "b": truth({"x": 100.0, "y": 90.0})},
         "grid_ceiling_per_config": {
             "a": {"x": {"server_s": 900.0}, "y": {"server_s": 300.0},
                   "z": {"server_s": 100.0}},  # z is cheapest but far from the best
             "b": {"x": {"server_s": 2000.0}, "y": {"server_s": 200.0}}},
         "methods": {"grid_ceiling": {"server_s_to_within_median": {"low": 4000.0,
                                                                    "high": 4000.0}}}}
    assert ss.grid_floor(d) == {"a": 300.0, "b": 2000.0}
    (line, _) = ss.grid_floor_lines(d)
    assert "0.15 x the grid's median 4,000 s = 600 s" in line
    assert "median 1,150 s, 0.29 of the grid" in line
