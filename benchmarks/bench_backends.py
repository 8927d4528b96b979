"""(i) Per lock backend: the lock cycle, a renewal pass, and tasks/s on a real worker.

Every backend of ``_backends.BACKENDS`` (Redis, PostgreSQL, ZooKeeper), side by side
in one run, through the same door: ``lock_from_url(url, name, ttl=30)`` (auto_renew
on, the default) and a ``LockedTask`` whose app's ``dlock_url`` is that URL.

1. **Lock cycle**: ``acquire(blocking=False)`` + ``release()`` on one client, on
   distinct names (a new lock object and name per cycle, as a ``LockedTask`` makes
   one per call), on one hot name (one lock object, taken and given back) and, on a
   backend that keeps semaphores, on one slot of a semaphore of 3 (``lock_limit=3``:
   one object, taken and given back; the others free).  Every
   round runs every (backend, names) variant for ``--cycles`` cycles, the order
   rotated from round to round.  Per variant: the median over rounds of each round's
   p50, p99 and mean wall time per cycle, the CPU time of this process per cycle
   (``time.process_time()``: the renewal scheduler's and the drivers' threads
   included), the requests the client sent per cycle (Redis commands, PostgreSQL
   statements, ZooKeeper requests: see ``_backends.Requests``), the lock server's CPU
   time per cycle (``/proc``, when it runs on this machine), and ``x Redis``: the
   median of the per-round ratio of the p50 to Redis's p50 on the same names.
2. **Renewal pass**: ``--holds`` holds (default 1 and 100) taken on a scheduler
   without a thread; each pass is one ``renew_due`` with the clock moved on by one
   renewal interval, so every hold is due (as ``bench_renewal.py``).  Median over
   ``--passes`` passes.
3. **Tasks/s**: one ``celery worker --pool=prefork -c 2`` per backend, all running
   at once, each on a queue of its own, on ``e2e_app.py`` with
   ``DLOCK_E2E_LOCK_URL`` (its ``dlock_url``) set to that backend's URL.  Redis is
   the broker of every worker, so only the lock changes.  ``bench_e2e.py``'s batches:
   the plain task (on the Redis backend's worker; the workers differ only in their
   ``dlock_url``) and ``LockedTask (hashed args)`` on each worker, variants
   alternated, the order rotated per round.  ``lock server`` is the CPU time of the
   lock's server when it is not the broker's redis-server; the idle workers and
   servers count neither in a task's CPU time nor as other work.

The servers: one throwaway ``redis-server`` (or ``--redis-url``) is the broker and the
Redis backend; PostgreSQL, MariaDB and ZooKeeper are started with the test suite's
launchers (``tests/fencing/pg_server.py``, ``tests/mariadb_server.py``,
``tests/zk_server.py``) unless ``--postgres-url`` / ``--mysql-url`` /
``--zookeeper-url`` name running ones.  A backend whose driver or server is missing is
skipped, with a one-line reason.

    python benchmarks/bench_backends.py          # -> results/bench_backends.json
    python benchmarks/bench_backends.py --smoke  # tiny counts, no JSON
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _backends as bk
import _common as c
import bench_e2e as e2e
import psutil
import redis

from celery_dlock import InvalidLockConfig, lock_from_url
from celery_dlock.core.scheduler import RenewalScheduler
from celery_dlock.core.urls import mask_url

NAME = "bench_backends"
TITLE_CYCLE = "### i. Lock cycle per backend: acquire(blocking=False) + release()"
TITLE_RENEW = "### i. One renewal pass per backend"
TITLE_E2E = "### i. Tasks/s per lock backend on a real prefork worker"
CYCLE_COLUMNS = [
    ("backend", "backend", ""),
    ("names", "names", ""),
    ("p50 us", "p50_us", ".1f"),
    ("p99 us", "p99_us", ".1f"),
    ("mean us", "mean_us", ".1f"),
    ("x Redis", "ratio_redis", ".2f"),
    ("CPU us/cycle", "cpu_us", ".1f"),
    ("requests/cycle", "requests", ".2f"),
    ("server CPU us/cycle", "server_cpu_us", ".1f"),
    ("other CPUs busy", "other_cpus_busy", ".2f"),
]
RENEW_COLUMNS = [
    ("backend", "backend", ""),
    ("holds", "holds", ""),
    ("wall ms/pass", "wall_ms", ".3f"),
    ("CPU ms/pass", "cpu_ms", ".3f"),
    ("requests/pass", "requests", ".1f"),
    ("server CPU ms/pass (mean)", "server_cpu_ms", ".3f"),
]
E2E_COLUMNS = [
    ("variant", "variant", ""),
    ("tasks/s", "tasks_per_s", ",.0f"),
    ("x plain", "ratio", ".3f"),
    ("x Redis lock", "ratio_redis", ".3f"),
    ("CPU ms/task", "cpu_ms", ".3f"),
    ("+CPU ms/task", "added_cpu_ms", "+.3f"),
    ("producer", "producer_ms", ".3f"),
    ("worker main", "worker_main_ms", ".3f"),
    ("pool children", "children_ms", ".3f"),
    ("redis-server", "redis_ms", ".3f"),
    ("lock server", "lock_server_ms", ".3f"),
    ("Redis cmds/task", "redis_cmds", ".2f"),
    ("other CPUs busy", "other_cpus_busy", ".2f"),
]
LOCKED = "LockedTask (hashed args)"


# -- 1. the lock cycle ----------------------------------------------------------------


def cycle_variants(urls: dict[str, str],
                   prefix: str) -> dict[tuple[str, str], Callable[[], None]]:
    """``(backend, names) -> one cycle``."""
    variants: dict[tuple[str, str], Callable[[], None]] = {}
    for backend, url in urls.items():
        counter = itertools.count()

        def distinct(url: str = url, backend: str = backend,
                     counter: Iterator[int] = counter) -> None:
            lock = lock_from_url(url, f"{prefix}:{backend}:d{next(counter)}", ttl=30)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"{backend}: a distinct name was taken")
            lock.release()

        hot_lock = lock_from_url(url, f"{prefix}:{backend}:hot", ttl=30)

        def hot(lock: Any = hot_lock, backend: str = backend) -> None:
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"{backend}: the hot name was taken")
            lock.release()

        variants[(backend, "distinct")] = distinct
        variants[(backend, "hot")] = hot
        try:  # a backend without semaphores refuses the limit
            slot = lock_from_url(url, f"{prefix}:{backend}:slots", ttl=30, limit=3)
        except InvalidLockConfig:
            continue

        def one_slot(lock: Any = slot, backend: str = backend) -> None:
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"{backend}: no slot of the semaphore was free")
            lock.release()

        variants[(backend, "slot of 3")] = one_slot
    return variants


def measure_cycles(fn: Callable[[], None], cycles: int, warmup: int,
                   server: e2e.Processes | None) -> dict[str, float | None]:
    for _ in range(warmup):
        fn()
    times = []
    perf = time.perf_counter
    srv0 = bk.group_cpu([server]) if server else None
    sent0 = bk.Requests.sent
    cpu0 = time.process_time()
    t_start = perf()
    for _ in range(cycles):
        t0 = perf()
        fn()
        times.append(perf() - t0)
    wall = perf() - t_start
    cpu = time.process_time() - cpu0
    sent = bk.Requests.sent - sent0
    times.sort()
    p50, p99 = c.percentile(times, 50), c.percentile(times, 99)
    return {
        "p50_us": None if p50 is None else p50 * 1e6,
        "p99_us": None if p99 is None else p99 * 1e6,
        "mean_us": wall / cycles * 1e6,
        "cpu_us": cpu / cycles * 1e6,
        "requests": sent / cycles,
        "server_cpu_us": (None if srv0 is None or server is None
                          else (bk.group_cpu([server]) - srv0) / cycles * 1e6),
    }


def run_cycles(urls: dict[str, str], servers: dict[str, e2e.Processes | None],
               control: redis.Redis, rounds: int, cycles: int, warmup: int,
               budget: c.RetryBudget, prefix: str) -> list[dict[str, Any]]:
    variants = cycle_variants(urls, prefix)
    keys = list(variants)
    # The redis-server is counted by LoadMonitor itself.
    ours = [g for b, g in servers.items() if g is not None and b != bk.REFERENCE]
    per_round: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in keys}
    r = 0
    while r < rounds:
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        monitor = c.LoadMonitor(control, ours=lambda: bk.group_cpu(ours))
        this_round = {k: measure_cycles(variants[k], cycles, warmup, servers[k[0]])
                      for k in order}
        load = monitor.stop()
        if not budget.keep(load, f"lock cycle round {r + 1}"):
            continue
        for k in keys:
            per_round[k].append(this_round[k] | {"other_cpus_busy":
                                                 load["other_cpus_busy"]})
        r += 1
    rows = []
    for (backend, names), samples in per_round.items():
        ref = per_round.get((bk.REFERENCE, names))
        ratios = ([s["p50_us"] / b["p50_us"] for s, b in zip(samples, ref, strict=True)]
                  if ref else [])
        row: dict[str, Any] = {"backend": backend, "names": names,
                               "ratio_redis": statistics.median(ratios) if ratios
                               else None,
                               "rounds_p50_us": [s["p50_us"] for s in samples],
                               "rounds_ratio_redis": ratios}
        for key in ("p50_us", "p99_us", "mean_us", "cpu_us", "requests",
                    "server_cpu_us", "other_cpus_busy"):
            values = [s[key] for s in samples]
            row[key] = None if None in values else statistics.median(values)
        rows.append(row)
    rows.sort(key=lambda row: (row["names"], list(urls).index(row["backend"])))
    return rows


# -- 2. one renewal pass --------------------------------------------------------------


def run_renewal(urls: dict[str, str], servers: dict[str, e2e.Processes | None],
                counts: list[int], passes: int, prefix: str) -> list[dict[str, Any]]:
    rows = []
    for holds in counts:
        for backend, url in urls.items():
            hb = RenewalScheduler(start_thread=False)
            locks = []
            for i in range(holds):
                lock = lock_from_url(url, f"{prefix}:{backend}:renew{holds}:{i}", ttl=30)
                # A scheduler without a thread, whose clock the passes move on (as
                # bench_renewal.py): lock_from_url takes no scheduler argument.
                lock._scheduler = hb  # type: ignore[attr-defined]
                if not lock.acquire(blocking=False):
                    raise RuntimeError(f"{backend}: could not take {i}")
                locks.append(lock)
            interval = 10.0  # ttl 30 s / 3
            base = time.monotonic()
            server = servers[backend]
            hb.renew_due(base + interval)  # unmeasured: connections, scripts
            samples = []
            # The server's CPU time over all passes (/proc counts in 10 ms ticks: one
            # pass is too short to see).
            srv0 = bk.group_cpu([server]) if server else None
            for k in range(1, passes + 1):
                sent0 = bk.Requests.sent
                cpu0 = time.process_time()
                t0 = time.perf_counter()
                hb.renew_due(base + (k + 1) * interval)
                wall = time.perf_counter() - t0
                cpu = time.process_time() - cpu0
                samples.append({
                    "wall_ms": wall * 1000, "cpu_ms": cpu * 1000,
                    "requests": float(bk.Requests.sent - sent0)})
            server_ms = (None if srv0 is None or server is None
                         else (bk.group_cpu([server]) - srv0) * 1000 / passes)
            if len(hb) != holds:
                raise RuntimeError(f"{backend}: {holds - len(hb)} holds were lost "
                                   "during renewal")
            for lock in locks:
                lock.release()
            row: dict[str, Any] = {"backend": backend, "holds": holds,
                                   "server_cpu_ms": server_ms}
            for key in samples[0]:
                row[key] = statistics.median(s[key] for s in samples)
            rows.append(row)
    return rows


# -- 3. tasks/s on a real worker per backend ------------------------------------------


class Routed:
    """A task sent to one worker's queue (``run_batch`` calls ``apply_async``)."""

    def __init__(self, task: Any, queue: str) -> None:
        self.task = task
        self.name = task.name
        self.queue = queue

    def apply_async(self, args: tuple[Any, ...]) -> Any:
        return self.task.apply_async(args, queue=self.queue)


