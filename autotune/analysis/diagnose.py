"""Diagnoses: pure rules over one load test's summary, its telemetry and the settings.

``diagnose(summary, telemetry, settings, context) -> list[Diagnosis]``; each diagnosis
carries the numbers that made it fire (``evidence``) and what to try next.  Rules stay
silent when their inputs are missing: no GPU telemetry, no compute-bound verdict.

Inputs (every key optional):

* ``summary``: a :class:`autotune.core.metrics.Summary` or its ``to_dict()``.
* ``telemetry``: ``gpu_util_mean_pct`` (0..100), ``gpu_util_per_gpu_pct`` (list),
  ``gpu_mem_used_per_gpu_bytes`` (list), ``kv_usage_mean`` / ``kv_usage_max`` (0..1),
  ``preemptions`` (count in the window), ``queue_time_mean_s`` / ``queue_time_p99_s``
  (vLLM's ``vllm:request_queue_time_seconds``), ``source`` ("simulated"/"measured").
* ``settings``: the user's choices: ``warmup`` (requests), ``max_concurrency``,
  ``load_levels`` (the rates/concurrencies tested), ``tensor_parallel_sizes`` (tested),
  ``gpus`` (of the node), ``prompt_tokens_mean`` / ``prompt_tokens_std``,
  ``workload_source``; and of the config: ``max_num_seqs``, ``tensor_parallel_size``.
  :func:`workload_settings` fills the prompt keys; :func:`pitfalls` reads only these.
* ``context``: a sweep around this point: ``xs``, ``tokens_per_s`` (same order) and
  ``index`` of this point, and ``thirds_rps`` from :func:`thirds_throughput`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.markup import escape

from autotune.core.records import RequestRecord

COMPUTE_UTIL_PCT = 95.0
UNDERFED_UTIL_PCT = 70.0
PLATEAU_GAIN = 0.10  # tokens/s gain under this on a step up counts as a plateau
SATURATED_SHARE = 0.90  # served under this share of the offered rate = cannot keep up
QUEUE_SHARE = 0.5  # queue time over this share of E2E = queue-dominated
TTFT_TAIL_RATIO = 5.0  # p99 TTFT over this many p50 TTFTs ...
TTFT_SHARE = 0.25  # ... and p99 TTFT over this share of p99 E2E
TTFT_DOMINANT_SHARE = 0.5  # or p99 TTFT alone over half of p99 E2E
KV_NEAR_FULL = 0.95
MEM_SPREAD = 0.10
SEND_LAG_S = 1e-3
SEND_LAG_SHARE = 0.05  # of the mean gap between scheduled arrivals
MIN_P99_SAMPLES = 299  # below, the 95% upper bound of a p99 is no sample at all
UNSTEADY_SPREAD = 0.25  # first vs last third of the window
SHORT_PROMPT_TOKENS = 32

FINDING, WARNING = "finding", "warning"


@dataclass(frozen=True)
class Diagnosis:
    code: str
    title: str
    evidence: str  # the numbers that made it fire
    next_step: str
    severity: str = FINDING  # "warning": the figures or the method are not trustworthy

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# ----------------------------------------------------------------------------- access


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)
    return obj


def _num(obj: Any, *path: str) -> float:
    """A figure as float; NaN when absent (JSON None from ``to_dict`` too)."""
    value = _get(obj, *path)
    try:
        return math.nan if value is None else float(value)
    except (TypeError, ValueError):
        return math.nan


def _known(*values: float) -> bool:
    return all(not math.isnan(v) for v in values)


def _s(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.3g} s"


# ----------------------------------------------------------------------------- inputs


def workload_settings(prompt_tokens: Sequence[int], source: str = "") -> dict[str, Any]:
    """The prompt-length keys of ``settings`` from the requests' prompt token counts."""
    n = len(prompt_tokens)
    mean = sum(prompt_tokens) / n if n else math.nan
    std = (math.sqrt(sum((x - mean) ** 2 for x in prompt_tokens) / n) if n else math.nan)
    return {"prompt_tokens_mean": mean, "prompt_tokens_std": std, "workload_source": source}


def thirds_throughput(records: Sequence[RequestRecord]) -> tuple[float, float, float] | None:
    """Completions per second (warm-up ones too: the server's real rate) in each third
    of the measured sending span, from the first to the last measured send.  None when
    the span is empty."""
    sent = [r.sent_s for r in records if not r.warmup and r.sent_s is not None]
    if len(sent) < 3:
        return None
    start, end = min(sent), max(sent)
    third = (end - start) / 3.0
    if third <= 0:
        return None
    counts = [0, 0, 0]
    for r in records:
        if r.ok and r.end_s is not None and start <= r.end_s <= end:
            counts[min(int((r.end_s - start) / third), 2)] += 1
    return (counts[0] / third, counts[1] / third, counts[2] / third)


