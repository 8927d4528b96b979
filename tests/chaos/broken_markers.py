"""Queue-marker stores broken on purpose, to show the modes checker catches each way
enqueue-time uniqueness can fail (as :mod:`broken_locks` does for the lock).

Each is :class:`~celery_dlock.backends.redis.markers.RedisMarkers` with one rule of the
claim taken away:

* :class:`AlwaysOurs`: every claim answers "ours" (as for a call's own re-queue), so
  every call is published, duplicates included;
* :class:`ReplaceRecordsNothing`: a replace moves the marker to the new call and keeps
  no record of the call it replaced, so once the new call has started (and removed the
  marker) the replaced one finds nothing against it.
"""

from __future__ import annotations

from typing import Any

from celery_dlock.backends.redis.markers import RedisMarkers
from celery_dlock.task.markers import OURS, QUEUED, REPLACED


class AlwaysOurs(RedisMarkers):
    def claim(self, prefix: str, name: str, task_id: str, ttl: float,
              **_: Any) -> tuple[int, str, float | None]:
        self.client.set(self.key(prefix, name), task_id, px=max(1, int(ttl * 1000)))
        return OURS, task_id, None


class ReplaceRecordsNothing(RedisMarkers):
    def claim(self, prefix: str, name: str, task_id: str, ttl: float, *,
              replace: bool, **rest: Any) -> tuple[int, str, float | None]:
        code, other, left = super().claim(prefix, name, task_id, ttl, replace=False,
                                          **rest)
        if replace and code == QUEUED:
            self.client.set(self.key(prefix, name), task_id,
                            px=max(1, int(ttl * 1000)))
            return REPLACED, other, None
        return code, other, left

    def confirm(self, prefix: str, name: str, task_id: str) -> bool:
        return True  # the replace stands: nothing was kept to confirm


#: name -> marker store class (``real``: as shipped).
KINDS: dict[str, Any] = {"real": RedisMarkers, "always_ours": AlwaysOurs,
                         "replace_records_nothing": ReplaceRecordsNothing}
