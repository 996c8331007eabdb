"""HTTP load generator: open-loop (one arrival schedule) or closed-loop (virtual users),
streaming SSE, one record each.

Open loop: one dispatcher coroutine sleeps until each scheduled send time and releases
the request; warm-up requests come first on the same schedule, so the measured window
starts with the server in steady state.  Closed loop (``users``): each virtual user
sends its next request when its previous one ends, after a think time
(:class:`~autotune.workload.arrivals.ClosedLoop`); a request's ``scheduled_s`` is when
its user sent it.  Each request streams from the server's
OpenAI-compatible API with ``stream_options.include_usage`` (exact token counts) and
``max_tokens`` + ``ignore_eos`` (exactly the asked output length).  A request never
raises: whatever went wrong ends up in its record's ``error``, as ``"kind: detail"``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import httpx

from autotune.client.sse import StreamReader
from autotune.client.transport import BodySink, ConnectError, HttpClient, TransportError
from autotune.core.errors import AutotuneError
from autotune.core.records import RequestRecord, WindowCallback
from autotune.workload.arrivals import (
    PROCESSES,
    ClosedLoop,
    conversation_order,
    schedule,
)
from autotune.workload.sources import Request

# httpcore tries ``import sniffio`` on every request; when it is not installed, each
# failed import searches sys.path again (~0.2 ms a request).  A None entry makes that
# import fail at once, exactly as it would have failed anyway.
if importlib.util.find_spec("sniffio") is None:
    sys.modules.setdefault("sniffio", None)  # type: ignore[arg-type]

ENDPOINTS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
TRANSPORTS: tuple[str, ...] = ("native", "aiohttp", "httpx")
ProgressCallback = Callable[[int, int], None]  # (measured requests done, measured total)

# asyncio timers fire up to ~1 ms late (epoll rounds its timeout up to whole ms), so
# the dispatcher sleeps until this long before a send time and then yields in a loop.
DEFAULT_SPIN_S = 0.001


class LoadGenError(AutotuneError):
    """The load test cannot run as asked: the message says what and how to fix it."""


@dataclass
class LoadTestConfig:
    """How to offer load: where, at what rate, with which arrival process."""

    url: str  # base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str = "completions"  # "completions" | "chat"
    rate: float = math.inf  # offered req/s; inf sends everything at once
    # "poisson" | "gamma" | "constant" | "trace" (the requests' arrival_s, ``rate`` times
    # faster: warm-up ones included, so give warm-up requests from the trace)
    process: str = "poisson"
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    max_concurrency: int | None = None  # client-side cap; None = unbounded
    warmup: int = 100  # warm-up requests before the measured ones
    request_timeout_s: float = 600.0  # whole request, from send to last byte
    api_key: str | None = None
    seed: int = 0
    window_s: float = 1.0  # period of the on_window callback
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    spin_s: float = DEFAULT_SPIN_S
    # "native": autotune.client.transport (the fastest, chosen by benchmarks/tool_comparison.py);
    # "aiohttp": httpx's API on aiohttp (httpx-aiohttp); "httpx": httpx's own transport,
    # for what the native client leaves out on purpose (proxies, HTTP/2).
    transport: str = "native"
    # Closed loop: this many virtual users, each sending when its previous request ended
    # and its think time passed (``rate``, ``process`` and ``burstiness`` then unused).
    users: int | None = None
    think_s: float = 0.0  # mean think time between a user's requests
    think: str = "exponential"  # "exponential" | "fixed"

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        if self.users is not None:
            if self.users < 1:
                raise LoadGenError(f"a closed loop needs at least 1 user, got {self.users}")
            if self.max_concurrency is not None:
                raise LoadGenError("a closed loop keeps one request in flight per user: "
                                   "leave max_concurrency unset")
        try:
            ClosedLoop(think_s=self.think_s, think=self.think)
        except ValueError as exc:
            raise LoadGenError(str(exc)) from None
        if self.endpoint not in ENDPOINTS:
            raise LoadGenError(
                f"unknown endpoint {self.endpoint!r}; use one of {', '.join(ENDPOINTS)}")
        if not self.rate > 0:  # also rejects NaN
            raise LoadGenError(f"request rate must be > 0 req/s (or inf), got {self.rate}")
        if self.process not in PROCESSES:
            raise LoadGenError(
                f"unknown arrival process {self.process!r}; use one of {', '.join(PROCESSES)}")
        if not self.burstiness > 0:
            raise LoadGenError(f"burstiness must be > 0 (1 = Poisson), got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LoadGenError(
                f"max concurrency must be >= 1 (or unset), got {self.max_concurrency}")
        if self.warmup < 0:
            raise LoadGenError(f"warm-up must be >= 0 requests, got {self.warmup}")
        if not self.request_timeout_s > 0:
            raise LoadGenError(f"request timeout must be > 0 s, got {self.request_timeout_s}")
        if not self.window_s > 0:
            raise LoadGenError(f"window must be > 0 s, got {self.window_s}")
        if self.transport not in TRANSPORTS:
            raise LoadGenError(f"unknown transport {self.transport!r}; use one of "
                               f"{', '.join(TRANSPORTS)}")
        if self.spin_s < 0:
            raise LoadGenError(f"spin_s must be >= 0, got {self.spin_s}")

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "api_key" and value is not None:
                value = "***"
            parts.append(f"{f.name}={value!r}")
        return f"LoadTestConfig({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        """For result files: the API key is never written, only whether one was set."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["api_key"] = "***" if self.api_key else None
        data["rate"] = None if math.isinf(self.rate) else self.rate
        data["extra_body"] = dict(self.extra_body)
        return data


