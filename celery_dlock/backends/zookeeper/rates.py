"""Per-name rates (``lock_rate``) on ZooKeeper: one node per rated name, written by
compare-and-set around the one decision (:func:`celery_dlock.core.rates.gcra_take`).

**The node.**  ``/<prefix>/.rates/<name>`` (:mod:`.nodes`), persistent; its data is
the name's :class:`~celery_dlock.core.rates.RateDocument` as JSON (:func:`encode`).
Other data there (another application's) is :class:`~celery_dlock.LockKeyConflict`,
and is never overwritten.  A state past its ``expires`` counts as none: the next
take of the name overwrites it (nothing is ever deleted; one small node per name
ever rated stays).

**The clock** is the ensemble's (:mod:`.clock`): a take first sets the clock node
``/<prefix>/.rates/.clock`` and takes ``now`` from the stat it answers, so every
worker decides on the same time.  That costs one more quorum write per take (a take
is two writes and a read: the clock's write and the read go out together, one round
trip).  The clock counts whole milliseconds: rates are kept to the microsecond as
everywhere, but calls within one millisecond all see the same ``now``.

**The compare-and-set.**  A take reads the name's node (data and ``stat.version``),
decides, and writes ``set(path, data, version)`` (someone wrote it meanwhile:
``BadVersionError``, read again) or, when there is none, ``create(path, data)``
(someone made it meanwhile: ``NodeExistsError``, read again); at most :data:`TRIES`
times, then BackendUnavailable.  A write whose reply was lost (the connection
dropped mid-call) is sent again once, by reading again: if the first landed, the
read finds the call's operation id and its first answer (gcra_take remembers them),
and no second slot is taken; if it did not, the call is decided anew.

**Reading** (``state``, ``states``: ``celery dlock show``, ``ls``, ``top``) creates
nothing: it sets the clock node only where it is already there (a take made it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ...core.errors import BackendUnavailable, LockKeyConflict
from ...core.rates import (
    Rate,
    RateDecision,
    RateDocument,
    RateState,
    TakesByOperation,
    gcra_take,
    interval_tau,
    rate_state,
)
from . import clock, versioned
from .nodes import clock_path, rate_path, rates_path
from .url import ZkSpec

__all__ = ["TRIES", "ZkRates", "decode", "encode"]

#: How many times a take reads and tries to write before giving up (the node kept
#: changing under it: BackendUnavailable), as on the SQL stores.
TRIES = 100
_MARK = "dlock_rate"
_TAKE = "a rate take"
_READ = "a rate read"


def encode(document: RateDocument) -> bytes:
    """A rate node's data."""
    return json.dumps({_MARK: 1, "tat": document.tat, "interval": document.interval,
                       "tau": document.tau, "ops": [list(op) for op in document.ops],
                       "slots": list(document.slots), "expires": document.expires},
                      separators=(",", ":")).encode()


