"""Fit a hardware profile's cost coefficients to step times measured on a real engine.

The simulator prices a step through :class:`~autotune.sim.costmodel.CostModel`::

    step = max(compute, memory) + communication + step_overhead + seqs x per_seq_overhead
    compute = (2 x matmul params x tokens + 4 x layers x heads x head_dim x pairs)
              / (TP x peak_tflops x compute_efficiency)
    memory = (weight bytes + KV bytes read) / TP / (peak_bandwidth_gbs x bandwidth_efficiency)

Given measured step times (each with the batch that produced it), :func:`fit_step_times`
finds the achieved FLOP/s, ``step_overhead_ms`` and ``per_seq_overhead_us`` (and, on
request, the achieved memory bandwidth) that minimise the squared relative error of that
very formula, and returns the old profile with those fields replaced, plus the residuals
and R².  Interconnect figures are always kept (one device, nothing to see).  Bandwidth
is kept unless asked for: on a small model the weight stream hides in a step's host
overhead, and only decodes over different context lengths (KV entries read) show it.

Decode-only steps cannot separate the per-token compute from the per-sequence overhead
(one token per sequence), so the samples must include steps with more tokens than
sequences (prefills).

The API front end (:mod:`autotune.sim.frontend`) is fitted apart, by
:func:`fit_front_end`: its per-request and per-output-token CPU costs from what load
tests cost the API-server process and from time to first token less the prefill step,
by linear least squares, with standard errors.  Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import yaml
from scipy.optimize import minimize, minimize_scalar, nnls

from autotune.sim.config import ConfigRefused, EngineConfig, resolve
from autotune.sim.costmodel import CostModel
from autotune.sim.profiles import HardwareProfile, ModelProfile


@dataclass(frozen=True)
class StepSample:
    """One measured engine step: the batch it ran and how long it took.

    ``kv_tokens`` and ``pairs`` follow the scheduler's conventions (KV entries read and
    attention (query, key) pairs, summed over the batch's sequences).
    """

    tokens: int
    seqs: int
    kv_tokens: float
    pairs: float
    seconds: float
    label: str = ""

    @classmethod
    def decode(cls, batch: int, context: float, seconds: float, label: str = "") -> StepSample:
        """``batch`` sequences decoding one token each over a mean ``context`` tokens."""
        kv = float(batch) * (context + 1)
        return cls(batch, batch, kv, kv, seconds, label or f"decode x{batch}")

    @classmethod
    def prefill(cls, prompt: int, seconds: float, *, decode_batch: int = 0,
                decode_context: float = 0.0, label: str = "") -> StepSample:
        """A whole ``prompt`` prefilled in one step beside ``decode_batch`` decodes."""
        kv_dec = float(decode_batch) * (decode_context + 1)
        pairs = prompt * (prompt + 1) / 2 + kv_dec
        return cls(prompt + decode_batch, 1 + decode_batch, prompt + kv_dec, pairs, seconds,
                   label or f"prefill {prompt}" + (f" + decode x{decode_batch}"
                                                   if decode_batch else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "tokens": self.tokens, "seqs": self.seqs,
                "kv_tokens": self.kv_tokens, "pairs": self.pairs, "seconds": self.seconds}


@dataclass(frozen=True)
class Calibration:
    """A fitted profile and how well it reproduces the samples through the cost model."""

    hardware: HardwareProfile
    previous: HardwareProfile
    samples: tuple[StepSample, ...]
    predicted_s: tuple[float, ...]
    memory_bound: tuple[bool, ...]  # the memory side of the roofline set that step's time
    r2: float  # on the step times themselves (not the weighted objective)
    rmse_s: float
    max_rel_error: float
    bandwidth_fitted: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def achieved_tflops(self) -> float:
        return self.hardware.achieved_flops / 1e12

    @property
    def residuals_s(self) -> tuple[float, ...]:
        """Measured minus predicted, per sample."""
        return tuple(s.seconds - p for s, p in zip(self.samples, self.predicted_s, strict=True))

    def fitted_fields(self) -> dict[str, float]:
        hw = self.hardware
        out = {"peak_tflops": hw.peak_tflops, "compute_efficiency": hw.compute_efficiency,
               "step_overhead_ms": hw.step_overhead_ms,
               "per_seq_overhead_us": hw.per_seq_overhead_us}
        if self.bandwidth_fitted:
            out.update(peak_bandwidth_gbs=hw.peak_bandwidth_gbs,
                       bandwidth_efficiency=hw.bandwidth_efficiency)
        return out

    def to_dict(self) -> dict[str, Any]:
        rows = [{**s.to_dict(), "predicted_s": p, "residual_s": s.seconds - p,
                 "memory_bound": mb}
                for s, p, mb in zip(self.samples, self.predicted_s, self.memory_bound,
                                    strict=True)]
        return {"profile": self.hardware.name, "fitted": self.fitted_fields(),
                "achieved_tflops": self.achieved_tflops,
                "achieved_bandwidth_gbs": self.hardware.achieved_bandwidth / 1e9,
                "bandwidth_fitted": self.bandwidth_fitted, "r2": self.r2,
                "rmse_s": self.rmse_s, "max_rel_error": self.max_rel_error,
                "samples": rows, "notes": list(self.notes)}


def cost_model(hardware: HardwareProfile, model: ModelProfile,
               tensor_parallel_size: int = 1) -> CostModel:
    """The simulator's cost model for ``model`` on ``hardware`` (vLLM's default config)."""
    try:
        setup = resolve(EngineConfig(model.name, tensor_parallel_size=tensor_parallel_size),
                        hardware, model)
    except ConfigRefused as exc:
        raise ValueError(f"cannot price steps of {model.name} on {hardware.name}: {exc}"
                         ) from None
    return CostModel.for_setup(setup)


def predict(samples: Sequence[StepSample], hardware: HardwareProfile, model: ModelProfile,
            tensor_parallel_size: int = 1) -> np.ndarray:
    """Step times (seconds) the simulator's cost model gives for ``samples``."""
    cm = cost_model(hardware, model, tensor_parallel_size)
    return np.array([cm.step(s.tokens, s.seqs, s.kv_tokens, s.pairs).total_s
                     for s in samples])


