"""(e) Redis commands per hand-off with N waiters (N = 1, 4, 16).

N waiters means N + 1 processes on one key (one holds, N wait), each looping
``acquire -> hold 5 ms -> release`` as in (c).  Counted inside the window:

* ``Redis cmds``: every command the server ran, from ``INFO commandstats`` deltas (which,
  like ``total_commands_processed``, include the commands run inside Lua scripts);
* ``round trips``: the commands the clients sent (``EVALSHA``, ``BLPOP``, ``SET``...).

Both are divided by the hand-offs (the next hold going to another process) and by the
acquisitions.  For a lock whose waiters sleep until they are woken, the numbers do
not depend on N; for a polling lock they grow with N.

    python benchmarks/bench_waiters.py          # full run -> results/bench_waiters.json
    python benchmarks/bench_waiters.py --smoke  # 1 waiter, 0.3 s windows, no JSON
"""

from __future__ import annotations

import sys
from typing import Any

import _common as c
import _handoff as h

NAME = "bench_waiters"
TITLE = "### e. Redis commands per hand-off with N waiters"
COLUMNS = [
    ("variant", "variant", ""),
    ("waiters", "waiters", ""),
    ("hand-offs", "handoffs", ""),
    ("acquisitions", "acquisitions", ""),
    ("Redis cmds/hand-off", "redis_cmds_per_handoff", ".1f"),
    ("round trips/hand-off", "round_trips_per_handoff", ".2f"),
    ("Redis cmds/acquisition", "redis_cmds_per_acq", ".1f"),
    ("round trips/acquisition", "round_trips_per_acq", ".2f"),
    ("top commands per hand-off", "top_commands", ""),
]


def top_commands(per_handoff: dict[str, float], n: int = 4) -> str:
    top = sorted(per_handoff.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.1f}" for k, v in top)


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--waiters", default=None,
                        help="comma-separated waiter counts (default 1,4,16; smoke 1)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds per window (default 4; smoke 0.3)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per waiter count (default 2; smoke 1)")
    parser.add_argument("--hold", type=float, default=0.005,
                        help="seconds each hold lasts (default 0.005)")
    parser.add_argument("--variants", default=",".join(h.VARIANTS),
                        help="comma-separated subset of: " + ", ".join(h.VARIANTS))
    args = parser.parse_args(argv)
    waiters = [int(n) for n in
               (args.waiters or ("1" if args.smoke else "1,4,16")).split(",")]
    duration = args.duration or (0.3 if args.smoke else 4.0)
    rounds = args.rounds or (1 if args.smoke else 2)
    variants = args.variants.split(",")
    for v in variants:
        if v not in h.VARIANTS:
            parser.error(f"unknown variant {v!r}")

    results: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke,
                               "duration": duration, "rounds": rounds,
                               "hold": args.hold}
    c.wait_quiet(args.wait_quiet)
    with c.redis_server(args.redis_url) as (url, _server):
        info_client = c.counting_client(url)
        results["machine"] = c.machine_info(info_client)
        c.print_machine(results["machine"])
        monitor = c.LoadMonitor(info_client)
        budget = c.RetryBudget(args)
        rows = h.run_matrix(url, variants, [n + 1 for n in waiters], rounds, duration,
                            args.hold, budget)
        results["load"] = monitor.stop() | budget.as_dict()
        info_client.close()
    for row in rows:
        row["waiters"] = row["procs"] - 1
        row["top_commands"] = top_commands(row["commands_per_handoff"])
    rows.sort(key=lambda r: (variants.index(r["variant"]), r["waiters"]))
    results["rows"] = rows
    print(f"\n{TITLE}\n")
    print(f"hold {args.hold * 1000:g} ms, {rounds} round(s) x {duration:g} s per "
          "variant and N, variants interleaved; totals over the rounds.\n")
    print(c.markdown_table(COLUMNS, rows))
    c.print_load(results["load"])
    c.write_json(c.json_path(args, NAME), results)
    return 1 if any(r["overlaps"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
