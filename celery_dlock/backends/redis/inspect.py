"""Reading (and force-releasing) the locks held in Redis: the Redis side of
:class:`~celery_dlock.backends.redis.backend.RedisBackend`, for ``celery dlock`` and
metrics.

Everything here reads (or, for :func:`force_release`, frees) the keys laid out in
:mod:`celery_dlock.backends.redis.scripts`; nothing depends on a running worker::

    from celery_dlock.backends.redis.inspect import force_release, get_lock, iter_locks
    # (the same functions: celery_dlock.backends.redis.inspect)

    for info in iter_locks(client, "dlock"):
        print(info.key, info.task_name, info.held_for)

Listing uses ``SCAN`` (never ``KEYS``) with ``MATCH P:[{#]*}`` and ``TYPE hash``, so the
helper keys of a lock (fence counter, waiters' line, doorbells, a force release's
marker) are skipped by the server, and reads each page of keys with one
non-transactional pipeline (``HGETALL`` and ``PTTL`` per key, one ``TIME``): listing
10,000 locks costs a few dozen round trips, not 20,000.  ``SCAN`` may return a key more
than once; :func:`iter_locks` yields it once.  A lock that expires between ``SCAN`` and
the read is left out.  On Redis Cluster each master is scanned in turn, with a plain
client of its own (:func:`node_clients`), so each page is read with one pipeline (and
one TIME) on the server that has its keys.

Ages come from the server's clock (``TIME`` minus the hold's ``acquired_at``), so they
are right whatever the clock of the machine that asks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...core.errors import BackendUnavailable, DLockError
from ...core.holds import SUMMARY_FIELDS, HoldChanged, HoldInfo
from ...core.lock_args import DEFAULT_PREFIX
from ...core.protocol import new_op_id
from .cluster import node_clients
from .hashtag import name_of_key
from .hashtag import scan_pattern as _scan_pattern
from .keyspace import HOLD_FIELDS, HOLD_NUMBERS, LockKeys, decode
from .refusals import refusal
from .released import clean_text
from .scripts import FORCE_RELEASE, READ_HOLD
from .semaphore_inspect import (
    force_release_semaphore,
    is_semaphore,
    read_semaphore,
    semaphore_infos,
)

#: The name this module used before the hold's description moved to the core.

logger = logging.getLogger("celery_dlock.inspect")

__all__ = [
    "SUMMARY_FIELDS",
    "HoldChanged",
    "HoldInfo",
    "force_release",
    "get_lock",
    "iter_locks",
    "lock_name_of",
    "node_clients",
    "release_matching",
    "scan_pattern",
    "waiting_counts",
]

# Hash fields that HoldInfo shows under their own name (or turns into ttl/held_for);
# every other field of the hash goes to HoldInfo.extra.
_KNOWN = frozenset({"owner", "count", "fence", "acquired_at", "ttl", "ops", "prev",
                    "line", "task_id", "task_name", "worker", "pid", "host"})

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError)
#: How often :func:`force_release` without a fence reads a hold that changed hands.
_FORCE_ATTEMPTS = 3


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _as_fields(raw: Mapping[Any, Any] | Iterable[Any]) -> dict[str, str]:
    """A hash as ``{str: str}``, from an ``HGETALL`` mapping or a flat script reply."""
    if isinstance(raw, Mapping):
        return {_text(k): _text(v) for k, v in raw.items()}
    flat = list(raw)
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _text(value: Any) -> str:
    """A field of a hold as text; bytes that are not UTF-8 (foreign data) escaped."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _lease(ttl_ms: str | None) -> float | None:
    """The ``ttl`` field of a hold (ms, the longest asked for) in seconds."""
    ms = _int(ttl_ms)
    return ms / 1000.0 if ms is not None and ms > 0 else None


