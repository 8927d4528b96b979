"""P processes contending for one lock: the machinery behind (c) and (e).

Each process loops ``acquire -> hold -> release`` on one key from a common start time
until a common end time.  Timestamps are ``time.monotonic()`` (``CLOCK_MONOTONIC``,
shared by every process of one Linux machine): ``t_acq`` right after ``acquire()``
returns, ``t_rel`` right before ``release()`` is called.  Sorting every hold of every
process by ``t_acq`` gives the lock's history:

* a *hand-off* is two consecutive holds by different processes; its delay is
  ``t_acq(next) - t_rel(previous)``;
* an *overlap* is a next hold that starts before the previous one released: a broken
  lock.  It must be 0;
* *fairness* is min/max of the acquisitions per process inside the window; *Jain's
  index* of the same counts, (sum x)^2 / (n sum x^2), is 1 when every process got as
  many and 1/n when one got them all.

The parent takes ``INFO commandstats`` at the start and at the end of the window (Redis
commands, including those run inside Lua scripts); each child counts the commands its
client sends inside the window (round trips).

With ``breakdown``, celery_dlock's workers also note when their doorbell ``BLPOP``
returned (by wrapping ``celery_dlock.backends.redis.lock.ring_wait``), which splits a
hand-off into
*release -> woken* (the release script, the doorbell, the waiter's wake-up) and *woken
-> acquired* (the waiter's ``ACQUIRE`` round trip).

Processes are forked (Linux): the parent holds no lock and runs no scheduler thread,
and every child makes its own client and lock.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common as c
import redis
import redis_lock

from celery_dlock import RedisLock

#: Every variant that (c) and (e) compare.
VARIANTS = (
    "celery_dlock",
    "redis-py sleep=0.1",
    "redis-py sleep=0.001",
    "python-redis-lock",
)
#: How long one acquire() may block before the worker tries again (seconds).
ACQUIRE_LIMIT = 30
QUANTILES = [*range(101), 99.9]


def make_lock(variant: str, client: redis.Redis,
              key: str) -> tuple[Callable[[], bool], Callable[[], Any]]:
    """``(acquire, release)`` for one process's lock object of ``variant``."""
    if variant == "celery_dlock":
        lock = RedisLock(client, key, ttl=30)
        return (lambda: lock.acquire(timeout=ACQUIRE_LIMIT)), lock.release
    if variant.startswith("redis-py sleep="):
        sleep = float(variant.split("=", 1)[1])
        rlock = client.lock(f"{key}:redispy", timeout=30, sleep=sleep)
        return (lambda: bool(rlock.acquire(blocking_timeout=ACQUIRE_LIMIT))), \
            rlock.release
    if variant == "python-redis-lock":
        plock = redis_lock.Lock(client, f"{key}:prl", expire=30)
        return (lambda: bool(plock.acquire(timeout=ACQUIRE_LIMIT))), plock.release
    raise ValueError(f"unknown variant {variant!r}")


def warm_up(url: str, variant: str, key: str) -> None:
    """Load the variant's scripts into the server, from the parent, without threads."""
    client = redis.Redis.from_url(url)
    if variant == "celery_dlock":
        lock = RedisLock(client, key, ttl=30, auto_renew=False)
        lock.acquire(blocking=False)
        lock.release()
    else:
        acquire, release = make_lock(variant, client, key)
        acquire()
        release()
    client.close()


def _watch_doorbell() -> list[float | None]:
    """Wrap celery_dlock's doorbell wait so that it notes when it last rang."""
    import celery_dlock.backends.redis.lock as lock_module

    rang: list[float | None] = [None]
    ring_wait = getattr(lock_module, "ring_wait", None)
    if ring_wait is None:
        return rang

    def noting_ring_wait(*args: Any, **kwargs: Any) -> Any:
        reply = ring_wait(*args, **kwargs)
        if reply:
            rang[0] = time.monotonic()
        return reply

    lock_module.ring_wait = noting_ring_wait
    return rang


