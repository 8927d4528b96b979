"""The error family: hierarchy, messages naming the lock, pickling with context."""

from __future__ import annotations

import copy
import pickle

import pytest

import celery_dlock
from celery_dlock import (
    BackendUnavailable,
    DLockError,
    Holder,
    InvalidLockConfig,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    UnkeyableArgument,
)

HOLDER = Holder(owner="host:1:abc", count=2, fence=17, age=3.25, ttl=12.5,
                info={"task_id": "t-42", "task_name": "proj.reduce_stock",
                      "worker": "celery@w1", "pid": "4242", "host": "w1"})

ERRORS = [
    DLockError("something broke", lock_name="stock:1"),
    InvalidLockConfig("ttl must be positive", lock_name="stock:1"),
    UnkeyableArgument("object address in key", lock_name="stock:1"),
    LockNotAcquired(lock_name="stock:1", holder=HOLDER),
    LockNotAcquired("custom text", lock_name="stock:1"),
    LockNotOwned("cannot release", lock_name="stock:1"),
    LockLost("lock expired", lock_name="stock:1"),
    BackendUnavailable("Redis unavailable", lock_name="stock:1"),
]


@pytest.mark.parametrize("cls", [InvalidLockConfig, UnkeyableArgument, LockNotAcquired,
                                 LockNotOwned, LockLost, BackendUnavailable])
def test_every_error_is_a_dlock_error(cls):
    assert issubclass(cls, DLockError)
    assert issubclass(cls, Exception)


def test_config_errors_are_also_value_errors():
    assert issubclass(InvalidLockConfig, ValueError)
    assert issubclass(UnkeyableArgument, ValueError)
    assert not issubclass(LockNotAcquired, ValueError)


def test_public_names_are_exported():
    for name in ("DLockError", "LockNotAcquired", "LockNotOwned", "LockLost",
                 "BackendUnavailable", "RedisLock"):
        assert name in celery_dlock.__all__
        assert hasattr(celery_dlock, name)


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_str_names_the_lock(err):
    assert "stock:1" in str(err)
    assert err.lock_name == "stock:1"


def test_lock_name_is_not_repeated_when_the_message_has_it():
    err = LockLost("lock 'a' expired", lock_name="a")
    assert str(err).count("a'") == 1
    assert str(DLockError("plain")) == "plain"


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_pickle_round_trip_keeps_context(err):
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(err, protocol=protocol))
        assert type(back) is type(err)
        assert back.lock_name == err.lock_name
        assert str(back) == str(err)
        assert back.args == err.args
        assert getattr(back, "holder", None) == getattr(err, "holder", None)
    assert str(copy.copy(err)) == str(err)


def test_pickled_contention_error_keeps_holder_details():
    err = LockNotAcquired(lock_name="stock:1", holder=HOLDER)
    back = pickle.loads(pickle.dumps(err))
    assert back.holder == HOLDER
    assert back.holder.task_id == "t-42"
    assert back.holder.pid == 4242
    with pytest.raises(LockNotAcquired):
        raise back


def test_contention_message_describes_the_holder():
    text = str(LockNotAcquired(lock_name="stock:1", holder=HOLDER))
    assert "proj.reduce_stock[t-42]" in text
    assert "celery@w1 pid 4242" in text
    assert "ttl left 12.5s" in text
    assert "for 3.2s" in text
    plain = str(LockNotAcquired(lock_name="stock:1"))
    assert "held elsewhere" in plain and "stock:1" in plain


def test_holder_helpers():
    assert Holder().describe() == "unknown holder"
    assert Holder(owner="o").describe() == "owner o"
    assert Holder(info={"pid": "not-a-number"}).pid is None
    d = HOLDER.as_dict()
    assert d["owner"] == "host:1:abc" and d["fence"] == 17 and d["task_id"] == "t-42"
    with pytest.raises(AttributeError):
        HOLDER.owner = "someone else"  # type: ignore[misc]
