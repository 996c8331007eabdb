"""``autotune calibrate``: bring your own server into the twin.

Runs calibration load shapes against one server config and fits the simulator's
profile to what they measured (:func:`autotune.tuning.twin.fit_twin`):

1. a saturation test: every request at once, which shows the service rate;
2. Poisson tests at fractions of that service rate (``loads``, default 0.5 and 0.8),
   which show latency below the knee, where queueing is light.

Each test is a fixed number of requests after a warm-up, on the same requests (common
random numbers).  The profile is written as a ``hardware.*.yaml`` that
``load_hardware`` reads, so the simulator, ``--prescreen sim``, ``search --twin-prior``
and ``bench --backend sim --profile PATH.yaml`` use it.  Figures of the fitted profile
are simulated; the tests it is fitted to are measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.backends.factory import server_backend
from autotune.core.errors import AutotuneError
from autotune.core.files import check_writable, write_json
from autotune.core.slo import combine
from autotune.core.terminal import console
from autotune.sim.profiles import HardwareProfile, ModelProfile
from autotune.tuning.ceiling import BackendProbe
from autotune.tuning.options import (
    DEFAULT_CONTEXT,
    ServerOptions,
    SimProfile,
    WorkloadOptions,
    at_least,
)
from autotune.tuning.twin import (
    ObservedTest,
    TwinError,
    TwinFit,
    fit_twin,
    observation_of,
    write_twin,
)
from autotune.workload.pool import pool_workload

DEFAULT_LOADS = (0.5, 0.8)


class CalibrationError(AutotuneError, ValueError):
    """The calibration cannot run or fit as asked; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class CalibrateOptions:
    """What ``autotune calibrate`` takes (and the library call)."""

    prior: SimProfile  # the profile the fit starts from
    out: Path
    json_path: Path | None = None
    server: ServerOptions  # --url of a running server, or --model to start
    flags: Mapping[str, Any] = field(default_factory=dict)  # the server config
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    loads: tuple[float, ...] = DEFAULT_LOADS
    dataset: str = "sharegpt"
    input_len: int = 256
    output_len: int = 128
    studies_dir: Path = Path("studies")

    def __post_init__(self) -> None:
        object.__setattr__(self, "flags", dict(self.flags))
        object.__setattr__(self, "loads", tuple(self.loads))
        at_least("--input-len", self.input_len, 1)
        at_least("--output-len", self.output_len, 1)
        if not self.server.url and not self.server.model:
            raise CalibrationError("no server: pass --url of a running server, or --model "
                                   "(and --vllm-cmd) for autotune to start one")
        if self.dataset not in ("sharegpt", "synthetic"):
            raise CalibrationError(f"unknown --dataset {self.dataset!r}; use sharegpt or "
                                   "synthetic")


def parse_loads(text: str) -> tuple[float, ...]:
    """``"0.5,0.8"`` -> (0.5, 0.8): fractions of the saturated service rate."""
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise CalibrationError(f"--loads {text!r}: give fractions of the service rate "
                               "separated by commas, e.g. 0.5,0.8") from None
    if not loads or any(not (0 < x <= 1.5 and math.isfinite(x)) for x in loads):
        raise CalibrationError(f"--loads {text!r}: each load must be above 0 and at most 1.5 "
                               "times the service rate, e.g. 0.5,0.8")
    return loads


def _prior(o: CalibrateOptions) -> tuple[HardwareProfile, ModelProfile]:
    return o.prior.load()


def run_calibration(o: CalibrateOptions) -> int:
    """Run the load shapes, fit, write the profile; the exit code (0)."""
    check_writable(o.out, "--out")
    check_writable(o.json_path, "--json")
    prior, model = _prior(o)
    server, w = o.server, o.workload
    kind = "attach" if server.url else "vllm"
    # An attached server runs the config it was started with: --param describes it to
    # the twin and is not sent anywhere.
    launch = {} if kind == "attach" else dict(o.flags)
    backend, where = server_backend(kind, url=server.url, model=server.model,
                                    vllm_cmd=server.vllm_cmd, env=dict(server.env),
                                    log_dir=o.studies_dir / "calibrate" / "logs")
    try:
        wl = _workload(o)
        # Fixed-count tests, never pruned: the limit only labels a verdict nobody reads.
        probe = BackendProbe(backend, launch, combine("3600s", None), list(wl.requests),
                             warmup=w.warmup, seed=w.seed, prune=False, steady=None,
                             fresh=True)
        console.print(f"calibrating {prior.name} ({model.name}) against {where}, config "
                      f"{dict(o.flags) or 'the defaults'}; workload {wl.source} "
                      f"({w.num_prompts} measured requests per test after {w.warmup} "
                      f"warm-up, tokens counted with {wl.tokenizer}); shapes: all at once, "
                      f"then {', '.join(f'{x:g}' for x in o.loads)} x the service rate",
                      soft_wrap=True)
        shapes = _run_shapes(o, probe, where)
    finally:
        backend.close()
    tests = _observations(o, probe, shapes)
    try:
        fit = fit_twin(tests, prior, model, name=f"{prior.name}-calibrated")
    except TwinError as exc:
        raise CalibrationError(f"cannot fit {prior.name} to these tests: {exc}") from None
    header = [f"Written by autotune calibrate against {where}, config "
              f"{dict(o.flags) or 'the defaults'}; workload {wl.source}, "
              f"{w.num_prompts} requests per test after {w.warmup} warm-up."]
    write_twin(fit, o.out, header=header)
    _print_fit(fit, o, model)
    if o.json_path is not None:
        write_json(o.json_path, {"where": where, "config": dict(o.flags),
                                 "workload": wl.source, "fit": fit.to_dict()})
        console.print(f"wrote {o.json_path}")
    return 0


