"""``lock_rate``: a per-name rate, cluster-wide, on the server's clock (GCRA).

The rule on each store that keeps rates directly (Redis, PostgreSQL: grants, parked
slots, a parked call's return, a re-sent take, the state ``celery dlock show`` reads),
the checks at declaration and worker start, and two real worker nodes (on Redis, and
with their locks and rates on PostgreSQL) running 30 calls at 5/s with
``max_retries=0``: all succeed, and
no one-second window holds more starts than the rate plus the burst; that bound also
when calls wait for the lock or come back from contention retries (the rate is asked
with the lock held, right before the body starts).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner
from worker_harness import Harness, open_harness, wait_for

from celery_dlock import InvalidLockConfig, LockedTask, LockKeyConflict
from celery_dlock.backends.redis.rate import RedisRates, rate_key
from celery_dlock.core.errors import NotSupported
from celery_dlock.core.rates import parse_rate
from celery_dlock.ops.cli import dlock
from celery_dlock.task.startup import check_app


def _body() -> None:
    """A task body (Celery needs a named function)."""


class Store(NamedTuple):
    """A store that keeps rates: its kind, its URL (for ``celery dlock``), its
    :class:`~celery_dlock.core.protocol.RateStore`."""

    kind: str
    url: str
    rates: Any


def _store(kind: str, request: pytest.FixtureRequest) -> Iterator[Store]:
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        yield Store("redis", url, RedisRates(client))
        client.close()
        return
    if kind == "zookeeper":
        pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper "
                                            "extra)")
        from celery_dlock.backends.zookeeper import backend_from_url

        url = str(request.getfixturevalue("zk_server").url)
        yield Store("zookeeper", url, backend_from_url(url).rates())
        return
    if kind == "mysql":
        from celery_dlock.backends.sql.mysql.backend import MySQLBackend

        url = str(request.getfixturevalue("mariadb_url"))
        yield Store("mysql", url, MySQLBackend(url).rates())
        return
    from celery_dlock.backends.sql.postgres.backend import PostgresBackend

    url = str(request.getfixturevalue("postgres_server").url)
    yield Store("postgres", url, PostgresBackend(url).rates())


@pytest.fixture(params=["redis", "postgres", "mysql", "zookeeper"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each store that keeps rates in turn (PostgreSQL, MariaDB and ZooKeeper
    skipped, with the reason, where there is no server)."""
    yield from _store(request.param, request)


@pytest.fixture(params=["postgres", "mysql"])
def sql_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each SQL store that keeps rates in turn."""
    yield from _store(request.param, request)


@pytest.fixture(params=["postgres", "mysql", "zookeeper"])
def cas_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each store whose take is a compare-and-set loop around gcra_take (its
    ``_insert`` and ``_update`` writes), in turn."""
    yield from _store(request.param, request)


@pytest.fixture
def zk_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """The ZooKeeper store (skipped, with the reason, where there is no server)."""
    yield from _store("zookeeper", request)


@pytest.fixture
def rates(store: Store) -> Any:
    return store.rates


def test_gcra_grants_at_the_rate_and_parks_in_order(rates, prefix, name):
    rate = parse_rate("5/s")  # one call every 0.2 s, no burst
    assert rates.take(prefix, name, rate).run
    parked = [rates.take(prefix, name, rate) for _ in range(3)]
    assert not any(d.run for d in parked)
    slots = [d.slot for d in parked]
    assert all(s is not None for s in slots)
    # Successive slots, one interval apart, in the order asked.
    gaps = [(b - a) / 1e6 for a, b in itertools.pairwise(slots)]  # type: ignore[operator]
    assert all(abs(g - 0.2) < 0.005 for g in gaps), gaps
    assert 0.1 < parked[0].delay <= 0.2 and parked[2].delay > parked[1].delay
    state = rates.state(prefix, name)
    assert state is not None and state.available == 0
    assert state.interval == pytest.approx(0.2) and state.burst == 1
    assert 0.6 < state.next_in <= 0.8