def _timed(samples: Sequence[Any], need: int, fits: str, seconds: str
           ) -> Iterator[tuple[str, Any]]:
    """Each sample with its name, after the checks every fit's samples share: enough of
    them for its unknowns, and each timed by a finite number of seconds above 0."""
    if len(samples) < need:
        raise ValueError(f"need at least {need} {fits}, got {len(samples)}")
    for i, s in enumerate(samples):
        what = s.label or f"sample {i}"
        if not (math.isfinite(s.seconds) and s.seconds > 0):
            raise ValueError(f"{what}: {seconds}, got {s.seconds!r}")
        yield what, s


def _check(samples: Sequence[StepSample]) -> None:
    for what, s in _timed(samples, 4, "step samples to fit 3 coefficients",
                          "step time must be a finite number of seconds > 0"):
        if s.seqs < 1 or s.tokens < s.seqs:
            raise ValueError(f"{what}: need tokens >= seqs >= 1, got tokens={s.tokens} "
                             f"seqs={s.seqs}")
        if not (s.kv_tokens >= 0 and s.pairs >= 0):
            raise ValueError(f"{what}: kv_tokens and pairs must be >= 0")
    if not any(s.tokens > s.seqs for s in samples):
        raise ValueError("every sample is decode-only (one token per sequence): the "
                         "per-token compute cannot be told apart from the per-sequence "
                         "overhead; add prefill steps (tokens > seqs)")
    if len({s.seqs for s in samples}) < 2:
        raise ValueError("every sample has the same number of sequences: the per-sequence "
                         "overhead cannot be told apart from the per-step overhead; add "
                         "steps with other batch sizes")