def run_tasks(urls: dict[str, str], broker: str, redis_server: Any,
              servers: dict[str, e2e.Processes | None], budget: c.RetryBudget,
              count: int, rounds: int, warmup: int, prefix: str,
              log_dir: str) -> dict[str, Any]:
    import e2e_app

    control = redis.Redis.from_url(broker)
    redis_pid = e2e.local_redis_pid(control, redis_server)
    numbers = itertools.count(secrets.randbelow(1 << 30) << 22)
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        workers: dict[str, tuple[Any, str, Path]] = {}
        for backend, url in urls.items():  # started together, then waited for
            workers[backend] = stack.enter_context(e2e.worker(
                broker, prefix, 2, log_dir, tag=f"-{backend}",
                env={"DLOCK_E2E_LOCK_URL": url}, queue=f"{e2e_app.QUEUE}-{backend}"))
        for proc, name, log in workers.values():
            e2e.wait_ready(e2e_app.app, name, proc, log)

        def worker_procs(backend: str) -> list[psutil.Process]:
            try:
                main = psutil.Process(workers[backend][0].pid)
                return [main, *main.children(recursive=True)]
            except psutil.Error:
                return []

        def meter(backend: str, locked: bool) -> e2e.CpuMeter:
            lock_server = servers[backend] if locked and backend != bk.REFERENCE else None
            idle = [b for b in urls if b != backend]
            idle_servers = [g for b, g in servers.items() if b != bk.REFERENCE
                            and g is not None and g is not lock_server]

            def bystanders() -> list[psutil.Process]:
                return [p for b in idle for p in worker_procs(b)] + [
                    p for g in idle_servers for p in g()]

            return e2e.CpuMeter(workers[backend][0].pid, redis_pid,
                                extra={"lock_server": lock_server} if lock_server
                                else None, bystanders=bystanders)

        first = next(iter(urls))
        variants: dict[str, tuple[str, Routed, e2e.CpuMeter]] = {
            e2e.BASELINE: (first, Routed(e2e_app.plain, f"{e2e_app.QUEUE}-{first}"),
                           meter(first, False))}
        for backend in urls:
            variants[f"{LOCKED}, {backend}"] = (
                backend, Routed(e2e_app.locked, f"{e2e_app.QUEUE}-{backend}"),
                meter(backend, True))
        out["pool_children"] = {b: len(variants[f"{LOCKED}, {b}"][2].children())
                                for b in urls}

        def batch(variant: str, n: int) -> dict[str, Any]:
            backend, task, m = variants[variant]
            proc, _, log = workers[backend]
            return e2e.run_batch(task, n, numbers, control, m, proc, log,
                                 e2e_app.COUNTER, e2e_app.MARKER, e2e_app.DONE_AT)

        if warmup:  # imports, connections, sessions, tables: not measured
            for variant in variants:
                batch(variant, warmup)
        names = list(variants)
        per_round: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for variant in order:
                while True:
                    time.sleep(0.1)  # let the worker's last acks settle, unmeasured
                    sample = batch(variant, count)
                    if budget.keep(sample, f"tasks round {r + 1}, {variant}"):
                        break
                per_round[variant].append(sample)
            print(f"tasks round {r + 1}/{rounds}: " + ", ".join(
                f"{v} {per_round[v][-1]['tasks_per_s']:,.0f}/s" for v in order),
                file=sys.stderr)
    control.close()
    rows = e2e.summarise(per_round)
    ref = per_round.get(f"{LOCKED}, {bk.REFERENCE}")
    for row in rows:
        if ref is None or row["variant"] == e2e.BASELINE:
            row["ratio_redis"] = None
            continue
        ratios = [s["tasks_per_s"] / b["tasks_per_s"]
                  for s, b in zip(per_round[row["variant"]], ref, strict=True)]
        row["ratio_redis"] = statistics.median(ratios)
        row["rounds_ratio_redis"] = ratios
    out["rows"] = rows
    return out


