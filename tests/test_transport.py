"""The native HTTP/1.1 client (autotune.client.transport) and the SSE reader (autotune.client.sse),
against raw sockets that answer exactly what each test needs."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from autotune.client.sse import StreamReader
from autotune.client.transport import ConnectError, HttpClient, RemoteProtocolError
from autotune.core.records import RequestRecord

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


async def _serve(handler: Handler, body: Callable[[int], Awaitable[None]],
                 ssl_ctx: ssl.SSLContext | None = None) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=ssl_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        await body(port)
    finally:
        server.close()


def _chunked(*events: bytes) -> bytes:
    out = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n")
    for e in events:
        out += b"%x\r\n%s\r\n" % (len(e), e)
    return out + b"0\r\n\r\n"


def test_streams_chunked_body_to_the_sink_and_keeps_the_connection() -> None:
    connections = []
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            while True:
                requests.append(await _read_request(reader))
                writer.write(_chunked(b"data: a\n\n", b"data: b\n\n"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def body(port: int) -> None:
        got: list[tuple[float, bytes]] = []
        async with HttpClient(f"http://127.0.0.1:{port}", headers={"X-Key": "k"}) as client:
            for _ in range(3):
                reply = await client.request("POST", "/v1/completions", b'{"a":1}',
                                             lambda t, b: got.append((t, b)))
                assert reply.status == 200 and reply.body == b""
        assert b"".join(b for _, b in got) == b"data: a\n\ndata: b\n\n" * 3
        assert all(t > 0 for t, _ in got)

    asyncio.run(_serve(handler, body))
    assert len(connections) == 1  # kept alive and reused
    first = requests[0].decode()
    assert first.startswith("POST /v1/completions HTTP/1.1\r\n")
    assert "X-Key: k\r\n" in first and "Content-Length: 7\r\n" in first
    assert first.endswith('{"a":1}')


def test_error_status_body_is_returned_not_sunk() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy")
        await writer.drain()
        writer.close()

    async def body(port: int) -> None:
        sunk: list[bytes] = []
        async with HttpClient(f"http://127.0.0.1:{port}") as client:
            reply = await client.request("GET", "/health", None, lambda t, b: sunk.append(b))
        assert (reply.status, reply.body, sunk) == (503, b"busy", [])

    asyncio.run(_serve(handler, body))


def test_close_mid_response_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_chunked(b"data: a\n\n")[:-5])  # no final chunk
        await writer.drain()
        writer.transport.abort()

    async def body(port: int) -> None:
        async with HttpClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(RemoteProtocolError, match="without completing the response"):
                await client.request("POST", "/x", b"{}", lambda t, b: None)

    asyncio.run(_serve(handler, body))


def test_close_before_answering_is_not_retried() -> None:
    seen = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await _read_request(reader))
        writer.transport.abort()

    async def body(port: int) -> None:
        async with HttpClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(RemoteProtocolError, match="without answering"):
                await client.request("POST", "/x", b"{}")

    asyncio.run(_serve(handler, body))
    assert len(seen) == 1  # a POST the server may have acted on is never sent twice


def test_invalid_http_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def body(port: int) -> None:
        async with HttpClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(RemoteProtocolError, match="invalid HTTP response"):
                await client.request("GET", "/")

    asyncio.run(_serve(handler, body))


def test_sink_error_reaches_the_caller_even_on_the_last_read() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_chunked(b"data: {not json\n\n"))  # the whole response in one write
        await writer.drain()

    def sink(now: float, data: bytes) -> None:
        StreamReader(RequestRecord(0, 0.0)).feed(now, data)

    async def body(port: int) -> None:
        async with HttpClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(ValueError):
                await client.request("POST", "/x", b"{}", sink)

    asyncio.run(_serve(handler, body))


def test_idle_connection_past_expiry_is_not_reused() -> None:
    connections = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            while True:
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def body(port: int) -> None:
        async with HttpClient(f"http://127.0.0.1:{port}", keepalive_expiry_s=0.05) as client:
            await client.request("GET", "/")
            await asyncio.sleep(0.1)
            assert (await client.request("GET", "/")).body == b"ok"

    asyncio.run(_serve(handler, body))
    assert len(connections) == 2


def test_refused_connection_is_a_connect_error() -> None:
    async def body() -> None:
        async with HttpClient("http://127.0.0.1:1") as client:
            with pytest.raises(ConnectError, match="127.0.0.1:1"):
                await client.request("GET", "/")

    asyncio.run(body())


def test_a_cancel_as_the_connect_completes_cancels_and_closes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load test that stops cancels every request in flight. A cancel that lands in
    the same loop turn as the connect's completion must still cancel the request, and the
    new connection must be closed, not kept or used."""
    closed: list[bool] = []

    class Connected:
        def close(self) -> None:
            closed.append(True)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = asyncio.Event()

        async def create_connection(*args: object, **kwargs: object) -> tuple[None, Connected]:
            await gate.wait()
            return None, Connected()

        monkeypatch.setattr(loop, "create_connection", create_connection)
        client = HttpClient("http://127.0.0.1:9")
        task = asyncio.create_task(client.send(client.build("GET", "/")))
        for _ in range(3):
            await asyncio.sleep(0)  # the send is now waiting for its connection
        gate.set()  # the connect completes in the same turn as the cancel
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert closed == [True]


