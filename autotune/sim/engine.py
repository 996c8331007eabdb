"""Virtual-time simulation of one load test against a simulated vLLM engine.

``simulate`` drives the scheduler and the cost model as a discrete-event simulation and
fills the same :class:`~autotune.core.records.RequestRecord` objects the HTTP load generator
fills, so ``metrics`` cannot tell the two apart.  Every figure it produces is simulated.

The API server (front end, :mod:`autotune.sim.frontend`) is a stage of its own when the
hardware profile gives it a cost: a request reaches the scheduler only after the front
end has taken it in, and the client has a step's tokens only once the front end has sent
them, so TTFT, ITL and E2E are what a client waits for.  Client-side events (arrivals,
completions the client has seen) are then applied in time order apart from the engine's
steps.  With no front-end cost the engine runs exactly as without one.

Load is open-loop (each request sent at a time fixed in advance, optionally behind a
client-side concurrency cap) or closed-loop (``think_s``): virtual users each send a
request, wait for it to end, think, and send the next, so the send times depend on
the latencies the engine gives.  Pending sends are then a heap of the users' next
sends; the engine stops at the earliest as it stops at an open-loop arrival.

Speed: a step costs O(prefills + finishes) (see ``scheduler``), and stretches of
decode-only steps with no arrival, finish, KV-block shortage or window boundary in
between are costed and applied at once: in numpy (front end included), or, for a
stretch of a few steps, in a plain loop that does the same arithmetic (a numpy call
costs about a microsecond whatever its size).  Per-step records go to Python arrays.
"""

from __future__ import annotations

import heapq
import json
import math
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import cycle, islice, pairwise
from typing import Any

import numpy as np

from autotune.core.records import RequestRecord, WindowCallback
from autotune.sim.config import EngineConfig, EngineSetup, resolve
from autotune.sim.costmodel import CostModel
from autotune.sim.frontend import FrontEnd, FrontEndCosts
from autotune.sim.profiles import HardwareProfile, ModelProfile, load_hardware, load_model
from autotune.sim.scheduler import DECODE, Plan, Scheduler, Seq
from autotune.workload.arrivals import conversation_order
from autotune.workload.sources import Request

ABORTED = "aborted: pruned"


@dataclass(frozen=True)
class TimelinePoint:
    """Engine state over one window of virtual time (simulated)."""

    time_s: float  # end of the window
    running: int  # at the end of the window
    waiting: int
    kv_usage: float  # time-weighted mean over the window, 0..1
    busy_fraction: float  # GPU-busy share of the window ("GPU utilisation"), 0..1


@dataclass
class SimResult:
    """Records plus engine statistics of one simulated load test (all **simulated**)."""

    records: list[RequestRecord]
    aborted: bool
    preemptions: int  # over the measured window
    steps: int  # engine steps over the measured window
    busy_fraction: float  # GPU-busy share of the measured window
    kv_usage_mean: float  # time-weighted mean over the measured window, 0..1
    kv_usage_max: float
    timeline: list[TimelinePoint]
    kv_capacity_tokens: int  # "GPU KV cache size: N tokens"
    max_concurrency: float  # "Maximum concurrency for M tokens per request: X.XXx"
    window_start_s: float  # measured window: first measured request's send time
    window_end_s: float  # ... to the last measured request's end
    setup: EngineSetup
    total_steps: int = 0
    total_preemptions: int = 0
    # Front-end CPU over the measured window per API server, 0..1 (above 1 its backlog
    # grows); 0 when the profile gives the front end no cost.
    frontend_busy_fraction: float = 0.0
    # Prefix caching, over the whole run (warm-up included), in prompt tokens as vLLM's
    # vllm:prefix_cache_queries and vllm:prefix_cache_hits count them: a request's tokens
    # and its cached ones, at its first admission (0 and 0 with caching off).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    simulated: bool = True
    notes: list[str] = field(default_factory=list)

    def stats_dict(self) -> dict[str, Any]:
        """Engine statistics (no records), JSON-ready, labelled simulated."""
        s = self.setup
        return {
            "simulated": True,
            "aborted": self.aborted,
            "preemptions": self.preemptions,
            "steps": self.steps,
            "busy_fraction": self.busy_fraction,
            "kv_usage_mean": self.kv_usage_mean,
            "kv_usage_max": self.kv_usage_max,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_concurrency": self.max_concurrency,
            "window_start_s": self.window_start_s,
            "window_end_s": self.window_end_s,
            "total_steps": self.total_steps,
            "total_preemptions": self.total_preemptions,
            "frontend_busy_fraction": self.frontend_busy_fraction,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "engine": {
                "model": s.model.name,
                "hardware": s.hardware.label,
                "tensor_parallel_size": s.tensor_parallel_size,
                "max_num_seqs": s.max_num_seqs,
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "enable_chunked_prefill": s.enable_chunked_prefill,
                "enable_prefix_caching": s.enable_prefix_caching,
                "max_model_len": s.max_model_len,
                "num_gpu_blocks": s.num_gpu_blocks,
                "api_server_count": s.api_server_count,
            },
            "timeline": [asdict(p) for p in self.timeline],
            "notes": list(self.notes),
        }


def request_problem(prompt: int, output: int, max_model_len: int) -> str | None:
    """vLLM's 400 message for a request it rejects, or None when it is acceptable."""
    if output < 1:
        return f"max_tokens must be at least 1, got {output}."
    if prompt + output > max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt + output} tokens ({prompt} in the messages, {output} in the "
            "completion). Please reduce the length of the messages or completion."
        )
    return None


