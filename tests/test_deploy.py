"""The deployment plan: TP x DP choice, caps, cost, commands, gateway snippets."""

from __future__ import annotations

import re
import shlex

import pytest

from autotune.analysis.deploy import (
    DeployError,
    ReplicaResult,
    burst_size,
    choose_split,
    envoy_bucket,
    envoy_snippet,
    nginx_rate,
    nginx_snippet,
    plan_deployment,
    plan_text,
    serve_command,
)

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def rr(tp: int, rate: float, tok: float, req: float | None = None, **cfg) -> ReplicaResult:
    config = {"model": MODEL, "tensor_parallel_size": tp, "request_rate": rate, **cfg}
    return ReplicaResult(tensor_parallel_size=tp, ceiling_rate=rate, goodput_tokens=tok,
                         goodput_requests=req if req is not None else tok / 200, config=config)


def test_split_with_highest_total_goodput_wins():
    # TP=1 gives 800 tok/s on 1 GPU (x8 = 6400); TP=4 gives 3500 on 4 GPUs (x2 = 7000).
    results = [rr(1, 5, 800), rr(2, 10, 1500), rr(4, 22, 3500)]
    best, dp, cands = choose_split(results, 8)
    assert (best.tensor_parallel_size, dp) == (4, 2)
    assert {(shape, d): g for shape, d, g in cands} == {
        ("TP=1", 8): 6400, ("TP=2", 4): 6000, ("TP=4", 2): 7000}


def test_best_result_per_tp_is_used_and_tp_above_budget_is_skipped():
    results = [rr(1, 5, 800), rr(1, 6, 900), rr(8, 60, 99999)]
    best, dp, _ = choose_split(results, 4)
    assert best.goodput_tokens == 900 and dp == 4


def test_tie_prefers_fewer_gpus_then_smaller_tp():
    best, dp, _ = choose_split([rr(1, 5, 1000), rr(2, 10, 2000)], 4)
    assert (best.tensor_parallel_size, dp) == (1, 4)


def test_no_plan_when_nothing_fits_or_nothing_is_feasible():
    with pytest.raises(DeployError, match=r"at least 4 GPUs \(TP=4\).*--gpus 4"):
        choose_split([rr(4, 22, 3500)], 2)
    with pytest.raises(DeployError, match="nothing met the SLO"):
        choose_split([], 8)
    with pytest.raises(DeployError, match="--gpus must be at least 1"):
        choose_split([rr(1, 5, 800)], 0)


def test_plan_caps_cost_and_idle_gpus():
    plan = plan_deployment([rr(4, 22.0, 4400.0, 22.0)], 6, headroom=0.1, gpu_hour_cost=2.5)
    assert (plan.tensor_parallel_size, plan.data_parallel_size, plan.idle_gpus) == (4, 1, 2)
    assert plan.cap_per_replica == pytest.approx(19.8)
    assert plan.total_cap == pytest.approx(19.8)
    # 200 output tokens per request at 19.8 req/s = 3960 tok/s; 4 GPUs x $2.5/h.
    assert plan.output_tokens_per_s_at_cap == pytest.approx(3960.0)
    assert plan.cost_per_million_output_tokens == pytest.approx(10.0 / (3960 * 3600) * 1e6)
    text = plan_text(plan)
    assert "TP=4 x DP=1" in text and "2 idle" in text and "$0.701 per million" in text


def test_output_tokens_at_the_cap_never_exceed_the_goodput_at_the_ceiling():
    # At the ceiling, 63.75 of 70.8 req/s met the SLO: tokens at the cap are the good
    # ones scaled down, not the cap's rate times tokens per good request.
    r = rr(4, 70.8, 10437.0, 63.75)
    plan = plan_deployment([r], 8, headroom=0.1)
    assert plan.data_parallel_size == 2
    assert plan.goodput_tokens == pytest.approx(2 * 10437.0)
    assert plan.output_tokens_per_s_at_cap == pytest.approx(2 * 10437.0 * 0.9)
    assert plan.output_tokens_per_s_at_cap < plan.goodput_tokens


