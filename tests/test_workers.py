"""Workers on one study: PostgreSQL with heartbeats, kill -9, SIGTERM, journal files."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.core.terminal import mask_url, url_password
from autotune.servers.process import descendants
from autotune.study.seats import seat_of
from autotune.study.storage import scrub, storage_kind
from autotune.study.worker import (
    SPEC_ATTR,
    StudySpec,
    check_compatible,
    join_study,
    space_to_dict,
    spec_differences,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pg import NoPostgres, Postgres, postgres  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COUNTED = (TrialState.COMPLETE, TrialState.PRUNED)
optuna.logging.set_verbosity(optuna.logging.WARNING)

TINY_SPACE = """\
name: tiny-http
fixed: {{model: {model}}}
parameters:
  max_num_seqs: {{type: int, low: 1, high: {high}}}
  request_rate: {{type: float, low: 40, high: 80}}
rules: []
"""


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    try:
        with postgres() as server:
            yield server
    except NoPostgres as exc:
        pytest.skip(f"no PostgreSQL: {exc}")


# ----------------------------------------------------------------------------- helpers


class Worker:
    def __init__(self, tmp: Path, name: str, args: list[str],
                 env: dict[str, str] | None = None) -> None:
        self.out = tmp / f"{name}.out"
        self.err = tmp / f"{name}.err"
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            self.proc = subprocess.Popen([sys.executable, "-m", "autotune", "worker", *args],
                                         stdout=o, stderr=e, cwd=tmp, env=full_env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"worker {self.pid} did not finish in {timeout:.0f}s:\n{self.text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def text(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")


def common_args(tmp: Path, study: str, storage: str, *, n_trials: int, grace: int = 3,
                pace: float = 0.0) -> list[str]:
    # Short steady-state load tests (1-3 s) and two per trial: these tests are about
    # processes and storages, not about verdicts.
    return ["--study", study, "--storage", storage, "--n-trials", str(n_trials),
            "--dataset", "synthetic", "--num-prompts", "30", "--warmup", "3",
            "--heartbeat-interval", "1",
            "--min-duration", "1s", "--max-duration", "3s", "--backlog-share", "0.5",
            "--max-probes", "2",
            "--grace-period", str(grace), "--poll-s", "0.2", "--pace-s", str(pace),
            "--studies-dir", str(tmp / "studies"), "--db-retry-s", "60"]


def load(storage: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=_storage(storage))  # type: ignore[arg-type]


@functools.cache
def _storage(storage: str) -> object:
    """One storage per URL for the whole module: the tests poll the study every 0.2 s,
    and a new RDBStorage per poll held its own connection pool until collected, which
    ran PostgreSQL's 50 connections out in a slow full run (2026-12-06: "remaining
    connection slots are reserved")."""
    if storage.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(storage[len("journal:"):]))
    from autotune.study.storage import _normalise

    # Pre-ping: a pooled connection outlives a database restart (one test restarts it).
    return optuna.storages.RDBStorage(_normalise(storage),
                                      engine_kwargs={"pool_pre_ping": True})


def finished(storage: str, name: str) -> int:
    try:
        return len(load(storage, name).get_trials(states=COUNTED))
    except KeyError:  # not created yet
        return 0


def wait_for(cond, timeout: float, what: str, step: float = 0.2):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def owner(t: optuna.trial.FrozenTrial) -> str | None:
    w = t.user_attrs.get("worker")
    return None if w is None else str(w).rsplit(":", 1)[-1]


def running_trial_of(storage: str, name: str, pid: int) -> optuna.trial.FrozenTrial | None:
    """The RUNNING trial of worker ``pid`` once it has suggested a value, if any."""
    try:
        running = load(storage, name).get_trials(states=(TrialState.RUNNING,))
    except KeyError:
        return None
    mine = [t for t in running if owner(t) == str(pid) and t.params]
    return mine[0] if mine else None


def config_key(t: optuna.trial.FrozenTrial) -> str:
    return json.dumps(t.params, sort_keys=True)


def assert_each_config_evaluated_once(study: optuna.Study,
                                      done: list[optuna.trial.FrozenTrial]) -> None:
    """Evaluated: a server was started for it.  A trial whose config another trial had
    already run, or was running (the workers enqueue vLLM's defaults at once, or sample
    alike), reuses that answer with no server time, and a dead worker's trial is retried:
    neither is a second evaluation."""
    evaluated = [t for t in done if t.system_attrs.get("failed_trial") is None
                 and "repeat_of" not in (t.user_attrs.get("result") or {})]
    keys = [config_key(t) for t in evaluated]
    assert len(keys) == len(set(keys)), ("a config was evaluated twice", [
        (t.number, owner(t), config_key(t)) for t in evaluated])
    for t in done:
        result = t.user_attrs.get("result") or {}
        if "repeat_of" in result:
            assert result["server_s"] == 0.0
            assert config_key(study.trials[result["repeat_of"]]) == config_key(t)


