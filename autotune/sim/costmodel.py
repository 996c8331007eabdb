"""Step-time cost model: a roofline per engine step plus TP all-reduces and host overhead.

step = max(compute, memory) + TP communication + host overhead, where

- compute = (2 x matmul params x batch tokens + attention FLOPs) / (TP x achieved FLOP/s);
  attention FLOPs = 4 x layers x q-heads x head_dim x (query, key) pairs;
- memory = (weights / TP + KV bytes read / TP) / achieved bandwidth;
- communication = 2 all-reduces per layer of the batch's hidden states, ring algorithm:
  latency + 2 (TP-1)/TP x bytes / link bandwidth each;
- host overhead = fixed per step + per scheduled sequence (scheduling, sampling, output).

The GPU part (everything but host overhead) is what the simulator reports as busy time.
Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from autotune.sim.config import EngineSetup


@dataclass(frozen=True)
class StepCost:
    total_s: float
    gpu_s: float  # compute/memory roofline + communication: the "busy" part


@dataclass(frozen=True)
class CostModel:
    """Per-step cost coefficients for one engine setup (seconds)."""

    s_per_token_compute: float  # dense matmul time per batch token
    s_per_pair: float  # attention time per (query, key) pair
    s_weights: float  # time to stream the weight shard once
    s_per_kv_token: float  # time to read one token's KV shard
    s_comm_fixed: float  # all-reduce latency per step (all layers)
    s_comm_per_token: float  # all-reduce transfer time per batch token
    s_step: float  # host overhead per step
    s_per_seq: float  # host overhead per scheduled sequence

    @classmethod
    def for_setup(cls, setup: EngineSetup) -> CostModel:
        hw, m, tp = setup.hardware, setup.model, setup.tensor_parallel_size
        flops = tp * hw.achieved_flops
        bw = hw.achieved_bandwidth
        comm_fixed = comm_tok = 0.0
        if tp > 1:
            n_allreduce = 2 * m.num_layers
            comm_fixed = n_allreduce * hw.allreduce_latency_us * 1e-6
            ring = 2 * (tp - 1) / tp * m.hidden_size * m.dtype_bytes
            comm_tok = n_allreduce * ring / hw.achieved_link_bandwidth
        return cls(
            s_per_token_compute=2 * m.matmul_params / flops,
            s_per_pair=4 * m.num_layers * m.num_attention_heads * m.head_dim / flops,
            s_weights=m.weight_bytes / tp / bw,
            s_per_kv_token=m.kv_bytes_per_token / tp / bw,
            s_comm_fixed=comm_fixed,
            s_comm_per_token=comm_tok,
            s_step=hw.step_overhead_ms * 1e-3,
            s_per_seq=hw.per_seq_overhead_us * 1e-6,
        )

    def step(self, tokens: int, seqs: int, kv_tokens: float, pairs: float) -> StepCost:
        """One step of ``tokens`` batch tokens over ``seqs`` sequences.

        ``kv_tokens``: KV entries read (context plus new tokens, summed over sequences);
        ``pairs``: attention (query, key) pairs, summed over sequences.
        """
        return StepCost(*self.step_s(tokens, seqs, kv_tokens, pairs))

    def step_s(self, tokens: int, seqs: int, kv_tokens: float,
               pairs: float) -> tuple[float, float]:
        """``step`` as a plain ``(total_s, gpu_s)`` pair (the simulator's loop calls it
        once per step: building a frozen dataclass would cost more than the arithmetic)."""
        compute = tokens * self.s_per_token_compute + pairs * self.s_per_pair
        memory = self.s_weights + kv_tokens * self.s_per_kv_token
        gpu = max(compute, memory) + self.s_comm_fixed + tokens * self.s_comm_per_token
        return gpu + self.s_step + seqs * self.s_per_seq, gpu

    def decode_steps(self, seqs: int, kv0: float, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(total, gpu) times of ``k`` decode-only steps of ``seqs`` sequences.

        The first step reads ``kv0`` KV entries; each step after reads ``seqs`` more (every
        sequence grew by one token).  For decode, pairs equal KV entries read.
        """
        # Few numpy calls, and no max where it cannot matter: on a few dozen steps each
        # call costs more than its arithmetic.  KV counts are whole numbers, so ``arange``
        # gives them exactly (and exactly k of them).
        if seqs:
            kv = np.arange(kv0, kv0 + seqs * k, seqs, dtype=np.float64)
        else:
            kv = np.full(k, float(kv0))
        memory = kv * self.s_per_kv_token
        memory += self.s_weights
        if self._memory_bound(seqs):
            gpu = memory
        else:
            compute = kv * self.s_per_pair
            compute += seqs * self.s_per_token_compute
            gpu = np.maximum(compute, memory, out=compute)
        gpu += self.s_comm_fixed + seqs * self.s_comm_per_token
        return gpu + (self.s_step + seqs * self.s_per_seq), gpu

    def decode_step_iter(self, seqs: int, kv0: float) -> Iterator[tuple[float, float]]:
        """``decode_steps`` one step at a time, without end: the same floating-point
        operations in the same order, so the same values (KV counts are whole numbers, so
        adding ``seqs`` step by step is exact).  Cheaper than numpy for a few steps."""
        per_kv, weights = self.s_per_kv_token, self.s_weights
        comm = self.s_comm_fixed + seqs * self.s_comm_per_token
        host = self.s_step + seqs * self.s_per_seq
        kv = kv0
        if self._memory_bound(seqs):
            while True:
                gpu = kv * per_kv + weights + comm
                yield gpu + host, gpu
                kv += seqs
        per_pair, flops = self.s_per_pair, seqs * self.s_per_token_compute
        while True:
            gpu = max(kv * per_pair + flops, kv * per_kv + weights) + comm
            yield gpu + host, gpu
            kv += seqs

    def _memory_bound(self, seqs: int) -> bool:
        """Whether a decode step of ``seqs`` sequences is memory-bound at every context.

        Memory time has the larger intercept and slope, so it is the larger at any
        ``kv >= 0``, in floating point too (rounding is monotone): the max is exact.
        """
        return (self.s_per_kv_token >= self.s_per_pair
                and self.s_weights >= seqs * self.s_per_token_compute)

