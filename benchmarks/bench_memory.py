"""(g) Redis memory per held lock, and what stays behind per lock name after release.

For N = 1, 100 and 10,000 locks (distinct names, nothing contends) and each variant,
one process takes all N, then releases all N.  Three snapshots of the keys the run
made (``SCAN`` on the run's unique marker, which every key contains):

* *held*: every key while the N locks are held;
* *released*: right after the last release returned, what is left per name ever used
  (a key that expires shortly is still counted; its pattern and its TTL are shown);
* the server's ``used_memory`` (``INFO memory``) delta over both, per lock, which
  includes what ``MEMORY USAGE`` does not see (the key table's growth).

Bytes per key are ``MEMORY USAGE key SAMPLES 0`` (the whole value, the key name and
Redis's per-key overhead).  Key patterns replace the lock's name with ``NAME`` and
per-operation ids and digests with ``OP`` / ``HEX``.

Variants, each with its own key naming and the metadata it stores:

* ``celery_dlock RedisLock``: ``RedisLock(client, name, auto_renew=False)``, no metadata;
* ``celery_dlock LockedTask``: the same with the metadata a ``LockedTask`` attempt
  stores with its hold (task id, task name, worker, retries, replaced);
* ``redis-py Lock``, ``python-redis-lock``: their ``Lock`` on the same name;
* ``celery-once``, ``celery-singleton``: their Redis backends' own lock and unlock
  calls, with the keys they derive from a task name and its arguments.

Lock names are what ``LockedTask`` makes of a task name and hashed arguments
(``bench.memory:<sha256>``), so the key names are as long as in real use.

    python benchmarks/bench_memory.py          # full run -> results/bench_memory.json
    python benchmarks/bench_memory.py --smoke  # 1 and 10 locks, no JSON
"""

from __future__ import annotations

import hashlib
import re
import sys
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import _common as c
import redis
import redis_lock
from celery_once.backends.redis import Redis as OnceRedis
from celery_once.helpers import queue_once_key
from celery_singleton.backends.redis import RedisBackend as SingletonRedis
from celery_singleton.util import generate_lock

from celery_dlock import RedisLock
from celery_dlock.task.attempt import hold_info

NAME = "bench_memory"
TITLE = "### g. Redis memory per held lock and per name after release"
TASK = "bench.memory"
VARIANTS = ("celery_dlock RedisLock", "celery_dlock LockedTask", "redis-py Lock",
            "python-redis-lock", "celery-once", "celery-singleton")
COLUMNS = [
    ("variant", "variant", ""),
    ("locks", "locks", ""),
    ("keys/lock held", "held_keys_per_lock", ".2f"),
    ("bytes/lock held", "held_bytes_per_lock", ",.0f"),
    ("used_memory/lock held", "held_used_memory_per_lock", ",.0f"),
    ("keys/name after release", "left_keys_per_name", ".2f"),
    ("bytes/name after release", "left_bytes_per_name", ",.0f"),
    ("of which without expiry", "left_persistent_bytes_per_name", ",.0f"),
    ("used_memory/name after release", "left_used_memory_per_name", ",.0f"),
]
PATTERN_COLUMNS = [
    ("variant", "variant", ""),
    ("when", "when", ""),
    ("key pattern", "pattern", ""),
    ("keys/lock", "keys_per_lock", ".2f"),
    ("bytes/key", "bytes_per_key", ",.0f"),
    ("TTL", "ttl", ""),
]


def lock_name(i: int) -> str:
    """The name ``LockedTask`` gives a call with arguments ``(n=i)`` (hashed)."""
    digest = hashlib.sha256(f'{TASK}\n{{"n":{i}}}'.encode()).hexdigest()
    return f"{TASK}:{digest}"