def error_body(message: str, code: int = 400) -> str:
    """vLLM's JSON error body (``ErrorResponse``)."""
    return json.dumps({"object": "error", "message": message, "type": "BadRequestError",
                       "param": None, "code": code})


class _Steps:
    """Per-step records in step order: end time, duration, GPU time, KV blocks in use and,
    with the front end modelled, when the client has the step's tokens; also the queue
    sizes and cumulative preemptions after each step.

    Python arrays, not numpy ones: the loop appends a step at a time, which costs a numpy
    array far more (and numpy's stretches go in as raw bytes).  The queue figures change
    at few steps, so they are kept as runs.  :meth:`arrays` gives numpy views at the end.
    """

    def __init__(self) -> None:
        self.end = array("d")
        self.dur = array("d")
        self.gpu = array("d")
        self.used = array("q")
        self.seen = array("d")  # filled only when the front end is modelled
        # Runs, flat: first step, running, waiting, cumulative preemptions from that step on.
        self._runs = array("q")
        self._state = (-1, -1, -1)

    @property
    def n(self) -> int:
        return len(self.end)

    def state_from(self, i: int, state: tuple[int, int, int]) -> None:
        """Steps from ``i`` on leave (running, waiting, cumulative preemptions) = ``state``."""
        if state != self._state:
            self._runs.append(i)
            self._runs.extend(state)
            self._state = state

    def add(self, end: float, dur: float, gpu: float, used: int,
            state: tuple[int, int, int], seen: float | None = None) -> None:
        self.state_from(len(self.end), state)
        self.end.append(end)
        self.dur.append(dur)
        self.gpu.append(gpu)
        self.used.append(used)
        if seen is not None:
            self.seen.append(seen)

    def add_many(self, end: np.ndarray, dur: np.ndarray, gpu: np.ndarray, used: np.ndarray,
                 state: tuple[int, int, int], seen: np.ndarray | None = None) -> None:
        """Steps computed by numpy (float64 arrays of one length; ``used`` integers)."""
        self.state_from(len(self.end), state)
        self.end.frombytes(end.tobytes())
        self.dur.frombytes(dur.tobytes())
        self.gpu.frombytes(gpu.tobytes())
        self.used.frombytes(used.astype(np.int64, copy=False).tobytes())
        if seen is not None:
            self.seen.frombytes(seen.tobytes())

    def arrays(self) -> _StepArrays:
        """The records as numpy arrays (views: append no more steps after this)."""
        n = self.n
        runs = np.frombuffer(self._runs, dtype=np.int64).reshape(-1, 4)
        lengths = np.diff(np.append(runs[:, 0], n))
        running, waiting, preempt = (np.repeat(runs[:, c], lengths) for c in (1, 2, 3))
        return _StepArrays(
            end=np.frombuffer(self.end, dtype=np.float64),
            dur=np.frombuffer(self.dur, dtype=np.float64),
            gpu=np.frombuffer(self.gpu, dtype=np.float64),
            used=np.frombuffer(self.used, dtype=np.int64),
            running=running, waiting=waiting, preempt=preempt,
        )


@dataclass(frozen=True)
class _StepArrays:
    """:class:`_Steps` as numpy arrays, one entry per step."""

    end: np.ndarray
    dur: np.ndarray
    gpu: np.ndarray
    used: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    preempt: np.ndarray  # cumulative

    @property
    def n(self) -> int:
        return len(self.end)


def _as_hardware(hardware: HardwareProfile | str) -> HardwareProfile:
    return load_hardware(hardware) if isinstance(hardware, str) else hardware


def _as_model(model: ModelProfile | str | None, config: EngineConfig) -> ModelProfile:
    if model is None:
        return load_model(config.model)
    return load_model(model) if isinstance(model, str) else model


