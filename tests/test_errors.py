"""One error tree: every error the library means for its user derives from
``AutotuneError``, and the CLI turns any of them into one line and exit 2."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import typer

import autotune
from autotune.cli._common import one_line_errors
from autotune.core.errors import AutotuneError

# A signal, not an error: it must stay out of ``except Exception`` (so a trial's own
# handlers cannot swallow SIGTERM), hence a KeyboardInterrupt and never an AutotuneError.
# Only BaseExceptions that are not Exceptions may be listed here.
SIGNALS = {"autotune.study.worker.Terminated"}


def exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(autotune.__path__, "autotune."):
        if info.name == "autotune.__main__":
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_autotune_defines_is_an_autotune_error() -> None:
    classes = exception_classes()
    assert len(classes) > 30  # the walk found the package's modules
    # Internal ones too (Surplus, TrialFailed, the transport's): their handlers catch
    # them by class long before the CLI's one-line handler could.
    outside = sorted(name for name, cls in classes.items()
                     if not issubclass(cls, AutotuneError) and name not in SIGNALS)
    assert outside == []
    assert {n for n in SIGNALS if issubclass(classes[n], Exception)} == set()
    assert SIGNALS <= classes.keys()  # a renamed signal class must be renamed here too


def test_the_check_catches_an_exception_outside_the_tree(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    import autotune.core.files as files

    class Stray(Exception):
        pass

    Stray.__module__ = files.__name__
    monkeypatch.setattr(files, "Stray", Stray, raising=False)
    with pytest.raises(AssertionError, match="Stray"):
        test_every_exception_autotune_defines_is_an_autotune_error()


@pytest.mark.parametrize("exc", [
    AutotuneError("bad thing\nmore detail"),
    importlib.import_module("autotune.core.slo").SLOError("bad thing"),
    importlib.import_module("autotune.study.storage").StudyError("bad thing"),
])
def test_one_line_errors_prints_the_first_line_and_exits_2(exc: Exception,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    with pytest.raises(typer.Exit) as e, one_line_errors():
        raise exc
    assert e.value.exit_code == 2
    err = capsys.readouterr().err
    assert "bad thing" in err and "more detail" not in err and "Traceback" not in err


def test_a_bug_keeps_its_traceback() -> None:
    with pytest.raises(KeyError), one_line_errors():
        raise KeyError("a bug, not a user error")
