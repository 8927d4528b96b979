"""(f) Enqueue cost of the uniqueness modes: sends per second, per ``lock_mode``, per
lock store.

One producer (this process) sends with ``task.apply_async((n,))`` in a loop to a Redis
broker (the embedded redis-server, or ``--redis-url``); no worker runs, so every
message stays queued (the queue is emptied between batches, out of the timed window).
The queue markers of a mode are kept by the app's lock store (``dlock_url``): every
store of ``_backends.BACKENDS`` that keeps them (its registry entry has ``markers``;
``--stores`` for a subset), the Redis one being the broker's redis-server itself, the
others started with the test suite's launchers as ``bench_backends.py`` does (or
``--postgres-url`` / ``--mysql-url`` / ``--zookeeper-url``).  The broker stays the
one Redis, so only the store changes.  Variants:

* ``plain Task``                        ``@app.task``: what a send costs without locks
* ``LockedTask while_running``          the default mode: no enqueue-time check (it
                                        touches no store: one row, on the Redis app)
* ``LockedTask until_started``          and the other modes, per store: one claim per
* ``LockedTask until_finished``         send (a queue marker), each send a fresh lock
* ``LockedTask queued_and_running``     name, so every send is accepted
* ``LockedTask throttle``
* ``duplicate until_started, return_existing``   per store: the same lock name every
* ``duplicate until_started, drop``              send, its marker already there: every
                                                  send is a duplicate (nothing queued)

Each round runs every variant for ``--sends`` sends after a short warm-up, the order
rotated from round to round; the table gives medians over ``--rounds`` rounds, ``x
plain`` is the median of the per-round ratios of time per send to the plain task's in
the same round, and ``x Redis`` the same against the same variant on the Redis store.
Client CPU from ``time.process_time()``.  ``store requests/send``: the requests this
process's driver sent to the store, counted in the driver (``_backends.Requests``:
psycopg statements, PyMySQL ``execute`` calls, kazoo requests; a marker's read and
write are autocommitted statements); for the Redis store, redis-py round trips less
the broker's (one ``LPUSH`` per message queued, counted by the server).  ``store CPU
us/send``: the store server's CPU time (``/proc``; for Redis the one redis-server,
the broker's work included, as in the rows of no store).  Redis commands (those run
inside scripts included) and ``EVALSHA`` calls from ``INFO commandstats`` of the
broker's Redis.  No result backend is configured (as in bench_e2e): with one, a
duplicate with ``return_existing`` also reads the queued call's state (one ``GET``),
to tell a call that ended or was revoked from one still queued.

    python benchmarks/bench_send.py          # full run -> results/bench_send.json
    python benchmarks/bench_send.py --stores redis --smoke  # a few sends, no JSON
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import _backends as bk
import _common as c
import bench_e2e as e2e
import redis
from celery import Celery

from celery_dlock import LockedTask
from celery_dlock.core.registry import MARKERS, entry_named
from celery_dlock.core.urls import mask_url

NAME = "bench_send"
TITLE = "### f. Enqueue cost of the uniqueness modes: sends per second, per lock store"
COLUMNS = [
    ("store", "store", ""),
    ("variant", "variant", ""),
    ("sends/s", "sends_per_s", ",.0f"),
    ("us/send", "us_per_send", ".1f"),
    ("x plain", "ratio", ".3f"),
    ("x Redis", "ratio_redis", ".2f"),
    ("client CPU us/send", "client_cpu_us", ".1f"),
    ("store requests/send", "store_requests", ".2f"),
    ("store CPU us/send", "store_cpu_us", ".1f"),
    ("Redis cmds/send", "redis_cmds", ".2f"),
    ("EVALSHA/send", "evalsha", ".2f"),
]
MODES = ("until_started", "until_finished", "queued_and_running", "throttle")
BASELINE = "plain Task"
#: The store column of the rows that touch no lock store.
NO_STORE = "-"
Key = tuple[str, str]  # (store, variant)


def marker_stores() -> tuple[list[str], dict[str, str]]:
    """The stores of ``_backends.BACKENDS`` that keep queue markers (their registry
    entry says so: a store that gains them is measured with no change here), and
    why each other one is left out."""
    keep, why = [], {}
    for backend in bk.BACKENDS:
        if entry_named(backend.name).can(MARKERS):
            keep.append(backend.name)
        else:
            why[backend.name] = "keeps no queue markers in this checkout"
    return keep, why


def make_app(broker: str, prefix: str, store: str, store_url: str) -> Celery:
    app = Celery(f"bench_send_{store}", broker=broker, set_as_current=False)
    app.conf.update(task_default_queue=f"{prefix}-q",
                    dlock_key_prefix=f"{prefix}:{store}", dlock_url=store_url,
                    task_ignore_result=True,
                    broker_connection_retry_on_startup=True)
    return app


def make_variants(apps: dict[str, Celery],
                  numbers: Iterator[int]) -> dict[Key, Callable[[], Any]]:
    """``(store, variant) -> one send``: the plain task and ``while_running`` once
    (on the first app: they touch no store), every other mode on each store."""
    first = apps[next(iter(apps))]

    @first.task(name="bench_send.plain", shared=False)
    def plain(n: int) -> None:  # never runs: no worker
        return None

    variants: dict[Key, Callable[[], Any]] = {
        (NO_STORE, BASELINE): lambda: plain.apply_async((next(numbers),))}
    task = first.task(base=LockedTask, bind=True, name="bench_send.while_running",
                      lock_key="send:{n}", lock_mode="while_running",
                      shared=False)(_body)
    variants[(NO_STORE, "LockedTask while_running")] = _sender(task, numbers)
    for store, app in apps.items():
        for mode in MODES:
            task = app.task(base=LockedTask, bind=True, name=f"bench_send.{mode}",
                            lock_key="send:{n}", lock_mode=mode, shared=False)(_body)
            variants[(store, f"LockedTask {mode}")] = _sender(task, numbers)
        for policy in ("return_existing", "drop"):
            task = app.task(base=LockedTask, bind=True,
                            name=f"bench_send.dup_{policy}", lock_key="send:{n}",
                            lock_mode="until_started", on_duplicate=policy,
                            shared=False)(_body)
            same = next(numbers)
            task.apply_async((same,))  # the queued call every later send duplicates
            variants[(store, f"duplicate until_started, {policy}")] = _sender(
                task, itertools.repeat(same))
    return variants


def _body(self: Any, n: int) -> None:  # never runs: no worker
    return None


def _sender(task: Any, numbers: Iterator[int]) -> Callable[[], Any]:
    def send() -> Any:
        return task.apply_async((next(numbers),))

    return send


def store_requests(store: str, sent: int, delta: dict[str, dict[str, int]]) -> int:
    """The requests sent to ``store`` of the ``sent`` its driver counted: on Redis,
    less the broker's (one ``LPUSH`` round trip per message queued)."""
    if store == "redis":
        return sent - delta.get("lpush", {}).get("calls", 0)
    return sent


