"""vLLM's ``vllm bench serve --save-result`` JSON layout: write it, read it.

Writing lets ``autotune bench --format vllm`` produce files that vLLM's own tooling
and dashboards read.  Reading turns a team's past ``vllm bench serve`` results (one
object per file, or several objects one per line as ``--append-result`` writes them)
into the same rows the report plots, so they sit next to the study's trials.

The keys follow ``vllm/benchmarks/serve.py``: ``date`` (``%Y%m%d-%H%M%S``),
``backend``, ``model_id``, ``request_rate`` (``"inf"`` when unlimited),
``burstiness``, ``max_concurrency``, ``duration``, ``completed``, ``failed``,
``total_input_tokens``, ``total_output_tokens``, ``request_throughput``,
``request_goodput``, ``output_throughput``, ``total_token_throughput``,
``mean/median/std/pNN_{ttft,tpot,itl,e2el}_ms`` and, in detailed files,
``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``latencies``, ``start_times``
(seconds), ``generated_texts``, ``errors``.  What differs: warm-up requests are left
out (vLLM's warm-ups repeat one prompt and are never in its lists either), and
``duration`` is our measured window.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from autotune.core.errors import AutotuneError
from autotune.core.files import json_safe
from autotune.core.metrics import Summary
from autotune.core.records import RequestRecord
from autotune.study.space import VLLM_FLAGS
from autotune.tuning.record import as_mapping

PERCENTILES = (50.0, 90.0, 95.0, 99.0)
VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")
# vLLM's name for each metric -> ours.
OUR_METRIC = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}
IMPORTED_SOURCE = "measured (vllm bench serve, imported)"


class VllmResultError(AutotuneError, ValueError):
    """A file is not a vLLM ``--save-result`` JSON (the message says which key)."""


# ----------------------------------------------------------------------------- write


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    # vLLM's convention: an empty list is treated as [0].
    x = np.asarray(values if len(values) else [0.0], dtype=float) * 1000.0
    out = {"mean": float(x.mean()), "median": float(np.median(x)), "std": float(x.std())}
    for p in PERCENTILES:
        out[f"p{_pword(p)}"] = float(np.percentile(x, p))
    return out


def _peaks(ok: Sequence[RequestRecord]) -> tuple[float, int]:
    """vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``: per-second
    buckets from the first send; one token per streamed chunk."""
    timed = [(r.sent_s, r.end_s, r.chunk_times_s) for r in ok
             if r.sent_s is not None and r.end_s is not None]
    if not timed:
        return 0.0, 0
    t0 = min(sent for sent, _, _ in timed)
    t1 = max(end for _, end, _ in timed)
    n = int(math.ceil(t1 - t0)) + 1
    tokens = np.zeros(n)
    conc = np.zeros(n)
    for sent, end, chunk_times in timed:
        for t in chunk_times:
            b = int(t - t0)
            if 0 <= b < n:
                tokens[b] += 1
        a, z = int(sent - t0), int(end - t0)
        conc[a:min(z, n - 1) + 1] += 1
    return float(tokens.max()), int(conc.max())


def write_vllm_result(
    summary: Summary, records: Sequence[RequestRecord], run: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``--save-result --save-detailed`` dict of one load test.

    ``run``: the run's settings; keys used: ``model``, ``rate``, ``max_concurrency``,
    ``burstiness``, ``num_prompts``, ``url``, ``backend`` (vLLM's endpoint type,
    default ``openai``; ``endpoint == "chat"`` gives ``openai-chat``), ``tokenizer``,
    ``label``, ``metadata`` (dict merged in as vLLM's ``--metadata`` does).
    """
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    backend = run.get("backend") or ("openai-chat" if run.get("endpoint") == "chat"
                                     else "openai")
    rate = run.get("rate", summary.offered_rate)
    rate_out: Any = "inf" if rate is None or math.isinf(float(rate)) else float(rate)
    model = run.get("model") or ""
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": run.get("label"),
        "model_id": model,
        "tokenizer_id": run.get("tokenizer") or model,
        "num_prompts": int(run.get("num_prompts", len(measured))),
    }
    for key, value in dict(run.get("metadata") or {}).items():
        result[str(key)] = value
    result.update({
        "request_rate": rate_out,
        "burstiness": float(run.get("burstiness", 1.0) or 1.0),
        "max_concurrency": run.get("max_concurrency"),
    })
    dur = summary.duration_s
    peak_tokens, peak_conc = _peaks(ok)
    result.update({
        "duration": dur,
        "completed": summary.num_completed,
        "failed": summary.num_failed,
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.goodput_requests if summary.slo else None,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "input_lens": [r.prompt_tokens for r in measured],
        "output_lens": [r.output_tokens if r.ok else 0 for r in measured],
        "ttfts": [(r.ttft_s or 0.0) if r.ok else 0.0 for r in measured],
        "itls": [r.itls_s if r.ok else [] for r in measured],
        "latencies": [(r.e2e_s or 0.0) if r.ok else 0.0 for r in measured],
        "start_times": [r.sent_s if r.sent_s is not None else 0.0 for r in measured],
        # We keep token timings, not text: the texts are empty strings.
        "generated_texts": ["" for _ in measured],
        "errors": ["" if r.ok else (r.error or "unfinished") for r in measured],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_conc,
    })
    series = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl": [g for r in ok for g in r.itls_s],
        "e2el": [r.e2e_s for r in ok if r.e2e_s is not None],
    }
    for name in VLLM_METRICS:
        for stat, value in _stats_ms(series[name]).items():
            result[f"{stat}_{name}_ms"] = value
    # Our own figures under one key vLLM never uses, so nothing of theirs is shadowed.
    result["autotune"] = {
        "source": summary.source,
        "how": summary.how(),
        "slo": summary.slo,
        "meets_slo": summary.meets_slo,
        "goodput_tokens": summary.goodput_tokens,
        "attainment": summary.attainment,
        "num_warmup_excluded": summary.num_warmup_excluded,
        "url": run.get("url"),
    }
    return result


