"""A lean HTTP/1.1 client for load tests: keep-alive connections, streamed bodies handed
to a callback with their arrival time.

Why our own: a load generator must never be the bottleneck it measures.  httpx's own
transport spent about three times the CPU per streamed request of aiohttp's, and aiohttp
under httpx (httpx-aiohttp) still only matched ``vllm bench serve`` on one core
(benchmarks/RESULTS.md).  Here a response's bytes are parsed by ``httptools`` (the C
parser uvicorn uses) inside ``data_received`` and passed straight to the caller's sink,
stamped with the time they arrived: no per-chunk task switch, no intermediate queue,
and each chunk's time is when the socket delivered it, not when a consumer woke up.

Scope, on purpose: ``http`` and ``https``, HTTP/1.1, one server, no proxies, no
redirects, no cookies.  Anything else: ``LoadTestConfig(transport="httpx")``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from autotune.core.errors import AutotuneError

# Called with (perf_counter when the bytes arrived, decoded body bytes).
BodySink = Callable[[float, bytes], None]


class TransportError(AutotuneError):
    """The request did not complete; the message says what happened.

    Internal: the load generator records it as the request's failure (or retries a
    stale connection), so it reaches the user only as a figure."""


class ConnectError(TransportError):
    """No connection to the server (refused, unreachable, TLS handshake failed)."""


class RemoteProtocolError(TransportError):
    """The server closed the connection mid-response, or answered with invalid HTTP."""


class _StaleConnection(TransportError):
    """The connection closed before the request was written: safe to retry at once."""


@dataclass
class Reply:
    status: int
    body: bytes  # empty when a sink took the body


class _Connection(asyncio.Protocol):
    """One TCP connection; one request at a time on it (HTTP/1.1 without pipelining)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._sink: BodySink | None = None
        self._chunks: list[bytes] = []
        self._pending: list[bytes] = []  # body bytes of this read, for the sink
        self._now = 0.0
        self._received = False
        self.status = 0
        self.complete = False
        self.keep_alive = False

    # -- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._now = time.perf_counter()
        self._received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"invalid HTTP response: {exc}"))
            return
        pending = self._pending
        if pending and self._sink is not None:
            # One call per socket read, not per HTTP chunk: the bytes arrived together.
            body = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            try:
                self._sink(self._now, body)
            except Exception as exc:  # the caller's own error, e.g. a body it cannot read
                self._fail(exc)
                return
        if self.complete and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None or self._waiter.done():
            return
        # No retry here: once the request is written, a close is the server's answer
        # (vLLM's client counts it as a failure too).
        what = "completing the response" if self._received else "answering"
        detail = f": {exc}" if exc else ""
        self._waiter.set_exception(RemoteProtocolError(
            f"server closed the connection without {what}{detail}"))

    # -- httptools callbacks --------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self._sink is not None and 200 <= self.status < 300:
            self._pending.append(body)
        else:
            self._chunks.append(body)

    def on_message_complete(self) -> None:
        # The waiter is released in data_received, after the sink has had the bytes.
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # -- use ------------------------------------------------------------------------

    async def exchange(self, request: bytes, sink: BodySink | None) -> Reply:
        if self.closed or self.transport is None:
            raise _StaleConnection("connection closed before the request was sent")
        self._waiter = asyncio.get_running_loop().create_future()
        self._sink, self._chunks, self._received = sink, [], False
        self._pending.clear()
        self.status, self.complete = 0, False
        self.transport.write(request)
        await self._waiter
        return Reply(self.status, b"".join(self._chunks))

    def _fail(self, exc: BaseException) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _close_connected(task: asyncio.Task[tuple[asyncio.BaseTransport, _Connection]]) -> None:
    # A connection that completes after its request was given up is closed, not leaked.
    if not task.cancelled() and task.exception() is None:
        task.result()[1].close()


class HttpClient:
    """Keep-alive HTTP/1.1 to one server; as many connections as requests in flight."""

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None,
                 connect_timeout_s: float = 30.0, keepalive_expiry_s: float = 4.0,
                 verify: bool = True) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.ssl = ssl.create_default_context()
            if not verify:
                self.ssl.check_hostname = False
                self.ssl.verify_mode = ssl.CERT_NONE
        self.connect_timeout_s = connect_timeout_s
        # vLLM's uvicorn closes a keep-alive connection after 5 s idle; one idle longer
        # than this is dropped rather than raced against the server's close.
        self.keepalive_expiry_s = keepalive_expiry_s
        netloc = self.host if parts.port is None else f"{self.host}:{self.port}"
        fixed = {"Host": netloc, "User-Agent": "autotune", "Accept": "*/*",
                 **(headers or {})}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Connection] = []
        self._closed = False

    def build(self, method: str, path: str, body: bytes | None = None,
              content_type: str = "application/json") -> bytes:
        """The request's bytes: build once, send as often as needed."""
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._fixed}"
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        return (head + "\r\n").encode("latin-1") + (body or b"")

    async def request(self, method: str, path: str, body: bytes | None = None,
                      sink: BodySink | None = None) -> Reply:
        return await self.send(self.build(method, path, body), sink)

    async def send(self, request: bytes, sink: BodySink | None = None) -> Reply:
        """Send prepared request bytes; a 2xx body goes to ``sink`` as it arrives."""
        conn = await self._acquire()
        try:
            try:
                reply = await conn.exchange(request, sink)
            except _StaleConnection:
                conn = await self._connect()
                reply = await conn.exchange(request, sink)
        except BaseException:
            conn.close()  # cancelled or failed mid-response: the connection is unusable
            raise
        if conn.keep_alive and not conn.closed and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        return reply

    async def _acquire(self) -> _Connection:
        expired = time.monotonic() - self.keepalive_expiry_s
        while self._idle:
            conn = self._idle.pop()  # the most recently used: least likely timed out
            if not conn.closed and conn.idle_since > expired:
                return conn
            conn.close()
        return await self._connect()

    async def _connect(self) -> _Connection:
        if self._closed:
            raise TransportError("client is closed")
        loop = asyncio.get_running_loop()
        # Not asyncio.wait_for: before Python 3.12 it returns the connection and drops a
        # cancel that lands as the connect completes, so a pruned load test waited for
        # that request's whole response.
        connecting = loop.create_task(
            loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl))
        try:
            done, _ = await asyncio.wait({connecting}, timeout=self.connect_timeout_s)
        except asyncio.CancelledError:
            connecting.add_done_callback(_close_connected)
            connecting.cancel()
            raise
        if not done:
            connecting.add_done_callback(_close_connected)
            connecting.cancel()
            raise ConnectError(f"connect to {self.host}:{self.port} timed out after "
                               f"{self.connect_timeout_s:g} s")
        try:
            _, conn = connecting.result()
        except ssl.SSLError as exc:
            raise ConnectError(f"TLS handshake with {self.host}:{self.port} failed: "
                               f"{exc}") from None
        except OSError as exc:
            raise ConnectError(f"connect to {self.host}:{self.port} failed: {exc}") from None
        return conn

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
