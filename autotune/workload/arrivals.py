"""Arrival schedules for open-loop load: Poisson, gamma (bursty) and constant.

Pure: the HTTP load generator and the simulator draw the same schedule from the same
seed, so a virtual-time run and a real-time run offer exactly the same load.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Process = Literal["poisson", "gamma", "constant"]
PROCESSES: tuple[str, ...] = ("poisson", "gamma", "constant")


def arrival_offsets(
    n: int,
    rate: float,
    *,
    process: Process = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """Send times (seconds from start) of ``n`` requests at ``rate`` req/s.

    Gaps are gamma-distributed with shape ``burstiness`` and mean ``1/rate``, as in
    vLLM's benchmark: shape 1 is Poisson, below 1 is burstier, above 1 smoother.
    ``rate = inf`` sends everything at t=0.  The first request goes at t=0.

    Random gaps are rescaled so that their mean is exactly ``1/rate``: the schedule is
    the arrival process conditioned on its ``n - 1`` gaps spanning ``(n - 1)/rate``
    seconds.  Without that, one unlucky draw of a few hundred gaps offers 10% less
    load than asked, and every figure quoted "at rate R" would be at another rate.
    """
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 req/s, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n == 0:
        return np.zeros(0)
    if np.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    if process == "constant":
        gaps = np.full(n - 1, 1.0 / rate)
    elif process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    elif process == "gamma":
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    else:
        raise ValueError(f"unknown arrival process {process!r}; use one of {', '.join(PROCESSES)}")
    if process != "constant" and gaps.size and gaps.sum() > 0:
        gaps *= (gaps.size / rate) / gaps.sum()
    return np.concatenate([[0.0], np.cumsum(gaps)])
