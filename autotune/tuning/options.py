"""Options shared by the commands: how each is read, in one place, with one meaning.

Each helper turns what a user typed into a typed value or raises :class:`OptionsError`
with one line that names the option and says how to fix it.
"""

from __future__ import annotations

import re
from typing import Any

from autotune.core.errors import AutotuneError

DEFAULT_PROFILE = ("a100-80gb", "llama-3-8b", 4)
# The context length (longest prompt + output kept from ShareGPT) when neither the config
# nor the server says one.
DEFAULT_CONTEXT = 8192


class OptionsError(AutotuneError, ValueError):
    """An option the user can fix; the message names it and says how."""


def duration(name: str, text: str | None) -> float | None:
    if text is None:
        return None
    from autotune.core.slo import SLOError, parse_duration

    try:
        return parse_duration(text)
    except SLOError as exc:
        raise OptionsError(f"{name}: {exc}") from None


def parse_profile(text: str | None, space_profile: dict[str, Any], gpus: int | None
                  ) -> tuple[str, str, int]:
    hw, mdl, count = (space_profile.get("hardware", DEFAULT_PROFILE[0]),
                      space_profile.get("model", DEFAULT_PROFILE[1]),
                      int(space_profile.get("gpus", DEFAULT_PROFILE[2])))
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
    from autotune.sim.profiles import load_hardware

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
                 backlog_share: float = 0.02) -> Any:
    """The steady-state rule of every load test from the CLI's duration options."""
    from autotune.tuning.verdict import SteadyState, VerdictError

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
