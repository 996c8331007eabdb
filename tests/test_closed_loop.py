"""Closed-loop load: virtual users who send again when their reply ends (after a think
time), in the HTTP load generator and in ``autotune ceiling --by concurrency|users``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.client.loadgen import LoadGenError, LoadTestConfig, run_load_test_sync
from autotune.core.metrics import summarize
from autotune.core.records import RequestRecord
from autotune.tuning.load_unit import LoadUnit
from autotune.workload.arrivals import ClosedLoop, conversation_order
from autotune.workload.sources import Request

runner = CliRunner()
NODE = ["--profile", "a100-80gb", "--model-profile", "llama-3-8b", "--gpus", "1",
        "--max-num-seqs", "32", "--dataset", "synthetic", "--input-len", "64",
        "--output-len", "48", "--num-prompts", "300", "--max-num-prompts", "300",
        "--warmup", "20"]


def _in_flight_max(records: list) -> int:
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # an end before a send at the same time
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_each_user_sends_its_next_request_a_think_time_after_its_reply(fake_server) -> None:
    server = fake_server(token_delay_s=0.005)
    users, think = 3, 0.04
    config = LoadTestConfig(url=server.url, users=users, think_s=think, think="fixed",
                            warmup=3, seed=1)
    result = run_load_test_sync(config, [Request("a b c", 3, 8)] * 30)
    records = sorted(result.records, key=lambda r: r.sent_s)
    assert len(records) == 33 and all(r.ok for r in records)
    assert _in_flight_max(records) <= users
    assert server.stats()["max_running"] <= users
    # The sends after the first round are the ends of earlier requests plus the think
    # time: one user's reply, then its pause, then its next request; never sooner (a
    # loaded host may make it later).
    ends = np.sort([r.end_s + think for r in records[:-users]])
    sends = np.array([r.sent_s for r in records[users:]])
    assert np.all(sends >= ends - 1e-3)
    # A closed-loop request is scheduled when its user sends it.
    assert all(abs(r.scheduled_s - r.sent_s) < 0.01 for r in records)


def test_without_think_time_the_users_keep_that_many_requests_in_flight(fake_server) -> None:
    server = fake_server(token_delay_s=0.02)  # 0.2 s a request: the 4 overlap
    config = LoadTestConfig(url=server.url, users=4, warmup=0)
    result = run_load_test_sync(config, [Request("a b c", 3, 10)] * 24)
    assert all(r.ok for r in result.records)
    assert _in_flight_max(result.records) == 4
    assert server.stats()["max_running"] == 4


def test_conversations_are_grouped_by_their_runs_in_the_plan() -> None:
    def turn(c: str | None, t: int = 0) -> Request:
        return Request("x", 1, 1, conversation=c, turn=t)

    plan = [turn("a", 0), turn(None), turn("a", 1), turn("b", 0), turn("b", 1),
            turn("a", 0), turn("a", 1)]  # a cycled pool: "a" comes round again
    assert conversation_order(plan) == [[0, 2], [1], [3, 4], [5, 6]]


def test_a_user_sends_its_conversation_turn_by_turn(fake_server) -> None:
    server = fake_server(token_delay_s=0.005)
    think = 0.03
    turns = [Request(f"c{c} t{t}", 2, 6, conversation=f"c{c}", turn=t)
             for c in range(4) for t in range(3)]
    config = LoadTestConfig(url=server.url, users=2, think_s=think, think="fixed",
                            warmup=0, seed=2)
    result = run_load_test_sync(config, turns)
    assert all(r.ok for r in result.records) and len(result.records) == 12
    by_index = {r.index: r for r in result.records}
    for c in range(4):
        mine = [by_index[3 * c + t] for t in range(3)]
        for before, after in zip(mine, mine[1:], strict=False):
            # The next turn goes out after the previous reply and its think time.
            assert after.sent_s >= before.end_s + think - 0.005
    # Two users, each on its own conversation: never two turns of one in flight.
    assert _in_flight_max(result.records) <= 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"users": 0}, "at least 1 user"),
    ({"users": 2, "max_concurrency": 2}, "leave max_concurrency unset"),
    ({"users": 2, "think_s": -1.0}, "think time must be"),
    ({"users": 2, "think": "uniform"}, "unknown think-time distribution"),
])
def test_a_bad_closed_loop_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(LoadGenError, match=message):
        LoadTestConfig(url="http://127.0.0.1:9", **kwargs)


def test_think_times_and_starts_are_drawn_from_the_seed() -> None:
    closed = ClosedLoop(think_s=20.0)
    assert np.array_equal(closed.think_times(50, 3), closed.think_times(50, 3))
    assert not np.array_equal(closed.think_times(50, 3), closed.think_times(50, 4))
    assert closed.think_times(4000, 0).mean() == pytest.approx(20.0, rel=0.06)
    starts = closed.starts(100, 0)
    assert np.all(np.diff(starts) >= 0) and 0 <= starts[0] and starts[-1] < 20.0
    assert np.array_equal(ClosedLoop(think_s=5.0, think="fixed").think_times(3), [5, 5, 5])
    assert np.array_equal(ClosedLoop().starts(3), [0, 0, 0])


def test_levels_of_users_are_whole_and_their_bracket_closes_one_user_apart() -> None:
    unit = LoadUnit.of("users", 20.0)
    assert unit.at(37.4) == 37 and unit.at(0.2) == 1
    assert unit.between(37.4, 37, 40) == 38 and unit.between(39.9, 37, 40) == 39
    assert unit.up(1, 1.03) == 2 and unit.down(2, 1.7) == 1 and unit.down(1, 0.5) == 1
    assert unit.closed_bracket(59, 60, 0.001) and not unit.closed_bracket(58, 60, 0.001)
    assert unit.cap(304, 0.10) == 273 and unit.cap(1, 0.10) == 1
    assert unit.fmt(180) == "180 users" and LoadUnit.of("concurrency").fmt(8) == "8 in flight"


def _ceiling(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["ceiling", *NODE, "--validate", "off", "--output", str(out),
                                 *args])
    assert result.exit_code == 0, result.stderr
    return json.loads(out.read_text()), result.stdout


def test_a_ceiling_in_users_answers_in_users_with_the_other_units_beside(
        tmp_path: Path) -> None:
    data, stdout = _ceiling(tmp_path, "--slo-p99", "3s", "--by", "users",
                            "--think-time", "5s", "--think", "fixed")
    assert data["by"] == "users" and data["unit"] == "users" and data["think_s"] == 5.0
    users = data["feasible_max"]
    assert users == int(users) and users >= 2
    assert data["infeasible_min"] is None or data["infeasible_min"] >= users + 1
    assert data["recommended_cap"] == int(users * 0.9)
    assert data["answer"].startswith(f"simulated: sustains {users:.0f} users (= ")
    assert "in flight on average, P99 E2E" in data["answer"]
    assert data["answer"] in stdout
    assert all(p["rate"] == int(p["rate"]) for p in data["probes"]
               if p["rate"] is not None and p["phase"] not in ("saturation", "floor"))
    figures = data["at_feasible_max"]
    # Little's law over a user's cycle: the users are the request rate times the cycle
    # of a reply and a think time, which the figures must show.
    passing = max((p for p in data["probes"] if p["rate"] == users and p["verdict"] == "pass"),
                  key=lambda p: p["num_prompts"])
    e2e_mean = passing["summary"]["e2e"]["mean"]
    assert figures["request_rate"] * (5.0 + e2e_mean) == pytest.approx(users, rel=0.1)
    assert figures["in_flight_mean"] == pytest.approx(figures["request_rate"] * e2e_mean,
                                                      rel=0.1)
    assert figures["e2e_p99_s"] <= 3.0


def test_a_ceiling_in_concurrency_keeps_that_many_in_flight(tmp_path: Path) -> None:
    data, stdout = _ceiling(tmp_path, "--slo-p99", "3s", "--by", "concurrency", "--csv",
                            str(tmp_path / "probes.csv"))
    rows = list(csv.DictReader((tmp_path / "probes.csv").open()))
    assert rows and {r["unit"] for r in rows} == {"in flight"}
    assert data["by"] == "concurrency" and data["think_s"] == 0.0
    level = data["feasible_max"]
    assert data["answer"].startswith(f"simulated: sustains {level:.0f} in flight (= ")
    assert level * 0.9 <= data["at_feasible_max"]["in_flight_mean"] <= level * (1 + 1e-9)
    assert "no think time" in stdout
    assert data["stepdown_probes"] is None  # auto_tune.sh's step-down is in req/s


@pytest.mark.parametrize(("args", "message"), [
    (["--by", "users"], "--by users needs a think time"),
    (["--by", "concurrency", "--think-time", "5s"], "drop --think-time"),
    (["--think-time", "5s"], "--think-time applies to --by users only"),
    (["--by", "users", "--think-time", "5s", "--start-rate", "3"],
     "--start-rate takes req/s"),
    (["--by", "users", "--think-time", "soon"], "--think-time: cannot read duration"),
])
def test_bad_closed_loop_options_are_one_line(tmp_path: Path, args: list[str],
                                              message: str) -> None:
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["ceiling", "--slo-p99", "2s", *args, "--output", str(out)])
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_in_flight_on_average_is_the_users_kept_busy_over_a_short_window() -> None:
    # 2 users, each request 1 s, sent back to back: the last sends come 1 s before the
    # last replies, so the send rate (5 gaps over 2 s) times the mean latency reads 2.5
    # in flight, and the judged latency over the window to the last reply 2.0 only by
    # luck of the numbers.  While the judged requests were sent, the 2 users kept 2.
    records = [RequestRecord(index=i, scheduled_s=t, dispatched_s=t, sent_s=t,
                             first_token_s=t + 0.5, end_s=t + 1.0, prompt_tokens=3,
                             output_tokens=2, expected_output_tokens=2, status=200,
                             warmup=i < 2)
               for i, t in enumerate([0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0])]
    summary = summarize(records)
    assert summary.scheduled_rate * summary.e2e.mean == pytest.approx(2.5)
    assert summary.in_flight_mean == pytest.approx(2.0)
    # A long drain after the last send does not dilute it (2 requests of 10 s at the
    # end: over the window to the last reply it would read about 1.3).
    records[-1].end_s = records[-2].end_s = 13.0
    assert summarize(records).in_flight_mean == pytest.approx(2.0)
