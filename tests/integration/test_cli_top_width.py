"""``celery dlock top`` at 80x24: a held lock's row fits, every column kept."""

from __future__ import annotations

import os
import uuid

import cli_app
import redis

from celery_dlock import RedisLock


def test_a_held_lock_row_fits_80_columns(redis_url: str) -> None:
    prefix = f"dltop{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_url)
    key = "inventory:warehouse-north:product:1234567890:variant:blue-xl"
    lock = RedisLock(r, key, ttl=60, auto_renew=False, prefix=prefix, info={
        "task_name": "shop.inventory.tasks.reduce_stock_for_marketplace_order",
        "task_id": str(uuid.uuid4()),
        "worker": "celery@worker-pool-7.eu-central-1.internal.example.com"})
    assert lock.acquire(blocking=False)
    try:
        proc = cli_app.run_cli(redis_url, prefix, "top", "--iterations", "1",
                               "--interval", "0.1",
                               extra_env={"COLUMNS": "80", "LINES": "24"})
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        (header,) = [line for line in lines if line.startswith("KEY")]
        (row,) = [line for line in lines if line.startswith("inv")]
        for column in ("KEY", "TASK_NAME", "TASK_ID", "WORKER", "PID", "COUNT",
                       "FENCE", "TTL", "HELD_FOR", "WAITING"):
            assert column in header, header
        assert len(header) <= 80 and len(row) <= 80, f"\n{header}\n{row}"
        assert "~" in row  # the long names were cut...
        assert f" {os.getpid()} " in row  # ...the numbers were not
        assert row.split()[-1] == "0"  # WAITING, the last column, is there
    finally:
        lock.release_all()
        r.close()
