"""(a) End to end on a real prefork worker: tasks/s and CPU per task.

One ``celery worker --pool=prefork -c 2`` subprocess (``e2e_app.py``, prefetch 64,
results ignored) runs no-op tasks whose only work is one ``INCR`` of a counter, as

* ``plain task``                  ``@app.task``
* ``LockedTask (hashed args)``    ``base=LockedTask``, default settings (lock_key=None)
* ``LockedTask (template key)``   ``base=LockedTask, lock_key="e2e:{n}"``
* ``celery-once QueueOnce``       ``base=QueueOnce`` (locks at enqueue, unlocks after)
* ``celery-singleton Singleton``  ``base=Singleton`` (locks at enqueue, unlocks after)

every call with distinct arguments (no contention; no lock left behind by one batch can
match a later call).  One round sends ``--tasks`` tasks per variant with
``task.apply_async((n,))`` in a loop, variant after variant (the order rotates from
round to round), and waits until the last one has run.  Per variant and round:

* tasks/s = tasks / (first send -> last task done), so enqueueing is included;
* CPU ms/task = CPU time (user + system) used meanwhile by this producer process, the
  worker's main process, its pool children and the redis-server (``/proc`` via psutil;
  the server's share is n/a with a ``--redis-url`` that is not a local process),
  divided by the tasks;
* Redis cmds/task from ``INFO commandstats`` (commands inside Lua scripts count too);
* other CPUs busy: how many CPUs other work on the machine kept busy meanwhile, on
  average (as ``_common.LoadMonitor``).  Well above 0, tasks/s is disturbed more than
  CPU ms/task.

The table gives medians over the rounds; ``x plain`` and ``+CPU ms/task`` are medians
of the per-round ratio and difference against ``plain task`` in the same round.  The
machine may be shared: a batch during which other work kept more than
``--disturbed-threshold`` CPUs busy is run again once the machine is idle, within the
``--retry-disturbed`` budget (see ``_common.RetryBudget``).

    python benchmarks/bench_e2e.py          # full run -> results/bench_e2e.json
    python benchmarks/bench_e2e.py --smoke  # 3 rounds x 60 tasks, no JSON
    python benchmarks/bench_e2e.py --concurrency 1,4,16 --tasks 1500 --rounds 3
                                            # -> results/bench_e2e_scaling.json
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import _common as c
import psutil
import redis

NAME = "bench_e2e"
#: The result file of a run over several pool sizes (``--concurrency 1,4,16``).
SCALING = "bench_e2e_scaling"
TITLE = "### a. End to end on a real prefork worker: no-op tasks, distinct arguments"
COLUMNS = [
    ("variant", "variant", ""),
    ("tasks/s", "tasks_per_s", ",.0f"),
    ("x plain", "ratio", ".3f"),
    ("CPU ms/task", "cpu_ms", ".3f"),
    ("+CPU ms/task", "added_cpu_ms", "+.3f"),
    ("producer", "producer_ms", ".3f"),
    ("worker main", "worker_main_ms", ".3f"),
    ("pool children", "children_ms", ".3f"),
    ("redis-server", "redis_ms", ".3f"),
    ("Redis cmds/task", "redis_cmds", ".2f"),
    ("other CPUs busy", "other_cpus_busy", ".2f"),
]
PARTS = ("producer", "worker_main", "children", "redis")
BASELINE = "plain task"
#: The variant the targets are about, and the ones it is compared with.
LOCKED = "LockedTask (hashed args)"
OTHERS = ("celery-once QueueOnce", "celery-singleton Singleton")


# -- the worker ----------------------------------------------------------------------


def worker_env(url: str, prefix: str,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker on ``e2e_app`` (found on ``PYTHONPATH``), with
    ``extra`` variables (``DLOCK_E2E_LOCK_URL``: the locks' ``dlock_url``)."""
    env = dict(os.environ, DLOCK_E2E_REDIS_URL=url, DLOCK_E2E_PREFIX=prefix,
               **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(c.HERE), os.environ.get("PYTHONPATH")) if p)
    return env