def fit_step_times(
    samples: Sequence[StepSample],
    hardware: HardwareProfile,
    model: ModelProfile,
    *,
    tensor_parallel_size: int = 1,
    relative: bool = True,
    fit_bandwidth: bool = False,
) -> Calibration:
    """Least-squares fit of achieved FLOP/s, step and per-sequence overhead (and, with
    ``fit_bandwidth``, the achieved memory bandwidth).

    ``relative``: minimise squared relative errors (a 6 ms decode step counts as much as
    a 100 ms prefill), else absolute ones.  The achieved FLOP/s is written back as
    ``compute_efficiency`` of the profile's ``peak_tflops`` (or, should it exceed the
    peak, as ``peak_tflops`` at efficiency 1); the bandwidth likewise as
    ``bandwidth_efficiency`` of ``peak_bandwidth_gbs``.  Bandwidth is only identifiable
    from decode steps over different context lengths (KV entries read); when the best
    fit leaves every sample compute-bound, the profile's bandwidth is kept and a note
    says so.  Raises ``ValueError`` on samples that cannot identify the coefficients.
    """
    samples = tuple(samples)
    _check(samples)
    if fit_bandwidth and len({s.kv_tokens for s in samples}) < 3:
        raise ValueError("fitting the bandwidth needs steps over at least 3 different "
                         "numbers of KV entries read (decodes at several contexts)")
    fit = _step_fit(samples, hardware, model, tensor_parallel_size, relative)
    inv_flops, inv_bw, i = _best_rates(fit, fit_bandwidth)
    _, (step_s, seq_s) = fit.solve(inv_flops, inv_bw)
    notes: list[str] = []
    if i == 0:
        notes.append("per-token compute is at the lower end of the search: the samples "
                     "barely depend on batch tokens")
    if fit_bandwidth and not (fit.nbytes * inv_bw > fit.work * inv_flops).any():
        # The best fit never lets memory bind: the bandwidth is not identified by these
        # samples, so fit the rest with the profile's, as if it had not been asked for.
        kept = fit_step_times(samples, hardware, model,
                              tensor_parallel_size=tensor_parallel_size, relative=relative)
        return replace(kept, notes=("no sample is memory-bound at the best fit: the "
                                    "bandwidth is not identified, the profile's is kept",
                                    *kept.notes))
    fitted = _fitted_profile(hardware, inv_flops, inv_bw, float(step_s), float(seq_s),
                             tensor_parallel_size, fit_bandwidth, notes)
    return _calibration(samples, fitted, hardware, model, tensor_parallel_size, fit.y,
                        fit_bandwidth, notes)


@dataclass(frozen=True, eq=False)
class _StepFit:
    """Each sample priced once at the old profile: the work in FLOP and in bytes (divide
    by FLOP/s and bytes/s for seconds) and the all-reduces, which the fit keeps, so
    the search only rescales them."""

    work: np.ndarray
    nbytes: np.ndarray
    comm: np.ndarray
    seqs: np.ndarray
    y: np.ndarray  # measured seconds
    w: np.ndarray  # 1 / y for relative errors, else ones
    design: np.ndarray
    bw_now: float  # the profile's achieved bytes/s, kept unless the bandwidth is fitted

    def solve(self, inv_flops: float, inv_bw: float) -> tuple[float, np.ndarray]:
        """For given s/FLOP and s/byte: the best (step, per-seq) overheads >= 0, and
        the weighted SSE."""
        device = np.maximum(self.work * inv_flops, self.nbytes * inv_bw) + self.comm
        coef, _ = nnls(self.design, (self.y - device) * self.w)
        pred = device + coef[0] + coef[1] * self.seqs
        return float(np.sum(((self.y - pred) * self.w) ** 2)), coef


def _step_fit(samples: Sequence[StepSample], hardware: HardwareProfile, model: ModelProfile,
              tensor_parallel_size: int, relative: bool) -> _StepFit:
    """The least-squares problem of :func:`fit_step_times`, apart from its search."""
    base = cost_model(hardware, model, tensor_parallel_size)
    flops_now = tensor_parallel_size * hardware.achieved_flops
    bw_now = hardware.achieved_bandwidth
    work = np.array([(s.tokens * base.s_per_token_compute + s.pairs * base.s_per_pair)
                     * flops_now for s in samples])
    nbytes = np.array([(base.s_weights + s.kv_tokens * base.s_per_kv_token) * bw_now
                       for s in samples])
    comm = np.array([base.s_comm_fixed + s.tokens * base.s_comm_per_token for s in samples])
    seqs = np.array([float(s.seqs) for s in samples])
    y = np.array([s.seconds for s in samples])
    w = 1.0 / y if relative else np.ones_like(y)
    design = np.column_stack([np.ones_like(y), seqs]) * w[:, None]
    return _StepFit(work, nbytes, comm, seqs, y, w, design, bw_now)


