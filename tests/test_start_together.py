"""Processes started in the same instant against a storage that does not exist yet all
join one study: Optuna's schema creation is serialised (a file lock for SQLite, a retry
on the known collision for PostgreSQL), and a worker waits for a study it cannot create.

Each process imports everything first, says "ready", and then blocks on its stdin; the
test releases all of them with one write each, so they open the storage together.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from autotune.storage import open_storage, schema_race, schema_race_retry
from autotune.study import StudyError
from autotune.worker import join_study

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pg import NoPostgres, Postgres, postgres  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
N = 4

JOINER = textwrap.dedent("""
    import json, logging, os, sys
    sys.path.insert(0, {root!r})
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import optuna
    from autotune.storage import open_storage
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url, name = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    sys.stdin.readline()  # the start signal: every process opens the storage now
    storage = open_storage(url, heartbeat_interval=None, grace_period=None)
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                direction="maximize")
    trial = study.ask()
    study.tell(trial, float(os.getpid()))
    print(json.dumps({{"pid": os.getpid()}}), flush=True)
""")


def start_together(tmp: Path, url: str, name: str) -> list[tuple[int, str, str, int]]:
    """Run N joiners released at once; (exit status, stdout, stderr, pid) of each."""
    script = tmp / "joiner.py"
    script.write_text(JOINER.format(root=str(ROOT)))
    procs = [subprocess.Popen([sys.executable, str(script), url, name],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(N)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            out.append((p.returncode, stdout, stderr, p.pid))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def assert_one_study_joined_by_all(url: str, name: str,
                                   results: list[tuple[int, str, str, int]]) -> None:
    for rc, _, stderr, _ in results:
        assert rc == 0, stderr
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    reported = [json.loads(out.splitlines()[-1])["pid"] for _, out, _, _ in results]
    assert sorted(reported) == sorted(pid for *_, pid in results)
    storage = open_storage(url, heartbeat_interval=None, grace_period=None)
    studies = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    assert studies.count(name) == 1
    study = optuna.load_study(study_name=name, storage=storage)
    assert sorted(int(t.value) for t in study.trials) == sorted(reported)


def test_four_processes_create_one_study_in_a_new_sqlite_file(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    url = f"sqlite:///{db}"
    results = start_together(tmp_path, url, "together")
    assert_one_study_joined_by_all(url, "together", results)


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    try:
        with postgres() as server:
            yield server
    except NoPostgres as exc:
        pytest.skip(f"no PostgreSQL: {exc}")


@pytest.mark.postgres
def test_four_processes_create_one_study_in_an_empty_postgresql(pg: Postgres,
                                                                tmp_path: Path) -> None:
    results = start_together(tmp_path, pg.url, "together")
    assert_one_study_joined_by_all(pg.url, "together", results)
    raced = sum("created concurrently" in stderr for _, _, stderr, _ in results)
    print(f"{raced} of {N} processes lost the schema race and opened again")


def test_schema_race_is_told_from_other_errors_and_retried() -> None:
    race = RuntimeError('duplicate key value violates unique constraint '
                        '"pg_type_typname_nsp_index"')
    assert schema_race(race)
    assert not schema_race(RuntimeError('password authentication failed for user "x"'))
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise race
        return "open"

    assert schema_race_retry(flaky, sleep=lambda s: None) == "open" and len(calls) == 3
    with pytest.raises(ValueError):
        schema_race_retry(lambda: (_ for _ in ()).throw(ValueError("other")),
                          sleep=lambda s: None)


def test_a_worker_waits_for_the_study_then_says_it_was_not_created(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path / 'w.db'}")
    said: list[str] = []
    with pytest.raises(StudyError, match=r"no study 'later' in this storage \(waited"):
        join_study(storage, "later", None, wait_s=0.2, poll_s=0.05, say=said.append)
    assert len(said) == 1 and "waiting up to 0.2 s for study 'later'" in said[0]
    with pytest.raises(StudyError, match="no study 'now' in this storage:"):
        join_study(storage, "now", None)  # wait_s=0: at once, and without a word


def test_a_worker_joins_a_study_created_while_it_waits(tmp_path: Path) -> None:
    import threading

    from autotune.space import SearchSpace
    from autotune.worker import SPEC_ATTR, StudySpec, space_to_dict

    url = f"sqlite:///{tmp_path / 'w.db'}"
    storage = open_storage(url)
    spec = StudySpec(space=space_to_dict(SearchSpace.load("default")), slo="10s")
    waiting = threading.Event()

    def create_once_waiting() -> None:
        waiting.wait(30)  # the worker has said that it waits
        other = open_storage(url)
        sid = other.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "soon")
        other.set_study_user_attr(sid, SPEC_ATTR, spec.to_dict())

    creator = threading.Thread(target=create_once_waiting)
    creator.start()
    try:
        joined, created = join_study(storage, "soon", None, wait_s=60, poll_s=0.05,
                                     say=lambda line: waiting.set())
    finally:
        waiting.set()
        creator.join()
    assert joined == spec and not created