def test_a_parked_call_runs_at_its_slot_without_asking_again(rates, prefix, name):
    rate = parse_rate("5/s")
    assert rates.take(prefix, name, rate).run
    parked = rates.take(prefix, name, rate)
    assert not parked.run
    early = rates.take(prefix, name, rate, parked.slot)
    assert not early.run and early.slot == parked.slot, "too early: the same slot"
    time.sleep(parked.delay + 0.01)
    assert rates.take(prefix, name, rate, parked.slot).run
    # Its slot was already counted (tat unmoved): the next call's slot is the one
    # right after it, not one more interval on.
    after = rates.take(prefix, name, rate)
    assert not after.run and after.slot == parked.slot + 200_000


def test_a_slot_starts_one_body(rates, prefix, name):
    """A parked message delivered twice (its worker died after the body started; a
    retry that kept the slot header) starts once at its slot: the second delivery
    asks afresh and, the rate being spent, is parked for a new slot."""
    rate = parse_rate("5/s")
    assert rates.take(prefix, name, rate).run
    parked = rates.take(prefix, name, rate)
    assert not parked.run
    time.sleep(parked.delay + 0.01)
    assert rates.take(prefix, name, rate, parked.slot).run
    again = rates.take(prefix, name, rate, parked.slot)
    # Asked afresh: a new slot, the one after the claimed one (tat moved on).
    assert not again.run and again.slot == parked.slot + 200_000


def test_a_parked_call_back_late_asks_afresh(rates, prefix, name):
    rate = parse_rate("5/s")
    assert rates.take(prefix, name, rate).run
    parked = rates.take(prefix, name, rate)
    time.sleep(parked.delay + 0.5)  # more than one interval past its slot
    assert rates.take(prefix, name, rate, parked.slot).run  # free again: granted
    again = rates.take(prefix, name, rate, parked.slot)  # the same late slot
    assert not again.run and again.slot != parked.slot


def test_a_burst_lets_that_many_through_at_once(rates, prefix, name):
    rate = parse_rate("2/s", burst=3)
    assert [rates.take(prefix, name, rate).run for _ in range(4)] == \
        [True, True, True, False]
    assert rates.state(prefix, name).burst == 3  # type: ignore[union-attr]


def test_the_state_expires_when_the_name_is_quiet(store, rates, prefix, name):
    rates.take(prefix, name, parse_rate("50/s"))
    if store.kind == "redis":  # the key itself goes (no row is left behind)
        client = rates.client
        assert 0 < client.pttl(rate_key(prefix, name)) <= 1100
    assert rates.state(prefix, name + "-other") is None
    assert rates.state(prefix, name) is not None
    assert [n for n, _ in rates.states(prefix)] == [name]
    time.sleep(1.1)  # tat + 1 s passed
    assert rates.state(prefix, name) is None
    assert list(rates.states(prefix)) == []
    assert rates.take(prefix, name, parse_rate("50/s")).run, "a fresh start"


def test_a_re_sent_take_takes_one_slot(rates, prefix, name):
    """The same operation twice (a reply lost, the request sent again): the first
    answer, and no second slot."""
    # One a minute: the four takes fall in one interval even when the store is slow
    # or paused meanwhile (the suite's servers are shared by the tests of a run).
    rate = parse_rate("1/m")
    # Two distinct operations (a fixed first character would equal the uuid's own
    # one time in sixteen, making the "second" operation the first one again).
    op, other = "a" + uuid.uuid4().hex, "b" + uuid.uuid4().hex
    assert rates.take_op(prefix, name, rate, None, op).run
    assert rates.take_op(prefix, name, rate, None, op).run, "its first answer"
    parked = rates.take_op(prefix, name, rate, None, other)
    again = rates.take_op(prefix, name, rate, None, other)
    assert not parked.run and again.slot == parked.slot
    # One grant and one parked call: the next slot is the second after the grant.
    assert rates.take(prefix, name, rate).slot == parked.slot + 60_000_000


