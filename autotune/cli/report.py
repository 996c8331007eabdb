"""``autotune report`` (pages and plots of a study) and ``autotune recommend`` (a
deployment plan for N GPUs with gateway rate-limit snippets)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from autotune.cli._app import app
from autotune.cli._common import UsageError, fail, one_line_errors
from autotune.core.terminal import console, err_console


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """One line for the user-facing errors of the report modules too."""
    # The report modules (matplotlib, the study's storage) load only when `report` or
    # `recommend` runs: every `autotune` start registers every command.
    from autotune.analysis.deploy import DeployError
    from autotune.analysis.vllm_results import VllmResultError
    from autotune.report.trackers import TrackerUnavailable
    from autotune.study.experiments import ExperimentsError

    with one_line_errors():
        try:
            yield
        except (DeployError, ExperimentsError, TrackerUnavailable, VllmResultError) as exc:
            raise fail(str(exc).splitlines()[0]) from None


def _imports(files: list[Path] | None, folder: Path | None) -> list[dict]:
    from autotune.analysis.vllm_results import read_vllm_rows  # loads when the command runs

    rows: list[dict] = []
    for f in files or []:
        rows += read_vllm_rows(f)
    if folder is not None:
        rows += read_vllm_rows(folder)
    return rows


@app.command("report")
def report(
    study: Annotated[str | None, typer.Argument(
        help="Study name (omit with --vllm-results to plot imported results alone).")] = None,
    storage: Annotated[str | None, typer.Option(
        help="Optuna storage URL (default sqlite:///studies/<name>.db).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--output", "--out",
        help="Folder for report.html, report.md and plots (default studies/<name>/).")] = None,
    import_: Annotated[list[Path] | None, typer.Option(
        "--import", help="A `vllm bench serve --save-result` JSON to plot with the "
                         "trials (repeatable).")] = None,
    vllm_results: Annotated[Path | None, typer.Option(
        help="A folder of `vllm bench serve` result JSON files to plot.")] = None,
    wandb: Annotated[str | None, typer.Option(
        help="Also log every load test of the study to this wandb project.")] = None,
    mlflow: Annotated[str | None, typer.Option(
        help="Also log every load test of the study to this MLflow tracking URI.")] = None,
) -> None:
    """Write report.html and report.md (with PNG plots) for a study."""
    with _errors():
        imported = _imports(import_, vllm_results)
        trackers = _trackers(wandb, mlflow)
        if study is None:
            if not imported:
                raise UsageError("give a STUDY name, or --vllm-results DIR / --import FILE "
                                 "to plot vllm bench serve results alone")
            # Loads when the command runs.
            from autotune.report.imported import write_imported_report

            folder = out or (vllm_results if vllm_results is not None else Path("."))
            paths = write_imported_report(imported, folder)
        else:
            from autotune.report import write_report  # loads when the command runs

            paths = write_report(study, storage, out, imported=imported)
            if trackers:
                _log_study(study, storage, trackers)
    console.print(f"report: {paths.html}")
    console.print(f"markdown: {paths.markdown}")
    for name, path in paths.plots.items():
        console.print(f"  plot {name}: {path}")
    for note in paths.notes:
        err_console.print(f"note: {note}")


def _trackers(wandb: str | None, mlflow: str | None) -> list:
    if not wandb and not mlflow:
        return []
    from autotune.report.trackers import make_trackers  # loads when the command runs

    return make_trackers(wandb_project=wandb, mlflow_uri=mlflow)


def _log_study(study: str, storage: str | None, trackers: list) -> None:
    from autotune.report import gather  # loads when the command runs
    from autotune.study.experiments import COLUMNS

    data = gather(study, storage)
    for row in data.rows:
        if row.get("num_measured"):
            flat = {k: row.get(k) for k in COLUMNS if k in row}
            for t in trackers:
                t.log(flat)
    for t in trackers:
        t.close()
    console.print(f"logged {sum(1 for r in data.rows if r.get('num_measured'))} load tests "
                  f"to {', '.join(t.name for t in trackers)}")


@app.command("recommend")
def recommend(
    study: Annotated[str, typer.Argument(help="Study name.")],
    gpus: Annotated[int | None, typer.Option(
        help="GPUs to deploy on (default: the study's --gpus).")] = None,
    gpu_hour_cost: Annotated[float | None, typer.Option(
        help="Price of one GPU-hour, for the cost per million output tokens.")] = None,
    headroom: Annotated[float, typer.Option(
        help="Cap this fraction under the ceiling (0.1 = 10%).")] = 0.1,
    storage: Annotated[str | None, typer.Option(
        help="Optuna storage URL (default sqlite:///studies/<name>.db).")] = None,
    model: Annotated[str | None, typer.Option(
        help="Model for `vllm serve` (default: the study's config).")] = None,
    burst_seconds: Annotated[float, typer.Option(
        help="Gateway burst: this many seconds of the cap.")] = 1.0,
    base_port: Annotated[int, typer.Option(help="Port of the first replica.")] = 8000,
    out: Annotated[Path | None, typer.Option(
        "--output", "--out",
        help="Also write the plan as Markdown to this file.")] = None,
    tier_gpus: Annotated[list[str] | None, typer.Option(
        "--tier-gpus", help="Put a tier of the search's --tier on its own replicas: "
                            "NAME=GPUS (repeatable), e.g. interactive=4.")] = None,
) -> None:
    """Lay out N GPUs as TP x DP for the highest total goodput under the SLO.

    Prints the layout's rate cap, cost, `vllm serve` commands and gateway snippets."""
    with _errors():
        from autotune.analysis.deploy import (  # loads when the command runs
            DeployError,
            envoy_snippet,
            nginx_snippet,
            plan_deployment,
            plan_text,
        )
        from autotune.report import gather  # loads when the command runs
        from autotune.report.build import provenance, replica_results

        # Every number is checked before the study is read: a typo should not cost a
        # database round trip, nor be hidden behind "no such study".
        if burst_seconds <= 0:
            raise UsageError(f"--burst-seconds must be > 0, got {burst_seconds:g}")
        if gpus is not None and gpus < 1:
            raise UsageError(f"--gpus must be >= 1, got {gpus}")
        if not 0 <= headroom < 1:
            raise UsageError(f"--headroom must be in [0, 1), got {headroom:g}")
        if gpu_hour_cost is not None and not gpu_hour_cost >= 0:
            raise UsageError(f"--gpu-hour-cost must be >= 0, got {gpu_hour_cost:g}")
        if not 1 <= base_port <= 65535:
            raise UsageError(f"--base-port must be a TCP port (1-65535), got {base_port}")
        data = gather(study, storage)
        if tier_gpus:
            _tier_plans(study, data, tier_gpus, gpus=gpus, headroom=headroom,
                        gpu_hour_cost=gpu_hour_cost, model=model, base_port=base_port,
                        burst_seconds=burst_seconds, out=out)
            return
        n = gpus if gpus is not None else data.attrs.get("gpus")
        if not n:
            raise UsageError("the study does not record its GPU count: pass --gpus N")
        results = replica_results(data)
        if not results:
            raise DeployError(f"nothing in study {study!r} met the SLO ({data.slo}): "
                              "there is no config to deploy; see `autotune report "
                              f"{study}` for the closest trial")
        plan = plan_deployment(results, int(n), headroom=headroom,
                               gpu_hour_cost=gpu_hour_cost, model=model, base_port=base_port)
        text = plan_text(plan, how=provenance(data))
        nginx = nginx_snippet(plan.total_cap, plan.replicas, burst_seconds=burst_seconds)
        envoy = envoy_snippet(plan.total_cap, burst_seconds=burst_seconds)
        if out is not None:
            out.write_text(f"# Deployment plan: {study}\n\n```\n{text}\n```\n\n"
                           f"## nginx\n\n```nginx\n{nginx}```\n\n"
                           f"## Envoy\n\n```yaml\n{envoy}```\n", encoding="utf-8")
    console.print(text, soft_wrap=True, markup=False)
    console.print("\nGateway (nginx):", markup=False)
    console.print(nginx, soft_wrap=True, markup=False)
    console.print("Gateway (Envoy local rate limit):", markup=False)
    console.print(envoy, soft_wrap=True, markup=False)