def assert_no_secret(password: str, tmp: Path, study: optuna.Study, *texts: str) -> None:
    assert len(password) >= 8
    for text in texts:
        assert password not in text
    for path in tmp.rglob("*"):
        if path.is_file() and not path.name.endswith(".db"):
            assert password.encode() not in path.read_bytes(), f"password written to {path}"
    dump = json.dumps([study.user_attrs, study._storage.get_study_system_attrs(study._study_id)]
                      + [[t.user_attrs, t.system_attrs] for t in study.trials], default=str)
    assert password not in dump


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def marked_processes(marker: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if marker.encode() in cmd and alive(int(entry)):
                out.append(int(entry))
    return out


def http_worker_args(tmp: Path, model: str) -> list[str]:
    space = tmp / "tiny.yaml"
    space.write_text(TINY_SPACE.format(model=model, high=64))
    cmd = f"{sys.executable} -m autotune.testing.fake_server --token-delay-ms 1"
    return ["--backend", "vllm", "--vllm-cmd", cmd, "--model", model, "--space", str(space),
            "--slo", "10s", "--input-len", "16", "--output-len", "8"]


# ----------------------------------------------------------------------------- pure


def test_mask_url_hides_only_the_password() -> None:
    url = "postgresql://tuner:s3cr%40t@db.example:5432/studies"
    assert mask_url(url) == "postgresql://tuner:***@db.example:5432/studies"
    assert url_password(url) == "s3cr%40t"
    assert mask_url("postgresql://tuner@db/studies") == "postgresql://tuner@db/studies"
    assert mask_url("journal:/nfs/a.log") == "journal:/nfs/a.log"
    assert scrub("failed for s3cr@t and s3cr%40t", url) == "failed for *** and ***"
    assert [storage_kind(u) for u in (url, "mysql+pymysql://a@b/c", "sqlite:///x.db",
                                      "journal:x")] == ["server", "server", "sqlite", "journal"]


def _spec(**space_changes: object) -> StudySpec:
    from autotune.study.space import SearchSpace

    data = space_to_dict(SearchSpace.load("default"))
    data["parameters"].update(space_changes)
    return StudySpec(space=data, slo="10s")


def test_space_round_trips_and_differences_are_named() -> None:
    from autotune.study.space import SearchSpace

    space = SearchSpace.load("default")
    assert space_to_dict(SearchSpace.from_dict(space_to_dict(space))) == space_to_dict(space)
    study = _spec()
    assert spec_differences(study, _spec()) == []
    other = _spec(max_num_seqs={"type": "int", "low": 32, "high": 256, "step": 32})
    diffs = spec_differences(study, other)
    assert len(diffs) == 1 and diffs[0].startswith("parameters.max_num_seqs:")
    slo = StudySpec(space=study.space, slo="p99:e2e<=5s")
    assert spec_differences(study, slo)[0].startswith("SLO:")
    assert spec_differences(study, StudySpec(space=study.space, slo="p99:e2e<=10s")) == []
    with pytest.raises(Exception, match="refusing to join study 's': parameters.max_num_seqs"):
        check_compatible({"autotune:spec": study.to_dict()}, other, "s")


def test_surplus_seat_counts_live_trials_before_it() -> None:
    def ft(number: int, state: TrialState) -> optuna.trial.FrozenTrial:
        values = [1.0] if state == TrialState.COMPLETE else None
        t = optuna.trial.create_trial(state=state, values=values)
        t.number = number
        return t

    trials = [ft(0, TrialState.COMPLETE), ft(1, TrialState.FAIL), ft(2, TrialState.RUNNING),
              ft(3, TrialState.RUNNING)]
    assert seat_of(trials, 3) == 2  # the FAILED trial gave its seat back
    assert seat_of(trials, 2) == 1


# ----------------------------------------------------------------------------- PostgreSQL


@pytest.mark.postgres
@pytest.mark.slow
def test_two_workers_share_one_study_and_survive_a_database_restart(
        pg: Postgres, tmp_path: Path) -> None:
    name, n = "two-workers", 10
    args = ["--space", "default", "--slo", "10s",
            *common_args(tmp_path, name, pg.url, n_trials=n, grace=10, pace=0.6)]
    workers = [Worker(tmp_path, f"w{i}", args) for i in range(2)]
    try:
        if pg.local:  # the database drops for ~2 s mid-study; the workers must wait it out
            wait_for(lambda: finished(pg.url, name) >= 3, 60,
                     "3 finished trials")
            pg.restart(2.0)
        codes = [w.wait(90) for w in workers]
    finally:
        for w in workers:
            w.stop()
    texts = [w.text() for w in workers]
    assert codes == [0, 0], texts
    study = load(pg.url, name)
    done = study.get_trials(states=COUNTED)
    assert len(done) == n, [t.state for t in study.trials]
    assert {owner(t) for t in done} == {str(w.pid) for w in workers}  # both contributed
    retried = {t.system_attrs.get("failed_trial") for t in study.trials} - {None}
    assert_each_config_evaluated_once(study, done)
    assert not retried or all(study.trials[r].state == TrialState.FAIL for r in retried)
    assert "postgresql://tuner:***@" in texts[0] + texts[1]
    assert_no_secret(pg.password, tmp_path, study, *texts)


@pytest.mark.postgres
@pytest.mark.slow
def test_kill_9_fails_the_trial_after_the_grace_period_and_retries_it(
        pg: Postgres, tmp_path: Path) -> None:
    name, n, model = "kill-nine", 4, f"fake-kill-{os.getpid()}"
    args = [*http_worker_args(tmp_path, model),
            *common_args(tmp_path, name, pg.url, n_trials=n, grace=3, pace=2.0)]
    victim = Worker(tmp_path, "victim", args)
    survivor = Worker(tmp_path, "survivor", args)
    try:
        def victims_trial() -> optuna.trial.FrozenTrial | None:
            mine = running_trial_of(pg.url, name, victim.pid)
            # The victim's own server, not the survivor's (both serve the same model).
            return mine if mine and descendants(victim.pid) else None

        killed = wait_for(victims_trial, 60, "the victim's trial to run its server")
        server_pids = descendants(victim.pid)
        assert server_pids and marked_processes(model)
        t_kill = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        # The guard takes the server down with its worker: SIGTERM, then SIGKILL after
        # the server's grace (VllmServer's 15 s).  Waiting only those 15 s raced the
        # guard's own SIGKILL when the fake server was slow to leave on SIGTERM (CI run
        # 62 of 2026-12-04); the promise is the grace, so the wait is the grace and more.
        grace = 15.0
        wait_for(lambda: not any(alive(p) for p in server_pids), grace + 10.0,
                 "the server to die")
        assert survivor.wait(90) == 0, survivor.text()
    finally:
        victim.stop()
        survivor.stop()
    study = load(pg.url, name)
    trials = {t.number: t for t in study.trials}
    assert trials[killed.number].state == TrialState.FAIL
    assert trials[killed.number].datetime_complete is not None
    failed_after = (trials[killed.number].datetime_complete
                    - trials[killed.number].datetime_start).total_seconds()
    assert failed_after >= 3  # not before the grace period
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed.number]
    assert len(retries) == 1 and retries[0].state in COUNTED, survivor.text()
    assert retries[0].params == killed.params  # the same config, retried once
    assert owner(retries[0]) == str(survivor.pid)
    assert len(study.get_trials(states=COUNTED)) == n
    assert marked_processes(model) == []  # no server survives
    assert time.monotonic() - t_kill < 90
    assert_no_secret(pg.password, tmp_path, study, survivor.text(), victim.text())