# ----------------------------------------------------------------------------- rules


def _gpu_util(telemetry: Mapping[str, Any]) -> float:
    util = _num(telemetry, "gpu_util_mean_pct")
    if math.isnan(util):
        per = telemetry.get("gpu_util_per_gpu_pct") or []
        vals = [float(v) for v in per if v is not None]
        util = sum(vals) / len(vals) if vals else math.nan
    return util


def _sim_label(telemetry: Mapping[str, Any]) -> str:
    return " (simulated)" if telemetry.get("source") == "simulated" else ""


def _compute_bound(s: Any, t: Mapping[str, Any], ctx: Mapping[str, Any]) -> Diagnosis | None:
    util = _gpu_util(t)
    if not _known(util) or util < COMPUTE_UTIL_PCT:
        return None
    why = None
    xs, toks, idx = ctx.get("xs"), ctx.get("tokens_per_s"), ctx.get("index")
    if xs is not None and toks is not None and idx is not None and idx > 0:
        prev, cur = float(toks[idx - 1]), float(toks[idx])
        if prev > 0 and cur / prev - 1.0 < PLATEAU_GAIN:
            why = (f"tokens/s {prev:,.0f} -> {cur:,.0f} ({cur / prev - 1:+.1%}) from "
                   f"{xs[idx - 1]:g} to {xs[idx]:g}")
    if why is None:
        offered, served = _num(s, "scheduled_rate"), _num(s, "request_throughput")
        if _known(offered, served) and offered > 0 and served < SATURATED_SHARE * offered:
            why = f"serves {served:.2f} of {offered:.2f} req/s offered"
    if why is None:
        return None
    return Diagnosis(
        "compute_bound", "At the compute limit",
        f"GPU util {util:.0f}%{_sim_label(t)} while {why}",
        "more load only adds queueing: keep the rate at or under this point, or add GPUs "
        "(TP/DP) or a faster GPU for more tokens/s")


def _underfed(s: Any, t: Mapping[str, Any], settings: Mapping[str, Any]) -> Diagnosis | None:
    util = _gpu_util(t)
    if not _known(util) or util >= UNDERFED_UTIL_PCT:
        return None
    seqs = settings.get("max_num_seqs")
    seq_note = f" (max_num_seqs {seqs})" if seqs is not None else ""
    tp = settings.get("tensor_parallel_size")
    comm = (f"; under TP={tp} the GPUs may also be waiting on each other"
            if tp is not None and int(tp) > 1 else "")
    return Diagnosis(
        "underfed", "GPUs underfed",
        f"GPU util {util:.0f}%{_sim_label(t)} < {UNDERFED_UTIL_PCT:.0f}% at "
        f"{_num(s, 'request_throughput'):.2f} req/s",
        f"the batch is too small: raise the request rate or max_num_seqs{seq_note}{comm}")


def _queueing(s: Any, t: Mapping[str, Any]) -> Diagnosis | None:
    e2e_mean, e2e_p99 = _num(s, "e2e", "mean"), _num(s, "e2e", "p99")
    q_mean, q_p99 = _num(t, "queue_time_mean_s"), _num(t, "queue_time_p99_s")
    step = ("requests wait for a batch slot: lower the rate cap (see the knee) or raise "
            "max_num_seqs if KV cache and GPU util leave room")
    if _known(q_p99, e2e_p99) and e2e_p99 > 0 and q_p99 / e2e_p99 > QUEUE_SHARE:
        return Diagnosis("queueing", "P99 dominated by queueing",
                         f"queue time p99 ~{_s(q_p99)} ~ {q_p99 / e2e_p99:.0%} of P99 E2E "
                         f"{_s(e2e_p99)} (vllm:request_queue_time_seconds, interpolated in "
                         "its buckets)", step)
    if _known(q_mean, e2e_mean) and e2e_mean > 0 and q_mean / e2e_mean > QUEUE_SHARE:
        return Diagnosis("queueing", "Latency dominated by queueing",
                         f"mean queue time {_s(q_mean)} = {q_mean / e2e_mean:.0%} of mean "
                         f"E2E {_s(e2e_mean)} (vllm:request_queue_time_seconds)", step)
    if _known(q_mean) or _known(q_p99):
        return None  # the server said how long requests queued: trust it over TTFT
    p50, p99 = _num(s, "ttft", "p50"), _num(s, "ttft", "p99")
    if not _known(p50, p99, e2e_p99) or e2e_p99 <= 0 or p50 <= 0:
        return None
    share = p99 / e2e_p99
    tail = p99 / p50
    if (tail > TTFT_TAIL_RATIO and share > TTFT_SHARE) or share > TTFT_DOMINANT_SHARE:
        return Diagnosis(
            "queueing", "P99 dominated by queueing (from TTFT)",
            f"p99 TTFT {_s(p99)} = {tail:.1f}x p50 TTFT {_s(p50)} and {share:.0%} of P99 "
            f"E2E {_s(e2e_p99)}: the first token waits far beyond a prefill", step)
    return None


