"""vLLM's API server (the front end) as a stage of the simulated engine.

A client's request passes through the front end twice:

- on the way in, the front end parses the HTTP request, tokenises the prompt and hands
  the request to the engine (``request_s`` of CPU): only then can the scheduler see it;
- on the way out, every token a step produces is detokenised and sent as one SSE chunk
  (``token_s`` of CPU each): the client sees a step's tokens only once that is done.

The front end is one FIFO queue served by ``servers`` API-server processes in parallel
(vLLM's ``--api-server-count``).  Pooling them into one clock that drains ``servers``
CPU-seconds per second keeps the queue a single number, so stretches of decode steps
are still priced in one numpy pass; a request's own parse still takes the full
``request_s`` (one process handles it), only its queueing is pooled.  A step's tokens
reach the client together, when the front end is through with that step's batch.

Where the front end and the engine share a core (vLLM-CPU on a small machine), a share
``share`` of each CPU-second of front-end work is taken from the engine: the engine owes
it (``debt``) and pays it by running its next steps longer, at most ``share x servers``
seconds per second of step (the front end cannot do more beside one step).  Work the
front end does while the engine idles costs the engine nothing.

With both costs 0 the front end is not modelled at all (``FrontEndCosts.active``): the
engine then runs exactly as without this module.  Pure apart from :class:`FrontEnd`,
the mutable clock of one simulation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from autotune.sim.config import EngineSetup


@dataclass(frozen=True)
class FrontEndCosts:
    """What the front end costs (seconds of CPU) and how it shares the engine's core."""

    request_s: float  # per request: HTTP parse, tokenisation, hand-over to the engine
    token_s: float  # per output token: detokenisation and one SSE chunk
    share: float = 0.0  # 0..1 of front-end CPU time taken from the engine's core
    servers: int = 1  # API-server processes working in parallel

    def __post_init__(self) -> None:
        if not (math.isfinite(self.request_s) and math.isfinite(self.token_s)
                and self.request_s >= 0 and self.token_s >= 0):
            raise ValueError(f"front-end costs must be finite and >= 0, got request_s="
                             f"{self.request_s!r} token_s={self.token_s!r}")
        if not 0 <= self.share <= 1:
            raise ValueError(f"front-end share must be between 0 and 1, got {self.share!r}")
        if self.servers < 1:
            raise ValueError(f"front-end servers must be >= 1, got {self.servers!r}")

    @classmethod
    def for_setup(cls, setup: EngineSetup) -> FrontEndCosts:
        """The hardware profile's front-end figures with the config's server count."""
        hw = setup.hardware
        return cls(request_s=hw.frontend_request_ms * 1e-3,
                   token_s=hw.frontend_token_us * 1e-6,
                   share=hw.frontend_engine_share, servers=setup.api_server_count)

    @property
    def active(self) -> bool:
        """Whether the front end costs anything (else the engine skips it entirely)."""
        return self.request_s > 0 or self.token_s > 0

    def capacity_rps(self, output_tokens: float) -> float:
        """Requests per second the front end can serve at ``output_tokens`` each."""
        work = self.request_s + output_tokens * self.token_s
        return self.servers / work if work > 0 else math.inf


def lindley(start: float, add: float, drain: np.ndarray) -> np.ndarray:
    """``x[m+1] = max(x[m] - drain[m], 0) + add`` from ``x[0] = start``: ``x[1..k]``.

    A queue's backlog after each of ``k`` periods that drain ``drain[m]`` and then
    receive ``add``, in one pass (Lindley's recursion as a running minimum) instead of
    a Python loop per step.
    """
    k = len(drain)
    if k == 0:
        return np.zeros(0)
    first = max(start - float(drain[0]), 0.0)  # backlog just before the first add
    walk = np.zeros(k)
    np.cumsum(add - drain[1:], out=walk[1:])
    return np.maximum(first + walk, walk - np.minimum.accumulate(walk)) + add


# One decode step priced by ``FrontEnd.stretch_steps``: (engine time, GPU time, duration,
# end, when the client has its tokens, the engine's debt after it).
StepPrice = tuple[float, float, float, float, float, float]


@dataclass(frozen=True)
class Stretch:
    """A stretch of ``k`` decode steps with the front end priced in (arrays of ``k``)."""

    dur: np.ndarray  # step durations: the engine's own time plus the debt each one pays
    end: np.ndarray  # when each step ends
    seen: np.ndarray  # when the client has each step's tokens
    debt: np.ndarray  # the engine's debt after each step


