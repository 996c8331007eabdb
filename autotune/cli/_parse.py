"""How the commands read what a user typed: each helper turns option strings into a
typed value (seconds, an SLO, a space, a profile, an option group of
:mod:`autotune.tuning.options`), or raises :class:`OptionsError` with one line that
names the option and says how to fix it.  The library never sees an option string.
"""

from __future__ import annotations

import re
from typing import Any

from autotune.core.errors import AutotuneError
from autotune.core.slo import SLO, SLOError, combine, parse_duration
from autotune.sim.profiles import load_hardware
from autotune.study.space import SearchSpace
from autotune.tuning.load_unit import LoadUnit
from autotune.tuning.options import (
    OptionsError,
    ServerOptions,
    SimProfile,
    at_least,
    check_backend,
)
from autotune.tuning.verdict import SteadyState, VerdictError


def duration(name: str, text: str | None) -> float | None:
    """'90s' -> 90.0 (None: not given)."""
    if text is None:
        return None
    try:
        return parse_duration(text)
    except SLOError as exc:
        raise OptionsError(f"{name}: {exc}") from None


def load_unit(by: str, think_time: str | None, think: str) -> LoadUnit:
    """``--by`` with ``--think-time`` and ``--think`` as one load unit."""
    try:
        return LoadUnit.of(by, duration("--think-time", think_time), think)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None


def parse_profile(text: str | None, space_profile: dict[str, Any], gpus: int | None
                  ) -> tuple[str, str, int]:
    base = SimProfile.of_space(space_profile)
    hw, mdl, count = base.hardware, base.model, base.gpus
    if text:
        head, _, tail = text.partition(":")
        m = re.match(r"^(\d+)\s*[x×]\s*(.+)$", head.strip())
        if m:
            count, head = int(m.group(1)), m.group(2)
        elif head.strip() and "gpus" not in space_profile:
            # A hardware named without a count is its own default node ("cpu-tiny" is
            # one CPU), not the default profile's four GPUs.
            count = _default_node(head.strip(), count)
        hw = head.strip() or hw
        mdl = tail.strip() or mdl
    if gpus is not None:
        count = gpus
    return hw, mdl, count


def _default_node(hardware: str, fallback: int) -> int:
    try:
        return load_hardware(hardware).gpus
    except (AutotuneError, OSError, ValueError):  # said where the profile is loaded
        return fallback


def parse_gpu_ids(text: str | None) -> list[int] | None:
    """'0,1' -> [0, 1] (CUDA_VISIBLE_DEVICES of the server)."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise OptionsError(f"--gpu-ids {text!r}: give GPU numbers separated by commas, e.g. 0,1")
    if len(set(parts)) != len(parts):
        raise OptionsError(f"--gpu-ids {text!r}: a GPU is listed twice")
    return [int(p) for p in parts]


def parse_env(items: list[str]) -> dict[str, str]:
    """['KEY=VAL', ...] -> {KEY: VAL}."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise OptionsError(f"--vllm-env {item!r}: give KEY=VALUE, e.g. "
                             "VLLM_CPU_KVCACHE_SPACE=1")
        env[key] = value
    return env


def parse_steady(min_duration: str | None, max_duration: str | None, num_prompts: int,
                 backlog_share: float = 0.02) -> SteadyState:
    """The steady-state rule of every load test from the CLI's duration options."""
    try:
        return SteadyState(min_duration_s=duration("--min-duration", min_duration),
                           max_duration_s=duration("--max-duration", max_duration),
                           min_requests=num_prompts, backlog_share=backlog_share)
    except VerdictError as exc:
        raise OptionsError(f"--min-duration/--max-duration/--backlog-share: {exc}") from None


def parse_validate(text: str) -> float | None:
    """'5m' -> 300.0; 'off' or '0' -> None."""
    if text.strip().lower() in ("off", "0", "no", "none"):
        return None
    return duration("--validate", text)


def parse_slo(slo_p99: str | None, slo: str | None) -> SLO:
    """--slo-p99 and --slo as one SLO; one of them is needed."""
    if slo_p99 is None and slo is None:
        raise OptionsError("no SLO given: pass --slo-p99 10s (and/or --slo LIMITS)")
    return combine(slo_p99, slo)


def load_space(text: str) -> SearchSpace:
    """--space: a YAML path or a name in search_spaces/."""
    return SearchSpace.load(text)


def sim_profile(text: str | None, space: SearchSpace | None, gpus: int | None, *,
                model: str | None = None) -> SimProfile:
    """--profile HARDWARE[:MODEL] and --gpus over the space's own profile, if any;
    ``model`` (--model-profile) over the model --profile names."""
    at_least("--gpus", gpus, 1)
    hardware, named, count = parse_profile(text, {} if space is None else space.profile,
                                           gpus)
    return SimProfile(hardware=hardware, model=model or named, gpus=count)


def server_options(*, model: str | None, url: str | None, vllm_cmd: str,
                   startup_timeout: float, gpu_ids: str | None,
                   vllm_env: list[str] | None) -> ServerOptions:
    """The server flags of a command as one typed group."""
    ids = parse_gpu_ids(gpu_ids)
    return ServerOptions(model=model, url=url, vllm_cmd=vllm_cmd,
                         startup_timeout_s=startup_timeout,
                         gpu_ids=None if ids is None else tuple(ids),
                         env=parse_env(list(vllm_env or ())))


def backend_kind(backend: str | None, *, url: str | None, model: str | None) -> str:
    """--backend, or what --url (attach) and --model (vllm) imply; sim without either."""
    kind = backend or ("attach" if url else "vllm" if model else "sim")
    check_backend(kind, url)
    return kind