class _Run:
    """State of one simulation; ``simulate`` is its only user."""

    def __init__(self, setup: EngineSetup, requests: Sequence[Request], arrivals: np.ndarray,
                 warmup: int, max_concurrency: int | None, on_window: WindowCallback | None,
                 window_s: float, think_s: np.ndarray | None = None) -> None:
        self.setup = setup
        self.cost = CostModel.for_setup(setup)
        self.sched = Scheduler.for_setup(setup)
        costs = FrontEndCosts.for_setup(setup)
        # None: the front end costs nothing, and the engine runs as if it did not exist.
        self.fe = FrontEnd(costs) if costs.active else None
        self.requests = requests
        # Python lists: the loop reads them one element at a time (numpy scalars are slow).
        # Open loop: sends in arrival order, fixed in advance.  Closed loop (``think``):
        # each user's next send is known only once its request ends, so pending sends are
        # a heap of (time, user); the arrival source is chosen here, once, so the open
        # loop's path stays as it was.  A closed-loop user sends a conversation's turns in
        # order (``next_turn``), then takes the next conversation no user has started
        # (``firsts[next_conv]``); ``user_next`` is what each user sends next (-1: a new
        # conversation, taken when it sends).
        self.closed = think_s is not None
        self.think: list[float] = [] if think_s is None else think_s.tolist()
        self.dispatch_until: Callable[[float], None]
        if not self.closed:
            order = np.argsort(arrivals, kind="stable")
            self.order: list[int] = order.tolist()
            self.arrival_times: list[float] = arrivals[order].tolist()
            self.pending: list[tuple[float, int]] = []
            self.dispatch_until = self._dispatch_until
        else:
            self.order, self.arrival_times = [], []
            self.pending = [(t, u) for u, t in enumerate(arrivals.tolist())]
            heapq.heapify(self.pending)
            self.dispatch_until = self._dispatch_closed_until
        self.user_of: list[int] = [0] * len(requests) if self.closed else []
        self.firsts, self.next_turn = _conversations(requests) if self.closed else ([], [])
        self.next_conv = 0
        self.user_next: list[int] = [-1] * len(arrivals) if self.closed else []
        self.warmup = warmup
        self.max_concurrency = max_concurrency
        self.on_window = on_window
        self.window_s = window_s
        self.steps = _Steps()
        self.records: list[RequestRecord | None] = [None] * len(requests)
        self.seqs: dict[int, Seq] = {}  # sent and not yet ended, as the client sees it
        self.flushed: dict[int, int] = {}  # rid -> tokens already in chunk_times_s
        self.measured: list[RequestRecord] = []
        self.gated: deque[int] = deque()
        self.inflight = 0
        self.next_arrival = 0  # open loop: position in self.order; closed: requests sent
        # When the next send comes (inf: none pending); the loop and the decode stretches
        # stop there, so it is always the earliest pending send.
        self.t_arrival = self._closed_time() if self.closed else self._arrival_time()
        self.next_boundary = window_s if on_window is not None else float("inf")
        self.aborted = False
        # Front end only: requests it is taking in, (time the scheduler sees it, rid) ...
        self.handover: list[tuple[float, int]] = []
        self.in_front: set[int] = set()
        # ... and ends on their way to the client, (time the client has it, rid).
        self.delivery: list[tuple[float, int]] = []

    # ---- the client side: dispatch, concurrency gate, send, completion ---------------
    def _arrival_time(self) -> float:
        if self.next_arrival >= len(self.order):
            return math.inf
        return self.arrival_times[self.next_arrival]

    def _closed_time(self) -> float:
        """Closed loop: the earliest pending send (inf when none, or no request is left)."""
        if self.next_arrival >= len(self.requests) or not self.pending:
            return math.inf
        return self.pending[0][0]

    def _client_until(self, t: float) -> None:
        """Apply the client's events up to ``t``: arrivals and, with a front end, the ends
        it delivers, in time order (an end frees its slot before a same-time arrival)."""
        if self.fe is None:
            self.dispatch_until(t)
            return
        delivery = self.delivery
        while True:
            ta = self.t_arrival
            td = delivery[0][0] if delivery else math.inf
            if td <= ta and td <= t:
                _, i = heapq.heappop(delivery)
                self._deliver(i, td)
            elif ta <= t:
                self.dispatch_until(ta)
            else:
                return

    def _dispatch_until(self, t: float) -> None:
        while self.t_arrival <= t and self.next_arrival < len(self.order):
            at = self.t_arrival
            i = self.order[self.next_arrival]
            self.next_arrival += 1
            self.t_arrival = self._arrival_time()
            self._record(i, at)
            if self.max_concurrency is not None and self.inflight >= self.max_concurrency:
                self.gated.append(i)
            else:
                self._send(i, at)

    def _dispatch_closed_until(self, t: float) -> None:
        """Closed loop: send, in time order, every request whose user sends it by ``t``:
        its conversation's next turn, or the first turn of the next conversation no user
        has started.  No gate: a user has one request in flight."""
        pending, firsts, user_next = self.pending, self.firsts, self.user_next
        while self.t_arrival <= t:
            at, user = heapq.heappop(pending)
            i = user_next[user]
            if i < 0:
                i = firsts[self.next_conv]
                self.next_conv += 1
                if self.next_conv == len(firsts):
                    # Users waiting to start a conversation have none left to start;
                    # their sends must not stop the engine's stretches.
                    pending[:] = [(a, u) for a, u in pending if user_next[u] >= 0]
                    heapq.heapify(pending)
            self.next_arrival += 1
            # Before the send: a refusal ends at once and may push an earlier send.
            self.t_arrival = pending[0][0] if pending else math.inf
            self.user_of[i] = user
            self._record(i, at)
            self._send(i, at)

    def _record(self, i: int, at: float) -> None:
        """The record of request ``i``, scheduled (and dispatched) at ``at``."""
        # Same conventions as the HTTP load generator: measured requests are numbered
        # from 0 (warm-up ones negative); token counts arrive with the usage chunk.
        rec = RequestRecord(
            index=i - self.warmup, scheduled_s=at, dispatched_s=at,
            expected_output_tokens=self.requests[i].output_tokens, warmup=i < self.warmup,
        )
        self.records[i] = rec
        if not rec.warmup:
            self.measured.append(rec)

    def _send(self, i: int, t: float) -> None:
        rec = self.records[i]
        assert rec is not None
        rec.sent_s = t
        self.inflight += 1
        req = self.requests[i]
        problem = request_problem(req.prompt_tokens, req.output_tokens, self.setup.max_model_len)
        if problem is not None:
            rec.status = 400
            rec.error = f"http 400: {' '.join(error_body(problem).split())[:300]}"
            if self.fe is not None:
                # The front end tokenises the prompt before it can refuse it.
                heapq.heappush(self.delivery, (self.fe.take_request(t), i))
                return
            rec.end_s = t
            self._release_slot(i, t)
            return
        rec.status = 200
        seq = Seq(rid=i, prompt_tokens=req.prompt_tokens, max_output=req.output_tokens,
                  prefix=req.prefix)
        self.seqs[i] = seq
        self.flushed[i] = 0
        if self.fe is None:
            self.sched.add(seq)
        else:
            heapq.heappush(self.handover, (self.fe.take_request(t), i))
            self.in_front.add(i)

    def _handover_until(self, t: float) -> None:
        """Requests the front end has taken in by ``t`` join the scheduler's queue."""
        handover = self.handover
        while handover and handover[0][0] <= t:
            _, i = heapq.heappop(handover)
            self.in_front.discard(i)
            self.sched.add(self.seqs[i])

    def _release_slot(self, i: int, t: float) -> None:
        """The client has seen request ``i`` end at ``t`` (whatever the ending)."""
        self.inflight -= 1
        if self.closed:
            self._user_next(i, t)
            return
        while self.gated and (self.max_concurrency is None
                              or self.inflight < self.max_concurrency):
            self._send(self.gated.popleft(), t)

    def _user_next(self, i: int, t: float) -> None:
        """Closed loop: request ``i``'s user sends again after its think time: the next
        turn of its conversation, else a conversation no user has started, if any."""
        turn = self.next_turn[i]
        if turn < 0 and self.next_conv >= len(self.firsts):
            return
        user = self.user_of[i]
        self.user_next[user] = turn
        at = t + self.think[i]
        heapq.heappush(self.pending, (at, user))
        # It may come before every pending send, and the loop and the stretches stop at
        # ``t_arrival``.  It never comes before the start of a step already taken, so no
        # step ran without seeing it: without a front end, a decode stretch stops short
        # of the step in which a sequence finishes (``decode_stretch_limit``), so a
        # finish comes at the engine's time, and a refusal at its own send, which
        # stretches stop before; with one, stretches also stop before the send each end
        # still on its way to the client leads to (``_front_stretch_event``).  At worst
        # it falls inside the step just taken, as an open-loop arrival may.
        if at < self.t_arrival:
            self.t_arrival = at

    # ---- token times --------------------------------------------------------------
    def _flush(self, seq: Seq, rec: RequestRecord, upto: float = math.inf) -> None:
        """Append to ``rec.chunk_times_s`` every token the client has by ``upto``: with
        no front end, every token the engine produced so far."""
        ranges = list(seq.segments)
        if seq.state == DECODE:
            ranges.append((seq.seg_start, self.sched.step - 1))
        done = self.flushed[seq.rid]
        skip = done
        times = self.steps.end if self.fe is None else self.steps.seen
        for a, b in ranges:
            n = b - a + 1
            if skip >= n:
                skip -= n
                continue
            lo = a + skip
            if upto < times[b]:  # the front end has not sent them all yet (times ascend)
                cut = bisect_right(times, upto, lo, b + 1)
                rec.chunk_times_s.extend(times[lo:cut].tolist())
                done += cut - lo
                break
            rec.chunk_times_s.extend(times[lo: b + 1].tolist())
            done += n - skip
            skip = 0
        self.flushed[seq.rid] = done
        if self.fe is not None and rec.first_token_s is None and rec.chunk_times_s:
            rec.first_token_s = rec.chunk_times_s[0]

    def _finish(self, seq: Seq, t: float) -> None:
        rec = self.records[seq.rid]
        assert rec is not None
        self._flush(seq, rec)
        rec.output_tokens = len(rec.chunk_times_s)
        rec.end_s = t
        rec.prompt_tokens = seq.prompt_tokens
        del self.seqs[seq.rid]
        self._release_slot(seq.rid, t)

    def _deliver(self, i: int, t: float) -> None:
        """Front end: at ``t`` the client has request ``i``'s last chunk (or its 400)."""
        seq = self.seqs.get(i)
        if seq is not None:
            self._finish(seq, t)
            return
        rec = self.records[i]
        assert rec is not None
        rec.end_s = t
        self._release_slot(i, t)

    # ---- windows --------------------------------------------------------------------
    def _fire_windows(self, until: float) -> None:
        """Call the window callback at every boundary <= ``until`` (engine is between steps)."""
        while self.next_boundary <= until and not self.aborted:
            b = self.next_boundary
            self._client_until(b)
            upto = b if self.fe is not None else math.inf
            for seq in self.seqs.values():
                rec = self.records[seq.rid]
                assert rec is not None
                self._flush(seq, rec, upto)
            assert self.on_window is not None
            # As the load generator: no call before the first measured request is sent.
            if self.measured and self.on_window(b, list(self.measured)):
                self._abort(b)
            self.next_boundary += self.window_s

    def _abort(self, t: float) -> None:
        self.aborted = True
        upto = t if self.fe is not None else math.inf
        for seq in list(self.seqs.values()):
            rec = self.records[seq.rid]
            assert rec is not None
            self._flush(seq, rec, upto)
            rec.error = ABORTED
            rec.end_s = t
            if seq.rid not in self.in_front:
                self.sched.abort(seq)
        self.seqs.clear()
        for _, i in self.delivery:  # refusals the front end had not sent yet
            rec = self.records[i]
            if rec is not None and rec.end_s is None:
                rec.end_s = t
        self.delivery.clear()
        self.handover.clear()
        self.in_front.clear()
        for i in self.gated:
            rec = self.records[i]
            assert rec is not None
            rec.error = ABORTED
            rec.end_s = t
        self.gated.clear()

    # ---- the engine loop ------------------------------------------------------------
    def _front_event_time(self) -> float:
        """Front end: the next hand-over to the scheduler or end delivered to a client."""
        t = self.handover[0][0] if self.handover else math.inf
        return min(t, self.delivery[0][0]) if self.delivery else t

    def run(self) -> float:
        """Run the load test; the virtual time it ends."""
        return self._run_plain() if self.fe is None else self._run_front()

    def _state(self) -> tuple[int, int, int]:
        """What a step records of the queues: (running, waiting, cumulative preemptions)."""
        sched = self.sched
        return len(sched.running), len(sched.waiting), sched.num_preemptions

    def _scheduled_step(self) -> tuple[Plan, float, float]:
        """The scheduler's next step and its (total, GPU) seconds."""
        plan = self.sched.schedule()
        if plan.tokens == 0:
            raise RuntimeError("simulator scheduled an empty step (scheduler bug)")
        total_s, gpu_s = self.cost.step_s(plan.tokens, plan.seqs, plan.kv_tokens, plan.pairs)
        return plan, total_s, gpu_s

    def _run_plain(self) -> float:
        """The engine loop with no front end: clients talk to the scheduler directly."""
        sched, steps, records = self.sched, self.steps, self.records
        now = 0.0
        while not self.aborted:
            if self.t_arrival <= now:
                self.dispatch_until(now)
            if sched.idle:
                t_next = self.t_arrival
                if t_next == math.inf:
                    break
                self._fire_windows(t_next)
                now = t_next
                continue
            k = sched.decode_stretch_limit()
            if k >= 2:
                end = self._stretch(now, k)
                if end is not None:
                    now = end
                    continue
            plan, total_s, gpu_s = self._scheduled_step()
            end = now + total_s
            if self.next_boundary < end:
                self._fire_windows_before(end)
                if self.aborted:
                    break
            now = end
            started, finished = sched.complete(plan)
            steps.add(now, total_s, gpu_s, sched.used_blocks, self._state())
            for seq in started:
                rec = records[seq.rid]
                if rec is not None and rec.first_token_s is None:
                    rec.first_token_s = now
            for seq in finished:
                self._finish(seq, now)
        return now

    def _run_front(self) -> float:
        """The engine loop with the front end as a stage before and after the engine."""
        sched, steps, fe = self.sched, self.steps, self.fe
        assert fe is not None
        delivery, handover = self.delivery, self.handover
        now = 0.0
        while not self.aborted:
            # The calls only when due: most iterations have nothing to apply.
            if self.t_arrival <= now or (delivery and delivery[0][0] <= now):
                self._client_until(now)
            if handover and handover[0][0] <= now:
                self._handover_until(now)
            if sched.idle:
                t_next = min(self.t_arrival, self._front_event_time())
                if t_next == math.inf:
                    break
                self._fire_windows(t_next)
                fe.idle(t_next - now)
                now = t_next
                continue
            k = sched.decode_stretch_limit()
            if k >= 2:
                end = self._front_stretch(now, k)
                if end is not None:
                    now = end
                    continue
            plan, total_s, gpu_s = self._scheduled_step()
            step_s = total_s + fe.step_extra(total_s)
            end = now + step_s
            self._fire_windows_before(end)
            if self.aborted:
                break
            # What the client did during the step reaches the front end before the
            # step's tokens do (the front end works in time order).
            self._client_until(end)
            now = end
            started, finished = sched.complete(plan)
            # Each decoding sequence and each one whose prefill ended produced one token.
            seen_s = fe.emit(now, plan.num_decode + len(started))
            steps.add(now, step_s, gpu_s, sched.used_blocks, self._state(), seen_s)
            for seq in finished:
                heapq.heappush(self.delivery, (seen_s, seq.rid))
        return now

    # ---- decode stretches (no front end) ----------------------------------------------
    # A stretch is costed as ``decode_steps`` does it, either in numpy or one step at a
    # time in plain Python (the same operations, so the same floats): a numpy call costs
    # about a microsecond whatever its size, so short stretches, common at low load where
    # the next arrival or finish is a few steps away, are cheaper in Python.  Which one
    # runs changes only the speed (measured: 16 suits 2 to 100 req/s).
    SCALAR_STEPS = 16  # stretches expected to stop within this many steps go step by step

    def _stretch(self, now: float, k: int) -> float | None:
        """Apply the longest prefix of the next ``k`` decode-only steps that fits the free
        KV blocks, starts before the next arrival and ends by the next window boundary.

        Returns the time it ends, or None when no step was applied: fewer than 2 steps
        fit the blocks (then ``schedule`` takes the step, preempting as it must), or the
        first step would start after the next arrival or end past the next boundary.
        """
        # Expected length: up to the heap's finish, or the next event at the last step's pace.
        pace = self.steps.dur[-1] if self.steps.n else 0.0
        event = min(self.t_arrival, self.next_boundary)
        if k <= self.SCALAR_STEPS or event - now < self.SCALAR_STEPS * pace:
            return self._stretch_scalar(now, k)
        return self._stretch_vector(now, k)

    def _stretch_vector(self, now: float, k: int) -> float | None:
        """``_stretch`` in numpy."""
        sched = self.sched
        k, needs = sched.decode_stretch_blocks(k)
        if k < 2:
            return None
        tot, gpu = self.cost.decode_steps(sched.num_decode, sched.decode_kv0(), k)
        ends = np.add.accumulate(tot)  # cumsum, without its wrapper's overhead
        ends += now
        last = float(ends[-1])
        # Steps start no later than they end, and ends ascend: a search is needed only
        # when the event falls inside the stretch (else it would return k anyway).
        if self.t_arrival <= last:
            k = int((ends - tot).searchsorted(self.t_arrival, side="left"))
        if self.next_boundary < last:
            k = min(k, int(ends.searchsorted(self.next_boundary, side="right")))
        if k < 1:
            return None
        used = needs[:k].cumsum()
        used += sched.used_blocks
        self.steps.add_many(ends[:k], tot[:k], gpu[:k], used, self._state())
        sched.advance_decode(k, int(used[-1]) - sched.used_blocks)
        return float(ends[k - 1])

    def _stretch_scalar(self, now: float, k: int) -> float | None:
        """``_stretch`` one step at a time: stops at the first step that does not fit.

        Step starts and ends ascend (each step lasts far longer than a rounding step of
        the clock), so stopping there gives what the searches in numpy give.
        """
        sched, steps = self.sched, self.steps
        blocks = sched.block_cycle()
        free = sched.free_blocks
        if blocks[0] + blocks[1 % len(blocks)] > free:
            return None  # fewer than 2 steps fit the blocks: not a stretch
        t_arrival, t_window = self.t_arrival, self.next_boundary
        used0 = sched.used_blocks
        first = steps.n
        add_end, add_dur = steps.end.append, steps.dur.append
        add_gpu, add_used = steps.gpu.append, steps.used.append
        elapsed = end = 0.0
        alloc = n = 0
        decodes = self.cost.decode_step_iter(sched.num_decode, sched.decode_kv0())
        for (tot, gpu), need in zip(islice(decodes, k), cycle(blocks)):
            elapsed += tot
            t = now + elapsed  # as numpy's cumsum, then + now
            if t - tot >= t_arrival or t > t_window or alloc + need > free:
                break
            alloc += need
            add_end(t)
            add_dur(tot)
            add_gpu(gpu)
            add_used(used0 + alloc)
            end = t
            n += 1
        if n == 0:
            return None
        steps.state_from(first, self._state())
        sched.advance_decode(n, alloc)
        return end

    # ---- decode stretches (front end) -----------------------------------------------
    # As without a front end: numpy for long stretches, one step at a time for short ones,
    # the same arithmetic either way (``FrontEnd.stretch`` / ``FrontEnd.stretch_steps``).
    def _front_stretch(self, now: float, k: int) -> float | None:
        """Front end: apply the longest prefix of the next ``k`` decode-only steps that
        fits the free KV blocks, starts before the next event that may change the batch
        or give the front end work, and ends by the next window boundary.

        Returns the time it ends, or None when no step was applied (``schedule`` takes
        the step then): fewer than 2 steps fit the blocks, or the first step would start
        after that event or end past the boundary.
        """
        pace = self.steps.dur[-1] if self.steps.n else 0.0
        event = min(self._front_stretch_event(), self.next_boundary)
        if k <= self.SCALAR_STEPS or event - now < self.SCALAR_STEPS * pace:
            return self._front_stretch_scalar(now, k)
        return self._front_stretch_vector(now, k)

    def _front_stretch_vector(self, now: float, k: int) -> float | None:
        """``_front_stretch`` in numpy."""
        fe, sched, steps = self.fe, self.sched, self.steps
        assert fe is not None
        k, needs = sched.decode_stretch_blocks(k)
        if k < 2:
            return None
        r = sched.num_decode
        tot, gpu = self.cost.decode_steps(r, sched.decode_kv0(), k)
        # The engine's own step times bound the stretch (the front end only lengthens
        # steps): price the front end over that prefix alone.
        k = self._front_stretch_limit(np.add.accumulate(tot) + now, tot)
        if k < 1:
            return None
        stretch = fe.stretch(now, tot[:k], r)
        k = min(k, self._front_stretch_limit(stretch.end, stretch.dur))
        if k < 1:
            return None
        used = needs[:k].cumsum() + sched.used_blocks
        steps.add_many(stretch.end[:k], stretch.dur[:k], gpu[:k], used, self._state(),
                       stretch.seen[:k])
        sched.advance_decode(k, int(used[-1] - sched.used_blocks))
        if k > 1:
            fe.apply(stretch, k - 1, r)
        return self._front_stretch_last(float(tot[k - 1]), float(stretch.end[k - 1]), r)

    def _front_stretch_scalar(self, now: float, k: int) -> float | None:
        """``_front_stretch`` one step at a time: stops at the first step that does not
        fit, as the searches in numpy do (step starts and ends ascend)."""
        fe, sched, steps = self.fe, self.sched, self.steps
        assert fe is not None
        blocks = sched.block_cycle()
        free = sched.free_blocks
        if blocks[0] + blocks[1 % len(blocks)] > free:
            return None  # fewer than 2 steps fit the blocks: not a stretch
        r = sched.num_decode
        event, t_window = self._front_stretch_event(), self.next_boundary
        used0, first = sched.used_blocks, steps.n
        add_end, add_dur, add_seen = steps.end.append, steps.dur.append, steps.seen.append
        add_gpu, add_used = steps.gpu.append, steps.used.append
        decodes = islice(self.cost.decode_step_iter(r, sched.decode_kv0()), k)
        # The engine's own time: the bound ``_front_stretch_vector`` applies first.  Its
        # window test is left out: a step ends no earlier with the front end's debt.
        elapsed = 0.0
        alloc = n = 0
        last_base = last_end = debt_before = last_debt = 0.0
        for (base, gpu, dur, end, seen, debt), need in zip(
                fe.stretch_steps(now, decodes, r), cycle(blocks)):
            elapsed += base
            if (elapsed + now - base >= event or end - dur >= event or end > t_window
                    or alloc + need > free):
                break
            alloc += need
            add_end(end)
            add_dur(dur)
            add_gpu(gpu)
            add_used(used0 + alloc)
            add_seen(seen)
            last_base, last_end, debt_before, last_debt = base, end, last_debt, debt
            n += 1
        if n == 0:
            return None
        steps.state_from(first, self._state())
        sched.advance_decode(n, alloc)
        if n > 1:
            fe.commit(steps.seen[-2], debt_before, n - 1, r)
        return self._front_stretch_last(last_base, last_end, r)

    def _front_stretch_last(self, base: float, end: float, r: int) -> float:
        """Settle a stretch's last step (engine time ``base``, ending at ``end``): it may
        straddle a client event, whose work reaches the front end before that step's
        tokens do, so its tokens are priced after the event.  Returns ``end``."""
        fe, steps = self.fe, self.steps
        assert fe is not None
        fe.step_extra(base)  # the debt it pays (its duration above)
        if self.t_arrival <= end or (self.delivery and self.delivery[0][0] <= end):
            self._client_until(end)
        steps.seen[steps.n - 1] = fe.emit(end, r)
        return end

    def _front_stretch_event(self) -> float:
        """Front end: a stretch's steps start before this: the next hand-over (the
        scheduler may admit it) or client event that gives the front end work (an
        arrival, an end that lets a gated request go, or in a closed loop the send an
        end leads to after its think time)."""
        event = self.t_arrival
        if self.delivery:
            if self.max_concurrency is not None:
                event = min(event, self.delivery[0][0])
            elif self.closed and self.next_arrival < len(self.requests):
                # Few ends are on their way at once: a scan costs less than a heap of sends.
                think = self.think
                event = min(event, min(td + think[i] for td, i in self.delivery))
        if self.handover:
            event = min(event, self.handover[0][0])
        return event

    def _front_stretch_limit(self, ends: np.ndarray, dur: np.ndarray) -> int:
        """Front end: how many steps of a decode stretch may run in one go (they start
        before ``_front_stretch_event`` and end by the next window)."""
        event = self._front_stretch_event()
        k = len(ends)
        last = float(ends[-1])
        # As in ``_stretch_vector``: a search only when the event falls inside the stretch.
        if event <= last:
            k = int((ends - dur).searchsorted(event, side="left"))
        if self.next_boundary < last:
            k = min(k, int(ends.searchsorted(self.next_boundary, side="right")))
        return k

    def _fire_windows_before(self, end: float) -> None:
        # A boundary inside the coming step sees the state before it (steps are atomic).
        while self.next_boundary < end and not self.aborted:
            self._fire_windows(self.next_boundary)


