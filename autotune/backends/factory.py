"""Building a backend: what a command asked for becomes the backend its load tests
run on, here and nowhere else."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from autotune.backends.http import ServerBackend
from autotune.client.loadgen import check_server
from autotune.core.errors import AutotuneError
from autotune.servers.vllm import AttachedServer, VllmServer


class BackendError(AutotuneError, ValueError):
    """A backend that cannot be built from what was given; the message says how to fix
    it."""


def server_backend(kind: str, flags: dict[str, Any], *, url: str | None, model: str | None,
                   vllm_cmd: str, log_dir: Path, env: dict[str, str] | None = None
                   ) -> tuple[ServerBackend, str]:
    """A real server's trial backend (``kind`` vllm or attach) for one config, and a
    line that says where its load tests run; bad input is one :class:`BackendError`."""
    if kind == "attach":
        if flags:
            raise BackendError(
                f"the server at {url} is attached: autotune cannot restart it with "
                f"{', '.join(sorted(flags))}; drop the config flags, or use --backend vllm")
        if not url:
            raise BackendError("--backend attach needs --url of the running server")
        check_server(url)  # an unreachable server is one clear line, before any work
        return (ServerBackend(AttachedServer(url), name="attach", model=model),
                f"attached server {url}")
    cmd = shlex.split(vllm_cmd)
    if not cmd:
        raise BackendError("--vllm-cmd is empty: give the command that starts vLLM")
    if not model:
        raise BackendError("--backend vllm needs --model (a path or name to serve)")
    server = VllmServer(model, vllm_cmd=cmd, model_as_flag=cmd[-1] != "serve",
                        log_dir=log_dir, env=env)
    return ServerBackend(server, name="vllm"), f"vLLM ({vllm_cmd} {model})"
