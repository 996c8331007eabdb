"""Real time: a server process (vLLM, the simulator's HTTP server, or an attached
endpoint) driven by the HTTP load generator."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from autotune.backends.base import Backend, LoadPlan, LoadRun, TrialFailed
from autotune.client.loadgen import LoadTestConfig, run_load_test_sync
from autotune.core.metrics import MEASURED
from autotune.core.records import WindowCallback
from autotune.servers.telemetry import NvmlSampler
from autotune.servers.vllm import ServerError, ServerStartError


class ServerBackend(Backend):
    """Real time: a :class:`autotune.servers.vllm.Server` and the HTTP load generator."""

    mode = "real"
    source = MEASURED

    def __init__(self, server: Any, *, name: str = "vllm", model: str | None = None,
                 endpoint: str = "completions", api_key: str | None = None,
                 gpus: int | None = None, nvml: bool = True,
                 transport: str = "native") -> None:
        super().__init__()
        self.server = server
        self.name = name
        self.restartable = bool(getattr(server, "restartable", True))
        self.model = model
        self.endpoint = endpoint
        self.api_key = api_key
        self.gpus = gpus
        self.nvml = nvml
        self.transport = transport
        self._flags: dict[str, Any] | None = None

    def prepare(self, flags: Mapping[str, Any], *, trial: int | None = None
                ) -> dict[str, Any]:
        server_flags = {k: v for k, v in flags.items() if k != "model"}
        if not self.restartable:
            server_flags = {}
        if self._flags == server_flags and self.server.alive():
            return {"reused": True, "startup_s": 0.0, "config": server_flags,
                    "endpoint": self.server.endpoint}
        t0 = time.monotonic()
        try:
            info = self.server.start(server_flags, trial=trial)
        except ServerStartError as exc:
            self._flags = None
            self.server_s += time.monotonic() - t0
            path = getattr(exc, "log_path", None)
            raise TrialFailed(exc.reason, exc.detail,
                              log_path=None if path is None else str(path)) from None
        except ServerError as exc:
            self._flags = None
            raise TrialFailed("refused", str(exc)) from None
        self.server_s += time.monotonic() - t0
        self.restarts += 1
        self._flags = server_flags
        data = info.to_dict() if hasattr(info, "to_dict") else {}
        data["reused"] = False
        return data

    def load_test(self, rate: float, plan: LoadPlan, on_window: WindowCallback | None) -> LoadRun:
        closed = plan.closed
        shape: dict[str, Any] = (
            dict(rate=rate, process=plan.process, burstiness=plan.burstiness,
                 max_concurrency=plan.max_concurrency) if closed is None else
            dict(users=closed.users(rate), think_s=closed.think_s, think=closed.think))
        cfg = LoadTestConfig(
            url=self.server.endpoint, model=self.model, endpoint=self.endpoint,
            warmup=plan.warmup_at(rate), request_timeout_s=plan.request_timeout_s,
            api_key=self.api_key, seed=plan.seed, window_s=plan.window_s,
            transport=self.transport, **shape)
        sampler = _nvml_sampler() if self.nvml else None
        t0 = time.monotonic()
        try:
            res = run_load_test_sync(cfg, plan.measured_for(rate),
                                     warmup_requests=plan.warmup_requests, on_window=on_window)
        finally:
            gpu = sampler.stop() if sampler is not None else None
            self.server_s += time.monotonic() - t0
        telemetry: dict[str, Any] = {"source": "measured"}
        if gpu is not None and getattr(gpu, "available", False):
            telemetry.update(gpu_util_mean_pct=gpu.util_mean_pct,
                             gpu_util_max_pct=gpu.util_max_pct,
                             gpu_mem_used_max_bytes=gpu.mem_used_max_bytes, gpu_note=gpu.note)
        return LoadRun(records=list(res.records), aborted=res.aborted,
                       abort_reason=res.abort_reason, load_test_s=res.duration_s,
                       telemetry=telemetry, crashed=self.exit_report())

    def exit_report(self) -> str | None:
        """Why the server this backend started is gone (with its log's tail), or None
        while it runs.  A dead server is forgotten, so the next test restarts it."""
        if not self.restartable or self.server.alive():
            return None
        self._flags = None
        return "the server exited during the load test; log tail: " + " | ".join(
            self.server.log_tail(5).splitlines()[-5:])

    def close(self) -> None:
        self._flags = None
        with contextlib.suppress(Exception):
            self.server.stop()


def _nvml_sampler() -> Any:
    try:
        return NvmlSampler(interval_s=0.5).start()
    except Exception:  # no NVML, no GPU: telemetry is optional
        return None
