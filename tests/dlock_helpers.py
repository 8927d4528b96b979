"""Helpers shared by the lock-core tests.

This module is imported by ``spawn``-ed child processes too, so it imports nothing of
pytest and nothing heavy: only redis and the package itself.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.backoff
import redis.retry

from celery_dlock import RedisLock, RedlockLock, lock_from_url


def wait_until(predicate: Callable[[], object], timeout: float = 5.0,
               interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; its last verdict."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)


def child_pids(pid: int) -> list[int]:
    """The processes ``pid``'s threads started (Linux ``/proc``); none for a process
    that is gone, and a thread that ends meanwhile is skipped."""
    pids: list[int] = []
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return pids
    for thread in threads:
        try:
            pids += [int(child) for child in (thread / "children").read_text().split()]
        except OSError:
            continue
    return pids


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fast_failing_client(port: int, timeout: float = 0.5) -> redis.Redis:
    """A client that gives up at once: no retries, short socket timeouts."""
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
    )


def release_marker(key: str) -> bool:
    """Whether ``key`` is the short-lived marker of a semaphore's final release
    (``...}:r:OP``; a lock's release leaves none)."""
    _, sep, op = key.rpartition("}:r:")
    return bool(sep) and len(op) == 16 and all(c in "0123456789abcdef" for c in op)


def queue_members(client: redis.Redis, lock: RedisLock) -> list[str]:
    """Owners in the lock's FIFO line, first in line first."""
    return [m.decode() for m in client.zrange(lock.keys.queue, 0, -1)]


# -- child-process targets (must be importable by a spawned interpreter) ---------------


def _read_modify_write(client: redis.Redis, counter: str, inside: str,
                       overlaps: str, pause: float) -> None:
    if client.incr(inside) > 1:
        client.incr(overlaps)
    value = int(client.get(counter) or 0)
    time.sleep(pause)
    client.set(counter, value + 1)
    client.decr(inside)


def counter_worker(redis_url: str, prefix: str, name: str, counter: str, n: int,
                   barrier: Any, use_lock: bool, pause: float,
                   lock_urls: list[str] | None = None) -> None:
    """``n`` read-modify-write increments of ``counter``, under the lock or not.

    ``inside`` counts the processes inside the critical section; any moment with more
    than one is recorded in ``overlaps``.  The lock lives on ``lock_urls`` (a
    RedlockLock over them when there are several), by default on ``redis_url``.
    """
    client = redis.Redis.from_url(redis_url, socket_timeout=30)
    urls = lock_urls or [redis_url]
    nodes = [redis.Redis.from_url(u, socket_timeout=30) for u in urls
             if u.startswith(("redis://", "unix://"))]

    def make_lock() -> Any:
        if urls[0].startswith(("postgresql://", "mysql://", "zookeeper://")):
            return lock_from_url(urls[0], name, ttl=10, prefix=prefix,
                                 blocking_timeout=60)
        if len(nodes) == 1:
            return RedisLock(nodes[0], name, ttl=10, prefix=prefix, blocking_timeout=60)
        return RedlockLock(nodes, name, ttl=10, prefix=prefix, blocking_timeout=60)

    inside, overlaps = counter + ":inside", counter + ":overlaps"
    barrier.wait(timeout=60)
    for _ in range(n):
        if use_lock:
            with make_lock():
                _read_modify_write(client, counter, inside, overlaps, pause)
        else:
            _read_modify_write(client, counter, inside, overlaps, pause)
    client.close()
    for node in nodes:
        node.close()


def hold_until_killed(redis_url: str, prefix: str, name: str, ttl: float,
                      ready: Any, lock_url: str | None = None) -> None:
    """Take the lock (renewed by this process's scheduler) and never release it (on
    ``lock_url``'s backend when given, else on ``redis_url``)."""
    if lock_url is not None:
        lock = lock_from_url(lock_url, name, ttl=ttl, prefix=prefix)
    else:
        client = redis.Redis.from_url(redis_url, socket_timeout=30)
        lock = RedisLock(client, name, ttl=ttl, prefix=prefix)
    lock.acquire()
    ready.set()
    time.sleep(120)


def wait_in_line(redis_url: str, prefix: str, name: str, owner: str,
                 limit: int | None = None, lock_url: str | None = None) -> None:
    """Block in ``acquire`` (joining the line) until killed; with ``limit``, of a
    ``RedisSemaphore`` of that many slots; with ``lock_url``, of that URL's backend."""
    if lock_url is not None:
        lock_from_url(lock_url, name, owner=owner, prefix=prefix).acquire(timeout=120)
        return
    client = redis.Redis.from_url(redis_url, socket_timeout=30)
    if limit is not None:
        from celery_dlock import RedisSemaphore

        RedisSemaphore(client, name, limit, owner=owner, prefix=prefix).acquire(
            timeout=120)
        return
    RedisLock(client, name, owner=owner, prefix=prefix).acquire(timeout=120)


def release_if_held(lock: Any) -> None:
    """A test's cleanup: release ``lock`` if this object still holds it, whatever
    happened to its store meanwhile."""
    if lock.depth:
        try:
            lock.release()
        except Exception:  # its store went away, or the hold did: nothing to free
            pass


def try_acquire(lock: Any) -> bool:
    """One non-blocking acquire; Redis unreachable (a failover under way) is False."""
    from celery_dlock import BackendUnavailable

    try:
        return bool(lock.acquire(blocking=False))
    except BackendUnavailable:
        return False


def until_while(predicate: Callable[[], bool], timeout: float,
                also: Callable[[], None]) -> bool:
    """``wait_until`` that calls ``also`` (e.g. another owner trying) on every round."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        also()
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def tracked_copy(repo: Path, dest: Path) -> Path:
    """A copy of the files of ``repo`` that git tracks (every file but ``.venv``,
    ``.git`` and build output when it is not a git checkout), under ``dest``: builds
    run there, never in the checkout, whose build tree other runs may be using."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"],
                                capture_output=True, check=False)
    except OSError:  # no git on this machine: a plain copy below
        listed = None
    if listed is not None and listed.returncode == 0 and listed.stdout:
        for rel in listed.stdout.decode().split("\0"):
            if rel and (repo / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(repo / rel, dest / rel)
        return dest
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info",
                                  "__pycache__", ".pytest_cache", ".mypy_cache",
                                  ".ruff_cache")
    shutil.copytree(repo, dest, ignore=skip, dirs_exist_ok=True)
    return dest
