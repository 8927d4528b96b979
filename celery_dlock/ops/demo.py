"""The inventory demo: 200 in stock, 400 concurrent buyers, with and without the lock.

``celery-dlock demo`` starts a throwaway redis-server (unless ``--redis-url`` is given),
starts real ``celery worker`` processes (prefork) on this module's app, and sells the
same stock twice: once with a plain task, once with a :class:`LockedTask`.  Each buyer
reads the stock, thinks for 2 ms, and writes it back one lower: without a lock, buyers
that read the same stock each sell the same unit.

The Celery app below is configured from ``DLOCK_DEMO_*`` environment variables that the
demo command sets for the workers it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TextIO

import redis
from celery import Celery
from kombu.exceptions import KombuError

from ..core.urls import ENCODE_HINT, ambiguity
from ..task.connection import mask_url
from ..task.locked_task import LockedTask
from .embedded import EmbeddedRedis
from .interrupt import CtrlC
from .oneline import OneLineParser, mask_secrets

__all__ = ["app", "main", "run_demo"]

_URL = os.environ.get("DLOCK_DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
_PREFIX = os.environ.get("DLOCK_DEMO_PREFIX", "dlock-demo")
_QUEUE = os.environ.get("DLOCK_DEMO_QUEUE", "dlock-demo")

app = Celery("celery_dlock.ops.demo", broker=_URL, backend=_URL, set_as_current=False)
app.conf.update(
    task_default_queue=_QUEUE,
    broker_transport_options={"polling_interval": 0.1},
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    dlock_key_prefix=_PREFIX,
    result_expires=600,
)

_redis: redis.Redis | None = None
# Ctrl-C of the demo command: its loops stop at their next step (see .interrupt).
_CTRL_C = CtrlC()


def _client() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(_URL)
    return _redis


def _buy(product_id: int, phase: str) -> bool:
    """Read the stock, think 2 ms, write it back one lower: the racy part."""
    r = _client()
    stock_key = f"{_PREFIX}:{phase}:stock:{product_id}"
    stock = int(r.get(stock_key) or 0)
    sold = False
    if stock > 0:
        time.sleep(0.002)
        r.set(stock_key, stock - 1)
        r.incr(f"{_PREFIX}:{phase}:sold")
        sold = True
    r.incr(f"{_PREFIX}:{phase}:done")
    return sold


@app.task(name="demo.buy_plain")  # type: ignore[untyped-decorator]
def buy_plain(product_id: int) -> bool:
    return _buy(product_id, "plain")


@app.task(  # type: ignore[untyped-decorator]
    name="demo.buy_locked", base=LockedTask, lock_key="stock:{product_id}",
    on_contention="wait", lock_wait=60, lock_ttl=10)
def buy_locked(product_id: int) -> bool:
    return _buy(product_id, "locked")


# -- the command -----------------------------------------------------------------------


@dataclass
class PhaseResult:
    label: str
    stock: int
    buyers: int
    sold: int
    left: int
    seconds: float

    @property
    def oversold(self) -> int:
        return max(0, self.sold - self.stock)


def _progress(out: TextIO, label: str, done: int, total: int, width: int = 36) -> None:
    filled = int(width * done / total) if total else width
    bar = "#" * filled + "-" * (width - filled)
    out.write(f"\r  {label:<11} [{bar}] {done:>4}/{total}")
    out.flush()


@contextmanager
def _workers(url: str, prefix: str, queue: str, count: int, concurrency: int,
             out: TextIO, grace: float = 10.0) -> Iterator[list[str]]:
    """``count`` prefork workers on ``queue``; stopped on the way out: a warm shutdown
    (SIGTERM), and SIGKILL for a worker still running ``grace`` seconds later.  The
    demo's tasks take milliseconds, so a warm shutdown takes a second or two; now and
    then a prefork child waits at exit for its parent to read its last results while
    the parent waits for it to exit (billiard), until the grace ends it."""
    env = dict(os.environ, DLOCK_DEMO_REDIS_URL=url, DLOCK_DEMO_PREFIX=prefix,
               DLOCK_DEMO_QUEUE=queue)
    procs: list[subprocess.Popen[bytes]] = []
    names = [f"demo{i + 1}-{queue}@localhost" for i in range(count)]
    try:
        for name in names:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "celery_dlock.ops.demo", "worker",
                 "--pool=prefork", f"--concurrency={concurrency}", "-Q", queue,
                 "-n", name, "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "--loglevel=WARNING"],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True))
        yield names
    finally:
        out.write("  stopping workers...\n")
        for proc in procs:
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_ready(demo_app: Celery, names: Sequence[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = set(names)
    while waiting:
        _CTRL_C.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers did not start in {timeout:.0f}s: "
                               f"{', '.join(sorted(waiting))}")
        replies = demo_app.control.ping(destination=list(waiting), timeout=0.5) or []
        for reply in replies:
            waiting -= set(reply)


def _run_phase(demo_app: Celery, r: redis.Redis, prefix: str, phase: str, label: str,
               stock: int, buyers: int, out: TextIO, timeout: float,
               task_ids: list[str]) -> PhaseResult:
    product_id = 1
    r.set(f"{prefix}:{phase}:stock:{product_id}", stock)
    r.set(f"{prefix}:{phase}:sold", 0)
    r.set(f"{prefix}:{phase}:done", 0)
    name = "demo.buy_locked" if phase == "locked" else "demo.buy_plain"
    started = time.monotonic()
    for _ in range(buyers):
        _CTRL_C.check()
        task_id = uuid.uuid4().hex
        task_ids.append(task_id)  # before sending: an interrupt cleans it up too
        demo_app.send_task(name, args=(product_id,), task_id=task_id)
    deadline = started + timeout
    done = 0
    while done < buyers:
        _CTRL_C.check()
        done = int(r.get(f"{prefix}:{phase}:done") or 0)
        _progress(out, label, done, buyers)
        if time.monotonic() > deadline:
            out.write("\n")
            raise RuntimeError(f"{label}: only {done} of {buyers} buyers done after "
                               f"{timeout:.0f}s")
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    out.write(f"  {elapsed:.1f}s\n")
    return PhaseResult(label=label, stock=stock, buyers=buyers,
                       sold=int(r.get(f"{prefix}:{phase}:sold") or 0),
                       left=int(r.get(f"{prefix}:{phase}:stock:{product_id}") or 0),
                       seconds=elapsed)


def _table(plain: PhaseResult, locked: PhaseResult) -> str:
    rows: list[tuple[str, Any, Any]] = [
        ("buyers", plain.buyers, locked.buyers),
        ("in stock at start", plain.stock, locked.stock),
        ("units sold", plain.sold, locked.sold),
        ("left in stock", plain.left, locked.left),
        ("over-sold by", plain.oversold, locked.oversold),
        ("time", f"{plain.seconds:.1f}s", f"{locked.seconds:.1f}s"),
    ]
    lines = [f"  {'':<20}{'plain task':>14}{'LockedTask':>14}",
             f"  {'-' * 20}{'-' * 14}{'-' * 14}"]
    lines += [f"  {name:<20}{a!s:>14}{b!s:>14}" for name, a, b in rows]
    return "\n".join(lines)


_DEADLINES = "_kombu.binding_deadlines"
# kombu's record of delivered, not yet acknowledged messages (a hash by delivery tag
# and its index by time): a worker killed before its warm shutdown put them back
# leaves its entries there.
_UNACKED, _UNACKED_INDEX = "unacked", "unacked_index"


def _deadline_members(r: redis.Redis) -> set[bytes]:
    return {m for m in r.zrange(_DEADLINES, 0, -1) if isinstance(m, bytes)}


def _unacked_tags(r: redis.Redis, queue: str) -> list[bytes]:
    """Delivery tags of the unacknowledged messages that were routed to ``queue``
    (kombu keeps each as JSON ``[message, exchange, routing_key]``)."""
    tags = []
    for tag, entry in r.hscan_iter(_UNACKED, count=1000):
        try:
            _, exchange, routing_key = json.loads(entry)
        except (ValueError, TypeError):
            continue  # not kombu's, or not a form it writes: not the demo's either
        if queue in (exchange, routing_key):
            tags.append(tag)
    return tags


def _drop_worker_bindings(r: redis.Redis, queue: str) -> None:
    """Unbind the remote-control queues of this run's workers (``demoN-<queue>@...``)
    from the pidbox exchange: a killed worker never unbound its own."""
    for table in (b"_kombu.binding.celery.pidbox",
                  b"_kombu.binding_permanent.celery.pidbox"):
        ours = [member for member in r.sscan_iter(table, count=1000)
                if f"-{queue}@".encode() in member.rpartition(b"\x06\x16")[2]]
        if ours:
            r.srem(table, *ours)


def _cleanup(r: redis.Redis, prefix: str, queue: str, task_ids: Sequence[str],
             deadlines_before: set[bytes]) -> int:
    """Delete what this run created in Redis, and only that: the keys under its own
    prefix (stock, counters, locks), its queue and kombu's bindings of it, the
    results of the tasks it sent, what a worker that had to be killed left behind
    (its messages in kombu's unacked record, its pidbox binding), and the entries kombu
    added for this run to its binding-deadline index (the ping's pidbox exchanges
    included) when no binding table is left that needs them.  Returns how many keys
    went."""
    keys: list[Any] = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    keys += [queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"]
    keys += [f"{queue}\x06\x16{priority}" for priority in range(10)]
    keys += [f"celery-task-meta-{task_id}" for task_id in task_ids]
    deleted = 0
    for start in range(0, len(keys), 500):
        deleted += int(r.delete(*keys[start:start + 500]))
    tags = _unacked_tags(r, queue)
    for start in range(0, len(tags), 500):
        r.hdel(_UNACKED, *tags[start:start + 500])
        r.zrem(_UNACKED_INDEX, *tags[start:start + 500])
    _drop_worker_bindings(r, queue)
    for member in _deadline_members(r):
        if member not in deadlines_before and not r.exists(
                b"_kombu.binding." + member):
            r.zrem(_DEADLINES, member)
    return deleted


def _client_app(redis_url: str, queue: str) -> Celery:
    """The app the demo sends its buyers with (to ``queue``, the demo's own)."""
    # No result backend here: progress is read from Redis counters, and results the
    # workers store are deleted by task id.  (With one, every sent task would subscribe
    # to its result, and a Redis gone away would make them complain at exit.)
    demo_app = Celery("celery_dlock.ops.demo.client", broker=redis_url,
                      set_as_current=False)
    demo_app.conf.update(task_default_queue=queue,
                         broker_transport_options={"polling_interval": 0.1})
    return demo_app


def run_demo(redis_url: str | None = None, *, workers: int = 2, concurrency: int = 4,
             stock: int = 200, buyers: int = 400, out: TextIO = sys.stdout,
             timeout: float = 180.0) -> tuple[PhaseResult, PhaseResult]:
    """Run both phases and print the comparison; returns (plain, locked)."""
    server: EmbeddedRedis | None = None
    if redis_url is None:
        out.write("Starting an embedded redis-server... ")
        out.flush()
        server = EmbeddedRedis().start()
        redis_url = server.url
        out.write(f"{redis_url}\n")
    tag = uuid.uuid4().hex[:8]
    prefix, queue = f"dlock-demo-{tag}", f"dlock-demo-{tag}"
    demo_app = _client_app(redis_url, queue)
    r = redis.Redis.from_url(redis_url)
    task_ids: list[str] = []
    deadlines_before: set[bytes] = set()
    try:
        if server is None:
            deadlines_before = _deadline_members(r)
        out.write(f"Starting {workers} workers x {concurrency} processes (prefork)...\n")
        with _workers(redis_url, prefix, queue, workers, concurrency, out) as names:
            _wait_ready(demo_app, names, timeout=60)
            out.write(f"Selling {stock} units to {buyers} concurrent buyers, twice:\n")
            plain = _run_phase(demo_app, r, prefix, "plain", "plain task", stock,
                               buyers, out, timeout, task_ids)
            locked = _run_phase(demo_app, r, prefix, "locked", "LockedTask", stock,
                                buyers, out, timeout, task_ids)
        out.write("\n" + _table(plain, locked) + "\n\n")
        if plain.oversold:
            out.write(f"Without a lock {plain.oversold} units were sold that did not "
                      f"exist.\n")
        else:
            out.write("This time the plain task got lucky and did not over-sell; run "
                      "again, or add buyers.\n")
        verdict = ("exactly" if locked.sold == stock and locked.left == 0
                   else "NOT exactly")
        out.write(f"With LockedTask {verdict} {stock} units were sold, "
                  f"{locked.left} left.\n")
        return plain, locked
    finally:
        if server is None:  # a Redis of the user's: leave it as it was found
            with suppress(redis.RedisError):
                _cleanup(r, prefix, queue, task_ids, deadlines_before)
        r.close()
        demo_app.close()
        if server is not None:
            server.stop()


# Bounds of the command's numbers: below them the demo would do nothing or hang (no
# worker takes the tasks), above them it would only swamp this machine.
_BOUNDS = {"workers": (1, 16), "concurrency": (1, 32), "stock": (1, 100_000),
           "buyers": (1, 100_000)}


def _out_of_bounds(args: argparse.Namespace) -> str | None:
    for option, (low, high) in _BOUNDS.items():
        value = getattr(args, option)
        if not low <= value <= high:
            return f"--{option} must be between {low} and {high}, got {value}"
    return None


def _unreachable(redis_url: str, timeout: float = 3.0) -> str | None:
    """Why ``redis_url`` cannot be used (one line, password masked), or None."""
    why = ambiguity(redis_url)
    if why is not None:
        return f"--redis-url cannot be read one way only ({why}): {ENCODE_HINT}"
    try:
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=timeout,
                                      socket_timeout=timeout)
    except ValueError as exc:
        return f"--redis-url {mask_url(redis_url)} is not a Redis URL: {exc}"
    try:
        client.ping()
    except redis.RedisError as exc:
        reason = str(exc).replace(redis_url, mask_url(redis_url)).splitlines()
        return (f"cannot reach Redis at {mask_url(redis_url)}: "
                f"{reason[0] if reason else type(exc).__name__}")
    finally:
        client.close()
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="celery-dlock demo",
        description="Sell 200 units to 400 concurrent buyers on real Celery workers, "
                    "with and without LockedTask.")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes to start (1-16)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="prefork children per worker (1-32)")
    parser.add_argument("--stock", type=int, default=200,
                        help="units in stock (1-100000)")
    parser.add_argument("--buyers", type=int, default=400,
                        help="concurrent buyers (1-100000)")
    args = parser.parse_args(argv)
    problem = _out_of_bounds(args)
    if problem is not None:
        sys.stderr.write(f"celery-dlock demo: {problem}\n")
        return 2
    if args.redis_url is not None:
        problem = _unreachable(args.redis_url)
        if problem is not None:
            sys.stderr.write(f"celery-dlock demo: {problem}\n")
            return 1
    try:
        with _CTRL_C.installed():
            _, locked = run_demo(args.redis_url, workers=args.workers,
                                 concurrency=args.concurrency, stock=args.stock,
                                 buyers=args.buyers)
    except KeyboardInterrupt:
        sys.stderr.write("\ncelery-dlock demo: interrupted; workers stopped and the "
                         "demo's keys removed\n")
        return 130
    except (RuntimeError, OSError, redis.RedisError, KombuError) as exc:
        # No redis-server to start, workers that did not come up, a Redis that went
        # away: what went wrong, on one line (the workers are stopped by now).
        reason = " ".join(str(exc).split()) or type(exc).__name__
        sys.stderr.write(f"\ncelery-dlock demo: {mask_secrets(reason)}\n")
        return 1
    return 0 if locked.sold == min(args.stock, args.buyers) else 1