@dataclass
class LoadTestResult:
    """Every record (warm-up ones flagged) and how the run went."""

    # Not in repr: asyncio formats the finished task's result once, and thousands of
    # records made that a visible share of a load test's CPU.
    records: list[RequestRecord] = field(repr=False)
    offered_rate: float = math.inf
    aborted: bool = False
    abort_reason: str | None = None
    num_warmup: int = 0
    num_planned: int = 0  # measured requests on the schedule (some unsent if aborted)
    start_s: float = 0.0  # perf_counter of schedule offset 0
    duration_s: float = 0.0  # wall time from the first send to the return
    model: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.warmup]


def normalize_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all mean the same server."""
    text = url.strip()
    if not text.startswith(("http://", "https://")):
        raise LoadGenError(f"server URL must start with http:// or https://, got {url!r}")
    text = text.rstrip("/")
    if text.endswith("/v1"):
        text = text[:-3]
    return text


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _models_from(url: str, status: int, body: bytes) -> list[str]:
    return [str(m["id"]) for m in _cards_from(url, status, body)]


def _cards_from(url: str, status: int, body: bytes) -> list[dict[str, Any]]:
    """The model cards of a GET /v1/models answer, each with its ``id``."""
    if status in (401, 403):
        raise LoadGenError(
            f"server at {url} refused the API key (HTTP {status}); "
            "pass --api-key or set OPENAI_API_KEY")
    if status != 200:
        raise LoadGenError(
            f"server at {url} answered HTTP {status} to GET /v1/models; "
            "is it an OpenAI-compatible server?")
    try:
        cards = list(json.loads(body)["data"])
        for m in cards:
            str(m["id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise LoadGenError(
            f"server at {url} is not OpenAI-compatible: GET /v1/models gave no model list "
            f"({type(exc).__name__})") from None
    return cards


def _timed_out(exc: BaseException) -> bool:
    """A real timeout.  httpx-aiohttp raises ConnectTimeout for refused and dropped
    connections too, so the aiohttp error underneath decides."""
    if not isinstance(exc, httpx.TimeoutException):
        return False
    cause = exc.__cause__
    return cause is None or isinstance(cause, TimeoutError) or "Timeout" in type(cause).__name__


def _unreachable(url: str, exc: Exception) -> LoadGenError:
    text = str(exc) or type(exc).__name__
    if _timed_out(exc):
        return LoadGenError(f"server at {url} did not answer GET /v1/models in time ({text})")
    reason = "connection refused" if "refused" in text.lower() else text
    return LoadGenError(f"no server at {url}: {reason}; is it running?")


SIMULATOR_OWNER = "autotune-simulator"  # ``owned_by`` in autotune.sim.serve's /v1/models


@dataclass(frozen=True)
class Served:
    """What GET /v1/models says: the model ids, and whether the server is autotune's
    simulator (whose timings are simulated even though they come over HTTP)."""

    url: str
    models: list[str]
    simulated: bool
    max_model_len: int | None = None  # vLLM reports its context length per model

    @property
    def first_model(self) -> str:
        """The model to ask for when the user named none."""
        if not self.models:
            raise LoadGenError(f"server at {self.url} serves no model (GET /v1/models is "
                               "empty)")
        return self.models[0]


def check_server(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> Served:
    """What the server serves (GET /v1/models); LoadGenError if unusable."""
    base = normalize_url(url)
    try:
        response = httpx.get(f"{base}/v1/models", headers=_auth(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _unreachable(base, exc) from None
    cards = _cards_from(base, response.status_code, response.content)
    lengths = [m["max_model_len"] for m in cards
               if isinstance(m.get("max_model_len"), int) and m["max_model_len"] > 0]
    return Served(url=url, models=[str(m["id"]) for m in cards],
                  simulated=SIMULATOR_OWNER in {str(m.get("owned_by")) for m in cards},
                  max_model_len=lengths[0] if lengths else None)


def fetch_model(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model the server serves, for when the user named none."""
    return check_server(url, api_key, timeout_s).first_model