def _worker(index: int, variant: str, url: str, key: str, start_at: float,
            end_at: float, hold: float, queue: Any, breakdown: bool = False) -> None:
    client = c.counting_client(url, socket_timeout=ACQUIRE_LIMIT + 30)
    counter = c.counter_of(client)  # round trips within the measured window
    counter.start_at, counter.end_at = start_at, end_at
    acquire, release = make_lock(variant, client, key)
    rang = _watch_doorbell() if breakdown and variant == "celery_dlock" else [None]
    client.ping()
    events: list[tuple[float, float, float | None]] = []
    timeouts = 0
    wait = start_at - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    while True:
        rang[0] = None
        if not acquire():
            timeouts += 1
            if time.monotonic() >= end_at:
                break
            continue
        t_acq = time.monotonic()
        if t_acq < end_at:
            time.sleep(hold)
        t_rel = time.monotonic()
        release()
        events.append((t_acq, t_rel, rang[0]))
        if t_acq >= end_at:
            break
    queue.put((index, events, timeouts, counter.sent))
    client.close()


def jain(counts: Sequence[int]) -> float:
    """Jain's fairness index of ``counts``: 1 when all are equal, 1/n at worst."""
    squares = sum(x * x for x in counts)
    return sum(counts) ** 2 / (len(counts) * squares) if squares else 0.0


def analyse(per_proc: Sequence[Sequence[tuple[float, float, float | None]]],
            start: float, end: float) -> dict[str, Any]:
    merged = sorted((t_acq, t_rel, proc, t_rang) for proc, events in enumerate(per_proc)
                    for t_acq, t_rel, t_rang in events if t_acq >= start)
    delays: list[float] = []
    woken: list[float] = []  # release -> the next holder's doorbell rang
    after_wake: list[float] = []  # doorbell rang -> acquire returned
    overlaps = same = 0
    for prev, nxt in itertools.pairwise(merged):
        if nxt[0] >= end:
            break
        if nxt[0] < prev[1]:
            overlaps += 1
        if nxt[2] == prev[2]:
            same += 1
        else:
            delays.append(nxt[0] - prev[1])
            t_rang = nxt[3]
            if t_rang is not None and t_rang >= prev[1]:
                woken.append(t_rang - prev[1])
                after_wake.append(nxt[0] - t_rang)
    counts = [sum(1 for t_acq, _, _ in events if start <= t_acq < end)
              for events in per_proc]
    duration = end - start
    acquisitions = sum(counts)
    return {
        "acquisitions": acquisitions,
        "handoffs": len(delays),
        "same_process_reacquires": same,
        "overlaps": overlaps,
        "per_process": counts,
        "fairness": (min(counts) / max(counts)) if max(counts) else 0.0,
        "jain": jain(counts),
        "acq_per_s": acquisitions / duration,
        "handoffs_per_s": len(delays) / duration,
        "delays": delays,
        "woken": woken,
        "after_wake": after_wake,
    }


def run_once(url: str, variant: str, procs: int, duration: float, hold: float,
             key: str, info_client: redis.Redis,
             breakdown: bool = False) -> dict[str, Any]:
    """One window of ``procs`` processes on ``variant``; returns the analysis."""
    warm_up(url, variant, key + ":warm")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    start_at = time.monotonic() + 0.4 + 0.03 * procs
    end_at = start_at + duration
    workers = [ctx.Process(target=_worker, daemon=True,
                           args=(i, variant, url, key, start_at, end_at, hold, queue,
                                 breakdown))
               for i in range(procs)]
    for w in workers:
        w.start()
    time.sleep(max(0.0, start_at - time.monotonic()))
    before = c.command_calls(info_client)
    time.sleep(max(0.0, end_at - time.monotonic()))
    after = c.command_calls(info_client)
    results: dict[int, tuple[list[tuple[float, float]], int, int]] = {}
    deadline = time.monotonic() + ACQUIRE_LIMIT + 20
    while len(results) < procs and time.monotonic() < deadline:
        try:
            index, events, timeouts, sent = queue.get(timeout=1.0)
        except Exception:  # queue.Empty: check that the workers are alive
            if not any(w.is_alive() for w in workers) and queue.empty():
                break
            continue
        results[index] = (events, timeouts, sent)
    for w in workers:
        w.join(timeout=5)
        if w.is_alive():
            w.kill()
            w.join()
    if len(results) < procs:
        raise RuntimeError(f"{variant}: only {len(results)} of {procs} workers reported")
    per_proc = [results[i][0] for i in range(procs)]
    out = analyse(per_proc, start_at, end_at)
    delta = c.calls_delta(before, after)
    out["redis_cmds"] = c.total_calls(delta)
    out["commands"] = {k: v["calls"] for k, v in delta.items()}
    out["round_trips"] = sum(results[i][2] for i in range(procs))
    out["timeouts"] = sum(results[i][1] for i in range(procs))
    return out