@pytest.mark.parametrize("odd", ["x" * 5000, "a\x00b", "\x01sha256:looks-digested"])
def test_a_long_or_odd_name_keeps_its_rate(rates, prefix, odd):
    rate = parse_rate("5/s")
    assert rates.take(prefix, odd, rate).run
    assert not rates.take(prefix, odd, rate).run
    assert rates.take(prefix, odd[:-1] + "?", rate).run, "another name's own rate"
    state = rates.state(prefix, odd)
    assert state is not None and state.available == 0
    assert len(dict(rates.states(prefix))) == 2


def test_two_threads_never_get_more_than_the_rate_and_burst(rates, prefix, name):
    """Two threads taking one name as fast as they can for 1.5 s at 20/s, burst 2,
    each parked call coming back at its slot as the Celery face does: no window of
    one second holds more than R + B starts (timed on the threads' clock: the
    bound has one interval of slack for that)."""
    rate = parse_rate("20/s", burst=2)
    starts: list[float] = []
    errors: list[BaseException] = []
    end = time.monotonic() + 1.5

    def hammer() -> None:
        try:
            while time.monotonic() < end:
                decision = rates.take(prefix, name, rate)
                while not decision.run and time.monotonic() < end + 1:
                    time.sleep(decision.delay)
                    decision = rates.take(prefix, name, rate, decision.slot)
                    if not decision.run and decision.delay == 0:
                        break  # its slot was spent: ask afresh
                if decision.run:
                    starts.append(time.monotonic())
        except BaseException as exc:  # shown by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    starts.sort()
    worst = max(sum(1 for t in starts if s <= t < s + 1.0) for s in starts)
    assert len(starts) >= 20 and worst <= 22, (worst, len(starts))


def _one_slot_taken(write: str, first: Any, after: Any) -> None:
    """A take whose ``write`` landed twice (or once, its reply lost) took one slot:
    the take after it waits one interval (5/s: 0.2 s) more, not two."""
    if write == "_insert":
        assert first.run and not after.run
        assert after.slot is not None and after.delay > 0.15, "one slot, not two"
    else:
        assert not first.run and first.slot is not None
        assert after.slot == first.slot + 200_000, "one slot, not two"


@pytest.mark.parametrize("write", ["_insert", "_update"])
def test_a_write_sent_twice_takes_one_slot(cas_store, prefix, name, monkeypatch,
                                          write):
    """SQL and ZooKeeper: the server ran a take's write but its reply was lost, and
    it was sent again (SQL: the server object re-sends the statement once on a fresh
    connection; ZooKeeper: a create or a set at the version read, sent again): the
    second changes nothing (its compare-and-set fails), the re-read finds the
    call's op and answers as the first, and one slot is taken."""
    rates = cas_store.rates
    rate = parse_rate("5/s")
    if write == "_update":
        assert rates.take(prefix, name, rate).run  # a row to update
    sent = getattr(rates, write)

    def twice(*args: Any) -> bool:
        sent(*args)  # ran; its reply lost
        return bool(sent(*args))

    monkeypatch.setattr(rates, write, twice)
    first = rates.take(prefix, name, rate)
    monkeypatch.undo()
    after = rates.take(prefix, name, rate)
    _one_slot_taken(write, first, after)


