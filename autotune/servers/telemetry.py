"""Telemetry during a load test: GPU figures from NVML, engine figures from /metrics.

``NvmlSampler`` samples per-GPU utilisation, memory used and power in a thread.  On
a machine without NVML it says "no GPU telemetry" once and returns empty results.
``MetricsScraper`` scrapes vLLM's Prometheus ``/metrics`` (running and waiting
requests, KV-cache usage, preemptions, token counters) into a timeline.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType, TracebackType
from typing import Any

import httpx

from autotune.core.errors import AutotuneError

log = logging.getLogger("autotune.servers.telemetry")


class TelemetryError(AutotuneError):
    """A telemetry source answered with something we cannot use."""


# ----------------------------------------------------------------------------- NVML

_NVML_WARNED = False


def _warn_no_nvml(why: str) -> None:
    global _NVML_WARNED
    if not _NVML_WARNED:
        _NVML_WARNED = True
        log.warning("no GPU telemetry (NVML not available: %s)", why)


def _nvml() -> tuple[ModuleType | None, str]:
    """The initialised pynvml module, or None and why not."""
    try:
        import pynvml  # optional: only where NVIDIA GPUs are
    except ImportError as e:
        return None, f"pynvml not importable ({e}); install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError and friends: no driver, no library
        return None, str(e) or type(e).__name__
    return pynvml, ""


def _indices(nv: ModuleType, gpus: Sequence[int] | None) -> list[int]:
    count = int(nv.nvmlDeviceGetCount())
    return [g for g in (range(count) if gpus is None else gpus) if 0 <= g < count]


def gpu_memory_used(gpus: Sequence[int] | None = None) -> dict[int, int] | None:
    """Bytes used per GPU now, or None where NVML is not available."""
    nv, why = _nvml()
    if nv is None:
        return None
    try:
        return {
            i: int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).used)
            for i in _indices(nv, gpus)
        }
    except Exception as e:
        log.debug("NVML memory query failed: %s", e)
        return None
    finally:
        _shutdown(nv)


def gpu_process_pids(gpus: Sequence[int] | None = None) -> set[int]:
    """Pids that hold memory on the GPUs (compute and graphics), empty without NVML."""
    nv, _ = _nvml()
    if nv is None:
        return set()
    pids: set[int] = set()
    try:
        for i in _indices(nv, gpus):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            for fn in ("nvmlDeviceGetComputeRunningProcesses",
                       "nvmlDeviceGetGraphicsRunningProcesses"):
                if hasattr(nv, fn):
                    pids.update(int(p.pid) for p in getattr(nv, fn)(h))
    except Exception as e:
        log.debug("NVML process query failed: %s", e)
    finally:
        _shutdown(nv)
    return pids


def _shutdown(nv: ModuleType) -> None:
    try:
        nv.nvmlShutdown()
    except Exception:  # shutting down a half-initialised NVML must not raise
        pass


@dataclass
class GpuSample:
    t_s: float  # time.perf_counter()
    gpu: int
    util_pct: float | None
    mem_used_bytes: int | None
    power_w: float | None


@dataclass
class GpuStats:
    gpu: int
    name: str
    samples: int
    util_mean_pct: float | None
    util_max_pct: float | None
    mem_used_mean_bytes: float | None
    mem_used_max_bytes: int | None
    mem_total_bytes: int | None
    power_mean_w: float | None
    power_max_w: float | None


@dataclass
class GpuSummary:
    """Per-GPU and all-GPU figures over the sampled window.  ``available`` False
    means there was no NVML: every figure is then None and ``note`` says why."""

    available: bool
    note: str
    interval_s: float
    duration_s: float
    per_gpu: list[GpuStats] = field(default_factory=list)
    util_mean_pct: float | None = None  # mean over GPUs and samples
    util_max_pct: float | None = None
    mem_used_max_bytes: int | None = None  # max over GPUs
    power_mean_w: float | None = None  # summed over GPUs, mean over time
    power_max_w: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize_gpu_samples(samples: Sequence[GpuSample], names: dict[int, str],
                          totals: dict[int, int], interval_s: float,
                          duration_s: float) -> GpuSummary:
    """Pure: samples -> per-GPU and overall mean/max."""
    per: list[GpuStats] = []
    for g in sorted(names):
        mine = [s for s in samples if s.gpu == g]
        util = [s.util_pct for s in mine if s.util_pct is not None]
        mem = [s.mem_used_bytes for s in mine if s.mem_used_bytes is not None]
        pw = [s.power_w for s in mine if s.power_w is not None]
        per.append(GpuStats(
            gpu=g, name=names[g], samples=len(mine),
            util_mean_pct=_mean(util), util_max_pct=max(util, default=None),
            mem_used_mean_bytes=_mean(mem), mem_used_max_bytes=max(mem, default=None),
            mem_total_bytes=totals.get(g), power_mean_w=_mean(pw),
            power_max_w=max(pw, default=None),
        ))
    all_util = [s.util_pct for s in samples if s.util_pct is not None]
    # Total power per sampling instant, so mean/max are of the whole node's draw.
    by_t: dict[float, float] = {}
    for s in samples:
        if s.power_w is not None:
            by_t[s.t_s] = by_t.get(s.t_s, 0.0) + s.power_w
    mems = [p.mem_used_max_bytes for p in per if p.mem_used_max_bytes is not None]
    return GpuSummary(
        available=True,
        note=f"NVML, {len(names)} GPU(s), every {interval_s:g}s over {duration_s:.1f}s",
        interval_s=interval_s, duration_s=duration_s, per_gpu=per,
        util_mean_pct=_mean(all_util), util_max_pct=max(all_util, default=None),
        mem_used_max_bytes=max(mems, default=None),
        power_mean_w=_mean(list(by_t.values())), power_max_w=max(by_t.values(), default=None),
    )


class NvmlSampler:
    """Samples the GPUs every ``interval_s`` seconds between ``start()`` and ``stop()``."""

    def __init__(self, interval_s: float = 0.5, gpus: Sequence[int] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.gpus = list(gpus) if gpus is not None else None
        self.samples: list[GpuSample] = []
        self.available = False
        self.note = ""
        self._names: dict[int, str] = {}
        self._totals: dict[int, int] = {}
        self._nv: ModuleType | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._t0 = 0.0
        self._t1 = 0.0

    def start(self) -> NvmlSampler:
        nv, why = _nvml()
        self._t0 = time.perf_counter()
        if nv is None:
            self.note = f"no GPU telemetry (NVML not available: {why})"
            _warn_no_nvml(why)
            return self
        try:
            idx = _indices(nv, self.gpus)
            handles = {i: nv.nvmlDeviceGetHandleByIndex(i) for i in idx}
            for i, h in handles.items():
                name = nv.nvmlDeviceGetName(h)
                self._names[i] = name.decode() if isinstance(name, bytes) else str(name)
                self._totals[i] = int(nv.nvmlDeviceGetMemoryInfo(h).total)
        except Exception as e:
            _shutdown(nv)
            self.note = f"no GPU telemetry (NVML not available: {e})"
            _warn_no_nvml(str(e))
            return self
        if not handles:
            _shutdown(nv)
            self.note = "no GPU telemetry (NVML not available: no GPU found)"
            _warn_no_nvml("no GPU found")
            return self
        self._nv, self.available = nv, True
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(handles,),
                                        name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self, handles: dict[int, Any]) -> None:
        nv = self._nv
        assert nv is not None
        t = time.perf_counter()
        for i, h in handles.items():
            util = mem = power = None
            try:
                util = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:  # a metric the device does not support stays None
                pass
            try:
                mem = int(nv.nvmlDeviceGetMemoryInfo(h).used)
            except Exception:
                pass
            try:
                power = float(nv.nvmlDeviceGetPowerUsage(h)) / 1000.0  # mW -> W
            except Exception:
                pass
            self.samples.append(GpuSample(t, i, util, mem, power))

    def _run(self, handles: dict[int, Any]) -> None:
        while True:
            self._sample(handles)
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> GpuSummary:
        self._t1 = time.perf_counter()
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)
            self._thread = None
        if self._nv is not None:
            _shutdown(self._nv)
            self._nv = None
        return self.summary()

    def summary(self) -> GpuSummary:
        duration = (self._t1 or time.perf_counter()) - self._t0
        if not self.available:
            return GpuSummary(False, self.note, self.interval_s, duration)
        return summarize_gpu_samples(self.samples, self._names, self._totals,
                                     self.interval_s, duration)

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# ----------------------------------------------------------------------------- /metrics

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>.*)\})?"
    r"\s+(?P<value>\S+)(?:\s+\S+)?\s*$"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class PromSample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus_samples(text: str) -> list[PromSample]:
    """Every sample line of a Prometheus text exposition (comments skipped)."""
    out: list[PromSample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))  # handles NaN, +Inf, -Inf, 1e3
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        out.append(PromSample(m.group("name"), labels, value))
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value, folded over label sets (e.g. several engines).

    Counters and gauges of counts are summed; ``*_perc`` gauges (fractions) are
    averaged; histogram ``_bucket`` samples are left out, since summing cumulative
    buckets over ``le`` means nothing (their ``_sum`` and ``_count`` stay).
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in parse_prometheus_samples(text):
        if s.name.endswith("_bucket") or math.isnan(s.value):
            continue
        sums[s.name] = sums.get(s.name, 0.0) + s.value
        counts[s.name] = counts.get(s.name, 0) + 1
    return {k: (v / counts[k] if k.endswith("_perc") else v) for k, v in sums.items()}


# What the scraper keeps, under our names, with vLLM's older names as fallbacks.
ENGINE_METRICS: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
}
COUNTERS = ("preemptions", "prompt_tokens", "generation_tokens")


def engine_figures(parsed: dict[str, float]) -> dict[str, float | None]:
    """Our names for the vLLM series in one parsed scrape (None where absent)."""
    out: dict[str, float | None] = {}
    for key, names in ENGINE_METRICS.items():
        out[key] = next((parsed[n] for n in names if n in parsed), None)
    return out


@dataclass
class MetricsPoint:
    t_s: float  # time.perf_counter() when the scrape returned
    values: dict[str, float | None]


@dataclass
class MetricsSummary:
    """Gauges as mean/max over the scrapes; counters as the increase over them."""

    scrapes: int
    failures: int
    duration_s: float
    interval_s: float
    mean: dict[str, float | None]
    max: dict[str, float | None]
    increase: dict[str, float | None]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_metrics(points: Sequence[MetricsPoint], *, failures: int = 0,
                      interval_s: float = 0.0) -> MetricsSummary:
    """Pure: a timeline of scrapes -> mean/max of gauges, increase of counters."""
    mean: dict[str, float | None] = {}
    mx: dict[str, float | None] = {}
    inc: dict[str, float | None] = {}
    for key in ENGINE_METRICS:
        xs = [p.values[key] for p in points if p.values.get(key) is not None]
        vals = [float(x) for x in xs if x is not None]
        if key in COUNTERS:
            inc[key] = vals[-1] - vals[0] if vals else None
        else:
            mean[key] = _mean(vals)
            mx[key] = max(vals, default=None)
    dur = points[-1].t_s - points[0].t_s if len(points) > 1 else 0.0
    note = f"{len(points)} scrapes of /metrics every {interval_s:g}s over {dur:.1f}s"
    if failures:
        note += f", {failures} failed"
    return MetricsSummary(len(points), failures, dur, interval_s, mean, mx, inc, note)


def scrape(url: str, client: httpx.Client | None = None,
           timeout_s: float = 5.0) -> dict[str, float]:
    """One scrape of ``{url}/metrics``, parsed.  Raises ``TelemetryError``."""
    target = url.rstrip("/") + "/metrics"
    try:
        if client is None:
            r = httpx.get(target, timeout=timeout_s, trust_env=False)
        else:
            r = client.get(target)
    except httpx.HTTPError as e:
        raise TelemetryError(f"cannot scrape {target}: {e}") from e
    if r.status_code != 200:
        raise TelemetryError(f"{target} answered {r.status_code}")
    return parse_prometheus(r.text)


class MetricsScraper:
    """Scrapes ``{url}/metrics`` every ``interval_s`` seconds in a thread."""

    def __init__(self, url: str, interval_s: float = 1.0, timeout_s: float = 5.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.url = url.rstrip("/")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.points: list[MetricsPoint] = []
        self.failures = 0
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> MetricsScraper:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="metrics-scraper",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            while True:
                try:
                    parsed = scrape(self.url, client)
                    self.points.append(MetricsPoint(time.perf_counter(),
                                                    engine_figures(parsed)))
                except TelemetryError as e:
                    self.failures += 1
                    if self.last_error is None:
                        log.warning("%s (further failures counted silently)", e)
                    self.last_error = str(e)
                if self._stop.wait(self.interval_s):
                    return

    def stop(self) -> MetricsSummary:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=self.timeout_s + 1.0)
            self._thread = None
        return self.summary()

    def summary(self) -> MetricsSummary:
        s = summarize_metrics(self.points, failures=self.failures, interval_s=self.interval_s)
        if self.failures and self.last_error:
            s.note += f" (last error: {self.last_error})"
        return s

    def timeline(self) -> list[dict[str, float | None]]:
        """Rows ``{"t_s": ..., "running": ..., ...}`` for reports and plots."""
        return [{"t_s": p.t_s, **p.values} for p in self.points]

    def __enter__(self) -> MetricsScraper:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def wait_idle(url: str, timeout_s: float = 60.0, interval_s: float = 0.2, *,
              alive: Callable[[], bool] | None = None) -> float:
    """Poll ``/metrics`` until no request is running or waiting; return seconds waited.

    Raises ``TimeoutError`` if still busy after ``timeout_s`` (a ``/metrics`` that is
    too slow to answer by then counts as busy: a loaded server answers late, it is not
    gone), and ``TelemetryError`` if the endpoint does not expose
    ``vllm:num_requests_running``/``_waiting``, cannot be read by then for another
    reason, or cannot be read once ``alive`` (the server's process) says False.
    """
    t0 = time.monotonic()
    last: dict[str, float | None] = {}
    per_read = min(5.0, max(timeout_s, 0.5))
    with httpx.Client(timeout=per_read, trust_env=False) as client:
        while True:
            try:
                last = engine_figures(scrape(url, client))
            except TelemetryError as exc:
                if alive is not None and not alive():
                    raise
                if time.monotonic() - t0 >= timeout_s:
                    if isinstance(exc.__cause__, httpx.TimeoutException):
                        raise TimeoutError(
                            f"server at {url} still busy after {timeout_s:g}s (its "
                            f"/metrics did not answer within {per_read:g}s)") from exc
                    raise
            else:
                if last["running"] is None or last["waiting"] is None:
                    raise TelemetryError(
                        f"{url}/metrics has no vllm:num_requests_running/_waiting: "
                        "cannot tell when the server is idle"
                    )
                if last["running"] == 0 and last["waiting"] == 0:
                    return time.monotonic() - t0
            if time.monotonic() - t0 >= timeout_s:
                raise TimeoutError(
                    f"server at {url} still busy after {timeout_s:g}s "
                    f"(running={last.get('running')}, waiting={last.get('waiting')})"
                )
            time.sleep(interval_s)


def gpu_summary_lines(summary: GpuSummary) -> Iterable[str]:
    """Human lines for the CLI and reports; each says how it was measured."""
    if not summary.available:
        yield summary.note
        return
    yield summary.note
    for g in summary.per_gpu:
        util = "n/a" if g.util_mean_pct is None else f"{g.util_mean_pct:.0f}%"
        umax = "n/a" if g.util_max_pct is None else f"{g.util_max_pct:.0f}%"
        mem = ("n/a" if g.mem_used_max_bytes is None
               else f"{g.mem_used_max_bytes / 2**30:.1f} GiB")
        pw = "n/a" if g.power_mean_w is None else f"{g.power_mean_w:.0f} W"
        yield f"GPU {g.gpu} ({g.name}): util mean {util} max {umax}, mem max {mem}, " \
              f"power mean {pw} (measured, {g.samples} samples)"
