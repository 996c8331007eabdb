"""Engine config (vLLM's flags), vLLM's defaults for it, and vLLM's start-up refusals.

``resolve`` turns an :class:`EngineConfig` on a hardware/model profile into the concrete
figures vLLM would settle on at start-up (batch defaults, KV cache blocks), or raises
:class:`ConfigRefused` with a message like the one vLLM prints when it refuses to start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from autotune.core.errors import AutotuneError
from autotune.sim.profiles import GIB, HardwareProfile, ModelProfile


class ConfigRefused(AutotuneError):
    """vLLM would refuse to start with this config (the message mimics vLLM's)."""


@dataclass(frozen=True)
class EngineConfig:
    """The ``vllm serve`` flags the simulator models (None = vLLM's default)."""

    model: str
    tensor_parallel_size: int = 1
    # None = vLLM V1's default for the OpenAI server on this hardware:
    # 1024 on >= 70 GiB GPUs that are not A100 (H100, H200), 256 otherwise, 128 on CPU
    # (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults).
    max_num_seqs: int | None = None
    # None = 8192 on >= 70 GiB non-A100 GPUs, 2048 otherwise (same function); without
    # chunked prefill at least max_model_len.
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # vLLM's automatic prefix caching (--enable-prefix-caching / --no-enable-prefix-caching).
    # On by default: vLLM leaves the flag None and turns it on for every generative
    # decoder-only model (engine/arg_utils.py,
    # EngineArgs._set_default_chunked_prefill_and_prefix_caching_args, from
    # ModelConfig.is_prefix_caching_supported; CacheConfig's default is True too).
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    # None = vLLM's default for the platform (``default_block_size``): 16 on GPUs, 128
    # on vLLM-CPU.  Prefix caching reuses whole blocks, so a hit's size follows it.
    block_size: int | None = None
    # vLLM's --api-server-count: front-end (API server) processes that share the HTTP
    # load; the simulator prices each one's work with the hardware profile's front-end
    # costs (autotune.sim.frontend).
    api_server_count: int = 1

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> EngineConfig:
        """From vLLM flag names (``max-num-seqs`` or ``max_num_seqs``, optional ``--``).

        Unknown names raise ``ValueError`` so that a typo is not silently ignored.
        """
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw, value in flags.items():
            name = raw.lstrip("-").replace("-", "_")
            if name in ("no_enable_chunked_prefill", "no_enable_prefix_caching"):
                name, value = name[3:], not _as_bool(value)
            if value is None and name == "enable_prefix_caching":
                continue  # vLLM's own default (None there too): on for our models
            if name not in known:
                raise ValueError(f"unknown engine flag {raw!r}; known: {', '.join(known)}")
            kwargs[name] = _coerce(name, value)
        if "model" not in kwargs:
            raise ValueError("engine flags need 'model'")
        return cls(**kwargs)

    def to_flags(self) -> dict[str, Any]:
        """Non-default flags as vLLM CLI names (``max-num-seqs``)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "model" or value != f.default:
                out[f.name.replace("_", "-")] = value
        return out


_BOOLS = {"enable_chunked_prefill", "enable_prefix_caching"}
_INTS = {"tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
         "block_size", "api_server_count"}


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    return bool(value)


def _coerce(name: str, value: Any) -> Any:
    if value is None:
        return None
    try:
        if name in _INTS:
            return int(value)
        if name == "gpu_memory_utilization":
            return float(value)
    except ValueError:  # int()'s own message names neither the flag nor its type
        word = "an integer" if name in _INTS else "a number"
        raise ValueError(f"{name}={value!r}: {name} takes {word}") from None
    if name in _BOOLS:
        return _as_bool(value)
    return str(value)


@dataclass(frozen=True)
class EngineSetup:
    """What vLLM settles on at start-up for one config on one box."""

    config: EngineConfig
    hardware: HardwareProfile
    model: ModelProfile
    tensor_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    max_model_len: int
    block_size: int
    api_server_count: int
    num_gpu_blocks: int
    weights_gib_per_gpu: float
    activation_gib_per_gpu: float
    kv_cache_gib_per_gpu: float

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for N tokens per request: X.XXx"."""
        return self.num_gpu_blocks / math.ceil(self.max_model_len / self.block_size)

    def log_lines(self) -> list[str]:
        """Start-up lines in vLLM V1's wording, so one log parser reads both."""
        return [
            f"Model loading took {self.weights_gib_per_gpu:.4f} GiB (simulated)",
            f"Available KV cache memory: {self.kv_cache_gib_per_gpu:.2f} GiB",
            f"# GPU blocks: {self.num_gpu_blocks}",
            f"GPU KV cache size: {self.kv_capacity_tokens:,} tokens",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x",
        ]


def batch_defaults(hardware: HardwareProfile, tp: int) -> tuple[int, int]:
    """vLLM V1's OpenAI-server defaults: (max_num_batched_tokens, max_num_seqs)."""
    if hardware.platform == "cpu":
        return 2048 * tp, 128 * tp
    if hardware.memory_gib >= 70 and "a100" not in hardware.name.lower():
        return 8192, 1024
    return 2048, 256


def default_block_size(hardware: HardwareProfile) -> int:
    """vLLM's KV block size when ``--block-size`` is not given: 16 tokens on CUDA
    (``CacheConfig``), 128 on vLLM-CPU (``CpuPlatform.check_and_update_config`` sets it
    for every model but MLA and DeepSeek-V4 ones, which the simulator does not model;
    the served value is in ``vllm:cache_config_info`` on /metrics)."""
    return 128 if hardware.platform == "cpu" else 16


def activation_bytes(model: ModelProfile, max_num_batched_tokens: int, max_num_seqs: int,
                     tp: int) -> float:
    """Peak activation memory of vLLM's profiling run (a dummy batch of mnbt tokens).

    The largest live tensors are the MLP's gate/up output and a few hidden-state buffers
    per token, plus fp32 logits for the sampled positions (at most max_num_seqs).
    """
    per_token = (2 * model.intermediate_size / tp + 4 * model.hidden_size) * model.dtype_bytes
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size * 4 / tp
    return max_num_batched_tokens * per_token + logits


def resolve(config: EngineConfig, hardware: HardwareProfile, model: ModelProfile) -> EngineSetup:
    """vLLM's start-up for this config, or :class:`ConfigRefused` as vLLM would refuse."""
    tp = config.tensor_parallel_size
    _check_flags(config, hardware, model)
    max_model_len = _max_model_len(config, model)
    mnbt, mns = _batch_limits(config, hardware, tp, max_model_len)
    block_size = config.block_size or default_block_size(hardware)
    weights, activation, kv_bytes, num_blocks = _memory(config, hardware, model, mnbt, mns,
                                                        max_model_len, block_size)
    return EngineSetup(
        config=config,
        hardware=hardware,
        model=model,
        tensor_parallel_size=tp,
        max_num_seqs=mns,
        max_num_batched_tokens=mnbt,
        enable_chunked_prefill=config.enable_chunked_prefill,
        enable_prefix_caching=config.enable_prefix_caching,
        max_model_len=max_model_len,
        block_size=block_size,
        api_server_count=config.api_server_count,
        num_gpu_blocks=num_blocks,
        weights_gib_per_gpu=weights / GIB,
        activation_gib_per_gpu=activation / GIB,
        kv_cache_gib_per_gpu=kv_bytes / GIB,
    )


def _check_flags(config: EngineConfig, hardware: HardwareProfile, model: ModelProfile) -> None:
    """The flags vLLM refuses on their own, before it sizes anything, in its order and
    with its messages (so a log parser reads the simulator's refusals like vLLM's)."""
    tp = config.tensor_parallel_size
    if tp < 1:
        raise ConfigRefused(f"tensor_parallel_size must be >= 1, got {tp}")
    if model.num_attention_heads % tp:
        raise ConfigRefused(
            f"Total number of attention heads ({model.num_attention_heads}) must be divisible "
            f"by tensor parallel size ({tp})."
        )
    if tp > hardware.gpus:
        raise ConfigRefused(
            f"please set tensor_parallel_size ({tp}) to less than max local gpu count "
            f"({hardware.gpus})"
        )
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigRefused(
            f"GPU memory utilization must be within (0, 1]. Got {config.gpu_memory_utilization}."
        )
    if config.api_server_count < 1:
        raise ConfigRefused(f"api_server_count must be >= 1, got {config.api_server_count}")
    if config.block_size is not None and config.block_size not in (1, 8, 16, 32, 64, 128):
        raise ConfigRefused(f"block_size must be one of 1, 8, 16, 32, 64, 128; got "
                            f"{config.block_size}")


def _max_model_len(config: EngineConfig, model: ModelProfile) -> int:
    """The context length served: the flag, else the model's; vLLM refuses one longer
    than the model's positions."""
    max_model_len = config.max_model_len or model.max_model_len
    if max_model_len > model.max_model_len:
        raise ConfigRefused(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={model.max_model_len} in model's "
            "config.json). To allow overriding this maximum, set the env var "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
    return max_model_len


def _batch_limits(config: EngineConfig, hardware: HardwareProfile, tp: int,
                  max_model_len: int) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) after vLLM's defaults, or its refusal of
    a pair that cannot schedule a step."""
    default_tokens, default_seqs = batch_defaults(hardware, tp)
    mnbt = config.max_num_batched_tokens
    if mnbt is None:
        mnbt = default_tokens if config.enable_chunked_prefill else max(max_model_len,
                                                                         default_tokens)
    mns = config.max_num_seqs
    if mns is None:
        mns = min(default_seqs, mnbt)
    if mns < 1 or mnbt < 1:
        raise ConfigRefused("max_num_seqs and max_num_batched_tokens must be >= 1")
    if not config.enable_chunked_prefill and mnbt < max_model_len:
        raise ConfigRefused(
            f"max_num_batched_tokens ({mnbt}) is smaller than max_model_len ({max_model_len}). "
            "This effectively limits the maximum sequence length to max_num_batched_tokens "
            "and makes vLLM reject longer sequences. Please increase max_num_batched_tokens "
            "or decrease max_model_len."
        )
    if mnbt < mns:
        raise ConfigRefused(
            f"max_num_batched_tokens ({mnbt}) must be greater than or equal to "
            f"max_num_seqs ({mns})."
        )
    return mnbt, mns


def _memory(config: EngineConfig, hardware: HardwareProfile, model: ModelProfile,
            mnbt: int, mns: int, max_model_len: int, block_size: int
            ) -> tuple[float, float, float, int]:
    """Per GPU, (weight, activation and KV-cache bytes, KV blocks), as vLLM's memory
    profiling splits the budget; or its out-of-memory refusal (weights that do not
    fit, no room for the cache, or too little for one request of max_model_len)."""
    tp = config.tensor_parallel_size
    weights = model.weight_bytes / tp
    budget = hardware.memory_bytes * config.gpu_memory_utilization
    if weights > budget or weights > hardware.memory_bytes * 0.98:
        free = hardware.memory_bytes - weights
        raise ConfigRefused(
            "torch.OutOfMemoryError: CUDA out of memory while loading the model weights "
            f"({weights / GIB:.2f} GiB per GPU at tensor_parallel_size={tp}; "
            f"{hardware.memory_gib:.2f} GiB total, budget "
            f"{budget / GIB:.2f} GiB at gpu_memory_utilization="
            f"{config.gpu_memory_utilization}; {free / GIB:.2f} GiB would be free)."
        )
    activation = activation_bytes(model, mnbt, mns, tp) + hardware.runtime_reserve_gib * GIB
    kv_bytes = budget - weights - activation
    if kv_bytes <= 0:
        raise ConfigRefused(
            "No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        )
    per_block = model.kv_bytes_per_token / tp * block_size
    num_blocks = int(kv_bytes // per_block)
    need_blocks = math.ceil(max_model_len / block_size)
    if num_blocks < need_blocks:
        needed = need_blocks * per_block
        estimated = num_blocks * block_size
        raise ConfigRefused(
            f"To serve at least one request with the models's max seq len ({max_model_len}), "
            f"({needed / GIB:.2f} GiB KV cache is needed, which is larger than the available "
            f"KV cache memory ({kv_bytes / GIB:.2f} GiB). Based on the available memory, the "
            f"estimated maximum model length is {estimated}. Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
            "engine."
        )
    return weights, activation, kv_bytes, num_blocks
