"""One-variable sweeps: the seed's methodology (section 4.3-4.4) as a driver.

Everything but the swept variable stays fixed.  A server-side parameter
(``--param max_num_seqs=64,128,192``) gets one server start per value, reused across
the client-side values (``--rate 10:50:10`` or ``--concurrency 32,64,128``) run on it.
Each point is one full load test through :func:`autotune.tuning.trial.evaluate` (no
pruning: a sweep wants every figure), judged for overload, diagnosed, and the whole
sweep is read for its knee and, over TP/GPU counts, for its scaling.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from autotune.analysis import diagnose as dg
from autotune.analysis.knee import DEFAULT_MAX_GAIN, DEFAULT_MIN_RISE, Knee, find_knee
from autotune.analysis.scaling import ScalePoint, Scaling, analyze_scaling
from autotune.backends.base import Backend, LoadPlan, TrialFailed
from autotune.core.errors import AutotuneError
from autotune.core.files import json_safe
from autotune.servers import telemetry as tm
from autotune.servers.telemetry import engine_figures, parse_prometheus, parse_prometheus_samples
from autotune.study.space import flag_type_error
from autotune.tuning.pruning import UNBOUNDED_BACKLOG, PrunerSettings, decide
from autotune.tuning.trial import COMPLETE, INFEASIBLE, PRUNED, TrialResult, evaluate

CLIENT_VARS = ("rate", "concurrency")
# Parameters whose values change how many GPUs a layout uses: scaling analysis applies.
SCALING_PARAMS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
_SHORT = {"tensor_parallel_size": "TP", "pipeline_parallel_size": "PP",
          "data_parallel_size": "DP"}
SERVED_SHARE = 0.90  # completions under this share of the offered rate = overloaded
_NUM = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"


class SweepError(AutotuneError, ValueError):
    """A sweep that cannot be run as asked; the message says how to fix it."""


# ----------------------------------------------------------------------------- parsing


def parse_values(text: str, *, name: str, integer: bool = False) -> list[float]:
    """``'10,20,30'`` or ``'10:50:10'`` (start:stop:step, stop included) -> numbers."""
    text = text.strip()
    m = re.fullmatch(rf"({_NUM}):({_NUM}):({_NUM})", text)
    if m:
        start, stop, step = (float(g) for g in m.groups())
        if step <= 0 or stop < start:
            raise SweepError(f"{name} {text!r}: give START:STOP:STEP with STEP > 0 and "
                             "STOP >= START, e.g. 10:50:10")
        count = int(math.floor((stop - start) / step + 1e-9)) + 1
        values = [round(start + i * step, 10) for i in range(count)]
    else:
        values = []
        for part in text.split(","):
            part = part.strip()
            try:
                values.append(float(part))
            except ValueError:
                raise SweepError(f"{name} {text!r}: {part!r} is not a number; give a list "
                                 "like 10,20,30 or a range like 10:50:10") from None
    if not values:
        raise SweepError(f"{name} is empty: give values like 10,20,30")
    for v in values:
        if not v > 0:
            raise SweepError(f"{name} values must be greater than 0, got {v:g}")
        if integer and (math.isinf(v) or v != int(v)):
            raise SweepError(f"{name} values must be whole numbers, got {v:g}")
    if len(set(values)) != len(values):
        raise SweepError(f"{name} {text!r} repeats a value")
    return sorted(int(v) if integer else v for v in values)


def _coerce(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text.strip()


def parse_param(text: str) -> tuple[str, list[Any]]:
    """``'max_num_seqs=64,128,192'`` (or a START:STOP:STEP range) -> name and values."""
    name, sep, rest = text.partition("=")
    name = name.strip().replace("-", "_").lstrip("_")
    if not sep or not name or not rest.strip():
        raise SweepError(f"--param {text!r}: give NAME=V1,V2,... e.g. "
                         "max_num_seqs=64,128,192 or tensor_parallel_size=1,2,4")
    if name in CLIENT_VARS or name in ("request_rate", "max_concurrency"):
        raise SweepError(f"--param {name} is client-side: use --rate or --concurrency")
    if re.fullmatch(rf"\s*{_NUM}:{_NUM}:{_NUM}\s*", rest):
        values: list[Any] = [int(v) if float(v).is_integer() else v
                             for v in parse_values(rest, name=f"--param {name}")]
    else:
        values = [_coerce(p) for p in rest.split(",") if p.strip()]
    if len(set(map(str, values))) != len(values):
        raise SweepError(f"--param {text!r} repeats a value")
    for v in values:
        if (why := flag_type_error(name, v)) is not None:
            raise SweepError(f"--param {why}")
    return name, values


# ----------------------------------------------------------------------------- the spec


@dataclass
class SweepSpec:
    """What to sweep: at most one server-side parameter and one client-side list."""

    rates: list[float]
    concurrencies: list[int | None]
    param: str | None = None
    values: list[Any] = field(default_factory=list)
    base_flags: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.rates) > 1 and len(self.concurrencies) > 1:
            raise SweepError("sweep one client-side variable at a time: give several "
                             "--rate values or several --concurrency values, not both")
        if not self.rates or not self.concurrencies:
            raise SweepError("give at least one --rate or --concurrency value")
        if self.param is not None and not self.values:
            raise SweepError(f"--param {self.param} has no values")
        for name, value in self.base_flags.items():  # --set: refused here, not mid-sweep
            if (why := flag_type_error(name, value, "--set")) is not None:
                raise SweepError(f"--set {why}")
        if self.param is not None and self.param in self.base_flags:
            self.base_flags = {k: v for k, v in self.base_flags.items() if k != self.param}
        if self.n_points < 2:
            raise SweepError("nothing to sweep: give several --rate or --concurrency "
                             "values, or --param NAME=V1,V2")

    @property
    def client_var(self) -> str | None:
        if len(self.rates) > 1:
            return "rate"
        if len(self.concurrencies) > 1:
            return "concurrency"
        return None

    @property
    def server_values(self) -> list[Any]:
        return list(self.values) if self.param is not None else [None]

    @property
    def n_points(self) -> int:
        return len(self.server_values) * len(self.rates) * len(self.concurrencies)

    @property
    def x_name(self) -> str:
        """The variable on the x axis of the table, the knee and the plots."""
        return self.client_var or self.param or "rate"

    def flags_for(self, value: Any) -> dict[str, Any]:
        flags = dict(self.base_flags)
        if self.param is not None:
            flags[self.param] = value
        return flags

    def describe(self) -> str:
        parts = []
        if self.param is not None:
            parts.append(f"{self.param} = {', '.join(map(str, self.values))} (one server "
                         "start each)")
        rates = ", ".join("unlimited" if math.isinf(r) else f"{r:g}" for r in self.rates)
        conc = ", ".join("none" if c is None else str(c) for c in self.concurrencies)
        parts.append(f"rate {rates} req/s" + ("" if len(self.rates) > 1 else " (fixed)"))
        parts.append(f"max concurrency {conc}"
                     + ("" if len(self.concurrencies) > 1 else " (fixed)"))
        return "; ".join(parts)


# ----------------------------------------------------------------------------- points


@dataclass
class SweepPoint:
    server_value: Any
    rate: float
    concurrency: int | None
    result: TrialResult
    overloaded: bool | None = None
    overload_why: str = ""
    thirds_rps: tuple[float, float, float] | None = None
    diagnoses: list[dg.Diagnosis] = field(default_factory=list)

    @property
    def summary(self) -> Any:
        return self.result.summary

    def x(self, name: str) -> float:
        if name == "rate":
            return self.rate
        if name == "concurrency":
            return math.inf if self.concurrency is None else float(self.concurrency)
        return float(self.server_value)

    def fig(self, key: str) -> float:
        """One figure by column name; NaN when not measured."""
        s, t = self.summary, self.result.telemetry
        value: Any = None
        if key in ("gpu_util_mean_pct", "kv_usage_mean", "kv_usage_max", "running_max",
                   "batch_mean", "preemptions"):
            value = t.get(key)
        elif s is None:
            value = None
        elif key == "p99_e2e_s":
            value = s.e2e.p99
        elif key == "p99_e2e_lo_s":
            value = s.e2e.p99_lo
        elif key == "p99_e2e_hi_s":
            value = s.e2e.p99_hi
        elif key == "p99_ttft_s":
            value = s.ttft.p99
        else:
            value = getattr(s, key, None)
        return math.nan if value is None else float(value)

    def slo_text(self) -> str:
        check = self.result.check
        if check is None:
            return "-"
        return "met" if check.met else "missed (" + ", ".join(check.failed) + ")"

    def row(self, param: str | None) -> dict[str, Any]:
        r = self.result
        row: dict[str, Any] = {}
        if param is not None:
            row[param] = self.server_value
        row.update({
            "rate": self.rate, "concurrency": self.concurrency, "status": r.status,
            "reason": r.reason, "detail": r.detail,
            "num_measured": None if self.summary is None else self.summary.num_measured,
            "num_completed": None if self.summary is None else self.summary.num_completed,
            "warmup_excluded": (None if self.summary is None
                                else self.summary.num_warmup_excluded),
            "window_s": None if self.summary is None else self.summary.duration_s,
        })
        for key in ("request_throughput", "output_throughput", "total_token_throughput",
                    "p99_e2e_s", "p99_e2e_lo_s", "p99_e2e_hi_s", "p99_ttft_s",
                    "goodput_tokens", "gpu_util_mean_pct", "kv_usage_mean", "kv_usage_max",
                    "running_max", "batch_mean",
                    "preemptions", "send_lag_p99_s"):
            v = self.fig(key)
            row[key] = None if not math.isfinite(v) else v
        row.update({"slo": self.slo_text(), "overloaded": self.overloaded,
                    "overload_why": self.overload_why,
                    "diagnoses": ";".join(d.code for d in self.diagnoses),
                    "source": "simulated" if r.mode == "virtual" else "measured"})
        return row


def overload_verdict(result: TrialResult, plan: LoadPlan,
                     thirds: tuple[float, float, float] | None) -> tuple[bool | None, str]:
    """Overloaded (offered above service rate) or not, and a short why: a backlog that
    grows over the windows, or completions short of the offered rate over the last two
    thirds of the sending span.  None when it cannot be judged."""
    s = result.summary
    if s is None or result.status == INFEASIBLE and s.num_completed == 0:
        return None, f"not measured: {result.reason}: {result.detail}"
    if result.status == PRUNED:
        return True, f"pruned: {result.reason}"
    ev = result.evidence
    if ev is not None and math.isfinite(ev.offered_rate) and ev.arrival_rate > 0:
        # The steady-state evidence: the same reading as every verdict.
        if ev.backlog_lower is not None and ev.backlog_lower > ev.backlog_allowed:
            return True, f"queueing: backlog grows {ev.backlog_slope:.3g} req/s"
        # Judged on the steady-state evidence; said with the figures the table shows
        # (its rate and req/s columns), so the text and the columns never disagree.
        # A point that keeps up is not given a served figure: its req/s column (vLLM's
        # request_throughput, over the whole test, drain included) sits under the
        # offered rate even when nothing queues, and would read as a shortfall.
        if ev.served_rate < SERVED_SHARE * ev.arrival_rate:
            return True, f"serves {s.request_throughput:.1f} of {result.rate:.1f} req/s"
        return False, "backlog steady, keeps up with the offered rate"
    decision = decide(result.windows, plan.slo, planned=len(plan.requests),
                      settings=PrunerSettings(rules=(UNBOUNDED_BACKLOG,)))
    offered = s.scheduled_rate
    served = None if thirds is None else (thirds[1] + thirds[2]) / 2.0
    if decision is not None:
        trend = decision.detail.split(" (", 1)[0]  # "backlog grows X req/s"
        return True, f"queueing: {trend}"
    if not offered > 0 or math.isinf(offered):
        return None, "closed loop: the concurrency cap sets the load"
    said = f"serves {s.request_throughput:.1f} of {result.rate:.1f} req/s"
    if served is not None and served < SERVED_SHARE * offered:
        return True, said
    return False, "backlog steady" if served is None else f"backlog steady, {said}"


# ----------------------------------------------------------------------------- real telemetry


def _hist(text: str, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for s in parse_prometheus_samples(text):
        if s.name == name + "_bucket" and "le" in s.labels:
            le = float(s.labels["le"].replace("+Inf", "inf"))
            out[le] = out.get(le, 0.0) + s.value
    return out


def hist_quantile(before: Mapping[float, float], after: Mapping[float, float], q: float
                  ) -> float | None:
    """Quantile ``q`` (0..1) of a Prometheus histogram's increase, interpolated linearly
    inside the bucket (as ``histogram_quantile`` does)."""
    bounds = sorted(after)
    cum = [after[b] - before.get(b, 0.0) for b in bounds]
    if not cum or cum[-1] <= 0:
        return None
    target = q * cum[-1]
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, cum, strict=True):
        if c >= target:
            if math.isinf(b):
                return prev_b
            return prev_b + (b - prev_b) * ((target - prev_c) / (c - prev_c) if c > prev_c
                                            else 1.0)
        prev_b, prev_c = b, c
    return None


@contextlib.contextmanager
def real_telemetry(url: str | None, *, nvml: bool = True) -> Iterator[dict[str, Any]]:
    """Around one real load test: per-GPU NVML figures, KV usage from /metrics, and
    queue time and preemptions as increases of vLLM's counters.  Best effort: what
    cannot be read is left out (and a note says so)."""
    out: dict[str, Any] = {"source": "measured"}
    notes: list[str] = []
    sampler = scraper = None
    before_text = None
    if url is not None:
        try:
            before_text = _raw_metrics(url)
        except Exception as exc:  # an endpoint without /metrics is common
            notes.append(f"no /metrics: {exc}")
        if before_text is not None:
            scraper = tm.MetricsScraper(url, interval_s=0.5).start()
    if nvml:
        with contextlib.suppress(Exception):
            sampler = tm.NvmlSampler(interval_s=0.5).start()
    try:
        yield out
    finally:
        if sampler is not None:
            gpu = sampler.stop()
            if gpu.available:
                out["gpu_util_mean_pct"] = gpu.util_mean_pct
                out["gpu_util_per_gpu_pct"] = [g.util_mean_pct for g in gpu.per_gpu]
                out["gpu_mem_used_per_gpu_bytes"] = [g.mem_used_max_bytes for g in gpu.per_gpu]
            else:
                notes.append(gpu.note)
        if scraper is not None:
            ms = scraper.stop()
            out["kv_usage_mean"] = ms.mean.get("kv_cache_usage")
            out["kv_usage_max"] = ms.max.get("kv_cache_usage")
            # vllm:num_requests_running at its highest sample: the batch the config ran.
            out["running_max"] = ms.max.get("running")
        if url is not None and before_text is not None:
            try:
                after_text = _raw_metrics(url)
                out.update(_counter_deltas(before_text, after_text))
            except Exception as exc:
                notes.append(f"/metrics after the load test: {exc}")
        out["notes"] = notes


def _raw_metrics(url: str) -> str:
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=5.0, trust_env=False)
    if r.status_code != 200:
        raise OSError(f"{url}/metrics answered {r.status_code}")
    return r.text


def _counter_deltas(before: str, after: str) -> dict[str, Any]:
    b, a = parse_prometheus(before), parse_prometheus(after)
    out: dict[str, Any] = {}
    eb, ea = engine_figures(b), engine_figures(a)
    preemptions = ea.get("preemptions")
    if preemptions is not None:
        out["preemptions"] = preemptions - (eb.get("preemptions") or 0.0)
    # The batch the config ran: tokens generated per engine step, as vLLM's counters saw
    # every step.  The gauge vllm:num_requests_running is only what the 0.5 s scrapes
    # caught: in a full test run here they missed every busy moment of a 3 s test at
    # max_num_seqs 16 and read 1.
    steps = (a.get("vllm:iteration_tokens_total_count", 0.0)
             - b.get("vllm:iteration_tokens_total_count", 0.0))
    generated = ea.get("generation_tokens")
    if steps > 0 and generated is not None:
        out["batch_mean"] = (generated - (eb.get("generation_tokens") or 0.0)) / steps
    name = "vllm:request_queue_time_seconds"
    n = a.get(name + "_count", 0.0) - b.get(name + "_count", 0.0)
    if n > 0:
        out["queue_time_mean_s"] = (a.get(name + "_sum", 0.0) - b.get(name + "_sum", 0.0)) / n
        p99 = hist_quantile(_hist(before, name), _hist(after, name), 0.99)
        if p99 is not None:
            out["queue_time_p99_s"] = p99
    return out


# ----------------------------------------------------------------------------- the sweep


@dataclass
class SweepResult:
    spec: SweepSpec
    points: list[SweepPoint]
    source: str  # "simulated (virtual time)" or "measured (HTTP)"
    how: str
    knees: dict[str, Knee] = field(default_factory=dict)  # per server value (or "all")
    warnings: list[dg.Diagnosis] = field(default_factory=list)  # the sweep's pitfalls
    scaling: Scaling | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0

    @property
    def simulated(self) -> bool:
        return self.source.startswith("simulated")

    def rows(self) -> list[dict[str, Any]]:
        return [p.row(self.spec.param) for p in self.points]

    def to_csv(self) -> str:
        rows = self.rows()
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["rate"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
        return buf.getvalue()

    def to_dict(self) -> dict[str, Any]:
        return json_safe({
            "how": self.how, "source": self.source, "simulated": self.simulated,
            "sweep": {"param": self.spec.param, "values": self.spec.values,
                      "rates": self.spec.rates, "concurrencies": self.spec.concurrencies,
                      "x": self.spec.x_name, "base_flags": self.spec.base_flags},
            "settings": self.settings, "server_starts": self.restarts,
            "points": [{**p.row(self.spec.param),
                        "diagnoses": [d.to_dict() for d in p.diagnoses],
                        "summary": None if p.summary is None else p.summary.to_dict(),
                        "telemetry": p.result.telemetry} for p in self.points],
            "knees": {k: v.to_dict() for k, v in self.knees.items()},
            "warnings": [d.to_dict() for d in self.warnings],
            "scaling": None if self.scaling is None else self.scaling.to_dict(),
        })


PointFn = Callable[[SweepPoint], None]


def _failed(flags: dict[str, Any], rate: float, backend: Backend, exc: TrialFailed
            ) -> TrialResult:
    return TrialResult(flags=flags, rate=rate, status=INFEASIBLE, mode=backend.mode,
                       backend=backend.name, reason=exc.reason, detail=exc.detail,
                       log_path=exc.log_path, gpus=backend.gpus_used(flags))


def _endpoint(backend: Backend) -> str | None:
    """The running server's URL (a server not started yet has none)."""
    try:
        return str(backend.server.endpoint)  # type: ignore[attr-defined]
    except Exception:
        return None


