"""(b) Lock core, uncontended: acquire+release cycles per second.

Variants, interleaved round by round on one redis-server, one client connection each:

* ``floor: 2x PING``          two round trips, the least any acquire+release can cost
* ``celery_dlock renew=on``   ``RedisLock(r, name)`` (registers with the scheduler)
* ``celery_dlock renew=off``  ``RedisLock(r, name, auto_renew=False)``
* ``redis-py Lock``           ``r.lock(name, timeout=30)``
* ``python-redis-lock``       ``redis_lock.Lock(r, name, expire=30)``

Each round runs every variant for ``--cycles`` cycles after a short warm-up; the table
gives the median over ``--rounds`` rounds, and ``x floor`` is the median of the
per-round ratios (variant time / floor time in the same round).  Client CPU comes from
``time.process_time()``, server time from ``INFO commandstats`` (``usec``), round trips
from counting the commands the client sent.

``--pin`` repeats the whole measurement with the client process and the embedded
redis-server pinned to CPUs: ``none`` (the scheduler decides), ``same`` (both on CPU
0: every round trip is a context switch, no cross-CPU wake-up) and ``split`` (server on
CPU 0, client on CPU 1).  On virtual machines a cross-CPU wake-up can cost more than
the work itself, so the modes differ a lot; see README.md.

    python benchmarks/bench_core.py          # full run -> results/bench_core.json
    python benchmarks/bench_core.py --smoke  # a few cycles, no JSON
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import _common as c
import redis
import redis_lock

from celery_dlock import RedisLock

NAME = "bench_core"
TITLE = "### b. Lock core, uncontended: acquire+release cycles"
COLUMNS = [
    ("variant", "variant", ""),
    ("cycles/s", "cycles_per_s", ",.0f"),
    ("us/cycle", "us_per_cycle", ".1f"),
    ("x floor", "ratio", ".3f"),
    ("client CPU us/cycle", "client_cpu_us", ".1f"),
    ("server us/cycle", "server_us", ".1f"),
    ("round trips/cycle", "round_trips", ".2f"),
    ("Redis cmds/cycle", "redis_cmds", ".2f"),
]
MODES = ("none", "same", "split")


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (threads started later inherit the mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def pin(mode: str, server_pid: int | None) -> bool:
    all_cpus = set(range(os.cpu_count() or 1))
    if mode == "none":
        client_cpus, server_cpus = all_cpus, all_cpus
    elif mode == "same":
        client_cpus, server_cpus = {0}, {0}
    elif mode == "split":
        if len(all_cpus) < 2:
            return False
        client_cpus, server_cpus = {1}, {0}
    else:
        raise ValueError(mode)
    if server_pid is None and mode != "none":
        return False
    set_affinity(os.getpid(), client_cpus)
    if server_pid is not None:
        set_affinity(server_pid, server_cpus)
    return True


def floor(client: redis.Redis) -> Callable[[], None]:
    """Two round trips, the least any acquire+release can cost."""
    def run() -> None:
        client.ping()
        client.ping()

    return run


def cycle(lock: Any) -> Callable[[], None]:
    """One acquire and one release of ``lock``."""
    acquire, release = lock.acquire, lock.release

    def run() -> None:
        acquire()
        release()

    return run


def make_variants(client: redis.Redis, prefix: str) -> dict[str, Callable[[], Any]]:
    renew_on = RedisLock(client, f"{prefix}:on", ttl=30)
    renew_off = RedisLock(client, f"{prefix}:off", ttl=30, auto_renew=False)
    redispy = client.lock(f"{prefix}:redispy", timeout=30)
    prl = redis_lock.Lock(client, f"{prefix}:prl", expire=30)

    return {
        "floor: 2x PING": floor(client),
        "celery_dlock renew=on": cycle(renew_on),
        "celery_dlock renew=off": cycle(renew_off),
        "redis-py Lock": cycle(redispy),
        "python-redis-lock": cycle(prl),
    }


def measure(fn: Callable[[], Any], client: redis.Redis, cycles: int,
            warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    before = c.command_calls(client)
    sent0 = c.sent(client)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(cycles):
        fn()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    sent = c.sent(client) - sent0
    delta = c.calls_delta(before, c.command_calls(client))
    return {
        "wall_s": wall,
        "us_per_cycle": wall / cycles * 1e6,
        "client_cpu_us": cpu / cycles * 1e6,
        "server_us": c.total_usec(delta) / cycles,
        "round_trips": sent / cycles,
        "redis_cmds": c.total_calls(delta) / cycles,
    }


def run_mode(variants: dict[str, Callable[[], Any]], client: redis.Redis,
             rounds: int, cycles: int, warmup: int,
             budget: c.RetryBudget) -> list[dict[str, Any]]:
    names = list(variants)
    per_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    r = 0
    while r < rounds:
        # Rotate the order so that no variant always runs first (or after the floor).
        order = names[r % len(names):] + names[:r % len(names)]
        monitor = c.LoadMonitor(client)
        this_round = {name: measure(variants[name], client, cycles, warmup)
                      for name in order}
        if not budget.keep(monitor.stop(), f"round {r + 1}"):
            continue
        for name in names:
            per_round[name].append(this_round[name])
        r += 1
    floor_name = names[0]
    rows = []
    for name in names:
        samples = per_round[name]
        ratios = [s["us_per_cycle"] / f["us_per_cycle"]
                  for s, f in zip(samples, per_round[floor_name], strict=True)]
        us = statistics.median(s["us_per_cycle"] for s in samples)
        rows.append({
            "variant": name,
            "us_per_cycle": us,
            "cycles_per_s": 1e6 / us,
            "ratio": statistics.median(ratios),
            "client_cpu_us": statistics.median(s["client_cpu_us"] for s in samples),
            "server_us": statistics.median(s["server_us"] for s in samples),
            "round_trips": statistics.median(s["round_trips"] for s in samples),
            "redis_cmds": statistics.median(s["redis_cmds"] for s in samples),
            "rounds_us_per_cycle": [s["us_per_cycle"] for s in samples],
            "rounds_ratio": ratios,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per pin mode (default 7; smoke 3)")
    parser.add_argument("--cycles", type=int, default=None,
                        help="measured cycles per variant per round (default 2000)")
    parser.add_argument("--pin", default=None,
                        help="comma-separated pin modes from none,same,split "
                             "(default all; smoke: none,same)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.smoke else 7)
    cycles = args.cycles or (30 if args.smoke else 2000)
    warmup = 10 if args.smoke else 200
    modes = (args.pin or ("none,same" if args.smoke else ",".join(MODES))).split(",")
    for mode in modes:
        if mode not in MODES:
            parser.error(f"unknown pin mode {mode!r}")

    results: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke, "rounds": rounds,
                               "cycles": cycles, "modes": {}}
    c.wait_quiet(args.wait_quiet)
    with c.redis_server(args.redis_url) as (url, server):
        client = c.counting_client(url)
        results["machine"] = c.machine_info(client)
        c.print_machine(results["machine"])
        monitor = c.LoadMonitor(client)
        budget = c.RetryBudget(args)
        variants = make_variants(client, f"{c.run_id()}:core")
        for fn in variants.values():  # load scripts, start the scheduler thread
            fn()
        server_pid = server.process.pid if server and server.process else None
        print(f"\n{TITLE}\n")
        print(f"{rounds} rounds x {cycles} cycles per variant, variants interleaved; "
              "median over rounds.\n")
        try:
            for mode in modes:
                if not pin(mode, server_pid):
                    print(f"(pin mode {mode!r} skipped: needs the embedded server "
                          "and 2 CPUs)\n")
                    continue
                rows = run_mode(variants, client, rounds, cycles, warmup, budget)
                results["modes"][mode] = rows
                print(f"pin mode: {mode}\n")
                print(c.markdown_table(COLUMNS, rows))
                print()
        finally:
            pin("none", server_pid)
        results["load"] = monitor.stop() | budget.as_dict()
        c.print_load(results["load"])
        client.close()
    c.write_json(c.json_path(args, NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
