"""The option groups several commands share, typed and checked once.

A command's options object is built from these by the CLI, which has already parsed
every string (durations to seconds, the SLO, the space, the profile): the library only
ever sees typed values.  Each group checks its own ranges when it is made, with one
line that names the flag and how to fix it (:class:`OptionsError`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune.core.errors import AutotuneError
from autotune.sim.profiles import (
    HardwareProfile,
    ModelProfile,
    ProfileError,
    load_hardware,
    load_model,
)

# The simulator's profile when neither the space nor --profile names one.
DEFAULT_PROFILE = ("a100-80gb", "llama-3-8b", 4)
# The context length (longest prompt + output kept from ShareGPT) when neither the config
# nor the server says one.
DEFAULT_CONTEXT = 8192


class OptionsError(AutotuneError, ValueError):
    """An option the user can fix; the message names it and says how."""


# Where a command's load tests run: the simulator, a vLLM autotune starts, or a running
# server autotune attaches to.
BACKENDS = ("sim", "vllm", "attach")


def check_backend(kind: str, url: str | None) -> None:
    """Refuse a backend that is not one, or an attached one without its URL."""
    if kind not in BACKENDS:
        raise OptionsError(f"unknown backend {kind!r}; use one of {', '.join(BACKENDS)}")
    if kind == "attach" and not url:
        raise OptionsError("--backend attach needs --url of the running server")


def at_least(flag: str, value: int | None, low: int) -> None:
    """Refuse a count under ``low``, naming the flag (None: not given)."""
    if value is not None and value < low:
        raise OptionsError(f"{flag} must be at least {low}, got {value}")


@dataclass(frozen=True, kw_only=True)
class WorkloadOptions:
    """The ShareGPT sample every load test draws from, as ``vllm bench serve`` takes it."""

    num_prompts: int = 1000  # as vLLM's `vllm bench serve --num-prompts`
    warmup: int = 100
    seed: int = 0
    tokenizer: str | None = None  # a tokenizer.json; None: mistral-common's tekken
    max_model_len: int | None = None  # None: the config's, else the server's, else 8192

    def __post_init__(self) -> None:
        at_least("--num-prompts", self.num_prompts, 1)
        at_least("--warmup", self.warmup, 0)
        at_least("--max-model-len", self.max_model_len, 1)


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """How a vLLM server is started (``model``, ``vllm_cmd``) or found (``url``)."""

    model: str | None = None
    url: str | None = None
    vllm_cmd: str = "vllm serve"
    startup_timeout_s: float = 900.0
    gpu_ids: tuple[int, ...] | None = None  # CUDA_VISIBLE_DEVICES of a launched server
    env: dict[str, str] = field(default_factory=dict)  # more environment of the server

    def __post_init__(self) -> None:
        if not self.startup_timeout_s > 0:
            raise OptionsError(f"--startup-timeout must be more than 0 seconds, got "
                               f"{self.startup_timeout_s:g}")


@dataclass(frozen=True, kw_only=True)
class SimProfile:
    """The simulator's node: ``gpus`` of ``hardware`` serving ``model``."""

    hardware: str = DEFAULT_PROFILE[0]
    model: str = DEFAULT_PROFILE[1]
    gpus: int = DEFAULT_PROFILE[2]

    def __post_init__(self) -> None:
        at_least("--gpus", self.gpus, 1)

    @classmethod
    def of_space(cls, profile: Mapping[str, Any]) -> SimProfile:
        """A search space's own profile (its ``profile:`` section), defaults filled."""
        return cls(hardware=str(profile.get("hardware", DEFAULT_PROFILE[0])),
                   model=str(profile.get("model", DEFAULT_PROFILE[1])),
                   gpus=int(profile.get("gpus", DEFAULT_PROFILE[2])))

    @property
    def node(self) -> str:
        """The hardware profile's name with its GPU count, as ``load_hardware`` reads it."""
        return f"{self.gpus}x{self.hardware}"

    def load(self, what: str = "--profile") -> tuple[HardwareProfile, ModelProfile]:
        """The simulator's hardware and model profiles, or one line naming ``what`` was
        given and why it cannot be loaded."""
        try:
            return load_hardware(self.node), load_model(self.model)
        except (ProfileError, OSError, ValueError) as exc:
            raise OptionsError(f"{what} {self.hardware}:{self.model}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class RateSearch:
    """One config's ceiling search: bisect to ``tol`` in at most ``max_probes`` load
    tests, and cap the rate ``headroom`` under the highest rate that passed."""

    tol: float = 0.03
    max_probes: int = 8
    headroom: float = 0.10

    def __post_init__(self) -> None:
        if not (0 < self.tol < 1 and math.isfinite(self.tol)):
            raise OptionsError(f"--tol must be between 0 and 1 (e.g. 0.03 for 3%), got "
                               f"{self.tol}")
        at_least("--max-probes", self.max_probes, 1)
        if not 0 <= self.headroom < 1:
            raise OptionsError(f"--headroom must be in [0, 1), got {self.headroom}")