def summarise(variant: str, procs: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the delays of several rounds; median of the per-round rates."""
    delays = sorted(d for r in rounds for d in r["delays"])

    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in rounds))

    handoffs = sum(r["handoffs"] for r in rounds)
    acquisitions = sum(r["acquisitions"] for r in rounds)
    cmds = sum(r["redis_cmds"] for r in rounds)
    trips = sum(r["round_trips"] for r in rounds)
    commands: dict[str, int] = {}
    for r in rounds:
        for k, v in r["commands"].items():
            commands[k] = commands.get(k, 0) + v
    ms = [d * 1000.0 for d in delays]
    woken = sorted(d * 1000.0 for r in rounds for d in r["woken"])
    after_wake = sorted(d * 1000.0 for r in rounds for d in r["after_wake"])
    return {
        "variant": variant,
        "procs": procs,
        "rounds": len(rounds),
        "handoffs_per_s": med("handoffs_per_s"),
        "acq_per_s": med("acq_per_s"),
        "fairness": med("fairness"),
        "fairness_min": min(r["fairness"] for r in rounds),
        "jain": med("jain"),
        "handoffs": handoffs,
        "acquisitions": acquisitions,
        "handoff_share": handoffs / acquisitions if acquisitions else 0.0,
        "overlaps": sum(r["overlaps"] for r in rounds),
        "timeouts": sum(r["timeouts"] for r in rounds),
        "p50_ms": c.percentile(ms, 50),
        "p90_ms": c.percentile(ms, 90),
        "p99_ms": c.percentile(ms, 99),
        "max_ms": ms[-1] if ms else None,
        "delay_quantiles_ms": {str(q): c.percentile(ms, q) for q in QUANTILES}
        if ms else {},
        "redis_cmds_per_handoff": cmds / handoffs if handoffs else None,
        "redis_cmds_per_acq": cmds / acquisitions if acquisitions else None,
        "round_trips_per_handoff": trips / handoffs if handoffs else None,
        "round_trips_per_acq": trips / acquisitions if acquisitions else None,
        "commands_per_handoff": {k: v / handoffs for k, v in sorted(commands.items())}
        if handoffs else {},
        "per_process_rounds": [r["per_process"] for r in rounds],
        "other_cpus_busy_rounds": [r.get("other_cpus_busy") for r in rounds],
        "breakdown_handoffs": len(woken),
        "woken_p50_ms": c.percentile(woken, 50),
        "woken_p99_ms": c.percentile(woken, 99),
        "after_wake_p50_ms": c.percentile(after_wake, 50),
        "after_wake_p99_ms": c.percentile(after_wake, 99),
    }


def run_matrix(url: str, variants: Sequence[str], proc_counts: Sequence[int],
               rounds: int, duration: float, hold: float,
               budget: c.RetryBudget | None = None,
               progress: Callable[[str], None] = print,
               breakdown: bool = False) -> list[dict[str, Any]]:
    """Every (process count, variant) for ``rounds`` rounds, variants interleaved."""
    info_client = redis.Redis.from_url(url)
    prefix = c.run_id()
    rows = []
    try:
        for procs in proc_counts:
            collected: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
            for r in range(rounds):
                order = list(variants[r % len(variants):]) + \
                    list(variants[:r % len(variants)])
                for variant in order:
                    for attempt in itertools.count():
                        key = (f"{prefix}:p{procs}:r{r}:{VARIANTS.index(variant)}"
                               f":{attempt}")
                        monitor = c.LoadMonitor(info_client)
                        result = run_once(url, variant, procs, duration, hold, key,
                                          info_client, breakdown)
                        result["other_cpus_busy"] = monitor.stop()["other_cpus_busy"]
                        if budget is None or budget.keep(
                                result, f"P={procs} round {r + 1} {variant}"):
                            break
                    collected[variant].append(result)
                    progress(f"  P={procs} round {r + 1}/{rounds} {variant}: "
                             f"{result['handoffs']} hand-offs, "
                             f"{result['acquisitions']} acquisitions")
            rows += [summarise(v, procs, collected[v]) for v in variants]
    finally:
        info_client.close()
    return rows
