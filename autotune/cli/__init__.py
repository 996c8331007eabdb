"""The ``autotune`` command: one module per subcommand, all on one Typer app."""

from __future__ import annotations

import importlib

from autotune.cli._app import app

# Each module registers its subcommand on ``app`` when imported.  A module that is not
# written yet is skipped so the other commands keep working.
_COMMANDS = ("bench", "search", "ceiling", "calibrate", "report", "sweep", "worker",
             "serve_sim", "workload")

for _name in _COMMANDS:
    try:
        importlib.import_module(f"autotune.cli.{_name}")
    except ModuleNotFoundError as exc:  # pragma: no cover - only while modules are missing
        if exc.name != f"autotune.cli.{_name}":
            raise


def main() -> None:
    app()
