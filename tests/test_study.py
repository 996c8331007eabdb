from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from autotune.analysis.recommend import recommend, view_of
from autotune.backends.base import LoadPlan
from autotune.backends.sim import SimBackend
from autotune.core.slo import parse_slo
from autotune.study.space import SearchSpace
from autotune.study.storage import StudyError, open_storage
from autotune.study.study import RUNS_KEY, StudySettings, make_sampler, run_study, storage_url
from autotune.tuning.record import StoredTrial
from autotune.workload.sources import Request

ROOT = Path(__file__).resolve().parent.parent
SLO = parse_slo("10s")

SPACE = {
    "name": "tiny",
    "attention_heads": 32,
    "fixed": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "max_model_len": 8192},
    "parameters": {
        "tensor_parallel_size": {"type": "categorical", "choices": [1, 2, 3, 4, 8]},
        "max_num_seqs": {"type": "int", "low": 64, "high": 512, "step": 64},
        "max_num_batched_tokens": {"type": "categorical", "choices": [2048, 8192]},
        "enable_chunked_prefill": {"type": "bool"},
        "request_rate": {"type": "float", "low": 2.0, "high": 60.0, "log": True},
    },
    "baseline": {"tensor_parallel_size": 1, "max_num_seqs": 256,
                 "max_num_batched_tokens": 2048, "enable_chunked_prefill": True,
                 "request_rate": 3.0},
}


def _requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request("x", int(p), int(o)) for p, o in
            zip(rng.integers(20, 400, n), rng.integers(50, 400, n), strict=True)]


def _plan(n: int = 200) -> LoadPlan:
    reqs = _requests(n + 20)
    return LoadPlan(slo=SLO, requests=reqs[20:], warmup_requests=reqs[:20], warmup=20)


class Recording(SimBackend):
    """The simulator, remembering every config it was asked to start."""

    def __init__(self) -> None:
        super().__init__("4xa100-80gb", "llama-3-8b")
        self.prepared: list[dict[str, Any]] = []

    def prepare(self, flags: Any, *, trial: int | None = None) -> dict[str, Any]:
        self.prepared.append(dict(flags))
        return super().prepare(flags, trial=trial)


def _settings(tmp_path: Path, **kw: Any) -> StudySettings:
    space = SearchSpace.from_dict(SPACE, source="tiny.yaml")
    base = dict(name="t", slo=SLO, space=space, studies_dir=tmp_path / "studies", gpus=4,
                n_trials=14, seed=3)
    base.update(kw)
    base["storage"] = storage_url(base["name"], None, base["studies_dir"])
    return StudySettings(**base)