def _gpus_of(flags: Mapping[str, Any]) -> int:
    n = 1
    for key in SCALING_PARAMS:
        n *= int(flags.get(key, 1) or 1)
    return n


def run_sweep(
    spec: SweepSpec,
    backend: Backend,
    plan: LoadPlan,
    *,
    settings: Mapping[str, Any] | None = None,
    on_point: PointFn | None = None,
    knee_gain: float = DEFAULT_MAX_GAIN,
    knee_rise: float = DEFAULT_MIN_RISE,
) -> SweepResult:
    """Run every point (server values outer, client values inner), then read it."""
    if not backend.restartable and spec.param is not None:
        raise SweepError(f"--param {spec.param} is a server-side setting and an attached "
                         "server cannot be restarted: sweep --rate or --concurrency only, "
                         "or use --backend sim or vllm")
    base_settings = dict(settings or {})
    points: list[SweepPoint] = []
    real = backend.mode == "real"
    tps = sorted({int(spec.flags_for(v).get("tensor_parallel_size", 1) or 1)
                  for v in spec.server_values})
    for value in spec.server_values:
        flags = spec.flags_for(value)
        failure: TrialFailed | None = None
        startup: dict[str, Any] | None = None
        try:
            startup = backend.prepare(flags)  # one start per server value, then reused
        except TrialFailed as exc:
            failure = exc
        for conc in spec.concurrencies:
            for rate in spec.rates:
                if failure is not None:
                    point = SweepPoint(value, rate, conc, _failed(flags, rate, backend, failure))
                    point.overloaded, point.overload_why = overload_verdict(
                        point.result, plan, None)
                    points.append(point)
                    if on_point is not None:
                        on_point(point)
                    continue
                p = replace(plan, max_concurrency=conc)
                if p.steady is not None:
                    # A failing point runs its full window too: its req/s and tok/s are
                    # then the server's, not those of the seconds the fail took to show.
                    p = replace(p, steady=replace(p.steady, stop_when_failed=False))
                if real:
                    with real_telemetry(_endpoint(backend), nvml=True) as extra:
                        result = evaluate(backend, flags, rate, p)
                    result.telemetry = {**result.telemetry,
                                        **{k: v for k, v in extra.items() if v is not None}}
                else:
                    result = evaluate(backend, flags, rate, p)
                if startup is not None:  # the start this point's server came from
                    result.startup = startup
                    result.log_path = result.log_path or startup.get("log_path")
                point = SweepPoint(value, rate, conc, result)
                point.thirds_rps = dg.thirds_throughput(result.records)
                point.overloaded, point.overload_why = overload_verdict(
                    result, plan, point.thirds_rps)
                result.records = []  # the figures are kept; the records would fill memory
                points.append(point)
                if on_point is not None:
                    on_point(point)
    res = SweepResult(spec=spec, points=points, source=backend.source,
                      how=_how(spec, plan, backend), restarts=backend.restarts)
    res.settings = {**base_settings, "warmup": plan.warmup,
                    "load_levels": (spec.rates if len(spec.rates) > 1
                                    else spec.concurrencies if len(spec.concurrencies) > 1
                                    else spec.rates),
                    "tensor_parallel_sizes": tps}
    concs = set(spec.concurrencies)
    res.warnings = dg.pitfalls({**res.settings,
                                "max_concurrency": 1 if concs == {1} else None})
    _diagnose_all(res)
    res.knees = knees_of(res, max_gain=knee_gain, min_rise=knee_rise)
    res.scaling = scaling_of(res)
    return res