def measure(fn: Callable[[], Any], store: str, control: redis.Redis, queue: str,
            sends: int, warmup: int, server: e2e.Processes | None) -> dict[str, Any]:
    for _ in range(warmup):
        fn()
    control.delete(queue)
    driver = "redis" if store == NO_STORE else store
    before = c.command_calls(control)
    srv0 = bk.group_cpu([server]) if server else None
    sent0 = bk.Requests.by_driver.get(driver, 0)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(sends):
        fn()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    sent = bk.Requests.by_driver.get(driver, 0) - sent0
    delta = c.calls_delta(before, c.command_calls(control))
    srv = None if srv0 is None or server is None else bk.group_cpu([server]) - srv0
    control.delete(queue)
    return {
        "us_per_send": wall / sends * 1e6,
        "client_cpu_us": cpu / sends * 1e6,
        "store_requests": store_requests(driver, sent, delta) / sends,
        "store_cpu_us": None if srv is None else srv / sends * 1e6,
        "server_us": c.total_usec(delta) / sends,
        "redis_cmds": c.total_calls(delta) / sends,
        "evalsha": delta.get("evalsha", {}).get("calls", 0) / sends,
    }


def run(variants: dict[Key, Callable[[], Any]], control: redis.Redis, queue: str,
        rounds: int, sends: int, warmup: int, budget: c.RetryBudget,
        servers: dict[str, e2e.Processes | None]) -> list[dict[str, Any]]:
    keys = list(variants)
    # The redis-server is counted by LoadMonitor itself.
    ours = [g for s, g in servers.items() if g is not None and s != bk.REFERENCE]
    per_round: dict[Key, list[dict[str, Any]]] = {k: [] for k in keys}
    r = 0
    while r < rounds:
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        monitor = c.LoadMonitor(control, ours=lambda: bk.group_cpu(ours))
        this_round = {k: measure(variants[k], k[0], control, queue, sends, warmup,
                                 servers.get(bk.REFERENCE if k[0] == NO_STORE
                                             else k[0]))
                      for k in order}
        load = monitor.stop()
        if not budget.keep(load, f"round {r + 1}"):
            continue
        for k in keys:
            per_round[k].append(this_round[k] | {"other_cpus_busy":
                                                 load["other_cpus_busy"]})
        print(f"round {r + 1}/{rounds}: other work kept "
              f"{load['other_cpus_busy']} CPUs busy", file=sys.stderr)
        r += 1
    base = per_round[(NO_STORE, BASELINE)]
    rows = []
    for (store, name), samples in per_round.items():
        ratios = [s["us_per_send"] / p["us_per_send"]
                  for s, p in zip(samples, base, strict=True)]
        ref = per_round.get((bk.REFERENCE, name))
        vs_redis = ([s["us_per_send"] / b["us_per_send"]
                     for s, b in zip(samples, ref, strict=True)] if ref else [])
        us = statistics.median(s["us_per_send"] for s in samples)
        row: dict[str, Any] = {
            "store": store, "variant": name, "us_per_send": us, "sends_per_s": 1e6 / us,
            "ratio": statistics.median(ratios),
            "ratio_redis": statistics.median(vs_redis) if vs_redis else None,
            "rounds_us_per_send": [s["us_per_send"] for s in samples]}
        for key in ("client_cpu_us", "store_requests", "store_cpu_us", "server_us",
                    "redis_cmds", "evalsha", "other_cpus_busy"):
            values = [s[key] for s in samples]
            row[key] = None if None in values else statistics.median(values)
        rows.append(row)
    return rows