class Variant:
    """Takes and releases N locks of one kind."""

    def __init__(self, kind: str, url: str, client: redis.Redis) -> None:
        self.kind = kind
        self.client = client
        self.run = ""
        self.held: list[Any] = []
        self.url = url
        self.take = self._taker()

    def key_name(self, i: int) -> str:
        if self.kind == "celery-once":
            return queue_once_key(f"{self.run}.{TASK}", {"n": i})
        if self.kind == "celery-singleton":
            return generate_lock(TASK, [i], {}, key_prefix=f"{self.run}:SINGLETONLOCK_")
        return lock_name(i)

    def _taker(self) -> Callable[[int], Any]:
        """Lock i, or None when it was not free (clients made once per variant)."""
        take: Callable[[int], Any]
        if self.kind.startswith("celery_dlock"):
            meta = self.kind.endswith("LockedTask")

            def take(i: int) -> Any:
                info = None
                if meta:
                    request = SimpleNamespace(id=str(uuid.uuid4()),
                                              hostname="celery@bench-host")
                    info = hold_info(TASK, request)
                lock = RedisLock(self.client, lock_name(i), ttl=30, auto_renew=False,
                                 prefix=f"{self.run}:dlock", info=info)
                ok = lock.acquire(blocking=False)
                return lock if ok else None
        elif self.kind == "redis-py Lock":
            def take(i: int) -> Any:
                lock = self.client.lock(f"{self.run}:{lock_name(i)}", timeout=30)
                return lock if lock.acquire(blocking=False) else None
        elif self.kind == "python-redis-lock":
            def take(i: int) -> Any:
                lock = redis_lock.Lock(self.client, f"{self.run}:{lock_name(i)}",
                                       expire=30)
                return lock if lock.acquire(blocking=False) else None
        elif self.kind == "celery-once":
            once = OnceRedis({"url": self.url, "default_timeout": 60})

            def take(i: int) -> Any:
                key = self.key_name(i)
                once.raise_or_lock(key, 60)
                return (once, key)
        elif self.kind == "celery-singleton":
            single = SingletonRedis(self.url)

            def take(i: int) -> Any:
                key = self.key_name(i)
                ok = single.lock(key, str(uuid.uuid4()))
                return (single, key) if ok else None
        else:
            raise ValueError(self.kind)
        return take

    def acquire_all(self, run: str, n: int) -> None:
        self.run = run
        for i in range(n):
            held = self.take(i)
            if held is None:
                raise RuntimeError(f"{self.kind}: could not take lock {i}")
            self.held.append(held)

    def release_all(self) -> None:
        for held in self.held:
            if isinstance(held, tuple):
                backend, key = held
                if isinstance(backend, OnceRedis):
                    backend.clear_lock(key)
                else:
                    backend.unlock(key)
            else:
                held.release()
        self.held.clear()


#: What names a lock in a key (after the run's marker became RUN): LockedTask's
#: hashed name, celery-once's and celery-singleton's own keys.
_NAME_FORMS = [(re.compile(r"bench\.memory:[0-9a-f]{64}"), "NAME"),
               (re.compile(r"qo_RUN\.bench\.memory_n-\d+"), "NAME"),
               (re.compile(r"SINGLETONLOCK_[0-9a-f]{32}"), "SINGLETONLOCK_HEX")]


def pattern_of(key: str, run: str) -> str:
    """``key`` with its run marker, lock name, op ids and digests replaced."""
    key = key.replace(run, "RUN")
    for form, text in _NAME_FORMS:
        key = form.sub(text, key)
    key = re.sub(r":r:[^:]+$", ":r:OP", key)
    return re.sub(r":w:[0-9a-f]+$", ":w:HEX", key)


def snapshot(client: redis.Redis, run: str) -> dict[str, Any]:
    """The run's keys: count, MEMORY USAGE and TTL per pattern; used_memory."""
    keys = [k.decode() for k in client.scan_iter(match=f"*{run}*", count=1000)]
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.memory_usage(k, samples=0)
        pipe.pttl(k)
    replies = pipe.execute()
    by_pattern: dict[str, dict[str, Any]] = {}
    for j, key in enumerate(keys):
        size, pttl = replies[2 * j], replies[2 * j + 1]
        if size is None or pttl == -2:  # expired since SCAN
            continue
        pat = pattern_of(key, run)
        entry = by_pattern.setdefault(pat, {"keys": 0, "bytes": 0, "persistent_bytes": 0,
                                            "pttl_max": None})
        entry["keys"] += 1
        entry["bytes"] += int(size)
        if pttl is None or pttl < 0:
            entry["persistent_bytes"] += int(size)
        else:
            entry["pttl_max"] = max(entry["pttl_max"] or 0, int(pttl))
    return {"patterns": by_pattern, "used_memory": used_memory(client)}


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def ttl_text(entry: dict[str, Any]) -> str:
    if entry["persistent_bytes"] == entry["bytes"]:
        return "none"
    if entry["persistent_bytes"]:
        return f"some <= {entry['pttl_max'] / 1000:.0f} s"
    return f"<= {entry['pttl_max'] / 1000:.0f} s"


