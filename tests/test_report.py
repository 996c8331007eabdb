"""Reports: every plot renders, the pages are valid and hold the trial figures, bad
input says what is wrong."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image as mpimg
import optuna
import pytest
from typer.testing import CliRunner

from autotune.analysis.pareto import front
from autotune.cli import app
from autotune.report import ReportError, gather, write_report
from autotune.report.build import closest_row, replica_results
from autotune.report.data import read_timeline
from autotune.report.sample import make_sample_study

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = {"rate_curves", "history", "pareto", "importances", "timeline"}

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> tuple[str, Path]:
    d = tmp_path_factory.mktemp("study")
    storage = f"sqlite:///{d}/sample.db"
    make_sample_study(storage, "sample")
    make_sample_study(storage, "hopeless", feasible=False, telemetry=False)
    optuna.create_study(study_name="empty", storage=storage)
    return storage, d


@pytest.fixture(scope="module")
def report(sample, tmp_path_factory):
    storage, _ = sample
    out = tmp_path_factory.mktemp("out")
    return write_report("sample", storage, out)


class Collect(HTMLParser):
    """Collects tags, img srcs and text; fails on unbalanced tables/figures."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.imgs: list[str] = []
        self.text: list[str] = []
        self.cells: list[str] = []
        self._in_cell = False

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])
        if tag not in self.VOID:
            self.stack.append(tag)
        self._in_cell = tag in ("td", "th")

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"unbalanced </{tag}> in {self.stack}"
        self.stack.pop()
        self._in_cell = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_cell:
            self.cells.append(data.strip())


def parse(path: Path) -> Collect:
    p = Collect()
    p.feed(path.read_text(encoding="utf-8"))
    p.close()
    assert p.stack == [], f"unclosed tags {p.stack}"
    return p


def test_every_plot_is_a_valid_png(report):
    assert set(report.plots) == PLOTS
    for path in report.plots.values():
        assert path.read_bytes()[:8] == PNG
        img = mpimg.imread(path)
        assert img.shape[0] > 200 and img.shape[1] > 400


def test_html_is_valid_and_shows_every_plot(report):
    page = parse(report.html)
    assert sorted(Path(s).stem for s in page.imgs) == sorted(PLOTS)
    for src in page.imgs:
        assert (report.out_dir / src).is_file()
    text = " ".join(page.text)
    assert "SIMULATED" in text and "backend sim" in text and "a100-80gb" in text
    # The serve line wraps rather than scrolling, with a button that copies it.
    html = report.html.read_text()
    assert "white-space: pre-wrap" in html and "overflow-x" not in html
    assert '<button class="copy"' in html and "clipboard.writeText" in html


def test_tables_hold_the_trial_figures(report, sample):
    storage, _ = sample
    data = gather("sample", storage)
    page = parse(report.html)
    md = report.markdown.read_text()
    best = max(data.feasible, key=lambda r: r["value"])
    assert best["trial"] == 4
    # The trial table shows each trial's goodput, P99 and reason as printed figures.
    for r in data.rows:
        if r["feasible"]:
            assert f"{r['goodput_tokens']:,.1f}" in page.cells
            assert f"{r['goodput_tokens']:,.1f}" in md
        if r.get("e2e_p99_s") is not None:
            assert f"{r['e2e_p99_s']:.2f}" in page.cells
    assert any("tp_fits_gpus" in c for c in page.cells)
    assert not any("tp_fits_gpus: tp_fits_gpus" in c for c in page.cells)  # named once
    assert any(c.startswith("backlog") for c in page.cells)
    # The recommendation names the best trial, its cap and the baseline comparison.
    assert "| trial | 4 |" in md and "| rate cap with 10% headroom (req/s) | 19.8 |" in md
    assert "vs vLLM defaults (baseline)" in md
    # Compared on the same GPUs too: the defaults as replicas on the recommendation's 4.
    assert "| vs vLLM defaults on equal GPUs | on 4 GPUs, vLLM's defaults run as" in md
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 vllm serve" in md
    csv_text = report.trials_csv.read_text()
    assert csv_text.count("\n") == len(data.rows) + 1