def worker_argv(name: str, *pool: str) -> list[str]:
    """``celery worker`` arguments (after ``python -m celery``) for ``e2e_app``."""
    return ["-A", "e2e_app", "worker", *pool, "-n", name, "--without-gossip",
            "--without-mingle", "--without-heartbeat", "--loglevel=WARNING"]


@contextmanager
def worker(url: str, prefix: str, concurrency: int, log_dir: str, *, tag: str = "",
           env: Mapping[str, str] | None = None, queue: str | None = None,
           ) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """A ``celery worker`` subprocess on ``e2e_app``; yields (process, name, log).

    Several may run at once (``bench_backends.py``): each with its own ``tag`` (in
    its name and log), ``env`` (:func:`worker_env`'s extra) and ``queue`` (``-Q``;
    default: the app's default queue)."""
    name = f"{prefix}{tag}@localhost"
    log = Path(log_dir) / f"worker{tag}.log"
    pool = ["--pool=prefork", f"--concurrency={concurrency}"]
    if queue is not None:
        pool += ["-Q", queue]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", *worker_argv(name, *pool)],
            env=worker_env(url, prefix, env), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, name, log
    finally:
        with suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def log_tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_ready(app: Any, name: str, proc: subprocess.Popen[bytes], log: Path,
               timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}:\n"
                               f"{log_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not answer a ping in {timeout:.0f}s:\n"
                               f"{log_tail(log)}")
        if app.control.ping(destination=[name], timeout=0.5):
            return


# -- CPU time ------------------------------------------------------------------------


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


#: Processes whose CPU time a meter adds up (found anew at every snapshot).
Processes = Callable[[], list[psutil.Process]]


def group_seconds(procs: Processes) -> dict[int, float]:
    """CPU seconds used so far by each process of a group (the gone ones left out)."""
    out: dict[int, float] = {}
    for proc in procs():
        with suppress(psutil.Error):
            out[proc.pid] = cpu_seconds(proc)
    return out


def group_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds a group used between two snapshots (a process started meanwhile
    counts whole; one that ended meanwhile is lost)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


class CpuMeter:
    """CPU seconds used so far by the producer, the worker and the redis-server.

    ``extra``: more groups of processes whose time counts in a task's CPU time, each
    a column of its own (``bench_backends.py``: the lock's server when it is not the
    redis-server); ``bystanders``: processes of the benchmark that do not serve the
    batch (idle workers, idle servers), counted neither in the task's CPU time nor as
    other work on the machine."""

    def __init__(self, worker_pid: int, redis_pid: int | None, *,
                 extra: Mapping[str, Processes] | None = None,
                 bystanders: Processes | None = None) -> None:
        self.worker = psutil.Process(worker_pid)
        self.redis = psutil.Process(redis_pid) if redis_pid else None
        self.extra = dict(extra or {})
        self.bystanders = bystanders

    def children(self) -> list[psutil.Process]:
        return self.worker.children(recursive=True)

    def snapshot(self) -> dict[str, Any]:
        kids = self.children()
        return {
            "producer": time.process_time(),
            "worker_main": cpu_seconds(self.worker),
            "children": {p.pid: cpu_seconds(p) for p in kids},
            "redis": cpu_seconds(self.redis) if self.redis else None,
            "extra": {k: group_seconds(v) for k, v in self.extra.items()},
            "bystanders": group_seconds(self.bystanders) if self.bystanders else {},
            "machine": c._busy_jiffies(),
        }

    @staticmethod
    def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        if set(before["children"]) != set(after["children"]):
            raise RuntimeError("the worker's pool children changed during a batch "
                               f"({sorted(before['children'])} -> "
                               f"{sorted(after['children'])}): CPU time would be lost")
        out: dict[str, Any] = {
            "producer": after["producer"] - before["producer"],
            "worker_main": after["worker_main"] - before["worker_main"],
            "children": sum(after["children"][pid] - before["children"][pid]
                            for pid in after["children"]),
            "redis": None,
        }
        if before["redis"] is not None:
            out["redis"] = after["redis"] - before["redis"]
        for name, group in after["extra"].items():
            out[name] = group_delta(before["extra"][name], group)
        bystanders = group_delta(before["bystanders"], after["bystanders"])
        out["other"] = None
        if before["machine"] is not None and after["machine"] is not None:
            ours = sum(v for v in out.values() if v is not None) + bystanders
            out["other"] = max(0.0, after["machine"][0] - before["machine"][0] - ours)
        out["bystanders"] = bystanders
        return out