@pytest.mark.postgres
@pytest.mark.slow
def test_a_worker_stalled_past_the_grace_period_goes_on_and_its_trial_is_retried(
        pg: Postgres, tmp_path: Path) -> None:
    """A host that stalls longer than the grace period (SIGSTOP here; swapping, a frozen
    VM or a database outage elsewhere): another worker fails its trial as stale and
    queues it again, and when the stalled worker wakes up its trial is not its own to
    tell any more.  It says so and goes on; it does not crash (CI run of 2026-12-05: a
    search and a worker exited 1 on Optuna's "Should not reach." after such a gap)."""
    name, n = f"stall-{os.getpid()}", 3
    args = ["--space", "default", "--slo", "10s",
            *common_args(tmp_path, name, pg.url, n_trials=n, grace=3, pace=2.0)]
    sleeper = Worker(tmp_path, "sleeper", args)
    other: Worker | None = None
    try:
        def stopped_in_a_trial() -> optuna.trial.FrozenTrial | None:
            if running_trial_of(pg.url, name, sleeper.pid) is None:
                return None
            sleeper.proc.send_signal(signal.SIGSTOP)
            # Asked again: a stopped process's trial stays put.
            held = running_trial_of(pg.url, name, sleeper.pid)
            if held is None:  # it had just finished that trial
                sleeper.proc.send_signal(signal.SIGCONT)
            return held

        stalled = wait_for(stopped_in_a_trial, 60, "the sleeper stopped in a trial")
        other = Worker(tmp_path, "other", args)
        wait_for(lambda: load(pg.url, name).trials[stalled.number].state == TrialState.FAIL,
                 60, "the other worker to fail the stalled trial")
        sleeper.proc.send_signal(signal.SIGCONT)
        assert sleeper.wait(90) == 0, sleeper.text()
        assert other.wait(90) == 0, other.text()
    finally:
        if sleeper.proc.poll() is None:
            sleeper.proc.send_signal(signal.SIGCONT)
        sleeper.stop()
        if other is not None:
            other.stop()
    said = sleeper.text()
    assert (f"trial {stalled.number}: failed by another process while it ran here" in said
            and "Traceback" not in said), said
    study = load(pg.url, name)
    ended = study.trials[stalled.number]
    assert ended.state == TrialState.FAIL
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == stalled.number]
    assert len(retries) == 1 and retries[0].state in COUNTED
    assert ended.params.items() <= retries[0].params.items()
    assert len(study.get_trials(states=COUNTED)) == n


