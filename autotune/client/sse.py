"""Reading an OpenAI-compatible SSE stream into a request record.

Pure: bytes and their arrival times in, record fields out.  Every transport feeds the
same reader, so the figures cannot depend on which HTTP client carried the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.core.records import RequestRecord

# The one signature both parsers share (orjson's and json's stubs differ beyond it).
_loads: Callable[[bytes], Any]
try:  # orjson parses a streamed chunk about 6x faster: the client must not be the limit
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - orjson is a dependency; json is the fallback
    from json import loads as _loads


def chunk_text(obj: dict[str, Any]) -> str | None:
    """The generated text of one streamed chunk (completions or chat), if any."""
    choices = obj.get("choices")
    if not choices:
        return None
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content")
    return text


class StreamReader:
    """Feed it body bytes as they arrive; ``finish`` then says what the stream was worth.

    A chunk's time is when its bytes arrived; a chunk that carries text is an output
    chunk (TTFT is the first one, ITL the gaps between them), as in vLLM's client.
    """

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.usage: dict[str, Any] | None = None
        self.got_done = False
        self.server_error: str | None = None
        self._tail = b""
        self._last_s: float | None = None

    def feed(self, now: float, data: bytes) -> None:
        """Raises ValueError on a data line that is not JSON (a broken server)."""
        # orjson's JSONDecodeError subclasses ValueError, as json's does.
        if b"\n" not in data:
            self._tail += data
            return
        lines = (self._tail + data).split(b"\n") if self._tail else data.split(b"\n")
        self._tail = lines.pop()
        record = self.record
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event: lines
            body = line[5:].strip()
            if body == b"[DONE]":
                self.got_done = True
                continue
            obj = _loads(body)
            if "error" in obj and not obj.get("choices"):
                err = obj["error"]
                self.server_error = err.get("message") if isinstance(err, dict) else err
                continue
            if chunk_text(obj):
                if not record.chunk_times_s:
                    # Live, so the stop rule sees a running request's first token.
                    record.first_token_s = now
                record.chunk_times_s.append(now)
            if obj.get("usage"):
                self.usage = obj["usage"]
        # Not record.end_s: a record with an end is finished, and this one streams on.
        self._last_s = now

    def finish(self, *, ignore_eos: bool) -> None:
        """Token counts from the usage chunk, and the error when the stream fell short."""
        record = self.record
        if self._last_s is not None:
            record.end_s = self._last_s  # E2E ends at the last bytes, as vLLM's client
        if record.chunk_times_s:
            record.first_token_s = record.chunk_times_s[0]
        if self.usage is not None:
            record.prompt_tokens = int(self.usage.get("prompt_tokens") or 0)
            record.output_tokens = int(self.usage.get("completion_tokens") or 0)
        if self.server_error is not None:
            record.error = f"server error: {self.server_error}"
        elif not self.got_done:
            record.error = "incomplete: stream ended without data: [DONE]"
        elif self.usage is None:
            record.error = ("incomplete: no usage chunk (does the server honour "
                            "stream_options.include_usage?)")
        elif ignore_eos and record.output_tokens < record.expected_output_tokens:
            record.error = (f"truncated: {record.output_tokens} of "
                            f"{record.expected_output_tokens} output tokens")