def local_redis_pid(client: redis.Redis, server: Any) -> int | None:
    """The redis-server's pid, when it runs on this machine (else None)."""
    if server is not None and server.process is not None:
        return int(server.process.pid)
    pid = client.info("server").get("process_id")
    try:
        if pid and "redis" in psutil.Process(int(pid)).name():
            return int(pid)
    except (psutil.Error, ValueError):
        pass
    return None


# -- one batch -----------------------------------------------------------------------


def wait_done(what: str, count: int, control: redis.Redis,
              proc: subprocess.Popen[bytes], log: Path, counter: str, marker: str,
              done_at: int) -> None:
    """Block until the task that brings ``counter`` to ``done_at`` pushes ``marker``."""
    deadline = time.monotonic() + max(60.0, count / 20)
    while not control.blpop([marker], timeout=1):
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}:\n"
                               f"{log_tail(log)}")
        if time.monotonic() > deadline:
            left = done_at - int(control.get(counter) or 0)
            raise RuntimeError(
                f"{what}: {left} of {count} tasks not done in time; a lock left "
                f"behind (celery-once/singleton drop duplicates) or a stuck "
                f"worker:\n{log_tail(log)}")


def run_batch(task: Any, count: int, numbers: Iterator[int], control: redis.Redis,
              meter: CpuMeter, proc: subprocess.Popen[bytes], log: Path,
              counter: str, marker: str, done_at: int) -> dict[str, Any]:
    """Send ``count`` tasks with distinct arguments; wait for the last to finish."""
    control.delete(marker)
    control.set(counter, done_at - count)
    calls0 = c.command_calls(control)
    cpu0 = meter.snapshot()
    t0 = time.perf_counter()
    apply_async = task.apply_async
    for n in itertools.islice(numbers, count):
        apply_async((n,))
    sent = time.perf_counter() - t0
    wait_done(task.name, count, control, proc, log, counter, marker, done_at)
    wall = time.perf_counter() - t0
    cpu = CpuMeter.delta(cpu0, meter.snapshot())
    calls = c.calls_delta(calls0, c.command_calls(control))
    done = int(control.get(counter) or 0)
    if done != done_at:
        raise RuntimeError(f"{task.name}: {done - done_at:+d} tasks ran beyond the "
                           f"{count} sent")
    parts = (*PARTS, *meter.extra)
    total = sum(cpu[part] for part in parts if cpu[part] is not None)
    sample: dict[str, Any] = {
        "wall_s": wall,
        "send_s": sent,
        "tasks_per_s": count / wall,
        "cpu_ms": total / count * 1000,
        "redis_cmds": c.total_calls(calls) / count,
        "redis_cmds_by_name": {k: v["calls"] / count for k, v in calls.items()},
        # CPUs kept busy by other work on the machine meanwhile (as LoadMonitor).
        "other_cpus_busy": None if cpu["other"] is None else cpu["other"] / wall,
        "bystanders_ms": cpu["bystanders"] / count * 1000,
    }
    for part in parts:
        value = cpu[part]
        sample[f"{part}_ms"] = None if value is None else value / count * 1000
    return sample


# -- summary -------------------------------------------------------------------------


