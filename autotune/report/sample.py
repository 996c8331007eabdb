"""A small hand-made study in ``autotune.study.study``'s layout, for tests and demos.

The load tests are synthetic (a queue whose latency climbs as the offered rate nears
each config's capacity, then grows without bound past it), summarised by the real
``metrics.summarize``; the trials say so in their ``source``.
"""

from __future__ import annotations

import math
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from autotune.core.metrics import summarize
from autotune.core.records import RequestRecord
from autotune.core.slo import parse_slo

SOURCE = "simulated (synthetic queue, for tests)"


def synthetic_records(rate: float, capacity: float, n: int = 120, out_tokens: int = 200,
                      base_tpot: float = 0.02, seed: int = 0) -> list[RequestRecord]:
    """Requests at ``rate`` against a server that completes ``capacity`` req/s."""
    rho = rate / capacity
    records = []
    backlog_s = 0.0
    for i in range(n):
        sent = i / rate
        jitter = 1.0 + 0.15 * math.sin(i * 1.7 + seed)
        if rho < 1:
            wait = 0.2 * rho / (1 - rho) * jitter
        else:
            backlog_s += (1 / capacity - 1 / rate)  # the queue grows every arrival
            wait = backlog_s * jitter
        ttft = 0.05 + wait
        tpot = base_tpot * (1 + rho) * jitter
        first = sent + ttft
        chunks = [first + k * tpot for k in range(out_tokens)]
        records.append(RequestRecord(
            index=i, scheduled_s=sent, dispatched_s=sent, sent_s=sent, first_token_s=first,
            chunk_times_s=chunks, end_s=chunks[-1], prompt_tokens=100,
            output_tokens=out_tokens, expected_output_tokens=out_tokens, status=200))
    return records


def make_sample_study(storage: str, name: str = "sample", *, feasible: bool = True,
                      telemetry: bool = True) -> Any:
    """Ten trials: a baseline, configs at several rates, a pruned one, a rule break."""
    slo_text = "p99:e2e<=10s" if feasible else "p99:e2e<=1s"
    slo = parse_slo(slo_text)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    for key, value in {"slo": slo_text, "space": "sample", "objective": "tokens",
                       "per_gpu": False, "gpus": 4, "backend": "sim",
                       "hardware": "a100-80gb", "model": "llama-3-8b"}.items():
        study.set_user_attr(key, value)
    dists = {"tensor_parallel_size": CategoricalDistribution([1, 2, 4, 8]),
             "max_num_seqs": IntDistribution(64, 512, step=64),
             "request_rate": FloatDistribution(1.0, 64.0, log=True)}
    # (tp, seqs, rate, capacity req/s, kind)
    plan = [(1, 256, 4.0, 8.0, "baseline"), (4, 128, 10.0, 28.0, ""), (4, 128, 20.0, 28.0, ""),
            (4, 128, 30.0, 28.0, "pruned"), (4, 192, 22.0, 31.0, ""), (4, 192, 28.0, 31.0, ""),
            (2, 192, 12.0, 16.0, ""), (2, 192, 15.0, 16.0, ""), (1, 256, 6.0, 8.0, ""),
            (8, 256, 10.0, 50.0, "rule")]
    for number, (tp, seqs, rate, cap, kind) in enumerate(plan):
        flags = {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "tensor_parallel_size": tp,
                 "max_num_seqs": seqs, "enable_chunked_prefill": True}
        params = {"tensor_parallel_size": tp, "max_num_seqs": seqs, "request_rate": rate}
        if kind == "rule":
            result = {"status": "infeasible", "feasible": False, "reason": "tp_fits_gpus",
                      "detail": "TP 8 needs 8 GPUs, 4 given", "flags": flags, "rate": rate,
                      "launched": False}
            study.add_trial(optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE, value=0.0, params=params,
                distributions=dists,
                user_attrs={"result": result, "status": "infeasible",
                            "reason": "tp_fits_gpus", "feasible": False},
                constraints={str(slo.limits[0].label): 1000.0, "runs": 1.0}))
            continue
        records = synthetic_records(rate, cap, seed=number)
        summary = summarize(records, slo=slo, offered_rate=rate, source=SOURCE)
        met = bool(summary.slo_check and summary.slo_check.met)
        pruned = kind == "pruned"
        status = "pruned" if pruned else "complete"
        reason = "backlog" if pruned else (None if met else "slo_missed")
        span = records[-1].end_s or 1.0
        tel: dict[str, Any] = {"source": "simulated", "gpu_util_mean_pct": 60 + 10 * tp,
                               "gpu_util_max_pct": 99.0}
        if telemetry:
            tel["timeline"] = [{"t_s": t, "kv_cache_usage": min(0.95, 0.1 + t / span),
                                "running": min(seqs, 5 + t), "waiting": 0.0}
                               for t in range(0, int(span) + 1)]
            tel["gpu_samples"] = [{"t_s": t / 2, "gpu": 0, "util_pct": 70 + 25 * (t % 2)}
                                  for t in range(0, int(span * 2) + 1)]
        attrs = {
            "status": status, "feasible": met and not pruned, "mode": "virtual",
            "backend": "sim", "reason": reason,
            "detail": "in-flight requests kept growing" if pruned else None,
            "flags": flags, "rate": rate, "gpus": tp, "summary": summary.to_dict(),
            "how": summary.how(), "telemetry": tel, "launched": True,
            "windows": [[float(t), float(min(40, 3 + t * (3 if pruned else 0.2))), float(t)]
                        for t in range(0, int(span) + 1)],
        }
        user_attrs = {"result": attrs, "status": status, "reason": reason,
                      "feasible": met and not pruned}
        if kind == "baseline":
            user_attrs["baseline"] = True
        margins = summary.slo_check.margins if summary.slo_check else {}
        constraints = {k: min(float(v), 1000.0) for k, v in margins.items()}
        constraints["runs"] = 0.0
        value = summary.goodput_tokens if not pruned else None
        study.add_trial(optuna.trial.create_trial(
            state=(optuna.trial.TrialState.PRUNED if pruned
                   else optuna.trial.TrialState.COMPLETE),
            value=value, params=params, distributions=dists, user_attrs=user_attrs,
            intermediate_values={0: summary.goodput_tokens} if pruned else None,
            constraints=constraints))
    return study