def _conversations(requests: Sequence[Request]) -> tuple[list[int], list[int]]:
    """A closed loop's conversations, grouped as the HTTP load generator groups them
    (``workload.arrivals.conversation_order``): the first turn of each, in order, and
    each request's next turn (-1: its conversation's last)."""
    n = len(requests)
    if all(r.conversation is None for r in requests):
        return list(range(n)), [-1] * n
    groups = conversation_order(requests)
    next_turn = [-1] * n
    for group in groups:
        for a, b in pairwise(group):
            next_turn[a] = b
    return [group[0] for group in groups], next_turn


def _stats(run: _Run, end_time: float) -> SimResult:
    setup, st = run.setup, run.steps.arrays()
    n = st.n
    end, dur, gpu = st.end, st.dur, st.gpu
    used, cum_pre = st.used, st.preempt
    measured = [r for r in run.records if r is not None and not r.warmup]
    if measured:
        # The same window as metrics.summarize: first measured send to last completion.
        t0 = min((r.sent_s for r in measured if r.sent_s is not None),
                 default=min(r.scheduled_s for r in measured))
        t1 = max((r.end_s for r in measured if r.end_s is not None), default=end_time)
    else:
        t0, t1 = 0.0, end_time
    t1 = max(t1, t0)
    lo = int(np.searchsorted(end, t0, side="right"))
    hi = int(np.searchsorted(end, t1, side="right"))
    span = t1 - t0
    nblocks = max(setup.num_gpu_blocks, 1)
    if hi > lo and span > 0:
        busy = float(gpu[lo:hi].sum() / span)
        kv_mean = float((used[lo:hi] * dur[lo:hi]).sum() / span / nblocks)
        kv_max = float(used[lo:hi].max() / nblocks)
        pre = int(cum_pre[hi - 1] - (cum_pre[lo - 1] if lo > 0 else 0))
    else:
        busy = kv_mean = kv_max = 0.0
        pre = 0
    timeline = _timeline(st, run.window_s, end_time, nblocks)
    fe_busy = _frontend_busy(run, measured, span)
    cache = run.sched.prefix_cache
    notes = []
    if fe_busy >= 0.95:
        notes.append(f"the API server front end was busy {fe_busy:.0%} of the measured "
                     f"window with {setup.api_server_count} server(s): it limits "
                     "throughput (more --api-server-count, or cheaper front-end work)")
    return SimResult(
        records=[r for r in run.records if r is not None],
        aborted=run.aborted,
        preemptions=pre,
        steps=hi - lo,
        busy_fraction=min(busy, 1.0),
        kv_usage_mean=min(kv_mean, 1.0),
        kv_usage_max=kv_max,
        timeline=timeline,
        kv_capacity_tokens=setup.kv_capacity_tokens,
        max_concurrency=setup.max_concurrency,
        window_start_s=t0,
        window_end_s=t1,
        setup=setup,
        total_steps=n,
        total_preemptions=int(cum_pre[-1]) if n else 0,
        frontend_busy_fraction=fe_busy,
        prefix_cache_queries=cache.queries if cache is not None else 0,
        prefix_cache_hits=cache.hits if cache is not None else 0,
        notes=notes,
    )


