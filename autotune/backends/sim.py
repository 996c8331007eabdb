"""Virtual time: the simulator's discrete-event engine as a backend, thousands of times
faster than real time, with the same workload and arrival schedule as a real test."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autotune.backends.base import Backend, LoadPlan, LoadRun, TrialFailed
from autotune.core.metrics import SIMULATED
from autotune.core.records import WindowCallback
from autotune.sim import config as sim_config
from autotune.sim import engine, profiles
from autotune.workload.arrivals import schedule

if TYPE_CHECKING:
    from autotune.sim.profiles import HardwareProfile, ModelProfile


class SimBackend(Backend):
    """Virtual time: the simulator's engine on a hardware and model profile."""

    name = "sim"
    mode = "virtual"
    source = SIMULATED

    def __init__(self, hardware: str | HardwareProfile, model: str | ModelProfile, *,
                 startup_s: float = 0.0) -> None:
        """``hardware`` and ``model``: profile names (``"4xa100-80gb"``), or profile
        objects, e.g. a shipped profile with changed efficiency factors."""
        super().__init__()
        self._cfg, self._engine = sim_config, engine
        self.hardware = (profiles.load_hardware(hardware) if isinstance(hardware, str)
                         else hardware)
        self.model = profiles.load_model(model) if isinstance(model, str) else model
        self.hardware_name = hardware if isinstance(hardware, str) else hardware.label
        self.model_name = model if isinstance(model, str) else model.name
        self.startup_s = startup_s  # virtual seconds charged per (re)start
        self._config: Any = None
        self._flags: dict[str, Any] | None = None
        self._fields = {f.name for f in dataclasses.fields(sim_config.EngineConfig)}

    @property
    def gpus(self) -> int:
        return int(self.hardware.gpus)

    @property
    def attention_heads(self) -> int:
        return int(self.model.num_attention_heads)

    def prepare(self, flags: Mapping[str, Any], *, trial: int | None = None
                ) -> dict[str, Any]:
        flags = dict(flags)
        if self._flags == flags and self._config is not None:
            return {"reused": True, "startup_s": 0.0, "config": flags, "simulated": True}
        modelled = {k: v for k, v in flags.items() if k in self._fields}
        ignored = sorted(set(flags) - set(modelled))
        modelled.setdefault("model", self.model.hf_id)
        try:
            config = self._cfg.EngineConfig.from_flags(modelled)
            setup = self._cfg.resolve(config, self.hardware, self.model)
        except self._cfg.ConfigRefused as exc:
            self._flags = None
            raise TrialFailed("refused", str(exc)) from None
        except ValueError as exc:
            self._flags = None
            raise TrialFailed("invalid_argument", str(exc)) from None
        self._config, self._flags = config, flags
        self.restarts += 1
        self.server_s += self.startup_s
        return {"reused": False, "startup_s": self.startup_s, "config": flags,
                "simulated": True, "kv_cache_tokens": int(setup.kv_capacity_tokens),
                "max_concurrency": float(setup.max_concurrency),
                "max_num_seqs": setup.max_num_seqs,
                "max_num_batched_tokens": setup.max_num_batched_tokens,
                "ignored_flags": ignored}

    def load_test(self, rate: float, plan: LoadPlan, on_window: WindowCallback | None) -> LoadRun:
        n_warm = plan.warmup_at(rate)
        reqs = plan.warm_requests(rate) + plan.measured_for(rate)
        closed = plan.closed
        think = None
        if closed is None:
            arrivals = schedule(reqs, rate, process=plan.process,
                                burstiness=plan.burstiness, seed=plan.seed)
        else:  # the same users, think times and seed as the HTTP load generator's
            arrivals = closed.starts(closed.users(rate), plan.seed)
            think = closed.think_times(len(reqs), plan.seed)
        try:
            res = self._engine.simulate(self._config, self.hardware, self.model, reqs,
                                        arrivals, warmup=n_warm,
                                        max_concurrency=(plan.max_concurrency
                                                         if closed is None else None),
                                        on_window=on_window, window_s=plan.window_s,
                                        think_s=think)
        except self._cfg.ConfigRefused as exc:
            self._flags = None
            raise TrialFailed("refused", str(exc)) from None
        records = list(res.records)
        # Server time: from the first (warm-up) send to the last end, virtual seconds.
        ends = [r.end_s for r in records if r.end_s is not None]
        duration = max((max(ends) if ends else 0.0) - float(arrivals[0]), 0.0)
        self.server_s += duration
        stats = res.stats_dict()
        stats.pop("timeline", None)
        telemetry = {"source": "simulated", "gpu_util_mean_pct": 100.0 * res.busy_fraction,
                     "kv_usage_mean": res.kv_usage_mean, "kv_usage_max": res.kv_usage_max,
                     "preemptions": res.preemptions, "engine": stats.get("engine"),
                     "notes": stats.get("notes")}
        return LoadRun(records=records, aborted=bool(res.aborted),
                       abort_reason="pruned" if res.aborted else None,
                       load_test_s=max(res.window_end_s - res.window_start_s, 0.0),
                       telemetry=telemetry)