# -- main ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    bk.add_server_arguments(parser, "--backends", "all")
    parser.add_argument("--parts", default="cycle,renewal,tasks",
                        help="comma-separated subset of cycle,renewal,tasks")
    parser.add_argument("--rounds", type=int, default=None,
                        help="lock-cycle rounds (default 7; smoke 2)")
    parser.add_argument("--cycles", type=int, default=None,
                        help="cycles per variant per round (default 1000; smoke 20)")
    parser.add_argument("--holds", default=None,
                        help="renewal: comma-separated hold counts (default 1,100; "
                             "smoke 1,5)")
    parser.add_argument("--passes", type=int, default=None,
                        help="renewal passes per count (default 15; smoke 2)")
    parser.add_argument("--tasks", type=int, default=None,
                        help="tasks per variant per round (default 1500; smoke 30)")
    parser.add_argument("--task-rounds", type=int, default=None,
                        help="rounds of tasks (default 5; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured tasks per variant first (default 200; smoke 10)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if set(parts) - {"cycle", "renewal", "tasks"}:
        parser.error(f"--parts: unknown part in {args.parts!r}")
    known = {b.name for b in bk.BACKENDS}
    if args.backends and set(args.backends.split(",")) - known:
        parser.error(f"--backends: choose from {sorted(known)}")
    smoke = args.smoke
    rounds = args.rounds or (2 if smoke else 7)
    cycles = args.cycles or (20 if smoke else 1000)
    cycle_warmup = 5 if smoke else 100
    counts = [int(n) for n in (args.holds or ("1,5" if smoke else "1,100")).split(",")]
    passes = args.passes or (2 if smoke else 15)
    tasks = args.tasks or (30 if smoke else 1500)
    task_rounds = args.task_rounds or (1 if smoke else 5)
    warmup = args.warmup if args.warmup is not None else (10 if smoke else 200)

    results: dict[str, Any] = {
        "benchmark": NAME, "smoke": smoke, "rounds": rounds, "cycles": cycles,
        "holds": counts, "passes": passes, "tasks": tasks, "task_rounds": task_rounds,
        "warmup": warmup}
    prefix = f"{c.run_id()}-backends"
    bk.Requests.install()
    c.wait_quiet(args.wait_quiet)
    with contextlib.ExitStack() as stack:
        broker, redis_server = stack.enter_context(c.redis_server(args.redis_url))
        log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="dlock-bk-"))
        os.environ["DLOCK_E2E_REDIS_URL"] = broker
        os.environ["DLOCK_E2E_PREFIX"] = prefix
        urls, skipped = bk.start_backends(args, stack, broker)
        control = redis.Redis.from_url(broker)
        stack.callback(control.close)
        results["machine"] = c.machine_info(control)
        results["machine"]["servers"] = bk.server_versions(urls)
        c.print_machine(results["machine"])
        print("lock servers: " + ", ".join(
            f"{b} {v or '?'}" for b, v in results["machine"]["servers"].items()))
        results["backends"] = {b: mask_url(u) for b, u in urls.items()}
        results["skipped"] = skipped
        servers = {b: bk.server_processes(u) for b, u in urls.items()}
        results["server_cpu_measured"] = {b: g is not None for b, g in servers.items()}
        ours = [g for b, g in servers.items() if g is not None and b != bk.REFERENCE]
        monitor = c.LoadMonitor(control, ours=lambda: bk.group_cpu(ours))
        budget = c.RetryBudget(args)
        if not urls:
            print("no backend to measure")
        if urls and "cycle" in parts:
            results["cycle"] = run_cycles(urls, servers, control, rounds, cycles,
                                          cycle_warmup, budget, f"{prefix}:cycle")
            print(f"\n{TITLE_CYCLE}\n")
            print(f"{rounds} rounds x {cycles} cycles per variant, variants "
                  "interleaved; median over rounds of each round's figure.\n")
            print(c.markdown_table(CYCLE_COLUMNS, results["cycle"]))
        if urls and "renewal" in parts:
            results["renewal"] = run_renewal(urls, servers, counts, passes,
                                             f"{prefix}:renew")
            print(f"\n{TITLE_RENEW}\n")
            print(f"median of {passes} passes per count (server CPU: their mean); "
                  "every hold is due in every pass.\n")
            print(c.markdown_table(RENEW_COLUMNS, results["renewal"]))
        if urls and "tasks" in parts:
            results["tasks"] = run_tasks(urls, broker, redis_server, servers, budget,
                                         tasks, task_rounds, warmup, prefix, log_dir)
            print(f"\n{TITLE_E2E}\n")
            print(f"{task_rounds} rounds x {tasks} tasks per variant, variants "
                  "alternated (order rotates per round); one `celery worker "
                  "--pool=prefork -c 2` per backend, Redis the broker of all; median "
                  "over rounds. CPU columns: ms per task.\n")
            print(c.markdown_table(E2E_COLUMNS, results["tasks"]["rows"]))
        for backend, why in skipped.items():
            print(f"\nskipped {backend}: {why}")
        results["load"] = monitor.stop() | budget.as_dict()
        c.print_load(results["load"])
    c.write_json(c.json_path(args, NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
