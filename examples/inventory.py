"""Inventory: many concurrent buyers, a few units in stock, real prefork workers.

Each buyer is a task that reads the stock of a product, thinks for 2 ms and writes it
back one lower: a read-modify-write that over-sells as soon as two buyers of the same
product interleave (``celery-dlock demo`` shows that happen with a plain task).  Here
the task is a :class:`~celery_dlock.LockedTask` keyed on the product,
``lock_key="stock:{sku}"``: buyers of one product take turns (``on_contention="wait"``:
a waiting buyer is woken by the holder's release, not by polling) while buyers of other
products would not wait at all.  Exactly the stock is sold, and an "inside" counter
proves that no two buyers of the product were ever in the body at once.

The stock lives in a SQL table (SQLite, ``$INVENTORY_DB``) with a ``last_fence``
column, and the buyer writes it with :mod:`celery_dlock.fencing`: it claims the row
with its hold's fence (``self.lock.fence``) before reading, and writes the new stock
with that fence.  A buyer paused past its lock's ttl, whose lock has since passed to
another buyer, gets :class:`~celery_dlock.fencing.StaleFence` instead of over-writing
the newer buyer's sale (see ``docs/fencing.md``).

One command, on a throwaway redis-server and 2 workers x 4 prefork processes::

    python examples/inventory.py                      # 100 buyers, 40 in stock
    python examples/inventory.py --buyers 400 --stock 200

As an app module against a running Redis (what docker-compose.yml does; the workers
and the producer share ``$INVENTORY_DB``, by default a file in the temp directory)::

    REDIS_URL=redis://localhost:6379/0 celery -A examples.inventory worker
    REDIS_URL=redis://localhost:6379/0 python -m examples.inventory produce

``produce`` stocks a fresh product, enqueues the buyers, waits for all of them and
exits 0 only if exactly the stock was sold, with no overlap.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if not __package__:  # run as a file, python examples/inventory.py: find `examples`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_dlock import LockedTask
from celery_dlock.fencing import claim, fenced_update
from examples.celery_app import app, data, use_redis

__all__ = ["app", "buy", "main", "produce"]

THINK = 0.002  # seconds between reading and writing the stock: the race window


#: The stock table: one row per product, its fence column written by the helpers.
STOCK_TABLE = """
CREATE TABLE IF NOT EXISTS stock (
    sku        TEXT PRIMARY KEY,
    units      INTEGER NOT NULL,
    sold       INTEGER NOT NULL DEFAULT 0,
    last_fence BIGINT  NOT NULL DEFAULT 0
)"""


def _key(sku: str, what: str) -> str:
    return f"inventory:{sku}:{what}"


def db_path() -> str:
    """The SQLite file the workers and the producer share (``$INVENTORY_DB``)."""
    return os.environ.get("INVENTORY_DB") or os.path.join(
        tempfile.gettempdir(), "celery-dlock-inventory.sqlite3")


@contextlib.contextmanager
def stock_db() -> Iterator[sqlite3.Connection]:
    """One transaction on the stock database: committed at the end, rolled back on
    an exception (a :class:`~celery_dlock.fencing.StaleFence` too)."""
    conn = sqlite3.connect(db_path(), timeout=30)
    try:
        with conn:
            yield conn
    finally:
        conn.close()


@app.task(name="examples.inventory.buy", base=LockedTask, bind=True, ignore_result=True,
          lock_key="stock:{sku}", lock_ttl=10, on_contention="wait", lock_wait=30)
def buy(self: Any, sku: str) -> bool:
    """Sell one unit of ``sku`` if any is left."""
    r = data()
    if r.incr(_key(sku, "inside")) > 1:  # another buyer of this product is in here
        r.incr(_key(sku, "overlaps"))
    try:
        with stock_db() as db:
            # Claim the row with this hold's fence before reading it: a buyer with
            # an older fence can no longer write it, so what we read stays true.
            row, fence, name = {"sku": sku}, self.lock.fence, self.lock.name
            claim(db, "stock", row, fence, lock_name=name)
            units, sold = db.execute("SELECT units, sold FROM stock WHERE sku = ?",
                                     (sku,)).fetchone()
            if units <= 0:
                return False
            time.sleep(THINK)
            fenced_update(db, "stock", row, fence,
                          {"units": units - 1, "sold": sold + 1}, lock_name=name)
        return True
    finally:
        r.decr(_key(sku, "inside"))
        r.incr(_key(sku, "done"))


def restock(sku: str, units: int) -> None:
    """Put ``units`` of ``sku`` on the shelf (the fence column is left as it is)."""
    with stock_db() as db:
        db.execute("PRAGMA journal_mode=WAL")  # readers never wait for a writer
        db.execute(STOCK_TABLE)
        db.execute("INSERT INTO stock (sku, units) VALUES (?, ?) ON CONFLICT (sku) "
                   "DO UPDATE SET units = excluded.units, sold = 0", (sku, units))


def shelf(sku: str) -> tuple[int, int, int]:
    """(units left, units sold, the fence of the last write) of ``sku``."""
    with stock_db() as db:
        units, sold, fence = db.execute(
            "SELECT units, sold, last_fence FROM stock WHERE sku = ?", (sku,)).fetchone()
    return int(units), int(sold), int(fence)


@dataclass
class Outcome:
    sku: str
    buyers: int
    stock: int
    sold: int
    left: int
    fence: int
    overlaps: int
    seconds: float

    @property
    def ok(self) -> bool:
        expected = min(self.stock, self.buyers)
        return (self.sold == expected and self.left == self.stock - expected
                and self.overlaps == 0)


def produce(buyers: int, stock: int, sku: str | None = None,
            timeout: float = 120.0) -> Outcome:
    """Stock a product, send ``buyers`` buy tasks and wait until all have run."""
    sku = sku or f"sku-{uuid.uuid4().hex[:8]}"
    r = data()
    r.delete(*(_key(sku, k) for k in ("done", "inside", "overlaps")))
    restock(sku, stock)
    print(f"{buyers} buyers for {stock} units of {sku} ...", flush=True)
    started = time.monotonic()
    with app.producer_or_acquire() as producer:
        for _ in range(buyers):
            buy.apply_async((sku,), producer=producer)
    done = 0
    while done < buyers:
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"only {done} of {buyers} buyers done "
                               f"after {timeout:.0f}s")
        time.sleep(0.05)
        done = int(r.get(_key(sku, "done")) or 0)
    left, sold, fence = shelf(sku)
    return Outcome(sku=sku, buyers=buyers, stock=stock, sold=sold, left=left,
                   fence=fence,
                   overlaps=int(r.get(_key(sku, "overlaps")) or 0),
                   seconds=time.monotonic() - started)


def report(outcome: Outcome) -> int:
    print(f"sold {outcome.sold}, left {outcome.left} "
          f"(stock {outcome.stock}, {outcome.buyers} buyers, "
          f"{outcome.buyers - outcome.sold} turned away) in {outcome.seconds:.1f}s")
    print(f"the stock row was last written with fence {outcome.fence} "
          f"(one fence per hold of stock:{outcome.sku}; older ones are refused)")
    print(f"buyers of {outcome.sku} inside the locked body at the same time: "
          f"{'never' if not outcome.overlaps else f'{outcome.overlaps} times'}")
    if outcome.ok:
        print(f"OK: exactly {outcome.sold} units sold with the lock, none over-sold")
        return 0
    print(f"FAILED: expected {min(outcome.stock, outcome.buyers)} sold and no overlap")
    return 1


def run(args: argparse.Namespace) -> int:
    from examples._cluster import Cluster, redis_server, say, worker_argv

    with redis_server(args.redis_url) as url, tempfile.TemporaryDirectory(
            prefix="dlock-inventory-") as tmp:
        use_redis(url)
        os.environ["INVENTORY_DB"] = os.path.join(tmp, "inventory.sqlite3")
        tag = uuid.uuid4().hex[:6]
        nodes = [f"inventory{i + 1}-{tag}@localhost" for i in range(args.workers)]
        with Cluster(url) as cluster:
            for node in nodes:
                cluster.start(node.split("@")[0],
                              worker_argv("examples.inventory", node, args.concurrency))
            cluster.wait_for_workers(app, nodes)
            say(f"{args.workers} workers x {args.concurrency} processes (prefork) up")
            outcome = produce(args.buyers, args.stock, timeout=args.timeout)
            code = report(outcome)
            say("stopping the workers ...")
        return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/inventory.py",
        description="Sell a few units to many concurrent buyers on real workers.")
    parser.add_argument("command", nargs="?", choices=("run", "produce"), default="run",
                        help="run: embedded Redis and workers (default); produce: "
                             "enqueue buyers against $REDIS_URL and wait")
    parser.add_argument("--buyers", type=int, default=100)
    parser.add_argument("--stock", type=int, default=40)
    parser.add_argument("--sku", help="product id (produce; default: a fresh one)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--redis-url", help="run: use this Redis instead of starting one")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.command == "produce":
        return report(produce(args.buyers, args.stock, args.sku, args.timeout))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
