"""The Pareto front of goodput per GPU against tokens per user, and its table in the
recommendation."""

from __future__ import annotations

import pytest

from autotune.analysis.pareto import front, pareto_points
from autotune.analysis.recommend import TrialView, flags_line, recommend, to_markdown


def _view(number: int, seqs: int, *, goodput: float, gpus: int = 1, tpot: float | None,
          rate: float = 10.0, p99: float = 5.0, feasible: bool = True) -> TrialView:
    return TrialView(number=number, flags={"max_num_seqs": seqs}, rate=rate,
                     status="complete", feasible=feasible, value=goodput / gpus,
                     goodput_tokens=goodput, goodput_requests=None, output_throughput=None,
                     p99_e2e_s=p99, attainment=None, gpu_util_pct=None, gpus=gpus,
                     tpot_p50_s=tpot)


def test_the_front_keeps_the_configs_no_other_beats_on_both() -> None:
    views = [
        _view(0, 8, goodput=1000, tpot=0.010),   # fast per user, little per GPU: front
        _view(1, 64, goodput=3000, tpot=0.040),  # the most per GPU: front
        _view(2, 32, goodput=2000, tpot=0.050),  # beaten by #1 on both
        _view(3, 16, goodput=1500, tpot=0.020),  # in between: front
        _view(4, 64, goodput=2500, tpot=0.040, rate=8.0),  # #1's config, a worse trial
        _view(5, 128, goodput=9000, tpot=0.005, feasible=False),  # missed the SLO
        _view(6, 48, goodput=4000, gpus=2, tpot=0.030),  # 2000 per GPU, faster than #1
    ]
    points = pareto_points(views, headroom=0.1)
    assert [p.trial for p in points] == [1, 2, 6, 3, 0]  # by goodput per GPU, one per config
    assert {p.trial for p in points if p.on_front} == {0, 1, 3, 6}
    one = next(p for p in points if p.trial == 1)
    assert one.tokens_per_user == pytest.approx(25.0) and one.cap == pytest.approx(9.0)
    assert next(p for p in points if p.trial == 6).goodput_per_gpu == 2000


def test_without_tpot_the_front_is_against_p99() -> None:
    views = [_view(0, 8, goodput=1000, tpot=None, p99=2.0),
             _view(1, 64, goodput=3000, tpot=None, p99=6.0),
             _view(2, 32, goodput=900, tpot=None, p99=4.0)]
    assert {p.trial for p in pareto_points(views, headroom=0.1) if p.on_front} == {0, 1}
    assert front([(2.0, 1.0), (1.0, 1.0)], lower_x=True) == [(1.0, 1.0)]


def test_the_recommendation_tabulates_the_front() -> None:
    views = [_view(0, 8, goodput=1000, tpot=0.010), _view(1, 64, goodput=3000, tpot=0.040),
             _view(2, 32, goodput=2000, tpot=0.050)]
    rec = recommend(views, slo="p99:e2e<=10s")
    assert [p["trial"] for p in rec.pareto] == [1, 2, 0]
    md = to_markdown(rec)
    assert "## Goodput per GPU against tokens per user (Pareto front)" in md
    rows = [line for line in md.splitlines() if line.startswith("| *") or
            line.startswith("|  |")]
    assert len(rows) == 3 and sum(r.startswith("| *") for r in rows) == 2
    config = flags_line({"max_num_seqs": 64})
    assert f"| * | 1 | {config} | 1 | 3,000 | 25.0 | 5.00 | 10.00 | 9.00 |" in md
    assert "Pareto" not in to_markdown(recommend(views[:1], slo="p99:e2e<=10s"))