@pytest.mark.postgres
def test_a_worker_with_another_space_is_refused(pg: Postgres, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from autotune.cli import app
    from autotune.study.storage import open_storage

    name = "refuse"
    storage = open_storage(pg.url, heartbeat_interval=1, grace_period=3)
    spec, created = join_study(storage, name, _spec())
    assert created
    other = tmp_path / "other.yaml"
    text = (ROOT / "search_spaces" / "default.yaml").read_text()
    other.write_text(text.replace("high: 1024", "high: 512"))
    result = CliRunner().invoke(app, ["worker", "--study", name, "--storage", pg.url,
                                      "--space", str(other), "--slo", "10s",
                                      "--studies-dir", str(tmp_path / "studies")])
    out = result.output + (getattr(result, "stderr", "") or "")
    assert result.exit_code != 0
    assert "refusing to join study 'refuse': parameters.max_num_seqs" in out
    assert pg.password not in out
    same_slo_other = CliRunner().invoke(app, ["worker", "--study", name, "--storage", pg.url,
                                              "--space", "default", "--slo", "5s"])
    assert same_slo_other.exit_code != 0
    assert "SLO" in same_slo_other.output + (getattr(same_slo_other, "stderr", "") or "")
    assert optuna.load_study(study_name=name, storage=storage).trials == []


def test_a_worker_started_beside_its_search_waits_for_the_space(tmp_path: Path) -> None:
    """The search creates the study, then records its space once its workload is
    loaded: a worker without --space that found the study in between exited 2 ("stores
    no search space").  It now says once that it waits, and joins when the spec lands."""
    import threading

    from autotune.study.storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 'w.db'}")
    name = "beside"
    sid = storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], name)
    said: list[str] = []
    waiting = threading.Event()
    got: list[object] = []

    def say(line: str) -> None:
        said.append(line)
        waiting.set()

    def worker() -> None:
        try:
            got.append(join_study(storage, name, None, wait_spec_s=0.2, wait_s=60,
                                  poll_s=0.05, say=say))
        except Exception as exc:  # the assertion below names it
            got.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    assert waiting.wait(30), got
    spec = _spec()
    storage.set_study_user_attr(sid, SPEC_ATTR, spec.to_dict())
    thread.join(30)
    # The wait said is what is left of the 60 s (59.8 s on a busy machine).
    (line,) = said
    left = re.fullmatch(rf"study {name!r} exists; waiting up to ([\d.]+) s for its search to "
                        "record its search space and SLO", line)
    assert left and 30 < float(left.group(1)) <= 60, said
    assert got == [(spec, False)]


