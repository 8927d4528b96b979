"""(k) The operators' page (``celery dlock web``) with many locks held: time to serve a
page of the held locks, and the Redis commands it sends.

N locks (distinct names, metadata as a ``LockedTask`` stores it) are taken with one
``RedisLock`` each (no renewal); then each page is asked of the WSGI application
(``celery_dlock.ops.web.make_app``, no HTTP server: the page's own cost) ``--rounds``
times: the first page of the list, the last page, a name filter, the summary and one
lock's page, each reading the holds itself (the time, and this process's CPU time,
which a busy machine disturbs less); then the first page again within the
second another page read them (the app shares one read per second, see
``celery_dlock.ops.web.snapshot``).  Reported: the median and the worst time of a
request, and the Redis commands one request ran (counted by the server, ``INFO
commandstats``).  The list is read as ``ls`` reads it: ``SCAN`` pages, each page's
holds read in one pipelined round trip, so the commands grow with the locks and the
round trips by the page.

    python benchmarks/bench_web.py          # 10,000 locks -> results/bench_web.json
    python benchmarks/bench_web.py --smoke  # 200 locks, no JSON
"""

from __future__ import annotations

import io
import statistics
import sys
import time
import uuid
from typing import Any
from wsgiref.util import setup_testing_defaults

import _common as c
import redis
from celery import Celery

from celery_dlock import RedisLock
from celery_dlock.ops.web import make_app
from celery_dlock.ops.web.html import query

NAME = "bench_web"
TITLE = "### k. The web page with many locks held"
COLUMNS = [
    ("page", "page", ""),
    ("locks", "locks", ",d"),
    ("median ms", "median_ms", ".1f"),
    ("max ms", "max_ms", ".1f"),
    ("CPU ms", "cpu_ms", ".1f"),
    ("Redis commands/request", "commands", ",.0f"),
    ("bytes", "bytes", ",d"),
]


def _request(app: Any, path: str, qs: str = "") -> tuple[str, int]:
    environ: dict[str, Any] = {}
    setup_testing_defaults(environ)
    environ.update(PATH_INFO=path, QUERY_STRING=qs, **{"wsgi.input": io.BytesIO()})
    seen: dict[str, str] = {}

    def start_response(status: str, headers: Any) -> None:
        seen["status"] = status

    size = sum(len(part) for part in app(environ, start_response))
    return seen["status"], size


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--locks", type=int, default=None,
                        help="locks held (default 10000; smoke 200)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="requests of each page (default 5; smoke 2)")
    args = parser.parse_args(argv)
    count = args.locks or (200 if args.smoke else 10_000)
    rounds = args.rounds or (2 if args.smoke else 5)
    results: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke}
    rows: list[dict[str, Any]] = []
    c.wait_quiet(args.wait_quiet)
    with c.redis_server(args.redis_url) as (url, _server):
        client = redis.Redis.from_url(url)
        results["machine"] = c.machine_info(client)
        c.print_machine(results["machine"])
        prefix = f"bw{uuid.uuid4().hex[:8]}"
        locks = []
        for i in range(count):
            lock = RedisLock(client, f"report:{i:06d}", ttl=600, auto_renew=False,
                             prefix=prefix, owner=f"owner-{i}",
                             info={"task_name": "bench.report",
                                   "task_id": str(uuid.uuid4()),
                                   "worker": f"celery@bench-{i % 8}"})
            lock.acquire(blocking=False)
            locks.append(lock)
        app = Celery("bench_web", set_as_current=False)
        app.conf.update(dlock_url=url, broker_url="memory://")
        web = make_app(app, prefix=prefix)
        last = max(1, -(-count // 100))
        pages = {
            "locks, first page": ("/locks", ""),
            "locks, last page": ("/locks", f"page={last}"),
            "locks, name filter": ("/locks", query(name="report:0001")),
            "summary": ("/summary", ""),
            "one lock": ("/lock", query(name="report:000007")),
            "locks, first page, holds read this second": ("/locks", ""),
        }
        monitor = c.LoadMonitor(client)
        for page, (path, qs) in pages.items():
            _request(web, path, qs)  # warm
            times, cpu = [], []
            before = c.command_calls(client)
            for _ in range(rounds):
                if "read this second" not in page:
                    web.snapshot.forget()  # each request reads the holds itself
                start, start_cpu = time.perf_counter(), time.process_time()
                status, size = _request(web, path, qs)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
                assert status.startswith("200"), (page, status)
            commands = c.total_calls(c.calls_delta(before, c.command_calls(client)))
            rows.append({"page": page, "locks": count,
                         "median_ms": statistics.median(times) * 1000,
                         "max_ms": max(times) * 1000,
                         "cpu_ms": statistics.median(cpu) * 1000,
                         "commands": commands / rounds, "bytes": size})
        results["load"] = monitor.stop()
        web.target.close()
        for lock in locks:
            lock.release()
        client.close()
    results["rows"] = rows
    print(f"\n{TITLE}\n")
    print("One WSGI request per page, no HTTP server; commands counted by the server "
          "(INFO commandstats; pipelined ones each count).\n")
    print(c.markdown_table(COLUMNS, rows))
    c.print_load(results["load"])
    c.write_json(c.json_path(args, NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
