"""SLO tiers: each tier's best proven config, re-judged from the proof's load tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from autotune.analysis.recommend import TrialView, recommend, to_markdown
from autotune.analysis.tiers import (
    TierError,
    answer_tiers,
    check_tiers,
    parse_tier,
    parse_tier_gpus,
    proven_tier,
    tier_plans,
)
from autotune.cli import app
from autotune.core.metrics import summarize
from autotune.core.records import RequestRecord
from autotune.tuning.load_unit import RATE


def _probe(rate: float, e2e_s: float, ttft_s: float, n: int = 400) -> SimpleNamespace:
    """A probe whose every request took ``e2e_s`` (a few slower), ``ttft_s`` to its
    first token, 20 tokens."""
    rng = np.random.default_rng(int(rate * 100))
    records = []
    for i in range(n):
        t0 = i / rate
        e2e = e2e_s * (1.0 + 0.1 * rng.random())
        chunks = list(np.linspace(t0 + ttft_s, t0 + e2e, 20))
        records.append(RequestRecord(index=i, scheduled_s=t0, dispatched_s=t0, sent_s=t0,
                                     first_token_s=chunks[0], chunk_times_s=chunks,
                                     end_s=t0 + e2e, output_tokens=20, status=200,
                                     expected_output_tokens=20))
    return SimpleNamespace(rate=rate, phase="bisect", pruned=False, request_throughput=rate,
                           summary=summarize(records))


def _ceiling(trial: int, seqs: int, probes: list[SimpleNamespace]) -> SimpleNamespace:
    return SimpleNamespace(trial=trial, config={"max_num_seqs": seqs},
                           result=SimpleNamespace(probes=probes))


def test_each_tier_takes_the_config_with_the_most_within_its_limits() -> None:
    ceilings = [
        _ceiling(3, 256, [_probe(10.0, 2.0, 0.9), _probe(20.0, 6.0, 2.5)]),  # batchy
        _ceiling(7, 16, [_probe(6.0, 1.0, 0.1), _probe(8.0, 1.5, 0.2)]),     # snappy
    ]
    tiers = (parse_tier("interactive=p99:ttft<=500ms"), parse_tier("batch=10s"),
             parse_tier("tight=500ms"))
    interactive, batch, tight = answer_tiers(tiers, ceilings, study="s", headroom=0.1)
    assert (interactive.trial, interactive.rate) == (7, 8.0)
    assert (batch.trial, batch.rate) == (3, 20.0)
    assert batch.cap == pytest.approx(18.0) and batch.good_share == 1.0
    assert batch.command == "autotune ceiling --study s --trial 3 --slo 'p99:e2e<=10s'"
    assert tight.trial is None and "not shown" in tight.sentence
    assert all(c["bound_s"] <= c["threshold_s"] for c in interactive.checks)
    views = [TrialView(number=3, flags={"max_num_seqs": 256}, rate=20.0, status="complete",
                       feasible=True, value=1.0, goodput_tokens=400.0, goodput_requests=None,
                       output_throughput=None, p99_e2e_s=6.0, attainment=None,
                       gpu_util_pct=None, gpus=1)]
    rec = recommend(views, slo="p99:e2e<=10s")
    rec.tiers = [t.to_dict() for t in (interactive, batch, tight)]
    md = to_markdown(rec)
    assert "## SLO tiers" in md and md.count("| interactive |") == 1
    assert "| tight | `p99:e2e<=500ms` | re-judged | - | no config met it |" in md
    assert "| batch | `p99:e2e<=10s` | re-judged | 3 |" in md


def test_a_tier_proved_by_its_own_ceiling_search_takes_the_best_passing_config() -> None:
    tier = parse_tier("mid=3s")

    def proof(trial: int, rate: float | None) -> SimpleNamespace:
        probe = None if rate is None else _probe(rate, 2.0, 0.3)
        if probe is not None:
            probe.checks, probe.num_measured = [], probe.summary.num_measured
        return SimpleNamespace(trial=trial, config={"max_num_seqs": trial}, result=SimpleNamespace(
            feasible_max=rate, recommended_cap=None if rate is None else 0.9 * rate,
            feasible_probe=lambda: probe, sentence=lambda: f"sustains {rate}", unit=RATE))

    answer = proven_tier(tier, [proof(1, 5.0), proof(2, 9.0), proof(3, None)], study="s")
    assert answer.proved and (answer.trial, answer.rate) == (2, 9.0)
    assert answer.cap == pytest.approx(8.1) and answer.sentence.endswith("sustains 9.0")
    none = proven_tier(tier, [proof(3, None)], study="s")
    assert none.proved and none.trial is None and "no proven config meets it" in none.sentence


@pytest.mark.parametrize(("text", "message"), [
    ("interactive", "give NAME=SLO"),
    ("=10s", "give NAME=SLO"),
    ("x=p99:foo<=1s", "--tier x: unknown SLO metric 'foo'"),
    ("x=", "give NAME=SLO"),
])
def test_a_bad_tier_says_how_to_write_one(text: str, message: str) -> None:
    with pytest.raises(TierError, match=message):
        parse_tier(text)


def test_tier_names_must_differ_and_the_cli_says_so_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(TierError, match="must differ"):
        check_tiers((parse_tier("a=1s"), parse_tier("a=2s")))
    result = CliRunner().invoke(app, ["search", "--slo-p99", "10s", "--tier", "a=1s",
                                      "--tier", "nope", "--studies-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--tier 'nope': give NAME=SLO" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


def _stored(name: str, trial: int | None, tp: int, rate: float | None) -> dict:
    return {"tier": name, "slo": "p99:e2e<=5s", "trial": trial, "rate": rate,
            "flags": {"model": "m", "tensor_parallel_size": tp, "max_num_seqs": 64},
            "goodput_tokens": 1000.0, "goodput_requests": 5.0, "proved": False}


def test_each_tier_gets_its_own_replicas_on_the_next_gpus_and_ports() -> None:
    stored = [_stored("interactive", 3, 2, 10.0), _stored("batch", 5, 1, 20.0),
              _stored("tight", None, 1, None)]
    plans = dict(tier_plans(stored, parse_tier_gpus(["interactive=4", "batch=3"]), total=8,
                            headroom=0.1, gpu_hour_cost=None, model=None, base_port=9000))
    inter, batch = plans["interactive"], plans["batch"]
    assert inter.data_parallel_size == 2 and [r.gpus for r in inter.replicas] == [(0, 1), (2, 3)]
    assert [r.port for r in inter.replicas] == [9000, 9001]
    assert [r.gpus for r in batch.replicas] == [(4,), (5,), (6,)]
    assert [r.port for r in batch.replicas] == [9002, 9003, 9004]
    assert batch.total_cap == pytest.approx(3 * 18.0)
    assert batch.replicas[0].command.startswith("CUDA_VISIBLE_DEVICES=4 vllm serve m")
    with pytest.raises(TierError, match="more than --gpus 6"):
        tier_plans(stored, {"interactive": 4, "batch": 3}, total=6, headroom=0.1,
                   gpu_hour_cost=None, model=None, base_port=9000)
    with pytest.raises(TierError, match="no config met tier tight"):
        tier_plans(stored, {"tight": 1}, total=None, headroom=0.1, gpu_hour_cost=None,
                   model=None, base_port=9000)
    # A study searched by users: a replica's users are no share of a request rate.
    users = [{**_stored("chat", 2, 1, 180.0), "unit": "users"}]
    with pytest.raises(TierError, match="tiers count users, and replicas are planned by "
                                        "request rate"):
        tier_plans(users, {"chat": 2}, total=None, headroom=0.1, gpu_hour_cost=None,
                   model=None, base_port=9000)
    with pytest.raises(TierError, match="the study has no tier 'nope'; its tiers: "
                                        "interactive, batch, tight"):
        tier_plans(stored, {"nope": 1}, total=None, headroom=0.1, gpu_hour_cost=None,
                   model=None, base_port=9000)
    with pytest.raises(TierError, match="give NAME=GPUS"):
        parse_tier_gpus(["interactive=0"])
