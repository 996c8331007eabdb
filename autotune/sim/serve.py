"""A simulator that serves the OpenAI API like ``vllm serve``, in wall-clock time.

    python -m autotune.sim.serve --model llama-3-8b --profile 4xa100-80gb \\
        --tensor-parallel-size 4 --max-num-seqs 128 --port 8000

It is NOT vLLM and uses no GPU: the same scheduler, cost model and modelled API front end
(:mod:`autotune.sim.frontend`) as the virtual-time ``simulate`` decide when each request
reaches the engine and when each token is produced and sent, and the server sleeps until
then.  This process's own HTTP handling comes on top (real, and small).  Every figure it
serves is simulated.

Token counting (documented, deterministic): a text prompt counts one token per
whitespace-separated word (``len(text.split())``); a prompt given as token ids counts
them; a chat request counts the words of every message's content.  The output is
always ``max_tokens`` tokens (as with ``ignore_eos``), one word per token.  With prefix
caching (on by default, as in vLLM) each prompt declares every full block by its chained
hash, so a block an earlier prompt held is a cache hit.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (streaming SSE like vLLM, with
the usage chunk when ``stream_options.include_usage``), ``/v1/models``, ``/health``,
``/tokenize``, ``/metrics`` (vLLM's metric names).  Fault switches: ``--crash-after N``,
``--hang-at-startup``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import heapq
import itertools
import json
import os
import re
import signal
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from autotune.sim.config import ConfigRefused, EngineConfig, EngineSetup, resolve
from autotune.sim.costmodel import CostModel
from autotune.sim.engine import error_body, request_problem
from autotune.sim.frontend import FrontEnd, FrontEndCosts
from autotune.sim.profiles import ProfileError, load_hardware, load_model
from autotune.sim.scheduler import DECODE, Scheduler, Seq
from autotune.workload.shared_blocks import MAX_BLOCKS, prefix_of

if TYPE_CHECKING:
    from starlette.requests import Request as HttpRequest
    from starlette.responses import Response
    from starlette.routing import Route

OWNED_BY = "autotune-simulator"
# vLLM's bucket bounds for vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
DEFAULT_PROFILE = "a100-80gb"
DEFAULT_MODEL_PROFILE = "llama-3-8b"
WORDS = ("the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was",
         "with", "be", "by", "on", "not", "he", "this", "are")
TOKEN, DONE, CLOSED = "token", "done", "closed"


def log(level: str, msg: str, *, err: bool = False) -> None:
    """One line in vLLM's log format, tagged as the simulator."""
    stamp = datetime.now().strftime("%m-%d %H:%M:%S")
    print(f"{level} {stamp} [simulator] {msg}", file=sys.stderr if err else sys.stdout,
          flush=True)


def word_ids(text: str) -> list[int]:
    """One token per whitespace-separated word, the word's CRC-32 as its id."""
    return [zlib.crc32(w.encode()) for w in text.split()]


def prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
    """The documented deterministic tokens: the words of the text (of every message's
    content, in order, for a chat), or the token ids given."""
    if chat:
        ids: list[int] = []
        for m in body.get("messages") or []:
            content = m.get("content", "") if isinstance(m, dict) else ""
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = " ".join(str(p.get("text", "")) for p in content
                                   if isinstance(p, dict))
            ids += word_ids(str(content))
        return ids
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        prompt = prompt[0] if prompt else ""
        if isinstance(prompt, list):
            return [int(t) if isinstance(t, int) else 0 for t in prompt]
    return word_ids(str(prompt))


def prompt_token_count(body: dict[str, Any], chat: bool) -> int:
    return len(prompt_ids(body, chat))


