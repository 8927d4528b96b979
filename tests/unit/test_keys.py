"""Lock names from a task and its call arguments (pure functions, no Redis)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import uuid
from collections import namedtuple

import pytest

from celery_dlock.core.errors import InvalidLockConfig, UnkeyableArgument
from celery_dlock.task.keys import canonical, json_scalar, make_key_function


def buy(product_id, qty=1, *, note=None):
    return None


def bound_buy(self, product_id, qty=1):
    return None


def with_kwargs(a, **extra):
    return None


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Point:
    x: int
    y: int


Pair = namedtuple("Pair", "a b")


class Opaque:
    pass


class WithKey:
    def __init__(self, ident: int) -> None:
        self.ident = ident

    def __dlock_key__(self) -> int:
        return self.ident


# -- binding -------------------------------------------------------------------------

@pytest.mark.parametrize("lock_key", [None, "stock:{product_id}:{qty}"])
def test_positional_keyword_and_default_give_one_key(lock_key):
    key = make_key_function("shop.buy", buy, lock_key)
    names = {key((1,), {}), key((), {"product_id": 1}), key((1, 1), {}),
             key((1,), {"qty": 1}), key((), {"qty": 1, "product_id": 1})}
    assert len(names) == 1


@pytest.mark.parametrize("lock_key", [None, "stock:{product_id}:{qty}"])
def test_different_arguments_give_different_keys(lock_key):
    key = make_key_function("shop.buy", buy, lock_key)
    assert key((1,), {}) != key((2,), {})
    assert key((1,), {}) != key((1, 2), {})


def test_bound_task_drops_self():
    key = make_key_function("shop.buy", bound_buy, "stock:{product_id}", drop_first=True)
    assert key((7,), {}) == "stock:7"
    with pytest.raises(InvalidLockConfig, match="self"):
        make_key_function("shop.buy", bound_buy, "stock:{self}", drop_first=True)


def test_template_formats_values():
    key = make_key_function("shop.buy", buy, "stock:{product_id}")
    assert key(("abc",), {}) == "stock:abc"
    assert key((), {"product_id": 42, "qty": 3}) == "stock:42"


def test_template_supports_attribute_and_index_access():
    key = make_key_function("shop.buy", buy, "p:{product_id[0]}:{qty.real}")
    assert key((["x", "y"], 5), {}) == "p:x:5"


def test_template_over_var_keyword_arguments():
    key = make_key_function("t", with_kwargs, "k:{a}:{tenant}")
    assert key((1,), {"tenant": "acme"}) == "k:1:acme"
    with pytest.raises(UnkeyableArgument, match="tenant"):
        key((1,), {})


def test_hashed_key_names_the_task_and_is_stable():
    key = make_key_function("shop.buy", buy, None)
    name = key((1,), {"note": "x"})
    assert name.startswith("shop.buy:")
    assert len(name.split(":", 1)[1]) == 64
    assert name == make_key_function("shop.buy", buy, None)((1,), {"note": "x"})
    # another task with the same arguments gets another key
    assert make_key_function("shop.sell", buy, None)((1,), {"note": "x"}) != name


def test_lock_args_keys_on_a_subset():
    key = make_key_function("shop.buy", buy, None, ("product_id",))
    assert key((1, 5), {}) == key((1, 9), {"note": "other"})
    assert key((1,), {}) != key((2,), {})
    single = make_key_function("shop.buy", buy, None, "product_id")
    assert single((1,), {}) == key((1,), {})


def test_callable_key_gets_bound_arguments():
    seen = []

    def key_of(product_id, qty=1, *, note=None):
        seen.append((product_id, qty, note))
        return f"p{product_id}"

    key = make_key_function("shop.buy", buy, key_of)
    assert key((), {"product_id": 3}) == "p3"
    assert seen == [(3, 1, None)]


# -- declaration errors ----------------------------------------------------------------

def test_unknown_template_field_is_an_error_naming_task_and_field():
    with pytest.raises(InvalidLockConfig) as info:
        make_key_function("shop.buy", buy, "stock:{product}")
    assert "shop.buy" in str(info.value)
    assert "product" in str(info.value)


@pytest.mark.parametrize("template", ["stock:{}", "stock:{0}", ""])
def test_positional_or_empty_templates_are_errors(template):
    with pytest.raises(InvalidLockConfig):
        make_key_function("shop.buy", buy, template)


def test_unknown_lock_args_is_an_error():
    with pytest.raises(InvalidLockConfig, match="'nope'"):
        make_key_function("shop.buy", buy, None, ("product_id", "nope"))


def test_lock_args_with_a_template_is_an_error():
    with pytest.raises(InvalidLockConfig, match="lock_args"):
        make_key_function("shop.buy", buy, "stock:{product_id}", ("product_id",))


def test_lock_key_of_wrong_type_is_an_error():
    with pytest.raises(InvalidLockConfig, match="template"):
        make_key_function("shop.buy", buy, 42)  # type: ignore[arg-type]


# -- call-time errors ------------------------------------------------------------------

def test_object_with_memory_address_is_refused_by_hashed_key():
    key = make_key_function("shop.buy", buy, None)
    with pytest.raises(UnkeyableArgument, match="memory address"):
        key((Opaque(),), {})


def test_object_with_memory_address_is_refused_by_template():
    key = make_key_function("shop.buy", buy, "stock:{product_id}")
    with pytest.raises(UnkeyableArgument, match="memory address"):
        key((Opaque(),), {})


def test_nested_unkeyable_value_is_refused():
    key = make_key_function("shop.buy", buy, None)
    with pytest.raises(UnkeyableArgument, match="memory address"):
        key(({"a": [1, Opaque()]},), {})


def test_call_that_does_not_bind_is_an_error():
    key = make_key_function("shop.buy", buy, None)
    with pytest.raises(UnkeyableArgument, match="bind"):
        key((1, 2, 3), {})


@pytest.mark.parametrize("bad", [None, "", 5])
def test_callable_must_return_a_non_empty_string(bad):
    key = make_key_function("shop.buy", buy, lambda *a, **k: bad)
    with pytest.raises(UnkeyableArgument, match="non-empty string"):
        key((1,), {})


# -- canonical serialisation ------------------------------------------------------------

def test_canonical_is_order_independent_for_dicts_and_sets():
    assert canonical({"a": 1, "b": 2}) == canonical({"b": 2, "a": 1})
    assert canonical({3, 1, 2}) == canonical({2, 3, 1})


def test_canonical_tells_types_apart():
    assert canonical(1) != canonical("1")
    assert canonical(1) != canonical(True)
    assert canonical(b"ab") != canonical("ab")
    assert canonical([1, 2]) != canonical({1, 2})
    assert canonical(decimal.Decimal("1.0")) != canonical(1.0)


def test_canonical_handles_common_value_types():
    values = [
        dt.datetime(2026, 1, 2, 3, 4, 5), dt.date(2026, 1, 2), dt.timedelta(seconds=3),
        uuid.UUID(int=5), Color.RED, Point(1, 2), Pair(1, 2), decimal.Decimal("2.50"),
        float("nan"), WithKey(9), frozenset({1}), (1, "a"),
    ]
    texts = [canonical(v) for v in values]
    assert len(set(texts)) == len(texts)
    # equal values give equal text
    assert canonical(Point(1, 2)) == canonical(Point(1, 2))
    assert canonical(WithKey(9)) == canonical(WithKey(9))
    assert canonical(WithKey(9)) != canonical(WithKey(8))


def simple(a, b=2, c=None):
    return None


@pytest.mark.parametrize(("args", "kwargs"), [
    ((1,), {}), ((1, 5), {}), ((1, 5, "x"), {}), ((), {"a": 1}), ((1,), {"c": [1, 2]}),
    ((), {"c": 3, "a": 1, "b": 2}), ((1,), {"b": 2}),
])
def test_a_call_matched_without_bind_keys_as_bind_would(args, kwargs):
    """The quick match of a plain signature gives the name inspect's bind gives."""
    import hashlib
    import inspect

    bound = inspect.signature(simple).bind(*args, **kwargs)
    bound.apply_defaults()
    text = canonical(dict(bound.arguments), where="simple argument")
    want = "t.simple:" + hashlib.sha256(f"t.simple\n{text}".encode()).hexdigest()
    assert make_key_function("t.simple", simple, None)(args, kwargs) == want
    template = make_key_function("t.simple", simple, "s:{a}:{b}:{c}")
    assert template(args, kwargs) == "s:{a}:{b}:{c}".format(
        **{k: json_scalar(v) for k, v in bound.arguments.items()})


