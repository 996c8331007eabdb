"""The simulator's V1 continuous-batching scheduler (pure state machine)."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.sim.scheduler import DECODE, FINISHED, PREFILL, WAITING, Scheduler, Seq


def make(**kw: object) -> Scheduler:
    args: dict[str, object] = dict(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=100,
                                   block_size=4, enable_chunked_prefill=True)
    args.update(kw)
    return Scheduler(**args)  # type: ignore[arg-type]


def run_steps(s: Scheduler, n: int) -> list[tuple[list[Seq], list[Seq]]]:
    out = []
    for _ in range(n):
        out.append(s.complete(s.schedule()))
    return out


def tokens(seq: Seq) -> int:
    return sum(b - a + 1 for a, b in seq.segments)


def test_one_request_prefills_then_decodes_one_token_per_step() -> None:
    s = make()
    seq = Seq(0, prompt_tokens=10, max_output=5)
    s.add(seq)
    plan = s.schedule()
    assert plan.tokens == 10 and plan.num_decode == 0
    started, finished = s.complete(plan)
    assert started == [seq] and seq.state == DECODE and s.generated(seq) == 1
    for step in range(1, 5):
        plan = s.schedule()
        assert plan.tokens == 1 and plan.num_decode == 1
        _, finished = s.complete(plan)
        assert (finished == [seq]) == (step == 4)
    assert seq.state == FINISHED and seq.segments == [(0, 4)]
    assert s.free_blocks == s.num_blocks and s.idle


def test_single_output_token_finishes_in_the_prefill_step() -> None:
    s = make()
    seq = Seq(0, 7, 1)
    s.add(seq)
    started, finished = s.complete(s.schedule())
    assert started == finished == [seq] and seq.segments == [(0, 0)]
    assert s.free_blocks == s.num_blocks


def test_max_num_seqs_caps_running() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(Seq(i, 4, 10))
    s.complete(s.schedule())
    assert s.num_running == 2 and s.num_waiting == 1
    assert [q.rid for q in s.running] == [0, 1]  # FCFS


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    s = make(max_num_batched_tokens=8, max_num_seqs=4)
    seq = Seq(0, 20, 3)
    s.add(seq)
    chunks = []
    for _ in range(3):
        plan = s.schedule()
        chunks.append(plan.prefills[0][1])
        s.complete(plan)
    assert chunks == [8, 8, 4]
    assert seq.state == DECODE and seq.segments == [] and seq.seg_start == 2


def test_decodes_take_budget_first_then_prefill_chunks() -> None:
    s = make(max_num_batched_tokens=8, max_num_seqs=4)
    a = Seq(0, 4, 50)
    s.add(a)
    s.complete(s.schedule())  # a prefilled, now decoding
    b = Seq(1, 30, 5)
    s.add(b)
    plan = s.schedule()
    assert plan.num_decode == 1 and plan.prefills == [(b, 7, 0)] and plan.tokens == 8


def test_without_chunked_prefill_a_prompt_larger_than_the_budget_left_waits() -> None:
    s = make(max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=False)
    s.add(Seq(0, 4, 50))
    s.complete(s.schedule())
    big = Seq(1, 16, 5)
    s.add(big)
    plan = s.schedule()  # 1 decode token leaves 15 < 16
    assert plan.prefills == [] and big.state == WAITING
    small_first = make(max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=False)
    small_first.add(Seq(0, 16, 5))
    plan = small_first.schedule()
    assert plan.prefills[0][1] == 16  # whole prompt in one step


def test_admission_needs_free_blocks_for_the_first_chunk() -> None:
    s = make(num_blocks=3, block_size=4)
    s.add(Seq(0, 8, 2))  # 2 blocks
    s.add(Seq(1, 8, 2))  # needs 2 more: only 1 free
    plan = s.schedule()
    assert [p[0].rid for p in plan.prefills] == [0]
    assert s.num_waiting == 1


def test_kv_exhaustion_preempts_the_newest_and_requeues_it_first() -> None:
    s = make(num_blocks=6, block_size=4, max_num_seqs=4)
    old, new = Seq(0, 8, 12), Seq(1, 8, 12)
    s.add(old)
    s.add(new)
    s.complete(s.schedule())  # both prefilled: 4 of 6 blocks
    preempted_total = 0
    for _ in range(400):
        if s.idle:
            break
        plan = s.schedule()
        preempted_total += len(plan.preempted)
        if plan.preempted:
            assert plan.preempted[0] is new  # the newest goes first
            assert s.waiting[0] is new  # front of the queue
            assert s.generated(new) > 1  # keeps its tokens for the recompute
        s.complete(plan)
    assert s.idle and preempted_total >= 1 and s.num_preemptions == preempted_total
    assert tokens(old) == 12 and tokens(new) == 12  # no token lost or duplicated
    assert new.preemptions >= 1 and len(new.segments) >= 2
    assert s.free_blocks == s.num_blocks


def test_preempted_request_is_re_prefilled_with_its_generated_tokens() -> None:
    # 8 blocks: one request (27 tokens = 7 blocks) always fits alone, as vLLM guarantees
    s = make(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    s.add(Seq(0, 8, 20))
    victim = Seq(1, 8, 20)
    s.add(victim)
    s.complete(s.schedule())
    while victim.state != WAITING:
        s.complete(s.schedule())
    total = victim.total_tokens
    assert total > 8 and victim.computed == 0 and victim.blocks == 0
    while victim.state == WAITING:
        plan = s.schedule()
        for seq, chunk, ctx in plan.prefills:
            if seq is victim:
                assert ctx == 0 and chunk == total
        s.complete(plan)
    assert victim.state in (DECODE, PREFILL, FINISHED)


def test_abort_frees_blocks() -> None:
    s = make()
    a = Seq(0, 10, 100)
    s.add(a)
    run_steps(s, 3)
    assert s.free_blocks < s.num_blocks
    s.abort(a)
    assert s.free_blocks == s.num_blocks and s.idle


def drive(s: Scheduler, seqs: list[Seq], arrive_at: list[int], bulk: bool) -> None:
    """Add seqs at given step indexes; optionally use the bulk decode fast path."""
    pending = sorted(zip(arrive_at, range(len(seqs)), strict=True))
    j = 0
    for _ in range(100_000):
        while j < len(pending) and pending[j][0] <= s.step:
            s.add(seqs[pending[j][1]])
            j += 1
        if s.idle:
            if j == len(pending):
                return
            s.step = pending[j][0]  # idle engine: jump to the next arrival
            continue
        if bulk:
            k, needs = s.decode_stretch()
            nxt = pending[j][0] if j < len(pending) else 10**9
            k = min(k, nxt - s.step)
            if k >= 1:
                s.advance_decode(k, int(needs[:k].sum()))
                continue
        s.complete(s.schedule())
    raise AssertionError("did not finish")


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("num_blocks", [40, 400])
def test_bulk_decode_stretches_match_step_by_step(chunked: bool, num_blocks: int) -> None:
    rng = np.random.default_rng(3)
    n = 60
    prompts = rng.integers(1, 60, n)
    outputs = rng.integers(1, 80, n)
    arrive = np.sort(rng.integers(0, 600, n)).tolist()
    results = []
    for bulk in (False, True):
        # without chunked prefill vLLM needs max_num_batched_tokens >= max_model_len
        s = Scheduler(max_num_seqs=12, max_num_batched_tokens=64 if chunked else 160,
                      num_blocks=num_blocks,
                      block_size=4, enable_chunked_prefill=chunked)
        seqs = [Seq(i, int(p), int(o))
                for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
        drive(s, seqs, arrive, bulk)
        assert s.free_blocks == num_blocks
        results.append(([q.segments for q in seqs], s.num_preemptions))
    assert results[0] == results[1]
    segs, preemptions = results[1]
    assert all(sum(b - a + 1 for a, b in sg) == o for sg, o in zip(segs, outputs, strict=True))
    if num_blocks == 40:
        assert preemptions > 0  # the small cache really exercised preemption


def test_decode_stretch_stops_before_a_finish_and_before_a_block_shortage() -> None:
    s = make(num_blocks=1000)
    seq = Seq(0, 4, 30)
    s.add(seq)
    s.complete(s.schedule())
    k, _ = s.decode_stretch()
    assert k == 28  # 29 decode steps remain; the finishing one is left to schedule()
    tight = make(num_blocks=3, block_size=4)
    t = Seq(0, 4, 30)
    tight.add(t)
    tight.complete(tight.schedule())  # 1 block used, 2 free: 8 more tokens fit
    k, needs = tight.decode_stretch()
    assert int(needs.sum()) <= 2 and k == 8


def test_block_cycle_repeats_the_stretch_block_needs() -> None:
    s = make(num_blocks=1000, block_size=4)
    for i, prompt in enumerate((3, 6, 9, 13, 17)):
        s.add(Seq(i, prompt, 200))
        s.complete(s.schedule())
    for _ in range(3):
        k, needs = s.decode_stretch()
        cycle = s.block_cycle()
        assert k == s.decode_stretch_limit() > 20 and len(cycle) == 4
        assert needs.tolist() == [cycle[j % 4] for j in range(k)]
        s.advance_decode(3, sum(cycle[:3]))  # three steps on: the cycle rotates


def test_stretch_not_offered_when_the_queue_head_could_be_admitted() -> None:
    s = make()
    s.add(Seq(0, 4, 30))
    s.complete(s.schedule())
    s.add(Seq(1, 4, 30))
    assert s.decode_stretch()[0] == 0
    full = make(max_num_seqs=1)
    full.add(Seq(0, 4, 30))
    full.complete(full.schedule())
    full.add(Seq(1, 4, 30))
    assert full.decode_stretch()[0] > 0  # no running slot: decode-only
