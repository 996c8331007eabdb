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

With ``enable_prefix_caching`` the KV blocks are also vLLM's automatic prefix cache
(:class:`PrefixCache`): a request is admitted with the longest run of its shared prompt
blocks that is cached, and a freed block stays cached, and counted free, until an
allocation that finds no uncached free block evicts it, least recently freed first.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
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
    # Request.prefix: the prompt's shared prefixes, shortest first, as (key, tokens).
    prefix: tuple[tuple[str, int], ...] = ()
    # Prefix caching only.  ``keyed[i]`` is the id of the prompt's full block i where the
    # block lies inside a shared prefix (``PrefixCache.ids``); later blocks are its own.
    keyed: tuple[int, ...] = ()
    # While running: for each keyed block allocated so far, whether this seq holds a
    # reference on the cached block of that id (False: another request had already
    # cached the id when this one computed it, so this copy is the seq's own).
    held: list[bool] | None = None

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


def block_spans(prefix: Sequence[tuple[str, int]], prompt_tokens: int,
                block_size: int) -> list[tuple[str, int, int]]:
    """Which shared prefix each of a prompt's full blocks belongs to: ``(key, first,
    end)`` for blocks ``first .. end - 1``, in block order; blocks after the last span
    are the request's own.

    Block i (tokens ``[B i, B (i + 1))``) belongs to the first segment of ``prefix``
    with at least ``B (i + 1)`` tokens: every prompt naming that key has the same tokens
    up to there, so the same block and the same blocks before it (vLLM hashes a block
    with its parent's hash).  A segment longer than the prompt counts as the prompt.
    """
    spans: list[tuple[str, int, int]] = []
    done = 0
    for key, tokens in prefix:
        # Segments come shortest first; one no longer than those before adds nothing,
        # which still gives each block the first segment long enough.
        n = min(tokens, prompt_tokens) // block_size
        if n > done:
            spans.append((key, done, n))
            done = n
    return spans


def block_ids(prefix: Sequence[tuple[str, int]], prompt_tokens: int,
              block_size: int) -> tuple[tuple[str, int], ...]:
    """The ids ``(key, i)`` of a prompt's shared full blocks (``block_spans``): two
    prompts' blocks with one id hold the same tokens, as two equal chained block hashes
    do in vLLM."""
    return tuple((key, i) for key, a, b in block_spans(prefix, prompt_tokens, block_size)
                 for i in range(a, b))


