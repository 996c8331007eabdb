"""Known queues for testing verdicts on correlated latencies (pure)."""

from __future__ import annotations

import numpy as np


def mm1_sojourns(rho: float, n: int, seeds: int, rng: np.random.Generator) -> np.ndarray:
    """Sojourn times of ``n`` requests through an M/M/1 queue (service rate 1, load
    ``rho``) started in steady state, one column per seed (Lindley's recursion).  In
    steady state a sojourn is exponential with rate ``1 - rho``, so the limit that a
    given share of requests exceeds is known exactly, while consecutive requests'
    latencies stay correlated for hundreds of requests near capacity."""
    arrivals = rng.exponential(1.0 / rho, (n, seeds))
    service = rng.exponential(1.0, (n, seeds))
    wait = np.where(rng.random(seeds) < rho, rng.exponential(1.0 / (1.0 - rho), seeds), 0.0)
    out = np.empty((n, seeds))
    for i in range(n):
        out[i] = wait + service[i]
        wait = np.maximum(wait + service[i] - arrivals[i], 0.0)
    return out
