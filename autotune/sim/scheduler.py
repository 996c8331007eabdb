"""vLLM V1 continuous-batching scheduler, as a pure state machine (no clock, no I/O).

One ``schedule()`` plans a step; ``complete(plan)`` applies it.  The rules follow
``vllm/v1/core/sched/scheduler.py``:

- running requests first, in admission order: each decoding one gets its one token, a
  partially prefilled one gets the next chunk of what is left of the token budget;
- a running request that needs a KV block when none is free preempts the newest running
  request (recompute: its blocks are freed, ``computed`` drops to 0, the tokens it already
  generated are kept and re-prefilled), which goes to the front of the waiting queue;
- only in a step without preemption are waiting requests admitted, FCFS, while there is a
  running slot (``max_num_seqs``), token budget (``max_num_batched_tokens``) and free blocks
  for the first chunk; without chunked prefill a prompt that does not fit the budget whole
  waits (and blocks the queue, as in vLLM);
- the step that computes the last prompt token samples the first output token.

For speed, decoding sequences are kept implicitly: every step advances all of them by one
token (V1 never skips a running decode: preemption pops from the tail, so every request
before the one being preempted is already scheduled), so ``computed = c_base + step``
and their KV-block needs are counted by phase (``computed mod block_size``).  A step then
costs O(prefills + admissions + finishes), not O(running), and a stretch of decode-only
steps can be advanced in one call (:meth:`advance_decode`).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from autotune.sim.config import EngineSetup

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"
_NO_NEEDS = np.zeros(0, dtype=np.int64)  # a stretch of no steps allocates nothing
_NO_NEEDS.flags.writeable = False


@dataclass(eq=False, slots=True)
class Seq:
    """One request inside the engine.  Token positions are step indexes (see ``segments``)."""

    rid: int
    prompt_tokens: int
    max_output: int
    state: str = WAITING
    generated: int = 0  # output tokens so far (stale while decoding: see Scheduler.generated)
    computed: int = 0  # tokens whose KV is computed (stale while decoding)
    blocks: int = 0  # KV blocks held (stale while decoding)
    c_base: int = 0  # while decoding: computed == c_base + scheduler.step
    epoch: int = 0  # bumps when a decode stint ends, invalidating heap entries
    seg_start: int = -1  # step index of the first token of the open decode stint
    # Closed stints: (first, last) step index, inclusive; output token i of the request was
    # sampled by the i-th step listed here.
    segments: list[tuple[int, int]] = field(default_factory=list)
    preemptions: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class Plan:
    """One scheduled step and the figures the cost model needs."""

    step: int
    num_decode: int
    prefills: list[tuple[Seq, int, int]]  # (seq, chunk tokens, context before the chunk)
    preempted: list[Seq]
    tokens: int
    seqs: int
    kv_tokens: float
    pairs: float


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    @classmethod
    def for_setup(cls, setup: EngineSetup) -> Scheduler:
        """The scheduler of a resolved engine config (virtual time and the server alike)."""
        return cls(max_num_seqs=setup.max_num_seqs,
                   max_num_batched_tokens=setup.max_num_batched_tokens,
                   num_blocks=setup.num_gpu_blocks, block_size=setup.block_size,
                   enable_chunked_prefill=setup.enable_chunked_prefill)

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_blocks: int,
        block_size: int,
        enable_chunked_prefill: bool,
    ) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.chunked = enable_chunked_prefill
        self.free_blocks = num_blocks
        self.step = 0  # index of the next step
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # admission order; prefilling ones are at the tail
        self.prefilling: list[Seq] = []
        self.num_decode = 0
        self.num_preemptions = 0
        self._phase = [0] * block_size  # decoding seqs by c_base mod block_size
        # The same counts as an array, for a stretch's block needs in one ``take``.
        self._phase_arr = np.zeros(block_size, dtype=np.int64)
        self._rev = np.zeros(0, dtype=np.int64)  # (-j) mod block_size; grown on demand
        self._sum_cbase = 0
        self._heap: list[tuple[int, int, int, Seq]] = []  # (finish step, epoch, rid, seq)

    # ---- queries ------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def generated(self, seq: Seq) -> int:
        if seq.state == DECODE:
            return seq.c_base + self.step - seq.prompt_tokens + 1
        return seq.generated

    def computed(self, seq: Seq) -> int:
        return seq.c_base + self.step if seq.state == DECODE else seq.computed

    # ---- input --------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        if seq.max_output < 1:
            raise ValueError(f"request {seq.rid}: max_output must be >= 1")
        seq.state = WAITING
        self.waiting.append(seq)

    def abort(self, seq: Seq) -> None:
        """Drop a request wherever it is (client went away); frees its blocks."""
        if seq.state == WAITING:
            self.waiting.remove(seq)
        elif seq.state in (PREFILL, DECODE):
            self._release(seq)
            self.running.remove(seq)
        seq.state = FINISHED

    # ---- internals ----------------------------------------------------------------
    def _leave_decode(self, seq: Seq, last_step: int) -> None:
        """Materialise a decoding seq's lazy fields and drop it from the aggregates."""
        seq.computed = seq.c_base + self.step
        seq.generated = seq.computed - seq.prompt_tokens + 1
        seq.blocks = _cdiv(seq.computed, self.block_size)
        p = seq.c_base % self.block_size
        self._phase[p] -= 1
        self._phase_arr[p] -= 1
        self._sum_cbase -= seq.c_base
        self.num_decode -= 1
        seq.epoch += 1
        seq.segments.append((seq.seg_start, last_step))

    def _release(self, seq: Seq) -> None:
        if seq.state == DECODE:
            self._leave_decode(seq, self.step - 1)
        elif seq.state == PREFILL:
            self.prefilling.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def _preempt_newest(self, preempted: list[Seq]) -> Seq:
        victim = self.running.pop()
        self._release(victim)
        victim.computed = 0
        victim.state = WAITING
        victim.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        preempted.append(victim)
        return victim

    def _enter_decode(self, seq: Seq, next_step: int) -> None:
        seq.state = DECODE
        seq.c_base = seq.computed - next_step
        p = seq.c_base % self.block_size
        self._phase[p] += 1
        self._phase_arr[p] += 1
        self._sum_cbase += seq.c_base
        self.num_decode += 1
        finish = seq.prompt_tokens + seq.max_output - 1 - seq.c_base
        heapq.heappush(self._heap, (finish, seq.epoch, seq.rid, seq))

    def _decode_needs(self) -> int:
        return self._phase[(-self.step) % self.block_size]

    def _schedule_decodes_slow(self, preempted: list[Seq]) -> None:
        """KV blocks are short: walk the running list in order, preempting from the tail."""
        bs, step = self.block_size, self.step
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.state != DECODE:
                break  # prefilling seqs are the tail; they are handled after decodes
            if (seq.c_base + step) % bs == 0:
                while self.free_blocks == 0:
                    if self._preempt_newest(preempted) is seq:
                        return
                self.free_blocks -= 1
            i += 1

    # ---- one step -----------------------------------------------------------------
    def schedule(self) -> Plan:
        bs = self.block_size
        budget = self.max_num_batched_tokens
        preempted: list[Seq] = []
        needs = self._decode_needs()
        if needs <= self.free_blocks:
            self.free_blocks -= needs
        else:
            self._schedule_decodes_slow(preempted)
        num_decode = self.num_decode
        budget -= num_decode
        prefills: list[tuple[Seq, int, int]] = []

        for seq in list(self.prefilling):
            if seq.state != PREFILL or budget <= 0:
                continue
            chunk = min(seq.total_tokens - seq.computed, budget)
            need = _cdiv(seq.computed + chunk, bs) - seq.blocks
            stuck = False
            while need > self.free_blocks:
                if self._preempt_newest(preempted) is seq:
                    stuck = True
                    break
            if stuck:
                break
            self.free_blocks -= need
            seq.blocks += need
            budget -= chunk
            prefills.append((seq, chunk, seq.computed))

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                num_new = seq.total_tokens
                if not self.chunked and num_new > budget:
                    break
                chunk = min(num_new, budget)
                need = _cdiv(chunk, bs)
                if need > self.free_blocks:
                    break
                self.waiting.popleft()
                self.free_blocks -= need
                seq.blocks = need
                seq.computed = 0
                seq.state = PREFILL
                self.running.append(seq)
                self.prefilling.append(seq)
                budget -= chunk
                prefills.append((seq, chunk, 0))

        kv = float(self._sum_cbase + num_decode * (self.step + 1))
        pairs = kv
        tokens = num_decode
        for _, chunk, ctx in prefills:
            tokens += chunk
            kv += ctx + chunk
            pairs += chunk * (ctx + (chunk + 1) / 2)
        return Plan(self.step, num_decode, prefills, preempted, tokens,
                    num_decode + len(prefills), kv, pairs)

    def complete(self, plan: Plan) -> tuple[list[Seq], list[Seq]]:
        """Apply a planned step: (seqs that sampled their first token of a stint, finished)."""
        step = plan.step
        self.step = nxt = step + 1
        started: list[Seq] = []
        finished: list[Seq] = []
        heap = self._heap
        while heap and heap[0][0] <= nxt:
            _, epoch, _, seq = heapq.heappop(heap)
            if epoch != seq.epoch or seq.state != DECODE:
                continue  # stale entry: that stint ended (preempted)
            self._finish(seq, step, finished)
        for seq, chunk, _ in plan.prefills:
            if seq.state != PREFILL:
                continue
            seq.computed += chunk
            if seq.computed < seq.total_tokens:
                continue
            seq.generated += 1
            seq.seg_start = step
            self.prefilling.remove(seq)
            started.append(seq)
            if seq.generated >= seq.max_output:
                seq.segments.append((step, step))
                self.free_blocks += seq.blocks
                seq.blocks = 0
                seq.state = FINISHED
                self.running.remove(seq)
                finished.append(seq)
            else:
                self._enter_decode(seq, nxt)
        return started, finished

    def _finish(self, seq: Seq, last_step: int, finished: list[Seq]) -> None:
        self._leave_decode(seq, last_step)
        self.free_blocks += seq.blocks
        seq.blocks = 0
        seq.state = FINISHED
        self.running.remove(seq)
        finished.append(seq)

    # ---- decode-only stretches ----------------------------------------------------
    def _head_admissible(self) -> bool:
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        budget = self.max_num_batched_tokens - self.num_decode
        if budget <= 0:
            return False
        num_new = self.waiting[0].total_tokens
        if not self.chunked and num_new > budget:
            return False
        return _cdiv(min(num_new, budget), self.block_size) <= self.free_blocks

    def decode_stretch(self) -> tuple[int, np.ndarray]:
        """How many next steps are plain decodes of the same sequences, and their block needs.

        Those steps admit nothing (the head of the queue cannot be admitted now, and
        only fewer blocks become free while decoding), finish nothing and preempt nothing.
        The step that finishes a sequence is left to ``schedule``.  Returns ``(k, needs)``
        with ``needs[j]`` the blocks step ``j`` allocates; k = 0 when no stretch applies.
        """
        return self.decode_stretch_blocks(self.decode_stretch_limit())

    def decode_stretch_blocks(self, k: int) -> tuple[int, np.ndarray]:
        """The first ``k`` steps of a stretch cut where KV blocks run out: ``decode_stretch``
        from ``k = decode_stretch_limit()``."""
        if k <= 0:
            return 0, _NO_NEEDS
        needs = self._stretch_needs(k)
        if self.num_decode * (k // self.block_size + 1) > self.free_blocks:
            k = int(needs.cumsum().searchsorted(self.free_blocks, side="right"))
            needs = needs[:k]
        return k, needs

    def decode_stretch_limit(self) -> int:
        """``decode_stretch``'s ``k`` before KV blocks are counted (they may cut it short:
        see :meth:`block_cycle`); 0 when no stretch applies."""
        if self.prefilling or not self.num_decode or self._head_admissible():
            return 0
        heap = self._heap
        while heap and (heap[0][1] != heap[0][3].epoch or heap[0][3].state != DECODE):
            heapq.heappop(heap)
        return max(heap[0][0] - self.step - 1, 0) if heap else 0

    def block_cycle(self) -> list[int]:
        """Blocks each of the next ``block_size`` decode steps allocates; the steps after
        repeat the cycle (while the same sequences decode).

        Step ``s`` allocates one block per decoding seq whose ``c_base + s`` is a multiple
        of the block size, i.e. ``_phase[-s mod block_size]`` blocks.
        """
        m = (-self.step) % self.block_size
        return self._phase[m::-1] + self._phase[:m:-1]

    def _stretch_needs(self, k: int) -> np.ndarray:
        """``block_cycle`` over the next ``k`` steps, as an array (one ``take``)."""
        bs = self.block_size
        s0 = self.step % bs
        if len(self._rev) < s0 + k:  # grown rarely: to twice what is needed
            self._rev = -np.arange(2 * (s0 + k), dtype=np.int64) % bs
        return self._phase_arr.take(self._rev[s0: s0 + k])

    def advance_decode(self, k: int, blocks: int) -> None:
        """Apply ``k`` decode-only steps that allocate ``blocks`` blocks in all."""
        self.step += k
        self.free_blocks -= blocks

    def decode_kv0(self) -> float:
        """KV entries the next decode-only step reads (for the cost model)."""
        return float(self._sum_cbase + self.num_decode * (self.step + 1))