def _run_shapes(o: CalibrateOptions, probe: BackendProbe, where: str) -> list[float]:
    """Run the saturation test, then the Poisson tests at ``o.loads`` times the service
    rate it showed; the rates run, in ``probe.results`` order (inf: all at once)."""
    w = o.workload
    shapes: list[float] = [math.inf]
    sat = probe(math.inf, w.num_prompts)
    service = sat.summary.request_throughput
    if not service > 0:
        raise CalibrationError(f"the saturation test on {where} completed no request: "
                               "is the server healthy?")
    console.print(f"  all at once: {service:.3g} req/s, "
                  f"{sat.summary.output_throughput:,.0f} output tok/s "
                  f"({sat.summary.num_completed} completed; measured)",
                  soft_wrap=True, highlight=False)
    for load in o.loads:
        rate = load * service
        shapes.append(rate)
        r = probe(rate, w.num_prompts)
        console.print(f"  {load:g} x = {rate:.3g} req/s: P50 e2e {r.summary.e2e.p50:.3g} s, "
                      f"mean TTFT {r.summary.ttft.mean * 1000:.0f} ms, "
                      f"{r.summary.output_throughput:,.0f} output tok/s "
                      f"({r.summary.num_completed} completed; measured)",
                      soft_wrap=True, highlight=False)
    return shapes


def _observations(o: CalibrateOptions, probe: BackendProbe, shapes: list[float]
                  ) -> list[ObservedTest]:
    """The tests the fit may use, labelled with the config; one the twin cannot use is
    said, never silently dropped."""
    tests = []
    for i, rate in enumerate(shapes):
        try:
            obs = observation_of(probe, probe.results[i], rate=rate,
                                 num_prompts=o.workload.num_prompts,
                                 label="saturation" if math.isinf(rate) else "poisson")
        except TwinError as exc:
            console.print(f"  not fitted: {exc}", soft_wrap=True, highlight=False)
            continue
        tests.append(replace(obs, flags=dict(o.flags)))
    return tests


def _print_fit(fit: TwinFit, o: CalibrateOptions, model: ModelProfile) -> None:
    """Say how well the fit matches each test (against the prior), what each factor
    came to, and where the profile was written."""
    for t in fit.tests:
        errs = ", ".join(f"{n} {e:+.1%}" for n, e in t.errors().items())
        prior_errs = ", ".join(f"{e:+.0%}" for e in t.errors("prior").values())
        console.print(f"  fit, {t.label}: {errs} (prior: {prior_errs}); simulated vs "
                      "measured", soft_wrap=True, highlight=False)
    for f in fit.factors:
        state = ("held at 1: " + f.note) if not f.fitted else (
            f"x{f.value:.3g} (95% {f.low:.3g}..{f.high:.3g})"
            + ("" if f.identified else "; not identified: " + f.note))
        console.print(f"  {f.name}: {state}", soft_wrap=True, highlight=False)
    console.print(f"wrote {o.out} (RMS log error {fit.rms_log_error:.3f} over "
                  f"{len(fit.tests)} tests, in-sample; use it as --profile "
                  f"{o.out}:{model.name})", soft_wrap=True)


def _workload(o: CalibrateOptions) -> Any:
    w = o.workload
    return pool_workload(
        dataset=o.dataset, tokenizer_path=w.tokenizer, url=o.server.url,
        # Each shape sends prompts no other shape did: vLLM caches prefixes by default.
        model=o.server.model, total=(1 + len(o.loads)) * w.num_prompts + w.warmup,
        seed=w.seed,
        input_len=o.input_len, output_len=o.output_len,
        context=w.max_model_len or int(o.flags.get("max_model_len") or DEFAULT_CONTEXT))
