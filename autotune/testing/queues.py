"""Known queues for testing verdicts on correlated latencies (pure)."""

from __future__ import annotations

import math

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


def slow_swings(n: int, seeds: int, rng: np.random.Generator, *, memory: float = 1500.0,
                swing: float = 0.5, noise: float = 0.5) -> tuple[np.ndarray, float]:
    """Lognormal latencies whose log is a slowly wandering state (an AR(1) process that
    forgets over ``memory`` requests, standard deviation ``swing``) plus independent
    noise: a server whose load swings over minutes.  One column per seed, the state
    started in its stationary law.  Also returns the log-latency's standard deviation,
    from which the level a given share of requests exceeds is known exactly."""
    keep = math.exp(-1.0 / memory)
    state = np.empty((n, seeds))
    state[0] = rng.standard_normal(seeds) * swing
    step = rng.standard_normal((n, seeds)) * swing * math.sqrt(1.0 - keep * keep)
    for i in range(1, n):
        state[i] = keep * state[i - 1] + step[i]
    return np.exp(state + noise * rng.standard_normal((n, seeds))), math.hypot(swing, noise)
