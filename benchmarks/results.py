"""Turn each benchmark's JSON into benchmarks/RESULTS.md; no figure is typed by hand.

Every number in the file comes from a JSON object a benchmark wrote in the same run;
the page states the machine, the date, each exact command and how long it took.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


@dataclass
class BenchRun:
    """One benchmark's command, outcome and figures."""

    name: str
    title: str
    command: list[str]
    wall_s: float
    returncode: int
    data: dict[str, Any] | None = None
    text: str = ""  # stdout when the benchmark prints text, or the error tail
    notes: list[str] = field(default_factory=list)
    module: str = ""  # the benchmark's module when it is not named after it


def committed_label(path: Path, *, root: Path | None = None) -> str:
    """When the JSON at ``path`` was written, for a page that reuses it: its last commit
    if git (in ``root``, the repository by default) has the file unchanged, else its
    modification time.  A clone's files all carry the time of the checkout, so the file
    time alone would date every reused figure to the day it was cloned."""
    import subprocess
    import time

    root = root or Path(__file__).resolve().parent.parent
    try:
        changed = subprocess.run(["git", "status", "--porcelain", "--", str(path)],
                                 cwd=root, capture_output=True, text=True, check=True).stdout
        last = subprocess.run(["git", "log", "-1", "--date=format-local:%Y-%m-%d %H:%M UTC",
                               "--format=%cd, commit %h", "--", str(path)], cwd=root,
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "TZ": "UTC"}).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        changed, last = "?", ""
    if last and not changed.strip():
        return f"committed {last}"
    mtime = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
    return f"file modified {mtime}"


def machine() -> dict[str, Any]:
    """nproc, CPU model, memory, load: what the figures were measured on."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"nproc": os.cpu_count(), "cpu_model": model, "mem_gib": mem_gib,
            "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_at_end": load}


def machine_line(m: dict[str, Any]) -> str:
    """One line naming the machine of :func:`machine` (the page's header, a reused JSON's)."""
    return (f"{m['nproc']} CPUs ({m['cpu_model']}), {fmt(m['mem_gib'])} GiB, "
            f"Python {m['python']}, {m['platform']}")


def parse_json_output(stdout: str) -> dict[str, Any] | None:
    """The JSON object a benchmark printed: all of stdout, or its last JSON block."""
    text = stdout.strip()
    try:
        data = json.loads(text)
        return data if isinstance(data, dict) else {"value": data}
    except (json.JSONDecodeError, ValueError):
        pass
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith("{"):
            try:
                data = json.loads("\n".join(lines[i:]))
            except (json.JSONDecodeError, ValueError):
                continue
            if isinstance(data, dict):
                return data
    return None


def fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(data, list) and data and all(not isinstance(x, dict | list) for x in data):
        out.append((prefix, ", ".join(fmt(x) for x in data)))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out.extend(_flatten(v, f"{prefix}[{i}]"))
    else:
        out.append((prefix, data))
    return out


def emit(data: dict[str, Any], output: Path | None) -> int:
    """A benchmark's JSON: to ``--output`` when given, else to stdout; exit code 0."""
    text = json.dumps(data, indent=2)
    if output is not None:
        output.write_text(text)
    else:
        print(text)
    return 0


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return lines


def renderer_for(name: str) -> Any:
    """A benchmark's own ``markdown(data) -> list[str]`` when its module has one, else
    the generic figure table."""
    import importlib

    try:
        module = importlib.import_module(f"benchmarks.{name}")
    except ImportError:
        module = None
    own = getattr(module, "markdown", None)
    return own if callable(own) else generic_md


def generic_md(d: dict[str, Any], limit: int = 80) -> list[str]:
    flat = _flatten(d)
    rows = [[k, v] for k, v in flat[:limit]]
    out = table(["figure", "value"], rows)
    if len(flat) > limit:
        out.append(f"\n({len(flat) - limit} more figures in the JSON)")
    return out


def render(runs: list[BenchRun], *, total_wall_s: float, command: str,
           smoke: bool = False, notes: list[str] | None = None) -> str:
    m = machine()
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# Benchmark results", "",
             "Generated by `" + command + "`; do not edit by hand (every figure below comes "
             "from a benchmark's JSON" + ("; a reused one says when and by what it was "
                                          "written)." if any(r.notes for r in runs)
                                          else " in the same run)."), "",
             f"- Date: {now}",
             f"- Machine: {machine_line(m)}" + (" (this run's; a reused figure names its own)"
                                               if any(r.notes for r in runs) else ""),
             f"- Load average at the end: {', '.join(f'{x:.1f}' for x in m['loadavg_at_end'])}"
             " (the cores were shared with other work when this is above ~0.5 per core; "
             "absolute times then vary, ratios measured in the same run less so)"
             if m["loadavg_at_end"] else "- Load average: unknown",
             f"- Full run took {total_wall_s / 60:.1f} min" + (" (SMOKE sizes)" if smoke else "")
             + (" (reused benchmarks counted at their wall time in the run that wrote them)"
                if any(r.notes for r in runs) else ""),
             *[f"- Note: {n}" for n in notes or []],
             ""]
    lines += ["## Summary", ""]
    lines += table(["benchmark", "status", "wall s", "command"],
                    [[r.name, "ok" if r.returncode == 0 else f"exit {r.returncode}", r.wall_s,
                      "`" + " ".join(r.command) + "`"] for r in runs])
    for r in runs:
        lines += ["", f"## {r.title}", "", f"Command: `{' '.join(r.command)}` "
                  f"({fmt(r.wall_s)} s, exit {r.returncode})", ""]
        lines += [f"- {n}" for n in r.notes]
        if r.data is not None:
            renderer = renderer_for(r.module or r.name)
            try:
                lines += renderer(r.data)
            except (KeyError, TypeError, ValueError) as e:
                lines += [f"(could not render: {e}; raw figures follow)", ""]
                lines += generic_md(r.data)
        if r.text:
            lines += ["", "```", r.text.strip()[-4000:], "```"]
    return "\n".join(lines) + "\n"