@pytest.mark.parametrize("write", ["_insert", "_update"])
def test_zookeeper_a_write_whose_reply_was_lost_takes_one_slot(zk_store, prefix, name,
                                                              monkeypatch, write):
    """ZooKeeper: a take's write landed but its reply was lost (the connection
    dropped: BackendUnavailable): the take reads again, finds its op and its
    answer, and one slot is taken; a second loss in a row is the caller's."""
    from celery_dlock import BackendUnavailable

    rates = zk_store.rates
    rate = parse_rate("5/s")
    if write == "_update":
        assert rates.take(prefix, name, rate).run  # a node to update
    sent = getattr(rates, write)

    def lost(*args: Any) -> bool:
        sent(*args)
        raise BackendUnavailable("ZooKeeper unavailable during a rate take: the "
                                 "connection was lost (test)")

    monkeypatch.setattr(rates, write, lost)
    first = rates.take(prefix, name, rate)  # landed; answered by the re-read
    monkeypatch.undo()
    after = rates.take(prefix, name, rate)
    _one_slot_taken(write, first, after)

    def never(*args: Any) -> bool:
        raise BackendUnavailable("ZooKeeper unavailable during a rate take: the "
                                 "connection was lost (test)")

    monkeypatch.setattr(rates, "_insert", never)
    monkeypatch.setattr(rates, "_update", never)
    with pytest.raises(BackendUnavailable, match="ZooKeeper"):
        rates.take(prefix, name, rate)  # lost twice in a row: the caller's


def _zk_client(url: str) -> Any:
    from zk_server import ZkView

    return ZkView(url.removeprefix("zookeeper://"))


def test_zookeeper_foreign_data_at_a_rate_node_is_a_conflict(zk_store, prefix, name):
    """ZooKeeper: another application's data where a name's rate node would be is
    LockKeyConflict at a take and at ``state`` (left as it was), and left out of
    ``states``; the rates subtree is no lock for ``holds``."""
    from celery_dlock.backends.zookeeper import backend_from_url
    from celery_dlock.backends.zookeeper.nodes import rate_path

    view = _zk_client(zk_store.url)
    try:
        path = rate_path(prefix, name)
        view.client.create(path, b"someone else's", makepath=True)
        rates = zk_store.rates
        with pytest.raises(LockKeyConflict, match="did not write"):
            rates.take(prefix, name, parse_rate("5/s"))
        with pytest.raises(LockKeyConflict):
            rates.state(prefix, name)
        assert rates.take(prefix, "other", parse_rate("5/s")).run
        assert [n for n, _ in rates.states(prefix)] == ["other"]
        assert view.client.get(path)[0] == b"someone else's"
        assert list(backend_from_url(zk_store.url).holds(prefix)) == []
    finally:
        view.close()


def test_zookeeper_reading_rates_makes_no_node(zk_store, prefix, name):
    """ZooKeeper: ``state`` and ``states`` where no take ever was create nothing
    (not even the prefix node); after a take, reading adds no node either."""
    view = _zk_client(zk_store.url)
    try:
        rates = zk_store.rates
        assert rates.state(prefix, name) is None
        assert list(rates.states(prefix)) == []
        assert view.client.exists(f"/{prefix}") is None
        rates.take(prefix, name, parse_rate("5/s"))
        before = sorted(view.client.get_children(f"/{prefix}/.rates"))
        assert rates.state(prefix, name + "-none") is None
        assert [n for n, _ in rates.states(prefix)] == [name]
        assert sorted(view.client.get_children(f"/{prefix}/.rates")) == before
        assert len(before) == 2  # the name's node and the clock
    finally:
        view.close()


def test_zookeeper_an_unreachable_ensemble_is_backend_unavailable(prefix, name):
    pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")
    from celery_dlock import BackendUnavailable
    from celery_dlock.backends.zookeeper import backend_from_url

    rates = backend_from_url("zookeeper://127.0.0.1:1/x?connect_timeout=1").rates()
    for read in (lambda: rates.take(prefix, name, parse_rate("5/s")),
                 lambda: rates.state(prefix, name),
                 lambda: list(rates.states(prefix))):
        with pytest.raises(BackendUnavailable, match="ZooKeeper"):
            read()


def _sql(store: Store, *statements: str) -> list[tuple[Any, ...]]:
    """Run ``statements`` on the SQL store's server as its administrator: the last
    one's rows."""
    rows: list[tuple[Any, ...]] = []
    if store.kind == "postgres":
        import psycopg

        with psycopg.connect(store.url, autocommit=True) as conn:
            for statement in statements:
                cur = conn.execute(statement)
                rows = cur.fetchall() if cur.description else []
        return rows
    import pymysql

    from celery_dlock.backends.sql.mysql.server import connect_args

    conn = pymysql.connect(**connect_args(store.url)[0], autocommit=True)
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
                rows = [tuple(row) for row in cur.fetchall()]
    finally:
        conn.close()
    return rows


