"""SimBackend takes profile names or profile objects; startup is charged per restart."""

from __future__ import annotations

import dataclasses

import numpy as np

from autotune.backends.base import LoadPlan
from autotune.backends.sim import SimBackend
from autotune.core.slo import parse_slo
from autotune.sim.profiles import load_hardware, load_model
from autotune.tuning.trial import probe
from autotune.workload.sources import Request

FLAGS = {"max_num_seqs": 64, "tensor_parallel_size": 1}


def _plan(n: int = 120) -> LoadPlan:
    rng = np.random.default_rng(0)
    reqs = [Request("x", int(p), int(o))
            for p, o in zip(rng.integers(32, 512, n), rng.integers(16, 256, n), strict=True)]
    return LoadPlan(slo=parse_slo("10s"), requests=reqs[12:], warmup_requests=reqs[:12],
                    warmup=12, seed=0)


def _e2e(backend: SimBackend, rate: float = 8.0) -> list[float | None]:
    res = probe(backend, FLAGS, rate, _plan(), prune=False)
    return [r.e2e_s for r in res.records]


def test_names_still_work_and_are_kept() -> None:
    b = SimBackend("1xa100-80gb", "llama-3-8b")
    assert (b.hardware_name, b.model_name) == ("1xa100-80gb", "llama-3-8b")
    assert b.gpus == 1 and b.attention_heads == 32


def test_profile_objects_give_the_same_run_as_their_names() -> None:
    hw, model = load_hardware("1xa100-80gb"), load_model("llama-3-8b")
    by_object = SimBackend(hw, model)
    assert by_object.hardware_name == "1xa100-80gb"
    assert by_object.model_name == "llama-3-8b"
    assert _e2e(by_object) == _e2e(SimBackend("1xa100-80gb", "llama-3-8b"))


def test_a_changed_profile_changes_the_simulation() -> None:
    hw = load_hardware("1xa100-80gb")
    slow = dataclasses.replace(hw, compute_efficiency=hw.compute_efficiency * 0.5,
                               bandwidth_efficiency=hw.bandwidth_efficiency * 0.5)
    fast_e2e = _e2e(SimBackend(hw, "llama-3-8b"))
    slow_e2e = _e2e(SimBackend(slow, "llama-3-8b"))
    assert sum(x or 0.0 for x in slow_e2e) > sum(x or 0.0 for x in fast_e2e)


def test_startup_is_charged_per_restart_only() -> None:
    b = SimBackend("1xa100-80gb", "llama-3-8b", startup_s=90.0)
    plan = _plan()
    first = probe(b, FLAGS, 8.0, plan, prune=False)
    after_one = b.server_s
    assert b.restarts == 1 and after_one > 90.0
    probe(b, FLAGS, 6.0, plan, prune=False)  # same flags: the server is reused
    assert b.restarts == 1
    assert b.server_s - after_one > first.load_test_s * 0.5
    probe(b, dict(FLAGS, max_num_seqs=128), 8.0, plan, prune=False)
    assert b.restarts == 2
