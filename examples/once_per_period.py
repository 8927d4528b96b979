"""Once per period across the cluster, even with two ``celery beat`` running.

Running a second scheduler is a classic production mistake (two hosts with the same
deployment, a scaled "beat" service, a rolling restart): every periodic task is then
sent twice per period.  Here the periodic ``report`` task is a
:class:`~celery_dlock.LockedTask` keyed on the *period*, so the copies of one period
contend for one lock and all but one are skipped (``on_contention="skip"``).

How the key identifies the period, even when the two beats fire a few ms apart:

1. **Aligned ticks.**  ``EveryPeriod(interval)`` is a beat schedule that is due at the
   wall-clock boundaries ``k * interval`` (as ``crontab`` is at minute boundaries, but
   for any interval), not ``interval`` after the last run as a plain ``timedelta``
   schedule is.  Two beats started at different times therefore tick at the same
   instants, a few ms apart, instead of drifting in and out of phase.
2. **The period travels in the message.**  The entry's ``period`` argument is a
   :class:`celery.beat.BeatLazyFunc` that beat evaluates when it *sends*:
   ``floor(time.time() / interval)``, just after the boundary, so both beats send the
   same number; as each reads its own clock just after its own boundary, they agree
   even when the two hosts' clocks differ (by anything short of an interval).
   Computing it on the worker instead would be wrong: a message that waits in the
   queue, or a worker whose clock is off, would land in another period.
3. **The key is that argument**: ``lock_key="report:{period}"``.  The copy that arrives
   first runs; the copy that arrives while it runs finds the lock held and is skipped.

A lock only excludes *concurrent* runs: a copy delivered after the first run ended
(a worker that was busy, a beat that was paused or whose clock is late) would find the
lock free.  So the report also records "period done" as its last step, and checks it
first, inside the lock.  The lock makes that check-then-run atomic (without it, two
copies a few ms apart would both see "not done"); the record catches the late copy;
and because the record is written only when the report succeeded, a failed period
stays open for a retry (which a ``SET NX`` taken at the start would not allow).

One command: a throwaway redis-server, 2 workers, 2 beats (each with its own schedule
file), 8 periods of 1 s; it checks that every period ran exactly once::

    python examples/once_per_period.py
    python examples/once_per_period.py --periods 20 --interval 0.5

As an app module (docker-compose.yml runs two beats on purpose)::

    REDIS_URL=... REPORT_INTERVAL=5 celery -A examples.once_per_period beat
    REDIS_URL=... python -m examples.once_per_period check     # the table so far
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery.beat import BeatLazyFunc
from celery.schedules import schedstate, schedule

if not __package__:  # run as a file, python examples/once_per_period.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_dlock import LockedTask, signals
from examples.celery_app import app, data, use_redis

__all__ = ["EveryPeriod", "app", "current_period", "main", "report"]

#: Seconds per period (read by beat; the workers get it in each message).
INTERVAL = float(os.environ.get("REPORT_INTERVAL", "1"))
#: How long building one report takes (so a duplicate arrives while it runs).
WORK = float(os.environ.get("REPORT_WORK", "0.3"))

RAN = "once-per-period:ran"              # period -> reports built (must be 1)
DONE = "once-per-period:done"            # period -> who built it
CONTENDED = "once-per-period:contended"  # period -> copies skipped by the lock
LATE = "once-per-period:late"            # period -> copies skipped by the done record
ARRIVED = "once-per-period:arrived"      # + ":<period>": when each copy started


def current_period(interval: float) -> int:
    """The number of the period ``time.time()`` falls in."""
    return math.floor(time.time() / interval)


class EveryPeriod(schedule):  # type: ignore[misc]
    """A beat schedule due at every wall-clock multiple of ``interval`` seconds."""

    def __init__(self, interval: float, app: Any = None) -> None:
        self.interval = float(interval)
        super().__init__(dt.timedelta(seconds=self.interval), app=app)

    def is_due(self, last_run_at: dt.datetime) -> schedstate:
        now = time.time()
        due = math.floor(now / self.interval) > math.floor(
            last_run_at.timestamp() / self.interval)
        # Wake just after the next boundary (never just before it).
        next_in = (math.floor(now / self.interval) + 1) * self.interval - now + 0.002
        return schedstate(is_due=due, next=next_in)

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return dt.timedelta(seconds=self.is_due(last_run_at).next)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, (self.interval,)

    def __repr__(self) -> str:
        return f"<every {self.interval:g}s, on the boundaries>"


app.conf.beat_schedule = {
    "report-once-per-period": {
        "task": "examples.once_per_period.report",
        "schedule": EveryPeriod(INTERVAL),
        "kwargs": {"period": BeatLazyFunc(current_period, INTERVAL),
                   "interval": INTERVAL},
    },
}


@app.task(name="examples.once_per_period.report", base=LockedTask, bind=True,
          lock_key="report:{period}", on_contention="skip", lock_ttl=30)
def report(self: Any, period: int, interval: float = INTERVAL) -> dict[str, Any]:
    """Build the report of one period, unless it was already built."""
    r = data()
    _arrived(period)
    if r.hexists(DONE, period):  # a copy that arrived after the first one finished
        r.hincrby(LATE, period, 1)
        return {"period": period, "ran": False}
    time.sleep(WORK)  # build the report
    start = dt.datetime.fromtimestamp(period * interval, dt.timezone.utc)
    r.hincrby(RAN, period, 1)
    r.hset(DONE, period, json.dumps({
        "worker": self.request.hostname, "pid": os.getpid(), "fence": self.lock.fence,
        "period_start": start.isoformat(timespec="milliseconds")}))
    return {"period": period, "ran": True}


@signals.lock_contended.connect
def _count_skipped_copy(sender: Any, name: str, **_: Any) -> None:
    if getattr(sender, "name", None) == report.name:
        period = int(name.rsplit(":", 1)[1])
        _arrived(period)
        data().hincrby(CONTENDED, period, 1)


def _arrived(period: int) -> None:
    data().rpush(f"{ARRIVED}:{period}", time.time())


# -- checking ---------------------------------------------------------------------------


@dataclass
class Period:
    number: int
    ran: int
    contended: int
    late: int
    done_by: str
    spread: float  # seconds between the first and the last copy's start

    @property
    def copies(self) -> int:
        return self.ran + self.contended + self.late


def read_periods() -> list[Period]:
    r = data()
    ran, contended, late, done = (r.hgetall(k) for k in (RAN, CONTENDED, LATE, DONE))
    numbers = sorted({int(p) for h in (ran, contended, late) for p in h})
    out = []
    for n in numbers:
        who = json.loads(done[str(n)]) if str(n) in done else {}
        starts = [float(t) for t in r.lrange(f"{ARRIVED}:{n}", 0, -1)]
        out.append(Period(n, int(ran.get(str(n), 0)), int(contended.get(str(n), 0)),
                          int(late.get(str(n), 0)),
                          f"{who.get('worker', '-')} pid {who.get('pid', '-')}"
                          if who else "-",
                          max(starts) - min(starts) if starts else 0.0))
    return out


def sent_by_all(periods: list[Period], beats: int) -> list[Period]:
    """The periods from the first one that every beat sent (the others were starting)."""
    for i, p in enumerate(periods):
        if p.copies >= beats:
            return periods[i:]
    return []


def check(periods: list[Period], interval: float, want: int = 1, beats: int = 2) -> int:
    """Print the table; 0 when every period from first to last ran exactly once."""
    if not periods:
        print("FAILED: no period was recorded")
        return 1
    print(f"{'period':>12} {'starts (UTC)':>12} {'copies':>6} {'apart':>7} "
          f"{'ran':>4} {'skipped:lock':>12} {'skipped:done':>12}  built by")
    for p in periods:
        start = dt.datetime.fromtimestamp(p.number * interval, dt.timezone.utc)
        stamp = start.strftime("%H:%M:%S.%f")[:-3]
        print(f"{p.number:>12} {stamp:>12} {p.copies:>6} {p.spread * 1000:>5.0f}ms "
              f"{p.ran:>4} {p.contended:>12} {p.late:>12}  {p.done_by}")
    print(f"{len(periods)} periods, {sum(p.copies for p in periods)} copies sent, "
          f"{sum(p.ran for p in periods)} reports built, "
          f"{sum(p.contended for p in periods)} copies skipped by the lock, "
          f"{sum(p.late for p in periods)} by the done record")
    numbers = [p.number for p in periods]
    gaps = sorted(set(range(numbers[0], numbers[-1] + 1)) - set(numbers))
    wrong = [p.number for p in periods if p.ran != 1]
    measured = sent_by_all(periods, beats)
    # The last period may have been cut short by stopping the beats.
    short = [p.number for p in measured[:-1] if p.copies < beats]
    ok = True
    if gaps:
        print(f"FAILED: periods with no copy at all: {gaps}")
        ok = False
    if wrong:
        print(f"FAILED: periods not built exactly once: {wrong}")
        ok = False
    if len(measured) < want:
        print(f"FAILED: {len(measured)} periods sent by all {beats} beats, "
              f"wanted {want}")
        ok = False
    if short:
        print(f"FAILED: periods that did not get a copy from each of the {beats} "
              f"beats: {short}")
        ok = False
    if ok:
        print(f"OK: every period ran exactly once ({len(periods)} periods, "
              f"{len(measured)} of them sent by all {beats} beats)")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    from examples._cluster import Cluster, beat_argv, redis_server, say, worker_argv

    os.environ["REPORT_INTERVAL"] = repr(args.interval)
    with redis_server(args.redis_url) as url:
        use_redis(url)
        r = data()
        r.delete(RAN, CONTENDED, LATE, DONE)
        host = socket.gethostname()
        nodes = [f"reports{i + 1}-{os.getpid()}@{host}" for i in range(args.workers)]
        with Cluster(url) as cluster:
            for node in nodes:
                cluster.start(node.split("@")[0],
                              worker_argv("examples.once_per_period", node, 2))
            cluster.wait_for_workers(app, nodes)
            beats = [f"beat{i + 1}" for i in range(args.beats)]
            for name in beats:
                cluster.start(name, beat_argv("examples.once_per_period",
                                              cluster.dir / f"{name}-schedule"))
            say(f"{args.workers} workers and {args.beats} beats up; report every "
                f"{args.interval:g}s, {args.periods} periods ...")
            deadline = time.monotonic() + args.periods * args.interval + 15
            while len(sent_by_all(read_periods(), args.beats)) < args.periods:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            cluster.stop(*beats)
            time.sleep(WORK + 0.5)  # let the last copies finish
        return check(read_periods(), args.interval, want=args.periods, beats=args.beats)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/once_per_period.py",
        description="A periodic report sent by two beats runs once per period.")
    parser.add_argument("command", nargs="?", choices=("run", "check"), default="run",
                        help="run: embedded Redis, workers and beats (default); "
                             "check: print what $REDIS_URL recorded so far")
    parser.add_argument("--periods", type=int, default=8)
    parser.add_argument("--interval", type=float, default=INTERVAL)
    parser.add_argument("--beats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--redis-url", help="run: use this Redis instead of starting one")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(read_periods(), args.interval, beats=args.beats)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
