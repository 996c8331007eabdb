from __future__ import annotations

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

from autotune.recommend import recommend, view_from_row
from autotune.slo import parse_slo
from autotune.space import SearchSpace
from autotune.study import (
    RUNS_KEY,
    StudyError,
    StudySettings,
    make_sampler,
    open_storage,
    run_study,
    storage_url,
)
from autotune.trial import LoadPlan, SimBackend
from autotune.workload import Request

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
    # Rule-breaking configs (TP=3 does not divide 32 heads; TP=8 > 4 GPUs) never started.
    launched_tp = {f["tensor_parallel_size"] for f in backend.prepared}
    assert not launched_tp & {3, 8}
    broken = [t for t in trials if t.params["tensor_parallel_size"] in (3, 8)]
    for t in broken:
        assert t.user_attrs["result"]["launched"] is False
        assert t.user_attrs["reason"] in ("tp_divides_heads", "tp_fits_gpus")
        assert t.constraints[RUNS_KEY] == 1.0
    for t in trials:
        if (not t.params["enable_chunked_prefill"] and t.params["max_num_batched_tokens"] < 8192
                and t.params["tensor_parallel_size"] in (1, 2, 4)):
            assert t.user_attrs["reason"] == "batched_tokens_cover_model_len"
    # Pruned trials say which rule fired and when.
    for t in trials:
        if t.state == TrialState.PRUNED:
            prune = t.user_attrs["result"]["prune"]
            assert prune["rule"] in ("certain_violation", "unbounded_backlog")
            assert 0 < prune["at_s"] <= t.user_attrs["result"]["planned_s"] + 60
    views = [view_from_row(t.number, t.user_attrs, value=t.value, state=t.state.name,
                           baseline=bool(t.user_attrs.get("baseline")), params=t.params)
             for t in trials]
    rec = recommend(views, slo=str(SLO))
    best = next(t for t in trials if t.number == rec.best.trial)
    assert best.user_attrs["result"]["feasible"] is True
    assert all(v <= 0 for v in best.constraints.values())
    assert rec.baseline is not None and rec.baseline.number == 0
    if rec.baseline.feasible:
        assert rec.best.value >= rec.baseline.value
    assert rec.rate_cap == pytest.approx(0.9 * rec.best.max_feasible_rate, abs=0.01)
    assert rec.best.command.startswith("vllm serve meta-llama/Meta-Llama-3-8B-Instruct")
    records = list((tmp_path / "studies" / "t" / "records").glob("trial-*.jsonl"))
    assert records


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


def test_budget_stops_the_study(tmp_path: Path) -> None:
    s = _settings(tmp_path, n_trials=50, budget_s=60.0)  # 60 virtual seconds of server
    run = run_study(s, SimBackend("4xa100-80gb", "llama-3-8b"), _plan(100))
    assert run.stopped_by == "budget"
    assert run.new_trials < 50


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
    with pytest.raises(StudyError, match="cannot open storage"):
        open_storage("nosuchdb://localhost/x")


def test_killed_study_resumes_without_losing_finished_trials(tmp_path: Path) -> None:
    """kill -9 in the middle of a study: finished trials survive, the stale RUNNING
    trial is marked failed, and the same command continues."""
    studies = tmp_path / "studies"
    cmd = [sys.executable, "-c", "from autotune.cli import main; main()", "search",
           "--slo-p99", "10s", "--space", "llama3-8b-4xa100", "--study-name", "k",
           "--studies-dir", str(studies), "--num-prompts", "150", "--warmup", "10",
           "--n-trials", "400"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    storage = f"sqlite:///{studies / 'k.db'}"
    try:
        deadline = time.monotonic() + 60
        finished: dict[int, float | None] = {}
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if not (studies / "k.db").exists():
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
    study = optuna.load_study(study_name="k", storage=storage)
    finished = {t.number: t.value for t in study.get_trials()
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    assert len(finished) >= 4
    target = len(finished) + 2
    resume = cmd[:-1] + [str(target)]
    out = subprocess.run(resume, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
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
    from autotune.study import prescreen_enqueue, rows_from_study

    s = _settings(tmp_path, n_trials=10, name="pre")
    sim = SimBackend("4xa100-80gb", "llama-3-8b")
    plan = _plan(100)
    run = run_study(s, sim, plan)
    picks = prescreen_enqueue(rows_from_study(run.study, s.space), s.space, sim, plan, top_k=2)
    assert 1 <= len(picks) <= 2
    configs = {repr(sorted((k, v) for k, v in p.items() if k != "request_rate"))
               for p, _ in picks}
    assert len(configs) == len(picks)  # distinct configs
    for params, attrs in picks:
        pred = attrs["predicted"]
        assert pred["source"].startswith("simulated")
        assert pred["ceiling_rate"] is not None
        assert params["request_rate"] <= pred["ceiling_rate"] + 1e-9
        assert 2.0 <= params["request_rate"] <= 60.0
    # Enqueued into the next (real) study they run first and keep the prediction.
    real = _settings(tmp_path, n_trials=3, name="real")
    out = run_study(real, sim, plan, enqueue=picks)
    seeded = [t for t in out.study.get_trials() if "predicted" in t.user_attrs]
    assert len(seeded) == min(2, len(picks))
    assert all(t.number in (1, 2) for t in seeded)  # right after the baseline


def test_ceiling_probe_reuses_the_runner() -> None:
    from autotune.ceiling import ProbeResult
    from autotune.trial import ceiling_probe

    sim = SimBackend("4xa100-80gb", "llama-3-8b")
    flags = {"model": "m", "tensor_parallel_size": 1, "max_num_seqs": 256}
    run = ceiling_probe(sim, flags, _plan(400))
    low, high = run(2.0, 150), run(50.0, 400, repeat=1)
    assert isinstance(low, ProbeResult) and low.summary.num_measured == 150
    assert high.summary.num_measured == 400
    assert low.summary.slo_check.met and not low.pruned
    assert high.pruned and high.prune_reason in ("certain_violation", "unbounded_backlog")
    assert 0 < low.gpu_util <= 1 and low.server_s > 0
    assert sim.restarts == 1  # same flags: the simulated server was reused