def _lock_info(name: str, fields: Mapping[str, str], pttl_ms: int | None,
               now_ms: int | None) -> HoldInfo | None:
    owner = fields.get("owner")
    if owner is None:
        return None  # not one of our holds (or a half-written one): not a lock
    acquired_at = _int(fields.get("acquired_at"))
    held_for = None
    if acquired_at is not None and now_ms is not None:
        held_for = max(0, now_ms - acquired_at) / 1000.0
    ttl = pttl_ms / 1000.0 if pttl_ms is not None and pttl_ms >= 0 else None
    return HoldInfo(
        key=name,
        task_name=fields.get("task_name"),
        task_id=fields.get("task_id"),
        worker=fields.get("worker"),
        pid=_int(fields.get("pid")),
        owner=owner,
        count=_int(fields.get("count")) or 0,
        fence=_int(fields.get("fence")),
        ttl=ttl,
        held_for=held_for,
        host=fields.get("host"),
        extra={k: v for k, v in sorted(fields.items()) if k not in _KNOWN},
        lease=_lease(fields.get("ttl")),
    )


def _server_ms(reply: Any) -> int:
    secs, usecs = reply
    return int(secs) * 1000 + int(usecs) // 1000


def scan_pattern(prefix: str) -> str:
    """The ``SCAN MATCH`` pattern of every lock hash under ``prefix``."""
    return _scan_pattern(prefix)


def lock_name_of(prefix: str, key: str) -> str | None:
    """The lock name in a lock hash's key (None for other keys); see
    :mod:`celery_dlock.backends.redis.hashtag` for the two forms of key."""
    return name_of_key(prefix, key)


def _unavailable(exc: Exception, name: str | None = None) -> BackendUnavailable:
    return BackendUnavailable(f"Redis unavailable: {exc}", lock_name=name)


def _refused(exc: ResponseError, client: Any, keys: LockKeys,
             name: str) -> DLockError:
    """A force release's refusal: foreign data under the lock's keys, or a command
    Redis refused (left to the caller as BackendUnavailable)."""
    return refusal(exc, client, keys, name) or BackendUnavailable(
        f"Redis refused a force release: {exc}", lock_name=name)


def _read_hold(client: Any, key: str) -> tuple[dict[str, str], int, int]:
    """One lock hash, its remaining ttl (ms) and the server's clock (ms), at one
    moment (a script: a cluster client refuses TIME in a pipeline)."""
    reply = READ_HOLD(client, (key,), ())
    return _as_fields(reply[3:]), int(reply[0]), int(reply[1]) * 1000 + \
        int(reply[2]) // 1000


def _read_page(client: Any, page: list[tuple[str, str]]) -> list[HoldInfo]:
    pipe = client.pipeline(transaction=False)
    for key, _ in page:
        pipe.hgetall(key)
        pipe.pttl(key)
    pipe.time()
    replies = pipe.execute()
    now_ms = _server_ms(replies[-1])
    out = []
    for i, (_, name) in enumerate(page):
        raw, pttl = replies[2 * i], replies[2 * i + 1]
        if not raw or int(pttl) == -2:
            continue  # expired or released since SCAN saw it
        info = _lock_info(name, _as_fields(raw), int(pttl), now_ms)
        if info is not None:
            out.append(info)
    return out


def iter_locks(client: Any, prefix: str = DEFAULT_PREFIX, *,
               page_size: int = 500) -> Iterator[HoldInfo]:
    """Every lock held under ``prefix``, a page of ``page_size`` keys at a time.

    Needs Redis 6.0 or later (``SCAN ... TYPE``).  Raises :class:`BackendUnavailable`
    when Redis cannot be reached.  The order is Redis's (unsorted).
    """
    seen: set[str] = set()
    try:
        for node in node_clients(client):
            page: list[tuple[str, str]] = []
            for raw_key in node.scan_iter(match=scan_pattern(prefix), count=page_size,
                                          _type="hash"):
                try:
                    key = decode(raw_key)
                except UnicodeDecodeError:
                    # Not a name this library wrote: another program's binary key.
                    logger.info("skipped a key that is not UTF-8 under prefix %r: %r",
                                prefix, raw_key)
                    continue
                name = lock_name_of(prefix, key)
                if name is None or key in seen:
                    continue
                seen.add(key)
                page.append((key, name))
                if len(page) >= page_size:
                    yield from _read_page(node, page)
                    page = []
            if page:
                yield from _read_page(node, page)
            # Semaphores: a sorted set of holders at the same kind of key.
            for raw_key in node.scan_iter(match=scan_pattern(prefix), count=page_size,
                                          _type="zset"):
                try:
                    key = decode(raw_key)
                except UnicodeDecodeError:
                    continue
                name = lock_name_of(prefix, key)
                if name is None or key in seen:
                    continue
                seen.add(key)
                yield from semaphore_infos(node, [(key, name)])
    except _UNAVAILABLE as exc:
        raise _unavailable(exc) from exc