class RealtimeEngine:
    """The simulator's scheduler and cost model stepping in wall-clock time."""

    def __init__(self, setup: EngineSetup, *, crash_after: int | None = None) -> None:
        self.setup = setup
        self.cost = CostModel.for_setup(setup)
        self.sched = Scheduler.for_setup(setup)
        self.crash_after = crash_after
        self.queues: dict[int, asyncio.Queue[str]] = {}
        self.seqs: dict[int, Seq] = {}
        self.to_abort: list[int] = []
        self.wake = asyncio.Event()
        self.clock = 0.0  # wall time the last step ended (perf_counter)
        self.next_rid = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0
        self.stopping = False
        # Server-side TTFT (request received -> first token handed to HTTP), as vLLM's
        # vllm:time_to_first_token_seconds: a reference for what a client adds on top.
        self.ttft_counts = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        costs = FrontEndCosts.for_setup(setup)
        # The modelled API front end (None when the profile gives it no cost): requests it
        # is taking in, and hand-overs and token deliveries due at (perf_counter, order).
        self.fe = FrontEnd(costs) if costs.active else None
        self.in_front: set[int] = set()
        self.due: list[tuple[float, int, Callable[[], None]]] = []
        self.due_order = itertools.count()
        self.due_wake = asyncio.Event()

    def submit(self, ids: Sequence[int], max_tokens: int) -> tuple[int, asyncio.Queue[str]]:
        """Queue a request of prompt tokens ``ids``.  With prefix caching, every full
        block is declared by its chained hash, so a block any earlier prompt held is
        found in the cache, as vLLM finds it."""
        rid = self.next_rid
        self.next_rid += 1
        seq = Seq(rid, len(ids), max_tokens)
        if self.sched.prefix_cache is not None:
            seq.prefix = prefix_of(ids, MAX_BLOCKS)
        q: asyncio.Queue[str] = asyncio.Queue()
        self.queues[rid], self.seqs[rid] = q, seq
        if self.fe is None:
            self.sched.add(seq)
            self.wake.set()
        else:
            self.in_front.add(rid)
            self._at(self.fe.take_request(time.perf_counter()), lambda: self._hand_over(seq))
        return rid, q

    def _hand_over(self, seq: Seq) -> None:
        if seq.rid in self.in_front:  # not aborted while the front end had it
            self.in_front.discard(seq.rid)
            self.sched.add(seq)
            self.wake.set()

    def _at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` at perf_counter ``when`` (ties in the order they were asked)."""
        heapq.heappush(self.due, (when, next(self.due_order), action))
        self.due_wake.set()

    async def _run_due(self) -> None:
        """The front end's clock: run each hand-over and delivery when it is due."""
        while not self.stopping:
            delay = self.due[0][0] - time.perf_counter() if self.due else None
            if delay is not None and delay <= 0:
                heapq.heappop(self.due)[2]()
                continue
            self.due_wake.clear()
            try:
                await asyncio.wait_for(self.due_wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def _deliver(self, tokens: list[int], done: list[int]) -> None:
        for rid in tokens:
            q = self.queues.get(rid)
            if q is not None:
                q.put_nowait(TOKEN)
        for rid in done:
            q = self.queues.pop(rid, None)
            if q is not None:
                q.put_nowait(DONE)

    def abort(self, rid: int) -> None:
        # Applied between steps: a step in flight already holds blocks for it.
        if rid in self.seqs:
            self.to_abort.append(rid)
            self.wake.set()

    def close_all(self) -> None:
        self.stopping = True
        for q in self.queues.values():
            q.put_nowait(CLOSED)
        self.wake.set()
        self.due_wake.set()

    def _apply_aborts(self) -> None:
        for rid in self.to_abort:
            seq = self.seqs.pop(rid, None)
            self.queues.pop(rid, None)
            if seq is None:
                continue
            if rid in self.in_front:
                self.in_front.discard(rid)  # the engine never saw it
            else:
                self.sched.abort(seq)
        self.to_abort.clear()

    async def run(self) -> None:
        due = asyncio.create_task(self._run_due()) if self.fe is not None else None
        try:
            await self._run()
        finally:
            if due is not None:
                due.cancel()
                await asyncio.gather(due, return_exceptions=True)

    async def _run(self) -> None:
        sched, cost, fe = self.sched, self.cost, self.fe
        while not self.stopping:
            self._apply_aborts()
            if sched.idle:
                self.wake.clear()
                await self.wake.wait()
                now = time.perf_counter()  # an idle engine starts when work arrives
                if fe is not None:
                    fe.idle(now - self.clock)
                self.clock = now
                continue
            plan = sched.schedule()
            if plan.tokens == 0:  # cannot happen for a config that resolved; do not spin
                await asyncio.sleep(0.01)
                continue
            c = cost.step(plan.tokens, plan.seqs, plan.kv_tokens, plan.pairs)
            step_s = c.total_s if fe is None else c.total_s + fe.step_extra(c.total_s)
            # While busy, each step ends exactly one step time after the previous end, so
            # late wake-ups (sleep overshoot, a loaded CPU) never accumulate: a late step
            # delivers its tokens late, and the next one catches up.
            target = self.clock + step_s
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self.clock = target
            decoding = [s for s in sched.running if s.state == DECODE]
            started, finished = sched.complete(plan)
            for seq in started:
                if not seq.segments:  # first stint: the prompt was processed once
                    self.prompt_tokens_total += seq.prompt_tokens
            tokens = [seq.rid for seq in (*decoding, *started)]
            done = [seq.rid for seq in finished]
            self.generation_tokens_total += len(tokens)
            for rid in done:
                self.seqs.pop(rid, None)
            self.finished_total += len(done)
            if fe is None:
                self._deliver(tokens, done)
            else:  # the client has them once the front end has sent them
                self._at(fe.emit(target, len(tokens)),
                         functools.partial(self._deliver, tokens, done))
            if self.crash_after is not None and self.finished_total >= self.crash_after:
                log("ERROR", "EngineCore encountered a fatal error (simulated fault: "
                    f"--crash-after {self.crash_after}): RuntimeError: Engine core died "
                    "unexpectedly", err=True)
                os._exit(3)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1
        for i, le in enumerate(TTFT_BUCKETS):
            if seconds <= le:
                self.ttft_counts[i] += 1

    def metrics_text(self, model_name: str) -> str:
        lab = f'{{engine="0",model_name="{model_name}"}}'
        s = self.sched
        rows = [
            ("vllm:num_requests_running", "gauge",
             "Number of requests in model execution batches (simulated).", s.num_running),
            ("vllm:num_requests_waiting", "gauge",
             "Number of requests waiting to be processed (simulated).", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "gauge",
             "KV-cache usage. 1 means 100 percent usage (simulated).", s.kv_usage),
            ("vllm:num_preemptions_total", "counter",
             "Cumulative number of preemption from the engine (simulated).",
             s.num_preemptions),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed "
             "(simulated).", self.prompt_tokens_total),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens "
             "processed (simulated).", self.generation_tokens_total),
            ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in "
             "tokens (simulated).", 0 if s.prefix_cache is None else s.prefix_cache.queries),
            ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens "
             "(simulated).", 0 if s.prefix_cache is None else s.prefix_cache.hits),
        ]
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                    f"{name}{lab} {float(value)}"]
        name = "vllm:request_success_total"
        out += [f"# HELP {name} Count of successfully processed requests (simulated).",
                f"# TYPE {name} counter",
                f'{name}{{engine="0",finished_reason="length",model_name="{model_name}"}} '
                f"{float(self.finished_total)}"]
        name = "vllm:time_to_first_token_seconds"
        out += [f"# HELP {name} Histogram of time to first token in seconds (simulated "
                "engine, measured by this server from request receipt).",
                f"# TYPE {name} histogram"]
        for le, count in zip(TTFT_BUCKETS, self.ttft_counts, strict=True):
            out.append(f'{name}_bucket{{engine="0",le="{le}",model_name="{model_name}"}} '
                       f"{float(count)}")
        out += [f'{name}_bucket{{engine="0",le="+Inf",model_name="{model_name}"}} '
                f"{float(self.ttft_count)}",
                f"{name}_count{lab} {float(self.ttft_count)}",
                f"{name}_sum{lab} {self.ttft_sum}"]
        return "\n".join(out) + "\n"


def build_app(engine: RealtimeEngine, served_name: str) -> Any:
    # The HTTP server's packages load only when a simulated server is served.
    from starlette.applications import Starlette
    from starlette.routing import Route

    async def complete(request: HttpRequest) -> Response:
        return await _complete(engine, served_name, request)

    return Starlette(routes=[
        *_info_routes(engine, served_name),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
    ])


def _error(message: str, code: int = 400, kind: str = "BadRequestError") -> Response:
    """An error as vLLM's API server sends it, so a client parses ours like its own: the
    engine's error body, typed with the exception's class name."""
    from starlette.responses import JSONResponse  # the web stack: only when served

    body = json.loads(error_body(message, code))
    body["type"] = kind
    return JSONResponse(body, status_code=code)


async def _read_json(request: HttpRequest) -> dict[str, Any] | Response:
    """The request's JSON object, or the 400 that a body which is not one gets (shared by
    every POST route, so each answers a bad body alike)."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error("request body is not valid JSON")
    if not isinstance(body, dict):
        return _error("request body must be a JSON object")
    return body


def _info_routes(engine: RealtimeEngine, served_name: str) -> list[Route]:
    """The routes that describe the server (health, models, metrics, tokenize): apart
    from the completions because none of them puts work on the engine."""
    # The web stack loads only when a simulated server is served.
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    setup = engine.setup
    created = int(time.time())

    async def health(_: HttpRequest) -> Response:
        return Response(status_code=200)

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": served_name, "object": "model", "created": created, "owned_by": OWNED_BY,
            "root": setup.model.hf_id, "parent": None, "max_model_len": setup.max_model_len,
            "permission": [],
            "simulated": True,
            "simulator": {"model_profile": setup.model.name,
                          "hardware_profile": setup.hardware.label},
        }]})

    async def metrics(_: HttpRequest) -> Response:
        return PlainTextResponse(engine.metrics_text(served_name),
                                 media_type="text/plain; version=0.0.4")

    async def tokenize(request: HttpRequest) -> Response:
        body = await _read_json(request)
        if isinstance(body, Response):
            return body
        chat = "messages" in body
        n = prompt_token_count(body, chat)
        text = body.get("prompt", "") if not chat else " ".join(
            str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
        words = word_ids(text) if isinstance(text, str) else []
        vocab = setup.model.vocab_size
        tokens = [i % vocab for i in words] if len(words) == n else list(range(n))
        return JSONResponse({"count": n, "max_model_len": setup.max_model_len,
                             "tokens": tokens})

    return [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]),
    ]


@dataclass(frozen=True)
class _Call:
    """One completion the engine took: what its answer, whole or streamed, is made of."""

    engine: RealtimeEngine
    model: str  # the served name every answer carries
    chat: bool
    rid: int
    q: asyncio.Queue[str]
    received: float  # perf_counter when the request was taken (server-side TTFT)
    prompt_n: int
    max_tokens: int
    ident: str
    obj: str


async def _complete(engine: RealtimeEngine, served_name: str,
                    request: HttpRequest) -> Response:
    """Both completion routes: the path alone says chat or not; whole or streamed is
    only decided once the engine has the request."""
    from starlette.responses import Response, StreamingResponse  # only when served

    chat = request.url.path.endswith("/chat/completions")
    body = await _read_json(request)
    if isinstance(body, Response):
        return body
    sizes = _admit(engine, served_name, body, chat)
    if isinstance(sizes, Response):
        return sizes
    ids, max_tokens = sizes
    prompt_n = len(ids)
    received = time.perf_counter()
    rid, q = engine.submit(ids, max_tokens)
    call = _Call(engine, served_name, chat, rid, q, received, prompt_n, max_tokens,
                 ident=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                 obj="chat.completion.chunk" if chat else "text_completion")
    if not body.get("stream"):
        return await _whole_completion(call)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_stream(call, include_usage), media_type="text/event-stream")


def _admit(engine: RealtimeEngine, served_name: str, body: dict[str, Any],
           chat: bool) -> tuple[list[int], int] | Response:
    """(prompt tokens, max tokens) of a request the engine may take, or the error vLLM
    answers before queueing one (unknown model, bad or too long a request, shutting
    down)."""
    setup = engine.setup
    model = body.get("model", served_name)
    if model != served_name:
        return _error(f"The model `{model}` does not exist.", 404, "NotFoundError")
    ids = prompt_ids(body, chat)
    prompt_n = len(ids)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is None:
        max_tokens = setup.max_model_len - prompt_n if chat else 16
    if not isinstance(max_tokens, int):
        return _error(f"max_tokens must be an integer, got {max_tokens!r}")
    problem = request_problem(prompt_n, max_tokens, setup.max_model_len)
    if problem is not None:
        return _error(problem)
    if engine.stopping:
        return _error("server is shutting down", 503, "ServiceUnavailableError")
    return ids, max_tokens


def _usage(prompt_n: int, n_out: int) -> dict[str, int]:
    """The OpenAI usage block, alike in a whole answer and in a stream's last chunk."""
    return {"prompt_tokens": prompt_n, "total_tokens": prompt_n + n_out,
            "completion_tokens": n_out}


async def _whole_completion(call: _Call) -> Response:
    """A non-streamed answer: it waits for every token, and gives the engine its blocks
    back should the client leave (or the server stop) first."""
    from starlette.responses import JSONResponse  # the web stack: only when served

    engine = call.engine
    n_out = 0
    try:
        while (ev := await call.q.get()) == TOKEN:
            if n_out == 0:
                engine.observe_ttft(time.perf_counter() - call.received)
            n_out += 1
    finally:
        if ev != DONE:
            engine.abort(call.rid)
    if ev != DONE:
        return _error("server is shutting down", 503, "ServiceUnavailableError")
    text = "".join(f" {WORDS[i % len(WORDS)]}" for i in range(n_out))
    if call.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                          "content": text},
                                  "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": "length", "stop_reason": None}
    return JSONResponse({"id": call.ident, "object": call.obj.removesuffix(".chunk"),
                         "created": int(time.time()), "model": call.model,
                         "choices": [choice], "usage": _usage(call.prompt_n, n_out)})


def _sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event, compact JSON as vLLM writes it."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunk(call: _Call, i: int, last: bool) -> bytes:
    """Token ``i`` of a stream as its own event; the last one carries the finish reason."""
    word = f" {WORDS[i % len(WORDS)]}"
    reason = "length" if last else None
    if call.chat:
        c: dict[str, Any] = {"index": 0, "delta": {"content": word},
                             "logprobs": None, "finish_reason": reason}
    else:
        c = {"index": 0, "text": word, "logprobs": None, "finish_reason": reason,
             "stop_reason": None}
    return _sse({"id": call.ident, "object": call.obj, "created": int(time.time()),
                 "model": call.model, "choices": [c]})


async def _stream(call: _Call, include_usage: bool) -> AsyncIterator[bytes]:
    """A streamed answer, one event per token as the engine hands it over; a stream
    that ends before its last token gives the engine its blocks back."""
    engine = call.engine
    finished = False
    try:
        if call.chat:
            yield _sse({"id": call.ident, "object": call.obj, "created": int(time.time()),
                        "model": call.model, "choices": [{
                            "index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}]})
        n_out = 0
        while True:
            ev = await call.q.get()
            if ev == CLOSED:
                return  # shutting down: close the stream
            if ev == DONE:
                finished = True
                break
            if n_out == 0:
                engine.observe_ttft(time.perf_counter() - call.received)
            yield _chunk(call, n_out, n_out + 1 == call.max_tokens)
            n_out += 1
        if include_usage:
            yield _sse({"id": call.ident, "object": call.obj, "created": int(time.time()),
                        "model": call.model, "choices": [],
                        "usage": _usage(call.prompt_n, n_out)})
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            engine.abort(call.rid)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autotune.sim.serve",
        description="autotune's SIMULATOR of `vllm serve`: an OpenAI-compatible server "
        "whose token timings come from a simulated vLLM engine (no GPU, no model). "
        "Every figure it produces is simulated.")
    p.add_argument("--model", default=None,
                   help="served model name (or the first positional argument); also the "
                   "model profile when it names one "
                   "(llama-3-8b, an HF id such as meta-llama/Meta-Llama-3-8B-Instruct, or a "
                   "model folder with config.json)")
    p.add_argument("--sim-model", default=None,
                   help=f"model profile to simulate (default: --model when it is a profile, "
                   f"else {DEFAULT_MODEL_PROFILE})")
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="hardware profile, optionally with a GPU count: 4xa100-80gb "
                   f"(default {DEFAULT_PROFILE})")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="vLLM's automatic prefix cache (on by default, as "
                   "in vLLM): prompts sharing full blocks of words skip their prefill")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    # None: the platform's default, as vLLM (16 on GPUs, 128 on vLLM-CPU).
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--api-server-count", type=int, default=1,
                   help="API-server processes: they share the modelled front end's work")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--startup-delay-s", type=float, default=3.0,
                   help="seconds to wait before serving, like vLLM's start-up (default 3)")
    p.add_argument("--crash-after", type=int, default=None, metavar="N",
                   help="fault switch: exit non-zero once N requests have finished")
    p.add_argument("--hang-at-startup", action="store_true",
                   help="fault switch: never start serving (the port stays closed)")
    return p


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    positional = None
    if argv and not argv[0].startswith("-"):  # `vllm serve MODEL ...`
        positional = argv.pop(0)
    args, unknown = parser().parse_known_args(argv)
    if args.model is None:
        args.model = positional
    if args.model is None:
        parser().error("a model is required (--model NAME)")
    return args, unknown


_COUNTED = re.compile(r"^\d+x", re.IGNORECASE)  # a profile name with a GPU count


def _model_profile(args: argparse.Namespace) -> tuple[Any, str | None]:
    if args.sim_model:
        return load_model(args.sim_model), None
    try:
        return load_model(args.model), None
    except ProfileError:
        note = (f"model {args.model!r} is not a simulator profile: simulating "
                f"{DEFAULT_MODEL_PROFILE} (set --sim-model to choose)")
        return load_model(DEFAULT_MODEL_PROFILE), note


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = parse(sys.argv[1:] if argv is None else argv)
    log("INFO", "autotune SIMULATOR of the vLLM OpenAI API server: no GPU, no model "
        "weights; every timing it serves is simulated")
    if unknown:
        log("WARNING", f"ignoring flags the simulator does not model: {' '.join(unknown)}")
    try:
        hardware = load_hardware(args.profile)
        model, note = _model_profile(args)
    except ProfileError as exc:
        log("ERROR", str(exc), err=True)
        return 2
    if note:
        log("WARNING", note)
    config = EngineConfig(
        model=model.name, tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        block_size=args.block_size, api_server_count=args.api_server_count)
    node = hardware.label
    if not _COUNTED.match(args.profile.strip()):
        # "a100-80gb" names the GPU, not the node: say how many GPUs that profile has.
        node += (f" ({args.profile}'s default node of {hardware.gpus} GPUs; "
                 f"--profile 1x{hardware.name} for one)")
    log("INFO", f"non-default args: {config.to_flags()} on {node} (simulated)")

    stop = {"flag": False}

    def on_term(signum: int, _frame: Any) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_term)
    if args.hang_at_startup:
        # Said after the handler is in place: a test may send SIGTERM on reading it.
        log("WARNING", "simulated fault --hang-at-startup: start-up will never finish")
        while not stop["flag"]:
            time.sleep(0.05)
        return 0
    deadline = time.monotonic() + max(args.startup_delay_s, 0.0)
    while time.monotonic() < deadline and not stop["flag"]:
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
    if stop["flag"]:
        return 0
    try:
        setup = resolve(config, hardware, model)
    except ConfigRefused as exc:
        log("ERROR", "EngineCore failed to start (simulated).", err=True)
        print(f"ValueError: {exc}", file=sys.stderr, flush=True)
        print("RuntimeError: Engine core initialization failed. See root cause above.",
              file=sys.stderr, flush=True)
        return 1
    for line in setup.log_lines():
        log("INFO", line)
    log("INFO", f"max_num_seqs={setup.max_num_seqs}, max_num_batched_tokens="
        f"{setup.max_num_batched_tokens}, chunked prefill "
        f"{'enabled' if setup.enable_chunked_prefill else 'disabled'} (simulated)")
    served = (args.served_model_name or [args.model])[0]
    return _serve(setup, served, args)


def _serve(setup: EngineSetup, served: str, args: argparse.Namespace) -> int:
    import uvicorn  # loaded only when a simulated server is served

    engine = RealtimeEngine(setup, crash_after=args.crash_after)
    app = build_app(engine, served)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(engine.close_all)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=2, lifespan="off")
    server = Server(config)

    async def run() -> None:
        task = asyncio.create_task(engine.run())
        log("INFO", f"Starting vLLM API server (simulator) on http://{args.host}:{args.port}")
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started and not serving.done():
                await asyncio.sleep(0.01)
            if server.started:
                log("INFO", "Application startup complete.")
            await serving
        finally:
            engine.close_all()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    log("INFO", "Shutting down (simulator).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