def _frontend_busy(run: _Run, measured: list[RequestRecord], span: float) -> float:
    """The front end's CPU for the measured requests over what its servers can give in
    the measured window (0 when the front end is not modelled)."""
    if run.fe is None or span <= 0:
        return 0.0
    c = run.fe.costs
    work = sum(c.request_s + c.token_s * len(r.chunk_times_s)
               for r in measured if r.sent_s is not None)
    return work / (c.servers * span)


def _timeline(st: _StepArrays, window_s: float, end_time: float,
              nblocks: int) -> list[TimelinePoint]:
    n = st.n
    if n == 0 or end_time <= 0:
        return []
    nbins = int(np.ceil(end_time / window_s))
    end = st.end
    idx = np.minimum((end / window_s).astype(np.int64), nbins - 1)
    # A step ending exactly on an edge belongs to the window it ends
    idx = np.where((idx > 0) & (end == idx * window_s), idx - 1, idx)
    busy = np.bincount(idx, weights=st.gpu, minlength=nbins)
    kvw = np.bincount(idx, weights=st.used * st.dur, minlength=nbins)
    edges = window_s * np.arange(1, nbins + 1)
    last = np.searchsorted(end, edges, side="right") - 1
    before = last < 0  # no step has ended yet: empty queues
    running = np.where(before, 0, st.running[last])
    waiting = np.where(before, 0, st.waiting[last])
    kv_usage = np.minimum(kvw / window_s / nblocks, 1.0)
    busy_fraction = np.minimum(busy / window_s, 1.0)
    columns = (edges, running, waiting, kv_usage, busy_fraction)  # TimelinePoint's fields
    return list(map(TimelinePoint, *(c.tolist() for c in columns)))


