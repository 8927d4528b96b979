"""``lock_rate``'s script under network faults: a call the client sends twice (its
reply was lost, or the server ran the first request late, after the re-send) takes
one slot, not two; a stalled server fails the call (closed)
within the client's timeouts, taking nothing (a black hole) or one slot (a request
it runs late)."""

from __future__ import annotations

import time

import pytest
import redis
import redis.backoff
import redis.retry
from proxy import FaultProxy

from celery_dlock import BackendUnavailable
from celery_dlock.backends.redis.rate import TAKE, RedisRates, rate_key
from celery_dlock.core.rates import parse_rate
from celery_dlock.ops.embedded import EmbeddedRedis

pytestmark = pytest.mark.slow

RATE = parse_rate("6/m")  # one slot every 10 s: no slot comes due during a test
STEP = 10_000_000  # its interval, in the server's microseconds


def _client(url: str, *, timeout: float, retries: int) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def _tat(server: EmbeddedRedis, prefix: str, name: str) -> int:
    direct = redis.Redis.from_url(server.url, socket_timeout=10)
    try:
        return int(direct.hget(rate_key(prefix, name), "tat") or 0)
    finally:
        direct.close()


def _warm(rates: RedisRates, prefix: str) -> None:
    """One call, so that the next are EVALSHA of the loaded script (the proxy matches
    its sha)."""
    assert rates.take(prefix, "warm-up", RATE).run


def test_a_call_resent_after_its_reply_was_lost_takes_one_slot(
        own_server: EmbeddedRedis, proxy: FaultProxy, prefix: str, name: str) -> None:
    rates = RedisRates(_client(proxy.url, timeout=0.5, retries=2))
    _warm(rates, prefix)
    assert rates.take(prefix, name, RATE).run  # the name's first slot: now
    first = _tat(own_server, prefix, name)
    matched = proxy.drop_reply(TAKE.sha.encode())
    parked = rates.take(prefix, name, RATE)  # its reply is lost; redis-py re-sends
    assert matched.is_set() and proxy.dropped_bytes > 0
    assert not parked.run and parked.slot == first, "the slot the first send reserved"
    assert _tat(own_server, prefix, name) == first + STEP, "one slot taken, not two"
    after = rates.take(prefix, name, RATE)
    assert after.slot == first + STEP, "the next call gets the very next slot"


def test_a_request_the_server_runs_late_after_its_resend_takes_no_second_slot(
        own_server: EmbeddedRedis, proxy: FaultProxy, prefix: str, name: str) -> None:
    """A stalled link: the client gives up on its request and sends it again, which
    is answered; then the first arrives after all.  Both ran: one slot."""
    rates = RedisRates(_client(proxy.url, timeout=0.5, retries=2))
    _warm(rates, prefix)
    assert rates.take(prefix, name, RATE).run
    first = _tat(own_server, prefix, name)
    held = proxy.hold_request(TAKE.sha.encode())
    parked = rates.take(prefix, name, RATE)  # answered: the re-send
    assert held.arrived.is_set() and not parked.run and parked.slot == first
    held.let_go()  # the first request reaches the server now, and runs
    assert held.forwarded.wait(5)
    direct = redis.Redis.from_url(own_server.url, socket_timeout=10)
    try:
        assert direct.ping()  # served after the late request (one server thread)
    finally:
        direct.close()
    time.sleep(0.3)  # and time to spare
    assert _tat(own_server, prefix, name) == first + STEP, "one slot taken, not two"


def test_a_stalled_server_fails_the_call_closed_and_its_late_run_takes_one_slot(
        own_server: EmbeddedRedis, proxy: FaultProxy, prefix: str, name: str) -> None:
    """Every request reaches the server a second late, after the client gave up:
    the call fails (closed: no body may start on it) within the client's timeouts,
    and the request the server runs late takes one slot."""
    rates = RedisRates(_client(proxy.url, timeout=0.3, retries=2))
    _warm(rates, prefix)
    assert rates.take(prefix, name, RATE).run
    first = _tat(own_server, prefix, name)
    proxy.delay(1.0)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="rate_take"):
        rates.take(prefix, name, RATE)
    assert time.monotonic() - started < 5, "bounded by the client's timeouts"
    time.sleep(1.5)  # the delayed request reaches the server and runs
    proxy.heal()
    assert _tat(own_server, prefix, name) == first + STEP, "one slot taken"


def test_a_stalled_server_fails_the_call_closed_and_takes_nothing(
        own_server: EmbeddedRedis, proxy: FaultProxy, prefix: str, name: str) -> None:
    rates = RedisRates(_client(proxy.url, timeout=0.5, retries=1))
    _warm(rates, prefix)
    assert rates.take(prefix, name, RATE).run
    first = _tat(own_server, prefix, name)
    proxy.black_hole()
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="rate_take"):
        rates.take(prefix, name, RATE)
    assert time.monotonic() - started < 5, "bounded by the client's timeouts"
    proxy.heal()
    assert _tat(own_server, prefix, name) == first, "nothing reached the server"
    parked = rates.take(prefix, name, RATE)
    assert not parked.run and parked.slot == first
