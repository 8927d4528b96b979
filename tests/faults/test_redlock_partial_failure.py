"""RedlockLock when one node of three fails in part: it refuses writes (out of memory,
a read-only replica), it is stopped longer than the ttl, or two "nodes" are one server.

Each test starts its own redis-servers (no persistence), which it reconfigures with
``CONFIG SET``/``REPLICAOF`` or stops with SIGSTOP.  Timing bounds are generous (a
loaded two-core machine); every wait is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from dlock_helpers import closed_port, wait_until
from proxy import FaultProxy

from celery_dlock import RedisLock, RedlockLock
from celery_dlock.backends.redis.redlock.workers import IDLE_EXIT, NODE_WORKERS
from celery_dlock.backends.redis.scripts import ACQUIRE, RELEASE
from celery_dlock.ops.embedded import EmbeddedRedis


class Nodes:
    """Three independent redis-servers of one test, and clients of them."""

    def __init__(self) -> None:
        self.servers = [EmbeddedRedis(extra_args=("--maxmemory-policy", "noeviction"))
                        for _ in range(3)]
        self.extra: list[EmbeddedRedis] = []
        self._clients: list[redis.Redis] = []
        #: Per node, how the lock's clients log in (default: no ACL user).
        self.auth: dict[int, dict[str, str]] = {}

    def start(self) -> Nodes:
        for s in self.servers:
            s.start()
        return self

    def client(self, server: EmbeddedRedis, **kwargs: Any) -> redis.Redis:
        kwargs.setdefault("socket_timeout", 5)
        c = redis.Redis(host=server.host, port=server.port, **kwargs)
        self._clients.append(c)
        return c

    def clients(self) -> list[redis.Redis]:
        return [self.client(s, **self.auth.get(i, {}))
                for i, s in enumerate(self.servers)]

    def admin(self, i: int) -> redis.Redis:
        return self.client(self.servers[i])

    def out_of_memory(self, i: int) -> None:
        """Node ``i`` answers every write with OOM (and still answers reads)."""
        self.admin(i).config_set("maxmemory", 1)

    def read_only_replica(self, i: int) -> None:
        """Node ``i`` becomes a replica of a fresh server: writes answer READONLY."""
        master = EmbeddedRedis().start()
        self.extra.append(master)
        self.admin(i).replicaof(master.host, master.port)

    def no_script_permission(self, i: int) -> None:
        """The lock's clients log in to node ``i`` as a user that may not run
        scripts: every lock operation there answers NOPERM."""
        self.admin(i).acl_setuser("dlock", enabled=True, passwords=["+a-secret-pw"],
                                  keys=["*"], commands=["+@all", "-eval", "-evalsha"])
        self.auth[i] = {"username": "dlock", "password": "a-secret-pw"}

    def stop_process(self, i: int) -> None:
        self._signal(i, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        self._signal(i, signal.SIGCONT)

    def _signal(self, i: int, sig: int) -> None:
        process = self.servers[i].process
        assert process is not None
        os.kill(process.pid, sig)

    def owners(self, key: str, which: tuple[int, ...] = (0, 1, 2)) -> list[str | None]:
        """The owner of ``key`` on each node of ``which``, asked directly."""
        out: list[str | None] = []
        for i in which:
            value = self.admin(i).hget(key, "owner")
            out.append(value.decode() if value is not None else None)
        return out

    def close(self) -> None:
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()
        for s in [*self.servers, *self.extra]:
            if s.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(s.process.pid, signal.SIGCONT)
            s.stop()


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    started = Nodes()
    try:
        yield started.start()
    finally:
        started.close()


def _lock(clients: list[redis.Redis], name: str, owner: str,
          **kwargs: Any) -> RedlockLock:
    kwargs.setdefault("ttl", 2.0)
    kwargs.setdefault("node_timeout", 0.2)
    return RedlockLock(clients, name, owner=owner, prefix="pf", **kwargs)


# -- one node refuses writes ------------------------------------------------------------

REFUSALS: dict[str, Callable[[Nodes, int], None]] = {
    "out-of-memory": Nodes.out_of_memory,
    "read-only-replica": Nodes.read_only_replica,
    "no-acl-permission": Nodes.no_script_permission,
}
ERRORS = {"out-of-memory": "OutOfMemoryError", "read-only-replica": "ReadOnlyError",
          "no-acl-permission": "NoPermissionError"}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_one_node_refusing_writes_does_not_veto_the_quorum(nodes, refusal, caplog):
    REFUSALS[refusal](nodes, 2)
    caplog.set_level(logging.DEBUG, logger="celery_dlock")
    a = _lock(nodes.clients(), "refuse", "owner-a")
    b = _lock(nodes.clients(), "refuse", "owner-b")
    for round_ in range(3):  # every time, not by luck
        assert a.acquire(blocking=False), f"round {round_}: 2 of 3 granted"
        assert nodes.owners(a.keys.lock)[:2] == ["owner-a", "owner-a"]
        # the refusing node took nothing (out of memory: a grant's first write, the
        # fence counter's SET, is one Redis refuses memory to)
        assert nodes.owners(a.keys.lock)[2] is None
        assert not b.acquire(blocking=False)
        assert a.holder() is not None and a.holder().owner == "owner-a"
        # extend and release are answered OK by the quorum, whatever the third says
        a.extend(3.0)
        assert not a.lost and a.owned()
        a.release()
        assert a.depth == 0
        assert nodes.owners(a.keys.lock)[:2] == [None, None]
    # a renewal scheduler keeps the hold past several ttls on the two others
    assert a.acquire(blocking=False)
    time.sleep(2.5)
    a.ensure_held()
    assert not a.lost and a.lost_reason is None
    a.release()
    # the log names the node that refused and its error, and tells no untruth
    messages = [r.getMessage() for r in caplog.records]
    assert not any("after its validity ended" in m for m in messages), messages
    port = nodes.servers[2].port
    word = ERRORS[refusal]
    if refusal == "out-of-memory":
        return
    assert any(f":{port}/0" in m and word in m and "refused" in m for m in messages), \
        messages
    assert not any("a-secret-pw" in m for m in messages)


def test_a_refusing_node_among_too_few_is_unavailable_and_named(nodes):
    from celery_dlock import BackendUnavailable

    nodes.read_only_replica(1)
    nodes.read_only_replica(2)
    a = _lock(nodes.clients(), "two-refuse", "owner-a")
    with pytest.raises(BackendUnavailable,
                       match=r"1 of 3 nodes answered.*:\d+/0: ReadOnlyError"):
        a.acquire(blocking=False)
    assert nodes.owners(a.keys.lock) == [None, None, None]  # given back on node 0



# -- one node stopped longer than the ttl -----------------------------------------------


@pytest.mark.slow
def test_one_node_stopped_past_several_ttls_starves_nobody(nodes):
    a = _lock(nodes.clients(), "held", "owner-a")  # ttl 2 s
    assert a.acquire(blocking=False)
    assert wait_until(lambda: nodes.owners(a.keys.lock) == ["owner-a"] * 3)
    shared = nodes.clients()  # what an application's backend has: one set of clients
    baseline = threading.active_count()
    most = baseline
    stop = threading.Event()
    tries = [0]

    errors: list[BaseException] = []

    def wait_for_held(k: int) -> None:
        # busy waiters for the held lock: each refused try sends calls to the stopped
        # node, and a give-back of that try there too.  Their node timeout leaves a
        # loaded machine (two cores, another test beside) time to start their calls
        # to the live nodes; the stopped node keeps each of its calls that long.
        waiter = _lock(shared, "held", f"waiter-{k}", node_timeout=0.5)
        while not stop.is_set():
            try:
                assert not waiter.acquire(timeout=0.5)
            except BaseException as exc:
                errors.append(exc)
                return
            tries[0] += 1

    waiters = [threading.Thread(target=wait_for_held, args=(k,), daemon=True)
               for k in range(20)]
    nodes.stop_process(1)
    try:
        for t in waiters:
            t.start()
        end = time.monotonic() + 8.0  # four ttls
        n = 0
        while time.monotonic() < end:
            n += 1
            other = _lock(shared, f"other-{n}", f"owner-{n}")
            started = time.monotonic()
            assert other.acquire(blocking=False), f"acquire {n} while node 1 is stopped"
            assert time.monotonic() - started < 1.5
            other.release()
            assert not a.lost, a.lost_reason
            most = max(most, threading.active_count())
            time.sleep(0.2)
        assert errors == []
        assert n >= 10 and tries[0] >= 20
        assert not a.lost and a.lost_reason is None
        a.ensure_held()
        assert nodes.owners(a.keys.lock, (0, 2)) == ["owner-a", "owner-a"]
    finally:
        stop.set()
        nodes.resume(1)
        for t in waiters:
            t.join(timeout=10)
    assert not any(t.is_alive() for t in waiters)
    # the stopped node answers again and takes part in what follows
    a.extend(2.0)
    assert not a.lost
    a.release()
    late = _lock(shared, "after", "owner-z")
    assert late.acquire(blocking=False)
    assert wait_until(lambda: nodes.owners(late.keys.lock) == ["owner-z"] * 3)
    late.release()
    most = max(most, threading.active_count())
    # the calls hung on the stopped node did not pile up threads (the test's own 20
    # waiters aside)
    assert most - len(waiters) < baseline + 40, (baseline, most)
    ports = [f":{s.port}" for s in nodes.servers]

    def workers() -> int:
        return sum(1 for t in threading.enumerate()
                   if t.name.startswith("celery-dlock-redlock-")
                   and t.name.endswith(tuple(ports)))

    assert workers() <= 3 * NODE_WORKERS
    # and they end once idle
    assert wait_until(lambda: workers() == 0, timeout=IDLE_EXIT + 10)


# -- a give-back that arrives late -----------------------------------------------------


def _evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0))


def test_a_late_give_back_never_removes_the_owners_next_hold(nodes):
    """The steps of a black-holed node healing, in a fixed order: attempt 1 is
    refused by nodes 0 and 1 and granted by node 2, whose give-back is held up on the
    way (past the node timeout: the caller goes on); that grant expires; the same
    owner's attempt 2 takes a new hold on all three; then the give-back reaches node 2.
    It names the acquire it undoes, so it leaves attempt 2's hold there alone (before,
    it released whatever the owner held: the hold just granted was gone from node 2)."""
    proxy = FaultProxy(nodes.servers[2].port)
    through_proxy = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=5)
    try:
        clients = [*nodes.clients()[:2], through_proxy]
        # No renewal: the only script call node 2 gets after attempt 2 is the give-back.
        a = _lock(clients, "late-undo", "owner-a", ttl=1.0, node_timeout=0.2,
                  auto_renew=False)
        others = [RedisLock(nodes.admin(i), "late-undo", owner="owner-x", ttl=30,
                            prefix="pf", auto_renew=False) for i in (0, 1)]
        for other in others:
            assert other.acquire(blocking=False)
        nodes.admin(2).script_load(RELEASE.source)  # a late EVALSHA finds it there
        held = proxy.hold_request(RELEASE.sha.encode())
        assert not a.acquire(blocking=False)  # attempt 1: 1 of 3 granted
        assert held.arrived.wait(5)  # its give-back to node 2, held up
        assert nodes.owners(a.keys.lock) == ["owner-x", "owner-x", "owner-a"]
        for other in others:
            other.release()
        # attempt 1's grant on node 2 ends by its ttl
        assert wait_until(lambda: nodes.owners(a.keys.lock, (2,)) == [None],
                          timeout=5)
        assert a.acquire(blocking=False)  # attempt 2, the same owner
        assert wait_until(lambda: nodes.owners(a.keys.lock) == ["owner-a"] * 3)
        a.extend(30.0)  # past the checks below; node 2 may answer after the quorum
        assert wait_until(lambda: nodes.admin(2).pttl(a.keys.lock) > 5000)
        before = _evalsha_calls(nodes.admin(2))
        held.let_go()  # now the give-back of attempt 1 reaches node 2
        assert held.forwarded.wait(5)
        assert wait_until(lambda: _evalsha_calls(nodes.admin(2)) > before, timeout=5)
        assert nodes.owners(a.keys.lock) == ["owner-a"] * 3
        assert not a.lost
        a.ensure_held()
        a.release()
        assert wait_until(lambda: nodes.owners(a.keys.lock) == [None] * 3)
    finally:
        through_proxy.close()
        proxy.close()


def test_a_retry_within_one_acquire_is_not_undone_by_the_last_attempts_give_back(
        nodes):
    """One blocking acquire, two attempts: attempt 1 is refused by nodes 0 and 1 and
    granted by node 2, whose give-back is held up; nodes 0 and 1 are freed and
    attempt 2 is granted by all three; then the give-back reaches node 2.  Each attempt
    has an operation id of its own: attempt 2 counts in node 2's hold beside attempt
    1, and the give-back of attempt 1 takes back only its own count (with one id for
    both, node 2 answered attempt 2 with attempt 1's remembered grant, and the
    give-back then removed the hold attempt 2 counted on)."""
    proxy = FaultProxy(nodes.servers[2].port)
    through_proxy = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=5)
    try:
        clients = [*nodes.clients()[:2], through_proxy]
        a = _lock(clients, "retry-undo", "owner-a", ttl=10.0, node_timeout=0.2,
                  auto_renew=False)
        others = [RedisLock(nodes.admin(i), "retry-undo", owner="owner-x", ttl=30,
                            prefix="pf", auto_renew=False) for i in (0, 1)]
        for other in others:
            assert other.acquire(blocking=False)
        nodes.admin(2).script_load(RELEASE.source)  # a late EVALSHA finds it there
        held = proxy.hold_request(RELEASE.sha.encode())
        got: list[bool] = []
        acquiring = threading.Thread(target=lambda: got.append(a.acquire(timeout=10)))
        acquiring.start()
        try:
            assert held.arrived.wait(5)  # attempt 1 failed; its give-back held up
            for other in others:
                other.release()
        finally:
            acquiring.join(15)
        assert got == [True]  # a later attempt of the same acquire
        assert wait_until(lambda: nodes.owners(a.keys.lock) == ["owner-a"] * 3)
        # Node 2 had attempt 1's hold already: wait for attempt 2 to count there too
        # (its call may land after the quorum's reply, on a loaded machine).
        assert wait_until(lambda: nodes.admin(2).hget(a.keys.lock, "count") == b"2",
                          timeout=5)
        before = _evalsha_calls(nodes.admin(2))
        held.let_go()
        assert held.forwarded.wait(5)
        assert wait_until(lambda: _evalsha_calls(nodes.admin(2)) > before, timeout=5)
        assert nodes.owners(a.keys.lock) == ["owner-a"] * 3
        a.ensure_held()
        a.release()
        assert wait_until(lambda: nodes.owners(a.keys.lock) == [None] * 3)
    finally:
        through_proxy.close()
        proxy.close()


@pytest.mark.parametrize("grant", ["answered-after-the-quorum", "never-answered"])
def test_a_late_release_never_removes_the_owners_next_hold(nodes, grant):
    """A release held up on its way to node 2 (the caller is back once nodes 0 and 1
    confirmed) reaches it only after that hold expired there and the same owner took a
    new one: it names the hold it is for (by node 2's fence, learned from the grant's
    late answer, or, with no answer, by the acquire that took it) and leaves the new
    hold alone.  Before, it released whatever the owner held there."""
    proxy = FaultProxy(nodes.servers[2].port)
    through_proxy = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=5)
    try:
        clients = [*nodes.clients()[:2], through_proxy]
        a = _lock(clients, "late-release", "owner-a", ttl=1.0, node_timeout=0.2,
                  auto_renew=False)
        for script in (ACQUIRE, RELEASE):  # a late EVALSHA finds it there
            nodes.admin(2).script_load(script.source)
        if grant == "never-answered":
            held_grant = proxy.hold_request(ACQUIRE.sha.encode())
            assert a.acquire(blocking=False)  # by nodes 0 and 1
            assert held_grant.arrived.wait(5)
            time.sleep(0.3)  # node 2's call timed out: its answer is never read
            held_grant.let_go()
        else:
            assert a.acquire(blocking=False)
        assert wait_until(lambda: nodes.owners(a.keys.lock) == ["owner-a"] * 3)
        held = proxy.hold_request(RELEASE.sha.encode())
        a.release()  # nodes 0 and 1 confirm
        assert held.arrived.wait(5)
        assert wait_until(lambda: nodes.owners(a.keys.lock) == [None] * 3, timeout=5)
        assert a.acquire(blocking=False)  # the same owner's next hold
        assert wait_until(lambda: nodes.owners(a.keys.lock) == ["owner-a"] * 3)
        a.extend(30.0)
        assert wait_until(lambda: nodes.admin(2).pttl(a.keys.lock) > 5000)
        before = _evalsha_calls(nodes.admin(2))
        held.let_go()  # the first hold's release reaches node 2 now
        assert held.forwarded.wait(5)
        assert wait_until(lambda: _evalsha_calls(nodes.admin(2)) > before, timeout=5)
        assert nodes.owners(a.keys.lock) == ["owner-a"] * 3
        a.ensure_held()
        a.release()
        assert wait_until(lambda: nodes.owners(a.keys.lock) == [None] * 3)
    finally:
        through_proxy.close()
        proxy.close()


# -- one server is not several nodes ----------------------------------------------------


def test_one_server_given_as_several_nodes_is_refused_without_the_network(nodes):
    from celery_dlock import InvalidLockConfig
    from celery_dlock.backends.redis.redlock.backend import RedlockBackend

    s = nodes.servers[0]
    port = closed_port()  # nothing listens: refused without asking anyone
    secret = "hunter2-secret"
    cases = {
        "databases 0, 1, 2 of one server": [
            redis.Redis.from_url(f"redis://:{secret}@127.0.0.1:{port}/{db}")
            for db in range(3)],
        "one host:port twice": [
            redis.Redis(host="127.0.0.1", port=port),
            redis.Redis(host="127.0.0.1", port=s.port),
            redis.Redis(host="127.0.0.1", port=port)],
        "127.0.0.1 and localhost": [
            redis.Redis(host="127.0.0.1", port=port, password=secret),
            redis.Redis(host="localhost", port=port, db=1, password=secret),
            redis.Redis(host="127.0.0.1", port=s.port)],
    }
    for case, clients in cases.items():
        for make in (lambda c: RedlockLock(c, "dup"), RedlockBackend):
            with pytest.raises(InvalidLockConfig) as caught:
                make(clients)
            message = str(caught.value)
            assert "one server" in message and f":{port}/" in message, (case, message)
            assert "nodes 0 and" in message and secret not in message, (case, message)
        for c in clients:
            c.close()


def test_two_names_of_one_server_are_refused_when_first_contacted(nodes):
    from celery_dlock import BackendUnavailable, InvalidLockConfig

    tcp_and_unix = EmbeddedRedis(unix_socket=True).start()
    nodes.extra.append(tcp_and_unix)
    path = tcp_and_unix.unix_socket_path
    assert path is not None
    # a node that is down is allowed at construction, and by the check
    down = redis.Redis(host="127.0.0.1", port=closed_port(), socket_timeout=1)
    over_tcp = nodes.client(tcp_and_unix)
    over_unix = redis.Redis(unix_socket_path=path, socket_timeout=5)
    lock = _lock([over_tcp, down, over_unix], "two-names", "owner-a")  # no network
    with pytest.raises(InvalidLockConfig) as caught:
        lock.acquire(blocking=False)
    message = str(caught.value)
    assert "nodes 0 and 2" in message and "same run_id" in message
    assert f":{tcp_and_unix.port}/0" in message and f"unix://{path}" in message
    # nothing was kept: the one server has no hold
    assert wait_until(lambda: not over_tcp.exists(lock.keys.lock))
    assert lock.depth == 0
    # independent servers with one of them down: acquired, and two down is only
    # unavailable, never a configuration error
    fine = _lock([nodes.client(nodes.servers[0]), down, nodes.client(nodes.servers[1])],
                 "one-down", "owner-b")
    assert fine.acquire(blocking=False)
    fine.release()
    two_down = _lock([nodes.client(nodes.servers[0]), down,
                      redis.Redis(host="127.0.0.1", port=closed_port())],
                     "two-down", "owner-c")
    with pytest.raises(BackendUnavailable):
        two_down.acquire(blocking=False)
    over_unix.close()
    down.close()