def simulate(
    config: EngineConfig,
    hardware: HardwareProfile | str,
    model: ModelProfile | str | None,
    requests: Sequence[Request],
    arrivals: Sequence[float] | np.ndarray,
    *,
    warmup: int = 0,
    max_concurrency: int | None = None,
    on_window: WindowCallback | None = None,
    window_s: float = 1.0,
    think_s: Sequence[float] | np.ndarray | None = None,
) -> SimResult:
    """Run one load test in virtual time; every figure in the result is **simulated**.

    Open loop (``think_s=None``): ``requests[i]`` is sent at ``arrivals[i]`` seconds
    (only its token counts matter); the first ``warmup`` requests are warm-up.
    ``max_concurrency`` caps requests in flight as the load generator does.

    Closed loop (``think_s`` given, one think time per request): ``arrivals`` are the
    first sends of ``len(arrivals)`` virtual users (any number >= 1).  A user sends one
    conversation's turns in order (``Request.conversation``, by ``turn``; a request
    without one is a conversation of one turn): when the client sees request ``i`` end at
    ``t`` (finished, or refused with a 400) its user sends its conversation's next turn at
    ``t + think_s[i]``, or, after the last turn, the first turn of the next conversation
    no user has started (conversations in the order of their first request in
    ``requests``), until every request has been sent.  Without conversations the k-th
    send is ``requests[k]``.  Warm-up requests are the first ``warmup`` of ``requests``.
    A record's ``scheduled_s``, ``dispatched_s`` and ``sent_s`` are that send.  Each user
    has one request in flight, so ``max_concurrency`` must be None.

    ``on_window(now, measured_records)`` is called at every ``window_s`` boundary of
    virtual time; returning True aborts the test (nothing is sent after it) and marks
    the requests in flight with error ``"aborted: pruned"``.  ``model=None`` loads
    ``config.model``.  Raises :class:`~autotune.sim.config.ConfigRefused` when vLLM would
    refuse to start, ValueError on inconsistent arguments.
    """
    arr = np.asarray(arrivals, dtype=np.float64)
    think: np.ndarray | None = None
    if think_s is None:
        if arr.shape != (len(requests),):
            raise ValueError(f"got {len(requests)} requests but {arr.size} arrival offsets")
    else:
        if arr.ndim != 1 or arr.size < 1:
            raise ValueError("a closed loop needs one first send per user (at least 1 "
                             f"user), got arrival offsets of shape {arr.shape}")
        think = np.asarray(think_s, dtype=np.float64)
        if think.shape != (len(requests),):
            raise ValueError(f"got {len(requests)} requests but {think.size} think times "
                             "(a closed loop needs one per request)")
        if len(think) and (not np.all(np.isfinite(think)) or think.min() < 0):
            raise ValueError("think times must be finite and >= 0 seconds")
        if max_concurrency is not None:
            raise ValueError("max_concurrency must be None in a closed loop (each user has "
                             f"one request in flight), got {max_concurrency}")
    if len(arr) and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        raise ValueError("arrival offsets must be finite and >= 0 seconds")
    if not 0 <= warmup <= len(requests):
        raise ValueError(f"warmup must be between 0 and {len(requests)}, got {warmup}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    hw = _as_hardware(hardware)
    setup = resolve(config, hw, _as_model(model, config))
    run = _Run(setup, requests, arr, warmup, max_concurrency, on_window, window_s, think)
    end_time = run.run()
    return _stats(run, end_time)