def _how(spec: SweepSpec, plan: LoadPlan, backend: Backend) -> str:
    if plan.steady is None:
        size = (f"every point a full load test of {len(plan.requests)} measured requests "
                f"after {plan.warmup} warm-up requests (excluded)")
    else:
        lo, hi = plan.steady.min_s(plan.slo), plan.steady.max_s(plan.slo)
        size = (f"every point a load test sized by time after {plan.warmup} warm-up "
                f"requests (excluded): at least {lo:g} s of arrivals, failing points "
                f"included, up to {hi:g} s while its verdict is uncertain")
    return f"{backend.source}: {spec.describe()}; {size}, {plan.process} arrivals, " \
           f"seed {plan.seed}, no pruning"


def _series(res: SweepResult) -> dict[str, list[SweepPoint]]:
    """Points grouped by the line they lie on: one line per server value when a
    client variable is swept, else one line over the server values."""
    if res.spec.client_var is None:
        return {"all": list(res.points)}
    out: dict[str, list[SweepPoint]] = {}
    for p in res.points:
        key = "all" if res.spec.param is None else f"{res.spec.param}={p.server_value}"
        out.setdefault(key, []).append(p)
    return out


def _numeric_x(points: Sequence[SweepPoint], x: str) -> bool:
    try:
        xs = [p.x(x) for p in points]
    except (TypeError, ValueError):
        return False
    return all(math.isfinite(v) for v in xs)


