"""A small, real OpenAI-compatible streaming server for the load generator's tests.

Raw asyncio HTTP/1.1 (keep-alive, chunked SSE) so that it answers "instantly" when
asked to: the capacity benchmark needs a server that is never the bottleneck.  It
streams like vLLM (``/v1/completions``, ``/v1/chat/completions``, usage chunk with
``stream_options.include_usage``, ``data: [DONE]``), has per-token and first-token
delays, a concurrency limit with a real waiting queue, a startup delay, and fault
switches.  ``GET /stats`` is the ground truth tests compare the client against.

In-process::

    with FakeServer(token_delay_s=0.002, max_concurrency=4) as server:
        ... server.url ... server.stats()

As a process (unknown vLLM flags are accepted and ignored)::

    python -m autotune.testing.fake_server --port 8000 --token-delay-ms 5 --model M
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.core.errors import AutotuneError
from autotune.servers.process import spawn, stop_group

FAULTS: tuple[str, ...] = ("500", "drop", "cut", "reset", "slow", "short")
# 500: HTTP 500 at once.  drop: close the connection without any response.
# cut: stream half the tokens, then end the body cleanly with no usage and no [DONE].
# reset: stream half the tokens, then abort the TCP connection.
# slow: first token after ``slow_first_token_s`` instead of ``first_token_delay_s``.
# short: a complete, well-formed stream with half the tokens asked for (as if EOS).
# Two more switches act on the whole server, not one request in N:
# hang_after=N: after N generation requests the server freezes (a wedged engine): the
#   streams in flight stop mid-reply and later requests are read but never answered.
# mute: connections are accepted, and nothing is ever read from them or answered.

MAX_MODEL_LEN = 32768
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


class FakeServerError(AutotuneError, ValueError):
    """A fake-server knob was out of range."""


@dataclass
class FakeServerConfig:
    """Knobs of the fake server.  Delays in seconds."""

    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    max_concurrency: int | None = None  # requests beyond it wait in a FIFO queue
    startup_delay_s: float = 0.0
    fault: str | None = None  # one of FAULTS
    fail_every: int = 0  # every Nth generation request (1-based) gets the fault
    fail_fraction: float = 0.0  # or this fraction of them, drawn with ``seed``
    slow_first_token_s: float = 1.0
    eos_after: int | None = None  # without ignore_eos, stop after this many tokens
    hang_after: int | None = None  # freeze after this many generation requests
    mute: bool = False  # accept connections, never answer
    model: str = "fake-model"
    # asyncio timers fire up to ~1 ms late; the server sleeps until this long before
    # each token is due, then yields in a loop, so injected delays are exact (0 = off).
    timer_spin_s: float = 0.001
    api_key: str | None = field(default=None, repr=False)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.token_delay_s < 0 or self.first_token_delay_s < 0:
            raise FakeServerError("delays must be >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise FakeServerError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.fault is not None and self.fault not in FAULTS:
            raise FakeServerError(f"unknown fault {self.fault!r}; use one of {', '.join(FAULTS)}")
        if self.hang_after is not None and self.hang_after < 0:
            raise FakeServerError(f"hang_after must be >= 0, got {self.hang_after}")
        if self.fail_every < 0 or not 0.0 <= self.fail_fraction <= 1.0:
            raise FakeServerError("fail_every must be >= 0 and fail_fraction in [0, 1]")
        if self.fault is not None and not self.fail_every and not self.fail_fraction:
            self.fail_every = 1  # a fault with no rate applies to every request


@dataclass
class ServerStats:
    """What the server really did (``perf_counter`` times: one clock per machine)."""

    requests_started: int = 0  # generation requests received
    requests_completed: int = 0  # full response sent (stream ended with [DONE])
    requests_failed: int = 0  # a 500/drop/cut/reset fault was injected
    requests_cancelled: int = 0  # the client went away first
    tokens_sent: int = 0  # content chunks written
    prompt_tokens: int = 0
    running: int = 0
    waiting: int = 0
    max_running: int = 0
    max_waiting: int = 0
    first_start_s: float | None = None
    last_end_s: float | None = None
    faults: dict[str, int] = field(default_factory=dict)


def count_tokens(text: str) -> int:
    """The fake tokenizer: whitespace-separated words."""
    return len(text.split())


def _prompt_text(kind: str, req: dict[str, Any]) -> str:
    if kind == "chat":
        parts = []
        for message in req.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return " ".join(parts)
    prompt = req.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return " ".join("t" for _ in prompt)  # token ids: one word each
        return " ".join(str(p) for p in prompt)
    return str(prompt)


def _response(status: int, body: bytes, content_type: str = "application/json",
              keep_alive: bool = True) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
            f"connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    return head.encode("latin-1") + body


def _json(status: int, obj: Any, keep_alive: bool = True) -> bytes:
    return _response(status, json.dumps(obj).encode(), keep_alive=keep_alive)


def _error(status: int, message: str, keep_alive: bool = True) -> bytes:
    return _json(status, {"object": "error", "message": message, "code": status}, keep_alive)


def _frame(payload: bytes) -> bytes:
    """One SSE event as one HTTP chunk."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
