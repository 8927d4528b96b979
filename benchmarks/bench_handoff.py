"""(c) Hand-off under contention: P processes, one key, acquire -> hold 5 ms -> release.

For P = 4 and 16 and each variant (celery_dlock's FIFO doorbells, redis-py ``Lock``
polling every 0.1 s and every 0.001 s, python-redis-lock's shared signal list), every
process loops for ``--duration`` seconds; rounds interleave the variants.  The table
gives hand-offs/s (a hand-off is the next hold going to *another* process), the delay
from a release to the next acquire in another process (p50, p90, p99, pooled over the
rounds), fairness (min/max acquisitions per process, median over rounds) and the share
of acquisitions that were hand-offs (the rest: the releasing process took the lock
straight back).  ``overlaps`` counts holds that began before the previous one ended:
it must be 0.  See ``_handoff.py`` for the exact definitions.

    python benchmarks/bench_handoff.py          # full run -> results/bench_handoff.json
    python benchmarks/bench_handoff.py --smoke  # 2 processes, 0.3 s windows, no JSON
"""

from __future__ import annotations

import sys
from typing import Any

import _common as c
import _handoff as h

NAME = "bench_handoff"
TITLE = "### c. Hand-off under contention: acquire -> hold -> release on one key"
COLUMNS = [
    ("variant", "variant", ""),
    ("P", "procs", ""),
    ("hand-offs", "handoffs", ""),
    ("hand-offs/s", "handoffs_per_s", ".1f"),
    ("acquisitions/s", "acq_per_s", ".1f"),
    ("p50 ms", "p50_ms", ".3f"),
    ("p90 ms", "p90_ms", ".3f"),
    ("p99 ms", "p99_ms", ".3f"),
    ("fairness", "fairness", ".2f"),
    ("hand-off share", "handoff_share", ".2f"),
    ("overlaps", "overlaps", ""),
]
BREAKDOWN_TITLE = "#### celery_dlock hand-off, split at the waiter's doorbell"
BREAKDOWN_COLUMNS = [
    ("variant", "variant", ""),
    ("P", "procs", ""),
    ("hand-offs split", "breakdown_handoffs", ""),
    ("release -> woken p50 ms", "woken_p50_ms", ".3f"),
    ("p99 ms", "woken_p99_ms", ".3f"),
    ("woken -> acquired p50 ms", "after_wake_p50_ms", ".3f"),
    ("p99 ms", "after_wake_p99_ms", ".3f"),
]


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--procs", default=None,
                        help="comma-separated process counts (default 4,16; smoke 2)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds per window (default 4; smoke 0.3)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per process count (default 3; smoke 1)")
    parser.add_argument("--hold", type=float, default=0.005,
                        help="seconds each hold lasts (default 0.005)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also split celery_dlock's hand-offs at the moment the "
                             "waiter's doorbell rang (wraps its BLPOP wait)")
    parser.add_argument("--variants", default=",".join(h.VARIANTS),
                        help="comma-separated subset of: " + ", ".join(h.VARIANTS))
    args = parser.parse_args(argv)
    procs = [int(p) for p in (args.procs or ("2" if args.smoke else "4,16")).split(",")]
    duration = args.duration or (0.3 if args.smoke else 4.0)
    rounds = args.rounds or (1 if args.smoke else 3)
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
        rows = h.run_matrix(url, variants, procs, rounds, duration, args.hold, budget,
                            breakdown=args.breakdown)
        results["load"] = monitor.stop() | budget.as_dict()
        info_client.close()
    results["rows"] = rows
    print(f"\n{TITLE}\n")
    print(f"hold {args.hold * 1000:g} ms, {rounds} round(s) x {duration:g} s per "
          "variant and P, variants interleaved; delays pooled over rounds, rates and "
          "fairness: median over rounds.\n")
    print(c.markdown_table(COLUMNS, rows))
    split = [r for r in rows if r["breakdown_handoffs"]]
    if split:
        print(f"\n{BREAKDOWN_TITLE}\n")
        print(c.markdown_table(BREAKDOWN_COLUMNS, split))
    c.print_load(results["load"])
    c.write_json(c.json_path(args, NAME), results)
    broken = [r for r in rows if r["overlaps"]]
    if broken:
        print(f"\nERROR: overlapping holds in {[r['variant'] for r in broken]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