def _best_rates(fit: _StepFit, fit_bandwidth: bool) -> tuple[float, float, int]:
    """(s/FLOP, s/byte) of the least error, and the FLOP grid's index of the basin (0:
    at the search's lower end, which the caller notes)."""
    # The objective is piecewise quadratic (the roofline's max): scan a wide log grid
    # for the basin, then refine inside it.
    y = fit.y
    f_scale = float(np.max(y) / np.max(fit.work))
    f_grid = f_scale * np.logspace(-6, 1, 281 if not fit_bandwidth else 71)
    b_grid = (float(np.max(y) / np.max(fit.nbytes)) * np.logspace(-6, 1, 71)
              if fit_bandwidth else np.array([1.0 / fit.bw_now]))
    sse = np.array([[fit.solve(f, b)[0] for b in b_grid] for f in f_grid])
    i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
    inv_flops, inv_bw = float(f_grid[i]), float(b_grid[j])
    if fit_bandwidth:
        res = minimize(lambda x: fit.solve(math.exp(x[0]), math.exp(x[1]))[0],
                       x0=[math.log(inv_flops), math.log(inv_bw)], method="Nelder-Mead",
                       options={"xatol": 1e-6, "fatol": 1e-14, "maxiter": 2000})
        if res.fun <= sse[i, j]:
            inv_flops, inv_bw = math.exp(res.x[0]), math.exp(res.x[1])
    else:
        lo, hi = f_grid[max(i - 1, 0)], f_grid[min(i + 1, len(f_grid) - 1)]
        res = minimize_scalar(lambda g: fit.solve(g, inv_bw)[0], bounds=(lo, hi),
                              method="bounded", options={"xatol": lo * 1e-9})
        if res.fun <= sse[i, j]:
            inv_flops = float(res.x)
    return inv_flops, inv_bw, int(i)


def _fitted_profile(hardware: HardwareProfile, inv_flops: float, inv_bw: float,
                    step_s: float, seq_s: float, tensor_parallel_size: int,
                    fit_bandwidth: bool, notes: list[str]) -> HardwareProfile:
    """The fit written back as profile fields: an achieved rate above the profile's peak
    raises the peak (efficiency 1) rather than writing an efficiency over 1, and
    ``notes`` says so."""
    achieved_tflops = 1.0 / inv_flops / tensor_parallel_size / 1e12
    peak, eff = hardware.peak_tflops, achieved_tflops / hardware.peak_tflops
    if eff > 1.0:
        notes.append(f"achieved {achieved_tflops:.4g} TFLOP/s exceeds the profile's peak "
                     f"{peak:.4g}: peak_tflops raised to it, compute_efficiency 1")
        peak, eff = achieved_tflops, 1.0
    achieved_gbs = 1.0 / inv_bw / 1e9
    bw_peak, bw_eff = hardware.peak_bandwidth_gbs, achieved_gbs / hardware.peak_bandwidth_gbs
    if bw_eff > 1.0:
        notes.append(f"achieved {achieved_gbs:.4g} GB/s exceeds the profile's peak "
                     f"{bw_peak:.4g}: peak_bandwidth_gbs raised to it, efficiency 1")
        bw_peak, bw_eff = achieved_gbs, 1.0
    fitted = replace(hardware, peak_tflops=float(peak), compute_efficiency=float(eff),
                     step_overhead_ms=float(step_s) * 1e3,
                     per_seq_overhead_us=float(seq_s) * 1e6)
    if fit_bandwidth:
        fitted = replace(fitted, peak_bandwidth_gbs=float(bw_peak),
                         bandwidth_efficiency=float(bw_eff))
    return fitted


