"""A PostgreSQL for the tests: ``AUTOTUNE_TEST_PG`` when set, else a throwaway server.

The throwaway one is built from the system's binaries (``initdb``, ``pg_ctl``: on PATH,
``/usr/local/bin`` or Debian's ``/usr/lib/postgresql/*/bin``) in a temp dir, listens on
a free port on 127.0.0.1 only, has a password-protected user and database, and is
stopped and deleted at the end.  PostgreSQL refuses to run as root: as root the server
runs as the ``postgres`` system user (created by Debian's package).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class NoPostgres(Exception):
    """Why no PostgreSQL is available (the tests skip with this message)."""


@dataclass
class Postgres:
    url: str  # postgresql://user:password@127.0.0.1:port/db
    password: str
    data_dir: Path | None = None  # None: an external server (AUTOTUNE_TEST_PG)
    bin_dir: Path | None = None
    user: str | None = None

    @property
    def local(self) -> bool:
        return self.data_dir is not None

    def pg_ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert self.bin_dir is not None and self.data_dir is not None
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), *args]
        return _run_as(self.user, cmd)

    def restart(self, down_s: float) -> None:
        """Stop the server hard, stay down ``down_s`` seconds, start it again."""
        self.pg_ctl("-m", "immediate", "-w", "stop")
        time.sleep(down_s)
        self.pg_ctl("-w", "-l", str(self.data_dir / "log.txt"), "start")


def find_bin(name: str) -> Path | None:
    candidates = [shutil.which(name), f"/usr/local/bin/{name}",
                  *sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return Path(os.path.realpath(c)).parent
    return None


def _run_as(user: str | None, cmd: list[str]) -> subprocess.CompletedProcess[str]:
    if user is not None:
        runuser = shutil.which("runuser") or "/usr/sbin/runuser"
        cmd = [runuser, "-u", user, "--", *cmd]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    if res.returncode != 0:
        raise NoPostgres(f"{' '.join(cmd[-4:])} failed: {(res.stderr or res.stdout).strip()}")
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def postgres() -> Iterator[Postgres]:
    """Yield a :class:`Postgres`; raise :class:`NoPostgres` saying why there is none."""
    external = os.environ.get("AUTOTUNE_TEST_PG")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        raise NoPostgres("psycopg2 is not installed (pip install psycopg2-binary)") from None
    if external:
        from sqlalchemy.engine import make_url

        yield Postgres(url=external, password=make_url(external).password or "")
        return
    bin_dir = find_bin("initdb")
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        raise NoPostgres("no initdb/pg_ctl on PATH, /usr/local/bin or /usr/lib/postgresql/*/bin "
                         "(apt-get install postgresql) and AUTOTUNE_TEST_PG is not set")
    user = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise NoPostgres("running as root and there is no 'postgres' user to run the "
                             "server as (PostgreSQL refuses root)") from None
        user = "postgres"
    tmp = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    data = tmp / "data"
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(tmp, entry.pw_uid, entry.pw_gid)
    os.chmod(tmp, 0o700)
    password = "pw-" + secrets.token_hex(12)
    port = _free_port()
    pg = Postgres(url="", password=password, data_dir=data, bin_dir=bin_dir, user=user)
    started = False
    try:
        _run_as(user, [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                       "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                       "--no-sync"])
        with open(data / "postgresql.conf", "a") as f:
            f.write(f"\nlisten_addresses = '127.0.0.1'\nport = {port}\n"
                    f"unix_socket_directories = '{tmp}'\nfsync = off\n"
                    "max_connections = 50\n")
        pg.pg_ctl("-w", "-l", str(data / "log.txt"), "start")
        started = True
        import psycopg2

        conn = psycopg2.connect(host=str(tmp), port=port, user="postgres", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE ROLE tuner LOGIN PASSWORD '{password}'")
            cur.execute("CREATE DATABASE autotune OWNER tuner")
        conn.close()
        pg.url = f"postgresql://tuner:{password}@127.0.0.1:{port}/autotune"
        yield pg
    finally:
        if started:
            with contextlib.suppress(Exception):
                pg.pg_ctl("-m", "immediate", "-w", "stop")
        shutil.rmtree(tmp, ignore_errors=True)
