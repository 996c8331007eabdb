"""A deployment plan for N GPUs from per-replica results (pure).

Input: for each tensor-parallel size, the best feasible replica measured (goodput,
the highest rate that met the SLO and the config).  Output: the TP x DP split of the
GPU budget with the highest total goodput, the rate cap per replica and in total
(with headroom under the ceiling), the cost per million output tokens at the cap,
one ``vllm serve`` command per replica, and gateway rate-limit snippets (nginx
``limit_req`` and an Envoy local rate limit token bucket).

Replicas are independent copies behind a load balancer, so a plan's goodput is the
replica's goodput times DP; that is the assumption every figure here rests on, and
the plan says so.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autotune.core.errors import AutotuneError
from autotune.core.flags import CLIENT_PARAMS
from autotune.servers.vllm import config_to_flags

# Keys of a config that shape the client's load, not the server.
BASE_PORT = 8000
ENVOY_MIN_FILL_MS = 50  # Envoy refuses a token-bucket fill_interval under 50 ms


class DeployError(AutotuneError, ValueError):
    """No plan can be made from what was given (the message says what is missing)."""


@dataclass(frozen=True)
class ReplicaResult:
    """The best feasible result of one replica shape (one TP size).

    ``ceiling_rate``: the highest offered rate (req/s) that met the SLO (from the
    ceiling search when there was one, else the best feasible trial's rate).
    ``goodput_tokens``/``goodput_requests``: measured at ``ceiling_rate``.
    """

    tensor_parallel_size: int
    ceiling_rate: float
    goodput_tokens: float
    goodput_requests: float
    config: Mapping[str, Any] = field(default_factory=dict)
    p99_e2e_s: float | None = None
    trial: int | None = None
    source: str = ""
    pipeline_parallel_size: int = 1

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * max(self.pipeline_parallel_size, 1)

    @property
    def shape(self) -> str:
        pp = self.pipeline_parallel_size
        return f"TP={self.tensor_parallel_size}" + (f"xPP={pp}" if pp > 1 else "")


@dataclass(frozen=True)
class Replica:
    index: int
    gpus: tuple[int, ...]
    port: int
    command: str

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)


@dataclass(frozen=True)
class Plan:
    gpus: int
    tensor_parallel_size: int
    data_parallel_size: int
    replica: ReplicaResult
    headroom: float
    cap_per_replica: float  # req/s each replica admits
    total_cap: float  # req/s the gateway admits
    goodput_tokens: float  # total, at the measured ceiling
    output_tokens_per_s_at_cap: float  # total, at the cap
    gpu_hour_cost: float | None
    cost_per_million_output_tokens: float | None
    replicas: tuple[Replica, ...]
    idle_gpus: int
    alternatives: tuple[tuple[str, int, float], ...]  # (shape, dp, total goodput tok/s)

    @property
    def used_gpus(self) -> int:
        return self.replica.gpus_per_replica * self.data_parallel_size


# ----------------------------------------------------------------------------- choice


def best_per_tp(results: Iterable[ReplicaResult]) -> dict[tuple[int, int], ReplicaResult]:
    """Per replica shape (TP, PP), the result with the highest goodput (tokens)."""
    best: dict[tuple[int, int], ReplicaResult] = {}
    for r in results:
        if r.tensor_parallel_size < 1 or not r.ceiling_rate > 0:
            continue
        key = (r.tensor_parallel_size, max(r.pipeline_parallel_size, 1))
        cur = best.get(key)
        if cur is None or r.goodput_tokens > cur.goodput_tokens:
            best[key] = r
    return best


def choose_split(
    results: Iterable[ReplicaResult], gpus: int
) -> tuple[ReplicaResult, int, list[tuple[str, int, float]]]:
    """The replica shape and DP with the highest total goodput on ``gpus`` GPUs.

    Ties go to fewer GPUs used, then to smaller replicas (more replicas: more fault
    tolerance).  Returns (replica, dp, every candidate as (shape, dp, total goodput)).
    """
    if gpus < 1:
        raise DeployError(f"--gpus must be at least 1, got {gpus}")
    per_shape = best_per_tp(results)
    if not per_shape:
        raise DeployError("no feasible replica result: nothing met the SLO, so no plan")
    fitting = [r for _, r in sorted(per_shape.items()) if r.gpus_per_replica <= gpus]
    if not fitting:
        smallest = min(per_shape.values(), key=lambda r: r.gpus_per_replica)
        n = smallest.gpus_per_replica
        raise DeployError(
            f"every feasible config needs at least {n} GPUs ({smallest.shape}) but "
            f"--gpus is {gpus}; give --gpus {n} or more"
        )
    scored = [(r, gpus // r.gpus_per_replica) for r in fitting]
    best, dp = max(scored, key=lambda c: (c[1] * c[0].goodput_tokens,
                                          -c[0].gpus_per_replica * c[1],
                                          -c[0].gpus_per_replica))
    return best, dp, [(r.shape, d, d * r.goodput_tokens) for r, d in scored]


def plan_deployment(
    results: Iterable[ReplicaResult],
    gpus: int,
    *,
    headroom: float = 0.1,
    gpu_hour_cost: float | None = None,
    model: str | None = None,
    base_port: int = BASE_PORT,
    host: str = "0.0.0.0",
    first_gpu: int = 0,
) -> Plan:
    """The whole plan: split, caps, cost, commands; the replicas take GPUs from
    ``first_gpu`` on (another plan on the same host has the ones before)."""
    if not 0 <= headroom < 1:
        raise DeployError(f"--headroom must be in [0, 1), got {headroom:g}")
    if gpu_hour_cost is not None and not gpu_hour_cost >= 0:
        raise DeployError(f"--gpu-hour-cost must be >= 0, got {gpu_hour_cost:g}")
    replica, dp, candidates = choose_split(results, gpus)
    tp = replica.tensor_parallel_size
    per = replica.gpus_per_replica
    cap = replica.ceiling_rate * (1.0 - headroom)
    total_cap = cap * dp
    # The ceiling's goodput scaled down to the cap: at most the goodput measured at the
    # ceiling (a rate times tokens per request would count requests that missed the SLO
    # and could print more tokens at the cap than at the higher ceiling).
    tok_at_cap = dp * replica.goodput_tokens * (cap / replica.ceiling_rate
                                                if replica.ceiling_rate > 0 else 0.0)
    cost = None
    if gpu_hour_cost is not None and tok_at_cap > 0:
        cost = per * dp * gpu_hour_cost / (tok_at_cap * 3600.0) * 1e6
    replicas = tuple(
        Replica(
            index=i,
            gpus=tuple(range(first_gpu + i * per, first_gpu + (i + 1) * per)),
            port=base_port + i,
            command=serve_command(replica.config,
                                  gpus=range(first_gpu + i * per, first_gpu + (i + 1) * per),
                                  port=base_port + i, model=model, host=host),
        )
        for i in range(dp)
    )
    return Plan(
        gpus=gpus,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        replica=replica,
        headroom=headroom,
        cap_per_replica=cap,
        total_cap=total_cap,
        goodput_tokens=dp * replica.goodput_tokens,
        output_tokens_per_s_at_cap=tok_at_cap,
        gpu_hour_cost=gpu_hour_cost,
        cost_per_million_output_tokens=cost,
        replicas=replicas,
        idle_gpus=gpus - per * dp,
        alternatives=tuple(candidates),
    )


# ----------------------------------------------------------------------------- commands


def serve_command(
    config: Mapping[str, Any],
    *,
    gpus: Iterable[int],
    port: int,
    model: str | None = None,
    host: str = "0.0.0.0",
) -> str:
    """``CUDA_VISIBLE_DEVICES=0,1 vllm serve MODEL --host H --port P --flags...``."""
    flags = {k: v for k, v in config.items() if k not in CLIENT_PARAMS}
    model = model or flags.pop("model", None)
    flags.pop("model", None)
    if not model:
        raise DeployError("the config names no model; pass --model")
    devices = ",".join(str(g) for g in gpus)
    argv = ["vllm", "serve", str(model), "--host", host, "--port", str(port),
            *config_to_flags(flags)]
    return f"CUDA_VISIBLE_DEVICES={devices} " + shlex.join(argv)


# ----------------------------------------------------------------------------- gateway


def nginx_rate(rate: float) -> str:
    """nginx takes only whole ``Nr/s`` or ``Nr/m``: never above ``rate``.

    Whole req/s stay ``r/s``; anything else becomes requests per minute, rounded
    down (a cap the gateway enforces must not admit more than was measured).
    """
    if not rate > 0 or math.isinf(rate):
        raise DeployError(f"a gateway rate must be positive and finite, got {rate:g}")
    per_s = round(rate)
    if per_s >= 1 and abs(rate - per_s) < 1e-9:
        return f"{per_s}r/s"
    per_min = math.floor(rate * 60.0 + 1e-9)
    if per_min < 1:
        raise DeployError(f"rate cap {rate:g} req/s is under nginx's smallest rate, 1r/m")
    return f"{per_min}r/m"


def burst_size(rate: float, burst_seconds: float = 1.0) -> int:
    """Requests a burst may hold: ``burst_seconds`` worth of the cap, at least 1."""
    return max(1, math.ceil(rate * burst_seconds - 1e-9))


def nginx_snippet(total_cap: float, replicas: Sequence[Replica], *,
                  burst_seconds: float = 1.0, zone: str = "vllm") -> str:
    rate = nginx_rate(total_cap)
    burst = burst_size(total_cap, burst_seconds)
    servers = "\n".join(f"    server 127.0.0.1:{r.port};" for r in replicas)
    # One shared key ($server_name) makes the limit global, not per client.
    return (
        f"# nginx: cap {total_cap:.3g} req/s in total ({rate}), bursts up to {burst}\n"
        f"# (http block)\n"
        f"limit_req_zone $server_name zone={zone}:1m rate={rate};\n"
        f"limit_req_status 429;\n"
        f"upstream {zone}_replicas {{\n    least_conn;\n{servers}\n}}\n"
        f"# (server block)\n"
        f"location /v1/ {{\n"
        f"    limit_req zone={zone} burst={burst} nodelay;\n"
        f"    proxy_pass http://{zone}_replicas;\n"
        f"    proxy_buffering off;  # stream tokens as they come\n"
        f"    proxy_read_timeout 3600s;\n"
        f"}}\n"
    )


def envoy_bucket(rate: float, max_fill_ms: int = 60_000) -> tuple[int, int]:
    """(tokens_per_fill, fill_interval_ms) whose rate is at most ``rate``, closest to it.

    Prefers the shortest interval that gets within 1% (smoother refill).
    """
    if not rate > 0 or math.isinf(rate):
        raise DeployError(f"a gateway rate must be positive and finite, got {rate:g}")
    best: tuple[float, int, int] | None = None
    for tokens in range(1, 10_001):
        interval = max(ENVOY_MIN_FILL_MS, math.ceil(tokens * 1000.0 / rate - 1e-9))
        if interval > max_fill_ms:
            break
        err = (rate - tokens * 1000.0 / interval) / rate
        if best is None or err < best[0] - 1e-12:
            best = (err, tokens, interval)
        if err <= 0.01:
            return tokens, interval
    if best is None:
        raise DeployError(f"rate cap {rate:g} req/s is too low for an Envoy token bucket")
    return best[1], best[2]


def envoy_snippet(total_cap: float, *, burst_seconds: float = 1.0) -> str:
    tokens, interval_ms = envoy_bucket(total_cap)
    burst = burst_size(total_cap, burst_seconds)
    interval = f"{interval_ms / 1000:g}s"
    return (
        f"# Envoy: cap {total_cap:.3g} req/s ({tokens} every {interval}), bucket of {burst}\n"
        "http_filters:\n"
        "- name: envoy.filters.http.local_ratelimit\n"
        "  typed_config:\n"
        '    "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3'
        ".LocalRateLimit\n"
        "    stat_prefix: vllm_rate_cap\n"
        "    token_bucket:\n"
        f"      max_tokens: {max(burst, tokens)}\n"
        f"      tokens_per_fill: {tokens}\n"
        f"      fill_interval: {interval}\n"
        "    filter_enabled:\n"
        "      runtime_key: vllm_rate_cap_enabled\n"
        "      default_value: {numerator: 100, denominator: HUNDRED}\n"
        "    filter_enforced:\n"
        "      runtime_key: vllm_rate_cap_enforced\n"
        "      default_value: {numerator: 100, denominator: HUNDRED}\n"
    )


# ----------------------------------------------------------------------------- text


def plan_text(plan: Plan, *, how: str = "") -> str:
    """The plan as Markdown-friendly plain text."""
    r = plan.replica
    lines = [
        f"Deployment plan for {plan.gpus} GPUs: {r.shape} x "
        f"DP={plan.data_parallel_size} ({plan.used_gpus} GPUs used"
        + (f", {plan.idle_gpus} idle" if plan.idle_gpus else "") + ")",
    ]
    if how:
        lines.append(f"Based on: {how}")
    lines += [
        f"Per replica: ceiling {r.ceiling_rate:.3g} req/s meeting the SLO"
        + (f" (trial {r.trial})" if r.trial is not None else "")
        + f", goodput {r.goodput_tokens:,.0f} output tok/s",
        f"Rate cap: {plan.cap_per_replica:.3g} req/s per replica "
        f"({plan.headroom:.0%} headroom), {plan.total_cap:.3g} req/s in total",
        f"Output tokens at the cap: {plan.output_tokens_per_s_at_cap:,.0f} tok/s in total "
        f"(the ceiling's goodput, {plan.goodput_tokens:,.0f} tok/s in total, scaled by "
        f"cap/ceiling = {1.0 - plan.headroom:.0%})",
    ]
    if plan.cost_per_million_output_tokens is not None:
        lines.append(
            f"Cost at the cap: ${plan.cost_per_million_output_tokens:.3f} per million "
            f"output tokens ({plan.used_gpus} GPUs x ${plan.gpu_hour_cost:g}/GPU-hour)"
        )
    alts = ", ".join(f"{shape} x DP={dp}: {g:,.0f} tok/s"
                     for shape, dp, g in plan.alternatives)
    lines.append(f"Splits compared (total goodput at the ceiling): {alts}")
    lines.append("Assumes replicas are independent and the load balancer spreads "
                 "requests evenly.")
    lines.append("")
    lines.append("Replicas:")
    lines += [f"  {rep.command}" for rep in plan.replicas]
    return "\n".join(lines)
