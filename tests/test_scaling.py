"""Scaling analysis: the seed's 3.2x rule, TP=2 slower than TP=1, goodput per GPU."""

from __future__ import annotations

import pytest

from autotune.analysis.scaling import ScalePoint, ScalingError, analyze_scaling


def test_tp4_under_3_2x_is_flagged_with_the_seed_advice() -> None:
    s = analyze_scaling([ScalePoint("TP=1", 1, 1000.0), ScalePoint("TP=4", 4, 3000.0)])
    tp4 = s.rows[1]
    assert tp4.speedup == pytest.approx(3.0) and tp4.efficiency == pytest.approx(0.75)
    (flag,) = s.flags
    assert flag.code == "poor_scaling" and flag.label == "TP=4"
    assert "3.00x" in flag.evidence and "3.2x" in flag.evidence
    for words in ("topology", "--enforce-eager", "NCCL"):
        assert words in flag.next_step


def test_good_scaling_is_silent() -> None:
    s = analyze_scaling([ScalePoint("TP=1", 1, 1000.0), ScalePoint("TP=2", 2, 1900.0),
                         ScalePoint("TP=4", 4, 3500.0)])
    assert s.flags == [] and s.base == "TP=1"
    assert [r.efficiency for r in s.rows] == pytest.approx([1.0, 0.95, 0.875])


def test_tp2_slower_than_tp1_is_flagged() -> None:
    s = analyze_scaling([ScalePoint("TP=2", 2, 900.0), ScalePoint("TP=1", 1, 1000.0)])
    codes = {f.code for f in s.flags}
    assert codes == {"poor_scaling", "slower_with_more_gpus"}
    slower = next(f for f in s.flags if f.code == "slower_with_more_gpus")
    assert "900 vs 1,000" in slower.evidence


def test_base_is_the_smallest_layout() -> None:
    s = analyze_scaling([ScalePoint("TP=8", 8, 7000.0), ScalePoint("TP=2", 2, 2000.0)])
    assert s.base == "TP=2" and s.rows[1].ideal == 4 and s.rows[1].speedup == 3.5
    assert s.flags == []


def test_goodput_per_gpu_picks_dp_replicas_over_one_big_tp() -> None:
    s = analyze_scaling([ScalePoint("TP=1", 1, 1000.0, goodput_tokens=900.0),
                         ScalePoint("TP=4", 4, 3300.0, goodput_tokens=3000.0)])
    tp1, tp4 = s.rows
    assert tp1.goodput_per_gpu == 900 and tp4.goodput_per_gpu == 750
    assert tp1.replicas == 4 and tp1.replicas_goodput == 3600
    assert s.best_layout is not None and s.best_layout.startswith("4 x TP=1")
    assert any("best use of 4 GPUs" in line for line in s.lines())


def test_unsaturated_layout_is_a_lower_bound_not_a_flag() -> None:
    s = analyze_scaling([ScalePoint("TP=1", 1, 1000.0),
                         ScalePoint("TP=4", 4, 1500.0, saturated=False)])
    assert s.flags == []
    assert "lower bound" in s.note and "TP=4" in s.note


def test_bad_points_raise() -> None:
    with pytest.raises(ScalingError):
        analyze_scaling([])
    with pytest.raises(ScalingError, match="at least 1"):
        analyze_scaling([ScalePoint("x", 0, 1.0)])
