"""Processes started in the same instant against a storage that does not exist yet all
join one study: Optuna's schema creation is serialised (a file lock for SQLite, a retry
on the known collision for PostgreSQL), and a worker waits for a study it cannot create.

Each process imports everything first, says "ready", and then blocks on its stdin; the
test releases all of them with one write each, so they open the storage together.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.study.storage import StudyError, open_storage, schema_race, schema_race_retry
from autotune.study.study import process_running
from autotune.study.worker import join_study

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pg import NoPostgres, Postgres, postgres  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
N = 4

JOINER = textwrap.dedent("""
    import json, logging, os, sys
    sys.path.insert(0, {root!r})
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import optuna
    from autotune.study.storage import open_storage
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

    from autotune.study.space import SearchSpace
    from autotune.study.worker import SPEC_ATTR, StudySpec, space_to_dict

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


# ------------------------------------------------- a search and 4 workers, started together

SEARCH_AND_WORKERS_TRIALS = 10


def _cli(tmp: Path, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=tmp,
                                env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, log


TOGETHER_SPACE = """\
name: together
fixed: {{model: {model}}}
parameters:
  max_num_seqs: {{type: int, low: 1, high: 256}}
  request_rate: {{type: float, low: 10, high: 20}}
rules: []
"""


def _search_and_workers(tmp: Path, url: str, name: str) -> None:
    """`autotune search` and 4 `autotune worker`s, started in the same instant on one
    study that does not exist yet.  Every process launches a real server per trial (the
    fake vLLM server) and load-tests it in real time, as on GPUs, so that the five take
    turns at the study's seats."""
    n, model = SEARCH_AND_WORKERS_TRIALS, f"fake-together-{os.getpid()}"
    space = tmp / "together.yaml"
    space.write_text(TOGETHER_SPACE.format(model=model))
    server = f"{sys.executable} -m autotune.testing.fake_server --token-delay-ms 1 --eos-after 8"
    common = ["--storage", url, "--n-trials", str(n), "--space", str(space),
              "--backend", "vllm", "--vllm-cmd", server, "--model", model,
              # A pass needs about 70 judged requests (P90, two looks): 12 s gives the
              # five processes' starved fake servers room to show them.
              "--num-prompts", "10", "--warmup", "2", "--min-duration", "1s",
              "--max-duration", "12s", "--backlog-share", "0.5", "--max-probes", "2",
              "--studies-dir", str(tmp / "studies")]
    # The search draws synthetic requests as the workers do: reading ShareGPT made it the
    # last of the five to join on a loaded host, after the workers had taken every trial.
    search = ["search", "--study-name", name, "--slo", "p90:e2e<=1s", "--validate", "off",
              "--refine-top", "0", "--dataset", "synthetic", *common]
    # Heartbeats every second, but a grace period that a loaded CI host cannot reach by
    # starving a process for a while: nobody dies here, and a trial failed as stale would
    # rightly be retried, i.e. its config started twice.  The stale path has its own test
    # (test_workers: a worker stalled past the grace period).
    worker = ["worker", "--study", name, "--slo", "p90:e2e<=1s", "--dataset", "synthetic",
              "--input-len", "16",
              "--output-len", "8", "--heartbeat-interval", "1", "--grace-period", "60",
              "--poll-s", "0.2", *common]
    procs = [_cli(tmp, "search", search)]
    procs += [_cli(tmp, f"worker{i}", worker) for i in range(N)]
    try:
        codes = [p.wait(300) for p, _ in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = {log.stem: log.read_text(errors="replace") for _, log in procs}
    # pytest cuts a long message in the middle: the failed processes' tails say why
    failed = "\n".join(f"--- {stem} exited {code}:\n" + "\n".join(logs[stem].splitlines()[-25:])
                       for stem, code in zip(logs, codes, strict=True) if code)
    assert codes == [0] * (N + 1), failed
    for text in logs.values():
        assert "Traceback" not in text and "error:" not in text, text
    storage = open_storage(url, heartbeat_interval=None, grace_period=None)
    study = optuna.load_study(study_name=name, storage=storage)
    counted = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(counted) == n, [(t.number, t.state) for t in study.trials]
    owners = {t.system_attrs.get("autotune:pid") for t in counted}
    assert owners == {p.pid for p, _ in procs}, (owners, logs)  # every process ran trials
    surplus = [t for t in study.trials if t.user_attrs.get("reason") == "surplus"]
    assert all(t.state == TrialState.FAIL for t in surplus)
    # No config was started twice: a surplus trial never started its server, a config
    # proposed again is answered from its first trial (repeat_of), and nobody died here,
    # so no trial is a retry.
    started = [json.dumps(t.params, sort_keys=True) for t in counted
               if "repeat_of" not in (t.user_attrs.get("result") or {})]
    assert len(started) == len(set(started)), started
    assert marked(model) == []  # every server stopped with its process
    mine = sum(1 for t in counted if t.system_attrs.get("autotune:pid") == procs[0][0].pid)
    # The search counts the trials finished since it opened the study: the workers may
    # have finished several before (the search draws 10,000 ShareGPT requests first; on
    # a loaded host a worker finished two, so no bound on how many holds by design).
    got = re.search(r"(\d+) new trials \((\d+) here, (\d+) by workers\)", logs["search"])
    assert got, logs["search"][-3000:]
    new, here, others = map(int, got.groups())
    assert here == mine and new == here + others and 1 <= here <= new <= n


def marked(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmd and process_running(int(entry)):
                out.append(int(entry))
    return out


@pytest.mark.slow
def test_a_search_and_four_workers_started_together_on_a_new_sqlite_file(tmp_path: Path
                                                                        ) -> None:
    _search_and_workers(tmp_path, f"sqlite:///{tmp_path / 'shared.db'}", "five")


@pytest.mark.postgres
@pytest.mark.slow
def test_a_search_and_four_workers_started_together_on_an_empty_postgresql(
        pg: Postgres, tmp_path: Path) -> None:
    _search_and_workers(tmp_path, pg.url, f"five-{os.getpid()}")