def _calibration(samples: tuple[StepSample, ...], fitted: HardwareProfile,
                 hardware: HardwareProfile, model: ModelProfile, tensor_parallel_size: int,
                 y: np.ndarray, fit_bandwidth: bool, notes: list[str]) -> Calibration:
    """How well the fitted profile explains the samples, through the real cost model
    rather than the fit's algebra, so the figures are what the simulator will do."""
    pred = predict(samples, fitted, model, tensor_parallel_size)
    cm = cost_model(fitted, model, tensor_parallel_size)
    mem_bound = tuple(
        bool(cm.s_weights + s.kv_tokens * cm.s_per_kv_token
             > s.tokens * cm.s_per_token_compute + s.pairs * cm.s_per_pair)
        for s in samples)
    if any(mem_bound):
        notes.append(f"{sum(mem_bound)} of {len(samples)} samples are memory-bound under the "
                     + ("fitted" if fit_bandwidth else "kept") + " bandwidth")
    resid = y - pred
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else float("nan")
    return Calibration(
        hardware=fitted, previous=hardware, samples=samples,
        predicted_s=tuple(float(p) for p in pred), memory_bound=mem_bound, r2=r2,
        rmse_s=float(np.sqrt(np.mean(resid**2))),
        max_rel_error=float(np.max(np.abs(resid) / y)), bandwidth_fitted=fit_bandwidth,
        notes=tuple(notes))


def profile_yaml(cal: Calibration, header: Sequence[str],
                 comments: Mapping[str, str] | None = None) -> str:
    """The fitted profile as a ``hardware.<name>.yaml`` file with ``header`` on top.

    Every field of the profile is written (so the file is complete on its own); the
    fitted ones say so on their line, others carry ``comments[field]`` when given.
    """
    return hardware_yaml(cal.hardware, header, fitted=set(cal.fitted_fields()),
                         comments=comments)


def hardware_yaml(hardware: HardwareProfile, header: Sequence[str], *,
                  fitted: set[str] | frozenset[str] = frozenset(),
                  comments: Mapping[str, str] | None = None) -> str:
    """``hardware`` as a ``hardware.<name>.yaml`` file (``load_hardware`` reads it),
    ``header`` as comment lines on top; the ``fitted`` fields say so on their line,
    after which ``comments[field]`` follows (for any field)."""
    comments = dict(comments or {})
    lines = [f"# {h}".rstrip() for h in header]
    lines.append("kind: hardware")
    for f in fields(hardware):
        value = getattr(hardware, f.name)
        if isinstance(value, float):
            value = float(f"{value:.6g}")
        line = yaml.safe_dump({f.name: value}, sort_keys=False, width=1000).strip()
        note = "fitted" if f.name in fitted else comments.get(f.name, "")
        if f.name in fitted and f.name in comments:
            note = f"fitted; {comments[f.name]}"
        lines.append(f"{line:<31} # {note}" if note else line)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- front end


@dataclass(frozen=True)
class FrontEndSample:
    """What ``requests`` requests with ``output_tokens`` output tokens in all cost the API
    front end: ``seconds`` = request cost x requests + token cost x output tokens."""

    requests: float
    output_tokens: float
    seconds: float
    label: str = ""

    @classmethod
    def load_test(cls, requests: int, output_tokens: int, cpu_s: float,
                  label: str = "") -> FrontEndSample:
        """The API-server process's CPU seconds over a load test (warm-up included if
        its requests are counted) that served ``requests`` and ``output_tokens``."""
        return cls(float(requests), float(output_tokens), cpu_s,
                   label or f"load test: {requests} requests, {output_tokens} tokens")

    @classmethod
    def first_token(cls, seconds: float, label: str = "") -> FrontEndSample:
        """One request's time to first token less its prefill step, on an idle server:
        the front end takes the request in, then sends its first token."""
        return cls(1.0, 1.0, seconds, label or "first token less prefill")

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "requests": self.requests,
                "output_tokens": self.output_tokens, "seconds": self.seconds}


