"""Diagnoses: each fires on a case built to cause it and stays silent on a healthy run.

Engine cases run the simulator in virtual time (tiny max_num_seqs -> queueing, tiny
gpu_memory_utilization -> KV pressure, low rate -> underfed); what the simulator cannot
produce (per-GPU memory, client lag) is built as plain dicts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from autotune.analysis import diagnose as dg
from autotune.backends.base import LoadPlan
from autotune.backends.sim import SimBackend
from autotune.core.records import RequestRecord
from autotune.core.slo import parse_slo
from autotune.tuning.trial import evaluate
from autotune.workload.sources import Request


def _requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(np.log(100), 1.0, n), 4, 2000).astype(int)
    o = np.clip(rng.lognormal(np.log(200), 0.8, n), 2, 1500).astype(int)
    return [Request(prompt="x", prompt_tokens=int(a), output_tokens=int(b))
            for a, b in zip(p, o, strict=True)]


def _sim(flags: dict[str, Any], rate: float, *, n: int = 700, warmup: int = 300
         ) -> list[dg.Diagnosis]:
    reqs = _requests(n + warmup)
    plan = LoadPlan(slo=parse_slo("10s"), requests=reqs[warmup:],
                    warmup_requests=reqs[:warmup], warmup=warmup)
    result = evaluate(SimBackend("1xa100-80gb", "llama-3-8b"), flags, rate, plan)
    assert result.summary is not None
    ctx = {"thirds_rps": dg.thirds_throughput(result.records)}
    return dg.diagnose(result.summary, result.telemetry,
                       {"max_num_seqs": flags.get("max_num_seqs")}, ctx)


def _codes(diags: list[dg.Diagnosis]) -> set[str]:
    return {d.code for d in diags}


def test_healthy_simulated_run_is_silent() -> None:
    assert _sim({"max_num_seqs": 128}, 5.0) == []


def test_tiny_max_num_seqs_queues() -> None:
    diags = _sim({"max_num_seqs": 4}, 3.0, n=400)
    q = next(d for d in diags if d.code == "queueing")
    assert "p99 TTFT" in q.evidence and "of P99 E2E" in q.evidence
    assert "max_num_seqs" in q.next_step


def test_tiny_gpu_memory_utilization_gives_kv_pressure() -> None:
    diags = _sim({"max_num_seqs": 128, "gpu_memory_utilization": 0.22}, 8.0)
    kv = next(d for d in diags if d.code == "kv_pressure")
    assert "preemption" in kv.evidence and "(simulated)" in kv.evidence
    assert "gpu_memory_utilization" in kv.next_step


def test_low_rate_is_underfed() -> None:
    diags = _sim({"max_num_seqs": 128}, 0.3, n=400)
    (d,) = [d for d in diags if d.code == "underfed"]
    util = float(d.evidence.split("GPU util ")[1].split("%")[0])
    assert util < 70 and "max_num_seqs 128" in d.next_step


# ----------------------------------------------------------------------------- dict cases


def _summary(**over: Any) -> dict[str, Any]:
    """A healthy summary as ``Summary.to_dict()`` shapes it."""
    s: dict[str, Any] = {
        "num_completed": 1000, "scheduled_rate": 10.0, "request_throughput": 9.9,
        "send_lag_p99_s": 0.0002,
        "e2e": {"count": 1000, "mean": 4.0, "p50": 3.5, "p99": 8.0, "p99_lo": 7.5,
                "p99_hi": 8.8},
        "ttft": {"count": 1000, "mean": 0.05, "p50": 0.04, "p99": 0.15},
    }
    for key, value in over.items():
        if isinstance(value, dict):
            s[key] = {**s[key], **value}
        else:
            s[key] = value
    return s


HEALTHY_T = {"gpu_util_mean_pct": 85.0, "kv_usage_mean": 0.4, "kv_usage_max": 0.6,
             "preemptions": 0, "gpu_mem_used_per_gpu_bytes": [70e9, 71e9, 70.5e9, 70e9]}
HEALTHY_S = {"warmup": 100, "max_concurrency": None, "load_levels": [10, 20, 30],
             "tensor_parallel_sizes": [1, 4], "gpus": 4, "tensor_parallel_size": 4,
             "prompt_tokens_mean": 110.0, "prompt_tokens_std": 180.0}


def test_healthy_dict_case_is_silent() -> None:
    assert dg.diagnose(_summary(), HEALTHY_T, HEALTHY_S, {"thirds_rps": (9.8, 10.0, 10.1)}
                       ) == []


def test_memory_imbalance_under_tp() -> None:
    t = {**HEALTHY_T, "gpu_mem_used_per_gpu_bytes": [70e9, 70e9, 79e9, 70e9]}
    (d,) = dg.diagnose(_summary(), t, HEALTHY_S)
    assert d.code == "memory_imbalance" and "GPU 2" in d.evidence and "11%" in d.evidence
    # Not under TP=1: one engine per GPU may hold different loads.
    assert dg.diagnose(_summary(), t, {**HEALTHY_S, "tensor_parallel_size": 1}) == []


def test_client_limited_is_a_warning() -> None:
    (d,) = dg.diagnose(_summary(send_lag_p99_s=0.004, scheduled_rate=100.0), HEALTHY_T,
                       HEALTHY_S)
    assert d.code == "client_limited" and d.severity == dg.WARNING and "4.0 ms" in d.evidence
    # Judged against the gaps between arrivals: 3.7 ms at 1.4 req/s (gaps of 700 ms)
    # changes nothing, 40 ms does.
    assert dg.diagnose(_summary(send_lag_p99_s=0.0037, scheduled_rate=1.4), HEALTHY_T,
                       HEALTHY_S) == []
    (late,) = dg.diagnose(_summary(send_lag_p99_s=0.040, scheduled_rate=1.4), HEALTHY_T,
                          HEALTHY_S)
    assert late.code == "client_limited" and "35.7 ms" in late.evidence
    # All sent at once (rate inf): no schedule to fall behind.
    assert dg.diagnose(_summary(send_lag_p99_s=0.004, scheduled_rate=0.0), HEALTHY_T,
                       HEALTHY_S) == []


def test_too_few_requests_for_p99() -> None:
    s = _summary(e2e={"count": 150, "p99_hi": None}, num_completed=150)
    (d,) = dg.diagnose(s, HEALTHY_T, HEALTHY_S)
    assert d.code == "too_short" and "150" in d.evidence and "unbounded" in d.evidence


def test_unsteady_window() -> None:
    (d,) = dg.diagnose(_summary(), HEALTHY_T, HEALTHY_S, {"thirds_rps": (5.0, 8.0, 10.0)})
    assert d.code == "not_steady" and "50% apart" in d.evidence


def test_compute_bound_needs_a_plateau_or_saturation() -> None:
    t = {**HEALTHY_T, "gpu_util_mean_pct": 97.0}
    ctx = {"xs": [10, 20, 30], "tokens_per_s": [7200, 8900, 9100], "index": 2}
    (d,) = dg.diagnose(_summary(), t, HEALTHY_S, ctx)
    assert d.code == "compute_bound" and "8,900 -> 9,100" in d.evidence
    # High util while tokens/s still climbs is not the limit ...
    assert dg.diagnose(_summary(), t, HEALTHY_S, {**ctx, "index": 1}) == []
    # ... but serving well under the offered rate is.
    (d,) = dg.diagnose(_summary(request_throughput=6.0), t, HEALTHY_S)
    assert "serves 6.00 of 10.00" in d.evidence


def test_queueing_from_vllm_queue_time_and_from_ttft() -> None:
    t = {**HEALTHY_T, "queue_time_p99_s": 6.0}
    (d,) = dg.diagnose(_summary(), t, HEALTHY_S)
    assert d.code == "queueing" and "request_queue_time" in d.evidence
    # A short server-side queue time wins over a long TTFT tail.
    t_short = {**HEALTHY_T, "queue_time_p99_s": 0.1, "queue_time_mean_s": 0.01}
    s = _summary(ttft={"p50": 0.1, "p99": 5.0})
    assert dg.diagnose(s, t_short, HEALTHY_S) == []
    (d,) = dg.diagnose(s, HEALTHY_T, HEALTHY_S)
    assert "50.0x p50 TTFT" in d.evidence


def test_kv_near_full_without_preemption() -> None:
    (d,) = dg.diagnose(_summary(), {**HEALTHY_T, "kv_usage_max": 0.97}, HEALTHY_S)
    assert d.code == "kv_pressure" and "97%" in d.evidence


def test_missing_telemetry_stays_silent() -> None:
    assert dg.diagnose(_summary(), {}, {}) == []
    assert dg.diagnose(_summary(), None, None, None) == []


@pytest.mark.parametrize(("settings", "code"), [
    ({"warmup": 0}, "no_warmup"),
    ({"prompt_tokens_mean": 256.0, "prompt_tokens_std": 0.0}, "fixed_short_prompts"),
    ({"prompt_tokens_mean": 12.0, "prompt_tokens_std": 3.0}, "fixed_short_prompts"),
    ({"max_concurrency": 1}, "single_stream"),
    ({"load_levels": [20]}, "single_load_level"),
    ({"gpus": 4, "tensor_parallel_sizes": [4]}, "tp_not_compared"),
])
def test_pitfalls_warn_loudly(settings: dict[str, Any], code: str) -> None:
    (d,) = dg.pitfalls(settings)
    assert d.code == code and d.severity == dg.WARNING
    assert dg.pitfalls({**HEALTHY_S}) == []
    rich = dg.render([d], "rich")[0]
    assert rich.startswith("[bold yellow]WARNING")


def test_workload_settings_and_thirds() -> None:
    st = dg.workload_settings([10, 10, 10], "fixed prompt")
    assert st["prompt_tokens_std"] == 0 and st["prompt_tokens_mean"] == 10
    recs = [RequestRecord(index=i, scheduled_s=float(i), sent_s=float(i), end_s=float(i) + 0.5)
            for i in range(10)]
    thirds = dg.thirds_throughput(recs)
    assert thirds is not None and all(math.isclose(x, 1.0, rel_tol=0.25) for x in thirds)


def test_render_styles() -> None:
    d = dg.Diagnosis("x", "Title [a]", "evidence [1, 2]", "do this")
    assert dg.render([d], "markdown") == [
        "- **Title [a]** (`x`): evidence [1, 2]. Next: do this."]
    from rich.text import Text

    plain = Text.from_markup(dg.render([d], "rich")[0]).plain  # brackets survive markup
    assert "Title [a] (x): evidence [1, 2]. next: do this." == plain
    assert dg.render([], "plain") == ["No diagnosis fired."]
