"""A report of imported ``vllm bench serve`` results alone (no study)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.core.files import atomic_write
from autotune.core.flags import config_key
from autotune.report import plots
from autotune.report.build import ReportPaths, imported_table, trials_csv
from autotune.report.data import ReportError
from autotune.report.render import Figure, Page, Text, html_page, markdown


def write_imported_report(rows: Sequence[Mapping[str, Any]],
                          out_dir: str | os.PathLike[str]) -> ReportPaths:
    """Throughput and P99 against the request rate of imported results, one line per
    label, as ``report.html``/``report.md`` in ``out_dir``."""
    if not rows:
        raise ReportError("no vLLM results to report")
    out = Path(out_dir)
    if not out.is_dir():
        raise ReportError(f"cannot write the report: folder {out} does not exist")
    curves = []
    for r in rows:
        cfg = dict(r.get("config_json") or {})
        cfg.setdefault("label", r.get("study"))
        curves.append({**r, "config": cfg, "config_key": config_key(cfg), "feasible": False,
                       "gpus": int(cfg.get("tensor_parallel_size", 1) or 1)})
    prov = (f"measured by vllm bench serve (imported): {len(rows)} runs from "
            f"{len({r.get('study') for r in rows})} labels; no SLO verdicts (vLLM's files "
            "carry none)")
    path = plots.rate_curves(curves, out / "plots" / "vllm_rate_curves.png", slo=None,
                             provenance=prov)
    page = Page(title="vllm bench serve results", provenance=prov)
    page.add("Figures", Figure("vllm_rate_curves", "plots/vllm_rate_curves.png",
                               "Throughput and P99 against the request rate",
                               "one point per result file; dashed: output tok/s (no goodput: "
                               f"vLLM records no SLO verdict). Source: {prov}."),
             Text("Goodput is 0 on the solid lines because the files hold no SLO check; "
                  "the dashed lines are the throughput.", "note"))
    page.add("Results", imported_table(rows))
    html_path, md_path, csv_path = out / "report.html", out / "report.md", out / "trials.csv"
    atomic_write(md_path, markdown(page))
    atomic_write(html_path, html_page(page))
    atomic_write(csv_path, trials_csv(curves))
    return ReportPaths(out_dir=out, html=html_path, markdown=md_path, trials_csv=csv_path,
                       plots={"vllm_rate_curves": path})