@dataclass(frozen=True)
class FrontEndFit:
    """The front end's fitted costs (seconds) with their standard errors."""

    request_s: float
    token_s: float
    request_se_s: float  # nan when no degree of freedom is left (as many samples as costs)
    token_se_s: float
    dof: int  # degrees of freedom of the standard errors: samples less 2 (Student's t)
    samples: tuple[FrontEndSample, ...]
    predicted_s: tuple[float, ...]
    notes: tuple[str, ...] = ()

    @property
    def residuals_s(self) -> tuple[float, ...]:
        """Measured minus predicted, per sample."""
        return tuple(s.seconds - p for s, p in zip(self.samples, self.predicted_s, strict=True))

    @property
    def max_rel_error(self) -> float:
        return max(abs(r) / s.seconds for r, s in zip(self.residuals_s, self.samples,
                                                       strict=True))

    def profile(self, hardware: HardwareProfile) -> HardwareProfile:
        """``hardware`` with these front-end costs (its share of the engine's core kept)."""
        return replace(hardware, frontend_request_ms=self.request_s * 1e3,
                       frontend_token_us=self.token_s * 1e6)

    def to_dict(self) -> dict[str, Any]:
        rows = [{**s.to_dict(), "predicted_s": p, "residual_s": s.seconds - p}
                for s, p in zip(self.samples, self.predicted_s, strict=True)]
        return {"frontend_request_ms": self.request_s * 1e3,
                "frontend_request_ms_se": self.request_se_s * 1e3,
                "frontend_token_us": self.token_s * 1e6,
                "frontend_token_us_se": self.token_se_s * 1e6,
                "dof": self.dof, "max_rel_error": self.max_rel_error, "samples": rows,
                "notes": list(self.notes)}


def _check_front(samples: Sequence[FrontEndSample]) -> None:
    for what, s in _timed(samples, 2, "front-end samples to fit 2 costs",
                          "seconds must be a finite number > 0"):
        if not (s.requests >= 0 and s.output_tokens >= 0 and s.requests + s.output_tokens > 0):
            raise ValueError(f"{what}: need requests >= 0 and output_tokens >= 0, not both 0")


def fit_front_end(samples: Sequence[FrontEndSample], *, relative: bool = True
                  ) -> FrontEndFit:
    """Least-squares per-request and per-output-token front-end costs, with standard
    errors.

    ``relative``: weigh each sample by 1/seconds, so an 8 ms first token counts as much
    as a load test's 20 CPU seconds (and noise proportional to the figure is treated
    alike).  Costs are held at >= 0 (a note says when one was).  The standard errors
    are the usual ones of weighted least squares (residual variance times the inverse
    normal matrix); they need more samples than costs.  Raises ``ValueError`` when the
    samples cannot tell the two costs apart: every sample with the same tokens per
    request (load tests of one output length and no first-token sample, or first-token
    samples alone).
    """
    samples = tuple(samples)
    _check_front(samples)
    x = np.array([[s.requests, s.output_tokens] for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    w = 1.0 / y if relative else np.ones_like(y)
    xw, yw = x * w[:, None], y * w
    scale = np.abs(xw).max(axis=0)  # columns of like size, for a well-posed rank test
    if np.linalg.matrix_rank(xw / scale) < 2:
        raise ValueError("the samples cannot tell the per-request cost from the per-token "
                         "cost: every one has the same output tokens per request; add "
                         "load tests with other output lengths, or first-token samples "
                         "beside load tests")
    free, *_ = np.linalg.lstsq(xw, yw, rcond=None)
    if relative:
        # Weights from the measured figures lean towards samples whose noise came out
        # low; refit with weights from the fit's own predictions (they carry no noise).
        for _ in range(2):
            pred = x @ free
            if (pred <= 0).any():
                break
            w = 1.0 / pred
            xw, yw = x * w[:, None], y * w
            free, *_ = np.linalg.lstsq(xw, yw, rcond=None)
    notes: list[str] = []
    coef = free
    if (free < 0).any():
        coef, _ = nnls(xw, yw)
        for name, f in zip(("per-request", "per-token"), free, strict=True):
            if f < 0:
                notes.append(f"the unconstrained {name} cost came out negative ({f:.3g} s): "
                             "held at 0")
    resid = yw - xw @ coef
    dof = len(samples) - 2
    if dof > 0:
        cov = float(resid @ resid) / dof * np.linalg.inv(xw.T @ xw)
        se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    else:
        se = np.full(2, math.nan)
        notes.append("as many samples as costs: no standard error (add samples)")
    pred = x @ coef
    return FrontEndFit(request_s=float(coef[0]), token_s=float(coef[1]),
                       request_se_s=float(se[0]), token_se_s=float(se[1]), dof=dof,
                       samples=samples,
                       predicted_s=tuple(float(p) for p in pred), notes=tuple(notes))
