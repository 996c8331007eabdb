"""How long building a workload takes: parsing ShareGPT, tokenizing, synthetic prompts.

Run: ``python benchmarks/workload_load.py``.  Wall-clock times of one process on this
machine (each step once, after the step before it; figures are measured, not simulated).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from autotune.workload.sources import load_sharegpt, read_sharegpt, synthetic_workload
from autotune.workload.tokenizer import load_tokenizer

T = TypeVar("T")


def timed(label: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    out = fn()
    print(f"{label}: {time.perf_counter() - t0:.2f} s")
    return out


def main() -> None:
    conversations, stats = timed("parse shipped ShareGPT (first read in this process)",
                                 read_sharegpt)
    print(f"  {stats.records:,} complete records, {stats.multi_turn:,} with >= 2 turns, "
          f"ended early={stats.ended_early} at byte {stats.end_byte:,} of {stats.file_bytes:,}")
    timed("read again (in-process cache)", read_sharegpt)
    tok = timed("load tekken_240911 tokenizer", load_tokenizer)
    texts = [c.turns[i] for c in conversations[:6000] if len(c.turns) >= 2 for i in (0, 1)]
    texts = texts[:10_000]
    counts = timed(f"count {len(texts):,} ShareGPT texts with tekken",
                   lambda: tok.count_many(texts))
    print(f"  {sum(counts):,} tokens")
    for n in (2000, 10_000):
        w = timed(f"build a {n:,}-request ShareGPT workload (max_model_len 2048, seed 0)",
                  lambda n=n: load_sharegpt(tokenizer=tok, num_prompts=n))
        p = np.array([r.prompt_tokens for r in w.requests])
        o = np.array([r.output_tokens for r in w.requests])
        print(f"  {len(w.requests):,} pairs; prompt tokens p50 {np.median(p):.0f} mean "
              f"{p.mean():.1f}; output tokens p50 {np.median(o):.0f} mean {o.mean():.1f} "
              f"({tok.name})")
    w = timed("build 1,000 synthetic prompts, lognormal mean 1024 (cv 0.5), exact counts",
              lambda: synthetic_workload(tok, num_prompts=1000, input_len=1024, output_len=128,
                                         distribution="lognormal", input_spread=0.5))
    exact = sum(r.prompt_tokens == tok.count(r.prompt) for r in w.requests)
    print(f"  {exact}/{len(w.requests)} prompts re-counted to their recorded length")


if __name__ == "__main__":
    main()
