"""experiments.csv: fixed columns, append-only, safe with concurrent writers; trackers."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from autotune.core.metrics import summarize
from autotune.core.slo import parse_slo
from autotune.report.sample import synthetic_records
from autotune.study.experiments import (
    COLUMNS,
    ExperimentsError,
    append_experiment,
    format_row,
    header_line,
    read_experiments,
    row_from_summary,
)


def test_row_is_in_fixed_column_order_with_config_as_json():
    line = format_row({"trial": 3, "rate": 2.5, "study": "s",
                       "config_json": {"max_num_seqs": 64, "new_flag": True}})
    cells = next(iter(pd.read_csv(pd.io.common.StringIO(header_line() + line)).itertuples()))
    assert cells.trial == 3 and cells.rate == 2.5 and cells.study == "s"
    assert '"new_flag":true' in cells.config_json
    assert header_line().strip().split(",") == list(COLUMNS)


def test_unknown_column_is_refused():
    with pytest.raises(ExperimentsError, match="unknown experiments.csv column"):
        format_row({"goodput": 1.0})


def test_append_writes_header_once_and_never_rewrites(tmp_path: Path):
    path = tmp_path / "sub" / "experiments.csv"
    append_experiment(path, {"trial": 0, "config_json": {"a": 1}})
    first = path.read_bytes()
    # A config with a flag earlier rows lack: same header, rows still line up.
    append_experiment(path, {"trial": 1, "config_json": {"a": 1, "b": "x,y"},
                             "max_num_seqs": 128})
    assert path.read_bytes().startswith(first)
    df = read_experiments(path)
    assert list(df.columns) == list(COLUMNS)
    assert df["trial"].tolist() == [0, 1]
    assert df["max_num_seqs"].isna().tolist() == [True, False]


def test_foreign_header_is_not_appended_to(tmp_path: Path):
    path = tmp_path / "experiments.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ExperimentsError, match="header"):
        append_experiment(path, {"trial": 0})
    assert path.read_text() == "a,b\n1,2\n"


def test_row_from_summary_carries_the_load_test_figures():
    slo = parse_slo("10s")
    s = summarize(synthetic_records(5.0, 10.0, n=60), slo=slo, offered_rate=5.0,
                  source="simulated (virtual time)")
    row = row_from_summary(s.to_dict(), study="st", trial=7,
                           config={"tensor_parallel_size": 2, "max_num_seqs": 64},
                           backend="sim", gpu={"util_mean_pct": 55.0, "util_max_pct": 90.0})
    assert row["e2e_p99_s"] == pytest.approx(s.e2e.p99)
    assert row["goodput_tokens"] == pytest.approx(s.goodput_tokens)
    assert row["tensor_parallel_size"] == 2 and row["meets_slo"] is True
    assert row["pruned"] is False and row["gpu_util_max_pct"] == 90.0
    format_row(row)  # every key is a known column


WRITER = """
import sys
from autotune.study.experiments import append_experiment
path, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
pad = "x" * 3000  # long rows: a torn write would show
for i in range(n):
    append_experiment(path, {"study": who, "trial": i, "rate": float(i),
                             "config_json": {"who": who, "pad": pad, "i": i}})
"""


def test_two_concurrent_writers_tear_no_row(tmp_path: Path):
    path = tmp_path / "experiments.csv"
    n = 300
    root = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, str(n)],
                              cwd=root, env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"})
             for who in ("a", "b")]
    try:
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = path.read_text()
    assert text.count(header_line()) == 1
    df = read_experiments(path)
    assert len(df) == 2 * n
    for who in ("a", "b"):
        mine = df[df["study"] == who]
        assert sorted(mine["trial"]) == list(range(n))
        assert all(f'"who":"{who}"' in c for c in mine["config_json"])
    assert (df["rate"] == df["trial"].astype(float)).all()


# ----------------------------------------------------------------------------- trackers


def test_missing_tracker_package_says_how_to_install(monkeypatch):
    from autotune.report import trackers

    monkeypatch.setitem(sys.modules, "wandb", None)  # import raises ImportError
    with pytest.raises(trackers.TrackerUnavailable) as e:
        trackers.make_trackers(wandb_project="p")
    assert str(e.value) == "wandb is not installed: pip install wandb"
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(trackers.TrackerUnavailable, match="pip install mlflow"):
        trackers.make_trackers(mlflow_uri="file:///tmp/x")
    assert trackers.make_trackers() == []


def test_trackers_log_each_load_test_through_the_package_api(monkeypatch):
    from autotune.report import trackers

    calls: list[tuple] = []

    class Run:
        def log(self, data, step):
            calls.append(("wandb.log", step, data))

        def finish(self):
            calls.append(("wandb.finish",))

    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = lambda **kw: calls.append(("wandb.init", kw)) or Run()
    fake_mlflow = types.ModuleType("mlflow")
    fake_mlflow.set_tracking_uri = lambda uri: calls.append(("mlflow.uri", uri))
    fake_mlflow.set_experiment = lambda name: calls.append(("mlflow.exp", name))

    class RunCtx:
        def __enter__(self):
            calls.append(("mlflow.start",))

        def __exit__(self, *a):
            calls.append(("mlflow.end",))

    fake_mlflow.start_run = lambda run_name: RunCtx()
    fake_mlflow.log_params = lambda p: calls.append(("mlflow.params", p))
    fake_mlflow.log_metrics = lambda m: calls.append(("mlflow.metrics", m))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow)

    ts = trackers.make_trackers(wandb_project="proj", mlflow_uri="file:///tmp/ml")
    row = {"study": "s", "trial": 2, "rate": 3.0, "goodput_tokens": 120.5, "pruned": False,
           "e2e_p99_s": float("inf"), "config_json": {"max_num_seqs": 64}}
    for t in ts:
        t.log(row)
        t.close()
    init = next(c for c in calls if c[0] == "wandb.init")
    assert init[1]["project"] == "proj"
    logged = next(c for c in calls if c[0] == "wandb.log")
    assert logged[2]["goodput_tokens"] == 120.5 and logged[2]["config/max_num_seqs"] == 64
    assert "e2e_p99_s" not in logged[2]  # inf is not chartable
    metrics = next(c for c in calls if c[0] == "mlflow.metrics")[1]
    assert metrics["rate"] == 3.0 and metrics["trial"] == 2.0
    assert ("mlflow.uri", "file:///tmp/ml") in calls and ("wandb.finish",) in calls
