"""A value and its JSON text are one call (issue 11, item 15).

A call with ``UUID(...)`` arguments and one with the same UUIDs as strings must take
one lock: the JSON wire format (and so a client in another language, ``send_task``, a
result passed down a chain) carries them as the same text.  The rule, for the default
key (task name + hashed arguments) and for plain template fields: see
:mod:`celery_dlock.task.keys`.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import uuid
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app

from celery_dlock import LockedTask, LockNotAcquired, RedisLock
from celery_dlock.task.keys import canonical, make_key_function

U = uuid.UUID("6f1c2b1e-8a51-4c1e-9a57-0c8a3f0e2d11")
WHEN = dt.datetime(2026, 11, 23, 18, 30, 5, 123456, tzinfo=dt.timezone.utc)


class Level(enum.IntEnum):
    HIGH = 3


class Mode(str, enum.Enum):
    FAST = "fast"


class Plain(enum.Enum):
    A = 1


Pair = namedtuple("Pair", "a b")


def order(order_id, when=None, items=()):
    return None


@pytest.mark.parametrize(("value", "text"), [
    (U, str(U)),
    (WHEN, WHEN.isoformat()),
    (WHEN.date(), "2026-11-23"),
    (WHEN.time(), WHEN.time().isoformat()),
    (decimal.Decimal("12.50"), "12.50"),
    (Level.HIGH, 3),
    (Mode.FAST, "fast"),
    ((1, "a"), [1, "a"]),
    (Pair(1, 2), [1, 2]),
    ({1: "x", None: "y", 2.5: "z"}, {"1": "x", "null": "y", "2.5": "z"}),
    ({U: [U]}, {str(U): [str(U)]}),
    ([{"at": WHEN}], [{"at": WHEN.isoformat()}]),
])
def test_a_value_and_its_json_text_share_a_key(value, text):
    assert canonical(value) == canonical(text)
    key = make_key_function("shop.order", order, None)
    assert key((value,), {}) == key((text,), {})


@pytest.mark.parametrize(("a", "b"), [
    (1, "1"),
    (1, True),
    (1, 1.0),
    (b"ab", "ab"),
    ({1, 2}, [1, 2]),
    (Plain.A, 1),
    (dt.timedelta(seconds=3), 3.0),
    (decimal.Decimal("1.0"), decimal.Decimal("1.00")),
])
def test_values_json_tells_apart_keep_apart(a, b):
    assert canonical(a) != canonical(b)


def test_plain_template_fields_use_the_json_text():
    key = make_key_function("shop.order", order, "order:{order_id}:{when}")
    assert key((U, WHEN), {}) == f"order:{U}:{WHEN.isoformat()}"
    assert key((str(U), WHEN.isoformat()), {}) == key((U, WHEN), {})
    # A field with a format spec or an attribute gets the value itself.
    spec = make_key_function("shop.order", order, "day:{when:%Y-%m-%d}:{order_id.hex}")
    assert spec((U, WHEN), {}) == f"day:2026-11-23:{U.hex}"


# -- on a real worker: the UUID call contends with the string call ---------------------

@pytest.fixture
def worker_app(redis_url: str) -> Iterator[Any]:
    tag = uuid.uuid4().hex[:8]
    app = test_app(f"kc{tag}", redis_url, queue=f"q-kc{tag}", prefix=f"dlt{tag}",
                   task_serializer="json", result_expires=600)

    @app.task(base=LockedTask, shared=False, name=f"kc{tag}.order", on_contention="raise")
    def order_task(order_id: Any, when: Any = None) -> str:
        return "ran"

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        yield order_task, f"dlt{tag}"
    close_app(app)


def test_uuid_call_contends_with_the_string_call(worker_app, r):
    task, prefix = worker_app
    as_text = task.lock_name((str(U), WHEN.isoformat()))
    with RedisLock(r, as_text, prefix=prefix, ttl=30, auto_renew=False):
        result = task.delay(U, WHEN)
        with pytest.raises(LockNotAcquired) as caught:
            result.get(timeout=30)
    assert caught.value.lock_name == as_text
    assert task.delay(U, WHEN).get(timeout=30) == "ran"
