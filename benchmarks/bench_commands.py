"""(l) Redis commands per locked task, per ``lock_mode``: the lock's whole lifecycle.

Two throwaway redis-servers: one is the broker, the other holds the locks and nothing
else (the ``dlock_url`` of the ``LockedTask`` variants, celery-once's ``ONCE`` backend
url, celery-singleton's ``singleton_backend_url``), so what that second server counts
in ``INFO commandstats`` is lock work only.  One ``celery worker --pool=prefork -c 1``
subprocess on ``e2e_app.py`` (results ignored) runs, variant after variant, ``--tasks``
tasks whose body is one ``INCR`` of a counter on the broker, every call with distinct
arguments (nothing contends, no duplicate):

* ``plain task``                          ``@app.task``: no lock (0 on the lock store)
* ``LockedTask <mode>``                   ``base=LockedTask, lock_mode=<mode>``, hashed
                                          arguments, for each of the five modes
                                          (``throttle``: its window is ``lock_ttl``,
                                          30 s by default)
* ``LockedTask while_running, lock_limit=2``  a semaphore of two slots
* ``celery-once QueueOnce``               ``SET NX`` at enqueue, ``DEL`` after the run
* ``celery-singleton Singleton``          the same, its own way

A variant's window covers its whole lifecycle: every send (the producer's claim of a
queue marker), every run (lock, marker hand-over, release) and ~1 s after the last
body (``--settle``: a release's last calls land after the body that ended the batch).
A short unmeasured warm-up per variant comes first (connections, scripts loaded).
Per task, on the lock store: all commands (those run inside Lua scripts included),
the ``EVALSHA``/``EVAL`` calls, the commands run inside scripts, the plain commands
(sent by a client, not a script call), and the most frequent commands.  The split
between commands run by scripts and by clients is read from a ``MONITOR`` of the lock
store during the window (Lua's commands show as the ``lua`` client); the totals from
``INFO commandstats``, which the ``MONITOR`` count is checked against.  The broker's
commands per task are given beside (kombu's publish and fetch, the body's ``INCR``,
the benchmark's waits); being a polling loop's, they vary with wall time, while the
lock store's counts are exact and repeat, so one round is enough.  After the window,
the lock store's keys new since its start are counted by kind (fence counters,
markers left...), and those without an expiry are counted apart.

    python benchmarks/bench_commands.py          # full run -> results/bench_commands.json
    python benchmarks/bench_commands.py --smoke  # 20 tasks per variant, no JSON
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import _common as c
import bench_e2e as e2e
import psutil
import redis

from celery_dlock.ops.embedded import EmbeddedRedis

NAME = "bench_commands"
TITLE = "### l. Redis commands per locked task, per lock_mode"
COLUMNS = [
    ("variant", "variant", ""),
    ("lock store cmds/task", "lock_cmds", ".2f"),
    ("EVALSHA+EVAL/task", "script_calls", ".2f"),
    ("in scripts/task", "in_scripts", ".2f"),
    ("plain cmds/task", "plain_cmds", ".2f"),
    ("top commands/task (lock store)", "top", ""),
    ("broker cmds/task", "broker_cmds", ".2f"),
    ("lock store keys left/task", "keys_left", ".2f"),
]
#: The columns of the instruction counts that ``bench_instructions.py`` (j) keeps for
#: the variants it shares with this table.
INSTR_COLUMNS = [
    ("variant", "variant", ""),
    ("(j) variant", "j_variant", ""),
    ("send client instr", "send_client", ",.0f"),
    ("send server instr", "send_server", ",.0f"),
    ("run client instr", "run_client", ",.0f"),
    ("run server instr", "run_server", ",.0f"),
    ("added instr/task", "added", ",.0f"),
]
#: This table's variant -> (j)'s ``tasks`` row of the same declaration.
J_VARIANTS = {
    "plain task": "plain task",
    "LockedTask while_running": "LockedTask (hashed args)",
    "celery-once QueueOnce": "celery-once QueueOnce",
    "celery-singleton Singleton": "celery-singleton Singleton",
}
PEERS = ("celery-once QueueOnce", "celery-singleton Singleton")
BASELINE = "plain task"
TOP = 6


# -- the lock store's commands, by who ran them ----------------------------------------


class Monitor:
    """A ``MONITOR`` of a Redis server in a thread: every command it runs, with who ran
    it (``lua`` for a script's commands).  :meth:`window` gives the commands between
    two commands of one connection of ours (its ``INFO commandstats`` snapshots), so
    the count covers exactly what ``INFO commandstats`` does."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.entries: list[tuple[str, str, str]] = []  # (client, port, command)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("MONITOR did not start")

    def _run(self) -> None:
        try:
            with self.client.monitor() as monitor:
                self._ready.set()
                for entry in monitor.listen():
                    command = str(entry.get("command", ""))
                    item = (str(entry.get("client_type", "")),
                            str(entry.get("client_port", "")), command)
                    with self._cond:
                        self.entries.append(item)
                        self._cond.notify_all()
        except Exception as exc:  # the connection closed, or broke: window() says so
            self._error = exc
            self._ready.set()
            with self._cond:
                self._cond.notify_all()

    def mark(self) -> int:
        """How many commands it has seen so far."""
        with self._cond:
            return len(self.entries)

    def window(self, port: str, start: int, timeout: float = 10.0
               ) -> list[tuple[str, str]] | None:
        """``(client, COMMAND)`` of each command run after the first and before the
        second ``INFO`` that connection ``port`` ran from ``start`` on (None when they
        did not show within ``timeout``)."""
        deadline = time.monotonic() + timeout

        def infos() -> list[int]:
            return [i for i in range(start, len(self.entries))
                    if self.entries[i][1] == port
                    and self.entries[i][2].lower().startswith("info")]

        with self._cond:
            while len(found := infos()) < 2:
                left = deadline - time.monotonic()
                if left <= 0 or self._error is not None:
                    return None
                self._cond.wait(left)
            first, second = found[:2]
            return [(kind, command.split(" ", 1)[0].upper())
                    for kind, _, command in self.entries[first + 1:second]]

    def close(self) -> None:
        self.client.close()  # the thread ends with its connection (a daemon anyway)


def client_port(client: redis.Redis) -> str:
    """The local port of ``client``'s connection (a client of one connection)."""
    info = client.client_info()
    return str(info["addr"]).rsplit(":", 1)[1]


# -- keys left behind --------------------------------------------------------------------

_TAIL = re.compile(r"^(:h:|:r:|:w:)")


def key_kind(key: str) -> str:
    """What a key of the lock store is: a lock's hash, the suffix of a helper key
    (``:fence``, ``:m`` a queue marker...), or a peer's lock."""
    if key.startswith("qo_"):
        return "celery-once lock"
    if ":singleton:" in key:
        return "celery-singleton lock"
    if "}" not in key:
        return "other"
    tail = key.rsplit("}", 1)[1]
    if not tail:
        return "lock"
    tail_kind = _TAIL.match(tail)
    return tail_kind.group(1) + "*" if tail_kind else tail


def all_keys(client: redis.Redis) -> set[bytes]:
    return set(client.scan_iter(count=1000))


def left_keys(client: redis.Redis, before: set[bytes]) -> dict[str, Any]:
    """The keys new since ``before``, counted by kind, those without an expiry, and
    the shortest and longest time (s) the others have left, by kind."""
    new = sorted(all_keys(client) - before)
    kinds: Counter[str] = Counter()
    no_expiry: Counter[str] = Counter()
    ttls: dict[str, list[float]] = {}
    for key, ttl in zip(new, _ttls(client, new), strict=True):
        kind = key_kind(key.decode(errors="replace"))
        kinds[kind] += 1
        if ttl == -1:
            no_expiry[kind] += 1
        elif ttl >= 0:
            ttls.setdefault(kind, []).append(ttl / 1000)
    return {"count": len(new), "by_kind": dict(kinds), "no_expiry": dict(no_expiry),
            "ttl_s": {k: [round(min(v), 1), round(max(v), 1)]
                      for k, v in ttls.items()}}


def _ttls(client: redis.Redis, keys: list[bytes]) -> list[int]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    return [int(t) for t in pipe.execute()] if keys else []


# -- one variant -------------------------------------------------------------------------


def per_task(delta: dict[str, dict[str, int]], count: int) -> dict[str, float]:
    return {name.upper(): v["calls"] / count
            for name, v in sorted(delta.items(), key=lambda kv: -kv[1]["calls"])}


def top_commands(by_name: dict[str, float], n: int = TOP) -> str:
    items = sorted(by_name.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ", ".join(f"{name} {value:.1f}" for name, value in items[:n])
    return shown + (", ..." if len(items) > n else "")


def run_variant(task: Any, count: int, warmup: int, settle: float,
                numbers: itertools.count[int], broker: redis.Redis,
                lock: redis.Redis, lock_port: str, monitor: Monitor | None,
                worker: tuple[Any, Any], e2e_app: Any) -> dict[str, Any]:
    proc, log = worker

    def batch(n: int) -> None:
        broker.delete(e2e_app.MARKER)
        broker.set(e2e_app.COUNTER, e2e_app.DONE_AT - n)
        for i in itertools.islice(numbers, n):
            task.apply_async((i,))
        e2e.wait_done(task.name, n, broker, proc, log, e2e_app.COUNTER,
                      e2e_app.MARKER, e2e_app.DONE_AT)

    if warmup:  # connections, scripts loaded: not counted
        batch(warmup)
        time.sleep(settle)
    keys_before = all_keys(lock)
    broker.delete(e2e_app.MARKER)
    broker.set(e2e_app.COUNTER, e2e_app.DONE_AT - count)
    mark = monitor.mark() if monitor else 0
    lock0 = c.command_calls(lock)
    broker0 = c.command_calls(broker)
    t0 = time.perf_counter()
    for i in itertools.islice(numbers, count):
        task.apply_async((i,))
    e2e.wait_done(task.name, count, broker, proc, log, e2e_app.COUNTER,
                  e2e_app.MARKER, e2e_app.DONE_AT)
    ran = time.perf_counter() - t0
    time.sleep(settle)
    lock_delta = c.calls_delta(lock0, c.command_calls(lock))
    broker_delta = c.calls_delta(broker0, c.command_calls(broker))
    wall = time.perf_counter() - t0
    done = int(broker.get(e2e_app.COUNTER) or 0)
    if done != e2e_app.DONE_AT:
        raise RuntimeError(f"{task.name}: {done - e2e_app.DONE_AT:+d} tasks ran beyond "
                           f"the {count} sent")
    by_name = per_task(lock_delta, count)
    scripts = float(sum(v for k, v in by_name.items()
                        if k.startswith(("EVAL", "FCALL"))))
    total = c.total_calls(lock_delta) / count
    row: dict[str, Any] = {
        "lock_cmds": total,
        "script_calls": scripts,
        "top": top_commands(by_name) if by_name else "-",
        "lock_cmds_by_name": by_name,
        "broker_cmds": c.total_calls(broker_delta) / count,
        "broker_cmds_by_name": per_task(broker_delta, count),
        "run_s": ran,
        "window_s": wall,
        "in_scripts": None,
        "plain_cmds": None,
        "monitor": None,
    }
    seen = monitor.window(lock_port, mark) if monitor else None
    if seen is not None:
        by_whom = Counter(kind == "lua" for kind, _ in seen)
        in_scripts = by_whom[True] / count
        client_calls = Counter(name for kind, name in seen if kind != "lua")
        row["in_scripts"] = in_scripts
        row["plain_cmds"] = sum(v for k, v in client_calls.items()
                                if not k.startswith(("EVAL", "FCALL"))) / count
        row["plain_cmds_by_name"] = {
            k: v / count for k, v in client_calls.most_common()
            if not k.startswith(("EVAL", "FCALL"))}
        row["in_scripts_by_name"] = {
            k: v / count for k, v in Counter(
                name for kind, name in seen if kind == "lua").most_common()}
        # MONITOR leaves out no command a lock sends; a gap would show here.
        row["monitor"] = {"commands": len(seen),
                          "agrees_with_commandstats":
                              len(seen) == c.total_calls(lock_delta)}
    left = left_keys(lock, keys_before)
    row["keys_left"] = left["count"] / count
    row["keys_left_by_kind"] = {k: v / count for k, v in left["by_kind"].items()}
    row["keys_left_no_expiry"] = left["no_expiry"]
    row["keys_left_ttl_s"] = left["ttl_s"]
    return row


def idle_window(lock: redis.Redis, seconds: float) -> dict[str, int]:
    """What the lock store runs while the worker is idle (its background work)."""
    before = c.command_calls(lock)
    time.sleep(seconds)
    delta = c.calls_delta(before, c.command_calls(lock))
    return {k: v["calls"] for k, v in delta.items()}


def ours_cpu(worker_pid: int, lock_pid: int | None) -> Callable[[], float]:
    """CPU seconds used so far by the worker (its pool child included) and the lock
    store: this benchmark's, not other work on the machine (``LoadMonitor``)."""
    def procs() -> list[psutil.Process]:
        worker = psutil.Process(worker_pid)
        out = [worker, *worker.children(recursive=True)]
        return out + ([psutil.Process(lock_pid)] if lock_pid else [])

    return lambda: sum(e2e.group_seconds(procs).values())


# -- (j)'s instruction counts ------------------------------------------------------------


def instruction_rows(rows: list[dict[str, Any]], path: Path
                     ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(j)'s send and run instruction counts of the variants it shares with this
    table, from a ``bench_instructions.py`` result file, and where they come from
    (its file, source revision and redis-py version)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], {"file": str(path), "found": False}
    machine = data.get("machine") or {}
    origin = {"file": os.path.relpath(path, c.HERE), "found": True,
              "source": machine.get("source"),
              "redis": (machine.get("packages") or {}).get("redis")}
    tasks = {r["variant"]: r for r in data.get("tasks", [])}
    out = []
    for row in rows:
        j = tasks.get(J_VARIANTS.get(row["variant"], ""))
        if j is None:
            continue
        out.append({"variant": row["variant"], "j_variant": j["variant"],
                    **{k: j.get(k) for k in ("send_client", "send_server",
                                             "run_client", "run_server", "added")}})
    return out, origin


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--lock-url", default=None,
                        help="the lock store: a Redis that serves nothing else while "
                             "this runs (its INFO commandstats is read); default a "
                             "throwaway redis-server. --redis-url is the broker")
    parser.add_argument("--tasks", type=int, default=None,
                        help="measured tasks per variant (default 300; smoke 20)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured tasks per variant first (default 20; "
                             "smoke 3)")
    parser.add_argument("--settle", type=float, default=None,
                        help="seconds counted after the last body ends (default 1; "
                             "smoke 0.5)")
    parser.add_argument("--no-monitor", action="store_true",
                        help="no MONITOR of the lock store: no split between "
                             "commands run by scripts and by clients")
    parser.add_argument("--instructions", metavar="PATH",
                        default=str(c.RESULTS / "bench_instructions.json"),
                        help="a bench_instructions.py result file whose instruction "
                             "counts per task are printed beside (default: "
                             "results/bench_instructions.json)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated subset of the variants")
    args = parser.parse_args(argv)
    count = args.tasks or (20 if args.smoke else 300)
    warmup = args.warmup if args.warmup is not None else (3 if args.smoke else 20)
    settle = args.settle if args.settle is not None else (0.5 if args.smoke else 1.0)
    if args.lock_url and args.lock_url == args.redis_url:
        parser.error("--lock-url must be a server apart from the broker (--redis-url)")

    results: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke, "tasks": count,
                               "warmup": warmup, "settle_s": settle, "concurrency": 1}
    prefix = f"{c.run_id()}-cmds"
    c.wait_quiet(args.wait_quiet)
    with ExitStack() as stack:
        broker_url, _ = stack.enter_context(c.redis_server(args.redis_url))
        lock_server = None if args.lock_url else stack.enter_context(EmbeddedRedis())
        lock_url = args.lock_url or lock_server.url  # type: ignore[union-attr]
        log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="dlock-cmds-"))
        os.environ["DLOCK_E2E_REDIS_URL"] = broker_url
        os.environ["DLOCK_E2E_PREFIX"] = prefix
        os.environ["DLOCK_E2E_LOCK_URL"] = lock_url
        os.environ["DLOCK_E2E_PEER_LOCK_URL"] = lock_url
        os.environ["DLOCK_E2E_MODES"] = "1"  # e2e_app declares MODE_VARIANTS
        import e2e_app

        variants: dict[str, Any] = {
            BASELINE: e2e_app.plain, **e2e_app.MODE_VARIANTS,
            **{name: e2e_app.VARIANTS[name] for name in PEERS}}
        if args.variants:
            wanted = args.variants.split(",")
            unknown = set(wanted) - set(variants)
            if unknown:
                parser.error(f"unknown variant(s) {sorted(unknown)}; "
                             f"choose from {list(variants)}")
            variants = {k: v for k, v in variants.items() if k in wanted}
        broker = redis.Redis.from_url(broker_url)
        # One connection: its INFO calls are the window's bounds in the MONITOR.
        lock = redis.Redis.from_url(lock_url, single_connection_client=True)
        stack.callback(broker.close)
        stack.callback(lock.close)
        results["machine"] = c.machine_info(lock)
        results["machine"]["broker_redis_server"] = c.machine_info(broker)[
            "redis_server"]
        c.print_machine(results["machine"])
        monitor = None if args.no_monitor else Monitor(lock_url)
        if monitor:
            stack.callback(monitor.close)
        lock_port = client_port(lock)
        lock_pid = e2e.local_redis_pid(lock, lock_server)
        numbers = itertools.count(secrets.randbelow(1 << 30) << 22)
        env = {"DLOCK_E2E_LOCK_URL": lock_url, "DLOCK_E2E_PEER_LOCK_URL": lock_url,
               "DLOCK_E2E_MODES": "1"}
        rows = []
        with e2e.worker(broker_url, prefix, 1, log_dir, env=env) as (proc, name, log):
            e2e.wait_ready(e2e_app.app, name, proc, log)
            load = c.LoadMonitor(broker, ours=ours_cpu(proc.pid, lock_pid))
            for variant, task in variants.items():
                row = {"variant": variant, "task": task.name} | run_variant(
                    task, count, warmup, settle, numbers, broker, lock, lock_port,
                    monitor, (proc, log), e2e_app)
                rows.append(row)
                print(f"{variant}: {row['lock_cmds']:.2f} lock store cmds/task",
                      file=sys.stderr)
            idle_s = 2 * settle
            results["idle_lock_cmds"] = idle_window(lock, idle_s)
            results["idle_s"] = idle_s
            results["load"] = load.stop()
        results["rows"] = rows
        j_rows, j_origin = instruction_rows(rows, Path(args.instructions))
        results["instructions_j"] = j_origin | {"rows": j_rows}

    print(f"\n{TITLE}\n")
    print(f"{count} tasks per variant (after {warmup} unmeasured), distinct arguments; "
          "`celery worker --pool=prefork -c 1`; the lock store is a redis-server of "
          f"its own; each window: the sends, the runs and {settle:g} s after the last "
          "body. Per task; commands inside Lua scripts counted.\n")
    print(c.markdown_table(COLUMNS, rows))
    idle = results["idle_lock_cmds"]
    print(f"\nlock store commands while the worker sat idle for {results['idle_s']:g} "
          f"s: {sum(idle.values())}" + (f" ({idle})" if idle else ""))
    odd = [r["variant"] for r in rows
           if r.get("monitor") and not r["monitor"]["agrees_with_commandstats"]]
    if odd:
        print(f"WARNING: MONITOR and INFO commandstats disagree for {odd}")
    left_no_expiry = {r["variant"]: r["keys_left_no_expiry"] for r in rows
                      if r["keys_left_no_expiry"]}
    print("keys left without an expiry: "
          + (json.dumps(left_no_expiry) if left_no_expiry else "none"))
    for r in rows:
        if r["keys_left_by_kind"]:
            ttl = r["keys_left_ttl_s"]
            print(f"  keys left per task, {r['variant']}: " + ", ".join(
                f"{k} {v:.2f}" + (f" ({ttl[k][0]:g}-{ttl[k][1]:g} s left)"
                                  if k in ttl else "")
                for k, v in sorted(r["keys_left_by_kind"].items())))
    if j_rows:
        print(f"\nInstructions per task from (j), bench_instructions.py "
              f"({j_origin['file']}: celery-dlock at {j_origin['source']}, redis-py "
              f"{j_origin['redis']}): client and server, send and run, counted under "
              "callgrind; added = beyond the plain task.\n")
        print(c.markdown_table(INSTR_COLUMNS, j_rows))
    c.print_load(results["load"])
    c.write_json(c.json_path(args, NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
