"""Run a chaos run and print its report: ``python tests/chaos/run.py --seed 1
--minutes 10 [--lock postgresql|zookeeper] [--broker amqp] [--scenario modes]`` (see
docs/chaos.md)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import chaos_check  # noqa: E402
import chaos_driver  # noqa: E402
import chaos_servers  # noqa: E402
import modes_check  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--lock", choices=chaos_servers.LOCKS, default="redis",
                   help="the lock's server")
    p.add_argument("--broker", choices=chaos_servers.BROKERS, default="redis",
                   help="the Celery broker (amqp: a RabbitMQ node of the run's own)")
    p.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite",
                   help="the fenced counter's database")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--ttl", type=float, default=2.0)
    p.add_argument("--mean-gap", type=float, default=0.5,
                   help="mean seconds between fault starts")
    p.add_argument("--own-broker", action="store_true",
                   help="with --lock redis --broker redis: a broker Redis apart from "
                        "the lock's (restarted on its own)")
    p.add_argument("--scenario", choices=("lock", "modes"), default="lock",
                   help="modes: lock_mode, on_duplicate and lock_rate calls "
                        "(tests/chaos/chaos_modes.py) instead of the fenced counter")
    p.add_argument("--out", type=Path, default=None, help="run directory (kept)")
    args = p.parse_args()
    why = chaos_servers.unavailable(args.lock, args.broker)
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="dlock-chaos-"))
    cfg = chaos_driver.Config(seed=args.seed, seconds=args.minutes * 60, db=args.db,
                              lock=args.lock, broker=args.broker,
                              workers=args.workers, concurrency=args.concurrency,
                              ttl=args.ttl, mean_gap=args.mean_gap,
                              drain=max(60.0, args.minutes * 6), scenario=args.scenario,
                              own_broker=args.own_broker)
    started = time.time()
    chaos_driver.run(cfg, out)
    if args.scenario == "modes":
        rep = modes_check.check(out)
        (out / "report.json").write_text(json.dumps(rep, indent=1, default=str))
        print(modes_check.markdown(rep))
        print(f"\nrun directory: {out} ({time.time() - started:.0f} s)")
        return 1 if rep["violations"] else 0
    report = chaos_check.check(out)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(chaos_check.markdown(report))
    print(f"\nrun directory: {out} ({time.time() - started:.0f} s)")
    bad = (report["violations"] or report["unfenced_overlaps"]
           or report["stale_writes_accepted"]
           or report["lost_increments"] or report["locks_left"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
