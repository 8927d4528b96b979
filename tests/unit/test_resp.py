"""``backends/redis/resp.pack`` makes the bytes redis-py's own packer makes for the
arguments the scripts are given, and declines (None) every other kind of argument so
that redis-py packs those by its rules."""

from __future__ import annotations

import random
import string
from typing import Any

import pytest
from redis.connection import Encoder, PythonRespSerializer

from celery_dlock.backends.redis.resp import pack

_REDIS_PY = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def redis_py(args: tuple[Any, ...]) -> bytes:
    return b"".join(_REDIS_PY.pack(*args))


def _random_arg(rng: random.Random) -> Any:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randrange(-(2**63), 2**63)
    if kind == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    alphabet = string.printable + "éø漢字\u2028\x00"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))


@pytest.mark.parametrize("args", [
    ("EVALSHA", "a" * 40, 1, "dlock:{stock:1}", "owner", 30000, 0, "ab12", "",
     "pid", 4242, "host", "h1", "task_name", "app.tasks.réport"),
    ("EVALSHA", "b" * 40, 3, "k1", "k2", "k3", b"\x00\xff", -1, ""),
    ("EVALSHA", "c" * 40, 0),
    ("PING",),
    ("GET", "x" * 10_000),  # past redis-py's buffer cutoff: it sends it in pieces
    ("EVAL", "return 1", 0),
])
def test_the_bytes_are_redis_pys(args: tuple[Any, ...]) -> None:
    assert pack(args) == redis_py(args)


def test_random_commands_of_str_int_and_bytes_pack_as_redis_py_packs_them() -> None:
    rng = random.Random(21)
    for _ in range(500):
        head: tuple[Any, ...] = ("EVALSHA", "".join(rng.choice("0123456789abcdef")
                                                    for _ in range(40)),
                                 rng.randrange(4))
        if rng.random() < 0.3:
            head = (rng.choice(["GET", "SET", "PING", "hset", "Eval"]),)
        args = head + tuple(_random_arg(rng) for _ in range(rng.randrange(0, 12)))
        assert pack(args) == redis_py(args), args


def test_the_same_script_head_is_packed_again_for_every_call() -> None:
    # The cached head of one call must not leak another call's arguments.
    first = ("EVALSHA", "d" * 40, 1, "k", "a")
    second = ("EVALSHA", "d" * 40, 1, "other-key", "b", "c")
    assert pack(first) == redis_py(first)
    assert pack(second) == redis_py(second)
    assert pack(first) == redis_py(first)


@pytest.mark.parametrize("command", ["SCRIPT LOAD", "CLIENT\tLIST", b"PING", 7, ""])
def test_a_command_name_redis_py_would_split_or_refuse_is_left_to_it(
        command: Any) -> None:
    assert pack((command, "x")) is None


@pytest.mark.parametrize("odd", [1.5, True, None, memoryview(b"x"), bytearray(b"x"),
                                 ["a"]])
def test_other_kinds_of_argument_are_left_to_redis_py(odd: Any) -> None:
    assert pack(("EVALSHA", "e" * 40, 1, "k", odd)) is None
    assert pack(("EVALSHA", "e" * 40, odd, "k")) is None