def summarise(per_round: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    base = per_round[BASELINE]
    rows = []
    for name, samples in per_round.items():
        ratios = [s["tasks_per_s"] / b["tasks_per_s"]
                  for s, b in zip(samples, base, strict=True)]
        added = [s["cpu_ms"] - b["cpu_ms"] for s, b in zip(samples, base, strict=True)]
        row: dict[str, Any] = {
            "variant": name,
            "tasks_per_s": statistics.median(s["tasks_per_s"] for s in samples),
            "ratio": statistics.median(ratios),
            "cpu_ms": statistics.median(s["cpu_ms"] for s in samples),
            "added_cpu_ms": statistics.median(added),
            "redis_cmds": statistics.median(s["redis_cmds"] for s in samples),
            "rounds_other_cpus_busy": [s["other_cpus_busy"] for s in samples],
            "rounds_tasks_per_s": [s["tasks_per_s"] for s in samples],
            "rounds_cpu_ms": [s["cpu_ms"] for s in samples],
            "rounds_ratio": ratios,
            "rounds_added_cpu_ms": added,
            "rounds_send_s": [s["send_s"] for s in samples],
            "redis_cmds_by_name": samples[-1]["redis_cmds_by_name"],
        }
        extra = [k for k in samples[0] if k.endswith("_ms") and k != "cpu_ms"
                 and k.removesuffix("_ms") not in PARTS]
        for key in (*(f"{part}_ms" for part in PARTS), *extra, "other_cpus_busy"):
            values = [s[key] for s in samples]
            row[key] = None if None in values else statistics.median(values)
        rows.append(row)
    return rows


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {r["variant"]: r for r in rows}
    locked = by_name.get(LOCKED)
    if locked is None or BASELINE not in by_name:
        return []
    targets = [{
        "target": f"{LOCKED} tasks/s >= 0.95 x plain",
        "value": f"{locked['ratio']:.3f} x plain",
        "met": locked["ratio"] >= 0.95,
    }]
    others = [by_name[o] for o in OTHERS if o in by_name]
    if others:
        targets.append({
            "target": f"{LOCKED} adds fewer CPU ms/task than "
                      + " and ".join(o["variant"] for o in others),
            "value": f"{locked['added_cpu_ms']:+.3f} vs "
                     + ", ".join(f"{o['added_cpu_ms']:+.3f}" for o in others),
            "met": all(locked["added_cpu_ms"] < o["added_cpu_ms"] for o in others),
        })
    return targets


# -- main ----------------------------------------------------------------------------


def run_workers(url: str, server: Any, concurrency: int, variants: dict[str, Any],
                count: int, rounds: int, warmup: int, numbers: Iterator[int],
                budget: c.RetryBudget, prefix: str, app: Any, e2e: Any,
                log_dir: str) -> dict[str, Any]:
    """Every round on one ``prefork -c concurrency`` worker; per-round samples."""
    control = redis.Redis.from_url(url)
    redis_pid = local_redis_pid(control, server)
    out: dict[str, Any] = {"concurrency": concurrency}
    try:
        with worker(url, prefix, concurrency, log_dir) as (proc, name, log):
            wait_ready(app, name, proc, log)
            meter = CpuMeter(proc.pid, redis_pid)
            out["pool_children"] = len(meter.children())

            def batch(task: Any, n: int) -> dict[str, Any]:
                return run_batch(task, n, numbers, control, meter, proc, log,
                                 e2e.COUNTER, e2e.MARKER, e2e.DONE_AT)

            if warmup:  # imports, connections, script loading: not measured
                for task in variants.values():
                    batch(task, warmup)
            names = list(variants)
            per_round: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            orders = []
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                orders.append(order)
                for variant in order:
                    while True:
                        time.sleep(0.1)  # let the worker's last acks settle, unmeasured
                        sample = batch(variants[variant], count)
                        # Per batch, not LoadMonitor: the worker is not a waited child.
                        if budget.keep(sample, f"-c {concurrency} round {r + 1}, "
                                               f"{variant}"):
                            break
                    per_round[variant].append(sample)
                print(f"-c {concurrency} round {r + 1}/{rounds}: " + ", ".join(
                    f"{v} {per_round[v][-1]['tasks_per_s']:,.0f}/s" for v in order),
                    file=sys.stderr)
    finally:
        control.close()
    out["per_round"] = per_round
    out["orders"] = orders
    return out


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--tasks", type=int, default=None,
                        help="tasks per variant per round (default 2500; smoke 60)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds (default 7; smoke 3)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured tasks per variant before round 1 "
                             "(default 300; smoke 20)")
    parser.add_argument("--concurrency", default="2",
                        help="prefork pool processes (default 2); a comma-separated "
                             "list (1,4,16) runs every count on a worker of its own, "
                             "one after the other, and writes "
                             f"results/{SCALING}.json by default")
    parser.add_argument("--variants", default=None,
                        help="comma-separated subset (plain task is always run)")
    args = parser.parse_args(argv)
    count = args.tasks or (60 if args.smoke else 2500)
    rounds = args.rounds or (3 if args.smoke else 7)
    warmup = args.warmup if args.warmup is not None else (20 if args.smoke else 300)
    try:
        concurrencies = [int(n) for n in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: not a list of integers: {args.concurrency!r}")
    if any(n < 1 for n in concurrencies):
        parser.error("--concurrency: every count must be at least 1")
    scaling = len(concurrencies) > 1

    results: dict[str, Any] = {"benchmark": SCALING if scaling else NAME,
                               "smoke": args.smoke, "rounds": rounds,
                               "tasks": count, "warmup": warmup,
                               "concurrency": concurrencies if scaling
                               else concurrencies[0]}
    prefix = f"{c.run_id()}-e2e"
    c.wait_quiet(args.wait_quiet)
    with c.redis_server(args.redis_url) as (url, server), \
            tempfile.TemporaryDirectory(prefix="dlock-e2e-") as log_dir:
        os.environ["DLOCK_E2E_REDIS_URL"] = url
        os.environ["DLOCK_E2E_PREFIX"] = prefix
        import e2e_app

        variants = dict(e2e_app.VARIANTS)
        if args.variants:
            wanted = {BASELINE, *args.variants.split(",")}
            unknown = wanted - set(variants)
            if unknown:
                parser.error(f"unknown variant(s) {sorted(unknown)}; "
                             f"choose from {list(variants)}")
            variants = {k: v for k, v in variants.items() if k in wanted}
        control = redis.Redis.from_url(url)
        results["machine"] = c.machine_info(control)
        c.print_machine(results["machine"])
        monitor = c.LoadMonitor(control)
        budget = c.RetryBudget(args)
        # Distinct arguments across variants, rounds and runs on a shared Redis.
        numbers = itertools.count(secrets.randbelow(1 << 30) << 22)
        runs = [run_workers(url, server, n, variants, count, rounds, warmup, numbers,
                            budget, prefix, e2e_app.app, e2e_app, log_dir)
                for n in concurrencies]
        # After the workers have exited: their CPU time counts as this process's
        # children.
        results["load"] = monitor.stop() | budget.as_dict()
        control.close()
    all_rows = []
    for run in runs:
        rows = summarise(run["per_round"])
        for row in rows:
            row["workers"] = run["concurrency"]
        all_rows += rows
        run["rows"] = rows
        run["targets"] = check_targets(rows)
        del run["per_round"]
    if scaling:
        results["runs"] = runs
        results["rows"] = all_rows
    else:
        run = runs[0]
        results["pool_children"] = run["pool_children"]
        results["rows"] = run["rows"]
        results["orders"] = run["orders"]
        results["targets"] = run["targets"]
    print(f"\n{TITLE}\n")
    for run in runs:
        print(f"{rounds} rounds x {count} tasks per variant, variants alternated (order "
              f"rotates per round); `celery worker --pool=prefork "
              f"-c {run['concurrency']}`, prefetch 64, results ignored; median over "
              "rounds. CPU columns: ms per task.\n")
        print(c.markdown_table(COLUMNS, run["rows"]))
        if run["targets"] and not args.smoke and not scaling:  # smoke: meaningless
            print()
            for t in run["targets"]:
                print(f"- {'met' if t['met'] else 'MISSED'}: {t['target']} "
                      f"({t['value']})")
        print()
    if scaling:
        print("#### tasks/s by pool processes (x plain)\n")
        names = list(dict.fromkeys(r["variant"] for r in all_rows))
        cols = [("variant", "variant", "")] + [
            (f"-c {run['concurrency']}", f"c{run['concurrency']}", "")
            for run in runs]
        table = []
        for name in names:
            row: dict[str, Any] = {"variant": name}
            for run in runs:
                r = next(x for x in run["rows"] if x["variant"] == name)
                row[f"c{run['concurrency']}"] = (f"{r['tasks_per_s']:,.0f} "
                                                 f"({r['ratio']:.2f}x)")
            table.append(row)
        print(c.markdown_table(cols, table))
    c.print_load(results["load"])
    c.write_json(c.json_path(args, SCALING if scaling else NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