def get_lock(client: Any, prefix: str, name: str) -> HoldInfo | None:
    """The lock ``name`` under ``prefix`` (None when nobody holds it)."""
    key = LockKeys.for_name(prefix, name).lock
    try:
        fields, pttl, now_ms = _read_hold(client, key)
    except _UNAVAILABLE as exc:
        raise _unavailable(exc, name) from exc
    except ResponseError:
        if not is_semaphore(client, key):
            raise
        return read_semaphore(client, key, name)
    if not fields:
        return None
    return _lock_info(name, fields, pttl, now_ms)


def waiting_counts(client: Any, prefix: str, names: Iterable[str]) -> dict[str, int]:
    """How many live waiters (blocked acquirers, e.g. the ``wait`` policy) each lock
    has: members of its line whose lease has not run out.  One pipeline."""
    names = list(names)
    if not names:
        return {}
    try:
        now_ms = _server_ms(client.time())
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.zcount(LockKeys.for_name(prefix, name).leases, now_ms, "+inf")
        counts = pipe.execute()
    except _UNAVAILABLE as exc:
        raise _unavailable(exc) from exc
    return {name: int(n) for name, n in zip(names, counts, strict=True)}


def _is_semaphore(client: Any, key: str, name: str) -> bool:
    try:
        return is_semaphore(client, key)
    except _UNAVAILABLE as exc:
        raise _unavailable(exc, name) from exc


def force_release(client: Any, prefix: str, name: str, *,
                  fence: int | None = None, by: str | None = None,
                  reason: str | None = None) -> HoldInfo | None:
    """Free the lock ``name`` whoever holds it, and wake the first waiter in line.

    Returns the hold that was freed (None when nothing was held).  With ``fence``, frees
    only the hold with that fencing token and raises :class:`HoldChanged` when another
    hold has the lock (for a confirmed release: what was shown is what is freed).

    Either way the script is told which hold to free: the one just read (its fence),
    with an operation id, so a call that redis-py re-sends after a lost reply changes
    nothing, even if another owner took the lock in between.  Without ``fence``, a hold
    that changed between that read and the release is read again (a few times).

    The holder is not stopped: its scheduler finds the hold gone and reports it lost
    (``on_lost``, ``signals.lock_lost``; ``ensure_held()`` raises) with the reason
    ``released by <by>: <reason>``, which the script leaves in a short-lived marker
    (:mod:`celery_dlock.backends.redis.released`).  ``by`` and ``reason`` are made one
    line of
    at most :data:`~celery_dlock.backends.redis.released.REASON_MAX` characters.
    """
    keys = LockKeys.for_name(prefix, name)
    if _is_semaphore(client, keys.lock, name):
        return force_release_semaphore(client, prefix, name, fence=fence, by=by,
                                       reason=reason)
    notes = (":by", clean_text(by), ":reason", clean_text(reason))
    for _ in range(_FORCE_ATTEMPTS):
        try:
            # The hold to free, its remaining ttl and the server's clock: the
            # script's reply has the freed hash, not its ttl.
            before, pttl, now_ms = _read_hold(client, keys.lock)
            if not before:
                return None
            if (fence is not None and _is_hold(before)
                    and before.get("fence") != str(fence)):
                # The named hold ended before this call and another holds the
                # lock.  Told by the read, not by the script: the script would ask
                # the counter whether this call freed the named hold, which a call
                # with another operation id answers wrongly once in 256 (the
                # counter keeps 8 bits of the id).
                raise _changed(name, fence, before.get("fence"),
                               _lock_info(name, before, pttl, now_ms))
            expected = before.get("fence") if fence is None else str(fence)
            conditions = ("fence", expected) if expected is not None else ()
            op = new_op_id()
            reply = FORCE_RELEASE(client, (keys.lock,), (*conditions, *notes, ":op", op))
        except _UNAVAILABLE as exc:
            raise _unavailable(exc, name) from exc
        except ResponseError as exc:
            raise _refused(exc, client, keys, name) from exc
        status = int(reply[0])
        if status == 0:
            return None
        fields = before if status == 2 else _as_fields(reply[1:])
        same_hold = "fence" in before and before["fence"] == fields.get("fence")
        info = _lock_info(name, fields, pttl if same_hold else None, now_ms)
        if status == -1:
            if fence is None:
                continue  # taken since it was read: read it again
            raise _changed(name, fence, fields.get("fence"), info)
        return info
    raise HoldChanged(f"the lock changed hands {_FORCE_ATTEMPTS} times while it was "
                      "being released; nothing was released", lock_name=name)