def save_vllm_result(path: str | os.PathLike[str], result: Mapping[str, Any]) -> None:
    """Write one result as vLLM does (one JSON object, NaN/inf as null)."""
    Path(path).write_text(json.dumps(json_safe(result)) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- read


def load_vllm_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every result object in a file (``--append-result`` puts one per line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise VllmResultError(f"cannot read vLLM result {path}: {e.strerror or e}") from None
    objects: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise VllmResultError(f"{path} is not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(obj, dict):
            raise VllmResultError(f"{path} holds a JSON {type(obj).__name__}, not an object")
        objects.append(obj)
    if not objects:
        raise VllmResultError(f"{path} is empty")
    for obj in objects:
        for key in ("request_throughput", "output_throughput", "completed"):
            if key not in obj:
                raise VllmResultError(
                    f"{path} lacks {key!r}: not a `vllm bench serve --save-result` file"
                )
    return objects


def _num(value: Any) -> float | None:
    if value is None:
        return None
    if value == "inf":
        return math.inf
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _per_request_e2e(obj: Mapping[str, Any]) -> list[float] | None:
    """E2E per successful request from a detailed file: TTFT + the sum of its ITLs."""
    ttfts, itls, errors = obj.get("ttfts"), obj.get("itls"), obj.get("errors")
    if not isinstance(ttfts, list) or not isinstance(itls, list) or len(ttfts) != len(itls):
        return None
    errs = errors if isinstance(errors, list) and len(errors) == len(ttfts) else [""] * len(ttfts)
    return [float(t) + float(sum(g)) for t, g, e in zip(ttfts, itls, errs, strict=True)
            if not e]


def _list_at(obj: Mapping[str, Any], key: str) -> list[Any] | None:
    value = obj.get(key)
    return value if isinstance(value, list) else None


def records_from_vllm_result(obj: Mapping[str, Any]) -> list[RequestRecord]:
    """The requests of a detailed result (``--save-detailed``) as our records, so that
    ``metrics.summarize`` can be run on exactly the data vLLM summarised.

    A request's chunk times are its send time plus TTFT plus the running sum of its
    ITLs (vLLM stamps every chunk that carries ``choices``); its end is send time plus
    latency.  Without ``start_times`` (older vLLM) requests start at 0, which leaves
    every latency right and only the throughput window unknown.
    """
    need = ("ttfts", "itls", "output_lens")
    missing = [k for k in need if not isinstance(obj.get(k), list)]
    if missing:
        raise VllmResultError(f"not a detailed result (run vllm bench serve with "
                              f"--save-detailed): no {', '.join(missing)}")
    n = len(obj["ttfts"])
    starts = _list_at(obj, "start_times")
    starts = [0.0] * n if starts is None else starts
    latencies = _list_at(obj, "latencies")
    errors = _list_at(obj, "errors")
    errors = [""] * n if errors is None else errors
    inputs = _list_at(obj, "input_lens")
    inputs = [0] * n if inputs is None else inputs
    if any(len(v) != n for v in (obj["itls"], obj["output_lens"], starts, errors, inputs)):
        raise VllmResultError("detailed result lists have different lengths")
    records = []
    for i in range(n):
        start, ttft, gaps = float(starts[i]), float(obj["ttfts"][i] or 0.0), obj["itls"][i]
        times = list(start + ttft + np.cumsum([0.0, *map(float, gaps or [])]))
        end = start + float(latencies[i]) if latencies is not None else times[-1]
        records.append(RequestRecord(
            index=i, scheduled_s=start, dispatched_s=start, sent_s=start,
            first_token_s=times[0] if not errors[i] else None,
            chunk_times_s=times if not errors[i] else [], end_s=end,
            prompt_tokens=int(inputs[i] or 0), output_tokens=int(obj["output_lens"][i] or 0),
            expected_output_tokens=int(obj["output_lens"][i] or 0),
            status=200 if not errors[i] else None, error=str(errors[i]) or None))
    return records


def vllm_result_row(obj: Mapping[str, Any], *, name: str = "") -> dict[str, Any]:
    """One imported result as a report row (the keys of ``experiments.COLUMNS``)."""
    config: dict[str, Any] = {}
    aliases = {"tp": "tensor_parallel_size", "max_seqs": "max_num_seqs"}
    for key, value in obj.items():
        k = aliases.get(str(key), str(key))
        if k in VLLM_FLAGS and k != "model":
            config[k] = _coerce(value)
    if obj.get("max_concurrency") is not None:
        config["max_concurrency"] = obj["max_concurrency"]

    def ms(metric: str, stat: str) -> float | None:
        v = _num(obj.get(f"{stat}_{metric}_ms"))
        return None if v is None else v / 1000.0

    e2e_p99 = ms("e2el", "p99")
    e2e_p50 = ms("e2el", "median")
    per_req = _per_request_e2e(obj)
    if per_req:
        # A detailed file carries enough to fill what --percentile-metrics left out.
        if e2e_p99 is None:
            e2e_p99 = float(np.percentile(per_req, 99))
        if e2e_p50 is None:
            e2e_p50 = float(np.percentile(per_req, 50))
    meta = as_mapping(obj.get("autotune"))
    label = obj.get("label") or name or obj.get("backend") or "vllm"
    return {
        "time": _iso(obj.get("date")),
        "study": f"vllm:{label}",
        "trial": None,
        **{k: v for k, v in config.items()
           if k in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                    "enable_chunked_prefill", "gpu_memory_utilization", "max_concurrency")},
        "config_json": config,
        "rate": _num(obj.get("request_rate")),
        "request_throughput": _num(obj.get("request_throughput")),
        "output_throughput": _num(obj.get("output_throughput")),
        "total_token_throughput": _num(obj.get("total_token_throughput")),
        "ttft_p50_s": ms("ttft", "median"),
        "ttft_p99_s": ms("ttft", "p99"),
        "tpot_p50_s": ms("tpot", "median"),
        "tpot_p99_s": ms("tpot", "p99"),
        "e2e_p50_s": e2e_p50,
        "e2e_p99_s": e2e_p99,
        "goodput_requests": _num(obj.get("request_goodput")),
        "goodput_tokens": _num(meta.get("goodput_tokens")),
        "attainment": _num(meta.get("attainment")),
        "meets_slo": meta.get("meets_slo"),
        "slo": meta.get("slo"),
        "pruned": False,
        "backend": "vllm bench serve",
        "source": meta.get("source") or IMPORTED_SOURCE,
        "num_measured": (_num(obj.get("completed")) or 0) + (_num(obj.get("failed")) or 0),
        "duration_s": _num(obj.get("duration")),
        "model": obj.get("model_id"),
    }


def _coerce(value: Any) -> Any:
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        for cast in (int, float):
            try:
                return cast(value)
            except ValueError:
                pass
    return value


def _iso(date: Any) -> str | None:
    if not isinstance(date, str):
        return None
    try:
        return datetime.strptime(date, "%Y%m%d-%H%M%S").isoformat()
    except ValueError:
        return date


def read_vllm_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Report rows from one result file or from every ``*.json`` under a folder."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.json") if not p.name.endswith(".pytorch.json"))
        if not files:
            raise VllmResultError(f"no vLLM result files (*.json) under {path}")
    elif path.exists():
        files = [path]
    else:
        raise VllmResultError(f"no such vLLM result file or folder: {path}")
    rows: list[dict[str, Any]] = []
    for f in files:
        for obj in load_vllm_results(f):
            rows.append(vllm_result_row(obj, name=f.stem))
    return rows
