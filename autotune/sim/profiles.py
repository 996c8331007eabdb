"""Hardware and model profiles of the simulator, loaded from YAML data files.

Each file in ``profiles/`` is ``hardware.<name>.yaml`` or ``model.<name>.yaml`` and cites
where its figures come from.  Achieved FLOP/s and bandwidth are datasheet peaks times
efficiency factors; the factors say where they came from.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from autotune.core.errors import AutotuneError

PROFILE_DIR = Path(__file__).with_name("profiles")
GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


class ProfileError(AutotuneError, ValueError):
    """A profile name is unknown or a profile file is malformed."""


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU type (datasheet x efficiency) and how many of them the box has."""

    name: str
    description: str
    gpus: int
    memory_gib: float
    peak_tflops: float
    peak_bandwidth_gbs: float
    compute_efficiency: float
    bandwidth_efficiency: float
    interconnect: str  # "nvlink" | "pcie" | "none"
    link_bandwidth_gbs: float
    link_efficiency: float
    allreduce_latency_us: float
    step_overhead_ms: float
    per_seq_overhead_us: float
    runtime_reserve_gib: float
    platform: str = "cuda"  # "cuda" | "cpu": selects vLLM's batch defaults
    # vLLM's API server (the front end), per front-end server process: CPU time to take
    # one request in (HTTP parse, tokenise, hand it over to the engine) ...
    frontend_request_ms: float = 0.0
    # ... and to turn one output token into a client chunk (detokenise, one SSE event).
    frontend_token_us: float = 0.0
    # Share of that front-end CPU time taken from the engine's core: 0 = the front end has
    # cores of its own, 1 = it runs on the engine's core (one process, one GIL).
    frontend_engine_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("frontend_request_ms", "frontend_token_us"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value < float("inf")):
                raise ProfileError(f"hardware profile {self.name!r}: {name} must be a "
                                   f"finite number >= 0, got {value!r}")
        share = self.frontend_engine_share
        if not (isinstance(share, int | float) and 0 <= share <= 1):
            raise ProfileError(f"hardware profile {self.name!r}: frontend_engine_share must "
                               f"be between 0 and 1, got {share!r}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def achieved_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.compute_efficiency

    @property
    def achieved_bandwidth(self) -> float:
        return self.peak_bandwidth_gbs * 1e9 * self.bandwidth_efficiency

    @property
    def achieved_link_bandwidth(self) -> float:
        return self.link_bandwidth_gbs * 1e9 * self.link_efficiency

    def with_gpus(self, n: int) -> HardwareProfile:
        """The same GPU type in a box with ``n`` GPUs."""
        if n < 1:
            raise ProfileError(f"a hardware profile needs at least 1 GPU, got {n}")
        return replace(self, gpus=n)

    @property
    def label(self) -> str:
        return f"{self.gpus}x{self.name}"


@dataclass(frozen=True)
class ModelProfile:
    """A transformer's shape: enough to size weights, KV cache and FLOPs."""

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_model_len: int
    dtype: str

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def params_per_layer(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        mlp = 3 * h * self.intermediate_size  # gate, up, down (SwiGLU)
        return attn + mlp + 2 * h  # two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * self.params_per_layer + heads * self.embedding_params

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the input embedding does not)."""
        return self.num_layers * self.params_per_layer + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, whole model (divide by TP per GPU)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def _path(kind: str, name: str) -> Path:
    return PROFILE_DIR / f"{kind}.{name}.yaml"


def _read(kind: str, name: str) -> dict[str, Any]:
    path = _path(kind, name)
    if not path.is_file():
        known = ", ".join(list_profiles()[kind])
        raise ProfileError(f"unknown {kind} profile {name!r}; known: {known}")
    stat = path.stat()
    data = _parse(str(path), stat.st_mtime_ns, stat.st_size)
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise ProfileError(f"{path} is not a {kind} profile (missing 'kind: {kind}')")
    return dict(data)  # a copy: the cached one stays as read


@functools.lru_cache(maxsize=64)
def _parse(path: str, mtime_ns: int, size: int) -> Any:
    """A profile file's YAML, parsed once per version of the file: parsing takes about a
    millisecond, and every ``simulate`` given profile names reads two files."""
    return yaml.safe_load(Path(path).read_text())


def _build(cls: type, data: dict[str, Any], path: Path) -> Any:
    names = {f.name for f in fields(cls)}
    missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
    if missing:
        raise ProfileError(f"{path}: missing field(s) {', '.join(missing)}")
    return cls(**{k: v for k, v in data.items() if k in names})


_COUNT = re.compile(r"^(\d+)\s*[x×]\s*(.+)$", re.IGNORECASE)


def load_hardware(name: str) -> HardwareProfile:
    """A hardware profile by name; ``"4xa100-80gb"`` sets the GPU count to 4.  A path to
    a ``.yaml`` file (a fitted twin, ``studies/<name>/profile.fitted.yaml``) is read as
    it is, and ``"4x<path>.yaml"`` sets its GPU count likewise."""
    count: int | None = None
    m = _COUNT.match(name.strip())
    if m:
        count, name = int(m.group(1)), m.group(2)
    name = name.strip()
    if name.endswith((".yaml", ".yml")):
        profile = _load_hardware_file(Path(name))
    else:
        name = name.lower()
        profile = _build(HardwareProfile, _read("hardware", name), _path("hardware", name))
    return profile.with_gpus(count) if count is not None else profile


def _load_hardware_file(path: Path) -> HardwareProfile:
    if not path.is_file():
        raise ProfileError(f"no hardware profile file {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"{path}: not a readable YAML file ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != "hardware":
        raise ProfileError(f"{path} is not a hardware profile (missing 'kind: hardware')")
    return _build(HardwareProfile, data, path)


def model_from_hf_config(folder: str | Path) -> ModelProfile:
    """A model profile from a Hugging Face model folder's ``config.json`` (Llama-like)."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
        heads = int(cfg["num_attention_heads"])
        return ModelProfile(
            name=Path(folder).name,
            hf_id=str(folder),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_model_len=int(cfg.get("max_position_embeddings", 2048)),
            dtype=str(cfg.get("torch_dtype", "bfloat16")) if str(
                cfg.get("torch_dtype", "bfloat16")) in DTYPE_BYTES else "bfloat16",
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ProfileError(f"{path}: not a usable Llama-style config.json ({exc})") from exc


def load_model(name: str) -> ModelProfile:
    """A model profile by name (``llama-3-8b``), Hugging Face id, or model folder."""
    if Path(name, "config.json").is_file():
        return model_from_hf_config(name)
    if not _path("model", name).is_file():
        for candidate in list_profiles()["model"]:
            data = _read("model", candidate)
            if str(data.get("hf_id", "")).lower() == name.lower():
                name = candidate
                break
    return _build(ModelProfile, _read("model", name), _path("model", name))


def list_profiles() -> dict[str, list[str]]:
    """Names of every profile shipped: ``{"hardware": [...], "model": [...]}``."""
    out: dict[str, list[str]] = {"hardware": [], "model": []}
    for path in sorted(PROFILE_DIR.glob("*.yaml")):
        kind, _, rest = path.name.partition(".")
        if kind in out:
            out[kind].append(rest.removesuffix(".yaml"))
    return out
