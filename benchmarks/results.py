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


def _fmt(v: Any) -> str:
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
        out.append((prefix, ", ".join(_fmt(x) for x in data)))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out.extend(_flatten(v, f"{prefix}[{i}]"))
    else:
        out.append((prefix, data))
    return out


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines


def tool_comparison_md(d: dict[str, Any]) -> list[str]:
    out = [f"Pinning: {d.get('pinning')}. Replies: {d.get('output_tokens')} tokens, prompts "
           f"{d.get('input_tokens')} tokens; ~{d.get('duration_s_per_rate')} s of arrivals a "
           f"rate; sustained = all completed and achieved/offered >= {d.get('min_ratio')}; "
           f"{d.get('repeats', 1)} round(s) over all clients, order rotated, capacity = "
           "median over rounds.", ""]
    rows = []
    for tool, v in d.get("tools", {}).items():
        c = v["capacity"]
        rows.append([tool, c["max_sustained_rate"],
                     ", ".join(_fmt(x) for x in c.get("per_repeat", [])),
                     c["achieved_at_max"], c["streamed_tok_s_at_max"], v.get("wall_s")])
    out += _table(["client", "max sustained offered req/s (median)", "per round",
                   "achieved req/s there", "streamed tok/s there", "wall s (all rounds)"],
                  rows)
    ratio = d.get("ratio_vs_best_other")
    if ratio:
        best = ratio["best_other"]
        for key, value in ratio.items():
            if key.endswith("_rate_ratio"):
                out += ["", f"**Headline (same run): {key[:-len('_rate_ratio')]} / best other "
                        f"({best}) = {_fmt(value)}x sustained request rate** (medians)."]
        for i, per in enumerate(ratio.get("per_repeat", [])):
            out.append(f"- round {i}: " + ", ".join(f"{t} {_fmt(v)}x" for t, v in per.items()))
    for tool, why in d.get("skipped", {}).items():
        out.append(f"\nSkipped {tool}: {why}")
    for tool, v in d.get("tools", {}).items():
        cmd = v.get("command") or (v.get("repeats") or [{}])[0].get("command")
        if cmd:
            out += ["", f"{tool} command (one round): `{' '.join(cmd)}`"]
        imp = [r.get("import_s") for r in v.get("repeats", []) if r.get("import_s")]
        if imp:
            out.append(f"{tool}: import of vllm.benchmarks.serve took "
                       f"{', '.join(_fmt(x) for x in imp)} s (not counted in capacity)")
    if "guidellm" in d.get("tools", {}):
        out += ["", "GuideLLM rows: 'sent' = successful + errored + incomplete in its report; "
                "requests still queued or in flight when its max_duration constraint ended "
                "count as incomplete, so its completed/sent is lower than the other clients' "
                "by construction; achieved req/s = successful / its benchmark duration."]
    out += ["", "Achieved vs offered, every rate tried:", ""]
    rows = [[tool, r.get("repeat", 0), r["offered_rate"], r.get("achieved_rate"), r.get("ratio"),
             r.get("completed"), r.get("requests"), r.get("sustained")]
            for tool, v in d.get("tools", {}).items() for r in v["runs"]]
    out += _table(["client", "round", "offered req/s", "achieved req/s", "achieved/offered",
                   "completed", "sent", "sustained"], rows)
    return out


def metric_agreement_md(d: dict[str, Any]) -> list[str]:
    if "skipped" in d:
        return [f"Skipped: {d['skipped']}"]
    out = [f"Server: {d['server']}. {d['num_requests']} requests at {d['rate']} req/s, "
           f"seed {d['seed']}, {d.get('pinning')}; dataset: {d.get('dataset')}.", ""]
    rows = [[r["figure"], r["ours"], r["vllm"], f"{r['rel_diff']:+.2%}", r["within_3pct"],
             "" if not r.get("ours_p99_ci_95") else
             f"{_fmt(r['ours_p99_ci_95'][0])} to {_fmt(r['ours_p99_ci_95'][1])}",
             "" if r.get("vllm_inside_ours_p99_ci") is None else r["vllm_inside_ours_p99_ci"]]
            for r in d["comparison"]]
    out += _table(["figure (ms or /s)", "ours", "vllm bench serve", "ours vs vllm",
                   "within 3%", "our p99 95% CI", "vLLM's p99 inside it"], rows)
    out += ["", f"All within 3%: **{d['all_within_3pct']}**.", "", "Definitions:"]
    seen = set()
    for r in d["comparison"]:
        if r["definition"] not in seen:
            seen.add(r["definition"])
            out.append(f"- {r['figure']}: {r['definition']}")
    if any(r.get("ours_p99_ci_95") for r in d["comparison"]):
        out.append("- p99 rows: the two clients' runs are two samples (different arrival "
                   "jitter, a real-time simulator on a shared core); a vLLM p99 inside our "
                   "p99's 95% distribution-free interval differs by sampling, not by "
                   "definition.")
    out += ["", "vLLM command (run as vllm.benchmarks.serve.main on this argv): `"
            + " ".join(d["vllm_command"]) + "`"]
    return out


RENDERERS = {"tool_comparison": tool_comparison_md, "metric_agreement": metric_agreement_md}


def generic_md(d: dict[str, Any], limit: int = 80) -> list[str]:
    flat = _flatten(d)
    rows = [[k, v] for k, v in flat[:limit]]
    out = _table(["figure", "value"], rows)
    if len(flat) > limit:
        out.append(f"\n({len(flat) - limit} more figures in the JSON)")
    return out


def render(runs: list[BenchRun], *, total_wall_s: float, command: str,
           smoke: bool = False, notes: list[str] | None = None) -> str:
    m = machine()
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# Benchmark results", "",
             "Generated by `" + command + "`; do not edit by hand (every figure below comes "
             "from a benchmark's JSON in the same run).", "",
             f"- Date: {now}",
             f"- Machine: {m['nproc']} CPUs ({m['cpu_model']}), "
             f"{_fmt(m['mem_gib'])} GiB, Python {m['python']}, {m['platform']}",
             f"- Load average at the end: {', '.join(f'{x:.1f}' for x in m['loadavg_at_end'])}"
             " (the cores were shared with other work when this is above ~0.5 per core; "
             "absolute times then vary, ratios measured in the same run less so)"
             if m["loadavg_at_end"] else "- Load average: unknown",
             f"- Full run took {total_wall_s / 60:.1f} min" + (" (SMOKE sizes)" if smoke else ""),
             *[f"- Note: {n}" for n in notes or []],
             ""]
    lines += ["## Summary", ""]
    lines += _table(["benchmark", "status", "wall s", "command"],
                    [[r.name, "ok" if r.returncode == 0 else f"exit {r.returncode}", r.wall_s,
                      "`" + " ".join(r.command) + "`"] for r in runs])
    for r in runs:
        lines += ["", f"## {r.title}", "", f"Command: `{' '.join(r.command)}` "
                  f"({_fmt(r.wall_s)} s, exit {r.returncode})", ""]
        lines += [f"- {n}" for n in r.notes]
        if r.data is not None:
            renderer = RENDERERS.get(r.name, generic_md)
            try:
                lines += renderer(r.data)
            except (KeyError, TypeError, ValueError) as e:
                lines += [f"(could not render: {e}; raw figures follow)", ""]
                lines += generic_md(r.data)
        if r.text:
            lines += ["", "```", r.text.strip()[-4000:], "```"]
    return "\n".join(lines) + "\n"