class FrontEnd:
    """The front end's state during one simulation (the engine is its only user)."""

    def __init__(self, costs: FrontEndCosts) -> None:
        self.costs = costs
        self.free_at = 0.0  # when the front end is through with all work handed to it
        self.debt = 0.0  # engine seconds owed to front-end work done on its core
        self.work_s = 0.0  # front-end CPU seconds so far (for its utilisation)
        # What one step may pay of its debt, per second of the step's own time.
        self._pay_rate = costs.share * costs.servers

    def take_request(self, t: float) -> float:
        """A request reaches the front end at ``t``: when the scheduler can see it."""
        c = self.costs
        start = max(t, self.free_at)
        self.free_at = start + c.request_s / c.servers
        self.debt += c.share * c.request_s
        self.work_s += c.request_s
        return start + c.request_s

    def step_extra(self, base_s: float) -> float:
        """Seconds a step of ``base_s`` of engine time runs longer (it pays its debt)."""
        extra = min(self.debt, self._pay_rate * base_s)
        self.debt -= extra
        return extra

    def emit(self, t: float, tokens: int) -> float:
        """A step ending at ``t`` produced ``tokens``: when the client has them."""
        c = self.costs
        work = tokens * c.token_s
        self.free_at = max(self.free_at, t) + work / c.servers
        self.debt += c.share * work
        self.work_s += work
        return self.free_at

    def idle(self, seconds: float) -> None:
        """The engine idled ``seconds``: front-end work done meanwhile cost it nothing."""
        self.debt = max(self.debt - self._pay_rate * seconds, 0.0)

    def stretch(self, now: float, base: np.ndarray, tokens: int) -> Stretch:
        """Price ``len(base)`` decode steps from ``now``, each producing ``tokens``.

        The same arithmetic as :meth:`step_extra` then :meth:`emit` per step, as
        recursions solved in one pass (:func:`lindley`); :meth:`apply` commits a prefix.
        """
        c = self.costs
        work = tokens * c.token_s
        lag = self.free_at - now
        first = float(base[0])
        if work <= c.servers * first and lag <= first and self.debt <= self._pay_rate * first:
            # The usual case, in closed form: the front end keeps up with every step
            # (decode steps only grow longer as the context grows), so after the first
            # step each one pays exactly its own tokens' debt and they reach the client
            # one batch later.
            dur = base + c.share * work
            dur[0] = first + self.debt
            ends = dur.cumsum() + now
            seen = ends + work / c.servers
            seen[0] = max(self.free_at, float(ends[0])) + work / c.servers
            return Stretch(dur=dur, end=ends, seen=seen,
                           debt=np.full(len(base), c.share * work))
        cap = self._pay_rate * base
        debt = lindley(self.debt, c.share * work, cap)
        owed = np.concatenate(([self.debt], debt[:-1]))  # debt as each step starts
        dur = base + np.minimum(owed, cap)
        ends = dur.cumsum() + now
        backlog = lindley(self.free_at - now, work / c.servers, dur)
        return Stretch(dur=dur, end=ends, seen=ends + backlog, debt=debt)

    def stretch_steps(self, now: float, steps: Iterable[tuple[float, float]],
                      tokens: int) -> Iterator[StepPrice]:
        """:meth:`stretch` one step at a time: for each ``(base, gpu)`` of ``steps``, the
        step's ``(base, gpu, dur, end, seen, debt)`` (``gpu`` passes through untouched).

        The same floating-point operations in the same order as :meth:`stretch` and
        :func:`lindley` (cumulative sums added up in order, the running minimum carried),
        so the same values: cheaper than numpy for a few steps.  Reads the state once, at
        the first step, and changes nothing (:meth:`commit` does that).
        """
        c = self.costs
        work = tokens * c.token_s
        it = iter(steps)
        first = next(it, None)
        if first is None:
            return
        base0 = first[0]
        if (work <= c.servers * base0 and self.free_at - now <= base0
                and self.debt <= self._pay_rate * base0):
            yield from self._steps_keeping_up(now, first, it, work)
        else:
            yield from self._steps_lindley(now, first, it, work)

    def _steps_keeping_up(self, now: float, first: tuple[float, float],
                          it: Iterator[tuple[float, float]], work: float) -> Iterator[StepPrice]:
        """``stretch_steps`` in the closed form of :meth:`stretch`'s usual case."""
        c = self.costs
        paid, lag = c.share * work, work / c.servers
        base, gpu = first
        elapsed = dur = base + self.debt
        end = elapsed + now
        yield base, gpu, dur, end, max(self.free_at, end) + lag, paid
        for base, gpu in it:
            dur = base + paid
            elapsed += dur
            end = elapsed + now
            yield base, gpu, dur, end, end + lag, paid

    def _steps_lindley(self, now: float, first: tuple[float, float],
                       it: Iterator[tuple[float, float]], work: float) -> Iterator[StepPrice]:
        """``stretch_steps`` through :func:`lindley`'s recursions, carried step by step:
        the engine's debt (drained by each step's cap) and the front end's backlog
        (drained by each step's duration)."""
        c = self.costs
        pay, paid, lag = self._pay_rate, c.share * work, work / c.servers
        base, gpu = first
        cap = pay * base
        owed = self.debt
        dur = base + min(owed, cap)
        d_first = max(owed - cap, 0.0)  # lindley's ``first`` for the debt ...
        b_first = max((self.free_at - now) - dur, 0.0)  # ... and for the backlog
        d_walk = d_low = b_walk = b_low = 0.0  # walks and their running minima
        elapsed = dur
        end = elapsed + now
        owed = max(d_first + d_walk, d_walk - d_low) + paid
        yield base, gpu, dur, end, end + (max(b_first + b_walk, b_walk - b_low) + lag), owed
        for base, gpu in it:
            cap = pay * base
            dur = base + min(owed, cap)
            d_walk += paid - cap
            d_low = min(d_low, d_walk)
            b_walk += lag - dur
            b_low = min(b_low, b_walk)
            elapsed += dur
            end = elapsed + now
            owed = max(d_first + d_walk, d_walk - d_low) + paid
            yield base, gpu, dur, end, end + (max(b_first + b_walk, b_walk - b_low) + lag), owed

    def apply(self, stretch: Stretch, k: int, tokens: int) -> None:
        """Commit the first ``k`` steps of ``stretch`` (each produced ``tokens``)."""
        self.commit(float(stretch.seen[k - 1]), float(stretch.debt[k - 1]), k, tokens)

    def commit(self, seen: float, debt: float, k: int, tokens: int) -> None:
        """Commit ``k`` priced steps (each produced ``tokens``), the last of which the
        client sees at ``seen`` and leaves the engine ``debt``."""
        self.free_at = max(self.free_at, seen)
        self.debt = debt
        self.work_s += k * tokens * self.costs.token_s
