"""The Redis keys of one lock, what its hash says, and what may stand in for a client.

See :mod:`celery_dlock.backends.redis.scripts` for what each key holds and
:mod:`celery_dlock.backends.redis.hashtag` for how a name becomes a key.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.exceptions import RedisError

from ...core.errors import Holder, InvalidLockConfig
from .hashtag import lock_key
from .waiters import doorbell_suffix

__all__ = ["FENCE_SUFFIX", "HOLD_FIELDS", "HOLD_NUMBERS", "LINE_FIELD", "MARKER_SUFFIX",
           "RELEASED_SUFFIX", "SUFFIXES", "UNTOUCHED", "LockKeys", "check_client",
           "decode", "foreign_keys", "parse_holder"]

#: What a key of a lock must be (TYPE), to name a key holding foreign data.
_KEY_TYPES = {"lock": "hash", "fence": "string", "queue": "zset", "leases": "zset",
              "released": "hash"}
#: The fields every hold has (the scripts write them all at once, and delete the hash
#: as a whole): a hash at a lock's key without one of them is another application's.
#: A hold's other fields are metadata, free-form (``info=``): they tell nothing.
HOLD_FIELDS = ("owner", "count", "fence", "acquired_at", "ttl", "ops")
#: Those of :data:`HOLD_FIELDS` whose values are numbers (the scripts read them so).
HOLD_NUMBERS = tuple(f for f in HOLD_FIELDS if f not in ("owner", "ops"))
#: The field a hold's hash gets when a waiter joins the line during the hold (or the
#: line is not empty when it is granted): its final release rings the first in line
#: only then, so that a release of a lock nobody waited for reads no line.
LINE_FIELD = "line"
#: The scripts' own bookkeeping in a hold's hash (the last operation ids and their
#: results, the fence of the hold before, the line's flag): never shown as a holder's
#: metadata.
BOOKKEEPING = ("ops", "prev", LINE_FIELD)
#: What a conflict's message says of the foreign data, after naming it.
UNTOUCHED = ("another application's data is under this lock's keys and was left "
             "untouched (use another prefix or lock name)")
# The suffixes of a lock's helper keys after its hash's key, defined once: the Lua
# scripts get them from here (:mod:`celery_dlock.backends.redis.scripts`).
#: The fence counter.
FENCE_SUFFIX = ":fence"
#: The FIFO line of waiters and their leases.
QUEUE_SUFFIX = ":q"
LEASES_SUFFIX = ":ql"
#: A waiter's doorbell (followed by the sha1 of its owner).
DOORBELL_SUFFIX = ":w:"
#: The suffix of a force release's marker (:mod:`celery_dlock.backends.redis.released`).
RELEASED_SUFFIX = ":released"
#: A queue marker (enqueue-time uniqueness; :mod:`celery_dlock.backends.redis.markers`).
MARKER_SUFFIX = ":m"
#: A semaphore holder's hash (followed by the sha1 of its owner).
HOLDER_SUFFIX = ":h:"
#: Every suffix, by the name the Lua scripts know it by.
SUFFIXES = {"FENCE_SUFFIX": FENCE_SUFFIX, "QUEUE_SUFFIX": QUEUE_SUFFIX,
            "LEASES_SUFFIX": LEASES_SUFFIX, "DOORBELL_SUFFIX": DOORBELL_SUFFIX,
            "RELEASED_SUFFIX": RELEASED_SUFFIX}


class LockKeys(NamedTuple):
    """The Redis keys of one lock or semaphore (one layout for both); all share one
    hash tag (see :mod:`celery_dlock.backends.redis.hashtag`)."""

    lock: str
    fence: str
    queue: str
    leases: str
    doorbell_prefix: str
    released: str

    @classmethod
    def for_name(cls, prefix: str, name: str) -> LockKeys:
        base = lock_key(prefix, name)
        return cls(base, base + FENCE_SUFFIX, base + QUEUE_SUFFIX, base + LEASES_SUFFIX,
                   base + DOORBELL_SUFFIX, base + RELEASED_SUFFIX)

    def doorbell(self, owner: str) -> str:
        return self.doorbell_prefix + doorbell_suffix(owner)

    def holder(self, owner: str) -> str:
        """A semaphore's hash of ``owner``'s hold (a lock keeps its one holder in
        :attr:`lock`)."""
        return self.lock + HOLDER_SUFFIX + doorbell_suffix(owner)


def decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_holder(flat: Sequence[Any], pttl_ms: int | None, now_ms: int | None) -> Holder:
    """Build a :class:`Holder` from a flat ``HGETALL`` reply."""
    fields = {decode(flat[i]): decode(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
    owner = fields.pop("owner", None)
    count = int(fields.pop("count", "0") or 0)
    fence_text = fields.pop("fence", None)
    acquired_at = fields.pop("acquired_at", None)
    fields.pop("ttl", None)
    for internal in BOOKKEEPING:
        fields.pop(internal, None)
    age = None
    if acquired_at is not None and now_ms is not None:
        age = max(0.0, (now_ms - int(acquired_at)) / 1000.0)
    ttl = pttl_ms / 1000.0 if pttl_ms is not None and pttl_ms >= 0 else None
    return Holder(
        owner=owner,
        count=count,
        fence=int(fence_text) if fence_text else None,
        age=age,
        ttl=ttl,
        info=fields,
    )


def foreign_keys(client: Any, keys: LockKeys) -> str:
    """A sentence naming the keys of ``keys`` that hold another kind of data."""
    found = []
    for field, expected in _KEY_TYPES.items():
        key = getattr(keys, field)
        try:
            kind = decode(client.type(key))
        except RedisError:
            continue
        if kind not in ("none", expected):
            found.append(f"{key!r} holds a {kind}, not a {expected}")
    what = ("; ".join(found)
            or f"a key of {keys.lock!r} holds another kind of data")
    return f"{what}: {UNTOUCHED}"


#: Client classes already found to be synchronous redis-py clients (a lock is made per
#: task attempt: the checks below run once per class, not per lock).
_GOOD_CLIENT_TYPES: set[type] = set()


def check_client(client: Any, name: str | None) -> None:
    """InvalidLockConfig unless ``client`` is a synchronous redis-py client."""
    if type(client) in _GOOD_CLIENT_TYPES:
        return
    if client is None:
        raise InvalidLockConfig("a lock needs a Redis client", lock_name=name)
    if isinstance(client, (str, bytes)):
        raise InvalidLockConfig(
            "a lock needs a Redis client, not a URL: pass redis.Redis.from_url(url)",
            lock_name=name)
    if type(client).__module__.startswith("redis.asyncio") or \
            inspect.iscoroutinefunction(getattr(client, "execute_command", None)):
        raise InvalidLockConfig("a lock needs a synchronous Redis client; got a "
                                "redis.asyncio client", lock_name=name)
    if not (callable(getattr(client, "evalsha", None))
            and callable(getattr(client, "eval", None))):
        raise InvalidLockConfig(
            f"a lock needs a Redis client (redis.Redis or redis.cluster.RedisCluster), "
            f"got {type(client).__name__}", lock_name=name)
    if type(client).__module__.startswith("redis."):  # a class of its own may change
        _GOOD_CLIENT_TYPES.add(type(client))
