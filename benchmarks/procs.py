"""Child processes the benchmarks start (servers under test): stop them for sure."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, five seconds' grace, then SIGKILL; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