def _is_hold(fields: Mapping[str, str]) -> bool:
    """Whether ``fields`` have every field of a hold, its numbers numbers as the
    scripts' Lua reads them (what the scripts check before they touch a hash; anything
    else they refuse as foreign)."""
    return (all(fields.get(f) is not None for f in HOLD_FIELDS)
            and all(_lua_number(fields[f]) for f in HOLD_NUMBERS))


#: The white space Lua's ``tonumber`` skips around a number (C's isspace).
_LUA_SPACE = " \t\n\v\f\r"
_NAN_CHARS = re.compile(r"[+-]?nan\([0-9A-Za-z_]*\)", re.IGNORECASE)


def _lua_number(text: str) -> bool:
    """Whether Lua's ``tonumber`` (Redis's Lua 5.1: C's strtod, then a hex integer)
    reads ``text`` as a number.  Python's ``float`` alone differs both ways: it
    takes ``1_0`` and digits of other scripts, and refuses ``0x10``."""
    s = text.strip(_LUA_SPACE)
    if _NAN_CHARS.fullmatch(s):  # strtod's nan(chars)
        return True
    if not s.isascii() or "_" in s:
        return False
    try:
        float(s)
    except ValueError:
        if s.lstrip("+-")[:2].lower() != "0x":  # fromhex also reads 1e as 0x1e
            return False
        try:
            float.fromhex(s)  # 0x10, 0x1p3: strtod reads hex
        except ValueError:
            return False
    return True


def _changed(name: str, fence: int | None, now_fence: str | None,
             current: HoldInfo | None) -> HoldChanged:
    return HoldChanged(f"the lock is now held by another hold (fence {now_fence}, "
                       f"not {fence}); nothing was released", lock_name=name,
                       current=current)


def release_matching(client: Any, prefix: str, name: str,
                     conditions: Mapping[str, str]) -> bool:
    """Free ``name`` only if its hold's metadata matches every one of ``conditions``
    (for a worker freeing the lock of a child process that died: that task id in
    that pid); True when it freed a hold.  The conditions name one hold, which no
    newer hold can match, so a re-sent call changes nothing; no marker is left (the
    holder is gone, nobody would read it)."""
    keys = LockKeys.for_name(prefix, name)
    if _is_semaphore(client, keys.lock, name):
        return force_release_semaphore(client, prefix, name,
                                       conditions=conditions) is not None
    args = [x for pair in conditions.items() for x in pair]
    try:
        reply = FORCE_RELEASE(client, (keys.lock,), args)
    except _UNAVAILABLE as exc:
        raise _unavailable(exc, name) from exc
    except ResponseError as exc:
        raise _refused(exc, client, keys, name) from exc
    return int(reply[0]) == 1