def _kv_pressure(t: Mapping[str, Any]) -> Diagnosis | None:
    pre, kv_max, kv_mean = (_num(t, "preemptions"), _num(t, "kv_usage_max"),
                            _num(t, "kv_usage_mean"))
    parts = []
    if _known(pre) and pre > 0:
        parts.append(f"{pre:.0f} preemption(s)")
    if _known(kv_max) and kv_max >= KV_NEAR_FULL:
        parts.append(f"KV cache usage peaked at {kv_max:.0%}"
                     + (f" (mean {kv_mean:.0%})" if _known(kv_mean) else ""))
    if not parts:
        return None
    return Diagnosis(
        "kv_pressure", "KV-cache pressure", " and ".join(parts) + _sim_label(t),
        "raise gpu_memory_utilization, lower max_num_seqs or max_model_len, or spread "
        "the KV cache over more GPUs (TP); preempted requests are recomputed")


def _memory_imbalance(t: Mapping[str, Any], settings: Mapping[str, Any]) -> Diagnosis | None:
    mem = [float(v) for v in (t.get("gpu_mem_used_per_gpu_bytes") or []) if v is not None]
    tp = settings.get("tensor_parallel_size")
    if len(mem) < 2 or (tp is not None and int(tp) < 2) or max(mem) <= 0:
        return None
    spread = (max(mem) - min(mem)) / max(mem)
    if spread <= MEM_SPREAD:
        return None
    gib = [f"{m / 2**30:.1f}" for m in mem]
    hi = mem.index(max(mem))
    return Diagnosis(
        "memory_imbalance", "GPU memory imbalanced",
        f"per-GPU memory used {', '.join(gib)} GiB: spread {spread:.0%} > "
        f"{MEM_SPREAD:.0%}, GPU {hi} highest",
        f"check what else runs on GPU {hi} (`nvidia-smi`), that every TP rank holds the "
        "same share (`nvidia-smi dmon -s m`), and that the KV cache is split evenly")


def _client_limited(s: Any) -> Diagnosis | None:
    lag = _num(s, "send_lag_p99_s")
    if not _known(lag) or lag <= SEND_LAG_S:
        return None
    sched = _num(s, "scheduled_rate")
    if _known(sched) and (sched <= 0 or math.isinf(sched)):
        return None  # all sent at once: there is no schedule to lag behind
    # A lag matters against the gaps between arrivals: 4 ms late at 1.4 req/s (gaps of
    # 700 ms) leaves the offered load as it was; at 200 req/s it does not.
    limit = SEND_LAG_S
    if _known(sched) and sched > 0:
        limit = max(SEND_LAG_S, SEND_LAG_SHARE / sched)
    if lag <= limit:
        return None
    return Diagnosis(
        "client_limited", "Client could not keep up: figures not trustworthy",
        f"send lag p99 {lag * 1e3:.1f} ms > {limit * 1e3:.3g} ms behind the schedule "
        f"(the larger of {SEND_LAG_S * 1e3:g} ms and {SEND_LAG_SHARE:.0%} of the mean gap "
        "between arrivals)",
        "run the load generator on a less busy machine, lower the rate, or add client "
        "workers; until then the server is offered less than the rate says",
        WARNING)


def _too_short(s: Any, ctx: Mapping[str, Any]) -> list[Diagnosis]:
    out: list[Diagnosis] = []
    n = _num(s, "e2e", "count")
    if math.isnan(n):
        n = _num(s, "num_completed")
    hi = _get(s, "e2e", "p99_hi")
    e2e = _get(s, "e2e")
    # ``to_dict()`` writes an infinite bound as None: a present None is unbounded.
    hi_inf = ((isinstance(hi, float) and math.isinf(hi))
              or (hi is None and isinstance(e2e, Mapping) and "p99_hi" in e2e))
    if _known(n) and (n < MIN_P99_SAMPLES or hi_inf):
        out.append(Diagnosis(
            "too_short", "Too few requests for a meaningful P99",
            f"{n:.0f} completed requests; the 95% upper bound of P99 E2E is "
            f"{'unbounded' if hi_inf else _s(float(hi))}",
            "run more measured requests (about 400 or more bound a P99 on both sides; "
            "the seed runs 5-10 minutes)", WARNING))
    thirds = ctx.get("thirds_rps")
    if thirds:
        first, last = float(thirds[0]), float(thirds[-1])
        top = max(first, last)
        if top > 0 and abs(last - first) / top > UNSTEADY_SPREAD:
            out.append(Diagnosis(
                "not_steady", "Window not steady",
                f"completions {first:.2f} req/s in the first third of the window vs "
                f"{last:.2f} req/s in the last ({abs(last - first) / top:.0%} apart)",
                "warm up longer and measure longer so the figures come from a steady state",
                WARNING))
    return out


