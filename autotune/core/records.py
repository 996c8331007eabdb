"""The request record: one request as the client saw it.

The same record flows from the load generator (real HTTP) or the simulator (virtual
time) to ``metrics``, the pruner and the reports, so none of them can tell which
produced it.  All times are seconds on one monotonic clock shared by every record of
a load test (``time.perf_counter`` for HTTP, the virtual clock for the simulator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    index: int
    scheduled_s: float
    # When the client released the request (before any max-concurrency gate): its
    # lag behind scheduled_s is the client's own slowness, the "send lag".
    dispatched_s: float | None = None
    # When the HTTP request actually went out (after the gate): latencies start here.
    sent_s: float | None = None
    first_token_s: float | None = None
    # Arrival time of every streamed chunk that carried output text, in order.
    chunk_times_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    status: int | None = None
    error: str | None = None
    warmup: bool = False

    @property
    def done(self) -> bool:
        return self.end_s is not None

    @property
    def ok(self) -> bool:
        return self.end_s is not None and self.error is None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None or self.sent_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        if self.end_s is None or self.sent_s is None:
            return None
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """vLLM's definition: (e2e - ttft) / (output_tokens - 1)."""
        if not self.ok or self.output_tokens < 2:
            return None
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive content chunks (vLLM's ITL)."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def send_lag_s(self) -> float | None:
        if self.dispatched_s is None:
            return None
        return self.dispatched_s - self.scheduled_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


# Called by the load generator (HTTP or simulated) once per window with the current
# time and every measured record so far (unfinished ones have ``end_s is None``).
# Returning True asks the load test to stop early (the pruner fired).
WindowCallback = Callable[[float, Sequence[RequestRecord]], bool]
