"""Test helpers: a small, real OpenAI-compatible streaming server (``fake_server``)."""

from __future__ import annotations

from typing import Any

from autotune.testing import fake_server

__all__ = ["FakeServer", "FakeServerConfig", "FakeServerProcess"]


def __getattr__(name: str) -> Any:
    # Lazy, so ``python -m autotune.testing.fake_server`` does not import itself twice.
    if name in __all__:
        return getattr(fake_server, name)
    raise AttributeError(name)