def pitfalls(settings: Mapping[str, Any]) -> list[Diagnosis]:
    """The seed's four pitfalls (section 4.5), from the user's own settings."""
    out: list[Diagnosis] = []
    warm = settings.get("warmup")
    if warm is not None and int(warm) == 0:
        out.append(Diagnosis(
            "no_warmup", "Pitfall: no warm-up",
            "warm-up 0 requests: first requests pay memory allocation and kernel loading",
            "warm up with at least 100 requests (--warmup 100)", WARNING))
    mean, std = _num(settings, "prompt_tokens_mean"), _num(settings, "prompt_tokens_std")
    if _known(mean, std) and (std == 0 or mean < SHORT_PROMPT_TOKENS):
        src = settings.get("workload_source") or "the workload"
        out.append(Diagnosis(
            "fixed_short_prompts", "Pitfall: fixed or short prompts only",
            f"prompts of {src}: mean {mean:.0f} tokens, spread {std:.0f}: tokens/s looks "
            "better than on real long-context traffic",
            "use a mixed-length dataset such as ShareGPT (--dataset sharegpt)", WARNING))
    conc = settings.get("max_concurrency")
    levels = settings.get("load_levels")
    if conc is not None and int(conc) == 1:
        out.append(Diagnosis(
            "single_stream", "Pitfall: a single concurrency stream",
            "max concurrency 1: tokens/s of one stream is best-case latency, not capacity",
            "load-test with many concurrent requests (--concurrency 32,64,128 or a rate "
            "sweep)", WARNING))
    elif levels is not None and len(set(levels)) == 1:
        out.append(Diagnosis(
            "single_load_level", "Pitfall: one load level only",
            f"only {list(levels)[0]} tested: one point says nothing about the knee",
            "sweep the rate or the concurrency (autotune sweep --rate 10:50:10)", WARNING))
    gpus, tps = settings.get("gpus"), settings.get("tensor_parallel_sizes")
    if gpus is not None and int(gpus) > 1 and tps is not None and len(set(tps)) == 1:
        out.append(Diagnosis(
            "tp_not_compared", "Pitfall: TP scaling never compared",
            f"only TP={list(tps)[0]} tested on a {gpus}-GPU node",
            "compare layouts (autotune sweep --param tensor_parallel_size=1,2,4): a TP "
            "that scales badly points at communication", WARNING))
    return out


def diagnose(
    summary: Any,
    telemetry: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    context: Mapping[str, Any] | None = None,
) -> list[Diagnosis]:
    """Every rule that fires, warnings (trust and method) first.  The pitfalls fire
    from ``settings``; a sweep that shows them once passes point settings without
    their keys (see :func:`pitfalls`)."""
    t, st, ctx = telemetry or {}, settings or {}, context or {}
    found: list[Diagnosis | None] = [
        _client_limited(summary), *_too_short(summary, ctx), *pitfalls(st),
        _compute_bound(summary, t, ctx), _underfed(summary, t, st), _queueing(summary, t),
        _kv_pressure(t), _memory_imbalance(t, st),
    ]
    return [d for d in found if d is not None]


def render(diagnoses: Sequence[Diagnosis], style: str = "rich") -> list[str]:
    """Lines for a console (``rich`` markup), a Markdown report, or ``plain`` text."""
    if not diagnoses:
        return ["No diagnosis fired."] if style != "markdown" else ["- No diagnosis fired."]
    lines = []
    for d in diagnoses:
        loud = d.severity == WARNING
        if style == "markdown":
            head = f"**{'WARNING: ' if loud else ''}{d.title}**"
            lines.append(f"- {head} (`{d.code}`): {d.evidence}. Next: {d.next_step}.")
        elif style == "rich":
            title = escape(d.title)
            head = f"[bold yellow]WARNING {title}[/]" if loud else f"[bold]{title}[/]"
            lines.append(f"{head} [dim]({d.code})[/]: {escape(d.evidence)}. [dim]next:[/] "
                         f"{escape(d.next_step)}.")
        else:
            lines.append(f"{'WARNING ' if loud else ''}{d.title} ({d.code}): {d.evidence}. "
                         f"next: {d.next_step}.")
    return lines
