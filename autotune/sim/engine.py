"""Virtual-time simulation of one load test against a simulated vLLM engine.

``simulate`` drives the scheduler and the cost model as a discrete-event simulation and
fills the same :class:`~autotune.records.RequestRecord` objects the HTTP load generator
fills, so ``metrics`` cannot tell the two apart.  Every figure it produces is simulated.

The API server (front end, :mod:`autotune.sim.frontend`) is a stage of its own when the
hardware profile gives it a cost: a request reaches the scheduler only after the front
end has taken it in, and the client has a step's tokens only once the front end has sent
them, so TTFT, ITL and E2E are what a client waits for.  Client-side events (arrivals,
completions the client has seen) are then applied in time order apart from the engine's
steps.  With no front-end cost the engine runs exactly as without one.

Speed: a step costs O(prefills + finishes) (see ``scheduler``), and stretches of
decode-only steps with no arrival, finish, KV-block shortage or window boundary in
between are costed and applied in one numpy call (front end included).
"""

from __future__ import annotations

import heapq
import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from autotune.records import RequestRecord, WindowCallback
from autotune.sim.config import EngineConfig, EngineSetup, resolve
from autotune.sim.costmodel import CostModel
from autotune.sim.frontend import FrontEnd, FrontEndCosts
from autotune.sim.profiles import HardwareProfile, ModelProfile, load_hardware, load_model
from autotune.sim.scheduler import DECODE, Scheduler, Seq
from autotune.workload import Request

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
            "engine": {
                "model": s.model.name,
                "hardware": s.hardware.label,
                "tensor_parallel_size": s.tensor_parallel_size,
                "max_num_seqs": s.max_num_seqs,
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "enable_chunked_prefill": s.enable_chunked_prefill,
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
    """Growable per-step arrays: end time, GPU time, duration, blocks used, queue sizes,
    and (front end modelled) when the client has the step's tokens."""

    def __init__(self, cap: int = 8192) -> None:
        self.n = 0
        self.end = np.empty(cap)
        self.dur = np.empty(cap)
        self.gpu = np.empty(cap)
        self.used = np.empty(cap, dtype=np.int64)
        self.running = np.empty(cap, dtype=np.int64)
        self.waiting = np.empty(cap, dtype=np.int64)
        self.preempt = np.empty(cap, dtype=np.int64)  # cumulative preemptions
        self.seen = np.empty(cap)  # filled only when the front end is modelled

    def _grow(self, need: int) -> None:
        cap = len(self.end)
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for name in ("end", "dur", "gpu", "used", "running", "waiting", "preempt", "seen"):
            old = getattr(self, name)
            arr = np.empty(new, dtype=old.dtype)
            arr[: self.n] = old[: self.n]
            setattr(self, name, arr)

    def add(self, end: float, dur: float, gpu: float, used: int, running: int, waiting: int,
            preempt: int, seen: float | None = None) -> None:
        i = self.n
        if i >= len(self.end):
            self._grow(i + 1)
        self.end[i] = end
        self.dur[i] = dur
        self.gpu[i] = gpu
        self.used[i] = used
        self.running[i] = running
        self.waiting[i] = waiting
        self.preempt[i] = preempt
        if seen is not None:
            self.seen[i] = seen
        self.n = i + 1

    def add_many(self, end: np.ndarray, dur: np.ndarray, gpu: np.ndarray, used: np.ndarray,
                 running: int, waiting: int, preempt: int,
                 seen: np.ndarray | None = None) -> None:
        i, k = self.n, len(end)
        self._grow(i + k)
        j = i + k
        self.end[i:j] = end
        self.dur[i:j] = dur
        self.gpu[i:j] = gpu
        self.used[i:j] = used
        self.running[i:j] = running
        self.waiting[i:j] = waiting
        self.preempt[i:j] = preempt
        if seen is not None:
            self.seen[i:j] = seen
        self.n = j


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
                 window_s: float) -> None:
        self.setup = setup
        self.cost = CostModel.for_setup(setup)
        self.sched = Scheduler.for_setup(setup)
        costs = FrontEndCosts.for_setup(setup)
        # None: the front end costs nothing, and the engine runs as if it did not exist.
        self.fe = FrontEnd(costs) if costs.active else None
        self.requests = requests
        self.arrivals = arrivals
        self.order = np.argsort(arrivals, kind="stable")
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
        self.next_arrival = 0  # position in self.order
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
            return float("inf")
        return float(self.arrivals[self.order[self.next_arrival]])

    def _client_until(self, t: float) -> None:
        """Apply the client's events up to ``t``: arrivals and, with a front end, the ends
        it delivers, in time order (an end frees its slot before a same-time arrival)."""
        if self.fe is None:
            self._dispatch_until(t)
            return
        delivery = self.delivery
        while True:
            ta = self._arrival_time()
            td = delivery[0][0] if delivery else math.inf
            if td <= ta and td <= t:
                _, i = heapq.heappop(delivery)
                self._deliver(i, td)
            elif ta <= t:
                self._dispatch_until(ta)
            else:
                return

    def _dispatch_until(self, t: float) -> None:
        while self.next_arrival < len(self.order):
            i = int(self.order[self.next_arrival])
            at = float(self.arrivals[i])
            if at > t:
                return
            self.next_arrival += 1
            req = self.requests[i]
            # Same conventions as the HTTP load generator: measured requests are numbered
            # from 0 (warm-up ones negative); token counts arrive with the usage chunk.
            rec = RequestRecord(
                index=i - self.warmup, scheduled_s=at, dispatched_s=at,
                expected_output_tokens=req.output_tokens, warmup=i < self.warmup,
            )
            self.records[i] = rec
            if not rec.warmup:
                self.measured.append(rec)
            if self.max_concurrency is not None and self.inflight >= self.max_concurrency:
                self.gated.append(i)
            else:
                self._send(i, at)

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
            self._release_slot(t)
            return
        rec.status = 200
        seq = Seq(rid=i, prompt_tokens=req.prompt_tokens, max_output=req.output_tokens)
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

    def _release_slot(self, t: float) -> None:
        self.inflight -= 1
        while self.gated and (self.max_concurrency is None
                              or self.inflight < self.max_concurrency):
            self._send(self.gated.popleft(), t)

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
            chunk = times[a + skip: b + 1]
            if upto < chunk[-1]:  # the front end has not sent them all yet (times ascend)
                cut = int(np.searchsorted(chunk, upto, side="right"))
                rec.chunk_times_s.extend(chunk[:cut].tolist())
                done += cut
                break
            rec.chunk_times_s.extend(chunk.tolist())
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
        self._release_slot(t)

    def _deliver(self, i: int, t: float) -> None:
        """Front end: at ``t`` the client has request ``i``'s last chunk (or its 400)."""
        seq = self.seqs.get(i)
        if seq is not None:
            self._finish(seq, t)
            return
        rec = self.records[i]
        assert rec is not None
        rec.end_s = t
        self._release_slot(t)

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
        sched, cost, steps, fe = self.sched, self.cost, self.steps, self.fe
        now = 0.0
        while not self.aborted:
            self._client_until(now)
            if fe is not None:
                self._handover_until(now)
            if sched.idle:
                t_next = self._arrival_time()
                if fe is not None:
                    t_next = min(t_next, self._front_event_time())
                if t_next == float("inf"):
                    break
                self._fire_windows(t_next)
                if fe is not None:
                    fe.idle(t_next - now)
                now = t_next
                continue
            k, needs = sched.decode_stretch()
            if k >= 2:
                r = sched.num_decode
                tot, gpu = cost.decode_steps(r, sched.decode_kv0(), k)
                if fe is not None:
                    end = self._front_stretch(now, tot, gpu, needs, r)
                    if end is not None:
                        now = end
                        continue
                else:
                    ends = now + np.cumsum(tot)
                    k = min(k,
                            int(np.searchsorted(ends - tot, self._arrival_time(),
                                                side="left")),
                            int(np.searchsorted(ends, self.next_boundary, side="right")))
                    if k >= 1:
                        used = sched.used_blocks + np.cumsum(needs[:k])
                        steps.add_many(ends[:k], tot[:k], gpu[:k], used, sched.num_running,
                                       sched.num_waiting, sched.num_preemptions)
                        sched.advance_decode(k, int(used[-1] - sched.used_blocks))
                        now = float(ends[k - 1])
                        continue
            plan = sched.schedule()
            if plan.tokens == 0:
                raise RuntimeError("simulator scheduled an empty step (scheduler bug)")
            c = cost.step(plan.tokens, plan.seqs, plan.kv_tokens, plan.pairs)
            if fe is None:
                end = now + c.total_s
            else:
                step_s = c.total_s + fe.step_extra(c.total_s)
                end = now + step_s
            self._fire_windows_before(end)
            if self.aborted:
                break
            if fe is not None:
                # What the client did during the step reaches the front end before the
                # step's tokens do (the front end works in time order).
                self._client_until(end)
            now = end
            started, finished = sched.complete(plan)
            if fe is None:
                steps.add(now, c.total_s, c.gpu_s, sched.used_blocks, sched.num_running,
                          sched.num_waiting, sched.num_preemptions)
                for seq in started:
                    rec = self.records[seq.rid]
                    if rec is not None and rec.first_token_s is None:
                        rec.first_token_s = now
                for seq in finished:
                    self._finish(seq, now)
                continue
            # Each decoding sequence and each one whose prefill ended produced one token.
            seen_s = fe.emit(now, plan.num_decode + len(started))
            steps.add(now, step_s, c.gpu_s, sched.used_blocks, sched.num_running,
                      sched.num_waiting, sched.num_preemptions, seen_s)
            for seq in finished:
                heapq.heappush(self.delivery, (seen_s, seq.rid))
        return now

    def _front_stretch(self, now: float, tot: np.ndarray, gpu: np.ndarray,
                       needs: np.ndarray, r: int) -> float | None:
        """Front end: apply the steps of a decode stretch of ``r`` sequences that may run
        in one go (engine times ``tot``); the time they end, or None when none may."""
        fe, sched, steps = self.fe, self.sched, self.steps
        assert fe is not None
        # The engine's own step times bound the stretch (the front end only lengthens
        # steps): price the front end over that prefix alone.
        k = self._front_stretch_limit(tot.cumsum() + now, tot)
        if k < 1:
            return None
        stretch = fe.stretch(now, tot[:k], r)
        k = min(k, self._front_stretch_limit(stretch.end, stretch.dur))
        if k < 1:
            return None
        used = needs[:k].cumsum() + sched.used_blocks
        steps.add_many(stretch.end[:k], stretch.dur[:k], gpu[:k], used, sched.num_running,
                       sched.num_waiting, sched.num_preemptions, stretch.seen[:k])
        sched.advance_decode(k, int(used[-1] - sched.used_blocks))
        # The last step may straddle a client event, whose work reaches the front end
        # before that step's tokens do: price that step's tokens after it.
        if k > 1:
            fe.apply(stretch, k - 1, r)
        fe.step_extra(float(tot[k - 1]))  # the debt it pays (its duration above)
        end = float(stretch.end[k - 1])
        self._client_until(end)
        steps.seen[steps.n - 1] = fe.emit(end, r)
        return end

    def _front_stretch_limit(self, ends: np.ndarray, dur: np.ndarray) -> int:
        """Front end: how many steps of a decode stretch may run in one go.

        Steps must start before the next hand-over (the scheduler may admit it) and the
        next client event that gives the front end work (an arrival, or an end that lets
        a gated request go), and end by the next window.
        """
        event = self._arrival_time()
        if self.max_concurrency is not None and self.delivery:
            event = min(event, self.delivery[0][0])
        if self.handover:
            event = min(event, self.handover[0][0])
        k = len(ends)
        if event < math.inf:
            k = int(np.searchsorted(ends - dur, event, side="left"))
        if self.next_boundary < math.inf:
            k = min(k, int(np.searchsorted(ends, self.next_boundary, side="right")))
        return k

    def _fire_windows_before(self, end: float) -> None:
        # A boundary inside the coming step sees the state before it (steps are atomic).
        while self.next_boundary < end and not self.aborted:
            self._fire_windows(self.next_boundary)