def _payload(config: LoadTestConfig, model: str, request: Request) -> bytes:
    body: dict[str, Any] = {"model": model}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    body.update(max_tokens=request.output_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return json.dumps(body).encode()


def _describe(exc: BaseException) -> str:
    """``kind: detail`` for a failed request (metrics group failures by kind)."""
    text = str(exc) or type(exc).__name__
    if _timed_out(exc):
        return f"timeout: {type(exc).__name__}: {text}"
    if isinstance(exc, ConnectError):
        return f"connection: connect failed: {text}"
    if isinstance(exc, TransportError):
        return f"connection: {text}"
    if isinstance(exc, httpx.TimeoutException):  # a connection error under aiohttp
        cause = exc.__cause__
        detail = str(cause) or type(cause).__name__
        if "refused" in detail.lower() or "connect call failed" in detail.lower():
            return f"connection: connect failed: {detail}"
        return f"connection: {type(cause).__name__}: {detail}"
    if isinstance(exc, httpx.ConnectError):
        return f"connection: connect failed: {text}"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"connection: {text}"
    if isinstance(exc, httpx.TransportError):
        return f"connection: {type(exc).__name__}: {text}"
    if isinstance(exc, httpx.HTTPError):
        return f"http: {type(exc).__name__}: {text}"
    if isinstance(exc, ValueError):
        return f"bad response: {text}"
    return f"client error: {type(exc).__name__}: {text}"


@dataclass
class _Turns:
    """The closed loop's shared queue of conversations (a request on its own is a
    conversation of one turn), in the order of their first turns in the plan.  A user
    takes the next conversation not yet started and sends its turns in order; after
    request ``i`` ends, its user thinks ``think[i]`` before its next send."""

    payloads: list[Any]
    expected: list[int]
    think: list[float]
    n_warm: int
    conversations: list[list[int]]
    next: int = 0

    @classmethod
    def of(cls, plan: Sequence[Request], payloads: list[Any], think: list[float],
           n_warm: int) -> _Turns:
        return cls(payloads, [r.output_tokens for r in plan], think, n_warm,
                   conversation_order(plan))

    def take(self) -> list[int] | None:
        """The next conversation's requests, in turn order (None: none is left)."""
        if self.next >= len(self.conversations):
            return None
        self.next += 1
        return self.conversations[self.next - 1]


class _Run:
    """State of one load test on one event loop."""

    def __init__(self, config: LoadTestConfig, model: str, client: _Client,
                 on_window: WindowCallback | None, on_progress: ProgressCallback | None,
                 num_measured: int) -> None:
        self.config = config
        self.client = client
        self.gate = (asyncio.Semaphore(config.max_concurrency)
                     if config.max_concurrency else None)
        self.on_window = on_window
        self.on_progress = on_progress
        self.num_measured = num_measured
        self.model = model
        self.records: list[RequestRecord] = []
        self.measured: list[RequestRecord] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.pending = 0
        self.dispatch_done = False
        self.measured_done = 0
        self.finished = asyncio.Event()
        self.aborting = False
        self.abort_reason: str | None = None
        self.callback_error: BaseException | None = None

    async def dispatch(self, start: float, offsets: Sequence[float], payloads: list[Any],
                       expected: list[int], n_warm: int) -> None:
        loop = asyncio.get_running_loop()
        clock = time.perf_counter
        spin = self.config.spin_s
        for i, offset in enumerate(offsets):
            target = start + offset
            wait = target - clock() - spin
            if wait > 0:
                await asyncio.sleep(wait)
            while clock() < target:
                await asyncio.sleep(0)
            if self.stopping:
                break  # the watcher stopped the test while this request waited its turn
            warm = i < n_warm
            record = RequestRecord(
                index=i - n_warm, scheduled_s=target, dispatched_s=clock(),
                expected_output_tokens=expected[i], warmup=warm)
            self.records.append(record)
            if not warm:
                self.measured.append(record)
            self.pending += 1
            task = loop.create_task(self.send(record, payloads[i]))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        self.dispatch_done = True
        if self.pending == 0:
            self.finished.set()

    async def user(self, start: float, turns: _Turns) -> None:
        """One virtual user: send, wait for the end, think, send the next."""
        loop = asyncio.get_running_loop()
        wait = start - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        queue: list[int] = []
        while not self.stopping:
            if not queue:
                queue = list(turns.take() or ())
                if not queue:
                    return
            i = queue.pop(0)
            now = time.perf_counter()
            warm = i < turns.n_warm
            record = RequestRecord(
                index=i - turns.n_warm, scheduled_s=now, dispatched_s=now,
                expected_output_tokens=turns.expected[i], warmup=warm)
            self.records.append(record)
            if not warm:
                self.measured.append(record)
            self.pending += 1
            task = loop.create_task(self.send(record, turns.payloads[i]))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            await asyncio.wait({task})  # not the task itself: a stop cancels it, not us
            if turns.think[i] > 0:
                await asyncio.sleep(turns.think[i])

    async def users(self, starts: Sequence[float], turns: _Turns) -> None:
        await asyncio.gather(*(self.user(t, turns) for t in starts))
        self.dispatch_done = True
        if self.pending == 0:
            self.finished.set()

    @property
    def stopping(self) -> bool:
        return self.abort_reason is not None or self.callback_error is not None

    async def send(self, record: RequestRecord, payload: Any) -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None
        timed_out = False

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            if task is not None:
                task.cancel()

        acquired = False
        try:
            if self.gate is not None:
                await self.gate.acquire()
                acquired = True
            timer = loop.call_later(self.config.request_timeout_s, expire)
            record.sent_s = time.perf_counter()
            await self.stream(record, payload)
        except asyncio.CancelledError:
            if timed_out:
                record.error = (f"timeout: no complete response within "
                                f"{self.config.request_timeout_s:g} s")
                if task is not None and hasattr(task, "uncancel"):
                    task.uncancel()
            elif self.aborting:
                record.error = f"aborted: {self.abort_reason or 'stopped'}"
            else:
                record.error = "aborted: cancelled"
                raise
        except Exception as exc:  # a request never raises out of the load test
            record.error = _describe(exc)
        finally:
            if timer is not None:
                timer.cancel()
            if acquired and self.gate is not None:
                self.gate.release()
            if record.end_s is None:
                record.end_s = time.perf_counter()
            self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        self.pending -= 1
        if not record.warmup:
            self.measured_done += 1
            if self.on_progress is not None:
                self.on_progress(self.measured_done, self.num_measured)
        if self.dispatch_done and self.pending == 0:
            self.finished.set()

    def close_unstarted(self) -> None:
        # A task cancelled before its first step never runs its own ``finally``.
        now = time.perf_counter()
        for record in self.records:
            if record.end_s is None:
                record.error = record.error or f"aborted: {self.abort_reason or 'stopped'}"
                record.end_s = now

    async def stream(self, record: RequestRecord, payload: Any) -> None:
        reader = StreamReader(record)
        status, body = await self.client.post_stream(payload, reader.feed)
        record.status = status
        if status != 200:
            record.end_s = time.perf_counter()
            text = body[:300].decode("utf-8", "replace")
            record.error = f"http {status}: {' '.join(text.split())}"
            return
        reader.finish(ignore_eos=self.config.ignore_eos)

    async def watch(self) -> None:
        assert self.on_window is not None
        while True:
            await asyncio.sleep(self.config.window_s)
            if not self.measured:
                continue  # windows count from the first measured request
            try:
                stop = self.on_window(time.perf_counter(), list(self.measured))
            except Exception as exc:
                self.callback_error = exc
                self.finished.set()
                return
            if stop:
                self.abort_reason = "pruned"
                self.finished.set()
                return


def _raise_fd_limit(wanted: int) -> None:
    # One connection per in-flight request: an open-loop overload needs many sockets.
    try:
        import resource  # POSIX only: elsewhere the limit stays as it is

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


class _Client(Protocol):
    """What a load test needs of an HTTP client, whichever library carries the bytes."""

    def prepare(self, payload: bytes) -> Any:
        """A request body, made ready to send (as often as needed)."""

    async def get(self, path: str) -> tuple[int, bytes]: ...

    async def post_stream(self, prepared: Any, sink: BodySink) -> tuple[int, bytes]:
        """POST; a 200 body goes to ``sink`` as it arrives; else (status, body)."""

    async def aclose(self) -> None: ...


class _NativeClient:
    def __init__(self, config: LoadTestConfig) -> None:
        self.http = HttpClient(config.url, headers=_auth(config.api_key),
                               connect_timeout_s=min(config.request_timeout_s, 30.0))
        self.path = ENDPOINTS[config.endpoint]

    def prepare(self, payload: bytes) -> bytes:
        return self.http.build("POST", self.path, payload)

    async def get(self, path: str) -> tuple[int, bytes]:
        reply = await self.http.request("GET", path)
        return reply.status, reply.body

    async def post_stream(self, prepared: bytes, sink: BodySink) -> tuple[int, bytes]:
        reply = await self.http.send(prepared, sink)
        return reply.status, reply.body

    async def aclose(self) -> None:
        await self.http.aclose()


class _HttpxClient:
    """httpx's API on its own transport or on aiohttp's (httpx-aiohttp)."""

    def __init__(self, config: LoadTestConfig, total: int) -> None:
        # The pool must never be a hidden concurrency cap: as many connections as
        # requests can be in flight, all kept alive.
        cap = config.max_concurrency
        limits = httpx.Limits(max_connections=cap or max(total, 1000),
                              max_keepalive_connections=cap or total, keepalive_expiry=60.0)
        kwargs: dict[str, Any] = dict(base_url=config.url, limits=limits,
                                      headers=_auth(config.api_key),
                                      timeout=httpx.Timeout(config.request_timeout_s))
        if config.transport == "aiohttp" and importlib.util.find_spec("httpx_aiohttp"):
            from httpx_aiohttp import HttpxAiohttpClient  # optional: --transport aiohttp

            self.client: httpx.AsyncClient = HttpxAiohttpClient(**kwargs)
        else:
            self.client = httpx.AsyncClient(**kwargs)
        self.path = ENDPOINTS[config.endpoint]
        self.headers = {"content-type": "application/json"}

    def prepare(self, payload: bytes) -> bytes:
        return payload

    async def get(self, path: str) -> tuple[int, bytes]:
        response = await self.client.get(path)
        return response.status_code, response.content

    async def post_stream(self, prepared: bytes, sink: BodySink) -> tuple[int, bytes]:
        clock = time.perf_counter
        async with self.client.stream("POST", self.path, content=prepared,
                                      headers=self.headers) as response:
            if response.status_code != 200:
                return response.status_code, await response.aread()
            async for data in response.aiter_bytes():
                sink(clock(), data)
        return 200, b""

    async def aclose(self) -> None:
        await self.client.aclose()


def _client(config: LoadTestConfig, total: int) -> _Client:
    if config.transport == "native":
        return _NativeClient(config)
    return _HttpxClient(config, total)


async def run_load_test(
    config: LoadTestConfig,
    requests: Sequence[Request],
    *,
    warmup_requests: Sequence[Request] = (),
    on_window: WindowCallback | None = None,
    on_progress: ProgressCallback | None = None,
) -> LoadTestResult:
    """Offer ``config.warmup`` warm-up requests then ``requests`` on one schedule.

    Warm-up requests are drawn in turn from ``warmup_requests`` (or from ``requests``
    when none are given).  ``on_window`` is called every ``config.window_s`` with the
    measured records so far; True stops the test (in-flight requests are cancelled and
    recorded as ``aborted: pruned``).
    """
    if not requests:
        raise LoadGenError("no requests to send: the workload is empty")
    pool = list(warmup_requests) or list(requests)
    warm = [pool[i % len(pool)] for i in range(config.warmup)]
    plan = warm + list(requests)
    try:
        offsets = schedule(plan, config.rate, process=config.process,
                           burstiness=config.burstiness, seed=config.seed).tolist()
    except ValueError as exc:
        raise LoadGenError(str(exc)) from None
    _raise_fd_limit(min(len(plan), 1 << 16) + 256)
    client = _client(config, len(plan))
    try:
        model = config.model or await _served_model(client, config.url)
        # A test sized by time cycles its pool: each distinct request is encoded once.
        prepared: dict[int, Any] = {}
        payloads = [prepared[id(r)] if id(r) in prepared else
                    prepared.setdefault(id(r), client.prepare(_payload(config, model, r)))
                    for r in plan]
        run = _Run(config, model, client, on_window, on_progress, len(requests))
        start = time.perf_counter() + 0.002  # let the dispatcher task get going
        dispatcher = asyncio.create_task(_load(run, config, plan, offsets, payloads,
                                               len(warm), start))
        watcher = asyncio.create_task(run.watch()) if on_window is not None else None
        try:
            await run.finished.wait()
            if run.abort_reason is not None or run.callback_error is not None:
                run.aborting = True
                if run.abort_reason is None:
                    run.abort_reason = "on_window raised"
                dispatcher.cancel()
                for task in list(run.tasks):
                    task.cancel()
                await asyncio.gather(dispatcher, *run.tasks, return_exceptions=True)
                run.close_unstarted()
        finally:
            for own in (dispatcher, watcher):
                if own is not None and not own.done():
                    own.cancel()
            await asyncio.gather(*(t for t in (dispatcher, watcher) if t is not None),
                                 return_exceptions=True)
            for task in list(run.tasks):
                task.cancel()
            if run.tasks:
                await asyncio.gather(*run.tasks, return_exceptions=True)
        if run.callback_error is not None:
            raise run.callback_error
    finally:
        await client.aclose()
    return LoadTestResult(
        records=run.records, offered_rate=config.rate,
        aborted=run.abort_reason is not None, abort_reason=run.abort_reason,
        num_warmup=len(warm), num_planned=len(requests), start_s=start,
        duration_s=time.perf_counter() - start, model=model, config=config.to_dict())


async def _served_model(client: _Client, url: str) -> str:
    """The first model of ``GET /v1/models``."""
    try:
        status, body = await client.get("/v1/models")
    except (httpx.HTTPError, TransportError) as exc:
        raise _unreachable(url, exc) from None
    models = _models_from(url, status, body)
    if not models:
        raise LoadGenError(f"server at {url} serves no model")
    return models[0]


def _load(run: _Run, config: LoadTestConfig, plan: Sequence[Request], offsets: list[float],
          payloads: list[Any], n_warm: int, start: float) -> Coroutine[Any, Any, None]:
    """What sends the requests: the open loop's dispatcher, or the closed loop's users."""
    if config.users is None:
        return run.dispatch(start, offsets, payloads, [r.output_tokens for r in plan], n_warm)
    closed = ClosedLoop(think_s=config.think_s, think=config.think)
    turns = _Turns.of(plan, payloads, closed.think_times(len(plan), config.seed).tolist(),
                      n_warm)
    return run.users((start + closed.starts(config.users, config.seed)).tolist(), turns)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


async def _stoppable(coro: Coroutine[Any, Any, LoadTestResult]) -> LoadTestResult:
    """Run ``coro`` so that a stop signal ends it.  Python runs a signal's handler
    between two bytecodes of the main thread, which is mostly inside the loop's
    callbacks; uvloop logs an exception raised there ("Fatal error on transport") and
    goes on, so SIGTERM in a load test was lost and the command ran to its end.  The
    loop takes the signals instead: the test is cancelled (its streams close), the
    handlers that were there come back, and the signal is raised again for them."""
    if threading.current_thread() is not threading.main_thread():
        return await coro
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    taken = [sig for sig, handler in previous.items() if callable(handler)]
    got: list[int] = []

    def stop(signum: int) -> None:
        got.append(signum)
        task.cancel()

    for sig in taken:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await task
    finally:
        for sig in taken:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig])
        if got:
            signal.raise_signal(got[0])


def run_load_test_sync(
    config: LoadTestConfig,
    requests: Sequence[Request],
    *,
    warmup_requests: Sequence[Request] = (),
    on_window: WindowCallback | None = None,
    on_progress: ProgressCallback | None = None,
) -> LoadTestResult:
    """``run_load_test`` on a fresh event loop (uvloop when it is installed)."""
    coro = _stoppable(run_load_test(config, requests, warmup_requests=warmup_requests,
                                    on_window=on_window, on_progress=on_progress))
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)  # type: ignore[no-any-return]