def _rates_of(store: Store, table: str) -> Any:
    url = f"{store.url}{'&' if '?' in store.url else '?'}dlock_table={table}"
    if store.kind == "postgres":
        from celery_dlock.backends.sql.postgres.backend import PostgresBackend

        return PostgresBackend(url).rates()
    from celery_dlock.backends.sql.mysql.backend import MySQLBackend

    return MySQLBackend(url).rates()


def test_a_foreign_table_at_the_rates_table_name_is_a_conflict(sql_store, prefix,
                                                               name):
    """SQL: a table of another shape where the rates table would be is
    LockKeyConflict at the first take, and left as it was; reading rates (celery
    dlock ls) makes no rates table where none is.  (Redis: another application's
    data at the rate's key, test_a_rate_it_cannot_keep_leaves_no_lock_behind.)"""
    store = sql_store
    table = f"t_{uuid.uuid4().hex[:8]}"
    _sql(store, f"CREATE TABLE {table}_rates (a integer)",
         f"INSERT INTO {table}_rates VALUES (7)")
    rates = _rates_of(store, table)
    with pytest.raises(LockKeyConflict, match=f"{table}_rates"):
        rates.take(prefix, name, parse_rate("5/s"))
    assert _sql(store, f"SELECT * FROM {table}_rates") == [(7,)]
    columns = _sql(store, "SELECT column_name FROM information_schema.columns "
                          f"WHERE table_name = '{table}_rates'")
    assert [c[0].lower() for c in columns] == ["a"]
    # No rates table made by reading: a user without lock_rate never needs one.
    other = f"t_{uuid.uuid4().hex[:8]}"
    reader = _rates_of(store, other)
    assert reader.state(prefix, name) is None and list(reader.states(prefix)) == []
    assert _sql(store, "SELECT table_name FROM information_schema.tables "
                       f"WHERE table_name = '{other}_rates'") == []


@pytest.mark.parametrize("bad", ["5", "5/d", "5 / s", "/s", "0/s", "-1/s", "5/sec",
                                 "1e3/s", 5, None.__class__, "1000000/s"])
def test_a_bad_rate_is_refused_at_declaration(bad):
    app = Celery("rate-bad", broker="memory://", set_as_current=False)
    app.finalize()  # the decorator builds the task class at once
    with pytest.raises(InvalidLockConfig, match="lock_rate"):
        app.task(base=LockedTask, name=f"bad_{uuid.uuid4().hex[:6]}",
                 lock_rate=bad, shared=False)(_body)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_bad_burst_is_refused_at_declaration(bad):
    app = Celery("rate-bad", broker="memory://", set_as_current=False)
    app.finalize()  # the decorator builds the task class at once
    with pytest.raises(InvalidLockConfig, match="lock_rate_burst"):
        app.task(base=LockedTask, name=f"bad_{uuid.uuid4().hex[:6]}",
                 lock_rate="5/s", lock_rate_burst=bad, shared=False)(_body)


def test_a_rate_cannot_be_set_per_call(redis_url):
    app = Celery("rate-call", broker="memory://", set_as_current=False)
    app.finalize()
    task = app.task(base=LockedTask, name="rate_call", shared=False)(_body)
    with pytest.raises(InvalidLockConfig, match="per call"):
        task.apply_async(lock_rate="1/s")


@pytest.mark.parametrize("url", [
    ";".join(f"redlock://127.0.0.1:{port}/0" for port in (1, 2, 3))])