def decode(raw: bytes | None, where: str, name: str | None) -> RateDocument:
    """:func:`encode` read back; LockKeyConflict when it is not celery-dlock's."""
    try:
        data: Any = json.loads((raw or b"").decode())
        if not isinstance(data, dict) or data.get(_MARK) != 1:
            raise ValueError
        return RateDocument(
            int(data["tat"]), int(data["interval"]), int(data["tau"]),
            tuple((str(op), int(code), int(given)) for op, code, given in data["ops"]),
            tuple(int(slot) for slot in data["slots"]), int(data["expires"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise LockKeyConflict(f"ZooKeeper node {where!r} holds data celery-dlock did "
                              f"not write (another application uses this path?): "
                              f"nothing was changed; choose another prefix or name",
                              lock_name=name) from None


def _us(stat: Any) -> int:
    return clock.mtime_ms(stat) * 1000


class ZkRates(TakesByOperation):
    """The :class:`~celery_dlock.core.protocol.RateStore` of one ZooKeeper ensemble
    (see the module text)."""

    def __init__(self, spec: ZkSpec) -> None:
        self.spec = spec

    # -- the clock and the node ---------------------------------------------------------

    def _tick(self, prefix: str, name: str | None, *, create: bool) -> int | None:
        """The ensemble's clock now (us); None when there is no clock node and
        ``create`` is false."""
        now = clock.tick(self.spec, clock_path(rates_path(prefix)),
                         _TAKE if create else _READ, name, create=create)
        return None if now is None else now * 1000

    def _read(self, prefix: str, name: str) -> tuple[int, int | None,
                                                     RateDocument | None]:
        """The clock (us), and the name's node read with it: its version and state
        (live or not), or None twice."""
        path = rate_path(prefix, name)
        now, raw, stat = clock.read_at(self.spec, clock_path(rates_path(prefix)),
                                       path, _TAKE, name)
        if stat is None:
            return now * 1000, None, None
        return now * 1000, int(stat.version), decode(raw, path, name)

    def _insert(self, prefix: str, name: str, document: RateDocument) -> bool:
        """Make ``name``'s node; False (nothing changed) when there is one."""
        return versioned.write(self.spec, rate_path(prefix, name), encode(document),
                               None, _TAKE, name)

    def _update(self, prefix: str, name: str, version: int,
                document: RateDocument) -> bool:
        """Write ``name``'s node if still at ``version``; False when it is not (or
        it is gone)."""
        return versioned.write(self.spec, rate_path(prefix, name), encode(document),
                               version, _TAKE, name)

    # -- the store ----------------------------------------------------------------------

    def take_op(self, prefix: str, name: str, rate: Rate, slot: int | None,
                op: str) -> RateDecision:
        """:meth:`take` as the call ``op`` (the same op twice takes one slot)."""
        interval, tau = interval_tau(rate)
        resent = False
        for _ in range(TRIES):
            now, version, document = self._read(prefix, name)
            live = document if document is not None and document.expires > now \
                else None
            answer = gcra_take(live, now, interval, tau,
                               None if slot is None else int(slot), op)
            try:
                written = answer.document is None or (
                    self._insert(prefix, name, answer.document) if version is None
                    else self._update(prefix, name, version, answer.document))
            except BackendUnavailable:
                if resent:
                    raise
                resent = True  # it may have landed: the read tells
                continue
            if written:
                if answer.code == 1:
                    return RateDecision(True)
                return RateDecision(False, answer.wait_us / 1_000_000, answer.given_us)
        raise BackendUnavailable(
            f"ZooKeeper: the rate state of {name!r} kept changing under this call "
            f"({TRIES} tries); try again", lock_name=name)

    def _node(self, prefix: str, name: str) -> tuple[RateDocument, Any] | None:
        """``name``'s state (live or not) and its node's stat; None: no node."""
        path = rate_path(prefix, name)
        found = versioned.get(self.spec, path, _READ, name)
        return None if found is None else (decode(found[0], path, name), found[1])

    @staticmethod
    def _live(found: tuple[RateDocument, Any], now: int | None) -> RateState | None:
        document, stat = found
        if now is None:  # no clock node: the node's own last write is the latest
            now = _us(stat)
        if document.expires <= now:
            return None
        return rate_state(document.tat, document.interval, document.tau, now)

    def state(self, prefix: str, name: str) -> RateState | None:
        found = self._node(prefix, name)
        if found is None:
            return None  # and no clock written
        return self._live(found, self._tick(prefix, name, create=False))

    def states(self, prefix: str) -> Iterator[tuple[str, RateState]]:
        """Every name under ``prefix`` with a live rate state, each once (another
        application's nodes there are left out)."""
        names = versioned.names(self.spec, rates_path(prefix), _READ)
        if not names:
            return
        now = self._tick(prefix, None, create=False)
        for name in names:
            try:
                found = self._node(prefix, name)
            except LockKeyConflict:
                continue  # not a rate of ours: not listed
            live = None if found is None else self._live(found, now)
            if live is not None:
                yield name, live
