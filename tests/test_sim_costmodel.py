"""The simulator's cost model, profiles and start-up checks (refusals, KV sizing)."""

from __future__ import annotations

import math
from itertools import islice

import numpy as np
import pytest

from autotune.sim import (
    ConfigRefused,
    EngineConfig,
    ProfileError,
    list_profiles,
    load_hardware,
    load_model,
    resolve,
)
from autotune.sim.config import batch_defaults
from autotune.sim.costmodel import CostModel


def setup_for(model: str = "llama-3-8b", hw: str = "a100-80gb", **kw: object):
    return resolve(EngineConfig(model, **kw), load_hardware(hw), load_model(model))  # type: ignore[arg-type]


def test_profiles_listed_and_loadable() -> None:
    names = list_profiles()
    assert {"a100-80gb", "h100-80gb", "h200", "l40s", "cpu-tiny"} <= set(names["hardware"])
    assert {"llama-3-8b", "llama-3-70b", "qwen2.5-7b", "tiny"} <= set(names["model"])
    for n in names["hardware"]:
        hw = load_hardware(n)
        assert 0 < hw.compute_efficiency <= 1 and 0 < hw.bandwidth_efficiency <= 1
    for n in names["model"]:
        assert load_model(n).num_params > 0


def test_model_dimensions_give_the_published_parameter_counts() -> None:
    assert load_model("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert load_model("llama-3-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert load_model("qwen2.5-7b").num_params == pytest.approx(7.62e9, rel=0.01)
    # Llama-3-8B KV: 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes = 128 KiB per token
    assert load_model("llama-3-8b").kv_bytes_per_token == 131072


def test_gpu_count_prefix_and_with_gpus() -> None:
    assert load_hardware("4xa100-80gb").gpus == 4
    assert load_hardware("a100-80gb").with_gpus(2).gpus == 2
    with pytest.raises(ProfileError, match="unknown hardware profile"):
        load_hardware("a100-40gb")
    assert load_model("meta-llama/Meta-Llama-3-8B-Instruct").name == "llama-3-8b"


def test_vllm_batch_defaults_depend_on_the_gpu() -> None:
    assert batch_defaults(load_hardware("a100-80gb"), 1) == (2048, 256)
    assert batch_defaults(load_hardware("h100-80gb"), 1) == (8192, 1024)
    assert batch_defaults(load_hardware("l40s"), 1) == (2048, 256)
    assert batch_defaults(load_hardware("cpu-tiny"), 1) == (2048, 128)
    s = setup_for(enable_chunked_prefill=False)
    assert s.max_num_batched_tokens == 8192  # at least max_model_len without chunking


def test_kv_capacity_follows_the_memory_formula() -> None:
    s = setup_for()
    m, hw = load_model("llama-3-8b"), load_hardware("a100-80gb")
    free = hw.memory_bytes * 0.9 - m.weight_bytes - s.activation_gib_per_gpu * 2**30
    assert s.kv_capacity_tokens == pytest.approx(free / m.kv_bytes_per_token, rel=0.001)
    assert s.kv_capacity_tokens % 16 == 0
    assert s.max_concurrency == pytest.approx(s.num_gpu_blocks / (8192 / 16))
    # TP shards the KV heads: each GPU holds 1/TP of every token, and weights shrink
    tp4 = setup_for(tensor_parallel_size=4)
    assert tp4.kv_capacity_tokens > 4 * s.kv_capacity_tokens
    lower = setup_for(gpu_memory_utilization=0.5)
    assert lower.kv_capacity_tokens < s.kv_capacity_tokens


def test_log_lines_use_vllms_wording() -> None:
    lines = setup_for().log_lines()
    assert any(line.startswith("# GPU blocks: ") for line in lines)
    assert any(line.startswith("GPU KV cache size: ") and line.endswith(" tokens")
               for line in lines)
    assert any(line.startswith("Maximum concurrency for 8,192 tokens per request: ")
               for line in lines)


@pytest.mark.parametrize(
    ("kw", "model", "hw", "message"),
    [
        ({"tensor_parallel_size": 3}, "llama-3-8b", "a100-80gb",
         r"Total number of attention heads \(32\) must be divisible by tensor parallel size \(3\)"),
        ({"tensor_parallel_size": 8}, "qwen2.5-7b", "h100-80gb", r"attention heads \(28\)"),
        ({"tensor_parallel_size": 8}, "llama-3-8b", "4xa100-80gb",
         r"please set tensor_parallel_size \(8\) to less than max local gpu count \(4\)"),
        ({}, "llama-3-70b", "a100-80gb", r"CUDA out of memory"),
        ({"gpu_memory_utilization": 0.2}, "llama-3-8b", "a100-80gb",
         r"No available memory for the cache blocks"),
        ({"gpu_memory_utilization": 0.215}, "llama-3-8b", "a100-80gb",
         r"To serve at least one request with the models's max seq len \(8192\)"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}, "llama-3-8b",
         "a100-80gb", r"max_num_batched_tokens \(2048\) is smaller than max_model_len \(8192\)"),
        ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "llama-3-8b", "a100-80gb",
         r"must be greater than or equal to max_num_seqs"),
        ({"max_model_len": 100_000}, "llama-3-8b", "a100-80gb", r"max_model_len \(100000\)"),
    ],
)
def test_refused_configs(kw: dict, model: str, hw: str, message: str) -> None:
    with pytest.raises(ConfigRefused, match=message):
        resolve(EngineConfig(model, **kw), load_hardware(hw), load_model(model))


