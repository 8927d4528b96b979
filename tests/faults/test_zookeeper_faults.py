"""The ZooKeeper backend under real faults (docs/backends.md, "ZooKeeper").

Each test starts what it breaks: a ZooKeeper server of its own (``own_zk``), the fault
proxy in front of it, or a holder process that it kills or freezes.  The lock core's
contract itself runs on ZooKeeper through the ``lock_kind`` tests.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from dlock_helpers import closed_port, wait_until
from proxy import FaultProxy
from zk_server import ZkServer

pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")

from celery_dlock import BackendUnavailable, LockKeyConflict, LockLost
from celery_dlock.backends.zookeeper import ZooKeeperLock
from celery_dlock.backends.zookeeper.session import close_sessions

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture
def own_zk() -> Iterator[ZkServer]:
    """A ZooKeeper server of this test's own, to restart or cut off at will."""
    try:
        server = ZkServer()
    except RuntimeError as exc:
        pytest.skip(f"ZooKeeper server not available: {exc}")
    try:
        try:
            server.start()
        except RuntimeError as exc:
            pytest.skip(f"ZooKeeper server did not start: {exc}")
        yield server
    finally:
        close_sessions(server.hosts)  # no client goes on calling a server that is gone
        server.cleanup()


class Holder:
    """A ``zk_holder.py`` process, driven line by line."""

    def __init__(self, url: str, name: str, ttl: float, db: Path, err: Path) -> None:
        self._err: IO[str] = err.open("w")
        self.err = err
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "zk_holder.py"), "--url", url, "--name", name,
             "--ttl", str(ttl), "--db", str(db)],
            cwd=REPO, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._err)
        assert self.read(60) == {"ready": True}

    def read(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"holder said nothing in {timeout:.0f}s (exit "
                                 f"{self.proc.poll()}): {self.err.read_text()[-2000:]}")
        out: dict[str, Any] = json.loads(line)
        return out

    def send(self, op: str, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self._err.close()


def _stock(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30)
    conn.execute("CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, units INTEGER,"
                 " last_fence BIGINT NOT NULL DEFAULT 0)")
    conn.execute("INSERT OR IGNORE INTO stock (sku, units) VALUES ('a', 0)")
    conn.commit()
    return conn


# -- a holder that dies, or freezes ------------------------------------------------------


@pytest.mark.slow
def test_sigkill_of_the_holder_frees_the_lock_within_its_ttl(zk_server, name, tmp_path):
    ttl = 3.0
    _stock(tmp_path / "db.sqlite").close()
    holder = Holder(zk_server.url, name, ttl, tmp_path / "db.sqlite", tmp_path / "h.err")
    try:
        took = holder.send("acquire")
        assert took["held"]
        other = ZooKeeperLock(zk_server.url, name, ttl, owner="other")
        assert not other.acquire(blocking=False)
        os.kill(holder.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert other.acquire(timeout=ttl + 10)
        waited = time.monotonic() - killed
        # The server frees it once the session times out (ttl), counted from the
        # holder's last ping, plus its expiry check (a tick) and our wake-up.
        assert waited < ttl + 1.5, waited
        assert other.fence is not None and other.fence > took["fence"]
        other.release()
    finally:
        holder.close()


@pytest.mark.slow
def test_sigstop_past_the_ttl_the_holder_is_told_and_its_fenced_write_refused(
        zk_server, name, tmp_path):
    ttl = 2.0
    db = tmp_path / "db.sqlite"
    conn = _stock(db)
    holder = Holder(zk_server.url, name, ttl, db, tmp_path / "h.err")
    try:
        took = holder.send("acquire")
        assert took["held"]
        first = holder.send("write")
        assert first["ok"] and not first["lost"]
        os.kill(holder.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        other = ZooKeeperLock(zk_server.url, name, ttl, owner="other")
        assert other.acquire(timeout=ttl + 10)
        assert time.monotonic() - stopped > ttl * 0.9  # only once its session ended
        assert other.fence is not None and other.fence > took["fence"]
        from celery_dlock.fencing import fenced_update

        fenced_update(conn, "stock", {"sku": "a"}, other.fence, {"units": 2})
        conn.commit()
        os.kill(holder.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        # Its watchdog finds the deadline passed as soon as it runs again ...
        assert wait_until(lambda: holder.send("status")["lost"], timeout=5)
        told_at = holder.send("status")["told_at"][0]
        assert resumed - 0.1 <= told_at < resumed + 5
        # ... and the database refuses the write it makes anyway.
        late = holder.send("write")
        assert late.get("stale") is True and late["found"] == other.fence, late
        row = conn.execute("SELECT units, last_fence FROM stock").fetchone()
        assert row == (2, other.fence)
        other.release()
    finally:
        holder.close()
        conn.close()


# -- the session expires while held ------------------------------------------------------


@pytest.mark.slow
def test_session_expiry_while_held_tells_the_holder_first_never_two_holders(own_zk,
                                                                             name):
    ttl = 2.0
    told: list[float] = []
    with FaultProxy(own_zk.port) as proxy:
        via = f"zookeeper://127.0.0.1:{proxy.port}"
        holder = ZooKeeperLock(via, name, ttl, owner="holder",
                               on_lost=lambda _lock: told.append(time.monotonic()))
        other = ZooKeeperLock(own_zk.url, name, ttl, owner="other")
        assert holder.acquire(blocking=False)
        fence = holder.fence
        time.sleep(ttl)  # renewed meanwhile
        assert holder.owned() and not holder.lost
        proxy.black_hole()  # nothing reaches the server: its session times out
        cut = time.monotonic()
        acquired_at = None
        while time.monotonic() - cut < 20:
            if other.acquire(blocking=False):
                acquired_at = time.monotonic()
                break
            # never two holders: while the other cannot acquire, or at the moment
            # it does, the holder was told already if its session could be gone
            time.sleep(0.02)
        assert acquired_at is not None, "the expired session's lock never freed"
        assert told, "the holder was never told"
        assert told[0] < acquired_at, (told[0] - cut, acquired_at - cut)
        assert holder.lost and "deadline" in (holder.lost_reason or "")
        assert other.fence is not None and fence is not None and other.fence > fence
        proxy.heal()
        # Back on the server, the holder's session is over: nothing of it is held.
        with pytest.raises(LockLost):
            holder.release()
        assert other.owned()
        other.release()
        close_sessions(f"127.0.0.1:{proxy.port}")
    assert told and len(told) == 1


@pytest.mark.slow
def test_a_reconnect_the_server_never_answers_is_tried_again_within_the_session(
        own_zk, name):
    # A reconnecting client whose connection request goes unanswered (a server that
    # took the connection and then starved, or restarted under it) gives that
    # attempt up after connect_timeout and tries again, long before its session
    # (the ttl) is over: it does not wait the whole session timeout on one attempt.
    told: list[object] = []
    with FaultProxy(own_zk.port) as proxy:
        via = f"zookeeper://127.0.0.1:{proxy.port}?connect_timeout=2"
        holder = ZooKeeperLock(via, name, 30, owner="holder", on_lost=told.append)
        assert holder.acquire(blocking=False)
        session = holder._node.session
        session_id, password = session.client.client_id
        # The next connection request carries the session's password: its reply
        # is swallowed, and the connection stays open.
        swallowed = proxy.drop_reply(password)
        proxy.cut_all()
        assert swallowed.wait(10), "the client never asked to reconnect"
        cut = time.monotonic()
        assert wait_until(lambda: _answer(holder.owned), timeout=20), \
            (told, holder.lost_reason)
        assert time.monotonic() - cut < 20  # the session is 30 s: it never lapsed
        assert session.session_id() == session_id and not told and not holder.lost
        holder.release()
        close_sessions(f"127.0.0.1:{proxy.port}")


@pytest.mark.slow
def test_a_session_the_server_closed_is_reported_at_once_not_at_the_deadline(
        zk_server, name):
    from kazoo.client import KazooClient

    told: list[float] = []
    holder = ZooKeeperLock(zk_server.url, name, 60, owner="holder",
                           on_lost=lambda _lock: told.append(time.monotonic()))
    assert holder.acquire(blocking=False)
    session = holder._node.session
    session_id, password = session.client.client_id
    # Another client takes the session over and closes it: the server ends the
    # session (its nodes go) and tells the holder's client it expired.
    thief = KazooClient(zk_server.hosts, client_id=(session_id, password))
    thief.start(10)
    thief.stop()
    thief.close()
    closed = time.monotonic()
    assert wait_until(lambda: bool(told), timeout=20)
    assert told[0] - closed < 20  # long before its 60 s ttl's deadline
    assert holder.lost and "session expired" in (holder.lost_reason or "")
    assert session_id in session.dead
    other = ZooKeeperLock(zk_server.url, name, 59, owner="other")  # another session
    assert other.acquire(blocking=False)
    with pytest.raises(LockLost):
        holder.release()
    other.release()
    # The holder's process works on, on a new session (once kazoo made it).
    assert wait_until(lambda: _answer(lambda: holder.acquire(blocking=False)),
                      timeout=20)
    assert holder._node.session.session_id() != session_id
    holder.release()


# -- a server restart ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_hold_survives_a_server_restart_and_fences_go_on(own_zk, name):
    # A ttl well above a restart (the JVM starts in seconds, slower on a busy machine).
    told: list[object] = []
    holder = ZooKeeperLock(own_zk.url, name, 60, owner="holder", on_lost=told.append)
    other = ZooKeeperLock(own_zk.url, name, 60, owner="other")
    assert holder.acquire(blocking=False)
    fence = holder.fence
    own_zk.restart()  # the session is restored from the server's log
    assert wait_until(lambda: _answer(holder.owned), timeout=40), \
        (told, holder.lost_reason, own_zk.log_tail())
    assert not other.acquire(blocking=False)
    assert not told and not holder.lost
    holder.release()
    assert other.acquire(timeout=10)
    assert other.fence is not None and fence is not None and other.fence > fence
    other.release()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fences_strictly_increase_across_server_restarts(own_zk, name):
    seen = []
    for restart in (True, True, True, False):
        lock = ZooKeeperLock(own_zk.url, name, 5)
        assert wait_until(lambda lk=lock: _answer(lambda: lk.acquire(blocking=False)),
                          timeout=40)
        seen.append(lock.fence)
        lock.release()
        if restart:
            own_zk.restart()
    assert all(isinstance(f, int) for f in seen)
    assert seen == sorted(seen) and len(set(seen)) == len(seen), seen


def _answer(ask: Any) -> bool:
    """``ask()``, or False while the server is not answering yet (reconnecting)."""
    try:
        return bool(ask())
    except BackendUnavailable:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("write", ["create", "set"])
def test_a_rate_write_whose_reply_was_lost_takes_one_slot(zk_server, prefix, name,
                                                          write):
    """lock_rate: the proxy forwards a take's write of the rate node (the server
    runs it) and swallows every reply after it, until kazoo drops the connection
    (no ping answered) and the call fails with ConnectionLoss: the take reads again
    on the new connection, finds its operation id, and answers as its write did;
    one slot is taken, not two (docs/backends.md, "Rates (lock_rate) on
    ZooKeeper")."""
    from celery_dlock.backends.zookeeper import backend_from_url
    from celery_dlock.core.rates import parse_rate

    rate = parse_rate("1/m")  # one a minute: the seconds the fault takes move nothing
    with FaultProxy(zk_server.port) as proxy:
        rates = backend_from_url(f"zookeeper://127.0.0.1:{proxy.port}").rates()
        if write == "set":
            assert rates.take(prefix, name, rate).run  # a node to set
        swallowed = proxy.drop_reply(b'"dlock_rate":1')
        started = time.monotonic()
        answer = rates.take(prefix, name, rate)
        took = time.monotonic() - started
        assert swallowed.is_set(), "the write never went out"
        after = rates.take(prefix, name, rate)
        close_sessions(f"127.0.0.1:{proxy.port}")
    assert took < 30, took
    if write == "create":
        assert answer.run, "its write granted it: that answer, not a parking"
        assert not after.run and after.slot is not None and after.delay > 40
    else:
        assert not answer.run and answer.slot is not None
        assert after.slot == answer.slot + 60_000_000, "one slot, not two"


# -- bad input, no server ----------------------------------------------------------------


def test_a_server_that_does_not_answer_is_backend_unavailable(name):
    lock = ZooKeeperLock(f"zookeeper://127.0.0.1:{closed_port()}?connect_timeout=1",
                         name, 5)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="ZooKeeper unavailable"):
        lock.acquire(blocking=False)
    assert time.monotonic() - started < 10
    assert lock.depth == 0 and lock.fence is None


def test_an_unreachable_ensemble_warns_once_not_once_per_retry(name):
    # kazoo retries a connection every 50-500 ms and warns at each try; a script with
    # no logging configured printed every one of them on its terminal.
    script = (
        "import sys\n"
        "from celery_dlock import BackendUnavailable\n"
        "from celery_dlock.backends.zookeeper import ZooKeeperLock\n"
        f"lock = ZooKeeperLock('zookeeper://127.0.0.1:{closed_port()}"
        f"?connect_timeout=3', {name!r}, 5)\n"
        "try:\n"
        "    lock.acquire(blocking=False)\n"
        "except BackendUnavailable as exc:\n"
        "    print('unavailable', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    lines = done.stderr.splitlines()
    assert "unavailable" in lines, done.stderr
    dropped = [line for line in lines if line.startswith("Connection dropped")]
    assert len(dropped) == 1, done.stderr
    assert len(lines) <= 3, done.stderr


def test_another_applications_znode_at_the_lock_path_is_a_conflict(zk_server, prefix,
                                                                   name):
    from kazoo.client import KazooClient

    lock = ZooKeeperLock(zk_server.url, name, 5, prefix=prefix, auto_renew=False)
    calls = {"acquire": lambda: lock.acquire(blocking=False),
             "blocking acquire": lambda: lock.acquire(timeout=0.3),
             "release": lock.release, "extend": lock.extend, "holder": lock.holder}
    zk = KazooClient(zk_server.hosts)
    zk.start(10)
    try:
        zk.create(lock.path, b"another application's data", makepath=True)
        for what, call in calls.items():
            with pytest.raises(LockKeyConflict, match="another application") as info:
                call()
            assert repr(lock.path) in str(info.value), what
            assert zk.get(lock.path)[0] == b"another application's data", what
            assert zk.get_children(lock.path) == [], what
        assert lock.depth == 0
        # a child of another shape under a lock node of ours: the same
        zk.delete(lock.path)
        assert lock.acquire(blocking=False)
        zk.create(lock.path + "/their-node", b"x")
        other = ZooKeeperLock(zk_server.url, name, 5, prefix=prefix, owner="other")
        for what, call in {"acquire": lambda: other.acquire(blocking=False),
                           "blocking acquire": lambda: other.acquire(timeout=0.3),
                           "release": other.release, "extend": other.extend}.items():
            with pytest.raises(LockKeyConflict, match="their-node"):
                call()
            assert len(zk.get_children(lock.path)) == 2, what  # ours and theirs
            assert zk.get(lock.path + "/their-node")[0] == b"x", what
        lock.release()  # its own child, found without reading the line
    finally:
        zk.stop()
        zk.close()


def test_another_applications_ephemeral_node_at_the_prefix_is_a_conflict(zk_server,
                                                                         prefix, name):
    """An ephemeral node cannot have children: one of another application's at the
    prefix's path (or at the lock's, holding our mark) made every acquire
    BackendUnavailable on a healthy server."""
    from kazoo.client import KazooClient

    from celery_dlock.backends.zookeeper.nodes import DIR_MARK

    lock = ZooKeeperLock(zk_server.url, name, 5, prefix=prefix, auto_renew=False)
    zk = KazooClient(zk_server.hosts)
    zk.start(10)
    try:
        top = lock.path.rsplit("/", 1)[0]
        zk.create(top, b"theirs", ephemeral=True)
        for call in (lambda: lock.acquire(blocking=False),
                     lambda: lock.acquire(timeout=0.3)):
            with pytest.raises(LockKeyConflict, match="ephemeral") as info:
                call()
            assert "nothing was changed" in str(info.value)
        assert zk.get(top)[0] == b"theirs" and lock.depth == 0
        zk.delete(top)
        zk.create(lock.path, DIR_MARK, ephemeral=True, makepath=True)
        with pytest.raises(LockKeyConflict, match="ephemeral"):
            lock.acquire(blocking=False)
        assert zk.get_children(lock.path) == []
    finally:
        zk.stop()
        zk.close()


def test_a_path_whose_acl_refuses_this_user_is_invalid_config(zk_server, prefix, name):
    """NoAuth is the same on every healthy ensemble: InvalidLockConfig (never an
    outage a ``lock_fail_open`` task would run unlocked through)."""
    from kazoo.client import KazooClient
    from kazoo.security import make_acl, make_digest_acl

    from celery_dlock import InvalidLockConfig

    lock = ZooKeeperLock(zk_server.url, name, 5, prefix=prefix, auto_renew=False)
    top = lock.path.rsplit("/", 1)[0]
    zk = KazooClient(zk_server.hosts, auth_data=[("digest", "admin:pw")])
    zk.start(10)
    try:
        zk.create(top, b"", acl=[make_digest_acl("admin", "pw", all=True),
                                 make_acl("world", "anyone", read=True)])
        with pytest.raises(InvalidLockConfig, match="ACL") as info:
            lock.acquire(blocking=False)
        assert "NoAuthError" in str(info.value)
        assert zk.get_children(top) == [] and lock.depth == 0
        # the user the ACL names takes the lock
        granted = ZooKeeperLock(zk_server.url.replace("zookeeper://",
                                                      "zookeeper://admin:pw@"),
                                name, 5, prefix=prefix, auto_renew=False)
        with granted:
            assert granted.owned()
    finally:
        zk.delete(top, recursive=True)
        zk.stop()
        zk.close()


def test_every_kazoo_exception_is_mapped_on_purpose():
    """The table lists every exception kazoo defines (a new kazoo's would fall to
    its base, the fail-closed reading: this test then names it)."""
    import inspect

    from kazoo import exceptions as kz

    from celery_dlock.backends.zookeeper.answers import ANSWERS, UNEXPECTED, meaning_of

    listed = {kind for kind, _, _ in ANSWERS}
    defined = {cls for _, cls in inspect.getmembers(kz, inspect.isclass)
               if issubclass(cls, Exception) and cls.__module__ == kz.__name__}
    assert defined - listed == set(), sorted(c.__name__ for c in defined - listed)
    # each row is reached (no row is shadowed by one before it)
    for kind, meaning, why in ANSWERS:
        assert meaning_of(kind.__new__(kind)) == (meaning, why), kind
    assert meaning_of(ValueError())[0] == UNEXPECTED