class PrefixCache:
    """vLLM V1's automatic prefix cache, on the scheduler's block counts.

    What vLLM does (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``): every full
    block is hashed; a cached block is shared by every running request that hits it (a
    reference count); a freed block (reference count 0) goes back to the free queue but
    keeps its hash, so it is still counted free and may still be hit, until an
    allocation takes it.  Uncached free blocks are handed out first, then cached ones in
    the order they were freed (``free_blocks`` appends cached blocks, a request's tail
    block first), which makes eviction least-recently-freed first.

    Here only blocks in a shared prefix can ever be hit (prompts never resend generated
    text, and a request's own blocks are not looked up again: see docs/simulator.md), so
    only those are tracked, by an int id (``ids``: the key's number, then the block's);
    ``refs`` holds the cached ones, ``lru`` the evictable blocks in eviction order:
    shared blocks by id (>= 0, value 1), and runs of a request's own full blocks by a
    negative key (value: how many).  Own blocks are cached in vLLM too, so they take
    their turn in the eviction order, but no lookup can hit them.  A run at the front is
    as good as an uncached free block (nothing that could be hit is before it), so the
    front is always a shared block.

    Evictions are applied lazily: allocations only lower the scheduler's free count, and
    :meth:`settle` evicts what they took beyond the uncached free blocks before the
    cache is next read or changed (the scheduler calls it before every lookup and free).
    Work is block by block, as vLLM's is (a lookup, a hit and a free each cost one dict
    operation per block).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._keys: dict[str, int] = {}  # prefix key -> its number in block ids
        # Cached shared blocks -> running seqs holding each (a Counter: bulk increments).
        self.refs: Counter[int] = Counter()
        self.lru: OrderedDict[int, int] = OrderedDict()  # evictable, in eviction order
        self.evictable = 0  # blocks in ``lru``: cached and free
        self._runs = 0  # -key of the last run of own blocks
        # vLLM's PrefixCacheStats, in tokens: lookups of requests never preempted (what
        # vllm:prefix_cache_queries / vllm:prefix_cache_hits count), and of resumed ones.
        self.queries = self.hits = 0
        self.preempted_queries = self.preempted_hits = 0

    def ids(self, prefix: Sequence[tuple[str, int]], prompt_tokens: int) -> tuple[int, ...]:
        """``block_ids`` as ints: key number << 32 | block index."""
        out: list[int] = []
        for key, a, b in block_spans(prefix, prompt_tokens, self.block_size):
            base = self._keys.setdefault(key, len(self._keys)) << 32
            out.extend(range(base + a, base + b))
        return tuple(out)

    def settle(self, free: int) -> None:
        """Evict what allocations took beyond the uncached free blocks (``free`` is the
        scheduler's free count, evictable blocks included)."""
        lru, refs = self.lru, self.refs
        while self.evictable > free:
            key, n = lru.popitem(last=False)
            self.evictable -= n
            if key >= 0:
                del refs[key]
            self._strip()

    def _strip(self) -> None:
        """Runs of own blocks at the front count as uncached free blocks from now on."""
        lru = self.lru
        while lru:
            key = next(iter(lru))
            if key >= 0:
                return
            self.evictable -= lru.pop(key)

    def _append_run(self, n: int) -> None:
        lru = self.lru
        if not lru:
            return  # nothing hittable before them: as good as uncached free blocks
        last = next(reversed(lru))
        if last >= 0:
            self._runs += 1
            lru[-self._runs] = n
        else:
            lru[last] += n
        self.evictable += n

    def lookup(self, keyed: tuple[int, ...], limit: int) -> tuple[int, int]:
        """(blocks hit, how many of them are evictable): the longest run of ``keyed``'s
        first ``limit`` blocks that is cached (a miss ends it, as a chained hash does)."""
        get = self.refs.get
        n = ev = 0
        for bid in keyed[:limit]:
            r = get(bid)
            if r is None:
                break
            n += 1
            if not r:
                ev += 1
        return n, ev

    def admit(self, seq: Seq, hits: int, evictable: int, upto: int) -> None:
        """``seq`` takes its first ``hits`` blocks from the cache (``evictable`` of them
        were free: vLLM's ``touch`` takes them off the free queue) and caches its keyed
        blocks up to ``upto``, the full blocks of its first chunk (vLLM caches a block
        when it allocates it)."""
        refs = self.refs
        hit = seq.keyed[:hits]
        if evictable:
            lru = self.lru
            for bid in hit:
                if not refs[bid]:
                    del lru[bid]
            self.evictable -= evictable
            self._strip()
        refs.update(hit)
        seq.held = [True] * hits
        self.cache(seq, upto)

    def cache(self, seq: Seq, upto: int) -> None:
        """Cache ``seq``'s keyed blocks before ``upto`` that it has not cached yet."""
        held, refs = seq.held, self.refs
        assert held is not None
        new = seq.keyed[len(held):upto]
        if refs.keys().isdisjoint(new):
            refs.update(new)
            held += [True] * len(new)
            return
        for bid in new:
            if bid in refs:
                held.append(False)  # cached by another request first: this copy is own
            else:
                refs[bid] = 1
                held.append(True)

    def release(self, seq: Seq, full: int, blocks: int) -> int:
        """``seq`` frees its ``blocks`` blocks, the first ``full`` of them full: how many
        become free (its shared blocks that another running request holds do not).

        In vLLM's order: the tail first (a partial block is uncached, so handed out
        first), then its own full blocks, then its shared ones, last to first.
        """
        held = seq.held or []
        seq.held = None
        n = len(held)
        own = full - n
        if own:
            self._append_run(own)
        if not n:
            return blocks
        refs, lru = self.refs, self.lru
        ids = seq.keyed[n - 1::-1]
        if all(held):
            counts = list(map(refs.__getitem__, ids))
            dict.update(refs, zip(ids, [c - 1 for c in counts], strict=True))
            freed = blocks - n
            for bid, c in zip(ids, counts, strict=True):
                if c == 1:  # its last holder: evictable from now on
                    lru[bid] = 1
                    freed += 1
            self.evictable += freed - (blocks - n)
            return freed
        freed = blocks - n
        for bid, mine in zip(ids, reversed(held), strict=True):
            if not mine:
                self._append_run(1)
                freed += 1
                continue
            r = refs[bid] - 1
            refs[bid] = r
            if not r:
                lru[bid] = 1
                self.evictable += 1
                freed += 1
        return freed

    def record(self, seq: Seq, hit_tokens: int) -> None:
        """Count a lookup as vLLM's ``PrefixCacheStats.record`` does (in tokens, at
        admission; a resumed request's apart)."""
        if seq.preemptions:
            self.preempted_queries += seq.total_tokens
            self.preempted_hits += hit_tokens
        else:
            self.queries += seq.total_tokens
            self.hits += hit_tokens


class Scheduler:
    @classmethod
    def for_setup(cls, setup: EngineSetup) -> Scheduler:
        """The scheduler of a resolved engine config (virtual time and the server alike)."""
        return cls(max_num_seqs=setup.max_num_seqs,
                   max_num_batched_tokens=setup.max_num_batched_tokens,
                   num_blocks=setup.num_gpu_blocks, block_size=setup.block_size,
                   enable_chunked_prefill=setup.enable_chunked_prefill,
                   enable_prefix_caching=setup.enable_prefix_caching)

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_blocks: int,
        block_size: int,
        enable_chunked_prefill: bool,
        enable_prefix_caching: bool = False,
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
        # None: no prefix caching, and every path is the one without it.
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None

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
        if self.prefix_cache is not None and seq.prefix and not seq.keyed:
            seq.keyed = self.prefix_cache.ids(seq.prefix, seq.prompt_tokens)
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
        self._free(seq)

    def _free(self, seq: Seq) -> None:
        """Give back ``seq``'s KV blocks (its ``computed`` is up to date)."""
        cache = self.prefix_cache
        if cache is None or (seq.held is None and not cache.lru):
            # Nothing of it can be hit, and nothing evictable is queued before it: its
            # blocks are as good as uncached ones.
            self.free_blocks += seq.blocks
        else:
            # The evictions of the allocations so far come before these blocks join the
            # free queue (they are the most recently freed).
            cache.settle(self.free_blocks)
            full = min(seq.blocks, seq.computed // self.block_size)
            self.free_blocks += cache.release(seq, full, seq.blocks)
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
            if seq.held is not None and len(seq.held) < len(seq.keyed):
                assert self.prefix_cache is not None
                self.prefix_cache.cache(seq, (seq.computed + chunk) // bs)

        if not preempted:
            cache = self.prefix_cache
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if cache is not None and seq.keyed:
                    budget = self._admit_cached(seq, budget, prefills)
                    if budget < 0:
                        break
                    continue
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
                if cache is not None:
                    cache.record(seq, 0)  # nothing it could hit: a query all the same

        kv = float(self._sum_cbase + num_decode * (self.step + 1))
        pairs = kv
        tokens = num_decode
        for _, chunk, ctx in prefills:
            tokens += chunk
            kv += ctx + chunk
            pairs += chunk * (ctx + (chunk + 1) / 2)
        return Plan(self.step, num_decode, prefills, preempted, tokens,
                    num_decode + len(prefills), kv, pairs)

    def _hits(self, seq: Seq) -> tuple[int, int]:
        """The head of the queue's prefix-cache lookup: (blocks hit, evictable among
        them).  vLLM looks up at most ``num_tokens - 1`` tokens' full blocks
        (``KVCacheManager.get_computed_blocks``): the last token is always computed, for
        its logits."""
        cache = self.prefix_cache
        if cache is None or not seq.keyed:
            return 0, 0
        cache.settle(self.free_blocks)
        return cache.lookup(seq.keyed, (seq.total_tokens - 1) // self.block_size)

    def _admit_cached(self, seq: Seq, budget: int,
                      prefills: list[tuple[Seq, int, int]]) -> int:
        """Admit the head of the queue, a seq with shared blocks, with prefix caching on:
        the budget left, or -1 when it cannot be admitted now (the queue waits, as
        without caching)."""
        cache = self.prefix_cache
        assert cache is not None
        bs = self.block_size
        hits, evictable = self._hits(seq)
        hit_tokens = hits * bs
        num_new = seq.total_tokens - hit_tokens
        if not self.chunked and num_new > budget:
            return -1
        chunk = min(num_new, budget)
        blocks = _cdiv(hit_tokens + chunk, bs)
        # Hit blocks held by another request cost nothing; an evictable one leaves the
        # free queue (vLLM counts it in get_num_blocks_to_allocate).
        need = blocks - hits + evictable
        if need > self.free_blocks:
            return -1
        self.waiting.popleft()
        self.free_blocks -= need
        seq.blocks = blocks
        seq.computed = hit_tokens
        seq.state = PREFILL
        self.running.append(seq)
        self.prefilling.append(seq)
        cache.record(seq, hit_tokens)
        cache.admit(seq, hits, evictable, (hit_tokens + chunk) // bs)
        # The chunk's context is the cached prefix: attention reads it, nothing computes it.
        prefills.append((seq, chunk, hit_tokens))
        return budget - chunk

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
                self._free(seq)
                seq.state = FINISHED
                self.running.remove(seq)
                finished.append(seq)
            else:
                self._enter_decode(seq, nxt)
        return started, finished

    def _finish(self, seq: Seq, last_step: int, finished: list[Seq]) -> None:
        self._leave_decode(seq, last_step)
        self._free(seq)
        seq.state = FINISHED
        self.running.remove(seq)
        finished.append(seq)

    # ---- decode-only stretches ----------------------------------------------------
    def _head_admissible(self) -> bool:
        """Whether the head of the queue may be admitted before the running sequences
        change: now, or, with prefix caching, once decode steps have evicted blocks."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        budget = self.max_num_batched_tokens - self.num_decode
        if budget <= 0:
            return False
        seq = self.waiting[0]
        num_new = seq.total_tokens
        if self.prefix_cache is None or not seq.keyed:
            if not self.chunked and num_new > budget:
                return False
            return _cdiv(min(num_new, budget), self.block_size) <= self.free_blocks
        bs = self.block_size
        hits, evictable = self._hits(seq)
        rest = num_new - hits * bs
        if not self.chunked and rest > budget:
            return False  # fewer hits later only leave more to compute
        need = _cdiv(hits * bs + min(rest, budget), bs) - hits + evictable
        if self.chunked and budget < num_new:
            # Decode steps may evict the head's evictable hits (a lost hit loses every
            # later one).  When the budget cuts the chunk, the need is the chunk's blocks
            # plus the evictable hits, so each one lost lowers it, down to the chunk's
            # blocks; for a whole chunk a lost hit never lowers it.  Free blocks only go
            # down meanwhile: the head stays out if it stays out at its lowest need.
            need = min(need, _cdiv(budget, bs))
        return need <= self.free_blocks

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