def test_a_worker_beside_a_search_waits_past_its_slo_and_joins_its_spec(tmp_path: Path
                                                                        ) -> None:
    """What `autotune search` writes, in its order: the study with its SLO and space name
    first (open_study), then the spec workers run (run_study's attrs).  A worker without
    --space that looked in between exited 2 ("stores no search space"); it now waits for
    the spec, and the search's spec is one a worker can run."""
    import threading

    from autotune.cli._parse import load_space, parse_slo
    from autotune.search.options import SearchOptions
    from autotune.search.pipeline import _settings, _worker_spec
    from autotune.study.storage import open_storage
    from autotune.study.study import open_study
    from autotune.tuning.options import WorkloadOptions

    url = f"sqlite:///{tmp_path / 's.db'}"
    o = SearchOptions(slo=parse_slo("10s", None), space=load_space("cpu-tiny"), storage=url,
                      study_name="S", workload=WorkloadOptions(num_prompts=50),
                      n_trials=5, studies_dir=tmp_path / "studies")
    settings = _settings(o)
    storage = open_storage(url)
    study = open_study(settings, storage, None)  # the SLO, not yet the spec
    assert "slo" in study.user_attrs and SPEC_ATTR not in study.user_attrs
    waiting, got = threading.Event(), []

    def worker() -> None:
        try:
            got.append(join_study(storage, "S", None, wait_s=60, poll_s=0.05,
                                  say=lambda line: (got.append(line), waiting.set())))
        except Exception as exc:  # the assertion below names it
            got.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    assert waiting.wait(30), got
    for key, value in _worker_spec(o, settings).items():
        study.set_user_attr(key, value)
    thread.join(30)
    # The wait said is what is left of the 60 s (59.8 s on a busy machine).
    said = re.search(r"waiting up to ([\d.]+) s for its search", str(got[0]))
    assert len(got) == 2 and said and 30 < float(said.group(1)) <= 60, got
    spec, created = got[1]  # type: ignore[misc]
    assert not created and spec.slo == str(o.slo) and spec.n_trials == 5
    assert spec.search_space().params.keys() == settings.space.params.keys()
    from autotune.study.worker import build_plan

    assert build_plan(spec).slo == o.slo  # the worker can load its workload from it


def test_a_worker_waiting_for_a_space_that_never_comes_gives_up_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import autotune.study.worker as worker_mod
    from autotune.cli import app
    from autotune.study.storage import open_storage
    from autotune.study.worker import IncompatibleStudy

    url = f"sqlite:///{tmp_path / 'w.db'}"
    storage = open_storage(url)
    storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "never")
    said: list[str] = []
    with pytest.raises(IncompatibleStudy,
                       match=r"^study 'never' stores no search space \(waited 0.2 s\): give "):
        join_study(storage, "never", None, wait_spec_s=0.2, poll_s=0.05, say=said.append)
    assert said == ["study 'never' exists; waiting up to 0.2 s for its search to record its "
                    "search space and SLO"]
    # Through the CLI: one progress line, then one error line and exit 2.  The spec wait's
    # floor (15 s, for a creator between creating the study and writing its spec) is
    # shortened so the test does not sit it out.
    monkeypatch.setattr(worker_mod, "join_study",
                        functools.partial(worker_mod.join_study, wait_spec_s=0.2))
    r = CliRunner().invoke(app, ["worker", "--study", "never", "--storage", url,
                                 "--wait", "0.1s", "--studies-dir", str(tmp_path / "out")])
    out = [line for line in r.stdout.splitlines() if line.strip()]
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert out == ["study 'never' exists; waiting up to 0.2 s for its search to record its "
                   "search space and SLO"], r.stdout
    assert len(err) == 1 and err[0].startswith(
        "error: study 'never' stores no search space (waited 0.2 s)"), r.stderr


# ----------------------------------------------------------------------------- no database


@pytest.mark.slow
def test_sigterm_stops_the_server_and_fails_the_trial_as_interrupted(tmp_path: Path) -> None:
    name, model = "sigterm", f"fake-term-{os.getpid()}"
    url = f"sqlite:///{tmp_path / 'term.db'}"
    w = Worker(tmp_path, "term", [*http_worker_args(tmp_path, model),
                                  *common_args(tmp_path, name, url, n_trials=5, pace=5.0)])
    try:
        def running() -> optuna.trial.FrozenTrial | None:
            try:
                trials = load(url, name).get_trials(states=(TrialState.RUNNING,))
            except KeyError:
                return None
            return trials[0] if trials and trials[0].params and marked_processes(model) else None

        trial = wait_for(running, 60, "a running trial with its server")
        server_pids = descendants(w.pid)
        w.proc.send_signal(signal.SIGTERM)
        assert w.wait(30) == 143, w.text()
    finally:
        w.stop()
    assert not any(alive(p) for p in server_pids)
    study = load(url, name)
    t = study.trials[trial.number]
    assert t.state == TrialState.FAIL and t.user_attrs.get("reason") == "interrupted"
    queued = [q for q in study.get_trials(states=(TrialState.WAITING,))
              if q.system_attrs.get("failed_trial") == trial.number]
    # Its config waits (compared with the trial as it ended: the snapshot taken while it
    # ran may predate its last suggestion).
    assert len(queued) == 1 and queued[0].params == t.params


