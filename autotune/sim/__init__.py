"""The simulated vLLM engine (a simulator: every figure it produces is simulated).

- virtual time: :func:`simulate` runs a load test as a discrete-event simulation;
- real time: ``python -m autotune.sim.serve`` serves the OpenAI API like ``vllm serve``.

Both use the same scheduler (:mod:`autotune.sim.scheduler`, vLLM V1 continuous batching),
cost model (:mod:`autotune.sim.costmodel`, a roofline per step) and API front end
(:mod:`autotune.sim.frontend`, per-request and per-token CPU before and after the engine).
"""

from __future__ import annotations

from autotune.sim.config import ConfigRefused, EngineConfig, EngineSetup, resolve
from autotune.sim.engine import SimResult, TimelinePoint, simulate
from autotune.sim.profiles import (
    HardwareProfile,
    ModelProfile,
    ProfileError,
    list_profiles,
    load_hardware,
    load_model,
)

__all__ = [
    "ConfigRefused",
    "EngineConfig",
    "EngineSetup",
    "HardwareProfile",
    "ModelProfile",
    "ProfileError",
    "SimResult",
    "TimelinePoint",
    "list_profiles",
    "load_hardware",
    "load_model",
    "resolve",
    "simulate",
]
