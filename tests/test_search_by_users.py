"""``search --by concurrency|users``: each trial's ceiling searched in users of a closed
loop, the study ranking configs by the users they sustain, the cap validated in users."""

from __future__ import annotations

import json
import math
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.study.worker import SPEC_ATTR, StudySpec
from autotune.tuning.load_unit import RATE, LoadUnit

runner = CliRunner()
SPACE = """\
name: two-seqs
description: two configs of one A100, 8 or 32 sequences at a time
fixed:
  tensor_parallel_size: 1
  max_model_len: 2048
parameters:
  max_num_seqs: {type: categorical, choices: [8, 32]}
  request_rate: {type: float, low: 0.5, high: 100.0, log: true}
baseline:
  max_num_seqs: 8
  request_rate: 4.0
rules: []
"""


def _search(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    res = runner.invoke(app, ["search", "--studies-dir", str(tmp_path / "studies"),
                              "--space", str(space), "--profile", "a100-80gb", "--gpus", "1",
                              "--sampler", "grid", "--dataset", "synthetic",
                              "--num-prompts", "100", "--warmup", "10", *args])
    return res.exit_code, res.stdout, res.stderr


def test_a_search_by_concurrency_ranks_configs_by_the_requests_they_keep_in_flight(
        tmp_path: Path) -> None:
    code, out, err = _search(tmp_path, "--slo-p99", "8s", "--by", "concurrency",
                             "--n-trials", "2", "--prove-top", "1", "--validate", "1m",
                             "--tier", "batch=60s", "--study-name", "conc")
    assert code == 0, err + out[-2000:]
    folder = tmp_path / "studies" / "conc"
    rec = json.loads((folder / "recommendation.json").read_text())
    assert rec["unit"] == "in flight" and rec["objective"] == "in flight"
    # 32 sequences at a time keep more requests in flight under the SLO than 8.
    best = rec["best"]
    assert best["flags"]["max_num_seqs"] == 32
    top = best["max_feasible_rate"]
    assert top == int(top) and rec["ceilings"][0]["feasible_max"] == top
    assert best["value"] == top  # the objective is the ceiling itself
    # The cap: whole requests in flight, 10% under the proven ceiling, then validated
    # as a closed loop of that many.
    assert rec["rate_cap"] == int(rec["rate_cap"]) <= math.floor(0.9 * top)
    validation = rec["validation"]
    assert validation["unit"] == "in flight"
    assert all(r["rate"] == int(r["rate"]) for r in validation["runs"])
    assert f"load cap at the gateway: {rec['rate_cap']:.0f} in flight" in out
    assert f"**{rec['rate_cap']:,.0f} in flight**" in (folder / "recommendation.md").read_text()
    report = (folder / "report.md").read_text()
    assert "| level (in flight) |" in report and "ceiling (in flight)" in report
    assert "rate (req/s)" not in report
    # A tier re-judged from the proof's tests counts in flight too, its cap whole.
    (tier,) = rec["tiers"]
    assert tier["unit"] == "in flight" and tier["trial"] is not None
    assert tier["cap"] == int(tier["cap"]) <= tier["rate"]
    assert f"tier batch (p99:e2e<=60s): trial {tier['trial']} at {tier['rate']:.0f} in flight" \
        in out
    assert "| passed at (in flight) | cap (in flight) |" in (
        folder / "recommendation.md").read_text()

    storage = f"sqlite:///{tmp_path / 'studies' / 'conc.db'}"
    study = optuna.load_study(study_name="conc", storage=storage)
    assert study.user_attrs["objective"] == "level"
    assert study.user_attrs["load_unit"]["by"] == "concurrency"
    # Each feasible trial's value is the ceiling its own search found, in flight.
    for t in study.trials:
        if t.user_attrs.get("feasible"):
            assert t.value == t.user_attrs["result"]["rate"] == int(t.value)
    # A worker joining the study rebuilds the same unit from the stored spec.
    spec = StudySpec.from_dict(study.user_attrs[SPEC_ATTR])
    assert LoadUnit.from_spec(spec.load["unit"]) == LoadUnit.of("concurrency")

    # Resuming it by users who think would rank incomparable trials together.
    code, _, err = _search(tmp_path, "--slo-p99", "8s", "--n-trials", "3", "--by", "users",
                           "--think-time", "5s", "--study-name", "conc", "--validate", "off")
    assert code != 0 and "load_unit" in err and len(err.strip().splitlines()) == 1

    # `ceiling --study S --trial N` measures the trial as its search did: in flight,
    # from the level its search started at, without --by given again.
    trial = next(t for t in study.trials if t.user_attrs.get("feasible"))
    first = trial.user_attrs["result"]["ceiling"]["probes"][0]
    out_file = tmp_path / "again.json"
    res = runner.invoke(app, ["ceiling", "--study", "conc", "--trial", str(trial.number),
                              "--storage", storage, "--dataset", "synthetic",
                              "--max-probes", "2", "--validate", "off",
                              "--output", str(out_file)])
    assert res.exit_code in (0, 1), res.stderr
    again = json.loads(out_file.read_text())
    assert again["unit"] == "in flight"
    assert [p["phase"] for p in again["probes"]][:1] == [first["phase"]]
    assert again["probes"][0]["rate"] == first["rate"]


def test_a_stored_unit_reads_back_the_same_and_an_old_study_searched_req_s() -> None:
    users = LoadUnit.of("users", 20.0, "fixed")
    assert LoadUnit.from_spec(users.spec()) == users
    assert LoadUnit.from_spec(None) == RATE and LoadUnit.from_spec({}) == RATE


@pytest.mark.parametrize(("args", "needle"), [
    (["--by", "speed"], "use `autotune ceiling --dataset FILE --by speed`"),
    (["--by", "users"], "--by users needs a think time"),
    (["--by", "concurrency", "--objective", "tokens"], "drop --objective"),
    (["--objective", "level"], "add --by"),
    (["--by", "users", "--think-time", "20s", "--twin"], "--twin predicts in req/s"),
])
def test_what_a_search_by_users_cannot_take_is_one_line(tmp_path: Path, args: list[str],
                                                        needle: str) -> None:
    code, _, err = _search(tmp_path, "--slo-p99", "8s", *args)
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "studies").exists()


