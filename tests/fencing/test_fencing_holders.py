"""Fenced writes under a real ``RedisLock`` (and a PostgreSQL or MySQL lock), from
several processes.

Writer processes (``fencing_writer.py``) take one lock name on the suite's
redis-server (or, for ``sigstop-postgres-lock`` and ``sigstop-mysql-lock``, in the
database server's lease table) and increment a fenced counter row in SQLite,
PostgreSQL or MariaDB.  One holder is paused past its ttl while holding (SIGSTOP with
the scheduler frozen too, or simply idle with ``auto_renew=False``); the others take
the lock in turn meanwhile.  When the
paused holder resumes and writes with its old fence, the database refuses it and the
row stays as the newer holders left it; no increment is lost and the log of accepted
writes never goes back in fence order.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest
from conftest import Db

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TTL = 1.0
LOOP = 1.5  # seconds the other writers take turns while the holder is paused
WRITERS = 3


class Writer:
    """One ``fencing_writer.py`` process, driven line by line."""

    def __init__(self, argv: list[str], stderr: Path, db: Db) -> None:
        self.stderr_path = stderr
        self._stderr: IO[str] = stderr.open("w")
        env = {**os.environ, "DLOCK_FENCING_DSN": db.dsn}  # not in argv: a password
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fencing_writer.py"),
                                      *argv], cwd=REPO, text=True, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr)

    def ask(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"writer pid {self.proc.pid} said nothing in "
                                 f"{timeout:.0f}s (exit {self.proc.poll()}): "
                                 f"{self.stderr_path.read_text()[-2000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def send(self, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        self.ask(op, **args)
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            try:
                self.ask("exit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self._stderr.close()


def prepare(db: Db) -> tuple[str, str]:
    """The counter table (one row) and its log; returns (table, placeholder)."""
    conn = db.connect()
    table = db.table(conn, "name TEXT PRIMARY KEY, value BIGINT NOT NULL, "
                           "last_fence BIGINT NOT NULL DEFAULT 0")
    serial = {"sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT",
              "mariadb": "BIGINT AUTO_INCREMENT PRIMARY KEY"}.get(
                  db.kind, "BIGSERIAL PRIMARY KEY")
    cur = conn.cursor()
    cur.execute(f"CREATE TABLE {table}_log (id {serial}, who TEXT, fence BIGINT, "
                f"value BIGINT)")
    cur.execute(f"INSERT INTO {table} (name, value) VALUES ('counter', 0)")
    cur.close()
    conn.commit()
    conn.close()
    return table, "?" if db.kind == "sqlite" else "%s"


def snapshot(db: Db, table: str) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    conn = db.connect()
    try:
        cur = conn.cursor()
        cur.execute(f"SELECT name, value, last_fence FROM {table}")
        row = tuple(cur.fetchone())
        cur.execute(f"SELECT id, who, fence, value FROM {table}_log ORDER BY id")
        log = [tuple(r) for r in cur.fetchall()]
        cur.close()
        conn.commit()
        return row, log
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
# The database's refusal is the same whatever paused the holder: the second way of
# pausing runs on SQLite only, to keep the suite short.
@pytest.mark.parametrize(("db", "pause"), [("sqlite", "sigstop"),
                                           ("postgresql", "sigstop"),
                                           ("mariadb", "sigstop"),
                                           ("postgresql", "sigstop-postgres-lock"),
                                           ("mariadb", "sigstop-mysql-lock"),
                                           ("sqlite", "idle-without-renewal")],
                         indirect=["db"])
def test_holder_paused_past_its_ttl_is_refused_by_the_database(
        db: Db, redis_url: str, prefix: str, name: str, tmp_path: Path,
        pause: str) -> None:
    table, _ = prepare(db)
    common = ["--redis-url", redis_url, "--prefix", prefix, "--name", name,
              "--ttl", str(TTL), "--db", db.kind, "--table", table]
    if pause in ("sigstop-postgres-lock", "sigstop-mysql-lock"):
        common += ["--lock-url", db.dsn]  # the lock in the database it fences
    paused_argv = [*common, "--who", "paused"]
    if pause == "idle-without-renewal":
        paused_argv.append("--no-renew")
    writers: list[Writer] = []
    try:
        paused = Writer(paused_argv, tmp_path / "paused.err", db)
        writers.append(paused)
        others = [Writer([*common, "--who", f"w{i}"], tmp_path / f"w{i}.err", db)
                  for i in range(WRITERS)]
        writers += others
        for w in writers:
            assert w.read(60) == {"ready": True}

        took = paused.send("acquire")
        assert took["held"], took
        fence = took["fence"]
        first = paused.send("write")
        assert first == {"ok": True, "fence": fence, "value": 1}

        if pause.startswith("sigstop"):  # frozen whole: body, scheduler and watchdog
            os.kill(paused.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        for w in others:
            w.ask("loop", seconds=LOOP)
        loops = [w.read(60) for w in others]
        assert time.monotonic() - stopped > TTL  # the paused hold has expired
        before = snapshot(db, table)
        if pause.startswith("sigstop"):
            os.kill(paused.proc.pid, signal.SIGCONT)

        late = paused.send("write")
        after = snapshot(db, table)
        released = paused.send("release")
    finally:
        for w in writers:
            w.close()

    # the resumed holder's write was refused, and changed nothing
    assert late.get("stale") is True, late
    assert late["fence"] == fence and late["found"] > fence, late
    assert f"stale fence {fence}" in late["error"]
    assert after == before
    # the lock tells it too, on release
    assert released["released"] is False and "LockLost" in released["error"], released

    # the others took the lock in turn meanwhile, each with a higher fence
    accepted = sum(loop["accepted"] for loop in loops)
    assert all(loop["accepted"] > 0 for loop in loops), loops
    assert all(f > fence for loop in loops for f in loop["fences"]), loops
    row, log = after
    # no increment lost: the counter is the number of accepted writes
    assert row[1] == 1 + accepted == len(log), (row, accepted, len(log))
    assert [entry[3] for entry in log] == list(range(1, len(log) + 1))
    # accepted writes never go back in fence order; the paused one's only write is first
    fences = [entry[2] for entry in log]
    assert fences == sorted(fences)
    assert log[0][1:3] == ("paused", fence)
    assert all(who != "paused" for _, who, _, _ in log[1:])
    assert row[2] == fences[-1]
    print(f"\n{db.kind}/{pause}: paused holder's fence {fence} refused "
          f"(row at fence {late['found']}); {accepted} writes by {WRITERS} others, "
          f"{sum(loop['stale'] for loop in loops)} of theirs refused")


def test_a_fence_counter_that_went_back_is_refused_not_trusted(
        db: Db, conn: Any, r: Any, redis_url: str, prefix: str, name: str) -> None:
    """Fencing fails closed: a lost fence counter does not make fences go back (the
    next one starts from the server's clock, above every earlier one), and if a
    counter that had run ahead of the clock is lost, the next holder's lower fence is
    refused, not trusted; the row accepts writes again once the counter is set past
    its fence."""
    import redis

    from celery_dlock import RedisLock
    from celery_dlock.fencing import StaleFence, fenced_update

    table = db.table(conn)
    cur = conn.cursor()
    cur.execute(f"INSERT INTO {table} (sku, qty) VALUES ('A', 1)")
    cur.close()
    conn.commit()
    client = redis.Redis.from_url(redis_url)

    def write(qty: int = 1) -> int:
        with RedisLock(client, name, ttl=5, prefix=prefix) as lock:
            assert lock.fence is not None
            fenced_update(conn, table, {"sku": "A"}, lock.fence, {"qty": qty})
            conn.commit()
            return lock.fence

    try:
        fences = [write() for _ in range(3)]
        fence_key = RedisLock(client, name, prefix=prefix).keys.fence
        assert r.delete(fence_key) == 1  # the counter is lost (an empty restart)
        fences.append(write())  # accepted: fences never go back
        assert fences == sorted(set(fences))

        r.set(fence_key, 2**52)  # a counter far ahead of the server's clock ...
        ahead = write()
        assert ahead == 2**52 + 1
        assert r.delete(fence_key) == 1  # ... is lost: the next fence is lower
        with RedisLock(client, name, ttl=5, prefix=prefix) as lock:
            assert lock.fence is not None and lock.fence < ahead
            with pytest.raises(StaleFence) as caught:
                fenced_update(conn, table, {"sku": "A"}, lock.fence, {"qty": 0})
            conn.rollback()
            assert (caught.value.fence, caught.value.found) == (lock.fence, ahead)
        r.set(fence_key, ahead)  # the documented recovery
        assert write(0) == ahead + 1
    finally:
        client.close()