def _tier_plans(study: str, data: Any, items: list[str], *, gpus: int | None,
                headroom: float, gpu_hour_cost: float | None, model: str | None,
                base_port: int, burst_seconds: float, out: Path | None) -> None:
    """``recommend --tier-gpus``: each tier of the search on its own replicas."""
    from autotune.analysis.deploy import nginx_snippet, plan_text  # when the command runs
    from autotune.analysis.tiers import TIERS_ATTR, parse_tier_gpus, tier_plans
    from autotune.report.build import provenance

    stored = data.attrs.get(TIERS_ATTR) or []
    plans = tier_plans(stored, parse_tier_gpus(items), total=gpus, headroom=headroom,
                       gpu_hour_cost=gpu_hour_cost, model=model, base_port=base_port)
    slo = {t.get("tier"): t.get("slo") for t in stored}
    parts = []
    for name, plan in plans:
        how: dict[str, Any] = next((t for t in stored if t.get("tier") == name), {})
        head = (f"tier {name} ({slo.get(name)}; {'proved' if how.get('proved') else 're-judged'}"
                f" from trial {plan.replica.trial}): {plan.gpus} GPUs")
        text = plan_text(plan, how=f"{provenance(data)}; this tier's SLO {slo.get(name)}")
        nginx = nginx_snippet(plan.total_cap, plan.replicas, burst_seconds=burst_seconds)
        parts.append((head, text, nginx))
        console.print(head, soft_wrap=True, markup=False)
        console.print(text, soft_wrap=True, markup=False)
        console.print("Gateway (nginx):", markup=False)
        console.print(nginx, soft_wrap=True, markup=False)
    if out is not None:
        out.write_text(f"# Deployment plan by tier: {study}\n\n" + "".join(
            f"## {head}\n\n```\n{text}\n```\n\n```nginx\n{nginx}```\n\n"
            for head, text, nginx in parts), encoding="utf-8")
