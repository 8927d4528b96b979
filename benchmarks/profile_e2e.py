"""Where a locked task's time goes in the worker: ``bench_e2e``'s tasks, taken apart.

Two views, both on one throwaway redis-server and ``e2e_app.py``'s tasks:

``--parts`` (no profiler, in this process): the pieces ``LockedTask`` adds around a
task body, each timed on its own in a loop; rounds interleave the pieces and the table
gives medians of CPU time (``time.process_time()``, every thread of the process) and
wall time per call.  The whole call of a ``LockedTask`` minus the whole call of the
plain task is what a worker child pays per task; the rows below it say where it goes.

default (cProfile): one ``celery worker --pool=solo`` under cProfile (solo: the task
runs in the profiled process itself) runs ``--tasks`` tasks of one ``--variant`` with
distinct arguments; the table lists, per task, the ``celery_dlock`` (and celery-once /
celery-singleton) functions with the most cumulative time.  cProfile slows small
Python functions down several times over: read shares, not absolute costs.

    python benchmarks/profile_e2e.py --parts             # the pieces, us per call
    python benchmarks/profile_e2e.py                     # cProfile, LockedTask (hashed)
    python benchmarks/profile_e2e.py --variant "celery-once QueueOnce" --timer cpu
    python benchmarks/profile_e2e.py --save /tmp/locked.pstats   # for snakeviz etc.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as c
import redis
from bench_e2e import wait_done, wait_ready, worker_argv, worker_env

#: Functions whose file path contains one of these are listed.
LISTED = ("celery_dlock", "celery_once", "celery_singleton")

# -- the pieces, without a profiler ----------------------------------------------------

PARTS_COLUMNS = [
    ("piece", "part", ""),
    ("CPU us/call", "cpu_us", ".1f"),
    ("wall us/call", "wall_us", ".1f"),
    ("Redis round trips", "round_trips", ""),
]


def make_parts(e2e_app: Any) -> dict[str, tuple[int, Callable[[], Any]]]:
    """``{label: (round trips, call)}``, each call made with fresh arguments."""
    from celery_dlock import RedisLock, signals
    from celery_dlock.core.owner import owner_context
    from celery_dlock.task.config import get_client

    app, plain, locked = e2e_app.app, e2e_app.plain, e2e_app.locked
    template = e2e_app.locked_template
    numbers = itertools.count(1)
    client = get_client(app)
    settings = locked.dlock_settings()
    # What a worker child's request looks like to the task (not called directly).
    for task in (plain, locked, template):
        task.push_request(id="e2e-parts", hostname="parts@localhost",
                          called_directly=False, is_eager=False)
    info = {"task_id": "e2e-parts", "task_name": locked.name, "worker": "parts@localhost"}
    renewed = RedisLock(client, "e2e-parts:renewed", settings["lock_ttl"],
                        prefix=settings["lock_prefix"], info=info)
    unrenewed = RedisLock(client, "e2e-parts:unrenewed", settings["lock_ttl"],
                          prefix=settings["lock_prefix"], info=info, auto_renew=False)

    def cycle(lock: RedisLock) -> Callable[[], None]:
        def run() -> None:
            with owner_context():
                lock.acquire(blocking=False)
                lock.release()
        return run

    def owner() -> None:
        with owner_context():
            pass

    def signal_pair() -> None:
        signals.lock_acquired.send(sender=locked, key="k", fence=1, task_id="t",
                                   wait=0.0)
        signals.lock_released.send(sender=locked, key="k", fence=1, task_id="t",
                                   held_for=0.0, state="SUCCESS")

    def set_del() -> None:
        key = f"e2e-parts:setnx:{next(numbers)}"
        client.set(key, "task-id", nx=True, px=60000)
        client.delete(key)

    return {
        "plain task call (body: one INCR)": (1, lambda: plain(next(numbers))),
        "LockedTask call, hashed args (body included)":
            (3, lambda: locked(next(numbers))),
        "LockedTask call, template key (body included)":
            (3, lambda: template(next(numbers))),
        "acquire + release, auto_renew=False": (2, cycle(unrenewed)),
        "acquire + release, auto_renew=True (default)": (2, cycle(renewed)),
        "SET NX PX + DEL (celery-once/singleton's lock)": (2, set_del),
        "lock_name(), hashed args": (0, lambda: locked.lock_name((next(numbers),), {})),
        "lock_name(), template key":
            (0, lambda: template.lock_name((next(numbers),), {})),
        "dlock_settings()": (0, locked.dlock_settings),
        "get_client(app)": (0, lambda: get_client(app)),
        "RedisLock(client, key, ttl, prefix, info)":
            (0, lambda: RedisLock(client, "k", settings["lock_ttl"],
                                  prefix=settings["lock_prefix"], info=info)),
        "owner_context() enter + exit": (0, owner),
        "signals lock_acquired + lock_released": (0, signal_pair),
    }


def run_parts(parts: dict[str, tuple[int, Callable[[], Any]]], rounds: int,
              calls: int) -> list[dict[str, Any]]:
    names = list(parts)
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for _, fn in parts.values():  # load scripts, start threads, warm caches
        for _ in range(50):
            fn()
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = parts[name][1]
            cpu0, t0 = time.process_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append(((time.process_time() - cpu0) / calls * 1e6,
                                  (time.perf_counter() - t0) / calls * 1e6))
    return [{"part": name, "round_trips": parts[name][0],
             "cpu_us": statistics.median(s[0] for s in samples[name]),
             "wall_us": statistics.median(s[1] for s in samples[name]),
             "rounds_cpu_us": [s[0] for s in samples[name]]} for name in names]


# -- cProfile on a solo worker -----------------------------------------------------------

#: ``python -m cProfile`` with a choice of clock: argv = out, timer, celery argv...
RUNNER = """
import cProfile, runpy, sys, time
out, timer = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[3:]
prof = cProfile.Profile(time.process_time if timer == "cpu" else time.perf_counter)
try:
    prof.runcall(runpy.run_module, "celery", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
finally:
    prof.dump_stats(out)
"""


def profile_worker(url: str, prefix: str, out: Path, log: Path,
                   timer: str) -> subprocess.Popen[bytes]:
    argv = worker_argv(f"{prefix}@localhost", "--pool=solo")
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-c", RUNNER, str(out), timer, "celery", *argv],
            env=worker_env(url, prefix), stdin=subprocess.DEVNULL, stdout=f,
            stderr=subprocess.STDOUT)


def profiled_run(e2e_app: Any, task: Any, url: str, prefix: str, tasks: int,
                 timer: str, out: Path, log: Path) -> float:
    """Run ``tasks`` tasks on a profiled solo worker; returns the wall time."""
    control = redis.Redis.from_url(url)
    proc = profile_worker(url, prefix, out, log, timer)
    try:
        wait_ready(e2e_app.app, f"{prefix}@localhost", proc, log)
        control.set(e2e_app.COUNTER, e2e_app.DONE_AT - tasks)
        t0 = time.perf_counter()
        for n in range(1, tasks + 1):
            task.apply_async((n,))
        wait_done(task.name, tasks, control, proc, log, e2e_app.COUNTER,
                  e2e_app.MARKER, e2e_app.DONE_AT)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        control.close()


def per_task_table(stats: pstats.Stats, tasks: int, top: int) -> list[dict[str, Any]]:
    rows = []
    for (path, line, func), (_cc, ncalls, tottime, cumtime, _) in \
            stats.stats.items():  # type: ignore[attr-defined]
        if func == "<module>" or not any(part in path for part in LISTED):
            continue
        short = path.split("site-packages/")[-1].split(str(c.HERE.parent) + "/")[-1]
        rows.append({"function": f"{short}:{line}({func})", "calls": ncalls / tasks,
                     "own_us": tottime / tasks * 1e6, "cum_us": cumtime / tasks * 1e6})
    rows.sort(key=lambda r: -r["cum_us"])
    return rows[:top]


def cumulative(stats: pstats.Stats, func: str, path_part: str) -> float:
    for (path, _line, name), (_cc, _n, _tt, cumtime, _) in \
            stats.stats.items():  # type: ignore[attr-defined]
        if name == func and path_part in path:
            return float(cumtime)
    return 0.0


# -- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", action="store_true",
                        help="time the pieces in this process instead of profiling a "
                             "worker")
    parser.add_argument("--rounds", type=int, default=7, help="--parts: rounds")
    parser.add_argument("--calls", type=int, default=2000,
                        help="--parts: calls per piece per round")
    parser.add_argument("--variant", default="LockedTask (hashed args)",
                        help="cProfile: the bench_e2e variant to run")
    parser.add_argument("--tasks", type=int, default=3000, help="cProfile: tasks")
    parser.add_argument("--top", type=int, default=25, help="cProfile: rows")
    parser.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                        help="cProfile clock: wall (default; includes waiting for "
                             "Redis) or cpu (process CPU time; slower to read)")
    parser.add_argument("--save", default=None, metavar="PATH",
                        help="cProfile: keep the raw profile here")
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args(argv)
    prefix = f"{c.run_id()}-prof"
    with c.redis_server(args.redis_url) as (url, _server), \
            tempfile.TemporaryDirectory(prefix="dlock-prof-") as tmp:
        os.environ["DLOCK_E2E_REDIS_URL"] = url
        os.environ["DLOCK_E2E_PREFIX"] = prefix
        import e2e_app

        info_client = redis.Redis.from_url(url)
        c.print_machine(c.machine_info(info_client))
        info_client.close()
        if args.parts:
            rows = run_parts(make_parts(e2e_app), args.rounds, args.calls)
            print(f"\n{args.rounds} rounds x {args.calls} calls per piece, pieces "
                  "interleaved; median over rounds.\n")
            print(c.markdown_table(PARTS_COLUMNS, rows))
            return 0
        task = e2e_app.VARIANTS.get(args.variant)
        if task is None:
            parser.error(f"unknown variant {args.variant!r}; choose from "
                         f"{list(e2e_app.VARIANTS)}")
        out = Path(args.save or Path(tmp) / "worker.pstats")
        wall = profiled_run(e2e_app, task, url, prefix, args.tasks, args.timer, out,
                            Path(tmp) / "worker.log")
        stats = pstats.Stats(str(out))
    n = args.tasks
    print(f"\n{args.variant}: {n} tasks on a profiled solo worker ({args.timer} "
          f"clock), {wall:.1f}s ({n / wall:,.0f} tasks/s under the profiler)\n")
    call = cumulative(stats, "__call__", "celery_dlock/task.py")
    body = cumulative(stats, task.run.__name__, "e2e_app.py")
    if call:
        print(f"LockedTask.__call__: {call / n * 1e6:.0f} us/task, of which the body "
              f"{body / n * 1e6:.0f} us and the lock around it "
              f"{(call - body) / n * 1e6:.0f} us\n")
    else:
        print(f"task body: {body / n * 1e6:.0f} us/task\n")
    print(c.markdown_table([("function", "function", ""), ("calls/task", "calls", ".1f"),
                            ("own us/task", "own_us", ".1f"),
                            ("cumulative us/task", "cum_us", ".1f")],
                           per_task_table(stats, n, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
