"""The Pareto front of the configs a study measured: goodput per GPU against what each
user gets (output tokens per second per user, or P99 latency).

No config is best on both: a larger batch serves more per GPU and streams each user's
tokens slower.  The front is the configs that no other one beats on both, each at the
rate its ceiling search proved and with its cap, as vLLM's sweep plots it.  Pure: the
recommendation tabulates it and the report draws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol


class _Measured(Protocol):
    """What a point needs of a trial (``analysis.recommend.TrialView`` has it)."""

    @property
    def number(self) -> int: ...
    @property
    def flags(self) -> dict[str, Any]: ...
    @property
    def rate(self) -> float | None: ...
    @property
    def feasible(self) -> bool: ...
    @property
    def value(self) -> float | None: ...
    @property
    def goodput_tokens(self) -> float | None: ...
    @property
    def p99_e2e_s(self) -> float | None: ...
    @property
    def tpot_p50_s(self) -> float | None: ...
    @property
    def gpus(self) -> int: ...
    @property
    def config_key(self) -> str: ...


@dataclass(frozen=True)
class ParetoPoint:
    """One config at its best feasible trial."""

    trial: int
    flags: dict[str, Any]
    gpus: int
    rate: float | None  # req/s its trial passed at
    cap: float | None  # that rate less the headroom
    goodput_per_gpu: float  # output tok/s per GPU of the requests within the SLO
    tokens_per_user: float | None  # output tok/s one user streams: 1 / median TPOT
    p99_e2e_s: float | None
    on_front: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def front(points: Sequence[tuple[float, float]], *, lower_x: bool = False
          ) -> list[tuple[float, float]]:
    """The (x, y) points no other point beats on both (higher y; higher x, or lower
    with ``lower_x``), sorted from the best x.  A tie on both keeps one."""
    out: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0] if lower_x else -p[0], -p[1])):
        if not out or y > out[-1][1]:
            out.append((x, y))
    return out


def pareto_points(views: Sequence[_Measured], *, headroom: float) -> list[ParetoPoint]:
    """One point per feasible config (its trial with the highest objective), with
    ``on_front`` set on the configs no other one beats on both goodput per GPU and
    tokens per user (P99, lower is better, where no TPOT was measured); sorted by
    goodput per GPU, highest first."""
    best: dict[str, _Measured] = {}
    for v in views:
        if not v.feasible or v.value is None or v.goodput_tokens is None:
            continue
        held = best.get(v.config_key)
        if held is None or (v.value, -v.number) > (held.value or 0.0, -held.number):
            best[v.config_key] = v
    points = [ParetoPoint(
        trial=v.number, flags=dict(v.flags), gpus=v.gpus, rate=v.rate,
        cap=None if v.rate is None else v.rate * (1.0 - headroom),
        goodput_per_gpu=(v.goodput_tokens or 0.0) / max(v.gpus, 1),
        tokens_per_user=(1.0 / v.tpot_p50_s if v.tpot_p50_s else None),
        p99_e2e_s=v.p99_e2e_s) for v in best.values()]
    by_user = all(p.tokens_per_user is not None for p in points)
    xy = {id(p): ((p.tokens_per_user if by_user else p.p99_e2e_s), p.goodput_per_gpu)
          for p in points}
    usable = [p for p in points if xy[id(p)][0] is not None]
    on = set(front([xy[id(p)] for p in usable], lower_x=not by_user))  # type: ignore[misc]
    marked = [ParetoPoint(**{**asdict(p), "on_front": xy[id(p)] in on}) for p in points]
    return sorted(marked, key=lambda p: (-p.goodput_per_gpu, p.trial))
