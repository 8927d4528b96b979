"""Reading and force-releasing semaphores (:class:`~celery_dlock.RedisSemaphore`) for
``celery dlock`` and metrics: the semaphore side of
:mod:`celery_dlock.backends.redis.inspect`, which hands a key here when it holds a
sorted set (a semaphore's holders) instead of a lock's hash."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...core.errors import BackendUnavailable
from ...core.holds import HoldInfo
from ...core.protocol import new_op_id
from .keyspace import LockKeys, decode
from .released import clean_text
from .semaphore import read_holders
from .semaphore_scripts import SEM_FORCE_RELEASE

__all__ = ["force_release_semaphore", "is_semaphore", "read_semaphore",
           "semaphore_infos"]

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError)
_KNOWN = frozenset({"owner", "count", "fence", "acquired_at", "ttl", "ops", "task_id",
                    "task_name", "worker", "pid", "host", "limit"})


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _int(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def _lease(ttl_ms: str | None) -> float | None:
    """A holder's ``ttl`` field (ms, the longest asked for) in seconds."""
    ms = _int(ttl_ms)
    return ms / 1000.0 if ms is not None and ms > 0 else None


def _hold(name: str, flat: Sequence[Any], pttl_ms: int | None,
          now_ms: int | None) -> HoldInfo:
    fields = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
    acquired_at = _int(fields.get("acquired_at"))
    held_for = None
    if acquired_at is not None and now_ms is not None:
        held_for = max(0, now_ms - acquired_at) / 1000.0
    return HoldInfo(
        key=name, task_name=fields.get("task_name"), task_id=fields.get("task_id"),
        worker=fields.get("worker"), pid=_int(fields.get("pid")),
        owner=fields.get("owner", ""), count=_int(fields.get("count")) or 0,
        fence=_int(fields.get("fence")),
        ttl=pttl_ms / 1000.0 if pttl_ms is not None and pttl_ms >= 0 else None,
        held_for=held_for, host=fields.get("host"),
        extra={k: v for k, v in sorted(fields.items()) if k not in _KNOWN},
        lease=_lease(fields.get("ttl")))


def _limit_of(flat: Sequence[Any]) -> int:
    for i in range(0, len(flat) - 1, 2):
        if _text(flat[i]) == "limit":
            return _int(_text(flat[i + 1])) or 1
    return 1


def semaphore_info(name: str, now_ms: int,
                   live: Sequence[tuple[int, Sequence[Any]]]) -> HoldInfo | None:
    """One semaphore as a :class:`HoldInfo`: the fields of its holder whose slot frees
    first, ``limit`` (the largest its holders asked for) and every holder."""
    holds = tuple(_hold(name, fields, pttl, now_ms) for pttl, fields in live if fields)
    if not holds:
        return None
    limit = max(_limit_of(fields) for _, fields in live)
    return dataclasses.replace(holds[0], limit=limit, holders=holds)


def is_semaphore(client: Any, key: str) -> bool:
    """Whether ``key`` holds a semaphore's holders (a sorted set)."""
    return decode(client.type(key)) == "zset"


def read_semaphore(client: Any, key: str, name: str) -> HoldInfo | None:
    """The semaphore at ``key`` (None when nobody holds a slot)."""
    try:
        now_ms, live = read_holders(client, key)
    except _UNAVAILABLE as exc:
        raise BackendUnavailable(f"Redis unavailable: {exc}", lock_name=name) from exc
    return semaphore_info(name, now_ms, live)


def semaphore_infos(client: Any, page: Sequence[tuple[str, str]]) -> Iterator[HoldInfo]:
    """The semaphores of ``page`` (key, name) that someone holds."""
    for key, name in page:
        info = read_semaphore(client, key, name)
        if info is not None:
            yield info


def force_release_semaphore(client: Any, prefix: str, name: str, *,
                            fence: int | None = None, by: str | None = None,
                            reason: str | None = None,
                            conditions: Mapping[str, str] | None = None
                            ) -> HoldInfo | None:
    """Free the holds of semaphore ``name`` that match (``fence``, ``conditions``;
    neither: every holder); the semaphore as it was, with the freed holds as its
    ``holders`` (None: nothing freed).  Waiters are woken for the freed slots."""
    key = LockKeys.for_name(prefix, name).lock
    args: list[str] = []
    for k, v in (conditions or {}).items():
        args += (k, v)
    if fence is not None:
        args += ("fence", str(fence))
    if by is not None:
        args += (":by", clean_text(by), ":reason", clean_text(reason), ":op",
                 new_op_id())
    try:
        before = read_holders(client, key)
        reply = SEM_FORCE_RELEASE(client, (key,), args)
    except _UNAVAILABLE as exc:
        raise BackendUnavailable(f"Redis unavailable: {exc}", lock_name=name) from exc
    except ResponseError as exc:
        raise BackendUnavailable(f"Redis refused a force release: {exc}",
                                 lock_name=name) from exc
    freed: list[tuple[int, list[Any]]] = []
    i = 1
    for _ in range(int(reply[0])):
        n = int(reply[i])
        freed.append((-1, list(reply[i + 1:i + 1 + n])))
        i += 1 + n
    return semaphore_info(name, before[0], freed)