def test_70b_starts_with_tp_2_or_more() -> None:
    assert setup_for("llama-3-70b", tensor_parallel_size=2).num_gpu_blocks > 0


def test_from_flags_accepts_vllm_names() -> None:
    c = EngineConfig.from_flags({"model": "llama-3-8b", "--max-num-seqs": "64",
                                 "tensor_parallel_size": 2, "no-enable-chunked-prefill": True,
                                 "gpu-memory-utilization": "0.8"})
    assert c == EngineConfig("llama-3-8b", tensor_parallel_size=2, max_num_seqs=64,
                             enable_chunked_prefill=False, gpu_memory_utilization=0.8)
    assert EngineConfig.from_flags(c.to_flags()) == c
    with pytest.raises(ValueError, match="unknown engine flag"):
        EngineConfig.from_flags({"model": "x", "max-num-seq": 3})


def test_single_decode_step_is_weight_streaming_bound() -> None:
    s = setup_for()
    cm = CostModel.for_setup(s)
    c = cm.step(tokens=1, seqs=1, kv_tokens=500, pairs=500)
    hw, m = s.hardware, s.model
    roofline = m.weight_bytes / hw.achieved_bandwidth
    assert c.gpu_s == pytest.approx(roofline, rel=0.01)
    assert 0.008 < c.total_s < 0.015  # ~11 ms ITL for Llama-3-8B on A100 (simulated)


def test_prefill_becomes_compute_bound_and_grows_with_tokens() -> None:
    cm = CostModel.for_setup(setup_for())
    small = cm.step(64, 1, 64, 64 * 32)
    big = cm.step(2048, 1, 2048, 2048 * 1024)
    assert big.gpu_s > 3 * small.gpu_s
    assert big.gpu_s > 2 * 2048 * load_model("llama-3-8b").matmul_params / (
        load_hardware("a100-80gb").achieved_flops) * 0.99


def test_tensor_parallel_is_faster_but_sublinear() -> None:
    one = CostModel.for_setup(setup_for()).step(64, 64, 64 * 400, 64 * 400).total_s
    four = CostModel.for_setup(setup_for(tensor_parallel_size=4)).step(
        64, 64, 64 * 400, 64 * 400).total_s
    assert one / 4 < four < one
    pcie = CostModel.for_setup(setup_for(hw="l40s", tensor_parallel_size=4))
    nvl = CostModel.for_setup(setup_for(tensor_parallel_size=4))
    assert pcie.s_comm_per_token > 5 * nvl.s_comm_per_token  # PCIe all-reduce is slower


def test_vectorised_decode_steps_equal_scalar_steps() -> None:
    cm = CostModel.for_setup(setup_for(tensor_parallel_size=2))
    tot, gpu = cm.decode_steps(37, 12_345.0, 50)
    for j in (0, 7, 49):
        c = cm.step(37, 37, 12_345 + 37 * j, 12_345 + 37 * j)
        assert math.isclose(tot[j], c.total_s) and math.isclose(gpu[j], c.gpu_s)
    assert np.all(np.diff(tot) >= 0)  # longer contexts never make a step faster


@pytest.mark.parametrize(("hw", "model", "seqs"), [
    ("a100-80gb", "llama-3-8b", 37),  # memory-bound at every context
    ("a100-80gb", "llama-3-8b", 400),  # compute-bound, then memory-bound past ~245k KV
    ("cpu-tiny", "tiny", 5),
])
def test_decode_steps_step_by_step_and_vectorised_are_bit_identical(
        hw: str, model: str, seqs: int) -> None:
    cm = CostModel.for_setup(setup_for(model, hw, tensor_parallel_size=1))
    kv0, k = 12_345.0, 1000
    tot, gpu = cm.decode_steps(seqs, kv0, k)
    # The plain formula, max included, as the vectorised one must reproduce it exactly.
    kv = kv0 + seqs * np.arange(k, dtype=np.float64)
    compute = seqs * cm.s_per_token_compute + kv * cm.s_per_pair
    memory = cm.s_weights + kv * cm.s_per_kv_token
    want_gpu = np.maximum(compute, memory) + (cm.s_comm_fixed + seqs * cm.s_comm_per_token)
    assert np.array_equal(gpu, want_gpu)
    assert np.array_equal(tot, want_gpu + (cm.s_step + seqs * cm.s_per_seq))
    steps = list(islice(cm.decode_step_iter(seqs, kv0), k))
    assert steps == list(zip(tot.tolist(), gpu.tolist(), strict=True))
    assert cm.decode_steps(seqs, kv0, 0)[0].shape == (0,)


def test_model_folder_config_json_is_read(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 8, '
        '"num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 500, '
        '"max_position_embeddings": 1024, "torch_dtype": "bfloat16"}')
    m = load_model(str(tmp_path))
    assert (m.num_layers, m.head_dim, m.num_kv_heads, m.max_model_len) == (4, 16, 2, 1024)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ProfileError, match="config.json"):
        load_model(str(tmp_path))


def test_tiny_profile_matches_the_tiny_test_model_spec() -> None:
    from autotune.testing import tiny_model

    spec = tiny_model.TinyLlamaSpec()
    m = load_model("tiny")
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads,
            m.intermediate_size, m.vocab_size, m.max_model_len) == (
        spec.num_hidden_layers, spec.hidden_size, spec.num_attention_heads,
        spec.num_key_value_heads, spec.intermediate_size, spec.vocab_size,
        spec.max_position_embeddings)
