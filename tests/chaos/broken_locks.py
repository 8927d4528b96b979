"""Locks broken on purpose, to show the chaos checker catches each way a lock can fail.

Each is :class:`~celery_dlock.RedisLock` with one rule of the hold state machine's
backend side taken away (:class:`celery_dlock.core.hold.Hold` asks a backend for
``_send_acquire`` and ``_send_release``; these answer wrongly):

* :class:`NoOwnerCheck`: release deletes the lock whoever holds it (celery-once's and
  celery-singleton's ``DEL``);
* :class:`NoExclusion`: every acquire succeeds, with a fresh fence;
* :class:`ConstantFence`: real exclusion, but every hold gets fence 1.
"""

from __future__ import annotations

from typing import Any

from celery_dlock import RedisLock
from celery_dlock.core.hold import Grant, Refused
from celery_dlock.core.protocol import OK


class NoOwnerCheck(RedisLock):
    def _send_release(self, owner: str, op: str) -> int:
        self.client.delete(self.keys.lock)
        return OK


class NoExclusion(RedisLock):
    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        return Grant(int(self.client.incr(self.keys.fence)), reentry)

    def _send_release(self, owner: str, op: str) -> int:
        return OK

    def _read_status(self, owner: str) -> int:
        return OK


class ConstantFence(RedisLock):
    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        reply = super()._send_acquire(owner, op, queue=queue, reentry=reentry)
        return Grant(1, reply.reentered) if isinstance(reply, Grant) else reply


#: name -> lock class (``real``: the lock as shipped).
KINDS: dict[str, Any] = {"real": RedisLock, "no_owner_check": NoOwnerCheck,
                         "no_exclusion": NoExclusion, "constant_fence": ConstantFence}
