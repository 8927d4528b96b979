"""(f) Enqueue cost of the uniqueness modes: sends per second, per ``lock_mode``.

One producer (this process) sends with ``task.apply_async((n,))`` in a loop to a Redis
broker that is also the lock store (the embedded redis-server, or ``--redis-url``); no
worker runs, so every message stays queued (the queue is emptied between batches, out
of the timed window).  Variants:

* ``plain Task``                        ``@app.task``: what a send costs without locks
* ``LockedTask while_running``          the default mode: no enqueue-time check
* ``LockedTask until_started``          and the other modes: one claim script per
* ``LockedTask until_finished``         send (a queue marker), each send a fresh lock
* ``LockedTask queued_and_running``     name, so every send is accepted
* ``LockedTask throttle``
* ``duplicate until_started, return_existing``   the same lock name every send, its
* ``duplicate until_started, drop``              marker already there: every send is
                                                  a duplicate (nothing is queued)

Each round runs every variant for ``--sends`` sends after a short warm-up, the order
rotated from round to round; the table gives medians over ``--rounds`` rounds, and
``x plain`` is the median of the per-round ratios of time per send to the plain
task's in the same round.  Client CPU from ``time.process_time()``; Redis commands
(those run inside scripts included) and ``EVALSHA`` calls from ``INFO commandstats``.
No result backend is configured (as in bench_e2e): with one, a duplicate with
``return_existing`` also reads the queued call's state (one ``GET``), to tell a call
that ended or was revoked from one still queued.

    python benchmarks/bench_send.py          # full run -> results/bench_send.json
    python benchmarks/bench_send.py --smoke  # a few sends, no JSON
"""

from __future__ import annotations

import itertools
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import _common as c
import redis
from celery import Celery

from celery_dlock import LockedTask

NAME = "bench_send"
TITLE = "### f. Enqueue cost of the uniqueness modes: sends per second"
COLUMNS = [
    ("variant", "variant", ""),
    ("sends/s", "sends_per_s", ",.0f"),
    ("us/send", "us_per_send", ".1f"),
    ("x plain", "ratio", ".3f"),
    ("client CPU us/send", "client_cpu_us", ".1f"),
    ("server us/send", "server_us", ".1f"),
    ("Redis cmds/send", "redis_cmds", ".2f"),
    ("EVALSHA/send", "evalsha", ".2f"),
]
MODES = ("until_started", "until_finished", "queued_and_running", "throttle")
BASELINE = "plain Task"


def make_app(url: str, prefix: str) -> Celery:
    app = Celery("bench_send", broker=url, set_as_current=False)
    app.conf.update(task_default_queue=f"{prefix}-q", dlock_key_prefix=prefix,
                    task_ignore_result=True, broker_connection_retry_on_startup=True)
    return app


def make_variants(app: Celery, numbers: Iterator[int]) -> dict[str, Callable[[], Any]]:
    @app.task(name="bench_send.plain", shared=False)
    def plain(n: int) -> None:  # never runs: no worker
        return None

    variants: dict[str, Callable[[], Any]] = {
        BASELINE: lambda: plain.apply_async((next(numbers),))}
    for mode in ("while_running", *MODES):
        task = app.task(base=LockedTask, bind=True, name=f"bench_send.{mode}",
                        lock_key="send:{n}", lock_mode=mode, shared=False)(_body)
        variants[f"LockedTask {mode}"] = _sender(task, numbers)
    for policy in ("return_existing", "drop"):
        task = app.task(base=LockedTask, bind=True, name=f"bench_send.dup_{policy}",
                        lock_key="send:{n}", lock_mode="until_started",
                        on_duplicate=policy, shared=False)(_body)
        same = next(numbers)
        task.apply_async((same,))  # the queued call every later send duplicates
        variants[f"duplicate until_started, {policy}"] = _sender(
            task, itertools.repeat(same))
    return variants


def _body(self: Any, n: int) -> None:  # never runs: no worker
    return None


def _sender(task: Any, numbers: Iterator[int]) -> Callable[[], Any]:
    def send() -> Any:
        return task.apply_async((next(numbers),))

    return send


def measure(fn: Callable[[], Any], control: redis.Redis, queue: str, sends: int,
            warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    control.delete(queue)
    before = c.command_calls(control)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(sends):
        fn()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    delta = c.calls_delta(before, c.command_calls(control))
    control.delete(queue)
    return {
        "us_per_send": wall / sends * 1e6,
        "client_cpu_us": cpu / sends * 1e6,
        "server_us": c.total_usec(delta) / sends,
        "redis_cmds": c.total_calls(delta) / sends,
        "evalsha": delta.get("evalsha", {}).get("calls", 0) / sends,
    }


def run(variants: dict[str, Callable[[], Any]], control: redis.Redis, queue: str,
        rounds: int, sends: int, warmup: int,
        budget: c.RetryBudget) -> list[dict[str, Any]]:
    names = list(variants)
    per_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    r = 0
    while r < rounds:
        order = names[r % len(names):] + names[:r % len(names)]
        monitor = c.LoadMonitor(control)
        this_round = {name: measure(variants[name], control, queue, sends, warmup)
                      for name in order}
        if not budget.keep(monitor.stop(), f"round {r + 1}"):
            continue
        for name in names:
            per_round[name].append(this_round[name])
        r += 1
    rows = []
    for name in names:
        samples = per_round[name]
        ratios = [s["us_per_send"] / p["us_per_send"]
                  for s, p in zip(samples, per_round[BASELINE], strict=True)]
        us = statistics.median(s["us_per_send"] for s in samples)
        row: dict[str, Any] = {"variant": name, "us_per_send": us,
                               "sends_per_s": 1e6 / us,
                               "ratio": statistics.median(ratios),
                               "rounds_us_per_send": [s["us_per_send"] for s in samples]}
        for key in ("client_cpu_us", "server_us", "redis_cmds", "evalsha"):
            row[key] = statistics.median(s[key] for s in samples)
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
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.smoke else 7)
    sends = args.sends or (30 if args.smoke else 2000)
    warmup = 5 if args.smoke else 200

    results: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke, "rounds": rounds,
                               "sends": sends, "warmup": warmup}
    prefix = f"{c.run_id()}-send"
    c.wait_quiet(args.wait_quiet)
    with c.redis_server(args.redis_url) as (url, _server):
        control = redis.Redis.from_url(url)
        results["machine"] = c.machine_info(control)
        c.print_machine(results["machine"])
        app = make_app(url, prefix)
        numbers = itertools.count(secrets.randbelow(1 << 30) << 22)
        monitor = c.LoadMonitor(control)
        budget = c.RetryBudget(args)
        try:
            variants = make_variants(app, numbers)
            print(f"\n{TITLE}\n")
            print(f"{rounds} rounds x {sends} sends per variant, variants interleaved; "
                  "median over rounds.\n")
            rows = run(variants, control, f"{prefix}-q", rounds, sends, warmup, budget)
            results["rows"] = rows
            print(c.markdown_table(COLUMNS, rows))
        finally:
            app.close()
            cleanup(control, prefix)
        results["load"] = monitor.stop() | budget.as_dict()
        c.print_load(results["load"])
        control.close()
    c.write_json(c.json_path(args, NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