def test_no_feasible_trial_still_renders_and_says_so(sample, tmp_path):
    storage, _ = sample
    paths = write_report("hopeless", storage, tmp_path)
    md = paths.markdown.read_text()
    assert "Nothing met the SLO (p99:e2e<=1s)" in md
    data = gather("hopeless", storage)
    closest = closest_row(data)
    assert f"Closest trial: #{closest['trial']}" in md
    # It is the trial with the smallest worst margin of all that ran.
    worst = [max(r["margins"].values()) for r in data.rows if r["margins"]]
    assert max(closest["margins"].values()) == min(worst)
    assert "timeline" not in paths.plots or paths.plots["timeline"].exists()
    parse(paths.html)
    for p in paths.plots.values():
        assert p.read_bytes()[:8] == PNG


def test_unknown_and_empty_studies_and_missing_database(sample, tmp_path):
    storage, d = sample
    with pytest.raises(ReportError, match=r"no study named 'nope'.*empty, hopeless, sample"):
        write_report("nope", storage, tmp_path / "a")
    with pytest.raises(ReportError, match="has no finished trials yet"):
        write_report("empty", storage, tmp_path / "b")
    missing = tmp_path / "missing.db"
    with pytest.raises(ReportError, match="no study database at"):
        write_report("x", f"sqlite:///{missing}", tmp_path / "c")
    assert not missing.exists()  # never created as a side effect
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_too_few_trials_for_importances_gives_a_note(sample, tmp_path):
    storage, _ = sample
    few = f"sqlite:///{tmp_path}/few.db"
    study = optuna.create_study(study_name="few", storage=few, direction="maximize")
    for t in optuna.load_study(study_name="sample", storage=storage).get_trials()[:2]:
        study.add_trial(t)
    paths = write_report("few", few, tmp_path / "out")
    assert "importances" not in paths.plots
    assert any("need at least 4 completed trials" in n for n in paths.notes)
    assert "need at least 4 completed trials" in paths.markdown.read_text()
    assert "importances.png" not in paths.html.read_text()


def test_importances_need_varying_values(sample, tmp_path):
    storage, _ = sample
    paths = write_report("hopeless", storage, tmp_path)
    assert "importances" not in paths.plots
    assert any("same objective value" in n for n in paths.notes)


def test_replica_results_and_ceiling_files(sample, tmp_path):
    storage, _ = sample
    data = gather("sample", storage)
    by_trial = {r.trial: r for r in replica_results(data)}
    assert set(by_trial) == {r["trial"] for r in data.feasible}
    assert by_trial[4].ceiling_rate == 22.0 and by_trial[4].tensor_parallel_size == 4
    # A ceiling search on trial 4's config moves its ceiling and goodput.
    cfg = data.rows[4]["config"]
    ceiling = {"answer": "simulated: sustains 25 req/s", "source": "simulated",
               "feasible_max": 25.0, "infeasible_min": 26.0, "recommended_cap": 22.5,
               "config": cfg, "probes": [
                   {"index": 0, "rate": 25.0, "num_prompts": 200, "phase": "bisect",
                    "verdict": "pass", "binding": "p99:e2e", "request_throughput": 9.0,
                    "output_throughput": 1800.0, "num_measured": 200, "pruned": False,
                    "prune_reason": None, "gpu_util": 0.97, "checks": [],
                    "summary": {"goodput_tokens": 1800.0, "e2e": {"p99": 9.1}}},
                   {"index": 1, "rate": 26.0, "num_prompts": 200, "phase": "bisect",
                    "verdict": "fail", "binding": "p99:e2e", "request_throughput": 8.0,
                    "output_throughput": 1700.0, "num_measured": 90, "pruned": True,
                    "prune_reason": "certain_violation", "gpu_util": 0.99, "checks": []}]}
    (tmp_path / "ceiling.json").write_text(json.dumps(ceiling))
    data = gather("sample", storage, tmp_path)
    r4 = {r.trial: r for r in replica_results(data)}[4]
    assert (r4.ceiling_rate, r4.goodput_tokens, r4.goodput_requests) == (25.0, 1800.0, 9.0)
    paths = write_report("sample", storage, tmp_path)
    md = paths.markdown.read_text()
    assert "simulated: sustains 25 req/s" in md and "certain_violation" in md
    assert "| ceiling (req/s) | 25 |" in md
    # A probe's utilisation (stored as 0..1) is shown in percent, as everywhere else.
    probe_rows = [line for line in md.splitlines() if "| bisect |" in line]
    assert probe_rows and "| 97% |" in probe_rows[0] and "| 1% |" not in probe_rows[0]