def test_replica_commands_have_their_own_gpus_and_ports():
    plan = plan_deployment([rr(2, 10, 1500, enable_chunked_prefill=False, max_num_seqs=192)],
                           8, base_port=9000)
    assert plan.data_parallel_size == 4
    envs = [r.command.split()[0] for r in plan.replicas]
    assert envs == ["CUDA_VISIBLE_DEVICES=0,1", "CUDA_VISIBLE_DEVICES=2,3",
                    "CUDA_VISIBLE_DEVICES=4,5", "CUDA_VISIBLE_DEVICES=6,7"]
    ports = [r.port for r in plan.replicas]
    assert ports == [9000, 9001, 9002, 9003]
    argv = shlex.split(plan.replicas[1].command)
    assert argv[1:4] == ["vllm", "serve", MODEL]
    assert argv[argv.index("--port") + 1] == "9001"
    assert "--no-enable-chunked-prefill" in argv and "--max-num-seqs" in argv
    assert not any("request-rate" in a for a in argv)  # client-side, not a server flag


def test_serve_command_needs_a_model():
    with pytest.raises(DeployError, match="--model"):
        serve_command({"max_num_seqs": 8}, gpus=[0], port=8000)
    assert " vllm serve my/model " in serve_command({"max_num_seqs": 8}, gpus=[0], port=1,
                                                     model="my/model")


@pytest.mark.parametrize("rate,expected", [
    (22.0, "22r/s"), (19.8, "1188r/m"), (0.5, "30r/m"), (43.21, "2592r/m"), (1.0, "1r/s")])
def test_nginx_rate_is_whole_and_never_above_the_cap(rate, expected):
    text = nginx_rate(rate)
    assert text == expected
    n, unit = re.fullmatch(r"(\d+)r/([sm])", text).groups()
    assert int(n) / (1 if unit == "s" else 60) <= rate + 1e-12


def test_nginx_rate_refuses_what_it_cannot_say():
    with pytest.raises(DeployError, match="1r/m"):
        nginx_rate(0.01)
    with pytest.raises(DeployError):
        nginx_rate(float("inf"))


@pytest.mark.parametrize("rate", [0.3, 1.0, 7.7, 19.8, 43.2, 250.0, 1234.5])
def test_envoy_bucket_rate_is_at_most_the_cap_and_close(rate):
    tokens, interval_ms = envoy_bucket(rate)
    got = tokens * 1000.0 / interval_ms
    assert interval_ms >= 50 and tokens >= 1
    assert got <= rate * (1 + 1e-12)
    assert got >= rate * 0.99


def test_gateway_snippets_hold_cap_burst_and_replicas():
    plan = plan_deployment([rr(1, 5.5, 1100)], 2, headroom=0.0)
    nginx = nginx_snippet(plan.total_cap, plan.replicas, burst_seconds=2.0)
    assert "limit_req_zone $server_name zone=vllm:1m rate=11r/s;" in nginx
    assert f"burst={burst_size(11.0, 2.0)} nodelay" in nginx and "burst=22" in nginx
    assert "server 127.0.0.1:8000;" in nginx and "server 127.0.0.1:8001;" in nginx
    envoy = envoy_snippet(plan.total_cap)
    assert "envoy.filters.http.local_ratelimit" in envoy
    tokens = int(re.search(r"tokens_per_fill: (\d+)", envoy).group(1))
    interval = float(re.search(r"fill_interval: ([\d.]+)s", envoy).group(1))
    assert tokens / interval <= 11.0 + 1e-9
    assert int(re.search(r"max_tokens: (\d+)", envoy).group(1)) >= 11


def test_bad_headroom_and_cost():
    with pytest.raises(DeployError, match="headroom"):
        plan_deployment([rr(1, 5, 800)], 1, headroom=1.0)
    with pytest.raises(DeployError, match="gpu-hour-cost"):
        plan_deployment([rr(1, 5, 800)], 1, gpu_hour_cost=-1)


def test_pipeline_parallel_replicas_count_all_their_gpus():
    r = ReplicaResult(tensor_parallel_size=2, pipeline_parallel_size=2, ceiling_rate=20.0,
                      goodput_tokens=4000.0, goodput_requests=20.0,
                      config={"model": MODEL, "tensor_parallel_size": 2,
                              "pipeline_parallel_size": 2})
    plan = plan_deployment([r, rr(2, 8, 1500)], 8, gpu_hour_cost=1.0)
    assert plan.replica is r and plan.data_parallel_size == 2 and plan.used_gpus == 8
    assert [rep.cuda_visible_devices for rep in plan.replicas] == ["0,1,2,3", "4,5,6,7"]
    assert "TP=2xPP=2 x DP=2" in plan_text(plan)
    assert plan.cost_per_million_output_tokens == pytest.approx(
        8 / (2 * 20.0 * 0.9 * 200 * 3600) * 1e6)
