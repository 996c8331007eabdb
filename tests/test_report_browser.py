"""The HTML report in headless Chromium: no console errors, every image shows.

The page carries a tiny check script (``autotune.report.render.CHECK_SCRIPT``) that,
on ``load``, writes ``data-check`` on ``<body>``: ``ok``, ``broken:<srcs>`` or
``error:<what>`` (script errors, failed resource loads, ``console.error``).  Chromium
dumps the DOM after load and we read that attribute; Chromium's own log of console
messages is checked too.  Needs Debian's ``chromium`` package; skipped without it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import optuna
import pytest

from autotune.report import write_report
from autotune.report.sample import make_sample_study

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                         "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)")

optuna.logging.set_verbosity(optuna.logging.WARNING)


def dump_dom(page: Path, profile: Path) -> tuple[str, str]:
    """(DOM after load, Chromium's stderr log).  The whole process group is stopped."""
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
            "--disable-breakpad", "--disable-crash-reporter",
            f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
            "--dump-dom", page.resolve().as_uri()]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # helpers (zygote, renderer) too
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    return out, err


def body_attrs(dom: str) -> dict[str, str]:
    m = re.search(r"<body([^>]*)>", dom)
    assert m, dom[:500]
    return dict(re.findall(r'([\w-]+)="([^"]*)"', m.group(1)))


def console_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("browser")
    storage = f"sqlite:///{d}/b.db"
    make_sample_study(storage, "b")
    return write_report("b", storage, d / "out"), d


def test_report_loads_without_errors_and_every_image_shows(report):
    paths, d = report
    dom, log = dump_dom(paths.html, d / "profile1")
    attrs = body_attrs(dom)
    assert attrs.get("data-check") == "ok", attrs
    assert int(attrs["data-images"]) == len(paths.plots) == 5
    assert console_lines(log) == []


def test_the_check_catches_a_missing_image(report, tmp_path):
    paths, d = report
    # Same page, one plot gone: the check must say so (this proves the test above).
    shutil.copytree(paths.out_dir, tmp_path / "copy")
    (tmp_path / "copy" / "plots" / "history.png").unlink()
    dom, _ = dump_dom(tmp_path / "copy" / "report.html", d / "profile2")
    check = body_attrs(dom)["data-check"]
    assert check.startswith(("error:", "broken:")) and "history.png" in check