def _diagnose_all(res: SweepResult) -> None:
    x = res.spec.x_name
    for pts in _series(res).values():
        numeric = _numeric_x(pts, x)
        xs = [p.x(x) for p in pts] if numeric else list(range(len(pts)))
        toks = [p.fig("output_throughput") for p in pts]
        for i, p in enumerate(pts):
            if p.summary is None:
                continue
            flags = p.result.flags
            # The pitfalls are the sweep's, shown once (``SweepResult.warnings``).
            st = {"max_num_seqs": flags.get("max_num_seqs"),
                  "tensor_parallel_size": flags.get("tensor_parallel_size")}
            ctx = {"xs": xs, "tokens_per_s": toks, "index": i, "thirds_rps": p.thirds_rps}
            p.diagnoses = dg.diagnose(p.summary, p.result.telemetry, st, ctx)


def knees_of(res: SweepResult, *, max_gain: float = DEFAULT_MAX_GAIN,
             min_rise: float = DEFAULT_MIN_RISE) -> dict[str, Knee]:
    """The knee of each line of the sweep (see :func:`autotune.analysis.knee.find_knee`)."""
    x = res.spec.x_name
    out: dict[str, Knee] = {}
    if x in SCALING_PARAMS:
        return out  # a layout is not a load level: TP/PP/DP get the scaling analysis
    for key, pts in _series(res).items():
        if not _numeric_x(pts, x):
            continue
        knee = find_knee([p.x(x) for p in pts], [p.fig("output_throughput") for p in pts],
                         [p.fig("p99_e2e_s") for p in pts], x_label=x,
                         max_gain=max_gain, min_rise=min_rise)
        checks = [p.result.check for p in pts]
        if knee.x is None and checks and all(c is not None and not c.met for c in checks):
            # Upward is where the SLO is missed by more: the knee does not matter here.
            why = knee.why.replace("extend the sweep upward to find it",
                                   "every point misses the SLO: sweep lower values")
            knee = replace(knee, why=why)
        out[key] = knee
    return out


def scaling_of(res: SweepResult) -> Scaling | None:
    """Over a TP/PP/DP sweep: each layout's best tokens/s and best goodput."""
    if res.spec.param not in SCALING_PARAMS or len(res.spec.values) < 2:
        return None
    pts: list[ScalePoint] = []
    for value in res.spec.values:
        mine = [p for p in res.points if p.server_value == value and p.summary is not None
                and p.result.status == COMPLETE]
        if not mine:
            continue
        flags = res.spec.flags_for(value)
        top = max(mine, key=lambda p: p.fig("output_throughput"))
        good = [p.result.goodput("tokens") for p in mine]
        pts.append(ScalePoint(f"{_SHORT.get(res.spec.param, res.spec.param)}={value}",
                              _gpus_of(flags), top.fig("output_throughput"),
                              max(good) if good else None,
                              saturated=top.overloaded is not False))
    if len(pts) < 2:
        return None
    gpus = res.settings.get("gpus")
    return analyze_scaling(pts, budget_gpus=int(gpus) if gpus else None)