def measure(variant: Variant, client: redis.Redis, run: str,
            n: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    kind = variant.kind
    base = used_memory(client)
    variant.acquire_all(run, n)
    held = snapshot(client, run)
    variant.release_all()
    left = snapshot(client, run)
    for key in client.scan_iter(match=f"*{run}*", count=1000):
        client.delete(key)

    def totals(snap: dict[str, Any], field: str) -> int:
        return sum(int(e[field]) for e in snap["patterns"].values())

    row: dict[str, Any] = {
        "variant": kind, "locks": n,
        "held_keys_per_lock": totals(held, "keys") / n,
        "held_bytes_per_lock": totals(held, "bytes") / n,
        "held_used_memory_per_lock": (held["used_memory"] - base) / n,
        "left_keys_per_name": totals(left, "keys") / n,
        "left_bytes_per_name": totals(left, "bytes") / n,
        "left_persistent_bytes_per_name": totals(left, "persistent_bytes") / n,
        "left_used_memory_per_name": (left["used_memory"] - base) / n,
        "held_patterns": held["patterns"], "left_patterns": left["patterns"],
    }
    patterns = []
    for when, snap in (("held", held), ("after release", left)):
        for pat, e in sorted(snap["patterns"].items()):
            patterns.append({"variant": kind, "when": when, "pattern": f"`{pat}`",
                             "keys_per_lock": e["keys"] / n,
                             "bytes_per_key": e["bytes"] / e["keys"],
                             "ttl": ttl_text(e)})
        if not snap["patterns"]:
            patterns.append({"variant": kind, "when": when, "pattern": "(no key)",
                             "keys_per_lock": 0.0, "bytes_per_key": None, "ttl": ""})
    return row, patterns


def main(argv: list[str] | None = None) -> int:
    parser = c.base_parser(__doc__.split("\n\n")[0], NAME)
    parser.add_argument("--locks", default=None,
                        help="comma-separated lock counts (default 1,100,10000; "
                             "smoke 1,10)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    counts = [int(n) for n in
              (args.locks or ("1,10" if args.smoke else "1,100,10000")).split(",")]
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}")

    results: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke}
    rows: list[dict[str, Any]] = []
    patterns: list[dict[str, Any]] = []
    c.wait_quiet(args.wait_quiet)
    with c.redis_server(args.redis_url) as (url, _server):
        client = redis.Redis.from_url(url)
        results["machine"] = c.machine_info(client)
        c.print_machine(results["machine"])
        monitor = c.LoadMonitor(client)
        run = c.run_id()
        # One client per variant, used once first: no count pays for loading a
        # script or for a new connection's buffers in used_memory.
        objs = {kind: Variant(kind, url, client) for kind in variants}
        for kind in variants:
            measure(objs[kind], client, f"{run}w", 1)
        for n in counts:
            for kind in variants:
                row, pats = measure(objs[kind], client, f"{run}n{n}", n)
                rows.append(row)
                if n == max(counts):
                    patterns += pats
                print(f"  {kind} x {n}: {row['held_bytes_per_lock']:.0f} B/lock held, "
                      f"{row['left_bytes_per_name']:.0f} B/name left", file=sys.stderr)
        results["load"] = monitor.stop()
        client.close()
    rows.sort(key=lambda r: (variants.index(r["variant"]), r["locks"]))
    results["rows"] = rows
    results["patterns"] = patterns
    print(f"\n{TITLE}\n")
    print("MEMORY USAGE (SAMPLES 0) of every key of the run, per lock; used_memory: "
          "the server's INFO memory delta from before the first acquire.\n")
    print(c.markdown_table(COLUMNS, rows))
    print(f"\nKeys by pattern, {max(counts)} locks (TTL: the longest left when "
          "measured):\n")
    print(c.markdown_table(PATTERN_COLUMNS, patterns))
    c.print_load(results["load"])
    c.write_json(c.json_path(args, NAME), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