def test_the_pre_screen_of_a_search_by_users_predicts_users_and_seeds_the_real_search(
        tmp_path: Path) -> None:
    """The pre-screen searches the same closed loop in virtual time: its top config is
    enqueued at a whole number of users, the seeded trial's search starts there, and the
    recommendation shows prediction and measurement in users.  Both studies screen, as
    a search's do; the simulator stands in for the real server (the same study code)."""
    import yaml

    from autotune.analysis.recommend import recommend, to_markdown, view_of
    from autotune.backends.base import LoadPlan
    from autotune.backends.sim import SimBackend
    from autotune.core.slo import parse_slo
    from autotune.study.space import SearchSpace
    from autotune.study.study import (
        StudySettings,
        prescreen_enqueue,
        rows_from_study,
        run_study,
        storage_url,
    )
    from autotune.tuning.record import StoredTrial
    from autotune.workload.sources import Request

    slo = parse_slo("8s")
    users = LoadUnit.of("users", 5.0, "fixed")
    space = SearchSpace.from_dict(yaml.safe_load(SPACE), source="two-seqs.yaml")
    reqs = [Request("x", 256, 128) for _ in range(140)]
    plan = LoadPlan(slo=slo, requests=reqs[20:], warmup_requests=reqs[:20], warmup=20)

    def settings(name: str, n: int) -> StudySettings:
        return StudySettings(name=name, slo=slo, space=space, sampler="grid", seed=0,
                             studies_dir=tmp_path / "studies", gpus=1, n_trials=n,
                             objective="level", unit=users, screen=True,
                             storage=storage_url(name, None, tmp_path / "studies"))

    sim = SimBackend("1xa100-80gb", "llama-3-8b")
    pre = run_study(settings("u-prescreen", 2), sim, plan)
    rows = rows_from_study(pre.study)
    picks = prescreen_enqueue(rows, space, top_k=1)
    assert len(picks) == 1
    (params, attrs), = picks
    predicted = attrs["predicted"]["ceiling_rate"]
    assert predicted == int(predicted) >= 1  # whole users, the simulated trial's own
    assert predicted == max(r.rate for r in rows if r.feasible)

    real = run_study(settings("u", 2), sim, plan, enqueue=picks)
    seeded = next(t for t in real.study.get_trials() if "predicted" in t.user_attrs)
    result = seeded.user_attrs["result"]
    assert result["start"].startswith("the pre-screen")
    assert result["ceiling"]["probes"][0]["rate"] == predicted
    rec = recommend([view_of(StoredTrial.of(t)) for t in real.study.get_trials()],
                    slo=str(slo), objective=users.label)
    rec.unit = users.label
    md = to_markdown(rec)
    assert "| predicted ceiling (users) | measured at (users) |" in md