@pytest.mark.parametrize(("args", "kwargs"), [
    ((1, 2, 3, 4), {}), ((), {}), ((1,), {"a": 1}), ((1,), {"d": 1}), ((), {"b": 1}),
])
def test_a_call_that_does_not_match_a_plain_signature_is_refused_as_bind_would(
        args, kwargs):
    key = make_key_function("t.simple", simple, None)
    with pytest.raises(UnkeyableArgument, match="cannot bind the call"):
        key(args, kwargs)


@pytest.mark.parametrize(("task", "fun", "args", "kwargs", "name"), [
    ("shop.buy", buy, (1,), {"note": "x"},
     "shop.buy:4e1268177a56b3a0882d3fc66369aeac79f1049e0d5ab2218932253ecaa75305"),
    ("shop.buy", buy, (7,), {"note": "été ✓"},
     "shop.buy:261dda6ad57676d60b5c95555f477b314f74806bbf54d11c456614276a91909a"),
    ("t.simple", simple, (1, True, None), {},
     "t.simple:d3d84a2fec2573981834194dc85046c7db187c5cd9905f2ec871a482fd2ef570"),
    ("t.simple", simple, (1, [1, "a", {"z": 1, "b": [2]}]), {},
     "t.simple:666269909e8733ed958745167c5107f37f94ad0e38bf5b981dbf5e717d0cb78c"),
])
def test_a_hashed_name_is_the_same_in_every_release(task, fun, args, kwargs, name):
    """Workers of two releases (a rolling deploy) must name one call's lock alike, or
    both would run it: these names were made by 0.1.0 and may never change."""
    assert make_key_function(task, fun, None)(args, kwargs) == name


def test_canonical_text_is_the_same_in_every_release():
    value = {"b": 1, "a": "x", "é": None,
             "c": [1, 2.5, {"k": decimal.Decimal("1.10")}]}
    assert canonical(value) == (
        '{"__map__":[["\\"\\\\u00e9\\"",null],["\\"a\\"","x"],["\\"b\\"",1],'
        '["\\"c\\"",[1,2.5,{"__map__":[["\\"k\\"","1.10"]]}]]]}')


def test_a_dict_of_plain_values_is_canonical_as_any_other_mapping():
    """The quick path for a dict of plain values gives what the general one gives (a
    mapping that is not a dict takes the general one)."""
    import random
    import types

    rng = random.Random(7)
    keys = ["a", "b", "product_id", "qty", "é", "a b", "_x", "Z9", "", "\"q\"", 3,
            None, True]
    values = [0, 1, -5, 2**70, "", "x", "été", "\x00\n", True, False, None, 1.5,
              [1, "a"], {"k": 1}]
    for _ in range(300):
        d = {rng.choice(keys): rng.choice(values) for _ in range(rng.randrange(0, 6))}
        assert canonical(d) == canonical(types.MappingProxyType(d)), d
