"""benchmarks/search_efficiency.py: its pure parts, and a smoke run end to end.

The smoke run checks structure and invariants, never figures or timings.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import search_efficiency as se

ROOT = Path(__file__).resolve().parent.parent

FLAGS_A = {"tensor_parallel_size": 4, "max_num_seqs": 64}
FLAGS_B = {"tensor_parallel_size": 2, "max_num_seqs": 64}


# ----------------------------------------------------------------------------- pure parts


def test_time_to_within_takes_the_first_event_in_tolerance() -> None:
    trace = [(100.0, 0.0), (250.0, 900.0), (400.0, 970.0), (600.0, 1000.0)]
    assert se.first_within(trace, 1000.0, 0.03) == 2
    assert se.time_to_within(trace, 1000.0, 0.03) == 400.0
    assert se.time_to_within(trace, 1000.0, 0.0) == 600.0
    assert se.time_to_within(trace, 2000.0, 0.03) is None
    assert se.time_to_within([], 1000.0, 0.03) is None


def test_a_held_value_above_the_best_counts_as_reached() -> None:
    assert se.time_to_within([(10.0, 0.0), (20.0, 1200.0)], 1000.0, 0.03) == 20.0


def test_quantile_is_numpy_linear_and_handles_inf() -> None:
    assert se.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert se.quantile([1.0, 2.0, 3.0, 4.0], 0.25) == 1.75
    assert se.quantile([1.0, math.inf], 0.0) == 1.0
    assert se.quantile([1.0, math.inf], 0.5) == math.inf
    assert se.quantile([math.inf, math.inf], 1.0) == math.inf


def test_censored_median_is_exact_when_the_censored_runs_cannot_move_it() -> None:
    q = se.censored_quantiles([100.0, None, 300.0], [500.0, 400.0, 600.0])
    assert q["median"] == {"low": 300.0, "high": 300.0}
    assert q["max"] == {"low": 400.0, "high": math.inf}
    assert se.fmt_bound(q["median"]) == "300"
    assert se.fmt_bound(q["max"]) == ">400"


def test_censored_median_is_a_lower_bound_when_most_never_reached() -> None:
    q = se.censored_quantiles([None, None, 100.0], [200.0, 300.0, 500.0])
    assert q["median"] == {"low": 200.0, "high": math.inf}
    assert q["min"] == {"low": 100.0, "high": 100.0}
    assert se.fmt_bound(q["median"]) == ">200"


def test_bounded_ratio_and_its_text() -> None:
    exact = se.bounded_ratio({"low": 50.0, "high": 50.0}, {"low": 200.0, "high": 200.0})
    assert exact == {"low": 0.25, "high": 0.25}
    assert se.fmt_bound(exact, ".2f") == "0.25"
    upper = se.bounded_ratio({"low": 50.0, "high": 50.0}, {"low": 200.0, "high": math.inf})
    assert upper == {"low": 0.0, "high": 0.25}
    assert se.fmt_bound(upper, ".2f") == "<=0.25"
    both = se.bounded_ratio({"low": 50.0, "high": math.inf}, {"low": 200.0, "high": math.inf})
    assert se.fmt_bound(both, ".2f") == "unknown (neither reached)"
    assert se.fmt_bound({"low": None, "high": None}) == "n/a"


@pytest.mark.parametrize("guess", [0, 7, 13, 40, 49])
def test_find_boundary_on_a_monotone_verdict_from_any_guess(guess: int) -> None:
    calls: list[int] = []

    def passes(i: int) -> bool:
        calls.append(i)
        return i <= 13

    top, seen = se.find_boundary(passes, 50, guess, scan=3)
    assert top == 13
    assert len(calls) == len(set(calls)) == len(seen)  # nothing tested twice
    assert seen[13] and not seen[14]
    assert {15, 16, 17} <= set(seen)  # the scan above the boundary
    assert len(calls) <= 16


def test_find_boundary_scan_catches_a_pass_above_the_first_fail() -> None:
    verdict = {i: i <= 10 or i == 12 for i in range(30)}
    top, seen = se.find_boundary(verdict.__getitem__, 30, 10, scan=2)
    assert top == 12
    assert seen[11] is False


def test_find_boundary_when_nothing_or_everything_passes() -> None:
    assert se.find_boundary(lambda i: False, 20, 10, scan=3)[0] is None
    top, seen = se.find_boundary(lambda i: True, 20, 19, scan=3)
    assert top == 19 and len(seen) == 1
    assert se.find_boundary(lambda i: True, 20, 0, scan=3)[0] == 19


def _row(n: int, server_s: float, feasible: bool, value: float, flags: dict[str, Any],
         rate: float) -> dict[str, Any]:
    return {"number": n, "server_s": server_s, "feasible": feasible, "value": value,
            "flags": flags, "rate": rate}


def test_held_events_keep_the_best_feasible_by_measured_value() -> None:
    rows = [_row(0, 100.0, False, 0.0, FLAGS_B, 10.0),
            _row(1, 200.0, True, 500.0, FLAGS_A, 20.0),
            _row(2, 300.0, True, 500.0, FLAGS_B, 20.0),  # a tie keeps the earlier trial
            _row(3, 300.0, True, 400.0, FLAGS_B, 15.0),
            _row(4, 450.0, True, 900.0, FLAGS_B, 40.0)]
    events = se.held_events(rows)
    assert [t for t, _ in events] == [100.0, 200.0, 300.0, 300.0, 450.0]
    assert [p for _, p in events] == [None, (FLAGS_A, 20.0), (FLAGS_A, 20.0), (FLAGS_A, 20.0),
                                      (FLAGS_B, 40.0)]


def _walk(flags: dict[str, Any], durations: list[float], rate: float | None,
          own: float) -> dict[str, Any]:
    return {"flags": flags, "chosen_rate": rate, "own_throughput": own,
            "probes": [{"duration_s": d} for d in durations]}


def test_grid_events_charge_restarts_probes_and_sleeps() -> None:
    walks = [_walk(FLAGS_B, [20.0, 5.0, 6.0], 30.0, 12.0),
             _walk(FLAGS_A, [10.0], None, 0.0),
             _walk(FLAGS_A, [10.0, 4.0], 50.0, 11.0)]  # lower own throughput: not held
    events, total = se.grid_events(walks, 85.0)  # a start is polled up to 90 s
    first = 90 + 90 + 31 + 2 * se.STEP_SLEEP_S
    assert events[0] == (first, (FLAGS_B, 30.0), 1)
    second = first + se.CONFIG_SLEEP_S + 90 + 10
    assert events[1] == (second, (FLAGS_B, 30.0), 2)
    third = second + se.CONFIG_SLEEP_S + 90 + 14 + se.STEP_SLEEP_S
    assert events[2] == (third, (FLAGS_B, 30.0), 3)
    assert total == third + se.CONFIG_SLEEP_S


def test_memo_key_ignores_flag_order_and_float_noise() -> None:
    a = se.memo_key({"b": 1, "a": 2}, 48.5)
    assert a == se.memo_key({"a": 2, "b": 1}, 48.50000000001)
    assert a != se.memo_key({"a": 2, "b": 1}, 48.5, "grid")
    # Optuna's trial.params keep stepped floats unrounded; the study's flags are rounded.
    assert se.memo_key({"gpu_memory_utilization": 0.8500000000000001}, 50.0) == se.memo_key(
        {"gpu_memory_utilization": 0.85}, 50.0)


def test_the_misspecified_profile_says_so_and_applies_the_factors() -> None:
    from autotune.sim.profiles import load_hardware

    true, wrong = load_hardware(se.HARDWARE), se.misspecified_profile()
    assert wrong.label.endswith("-misspecified")
    for name, factor in se.MISSPEC.items():
        assert getattr(wrong, name) == pytest.approx(getattr(true, name) * factor)


# ----------------------------------------------------------------------------- smoke run


@pytest.fixture(scope="module")
def smoke_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("se")
    out, raw = folder / "search_efficiency.json", folder / "raw.pickle"
    assert se.main(["--smoke", "--output", str(out), "--save-raw", str(raw)]) == 0
    return out, raw


@pytest.fixture(scope="module")
def smoke(smoke_files: tuple[Path, Path]) -> dict[str, Any]:
    return json.loads(smoke_files[0].read_text())


def test_smoke_figures_come_back_from_the_raw_run(smoke_files: tuple[Path, Path],
                                                  smoke: dict[str, Any]) -> None:
    again = smoke_files[0].with_name("again.json")
    assert se.main(["--from-raw", str(smoke_files[1]), "--output", str(again)]) == 0
    data = json.loads(again.read_text())
    assert data.pop("from_raw") == str(smoke_files[1])
    assert data.pop("total_wall_s") <= smoke["total_wall_s"]
    assert data == {k: v for k, v in smoke.items() if k != "total_wall_s"}


def test_smoke_every_method_ran_on_every_seed(smoke: dict[str, Any]) -> None:
    seeds = smoke["settings"]["sizes"]["seeds"]
    assert set(smoke["methods"]) == {"autotune", "prescreen", "random", "grid", "grid_best_tp"}
    for name, m in smoke["methods"].items():
        assert [r["seed"] for r in m["per_seed"]] == seeds, name
        for r in m["per_seed"]:
            assert r["total_server_s"] > 0, name
            if r["reached"]:
                assert 0 < r["server_s_to_within"] <= r["total_server_s"], name
            else:
                assert r["server_s_to_within"] is None
        assert m["summary"]["reached"] == sum(r["reached"] for r in m["per_seed"])


def test_smoke_truth_bounds_every_in_space_method(smoke: dict[str, Any]) -> None:
    best = smoke["truth"]["best_goodput_tokens"]
    assert best > 0 and smoke["truth"]["load_tests"] >= smoke["truth"]["configs"]
    for name in ("autotune", "prescreen", "random"):
        for r in smoke["methods"][name]["per_seed"]:
            final = r["final"]
            assert final is None or final["true_goodput_tokens"] <= best * (1 + 1e-12), name
    high = smoke["grid_findings"]["space_rate_high"]
    for r in smoke["methods"]["grid"]["per_seed"]:
        final = r["final"]
        if final is not None and final["true_goodput_tokens"] > best:
            assert final["rate"] == "inf" or final["rate"] > high  # only beyond the space


def test_smoke_headline_ratios_come_from_the_medians(smoke: dict[str, Any]) -> None:
    methods = smoke["methods"]
    for key, ratio in smoke["headline"].items():
        a, b = key.split("/")
        ma = methods[a]["summary"]["server_s_to_within"]["median"]
        mb = methods[b]["summary"]["server_s_to_within"]["median"]
        if ma["high"] is not None and mb["low"]:
            assert ratio["high"] == pytest.approx(ma["high"] / mb["low"])
        if ma["low"] is not None and mb["high"] is not None and mb["high"] > 0:
            assert ratio["low"] == pytest.approx(ma["low"] / mb["high"])


def test_smoke_pruning_proof_and_consistency(smoke: dict[str, Any]) -> None:
    p = smoke["pruning"]
    assert len(p["per_seed"]) == len(smoke["settings"]["sizes"]["seeds"])
    for r in p["per_seed"]:
        assert 0 <= r["load_test_s_pruning_on"] <= r["load_test_s_all_full"]
        assert r["saved_share"] == pytest.approx(
            1 - r["load_test_s_pruning_on"] / r["load_test_s_all_full"])
        assert r["best_unchanged"] == (r["best_on"] == r["best_off_from_memo"])
    reruns = [r["rerun"] for r in p["per_seed"] if "rerun" in r]
    assert reruns and all(r["same_trial_sequence"] for r in reruns)
    assert p["summary"]["reruns"] == len(reruns)
    assert smoke["consistency"]["mismatched"] == 0


def test_smoke_prescreen_cost_is_cpu_time_and_picks_are_judged(smoke: dict[str, Any]) -> None:
    for r in smoke["methods"]["prescreen"]["per_seed"]:
        pre = r["prescreen"]
        assert pre["cpu_s"] > 0 and pre["virtual_s_not_charged"] > 0
        assert pre["picks"] and all("share_of_best" in p for p in pre["picks"])
    assert smoke["settings"]["prescreen_misspecification"]["multipliers"] == se.MISSPEC


def test_smoke_markdown_renders_headlines_and_tables(smoke: dict[str, Any]) -> None:
    text = "\n".join(se.markdown(smoke))
    assert "**Headline (same run): autotune / grid = " in text
    assert "| autotune |" in text and "| grid |" in text
    assert "| seed | trials | pruned |" in text
    assert "virtual seconds" in text and "per (re)start" in text


def test_the_module_imports_without_running_or_printing() -> None:
    code = "import benchmarks.search_efficiency as m; assert m._STATE is None"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    assert se._STATE is None  # a finished run leaves nothing behind either