@pytest.mark.slow
def test_two_workers_on_a_journal_file(tmp_path: Path) -> None:
    name, n = "journal", 8
    url = f"journal:{tmp_path / 'study.log'}"
    args = ["--space", "default", "--slo", "10s",
            *common_args(tmp_path, name, url, n_trials=n, pace=0.5)]
    workers = [Worker(tmp_path, f"j{i}", args) for i in range(2)]
    try:
        codes = [w.wait(90) for w in workers]
    finally:
        for w in workers:
            w.stop()
    assert codes == [0, 0], [w.text() for w in workers]
    study = load(url, name)
    done = study.get_trials(states=COUNTED)
    assert len(done) == n
    assert {owner(t) for t in done} == {str(w.pid) for w in workers}
    assert_each_config_evaluated_once(study, done)


def test_storage_calls_retry_while_the_database_is_down_but_not_a_bad_password(
        caplog: pytest.LogCaptureFixture) -> None:
    from sqlalchemy.exc import OperationalError

    from autotune.study.storage import call_with_retry, transient

    calls: list[int] = []
    slept: list[float] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise OperationalError("SELECT 1", {}, Exception("server closed the connection"))
        return "ok"

    with caplog.at_level("WARNING", logger="autotune.study.storage"):
        assert call_with_retry(flaky, retry_s=60, sleep=slept.append) == "ok"
    assert len(calls) == 4 and slept == [0.25, 0.5, 1.0]  # exponential backoff
    # One line says it retries, not one per attempt.
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("database unreachable during storage call: ") and (
        "retrying for up to 60 s" in said)
    wrong = OperationalError("connect", {}, Exception("password authentication failed"))
    assert transient(OperationalError("x", {}, Exception("timeout"))) and not transient(wrong)
    with pytest.raises(OperationalError):
        call_with_retry(lambda: (_ for _ in ()).throw(wrong), sleep=slept.append)
    assert len(slept) == 3


@pytest.mark.postgres
def test_a_missing_study_or_a_bad_storage_is_one_line(pg: Postgres, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from autotune.cli import app

    r = CliRunner().invoke(app, ["worker", "--study", "nope", "--storage", pg.url,
                                 "--wait", "0.3s"])
    out = r.output + (getattr(r, "stderr", "") or "")
    assert r.exit_code == 2 and "no study 'nope' in this storage (waited 0.3 s)" in out
    assert "waiting up to 0.3 s for study 'nope'" in out and pg.password not in out
    r = CliRunner().invoke(app, ["worker", "--study", "x", "--storage", "redis://h/0"])
    out = r.output + (getattr(r, "stderr", "") or "")
    assert r.exit_code == 2 and "unsupported storage redis://h/0" in out


@pytest.mark.slow
def test_journal_kill_9_on_this_host_is_retried_without_heartbeats(tmp_path: Path) -> None:
    name, n = "journal-kill", 4
    url = f"journal:{tmp_path / 'study.log'}"
    args = ["--space", "default", "--slo", "10s",
            *common_args(tmp_path, name, url, n_trials=n, pace=1.5)]
    victim, survivor = Worker(tmp_path, "v", args), Worker(tmp_path, "s", args)
    try:
        killed = wait_for(lambda: running_trial_of(url, name, victim.pid), 60,
                          "the victim's trial")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        assert survivor.wait(60) == 0, survivor.text()
    finally:
        victim.stop()
        survivor.stop()
    study = load(url, name)
    ended = study.trials[killed.number]
    assert ended.state == TrialState.FAIL
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed.number]
    # The retry fixes every value the dead trial had (Optuna's retry callback copies its
    # params) and samples the rest: the kill may land between two suggestions (seen in CI:
    # the dead trial had only TP), and then only those values are the dead trial's config.
    assert len(retries) == 1 and ended.params
    assert ended.params.items() <= retries[0].params.items(), (ended.params,
                                                               retries[0].params)
    assert len(study.get_trials(states=COUNTED)) == n
