"""Building a backend: the typed spec a command makes of what it was asked becomes the
backend its load tests run on, here and nowhere else.

A registry maps each kind to its builder (``sim``, ``vllm``, ``attach``), so a command
never re-derives how a server is started or whether the model is a flag.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.backends.base import Backend
from autotune.backends.http import ServerBackend
from autotune.backends.sim import SimBackend
from autotune.client.loadgen import check_server
from autotune.core.errors import AutotuneError
from autotune.servers.vllm import AttachedServer, VllmServer

if TYPE_CHECKING:
    from autotune.sim.profiles import HardwareProfile, ModelProfile


class BackendError(AutotuneError, ValueError):
    """A backend that cannot be built from what was given; the message says how to fix
    it."""


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """Where load tests run, as a command asked for it.

    ``kind``: ``sim`` (the simulator in virtual time), ``vllm`` (autotune starts vLLM)
    or ``attach`` (a server someone else runs, at ``url``)."""

    kind: str
    # sim: a hardware profile name with its GPU count ("4xa100-80gb") or a profile.
    hardware: str | HardwareProfile = "a100-80gb"
    sim_model: str | ModelProfile = "llama-3-8b"
    # attach: the server's URL; vllm: what to serve.
    url: str | None = None
    model: str | None = None
    # The model name requests carry (None: the server's own, from GET /v1/models).
    request_model: str | None = None
    vllm_cmd: str = "vllm serve"
    log_dir: Path = Path("studies") / "default" / "logs"
    env: Mapping[str, str] | None = None
    startup_timeout_s: float | None = None
    gpu_ids: Sequence[int] | None = None
    gpus: int | None = None  # the GPUs the backend says it uses (None: from the flags)
    nvml: bool = True
    name: str | None = None  # the backend's label (default: its kind)
    endpoint: str = "completions"
    api_key: str | None = None
    transport: str = "native"
    source: str | None = None  # the label of its figures (default: the backend's)

    def __post_init__(self) -> None:
        if self.kind not in BUILDERS:
            raise BackendError(f"unknown backend {self.kind!r}; use one of "
                               f"{', '.join(sorted(BUILDERS))}")


Builder = Callable[[BackendSpec], Backend]
BUILDERS: dict[str, Builder] = {}


def register(kind: str) -> Callable[[Builder], Builder]:
    """Make ``create_backend`` build ``kind`` with the decorated function."""

    def add(builder: Builder) -> Builder:
        BUILDERS[kind] = builder
        return builder

    return add


def create_backend(spec: BackendSpec) -> Backend:
    """The backend ``spec`` describes; bad input is one :class:`BackendError`."""
    backend = BUILDERS[spec.kind](spec)
    if spec.source is not None:
        backend.source = spec.source
    return backend


def describe(spec: BackendSpec) -> str:
    """One line saying where the load tests of ``spec`` run."""
    if spec.kind == "sim":
        hw = spec.hardware if isinstance(spec.hardware, str) else spec.hardware.label
        mdl = spec.sim_model if isinstance(spec.sim_model, str) else spec.sim_model.name
        return f"simulator {hw}, model {mdl}"
    if spec.kind == "attach":
        return f"attached server {spec.url}"
    return f"vLLM ({spec.vllm_cmd} {spec.model})"


@register("sim")
def _sim(spec: BackendSpec) -> Backend:
    return SimBackend(spec.hardware, spec.sim_model)


@register("attach")
def _attach(spec: BackendSpec) -> Backend:
    if not spec.url:
        raise BackendError("--backend attach needs --url of the running server")
    return ServerBackend(AttachedServer(spec.url), name=spec.name or "attach",
                         model=spec.request_model, endpoint=spec.endpoint,
                         api_key=spec.api_key, gpus=spec.gpus, nvml=spec.nvml,
                         transport=spec.transport)


@register("vllm")
def _vllm(spec: BackendSpec) -> Backend:
    cmd = shlex.split(spec.vllm_cmd)
    if not cmd:
        raise BackendError("--vllm-cmd is empty: give the command that starts vLLM")
    if not spec.model:
        raise BackendError("--backend vllm needs --model (a path or name to serve)")
    # `vllm serve MODEL` takes the model positionally; the API server module and
    # wrappers around it take --model.
    make = functools.partial(VllmServer, spec.model, vllm_cmd=cmd,
                             model_as_flag=cmd[-1] != "serve", log_dir=spec.log_dir,
                             env=spec.env, gpus=spec.gpu_ids)
    server = (make() if spec.startup_timeout_s is None
              else make(startup_timeout_s=spec.startup_timeout_s))
    return ServerBackend(server, name=spec.name or "vllm", model=spec.request_model,
                         gpus=spec.gpus, nvml=spec.nvml)


def server_backend(kind: str, *, url: str | None, model: str | None, vllm_cmd: str,
                   log_dir: Path, env: Mapping[str, str] | None = None
                   ) -> tuple[Backend, str]:
    """A real server's backend (``kind`` vllm or attach) for one config, and the line
    that says where its load tests run.  An attached server is checked now, so an
    unreachable one is one clear line before any work."""
    # Requests to an attached server name its model when told; a started vLLM is asked.
    spec = BackendSpec(kind=kind, url=url, model=model,
                       request_model=model if kind == "attach" else None,
                       vllm_cmd=vllm_cmd, log_dir=log_dir, env=env)
    if kind == "attach" and url:
        check_server(url)
    return create_backend(spec), describe(spec)