_END = b"0\r\n\r\n"


class _App:
    """Request handling; lives on one event loop."""

    def __init__(self, config: FakeServerConfig, ready_at: float) -> None:
        self.config = config
        self.ready_at = ready_at  # loop.time() when /health turns 200
        self.stats = ServerStats()
        self._sem = (asyncio.Semaphore(config.max_concurrency)
                     if config.max_concurrency else None)
        self._rng = random.Random(config.seed)
        self._writers: set[asyncio.StreamWriter] = set()
        self._created = int(time.time())
        self.frozen = False  # hang_after reached: nothing is answered any more

    async def _hang(self) -> None:
        """Never return: a wedged engine.  The handler's task ends when the server stops
        (asyncio.run cancels it) or the client goes away (the caller checks)."""
        await asyncio.Event().wait()

    def reset_stats(self) -> None:
        running, waiting = self.stats.running, self.stats.waiting
        self.stats = ServerStats(running=running, waiting=waiting)

    def close_connections(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()

    # -- HTTP/1.1 -----------------------------------------------------------------

    async def serve_connection(self, reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if self.config.mute:
                # Accepted by the kernel, then silence; return when the client gives up.
                await reader.read(-1)
                return
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except asyncio.LimitOverrunError:
                    writer.write(_error(400, "request head too large", keep_alive=False))
                    return
                lines = head.decode("latin-1").split("\r\n")
                try:
                    method, target, version = lines[0].split(" ", 2)
                except ValueError:
                    writer.write(_error(400, "bad request line", keep_alive=False))
                    return
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length") or 0)
                body = await reader.readexactly(length) if length else b""
                keep = (version == "HTTP/1.1"
                        and headers.get("connection", "").lower() != "close")
                keep = await self.route(method, target.split("?", 1)[0], headers, body,
                                        writer, keep)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    async def route(self, method: str, path: str, headers: dict[str, str], body: bytes,
                    writer: asyncio.StreamWriter, keep: bool) -> bool:
        loop = asyncio.get_running_loop()
        ready = loop.time() >= self.ready_at
        if path == "/health":
            writer.write(_response(200 if ready else 503, b"", keep_alive=keep))
            return keep
        if not ready:
            writer.write(_error(503, "server is starting", keep))
            return keep
        if path == "/stats":
            if method == "POST":
                self.reset_stats()
            writer.write(_json(200, asdict(self.stats), keep))
            return keep
        if path == "/metrics":
            writer.write(_response(200, self.metrics_text().encode(),
                                   "text/plain; version=0.0.4", keep))
            return keep
        if path == "/version":
            writer.write(_json(200, {"version": "autotune-fake"}, keep))
            return keep
        if self.config.api_key is not None and path.startswith("/v1/"):
            if headers.get("authorization") != f"Bearer {self.config.api_key}":
                writer.write(_error(401, "invalid API key", keep))
                return keep
        if path == "/v1/models":
            writer.write(_json(200, self.models(), keep))
            return keep
        if path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            if method != "POST":
                writer.write(_error(405, f"{path} takes POST", keep))
                return keep
            try:
                req = json.loads(body or b"{}")
                if not isinstance(req, dict):
                    raise ValueError("body is not a JSON object")
            except ValueError as exc:
                writer.write(_error(400, f"invalid JSON body: {exc}", keep))
                return keep
            if path == "/tokenize":
                writer.write(_json(200, self.tokenize(req), keep))
                return keep
            kind = "chat" if path == "/v1/chat/completions" else "completions"
            return await self.generate(kind, req, writer, keep)
        writer.write(_error(404, f"no route {path}", keep))
        return keep

    # -- endpoints ----------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        model = self.config.model
        return {"object": "list", "data": [{
            "id": model, "object": "model", "created": self._created,
            "owned_by": "autotune-fake", "root": model, "max_model_len": MAX_MODEL_LEN}]}

    def tokenize(self, req: dict[str, Any]) -> dict[str, Any]:
        text = _prompt_text("chat" if "messages" in req else "completions", req)
        words = text.split()
        return {"count": len(words), "max_model_len": MAX_MODEL_LEN,
                "tokens": [zlib.crc32(w.encode()) % 32000 for w in words]}

    def metrics_text(self) -> str:
        s, label = self.stats, f'{{model_name="{self.config.model}"}}'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {float(s.running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} {float(s.waiting)}\n"
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total{label} {float(s.tokens_sent)}\n"
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
            "# TYPE vllm:prompt_tokens_total counter\n"
            f"vllm:prompt_tokens_total{label} {float(s.prompt_tokens)}\n"
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            f"vllm:request_success_total{label} {float(s.requests_completed)}\n"
        )

    def _fault_for(self, number: int) -> str | None:
        c = self.config
        if c.fault is None:
            return None
        if c.fail_every and number % c.fail_every == 0:
            return c.fault
        if c.fail_fraction and self._rng.random() < c.fail_fraction:
            return c.fault
        return None

    async def generate(self, kind: str, req: dict[str, Any], writer: asyncio.StreamWriter,
                       keep: bool) -> bool:
        c, s = self.config, self.stats
        s.requests_started += 1
        if s.first_start_s is None:
            s.first_start_s = time.perf_counter()
        if c.hang_after is not None and s.requests_started > c.hang_after:
            self.frozen = True
        if self.frozen:
            await self._hang()
        fault = self._fault_for(s.requests_started)
        if fault is not None:
            s.faults[fault] = s.faults.get(fault, 0) + 1
        if fault == "500":
            s.requests_failed += 1
            writer.write(_error(500, "injected fault: internal server error", keep))
            return keep
        if fault == "drop":
            s.requests_failed += 1
            writer.transport.abort()
            return False

        max_tokens = req.get("max_completion_tokens") or req.get("max_tokens") or 16
        n_out = max(int(max_tokens), 1)
        finish = "length"
        if not req.get("ignore_eos", False) and c.eos_after is not None and c.eos_after < n_out:
            n_out, finish = max(c.eos_after, 1), "stop"
        if fault == "short":
            n_out, finish = max(n_out // 2, 1), "stop"
        n_sent = n_out if fault not in ("cut", "reset") else max(n_out // 2, 1)
        n_prompt = count_tokens(_prompt_text(kind, req))
        s.prompt_tokens += n_prompt
        stream = bool(req.get("stream", False))
        include_usage = bool((req.get("stream_options") or {}).get("include_usage", False))
        first_delay = c.slow_first_token_s if fault == "slow" else c.first_token_delay_s

        if stream:
            writer.write(_STREAM_HEAD)  # vLLM sends headers before the first token
        s.waiting += 1
        s.max_waiting = max(s.max_waiting, s.waiting)
        try:
            if self._sem is not None:
                await self._sem.acquire()
        except BaseException:
            s.waiting -= 1
            raise
        s.waiting -= 1
        s.running += 1
        s.max_running = max(s.max_running, s.running)
        try:
            if stream:
                ok = await self._stream(kind, writer, n_out, n_sent, n_prompt, finish,
                                        include_usage, first_delay, fault)
            else:
                ok = await self._whole(kind, writer, n_out, n_prompt, finish, first_delay,
                                       keep)
        except (ConnectionError, RuntimeError):
            ok = False
            s.requests_cancelled += 1
        finally:
            s.running -= 1
            if self._sem is not None:
                self._sem.release()
            s.last_end_s = time.perf_counter()
        if fault in ("cut", "reset") and ok:
            s.requests_failed += 1
            if fault == "reset":
                writer.transport.abort()
                return False
            return keep
        if ok:
            s.requests_completed += 1
        return keep and ok

    def _ids(self, kind: str) -> tuple[str, bytes]:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{self.stats.requests_started}"
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = (f'{{"id":"{rid}","object":"{obj}","created":{self._created},'
                f'"model":{json.dumps(self.config.model)},')
        return rid, head.encode()

    async def _stream(self, kind: str, writer: asyncio.StreamWriter, n_out: int, n_sent: int,
                      n_prompt: int, finish: str, include_usage: bool, first_delay: float,
                      fault: str | None) -> bool:
        loop = asyncio.get_running_loop()
        _, head = self._ids(kind)
        if kind == "chat":
            def chunk(text: str, reason: str | None) -> bytes:
                r = "null" if reason is None else f'"{reason}"'
                return head + (f'"choices":[{{"index":0,"delta":{{"content":"{text}"}},'
                               f'"logprobs":null,"finish_reason":{r}}}]}}').encode()
            # vLLM's first chat chunk carries only the role: no content, not a token.
            writer.write(_frame(head + b'"choices":[{"index":0,"delta":{"role":"assistant",'
                                       b'"content":""},"logprobs":null,"finish_reason":null}]}'))
        else:
            def chunk(text: str, reason: str | None) -> bytes:
                r = "null" if reason is None else f'"{reason}"'
                return head + (f'"choices":[{{"index":0,"text":"{text}","logprobs":null,'
                               f'"finish_reason":{r},"stop_reason":null}}]}}').encode()
        plain = _frame(chunk(" tok", None))
        delay = self.config.token_delay_s
        t_first = loop.time() + first_delay
        spin = self.config.timer_spin_s
        for k in range(n_sent):
            due = t_first + k * delay
            wait = due - loop.time()
            if wait > 0:
                if wait > spin:
                    await asyncio.sleep(wait - spin)
                while loop.time() < due:
                    await asyncio.sleep(0)
                if writer.transport.is_closing():
                    raise ConnectionResetError("client went away")
            if self.frozen:
                await self._hang()
            last = k == n_out - 1
            writer.write(_frame(chunk(" tok", finish)) if last else plain)
            self.stats.tokens_sent += 1
            if wait > 0:
                await writer.drain()
        if fault in ("cut", "reset"):
            if fault == "cut":
                writer.write(_END)
            await writer.drain()
            return True
        if include_usage:
            usage = (f'"choices":[],"usage":{{"prompt_tokens":{n_prompt},'
                     f'"total_tokens":{n_prompt + n_out},"completion_tokens":{n_out}}}}}')
            writer.write(_frame(head + usage.encode()))
        writer.write(_frame(b"[DONE]") + _END)
        await writer.drain()
        return True

    async def _whole(self, kind: str, writer: asyncio.StreamWriter, n_out: int, n_prompt: int,
                     finish: str, first_delay: float, keep: bool) -> bool:
        total = first_delay + max(n_out - 1, 0) * self.config.token_delay_s
        if total > 0:
            await asyncio.sleep(total)
        rid, _ = self._ids(kind)
        text = " tok" * n_out
        if kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                               "content": text}}
            obj = "chat.completion"
        else:
            choice, obj = {"index": 0, "text": text}, "text_completion"
        choice.update(logprobs=None, finish_reason=finish)
        body = {"id": rid, "object": obj, "created": self._created, "model": self.config.model,
                "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
                          "completion_tokens": n_out}}
        self.stats.tokens_sent += n_out
        writer.write(_json(200, body, keep))
        await writer.drain()
        return True


async def _listen(app: _App, host: str, port: int) -> asyncio.base_events.Server:
    return await asyncio.start_server(app.serve_connection, host, port, backlog=4096,
                                      limit=1 << 20)


class FakeServer:
    """The fake server on a background thread's event loop; ``.url`` once started.

    ``startup_delay_s`` here means /health (and every other route) answers 503 for
    that long after ``start()``: the port must be bound to be known.
    """

    def __init__(self, config: FakeServerConfig | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, **knobs: Any) -> None:
        self.config = config if config is not None else FakeServerConfig(**knobs)
        self.host, self.port = host, port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._app: _App | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        if self._app is None:
            raise RuntimeError("fake server is not started")
        return f"http://{self.host}:{self.port}"

    def start(self) -> FakeServer:
        self._thread = threading.Thread(target=self._run, name="fake-server", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._failure is not None:
            raise RuntimeError(f"fake server failed to start: {self._failure}")
        if not self._ready.is_set():
            raise RuntimeError("fake server did not start within 10 s")
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start() or lost at stop()
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop, self._stop = loop, asyncio.Event()
        app = _App(self.config, loop.time() + self.config.startup_delay_s)
        server = await _listen(app, self.host, self.port)
        self.port = server.sockets[0].getsockname()[1]
        self._app = app
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            app.close_connections()

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10.0)
        self._thread = None

    def stats(self) -> dict[str, Any]:
        if self._app is None:
            raise RuntimeError("fake server is not started")
        return asdict(self._app.stats)

    def reset_stats(self) -> None:
        if self._app is not None and self._loop is not None:
            done = threading.Event()

            def reset() -> None:
                self._app.reset_stats()  # type: ignore[union-attr]
                done.set()

            self._loop.call_soon_threadsafe(reset)
            done.wait(5.0)

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM, ``grace_s`` to exit, then SIGKILL; always reaped.  The process owner's
    stop, so a process's group and children go with it, whoever started it."""
    stop_group(proc, grace_s=grace_s)


class FakeServerProcess:
    """The fake server as a child process (``--port 0``); ``.url`` once started.

    For measurements that must not share a GIL with the client (the benchmark, and
    latency tests).  ``args`` are command-line flags, e.g. ``["--token-delay-ms", "2"]``.
    """

    def __init__(self, args: Sequence[str] = (), host: str = "127.0.0.1") -> None:
        self.args = list(args)
        self.host = host
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> FakeServerProcess:
        argv = [sys.executable, "-m", "autotune.testing.fake_server", "--host", self.host,
                "--port", "0", *self.args]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Under the process owner's guard, in a group of its own: a test run killed with
        # kill -9 takes its fake servers down too.
        self._proc = spawn(argv, stdout=subprocess.PIPE, env=env, grace_s=5.0)
        deadline = time.monotonic() + timeout_s
        assert self._proc.stdout is not None
        while time.monotonic() < deadline:
            line = self._proc.stdout.readline().decode(errors="replace")
            if not line:
                break
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
                return self
        self.stop()
        raise RuntimeError(f"fake server process did not start: {' '.join(argv)}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 5 s; the exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def __enter__(self) -> FakeServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def serve(config: FakeServerConfig, host: str, port: int) -> None:
    """Run until SIGTERM/SIGINT (the process form)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config.startup_delay_s > 0:
        # Like vLLM loading weights: nothing listens yet.
        print(f"fake server: starting, listening in {config.startup_delay_s:g} s", flush=True)
        try:
            await asyncio.wait_for(stop.wait(), config.startup_delay_s)
            return
        except asyncio.TimeoutError:
            pass
    app = _App(config, loop.time())
    server = await _listen(app, host, port)
    bound = server.sockets[0].getsockname()[1]
    print(f"fake server: listening on http://{host}:{bound} (model {config.model})", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        app.close_connections()
    print("fake server: stopped", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autotune.testing.fake_server", allow_abbrev=False,
        description="Fake OpenAI-compatible streaming server (tests and benchmarks). "
                    "Unknown vLLM flags are accepted and ignored.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--model", "--served-model-name", dest="model", default="fake-model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    p.add_argument("--first-token-delay-ms", type=float, default=0.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--startup-delay-s", type=float, default=0.0)
    p.add_argument("--fault", choices=FAULTS, default=None)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--fail-fraction", type=float, default=0.0)
    p.add_argument("--slow-first-token-s", type=float, default=1.0)
    p.add_argument("--eos-after", type=int, default=None)
    p.add_argument("--hang-after", type=int, default=None, metavar="N",
                   help="freeze after N generation requests (streams stop mid-reply)")
    p.add_argument("--mute", action="store_true",
                   help="accept connections and never answer")
    p.add_argument("--timer-spin-ms", type=float, default=1.0,
                   help="busy-wait this long before each token for exact delays (0 = off)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _run(coro: Any) -> None:
    """uvloop when installed: the benchmark server must never be the bottleneck."""
    try:
        import uvloop  # optional: faster when installed
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    args, _ignored = build_parser().parse_known_args(argv)
    try:
        config = FakeServerConfig(
            token_delay_s=args.token_delay_ms / 1000.0,
            first_token_delay_s=args.first_token_delay_ms / 1000.0,
            max_concurrency=args.max_concurrency, startup_delay_s=args.startup_delay_s,
            fault=args.fault, fail_every=args.fail_every, fail_fraction=args.fail_fraction,
            slow_first_token_s=args.slow_first_token_s, eos_after=args.eos_after,
            hang_after=args.hang_after, mute=args.mute,
            model=args.model, api_key=args.api_key, seed=args.seed,
            timer_spin_s=args.timer_spin_ms / 1000.0)
    except FakeServerError as exc:
        print(f"fake server: {exc}", file=sys.stderr)
        return 2
    try:
        _run(serve(config, args.host, args.port))
    except OSError as exc:
        print(f"fake server: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