def test_imported_vllm_results_sit_on_the_same_plot(sample, tmp_path):
    storage, _ = sample
    f = tmp_path / "vllm.json"
    f.write_text(json.dumps({"date": "20250101-000000", "backend": "openai", "label": "old",
                             "request_rate": 12.0, "completed": 100, "failed": 0,
                             "duration": 10.0, "request_throughput": 10.0,
                             "output_throughput": 1500.0, "total_token_throughput": 2500.0,
                             "p99_ttft_ms": 400.0, "median_ttft_ms": 100.0}))
    result = CliRunner().invoke(app, ["report", "sample", "--storage", storage, "--out",
                                      str(tmp_path / "r"), "--import", str(f)])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Imported vllm bench serve results" in md and "vllm:old" in md
    result = CliRunner().invoke(app, ["report", "--vllm-results", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plots" / "vllm_rate_curves.png").read_bytes()[:8] == PNG


def test_cli_errors_are_one_line(sample, tmp_path):
    storage, _ = sample
    r = CliRunner().invoke(app, ["report", "nope", "--storage", storage])
    assert r.exit_code == 2 and "no study named 'nope'" in r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, ["report", "sample", "--storage", storage, "--import",
                                 str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "no such vLLM result file" in r.output
    r = CliRunner().invoke(app, ["report"])
    assert r.exit_code == 2 and "give a STUDY name" in r.output


def test_recommend_cli_prints_plan_and_snippets(sample, tmp_path):
    storage, _ = sample
    out = tmp_path / "plan.md"
    r = CliRunner().invoke(app, ["recommend", "sample", "--storage", storage, "--gpus", "8",
                                 "--gpu-hour-cost", "2.5", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "TP=1 x DP=8" in r.output  # 8 x 846 tok/s beats 2 x 1750 on 8 GPUs
    assert "CUDA_VISIBLE_DEVICES=7 vllm serve" in r.output and "--port 8007" in r.output
    assert "limit_req_zone" in r.output and "rate=2592r/m" in r.output
    assert "tokens_per_fill" in r.output and "per million output tokens" in r.output
    assert out.read_text().startswith("# Deployment plan: sample")
    r = CliRunner().invoke(app, ["recommend", "hopeless", "--storage", storage, "--gpus", "4"])
    assert r.exit_code == 2 and "nothing in study 'hopeless' met the SLO" in r.output
    r = CliRunner().invoke(app, ["recommend", "sample", "--storage", storage, "--gpus", "2",
                                 "--headroom", "1.5"])
    assert r.exit_code == 2 and "--headroom" in r.output


def test_pareto_front_and_timeline_are_pure():
    pts = [(5.0, 100.0), (6.0, 90.0), (7.0, 150.0), (8.0, 150.0), (9.0, 200.0)]
    assert front(pts, lower_x=True) == [(5.0, 100.0), (7.0, 150.0), (9.0, 200.0)]
    row = {"telemetry": {"timeline": [{"t_s": 10.0, "kv_cache_usage": 0.5},
                                      {"t_s": 11.0, "kv_cache_usage": 0.75}],
                         "gpu_samples": [{"t_s": 3.0, "util_pct": 80}]},
           "windows": [[100.0, 4, 1], [101.0, 6, 2]]}
    s = read_timeline(row)
    assert s["kv_cache_usage_pct"] == [(0.0, 50.0), (1.0, 75.0)]
    assert s["gpu_util_pct"] == [(0.0, 80.0)] and s["in_flight"] == [(0.0, 4.0), (1.0, 6.0)]


def test_report_of_a_real_search_on_the_sim_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    studies = tmp_path / "studies"
    r = CliRunner().invoke(app, ["search", "--slo-p99", "10s", "--n-trials", "8",
                                 "--num-prompts", "80", "--warmup", "10", "--study-name",
                                 "simrep", "--studies-dir", str(studies), "--refine-top",
                                 "1"])
    assert r.exit_code == 0, r.output
    # Every phase's time is said, not only the study's.
    phases = r.output.split("wall time by phase: ", 1)[1].splitlines()[0]
    for phase in ("study", "proof", "validation", "report"):
        assert f"{phase} " in phases, phases
    r = CliRunner().invoke(app, ["report", "simrep", "--storage",
                                 f"sqlite:///{studies}/simrep.db"])
    assert r.exit_code == 0, r.output
    out = Path("studies") / "simrep"  # the default --out
    paths_html = out / "report.html"
    page = parse(paths_html)
    assert {"rate_curves", "history", "pareto", "timeline"} <= {Path(s).stem
                                                                 for s in page.imgs}
    for src in page.imgs:
        assert (out / src).read_bytes()[:8] == PNG
    md = (out / "report.md").read_text()
    assert "SIMULATED (simulated (virtual time))" in md and "backend sim" in md
    data = gather("simrep", f"sqlite:///{studies}/simrep.db")
    best = max(data.feasible, key=lambda x: x["value"])
    assert f"| trial | {best['trial']} |" in md
    assert f"{best['goodput_tokens']:,.1f}" in page.cells
    # The search appended one experiments.csv row per load test; pandas reads them all.
    import optuna
    import pandas as pd

    df = pd.read_csv(out / "experiments.csv")
    study = optuna.load_study(study_name="simrep", storage=f"sqlite:///{studies}/simrep.db")
    probes = {t.number: len(t.user_attrs["result"]["ceiling"]["probes"]) for t in study.trials
              if (t.user_attrs.get("result") or {}).get("ceiling")
              and "repeat_of" not in t.user_attrs["result"]}
    trial_rows = df[df["purpose"] == "trial"]
    assert len(trial_rows) == sum(probes.values()) > len(probes)  # every trial's probe
    assert trial_rows.groupby("trial").size().to_dict() == probes
    # ... and every other load test, with what it was for.
    assert set(df["purpose"]) == {"trial", "refinement", "validation"}
    rec = json.loads((out / "recommendation.json").read_text())
    assert (df["purpose"] == "validation").sum() == len(rec["validation"]["runs"])
    # The report's source line counts the trials' load tests, not one per trial.
    assert f"study simrep: {sum(probes.values())} load tests, warm-up excluded" in md


def test_importances_count_every_finished_config_and_say_so(report):
    # Infeasible and pruned configs count as 0 goodput rather than vanish: 10 finished
    # trials, of which 6 met the SLO.
    note = "parameter importances over 10 finished trials: 6 met the SLO"
    assert any(note in n for n in report.notes)
    assert "importances" in report.plots


def test_legends_sit_outside_the_plot_area():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from autotune.report import plots

    fig, ax = plt.subplots()
    for i in range(5):  # points everywhere a legend inside the axes could go
        ax.plot([0, 1, 2], [i, i + 1, i + 2], "o", label=f"config {i}")
    box = plots.legend(ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    drawn, area = box.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert drawn.x0 >= area.x1  # right of the plot area: it hides no point
    plt.close(fig)
