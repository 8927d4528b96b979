"""Errors keep their context through every result serializer (issue 11, item 8).

A ``LockNotAcquired`` raised on a worker is stored by the result backend and rebuilt by
the client's ``get()``.  Celery pickles exceptions only with the pickle serializer; with
json, yaml and msgpack it stores ``exc_module``, ``exc_type`` and ``exc.args`` and
rebuilds with ``cls(*args)``.  These tests run a real in-process worker against a real
Redis result backend with each serializer.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.backends.base import BaseBackend
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app

from celery_dlock import (
    BackendUnavailable,
    DLockError,
    Holder,
    InvalidLockConfig,
    LockedTask,
    LockLost,
    LockLostInterrupt,
    LockNotAcquired,
    LockNotOwned,
    RedisLock,
    UnkeyableArgument,
)
from celery_dlock.backends.redis.inspect import HoldChanged

SERIALIZERS = [
    "json",
    "pickle",
    "yaml",
    pytest.param("msgpack", marks=pytest.mark.skipif(
        importlib.util.find_spec("msgpack") is None, reason="msgpack not installed")),
]


def _app(redis_url: str, serializer: str, tag: str) -> Celery:
    app = test_app(
        f"err{tag}", redis_url, queue=f"q-err{tag}", prefix=f"dlt{tag}",
        result_serializer=serializer,
        accept_content=["json", serializer],
        result_accept_content=["json", serializer],
        result_expires=600,
    )
    return app


@pytest.fixture(params=SERIALIZERS)
def worker_app(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Any]:
    tag = uuid.uuid4().hex[:8]
    app = _app(redis_url, request.param, tag)

    @app.task(base=LockedTask, shared=False, name=f"err{tag}.raiser",
              lock_key="row:{x}", on_contention="raise")
    def raiser(x: str) -> str:
        return x

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        yield app, raiser, f"dlt{tag}"
    close_app(app)


def test_lock_not_acquired_keeps_lock_name_and_holder(worker_app, r):
    _, raiser, prefix = worker_app
    info = {"task_id": "held-by-7f3c", "task_name": "other.task", "worker": "w1@box"}
    with RedisLock(r, "row:42", ttl=30, prefix=prefix, info=info,
                   auto_renew=False) as held:
        result = raiser.delay("42")
        with pytest.raises(LockNotAcquired) as caught:
            result.get(timeout=20)
        assert held.owned()
    err = caught.value
    assert type(err) is LockNotAcquired
    assert err.lock_name == "row:42"
    holder = err.holder
    assert isinstance(holder, Holder)
    assert holder.task_id == "held-by-7f3c"
    assert holder.task_name == "other.task"
    assert holder.worker == "w1@box"
    assert holder.age is not None and 0 <= holder.age < 20
    assert holder.ttl is not None and 0 < holder.ttl <= 30
    assert holder.fence is not None and holder.fence >= 1
    assert holder.count == 1
    assert "held-by-7f3c" in str(err) and "row:42" in str(err)


# -- without a worker: what each backend stores and rebuilds --------------------------

_HOLDER = Holder(owner="h:1:abc", count=2, fence=7, age=1.5, ttl=28.5,
                 info={"task_id": "t-1", "task_name": "n", "worker": "w@h", "pid": "12"})

ERRORS = [
    DLockError("plain"),
    DLockError("named", lock_name="a:1"),
    InvalidLockConfig("app.conf.dlock_ttl must be positive", lock_name=None),
    UnkeyableArgument("cannot key x", lock_name="k"),
    LockNotAcquired(lock_name="stock:1", holder=_HOLDER),
    LockNotAcquired("custom text", lock_name="stock:2"),
    LockNotOwned("not yours", lock_name="s"),
    LockLost("expired", lock_name="s:3"),
    BackendUnavailable("Redis unavailable: boom", lock_name="s:4"),
    LockLostInterrupt(lock_name="s:5"),
    HoldChanged("changed", lock_name="s:6"),
]


def _same(a: DLockError, b: DLockError) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b)
    assert a.lock_name == b.lock_name
    assert a.message == b.message
    assert getattr(a, "holder", None) == getattr(b, "holder", None)


@pytest.mark.parametrize("serializer", [s if isinstance(s, str) else s.values[0]
                                        for s in SERIALIZERS])
@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_backend_round_trip(serializer: str, err: DLockError) -> None:
    if serializer == "msgpack" and importlib.util.find_spec("msgpack") is None:
        pytest.skip("msgpack not installed")
    app = Celery("rt", set_as_current=False)
    app.conf.update(result_serializer=serializer,
                    result_accept_content=[serializer], accept_content=[serializer])
    backend = BaseBackend(app)
    stored = backend.prepare_exception(err)
    # Through the wire format and back, as a result backend would.
    wire = backend.decode(backend.encode({"result": stored}))["result"]
    rebuilt = backend.exception_to_python(wire)
    _same(err, rebuilt)


def test_json_args_are_plain_data() -> None:
    err = LockNotAcquired(lock_name="stock:1", holder=_HOLDER)
    text = json.dumps(err.args)  # nothing falls back to repr()
    again = LockNotAcquired(*json.loads(text))
    _same(err, again)
    _same(err, pickle.loads(pickle.dumps(err)))


def test_positional_construction_still_means_message() -> None:
    err = LockNotAcquired("held", lock_name="k")
    assert err.message == "held" and err.lock_name == "k" and err.holder is None
    assert DLockError("m").lock_name is None