def test_sim_study_end_to_end(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    backend = Recording()
    run = run_study(s, backend, _plan())
    db = tmp_path / "studies" / "t.db"
    assert db.is_file()
    with sqlite3.connect(db) as con:
        (n,) = con.execute("select count(*) from trials").fetchone()
    assert n == 14
    trials = run.study.get_trials()
    assert trials[0].user_attrs.get("baseline") is True
    assert trials[0].params["max_num_seqs"] == 256
    # Every trial carries the same constraint keys (GP needs that), set via set_constraint.
    for t in trials:
        assert set(t.constraints) == {"p99:e2e", RUNS_KEY}
    # The rate is not sampled: each trial searches its config's own ceiling.
    assert all("request_rate" not in t.params for t in trials)
    # TP=3 (does not divide 32 heads) and TP=8 (> 4 GPUs) were removed before sampling:
    # no sample was spent on them.
    assert not {t.params["tensor_parallel_size"] for t in trials} & {3, 8}
    assert not {f["tensor_parallel_size"] for f in backend.prepared} & {3, 8}
    for t in trials:
        if not t.params["enable_chunked_prefill"] and t.params["max_num_batched_tokens"] < 8192:
            assert t.user_attrs["reason"] == "batched_tokens_cover_model_len"
            assert t.user_attrs["result"]["launched"] is False
            assert t.constraints[RUNS_KEY] == 1.0
    launched = [t for t in trials if t.user_attrs["result"].get("launched")
                and "repeat_of" not in t.user_attrs["result"]]
    # One server start per config: each launched trial's probes ran on one start.
    assert len(backend.prepared) >= len(launched)
    assert backend.restarts == len(launched)
    for t in launched:
        res = t.user_attrs["result"]
        ceiling = res["ceiling"]
        if t.state == TrialState.COMPLETE and res["feasible"]:
            # Its value is the goodput at the confirmed ceiling, and the cap is under it.
            assert res["rate"] == ceiling["feasible_max"]
            assert res["rate_cap"] == pytest.approx(0.9 * ceiling["feasible_max"])
            assert res["verdict"] == "pass" and res["evidence"]["verdict"] == "pass"
            assert t.value == pytest.approx(res["evidence"]["goodput_tokens"])
            assert all(v <= 0 for k, v in t.constraints.items() if k != RUNS_KEY)
    # No config is searched twice: a repeated proposal reuses the earlier answer.
    keys = [repr(sorted(t.params.items())) for t in launched]
    assert len(keys) == len(set(keys))
    views = [view_of(StoredTrial.of(t)) for t in trials]
    rec = recommend(views, slo=str(SLO))
    best = next(t for t in trials if t.number == rec.best.trial)
    assert best.user_attrs["result"]["feasible"] is True
    assert rec.baseline is not None and rec.baseline.number == 0
    if rec.baseline.feasible:
        assert rec.best.value >= rec.baseline.value
    assert rec.rate_cap == pytest.approx(0.9 * rec.best.max_feasible_rate, abs=0.01)
    assert rec.best.command.startswith("vllm serve meta-llama/Meta-Llama-3-8B-Instruct")
    records = list((tmp_path / "studies" / "t" / "records").glob("trial-*.jsonl"))
    assert records
    rows = (tmp_path / "studies" / "t" / "experiments.csv").read_text().splitlines()
    probes_run = sum(len(t.user_attrs["result"]["ceiling"]["probes"]) for t in launched)
    assert len(rows) - 1 == probes_run  # one row per load test


def test_a_config_that_cannot_beat_the_incumbent_stops_after_one_load_test(
        tmp_path: Path) -> None:
    """TP=4 first (strong), then TP=1 with few sequences (weak): the weak one's only
    load test runs at the rate that would beat TP=4's goodput, fails, and the trial is
    pruned with its reason and evidence, costing one probe, not a rate search."""
    strong = {"tensor_parallel_size": 4, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
              "enable_chunked_prefill": True}
    weak = {"tensor_parallel_size": 1, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
            "enable_chunked_prefill": True}
    s = _settings(tmp_path, n_trials=3, name="inc")
    backend = Recording()
    plan = _plan()
    run = run_study(s, backend, plan, enqueue=[(strong, {}), (weak, {})])
    trials = run.study.get_trials()
    assert [t.params["tensor_parallel_size"] for t in trials] == [1, 4, 1]
    best_before = max(trials[0].value or 0.0, trials[1].value or 0.0)
    t = trials[2]
    assert t.state == TrialState.PRUNED
    res = t.user_attrs["result"]
    assert res["reason"] == "below_incumbent" and res["status"] == "pruned"
    probes = res["ceiling"]["probes"]
    assert len(probes) == 1 and probes[0]["phase"] == "incumbent"
    assert probes[0]["verdict"] == "fail" and probes[0]["evidence"]["reasons"]
    mean_out = float(np.mean([r.output_tokens for r in plan.requests]))
    assert probes[0]["rate"] == pytest.approx(best_before / mean_out, rel=1e-6)
    assert res["start"].startswith("beat the incumbent")
    # Its constraints say it missed the SLO there, so it can never be the best.
    assert t.constraints["p99:e2e"] > 0
    # Without beat-the-incumbent the same config gets its whole ceiling search.
    s2 = _settings(tmp_path, n_trials=3, name="full", beat_incumbent=False)
    run2 = run_study(s2, Recording(), plan, enqueue=[(strong, {}), (weak, {})])
    full = run2.study.get_trials()[2]
    assert full.state == TrialState.COMPLETE
    assert len(full.user_attrs["result"]["ceiling"]["probes"]) > 1


def test_resume_continues_and_keeps_finished_trials(tmp_path: Path) -> None:
    s = _settings(tmp_path, n_trials=5)
    first = run_study(s, SimBackend("4xa100-80gb", "llama-3-8b"), _plan(100))
    before = {t.number: t.value for t in first.study.get_trials()
              if t.state == TrialState.COMPLETE}
    s2 = _settings(tmp_path, n_trials=8)
    second = run_study(s2, SimBackend("4xa100-80gb", "llama-3-8b"), _plan(100))
    after = {t.number: t.value for t in second.study.get_trials()}
    assert second.new_trials == 3
    for number, value in before.items():
        assert after[number] == value
    # The baseline is enqueued once per study, not once per run.
    assert sum(bool(t.user_attrs.get("baseline")) for t in second.study.get_trials()) == 1


def test_resume_with_another_slo_is_refused(tmp_path: Path) -> None:
    run_study(_settings(tmp_path, n_trials=1), SimBackend("4xa100-80gb", "llama-3-8b"),
              _plan(50))
    other = _settings(tmp_path, n_trials=2, slo=parse_slo("5s"))
    with pytest.raises(StudyError, match="slo"):
        run_study(other, SimBackend("4xa100-80gb", "llama-3-8b"), _plan(50))


@pytest.mark.parametrize("budget", [150.0, 1260.0, 1290.0])
def test_budget_cuts_the_running_load_test_and_labels_the_partial_answer(
        tmp_path: Path, budget: float) -> None:
    """--budget ends the study within one window (1 s) of its end, even in the middle of
    a trial's load test: that test is cut there, counts as what its evidence supports,
    and the trial's answer says it is partial.  150 s ends the first trial's search
    mid-way; 1,290 s ends inside the second trial's first test; with 1,260 s, the 43 s
    left after the first trial (1,217 s) are less than one test's 60 s minimum, so no
    trial is started only to be cut."""
    s = _settings(tmp_path, n_trials=50, budget_s=budget)
    run = run_study(s, Recording(), _plan())
    assert run.stopped_by == "budget"
    assert run.server_s <= budget + 1.0
    trials = [StoredTrial.of(t) for t in run.study.get_trials()]
    last = trials[-1]
    # Every earlier trial finished its search within the budget.
    assert all(not t.ceiling.get("budget_spent") for t in trials[:-1])
    if budget == 1260.0:
        assert len(trials) == 1 and not last.ceiling.get("budget_spent")
        assert budget - 60.0 < run.server_s
        return
    assert budget - 1.0 <= run.server_s
    assert last.ceiling["budget_spent"] is True
    assert "the --budget ran out" in last.ceiling["answer"]
    assert any("the --budget ran out during the load test" in n
               for n in last.ceiling["notes"])
    cut = [p for p in last.ceiling["probes"] if p.get("verdict") == "inconclusive"]
    assert cut, "the test running at the budget's end is inconclusive, not a verdict"
    # A cut test is not evidence that the config is below the incumbent.
    assert last.state == "COMPLETE" and last.reason != "below_incumbent"


@pytest.mark.parametrize("name", ["random", "grid", "gp"])
def test_other_samplers_run(tmp_path: Path, name: str) -> None:
    s = _settings(tmp_path, sampler=name, n_trials=12 if name == "gp" else 4)
    if name == "gp" and importlib.util.find_spec("torch") is None:
        with pytest.raises(StudyError, match="needs PyTorch"):
            run_study(s, SimBackend("4xa100-80gb", "llama-3-8b"), _plan(60))
        return
    run = run_study(s, SimBackend("4xa100-80gb", "llama-3-8b"), _plan(60))
    assert run.new_trials == s.n_trials


def test_unknown_sampler_and_bad_storage() -> None:
    space = SearchSpace.from_dict(SPACE)
    with pytest.raises(StudyError, match="unknown sampler 'anneal'"):
        make_sampler("anneal", seed=0, space=space)
    with pytest.raises(StudyError, match="cannot open storage"):
        open_storage("sqlite:////no/such/folder/x.db")
    with pytest.raises(StudyError, match="unsupported storage nosuchdb"):
        open_storage("nosuchdb://localhost/x")


def _study_row_exists(db: Path, name: str) -> bool:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            row = con.execute("SELECT 1 FROM studies WHERE study_name = ?", (name,)).fetchone()
            return row is not None
    except sqlite3.Error:
        return False


def test_killed_study_resumes_without_losing_finished_trials(tmp_path: Path) -> None:
    """kill -9 in the middle of a study: finished trials survive, the stale RUNNING
    trial is marked failed, and the same command continues."""
    studies = tmp_path / "studies"
    cmd = [sys.executable, "-c", "from autotune.cli import main; main()", "search",
           "--slo-p99", "10s", "--space", "llama3-8b-4xa100", "--study-name", "k",
           "--studies-dir", str(studies), "--num-prompts", "150", "--warmup", "10",
           "--validate", "off", "--n-trials", "400"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    err = tmp_path / "search.err"  # what the killed search said, should this test fail
    with open(err, "w") as err_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                stderr=err_file, start_new_session=True)
    storage = f"sqlite:///{studies / 'k.db'}"
    try:
        deadline = time.monotonic() + 60
        finished: dict[int, float | None] = {}
        while time.monotonic() < deadline:
            time.sleep(0.5)
            # Read-only until the search has created its study: opening a new file with
            # Optuna races the search's own schema setup (alembic_version UNIQUE error).
            if not _study_row_exists(studies / "k.db", "k"):
                continue
            try:
                study = optuna.load_study(study_name="k", storage=storage)
                done = [t for t in study.get_trials()
                        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
            except Exception:  # the study row may not exist yet
                continue
            if len(done) >= 4:
                break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert "k" in optuna.get_all_study_names(storage), err.read_text()[-2000:]
    study = optuna.load_study(study_name="k", storage=storage)
    finished = {t.number: t.value for t in study.get_trials()
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    assert len(finished) >= 4
    target = len(finished) + 2
    resume = cmd[:-1] + [str(target)]
    # A guard against a hang, not a speed check: two trials take ~30 s on an idle core.
    out = subprocess.run(resume, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    study = optuna.load_study(study_name="k", storage=storage)
    trials = study.get_trials()
    now = {t.number: t.value for t in trials}
    for number, value in finished.items():
        assert now[number] == value
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(done) == target
    assert (studies / "k" / "recommendation.json").is_file()


def test_prescreen_enqueues_top_configs_at_their_predicted_ceiling(tmp_path: Path) -> None:
    from autotune.study.study import prescreen_enqueue, rows_from_study

    s = _settings(tmp_path, n_trials=10, name="pre")
    sim = SimBackend("4xa100-80gb", "llama-3-8b")
    plan = _plan(100)
    run = run_study(s, sim, plan)
    rows = rows_from_study(run.study)
    picks = prescreen_enqueue(rows, s.space, top_k=2)
    assert 1 <= len(picks) <= 2
    configs = {repr(sorted(p.items())) for p, _ in picks}
    assert len(configs) == len(picks)  # distinct configs
    ceilings = {r.number: r.rate for r in rows}
    for params, attrs in picks:
        assert "request_rate" not in params
        pred = attrs["predicted"]
        assert pred["source"].startswith("simulated")
        # The prediction is the simulated trial's own ceiling.
        assert pred["ceiling_rate"] == ceilings[pred["prescreen_trial"]]
    # Enqueued into the next (real) study they run first, keep the prediction, and
    # the first of them starts its rate search at the predicted ceiling.
    real = _settings(tmp_path, n_trials=3, name="real")
    out = run_study(real, sim, plan, enqueue=picks)
    seeded = [t for t in out.study.get_trials() if "predicted" in t.user_attrs]
    assert len(seeded) == min(2, len(picks))
    assert all(t.number in (1, 2) for t in seeded)  # right after the baseline
    first = seeded[0].user_attrs["result"]
    assert first["start"].startswith(("the pre-screen", "beat the incumbent"))


def test_refine_ceilings_writes_what_the_report_reads(tmp_path: Path) -> None:
    from autotune.report.data import read_ceilings
    from autotune.study.study import refine_ceilings, rows_from_study, top_configs

    s = _settings(tmp_path, n_trials=8, name="ref")
    backend = Recording()
    plan = _plan(300)
    run = run_study(s, backend, plan)
    tops = top_configs(run.rows, top_k=2)
    assert tops and len({repr(sorted(r.flags.items())) for r in tops}) == len(tops)
    backend.prepared.clear()
    restarts = backend.restarts
    seen: list[Any] = []
    probed: list[tuple[int, int]] = []  # what a real proof prints as its tests end
    ceilings = refine_ceilings(rows_from_study(run.study), backend, plan, top_k=2,
                               max_probes=4, out_dir=s.out_dir, on_ceiling=seen.append,
                               on_probe=lambda n, p: probed.append((n, p.index)))
    assert [c.trial for c in ceilings] == [r.number for r in tops] == [c.trial for c in seen]
    assert probed == [(c.trial, p.index) for c in ceilings for p in c.result.probes]
    for c, row in zip(ceilings, tops, strict=True):
        assert c.start_rate == row.rate
        assert c.result.probes[0].rate == pytest.approx(row.rate)  # starts at the trial's rate
        assert c.result.probes[0].verdict in ("pass", "uncertain")  # the trial was feasible
        assert "request_rate" not in c.config
        assert c.path == s.out_dir / f"ceiling-trial-{c.trial}.json"
        assert c.result.search_probes <= 4
    # One server start per config, reused across its probes.
    assert len({repr(sorted(f.items())) for f in backend.prepared}) == len(ceilings)
    assert len(backend.prepared) > len(ceilings)  # several probes per config...
    assert len(ceilings) - 1 <= backend.restarts - restarts <= len(ceilings)  # ...one start
    found = read_ceilings(s.out_dir)
    assert sorted(f["trial"] for f in found) == sorted(c.trial for c in ceilings)
    for f in found:
        assert f["config"] and f["probes"] and f["source"].startswith("simulated")
        assert f["answer"].startswith("simulated: ")


def _view(number: int, value: float, rate: float, seqs: int) -> Any:
    from autotune.analysis.recommend import TrialView

    return TrialView(number=number, flags={"max_num_seqs": seqs}, rate=rate,
                     status="complete", feasible=True, value=value, goodput_tokens=value,
                     goodput_requests=rate, output_throughput=value, p99_e2e_s=5.0,
                     attainment=1.0, gpu_util_pct=None, gpus=1)


def _ceiling(trial: int, top: float, goodput: float) -> dict[str, Any]:
    probe = {"rate": top, "verdict": "pass", "num_prompts": 300,
             "summary": {"goodput_tokens": goodput, "goodput_requests": top,
                         "e2e": {"p99": 9.0}, "attainment": 0.995}}
    fail = {"rate": top * 1.1, "verdict": "fail", "num_prompts": 300, "summary": {}}
    return {"trial": trial, "config": {"max_num_seqs": trial}, "feasible": True,
            "feasible_max": top, "infeasible_min": top * 1.1, "answer": f"sustains {top}",
            "probes": [probe, fail], "source": "simulated (virtual time)"}


def test_apply_ceilings_ranks_on_refined_ceilings() -> None:
    from autotune.analysis.recommend import apply_ceilings

    # Trial 1 looked best at the rate it tried; trial 2's config has the higher ceiling.
    views = [_view(1, 1000.0, 10.0, 64), _view(2, 900.0, 9.0, 128), _view(3, 500.0, 5.0, 32)]
    rec = recommend(views, slo=str(SLO), headroom=0.2)
    assert rec.best.trial == 1
    rec = apply_ceilings(rec, views, [_ceiling(1, 11.0, 1100.0), _ceiling(2, 16.0, 1500.0)])
    assert rec.best.trial == 2 and rec.best.flags == {"max_num_seqs": 128}
    assert rec.best.max_feasible_rate == 16.0 and rec.best.rate == 16.0
    assert rec.best.goodput_tokens == 1500.0 and rec.best.p99_e2e_s == 9.0
    assert rec.rate_cap == pytest.approx(16.0 * 0.8)
    assert rec.best.ceiling["answer"] == "sustains 16.0"
    assert [p.trial for p in rec.next_best][:2] == [1, 3]  # refined first, then the rest
    assert [c["trial"] for c in rec.ceilings] == [1, 2]
    assert rec.to_dict()["best"]["ceiling"]["feasible_max"] == 16.0


def test_apply_ceilings_without_a_feasible_ceiling_keeps_the_trials_but_gives_no_cap(
        ) -> None:
    """The proof showed no level for the screened best: the trials' figures stay for
    the reader, but a cap under the screen's short test would stand on exactly what the
    proof could not show, so there is none, and the files say why."""
    from autotune.analysis.recommend import apply_ceilings, to_markdown

    views = [_view(1, 1000.0, 10.0, 64)]
    rec = recommend(views, slo=str(SLO))
    assert rec.rate_cap == pytest.approx(9.0)
    bad = {**_ceiling(1, 11.0, 1.0), "feasible": False, "feasible_max": None,
           "answer": "not shown to meet the SLO at any rate down to 4 req/s"}
    rec = apply_ceilings(rec, views, [bad])
    assert rec.best.trial == 1 and rec.best.max_feasible_rate == 10.0
    assert rec.rate_cap is None and rec.no_cap is not None and "proof" in rec.no_cap
    assert any("trial 1: not shown" in n for n in rec.notes)
    assert rec.to_dict()["no_cap"] == rec.no_cap
    md = to_markdown(rec)
    assert "**No cap**" in md and "cap at the gateway" not in md


def test_a_config_running_in_another_live_process_is_awaited_not_started_again() -> None:
    import socket
    import threading

    from autotune.study.study import _await_running_twin

    study = optuna.create_study(direction="maximize")
    dist = {"max_num_seqs": optuna.distributions.IntDistribution(1, 8)}

    def running_elsewhere(seqs: int, pid: int) -> optuna.Trial:
        study.enqueue_trial({"max_num_seqs": seqs})
        trial = study.ask(dist)
        for key, value in (("autotune:pid", pid), ("autotune:host", socket.gethostname())):
            study._storage.set_trial_system_attr(trial._trial_id, key, value)
        return trial

    other = subprocess.Popen(["sleep", "60"])  # the live process that runs the twin
    try:
        twin = running_elsewhere(3, other.pid)
        looked = threading.Event()
        real_get = study.get_trials

        def spying_get(*args: Any, **kwargs: Any) -> Any:
            looked.set()  # the waiter has looked and found the twin running
            return real_get(*args, **kwargs)

        def finish_twin() -> None:
            looked.wait(30)
            twin.set_user_attr("result", {"launched": True})
            study.tell(twin, 5.0)

        study.get_trials = spying_get  # type: ignore[method-assign]
        finisher = threading.Thread(target=finish_twin)
        finisher.start()
        answer = _await_running_twin(study, twin.number + 1, {"max_num_seqs": 3}, poll_s=0.01)
        finisher.join()
        assert answer is not None and answer.number == twin.number  # its answer, reused
        assert answer.state == TrialState.COMPLETE
        # A twin whose process has died is not awaited: this trial runs the config.
        orphan = running_elsewhere(7, other.pid)
        other.kill()
        other.wait()
        assert _await_running_twin(study, orphan.number + 1, {"max_num_seqs": 7},
                                   poll_s=0.01) is None
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_a_lower_trial_still_suggesting_is_awaited_until_its_config_is_known() -> None:
    """Two workers start vLLM's defaults at once: the later trial looks while the
    earlier one has not suggested its values yet.  It must wait for them (and then for
    the earlier trial's answer), not start the same config a second time."""
    import socket
    import threading

    from autotune.study.study import CONFIGURED_ATTR, _await_running_twin

    study = optuna.create_study(direction="maximize")
    other = subprocess.Popen(["sleep", "60"])  # the live process that runs the trial

    def asked_elsewhere() -> optuna.Trial:
        trial = study.ask()  # no value suggested yet
        for key, value in (("autotune:pid", other.pid),
                           ("autotune:host", socket.gethostname())):
            study._storage.set_trial_system_attr(trial._trial_id, key, value)
        return trial

    def configure(trial: optuna.Trial, seqs: int) -> None:
        trial.suggest_int("max_num_seqs", seqs, seqs)
        study._storage.set_trial_system_attr(trial._trial_id, CONFIGURED_ATTR, True)

    try:
        early = asked_elsewhere()
        looks = 0
        third_look, done = threading.Event(), threading.Event()
        real_get = study.get_trials

        def spying_get(*args: Any, **kwargs: Any) -> Any:
            nonlocal looks
            looks += 1
            if looks == 3:  # looked twice and waited; now the early trial decides
                third_look.set()
                done.wait(30)
            return real_get(*args, **kwargs)

        def decide_then_finish() -> None:
            if third_look.wait(30):
                configure(early, 3)
                early.set_user_attr("result", {"launched": True})
                study.tell(early, 5.0)
            done.set()

        study.get_trials = spying_get  # type: ignore[method-assign]
        finisher = threading.Thread(target=decide_then_finish)
        finisher.start()
        answer = _await_running_twin(study, early.number + 1, {"max_num_seqs": 3},
                                     poll_s=0.01)
        done.set()
        finisher.join()
        study.get_trials = real_get  # type: ignore[method-assign]
        assert answer is not None and answer.number == early.number  # its answer, reused
        # One that turns out to be another config is not waited for once it says so.
        unlike = asked_elsewhere()
        configure(unlike, 5)
        assert _await_running_twin(study, unlike.number + 1, {"max_num_seqs": 4},
                                   poll_s=0.01) is None
    finally:
        other.kill()
        other.wait()


def test_a_sampled_stepped_float_config_finds_its_twin_despite_binary_noise() -> None:
    """Optuna stores a sampled 0.85 of a 0.05-stepped float as 0.8500000000000001,
    while the space's suggestion (what a trial compares) says 0.85.  Two workers that
    sample such a config must still see one twin: the later trial waits for the
    running one and reuses its answer (the database-restart test of two workers
    evaluated a config twice, 2026-12-07), and a finished one is found as such."""
    import socket
    import threading

    from autotune.study.study import CONFIGURED_ATTR, _await_running_twin, _same_config

    gmu = SearchSpace.load("default").params["gpu_memory_utilization"]
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=1))
    other = subprocess.Popen(["sleep", "60"])  # the live process that runs the twin

    def sampled_elsewhere() -> tuple[optuna.Trial, dict[str, Any]]:
        trial = study.ask()
        params = {gmu.name: gmu.suggest(trial)}
        for key, value in (("autotune:pid", other.pid),
                           ("autotune:host", socket.gethostname()), (CONFIGURED_ATTR, True)):
            study._storage.set_trial_system_attr(trial._trial_id, key, value)
        return trial, params

    try:
        twin, suggested = sampled_elsewhere()
        # The noise this test is about (seed 1 draws 0.85 first).
        assert suggested == {gmu.name: 0.85} and twin.params[gmu.name] != 0.85
        looked, finished = threading.Event(), threading.Event()
        real_get = study.get_trials

        def spying_get(*args: Any, **kwargs: Any) -> Any:
            if looked.is_set():
                finished.wait(30)  # the twin's answer is stored before the next look
            looked.set()  # the waiter has looked once and found the twin running
            return real_get(*args, **kwargs)

        def finish_twin() -> None:
            if looked.wait(30):
                twin.set_user_attr("result", {"launched": True})
                study.tell(twin, 5.0)
            finished.set()

        study.get_trials = spying_get  # type: ignore[method-assign]
        finisher = threading.Thread(target=finish_twin)
        finisher.start()
        answer = _await_running_twin(study, twin.number + 1, suggested, poll_s=0.01)
        finished.set()
        finisher.join()
        study.get_trials = real_get  # type: ignore[method-assign]
        assert answer is not None and answer.number == twin.number  # waited, reused
        assert answer.state == TrialState.COMPLETE
        # Once finished, the same config found by value: 0.85 as a queued config says it.
        found = _same_config(study, twin.number + 1, {gmu.name: 0.85})
        assert found is not None and found.number == twin.number
        assert _same_config(study, twin.number + 1, {gmu.name: 0.9}) is None
    finally:
        other.kill()
        other.wait()


def test_a_lower_trial_read_torn_is_awaited_not_taken_for_another_config() -> None:
    """PostgreSQL hands Optuna a trial's params and its system attrs from separate
    statements (READ COMMITTED), so a look can catch a lower trial that finished
    suggesting in between: the marker that says its config is known, beside only its
    first values.  That is not another config: the later trial looks again, finds its
    twin, and reuses its answer rather than start the same config a second time."""
    import socket

    from optuna.distributions import IntDistribution
    from optuna.trial import FrozenTrial

    from autotune.study.study import CONFIGURED_ATTR, _await_running_twin

    study = optuna.create_study(direction="maximize")
    other = subprocess.Popen(["sleep", "60"])  # the live process that runs the twin
    try:
        twin = study.ask()
        config = {"max_num_seqs": twin.suggest_int("max_num_seqs", 1, 8),
                  "max_num_batched_tokens": twin.suggest_int("max_num_batched_tokens", 1, 8)}
        for key, value in (("autotune:pid", other.pid),
                           ("autotune:host", socket.gethostname()), (CONFIGURED_ATTR, True)):
            study._storage.set_trial_system_attr(twin._trial_id, key, value)
        real = study._storage.get_trial(twin._trial_id)
        torn = FrozenTrial(
            number=real.number, state=TrialState.RUNNING, value=None,
            datetime_start=real.datetime_start, datetime_complete=None,
            params={"max_num_seqs": config["max_num_seqs"]},
            distributions={"max_num_seqs": IntDistribution(1, 8)}, user_attrs={},
            system_attrs=dict(real.system_attrs), intermediate_values={},
            trial_id=real._trial_id)
        looks = 0
        real_get = study.get_trials

        def torn_first(*args: Any, **kwargs: Any) -> Any:
            nonlocal looks
            if kwargs.get("states") != (TrialState.RUNNING,):
                return real_get(*args, **kwargs)  # the look for a finished twin
            looks += 1
            if looks == 1:
                return [torn]
            if looks == 2:  # the twin has finished by the second look
                twin.set_user_attr("result", {"launched": True})
                study.tell(twin, 5.0)
            return real_get(*args, **kwargs)

        study.get_trials = torn_first  # type: ignore[method-assign]
        answer = _await_running_twin(study, twin.number + 1, config, poll_s=0.0)
        assert looks == 2
        assert answer is not None and answer.number == twin.number  # its answer, reused
    finally:
        other.kill()
        other.wait()


def test_a_trial_failed_by_another_process_while_it_runs_does_not_end_the_study(
        tmp_path: Path) -> None:
    """Another process fails a trial of this search as stale (a heartbeat gap longer
    than its grace period) and queues it again: the search says which trial it lost
    and goes on to n_trials, the lost config run again."""
    s = _settings(tmp_path, n_trials=3)
    taken: list[int] = []

    def take_over_first(number: int, probe: Any) -> None:
        if taken:
            return
        there = optuna.load_study(study_name="t", storage=open_storage(s.storage))
        frozen = there.trials[number]
        there._storage.set_trial_state_values(frozen._trial_id, TrialState.FAIL)
        there.enqueue_trial(frozen.params)
        taken.append(number)

    run = run_study(s, SimBackend("4xa100-80gb", "llama-3-8b"), _plan(60),
                    on_probe=take_over_first)
    assert run.taken_over == taken == [0]
    trials = run.study.get_trials()
    assert trials[0].state == TrialState.FAIL
    counted = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(counted) == 3 and run.new_trials == 3
    assert any(t.params == trials[0].params for t in counted)


def test_a_small_categorical_space_is_covered_before_any_config_repeats(
        tmp_path: Path) -> None:
    """Four configs and four trials: each is tried once (TPE's start-up draws repeat a
    tiny space), the defaults first; a rule-breaking config is never queued."""
    space = {**SPACE, "parameters": {
        "tensor_parallel_size": {"type": "categorical", "choices": [1, 4]},
        "max_num_batched_tokens": {"type": "categorical", "choices": [2048, 8192]},
        "request_rate": {"type": "float", "low": 2.0, "high": 60.0, "log": True}},
        "baseline": {"tensor_parallel_size": 1, "max_num_batched_tokens": 8192}}
    s = _settings(tmp_path, n_trials=4, screen=True,
                  space=SearchSpace.from_dict(space, source="four.yaml"))
    run = run_study(s, Recording(), _plan())
    tried = [(t.params["tensor_parallel_size"], t.params["max_num_batched_tokens"])
             for t in run.study.get_trials()]
    assert tried[0] == (1, 8192)
    assert sorted(tried) == [(1, 2048), (1, 8192), (4, 2048), (4, 8192)]


def test_screening_trials_are_short_and_rank_on_point_estimates(tmp_path: Path) -> None:
    """A screening study: every trial's ceiling search is at most 4 tests of at least
    20 s (not the full rule's 60 s), and each passing test is a screening pass."""
    s = _settings(tmp_path, n_trials=3, screen=True)
    run = run_study(s, Recording(), _plan(400))
    probes = [p for t in run.study.get_trials() if "result" in t.user_attrs
              for p in (t.user_attrs["result"].get("ceiling") or {}).get("probes", [])]
    timed = [p for p in probes if p.get("evidence")]
    assert timed and all(p["evidence"]["min_duration_s"] == 20.0 for p in timed)
    for t in run.study.get_trials():
        ceiling = (t.user_attrs.get("result") or {}).get("ceiling") or {}
        assert ceiling.get("search_probes", 0) <= 4