def _stats(run: _Run, end_time: float) -> SimResult:
    setup, st = run.setup, run.steps
    n = st.n
    end, dur, gpu = st.end[:n], st.dur[:n], st.gpu[:n]
    used, cum_pre = st.used[:n], st.preempt[:n]
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


def _timeline(st: _Steps, window_s: float, end_time: float, nblocks: int) -> list[TimelinePoint]:
    n = st.n
    if n == 0 or end_time <= 0:
        return []
    nbins = int(np.ceil(end_time / window_s))
    end = st.end[:n]
    idx = np.minimum((end / window_s).astype(np.int64), nbins - 1)
    # A step ending exactly on an edge belongs to the window it ends
    idx = np.where((idx > 0) & (end == idx * window_s), idx - 1, idx)
    busy = np.bincount(idx, weights=st.gpu[:n], minlength=nbins)
    kvw = np.bincount(idx, weights=st.used[:n] * st.dur[:n], minlength=nbins)
    edges = window_s * np.arange(1, nbins + 1)
    last = np.searchsorted(end, edges, side="right") - 1
    out = []
    for b in range(nbins):
        j = last[b]
        running = int(st.running[j]) if j >= 0 else 0
        waiting = int(st.waiting[j]) if j >= 0 else 0
        out.append(TimelinePoint(
            time_s=float(edges[b]), running=running, waiting=waiting,
            kv_usage=float(min(kvw[b] / window_s / nblocks, 1.0)),
            busy_fraction=float(min(busy[b] / window_s, 1.0)),
        ))
    return out


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
) -> SimResult:
    """Run one load test in virtual time; every figure in the result is **simulated**.

    ``requests[i]`` is sent at ``arrivals[i]`` seconds (only its token counts matter);
    the first ``warmup`` requests are warm-up.  ``max_concurrency`` caps requests in
    flight as the load generator does.  ``on_window(now, measured_records)`` is called at
    every ``window_s`` boundary of virtual time; returning True aborts the test and
    marks the requests in flight with error ``"aborted: pruned"``.  ``model=None`` loads
    ``config.model``.  Raises :class:`~autotune.sim.config.ConfigRefused` when vLLM would
    refuse to start.
    """
    arr = np.asarray(arrivals, dtype=np.float64)
    if arr.shape != (len(requests),):
        raise ValueError(f"got {len(requests)} requests but {arr.size} arrival offsets")
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
    run = _Run(setup, requests, arr, warmup, max_concurrency, on_window, window_s)
    end_time = run.run()
    return _stats(run, end_time)