def test_bad_url_is_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        HttpClient("ftp://host")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_with_a_self_signed_certificate(tmp_path: Path) -> None:
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nsec")
        await writer.drain()

    async def body(port: int) -> None:
        async with HttpClient(f"https://127.0.0.1:{port}") as client:
            with pytest.raises(ConnectError, match="TLS"):  # not trusted: refused
                await client.request("GET", "/")
        async with HttpClient(f"https://127.0.0.1:{port}", verify=False) as client:
            assert (await client.request("GET", "/")).body == b"sec"

    asyncio.run(_serve(handler, body, ctx))


# -- the SSE reader ------------------------------------------------------------------------


def _event(obj: str) -> bytes:
    return b"data: " + obj.encode() + b"\n\n"


def test_reader_times_text_chunks_across_split_reads() -> None:
    record = RequestRecord(0, 0.0, expected_output_tokens=2)
    reader = StreamReader(record)
    text = _event('{"choices":[{"text":"a"}]}')
    reader.feed(1.0, text[:10])  # a line split across reads is held until it completes
    reader.feed(2.0, text[10:] + _event('{"choices":[{"delta":{"content":"b"}}]}'))
    reader.feed(3.0, _event('{"choices":[{"text":""}]}')  # no text: not an output chunk
                + _event('{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}')
                + b"data: [DONE]\n\n")
    reader.finish(ignore_eos=True)
    assert record.chunk_times_s == [2.0, 2.0] and record.first_token_s == 2.0
    assert (record.prompt_tokens, record.output_tokens, record.end_s) == (5, 2, 3.0)
    assert record.error is None


@pytest.mark.parametrize(("events", "error"), [
    ([b"data: [DONE]\n\n"], "incomplete: no usage chunk"),
    ([_event('{"choices":[],"usage":{"completion_tokens":1}}')], "incomplete: stream ended"),
    ([_event('{"choices":[],"usage":{"completion_tokens":1}}'), b"data: [DONE]\n\n"],
     "truncated: 1 of 2"),
    ([_event('{"error":{"message":"boom"}}'), b"data: [DONE]\n\n"], "server error: boom"),
])
def test_reader_says_what_the_stream_lacked(events: list[bytes], error: str) -> None:
    record = RequestRecord(0, 0.0, expected_output_tokens=2)
    reader = StreamReader(record)
    for e in events:
        reader.feed(1.0, e)
    reader.finish(ignore_eos=True)
    assert record.error is not None and record.error.startswith(error)