def test_a_backend_without_rates_refuses_lock_rate_at_worker_start(url):
    app = Celery("rate-redlock", broker="memory://", set_as_current=False)
    app.finalize()
    app.conf.dlock_url = url
    app.task(base=LockedTask, name="rated_redlock", lock_rate="5/s",
             shared=False)(_body)
    with pytest.raises(NotSupported, match="lock_rate"):
        check_app(app)


@pytest.mark.parametrize("url", ["postgresql://dlock@127.0.0.1:1/dlock",
                                 "mysql://dlock@127.0.0.1:1/dlock",
                                 "zookeeper://127.0.0.1:1/dlock"])
def test_the_sql_stores_keep_rates_at_worker_start(url):
    """PostgreSQL, MySQL and ZooKeeper keep rates: lock_rate passes the worker-start
    check (no call)."""
    app = Celery("rate-sql", broker="memory://", set_as_current=False)
    app.finalize()
    app.conf.dlock_url = url
    app.task(base=LockedTask, name="rated_sql", lock_rate="5/s", shared=False)(_body)
    check_app(app)


def test_celery_dlock_show_prints_the_rate_state(store, rates, prefix, name):
    rate = parse_rate("2/s", burst=2)
    rates.take(prefix, name, rate)
    app = Celery("rate-cli", broker="memory://", set_as_current=False)
    obj = CLIContext(app=app, no_color=True, workdir=None)
    args = ["--url", store.url, "--prefix", prefix, "show", name]
    out = CliRunner().invoke(dlock, args, obj=obj)
    assert out.exit_code == 0, out.output
    line = next(x for x in out.stdout.splitlines() if x.startswith("rate:"))
    assert "1 of 2 may start now" in line and "one every 0.500s" in line
    shown = json.loads(CliRunner().invoke(dlock, [*args, "--json"], obj=obj).stdout)
    assert shown["rate"]["burst"] == 2 and shown["rate"]["available"] == 1
    assert shown["rate"]["next_in"] == 0
    rates.take(prefix, name, rate)
    rates.take(prefix, name, rate)  # parked: the next slot is ahead
    shown = json.loads(CliRunner().invoke(dlock, [*args, "--json"], obj=obj).stdout)
    assert shown["rate"]["available"] == 0 and 0.3 < shown["rate"]["next_in"] <= 1.0


def test_celery_dlock_ls_lists_rated_names(store, rates, prefix, name):
    rates.take(prefix, name, parse_rate("1/s"))
    rates.take(prefix, name, parse_rate("1/s"))  # parked: the next slot is ahead
    app = Celery("rate-ls", broker="memory://", set_as_current=False)
    obj = CLIContext(app=app, no_color=True, workdir=None)
    args = ["--url", store.url, "--prefix", prefix, "ls"]
    out = CliRunner().invoke(dlock, args, obj=obj)
    assert out.exit_code == 0, out.output
    header, *lines = out.stdout.splitlines()
    assert header.split()[-1] == "RATE"
    (line,) = [x for x in lines if x.startswith(name)]  # not held: a row of its own
    assert "0/1 next" in line
    rows = json.loads(CliRunner().invoke(dlock, [*args, "--json"], obj=obj).stdout)
    (row,) = [x for x in rows if x["key"] == name]
    assert row["owner"] is None and row["rate"]["available"] == 0
    assert 1.0 < row["rate"]["next_in"] <= 2.0


def test_celery_dlock_top_shows_the_rates(store, rates, prefix, name):
    rates.take(prefix, name, parse_rate("1/s"))
    rates.take(prefix, name, parse_rate("1/s"))  # parked: the next slot is ahead
    app = Celery("rate-top", broker="memory://", set_as_current=False)
    obj = CLIContext(app=app, no_color=True, workdir=None)
    args = ["--url", store.url, "--prefix", prefix, "top", "--iterations", "1"]
    out = CliRunner().invoke(dlock, args, obj=obj)
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert "Rates (lock_rate, 1):" in lines
    (line,) = [x for x in lines if x.strip().startswith(name)]
    assert "0/1 next" in line


# -- real workers ----------------------------------------------------------------------


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


