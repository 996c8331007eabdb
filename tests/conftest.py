"""Shared test fixtures.  Puts the repository root on sys.path (no install needed)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# pytest-xdist's workers export COLUMNS=80, and a rich Console pins the COLUMNS it sees
# when it is made (the CLI's are made at import): a test that sets COLUMNS for one
# invocation (CliRunner's env) would not get its width under xdist.
os.environ.pop("COLUMNS", None)
# pytest-xdist's workers ignore SIGINT (the controller handles Ctrl-C); an ignored signal
# is inherited across exec, so every process a test starts would ignore Ctrl-C too, and
# autotune rightly leaves an ignored signal alone.  Tests run with Python's default.
signal.signal(signal.SIGINT, signal.default_int_handler)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autotune.testing.fake_server import FakeServer, FakeServerProcess  # noqa: E402


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """Factory: ``fake_server(token_delay_s=0.002, ...)`` starts an in-process fake
    OpenAI-compatible server on a free 127.0.0.1 port; every one is stopped after the
    test."""
    started: list[FakeServer] = []

    def start(**knobs: Any) -> FakeServer:
        server = FakeServer(**knobs).start()
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def fake_server_process() -> Iterator[Callable[..., FakeServerProcess]]:
    """Factory: ``fake_server_process("--token-delay-ms", "2")`` runs the fake server
    as a child process (its own GIL); every one is stopped after the test."""
    started: list[FakeServerProcess] = []

    def start(*args: str) -> FakeServerProcess:
        server = FakeServerProcess(args).start()
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``) the tests that start real vLLM share one
    worker, so that two vLLM servers never fight over this machine's cores at once."""
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.xdist_group("vllm"))
