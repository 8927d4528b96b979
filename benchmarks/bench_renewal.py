"""(d) Renewal cost against the number of held locks (1 to 10,000 in one process).

The holds are ``RedisLock(r, name, ttl=30, scheduler=hb)`` on one client, with
``hb = RenewalScheduler(start_thread=False)``: no thread, each renewal pass is one
``hb.renew_due(now)`` call with ``now`` moved on by one renewal interval (ttl/3), so
every hold is due in every pass.  Per pass the table gives the round trips the client
sent (counted on its connections; renewal goes through a connection pool of its own,
made with the client's settings, whose round trips are counted too), the ``EVALSHA``
calls and all Redis commands the server ran (``INFO commandstats`` deltas; commands
inside the script count too), the client
CPU time (``time.process_time()``), the wall time, and the server's time
(``commandstats`` ``usec``).

For comparison, ``per-lock extend`` renews the same number of redis-py ``Lock``
objects the way one renewal thread per lock does it (python-redis-lock's
``auto_renewal``, or a loop calling ``Lock.reacquire()``): one round trip per hold.
Its passes are capped at 30,000 / holds (at least 3), so that 10,000 holds take
seconds, not minutes.

    python benchmarks/bench_renewal.py          # full run -> results/bench_renewal.json
    python benchmarks/bench_renewal.py --smoke  # 1 and 10 holds, 3 passes, no JSON
    python benchmarks/plot.py                   # -> core.png (d), growth.png
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import _common as c
import redis

from celery_dlock import RedisLock
from celery_dlock.core.scheduler import RenewalScheduler

NAME = "bench_renewal"
TITLE = "### d. Renewal cost per pass against held locks"
COLUMNS = [
    ("variant", "variant", ""),
    ("holds", "holds", ""),
    ("round trips/pass", "round_trips", ".2f"),
    ("EVALSHA/pass", "evalsha", ".2f"),
    ("Redis cmds/pass", "redis_cmds", ".1f"),
    ("client CPU ms/pass", "cpu_ms", ".3f"),
    ("wall ms/pass", "wall_ms", ".3f"),
    ("server ms/pass", "server_ms", ".3f"),
    ("client CPU us/hold", "cpu_us_per_hold", ".2f"),
    ("round trips/interval, staggered", "staggered_per_interval", ".2f"),
]


def measure_passes(client: redis.Redis, passes: int,
                   one_pass: Callable[[int], Any]) -> dict[str, float]:
    """Median per-pass figures over ``passes`` passes (Redis stats per pass)."""
    samples: list[dict[str, float]] = []
    for k in range(passes):
        before = c.command_calls(client)
        sent0 = c.sent(client)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        one_pass(k)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        sent = c.sent(client) - sent0
        delta = c.calls_delta(before, c.command_calls(client))
        samples.append({
            "round_trips": sent,
            "evalsha": delta.get("evalsha", {}).get("calls", 0),
            "redis_cmds": c.total_calls(delta),
            "cpu_ms": cpu * 1000,
            "wall_ms": wall * 1000,
            "server_ms": c.total_usec(delta) / 1000,
        })
    return {k: float(statistics.median(s[k] for s in samples)) for k in samples[0]}


def bench_dlock(client: redis.Redis, prefix: str, holds: int,
                passes: int) -> dict[str, Any]:
    hb = RenewalScheduler(start_thread=False)
    locks = [RedisLock(client, f"{prefix}:d{holds}:{i}", ttl=30, scheduler=hb)
             for i in range(holds)]
    for lock in locks:
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"could not take {lock.name}")
    interval = locks[0].ttl / 3
    base = time.monotonic()
    renewed0 = hb.renewal_calls

    def one_pass(k: int) -> None:
        # Every hold falls due once per interval; move the clock on by one interval.
        hb.renew_due(base + (k + 1) * interval)

    row = measure_passes(client, passes, one_pass)
    row["heartbeat_calls_per_pass"] = (hb.renewal_calls - renewed0) / passes
    if len(hb) != holds:
        raise RuntimeError(f"{holds - len(hb)} holds were lost during renewal")
    for lock in locks:
        lock.release()
    return row


def staggered_round_trips(client: redis.Redis, prefix: str, holds: int,
                          intervals: int) -> float:
    """Round trips per renewal interval once holds taken at different moments settle.

    The holds are taken at moments spread evenly over one interval (a fake clock);
    then the scheduler's own loop is replayed: wake when the earliest hold is due,
    renew what is due.  After two settling intervals, the renewal calls of
    ``intervals`` intervals are counted.
    """
    now = [1000.0]
    hb = RenewalScheduler(clock=lambda: now[0], start_thread=False)
    locks = []
    interval = 10.0  # ttl 30 s / 3
    for i in range(holds):
        now[0] = 1000.0 + interval * i / holds
        lock = RedisLock(client, f"{prefix}:s{holds}:{i}", ttl=30, scheduler=hb)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"could not take {lock.name}")
        locks.append(lock)
    settle_until = now[0] + 2 * interval
    end = settle_until + intervals * interval
    calls_at_settle = None
    next_due = hb.renew_due(now[0])
    while next_due is not None and next_due < end:
        if calls_at_settle is None and next_due >= settle_until:
            calls_at_settle = hb.renewal_calls
        now[0] = next_due
        next_due = hb.renew_due(next_due)
    if len(hb) != holds or calls_at_settle is None:
        raise RuntimeError("holds were lost during the staggered replay")
    for lock in locks:
        lock.release()
    return (hb.renewal_calls - calls_at_settle) / intervals


def bench_per_lock(client: redis.Redis, prefix: str, holds: int,
                   passes: int) -> dict[str, Any]:
    locks = [client.lock(f"{prefix}:r{holds}:{i}", timeout=30) for i in range(holds)]
    for lock in locks:
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"could not take {lock.name}")

    def one_pass(_k: int) -> None:
        for lock in locks:
            lock.reacquire()

    row = measure_passes(client, min(passes, max(3, 30000 // holds)), one_pass)
    for lock in locks:
        lock.release()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--holds", default=None,
                        help="comma-separated hold counts (default 1,10,100,1000,10000; "
                             "smoke 1,10)")
    parser.add_argument("--passes", type=int, default=None,
                        help="renewal passes per count (default 30; smoke 3)")
    args = parser.parse_args(argv)
    default = "1,10" if args.smoke else "1,10,100,1000,10000"
    counts = [int(n) for n in (args.holds or default).split(",")]
    passes = args.passes or (3 if args.smoke else 30)

    results: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke,
                               "passes": passes}
    rows: list[dict[str, Any]] = []
    c.wait_quiet(args.wait_quiet)
    with c.redis_server(args.redis_url) as (url, _server):
        client = c.counting_client(url)
        results["machine"] = c.machine_info(client)
        c.print_machine(results["machine"])
        monitor = c.LoadMonitor(client)
        prefix = f"{c.run_id()}:renew"
        # Load the scripts first, so that no pass pays for an EVAL fallback.
        bench_dlock(client, prefix + ":warm", 1, 1)
        for holds in counts:
            for variant, fn in (("celery_dlock RenewalScheduler", bench_dlock),
                                ("per-lock extend (redis-py)", bench_per_lock)):
                row = fn(client, prefix, holds, passes)
                row.update(variant=variant, holds=holds,
                           cpu_us_per_hold=row["cpu_ms"] * 1000 / holds)
                if fn is bench_dlock:
                    row["staggered_per_interval"] = staggered_round_trips(
                        client, prefix, holds, intervals=3 if args.smoke else 20)
                rows.append(row)
        results["load"] = monitor.stop()
        client.close()
    rows.sort(key=lambda r: (r["variant"] != "celery_dlock RenewalScheduler", r["holds"]))
    results["rows"] = rows
    print(f"\n{TITLE}\n")
    print(f"median of {passes} passes per count; every hold is due in every pass.\n")
    print(c.markdown_table(COLUMNS, rows))
    c.print_load(results["load"])
    c.write_json(c.json_path(args, NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