@pytest.fixture(params=["redis", "postgres", "mysql", "zookeeper"])
def store_harness(request: pytest.FixtureRequest, redis_url: str, r: redis.Redis,
                  prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> Iterator[Harness]:
    """A harness whose locks and rates are on each store that keeps rates in turn
    (the broker, results and the tasks' records stay on Redis)."""
    if request.param != "redis":
        from prefork_app import ENV_CONF

        url = str(request.getfixturevalue({
            "postgres": "postgres_server", "zookeeper": "zk_server"}[request.param]).url
        ) if request.param != "mysql" else str(request.getfixturevalue("mariadb_url"))
        monkeypatch.setenv(ENV_CONF, json.dumps({"dlock_url": url}))
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_nodes_keep_the_rate_and_park_without_dropping(store_harness: Harness
                                                          ) -> None:
    h = store_harness
    h.start_workers(count=2, concurrency=2)
    key = uuid.uuid4().hex[:8]
    task = h.app.tasks["pf.rated"]
    results = [task.delay(key, n) for n in range(30)]
    # All 30 succeed (max_retries=0: a parked call never counts as a retry).
    assert sorted(res.get(timeout=60) for res in results) == list(range(30))
    wait_for(lambda: len(h.records("rated", key)) >= 30, 10, what="30 recorded starts")
    runs = h.records("rated", key)
    assert len(runs) == 30, "each call ran once"
    assert {run["retries"] for run in runs} == {0}
    starts = sorted(run["start"] for run in runs)
    # Never more than the rate plus the burst (5 + 1) in any one-second window.
    worst = max(sum(1 for t in starts if s <= t < s + 1.0) for s in starts)
    assert worst <= 6, (worst, starts)
    # Parked, not run at once: 30 calls at 5/s need about 6 s.
    assert starts[-1] - starts[0] >= 5.0
    # Both nodes took part.
    assert len({run["node"] for run in runs}) == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["wait", "retry"])
def test_waiting_for_the_lock_lets_no_more_starts_through(store_harness: Harness,
                                                          policy: str) -> None:
    """1/s: the first call holds the lock 2.5 s; three more, parked for their slots
    (1, 2 and 3 s), meet the held lock and wait for it (or retry): when it frees,
    they must not all start at once."""
    h = store_harness
    h.start_workers(count=1, concurrency=4)
    key = uuid.uuid4().hex[:8]
    task = h.app.tasks["pf.rated_slow"]
    first = task.apply_async((key, 0, 2.5), on_contention=policy)
    wait_for(lambda: h.records("rated_slow", key), 20, what="the first start")
    rest = [task.apply_async((key, n, 0.0), on_contention=policy) for n in (1, 2, 3)]
    assert sorted(res.get(timeout=60) for res in [first, *rest]) == [0, 1, 2, 3]
    starts = sorted(run["start"] for run in h.records("rated_slow", key))
    assert len(starts) == 4, "each call ran once"
    # At most R + B = 1 + 1 starts in any one-second window.
    worst = max(sum(1 for t in starts if s <= t < s + 1.0) for s in starts)
    assert worst <= 2, [round(t - starts[0], 3) for t in starts]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rate_it_cannot_keep_leaves_no_lock_behind(harness: Harness) -> None:
    """Another application's data at the rate's key: the call fails with
    LockKeyConflict (the data untouched), and the lock it took to ask is released,
    not left to its ttl."""
    from celery_dlock import LockKeyConflict

    h = harness
    h.start_workers(count=1, concurrency=1)
    key = uuid.uuid4().hex[:8]
    name = f"rated:{key}"
    h.r.set(rate_key(h.prefix, name), "someone else's")
    with pytest.raises(LockKeyConflict):
        h.app.tasks["pf.rated"].delay(key, 1).get(timeout=30)
    assert h.owner(name) is None, "the lock is not left behind"
    assert h.r.get(rate_key(h.prefix, name)) == b"someone else's"
    assert h.records("rated", key) == [], "the body never ran"