def cleanup(control: redis.Redis, prefix: str) -> None:
    """Remove this run's keys (on a ``--redis-url`` server; the embedded one goes)."""
    for key in control.scan_iter(match=f"{prefix}*", count=1000):
        control.delete(key)


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds (default 7; smoke 3)")
    parser.add_argument("--sends", type=int, default=None,
                        help="measured sends per variant per round (default 2000; "
                             "smoke 30)")
    bk.add_server_arguments(parser, "--stores",
                            "all that keep queue markers and can be had here")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.smoke else 7)
    sends = args.sends or (30 if args.smoke else 2000)
    warmup = 5 if args.smoke else 200
    able, not_kept = marker_stores()
    wanted = args.stores.split(",") if args.stores else able + list(not_kept)
    known = {b.name for b in bk.BACKENDS}
    if set(wanted) - known:
        parser.error(f"--stores: choose from {sorted(known)}")

    results: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke, "rounds": rounds,
                               "sends": sends, "warmup": warmup}
    prefix = f"{c.run_id()}-send"
    bk.Requests.install()
    c.wait_quiet(args.wait_quiet)
    with contextlib.ExitStack() as stack:
        url, _server = stack.enter_context(c.redis_server(args.redis_url))
        skipped = {s: why for s, why in not_kept.items() if s in wanted}
        for store, why in skipped.items():
            print(f"skipped {store}: {why}")
        urls, failed = bk.start_backends(args, stack, url,
                                         [s for s in wanted if s in able])
        skipped |= failed
        control = redis.Redis.from_url(url)
        stack.callback(control.close)
        results["machine"] = c.machine_info(control)
        results["machine"]["servers"] = bk.server_versions(urls)
        c.print_machine(results["machine"])
        print("lock stores: " + ", ".join(
            f"{s} {v or '?'}" for s, v in results["machine"]["servers"].items()))
        results["stores"] = {s: mask_url(u) for s, u in urls.items()}
        results["skipped"] = skipped
        servers = {s: bk.server_processes(u) for s, u in urls.items()}
        ours = [g for s, g in servers.items() if g is not None and s != bk.REFERENCE]
        monitor = c.LoadMonitor(control, ours=lambda: bk.group_cpu(ours))
        budget = c.RetryBudget(args)
        apps = {s: make_app(url, prefix, s, u) for s, u in urls.items()}
        if not apps:  # the plain task and while_running still run, on the broker
            apps = {NO_STORE: make_app(url, prefix, NO_STORE, url)}
        numbers = itertools.count(secrets.randbelow(1 << 30) << 22)
        try:
            variants = make_variants(apps, numbers)
            print(f"\n{TITLE}\n")
            print(f"{rounds} rounds x {sends} sends per variant, variants interleaved; "
                  "median over rounds. Broker: the one Redis; store: the app's "
                  "dlock_url.\n")
            rows = run(variants, control, f"{prefix}-q", rounds, sends, warmup,
                       budget, servers)
            results["rows"] = rows
            print(c.markdown_table(COLUMNS, rows))
        finally:
            for app in apps.values():
                app.close()
            cleanup(control, prefix)
        for store, why in skipped.items():
            print(f"\nskipped {store}: {why}")
        results["load"] = monitor.stop() | budget.as_dict()
        c.print_load(results["load"])
    c.write_json(c.json_path(args, NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
