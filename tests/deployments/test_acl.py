"""The least-privilege ACL rule of docs/deployments.md.

1. The rule is read from the docs and given to a user; the whole workload
   (acl_workload.py: RedisLock, inspect, LockedTask with events, the CLI) runs as that
   user on a server of its own.
2. The same workload runs under ``MONITOR`` as a user allowed every command (on the
   same keys): every command the rule allows was sent (so none can go), and every
   command sent is allowed.
3. A user whose rule lacks one command the scripts run gets InvalidLockConfig naming
   it, and no key is left without its expiry.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from acl_workload import run_workload

from celery_dlock import InvalidLockConfig, RedisLock
from celery_dlock.backends.redis.inspect import force_release
from celery_dlock.backends.redis.scripts import ACQUIRE
from celery_dlock.core.hold import new_op_id
from celery_dlock.ops.embedded import EmbeddedRedis

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployments.md"
USER, PASSWORD = "dlock", "dlock-secret"


def acl_rule() -> str:
    """The rule in the docs: the block after ``<!-- acl-rule -->``."""
    found = re.search(r"<!-- acl-rule -->\s*```text\n(.*?)```", DOC.read_text(),
                      re.DOTALL)
    assert found, f"no ACL rule block in {DOC}"
    return " ".join(found.group(1).split())


def allowed_commands(rule: str) -> set[str]:
    return {token[1:].lower() for token in rule.split() if token.startswith("+")}


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as s:
        admin = redis.Redis.from_url(s.url)
        try:
            admin.execute_command("ACL", "WHOAMI")
        except redis.ResponseError as exc:  # Redis < 6
            pytest.skip(f"this redis-server has no ACL: {exc}")
        finally:
            admin.close()
        yield s


def _setup(server: EmbeddedRedis, prefix: str, *,
           everything: bool = False) -> tuple[str, str]:
    """A user with the docs' rule (``everything``: with every command) on ``prefix``."""
    admin = redis.Redis.from_url(server.url)
    rule = acl_rule().replace("~dlock:*", f"~{prefix}:*")
    assert rule != acl_rule(), "the rule should name the key prefix dlock:*"
    if everything:
        rule = f"resetkeys ~{prefix}:* resetchannels +@all"
    admin.execute_command("ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}",
                          *rule.split())
    admin.script_flush()  # as after a restart: the lock falls back to EVAL
    foreign = "foreign"
    admin.set(f"{prefix}:{{{foreign}}}", "another application's data")
    admin.close()
    return f"redis://{USER}:{PASSWORD}@127.0.0.1:{server.port}/0", foreign


def test_the_library_works_as_the_acl_user(server, redis_url):
    prefix = f"dla{uuid.uuid4().hex[:8]}"
    url, foreign = _setup(server, prefix)
    run_workload(url, redis_url, prefix, foreign)
    # and the user really is confined: other keys and other commands are refused
    client = redis.Redis.from_url(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.get("elsewhere")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.flushall()
    client.close()


# A MONITOR line: `<time> [<db> <client>] "<command>" "<arg>" ...`, <client> being
# `lua`, `unix:<path>` or `<address>:<port>`. Parsed here rather than by redis-py's
# Monitor, which before 5.0.1 read the client up to the LAST `]` of the line and so
# lost the command name of every EVAL whose script holds a `]`.
_MONITOR_LINE = re.compile(r'[\d.]+ \[\d+ (?P<client>[^\]]*)\] "(?P<name>[^"]*)"')


def _monitor(server: EmbeddedRedis, seen: set[str], stop: str,
             ready: threading.Event) -> None:
    admin = redis.Redis.from_url(server.url)
    with admin.monitor() as monitor:
        ready.set()
        while True:
            line = monitor.connection.read_response()
            text = line.decode(errors="replace") if isinstance(line, bytes) else line
            found = _MONITOR_LINE.match(text)
            if not found:  # not a command
                continue
            name = found["name"].lower()
            if name == "echo" and stop in text:
                break
            if found["client"].split(":", 1)[0] != "unknown":
                seen.add(name)
    admin.close()


def test_the_rule_allows_only_what_the_library_sends(server, redis_url):
    prefix = f"dla{uuid.uuid4().hex[:8]}"
    url, foreign = _setup(server, prefix, everything=True)
    seen: set[str] = set()
    stop = uuid.uuid4().hex
    ready = threading.Event()
    recorder = threading.Thread(target=_monitor, args=(server, seen, stop, ready),
                                daemon=True)
    recorder.start()
    assert ready.wait(10)
    try:
        run_workload(url, redis_url, prefix, foreign)
    finally:
        admin = redis.Redis.from_url(server.url)
        admin.echo(stop)
        admin.close()
        recorder.join(10)
    # the connection handshake's optional commands (refused and ignored by redis-py)
    seen -= {"client", "auth", "hello"}
    allowed = allowed_commands(acl_rule())
    assert seen <= allowed, f"sent but not allowed: {sorted(seen - allowed)}"
    assert allowed <= seen, f"allowed but never sent: {sorted(allowed - seen)}"


# -- a user whose rule lacks one command the scripts run ------------------------------

#: Every command the lock's scripts run; each is refused in turn below.
SCRIPT_COMMANDS = ("time", "exists", "hget", "hgetall", "hmget", "pttl", "get", "zrange",
                   "zrangebyscore", "set", "hset", "pexpire", "zadd", "rpush", "del",
                   "zrem")


def _expiring(admin: redis.Redis, prefix: str, what: str) -> None:
    """Every key under ``prefix`` expires, the fence counters too (they outlive their
    name's last hold by the fence ttl: docs/fencing.md)."""
    for key in admin.scan_iter(match=f"{prefix}:*"):
        assert admin.pttl(key) > 0, f"{what} left {key!r} without an expiry"


def _wait_in_line(admin: redis.Redis, lock: RedisLock, owner: str) -> None:
    """``owner`` joins the line of ``lock`` (held by another owner), as a blocked
    acquire does, then stops waiting (its place lasts as long as its lease)."""
    reply = ACQUIRE(admin, (lock.keys.lock,), (owner, 30_000, 30_000, new_op_id(), "",
                                                  86_400_000))
    assert int(reply[0]) == 0


@pytest.mark.parametrize("command", SCRIPT_COMMANDS)
def test_a_refused_command_is_named_and_leaves_no_key_without_its_expiry(
        server: EmbeddedRedis, command: str) -> None:
    """As a user whose rule lacks ``command``: take a free lock, wait in line, re-enter,
    extend, release to the first in line, take the lock as the first in line, force a
    release.  Each works, or fails with InvalidLockConfig naming the command; no key
    is left without its expiry; and the command is refused somewhere."""
    prefix = f"dlr{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(server.url)
    user = f"lacks-{command}"
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}",
                          f"~{prefix}:*", "+@all", f"-{command}")
    client = redis.Redis.from_url(f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0")
    refused: list[str] = []

    def mine(name: str) -> RedisLock:
        return RedisLock(client, name, ttl=30, owner="U", prefix=prefix,
                         auto_renew=False)

    def held(name: str, owner: str) -> RedisLock:
        lock = RedisLock(admin, name, ttl=30, owner=owner, prefix=prefix,
                         auto_renew=False)
        assert lock.acquire(blocking=False)
        return lock

    def attempt(what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except InvalidLockConfig as exc:
            assert command.upper() in str(exc), (what, str(exc))
            refused.append(what)
        _expiring(admin, prefix, what)

    try:
        attempt("a fresh acquire", lambda: mine("fresh").acquire(blocking=False))
        held("line", "H")
        attempt("a wait in line", lambda: mine("line").acquire(timeout=0.2))
        held("again", "U")
        attempt("a re-entry", lambda: mine("again").acquire(blocking=False))
        attempt("an extend", lambda: mine("again").extend(60))
        wake = held("wake", "U")
        _wait_in_line(admin, wake, "W")
        attempt("a release that wakes the first in line", mine("wake").release)
        head = held("head", "H")
        _wait_in_line(admin, head, "U")
        head.release()
        attempt("the first in line takes the lock",
                lambda: mine("head").acquire(blocking=False))
        forced = held("forced", "H")
        _wait_in_line(admin, forced, "W")
        attempt("a force release", lambda: force_release(client, prefix, "forced",
                                                         by="ops@host", reason="x"))
        assert refused, f"{command} was never refused: is it still used?"
    finally:
        client.close()
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


def test_fail_open_does_not_run_a_body_unlocked_over_a_refused_command(
        server: EmbeddedRedis, redis_url: str) -> None:
    """A refused command is configuration, not an outage: a ``lock_fail_open`` task
    fails with InvalidLockConfig instead of running its body without the lock."""
    from celery_helpers import close_app, test_app

    from celery_dlock import LockedTask

    prefix = f"dlf{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "lacks-pexpire", "reset", "on",
                          f">{PASSWORD}", f"~{prefix}:*", "+@all", "-pexpire")
    url = f"redis://lacks-pexpire:{PASSWORD}@127.0.0.1:{server.port}/0"
    app = test_app("fo-acl", redis_url, dlock_url=url, dlock_key_prefix=prefix)
    ran: list[str] = []

    @app.task(base=LockedTask, shared=False, lock_key="k:{x}", lock_fail_open=True,
              on_contention="raise")
    def work(x: str) -> None:
        ran.append(x)

    try:
        with pytest.raises(InvalidLockConfig, match="PEXPIRE"):
            work.apply(("a",)).get()
        assert ran == []
        _expiring(admin, prefix, "the task's acquire")
    finally:
        close_app(app)
        admin.execute_command("ACL", "DELUSER", "lacks-pexpire")
        admin.close()


@pytest.mark.parametrize(("options", "command"), [
    ({"lock_mode": "until_started"}, "zscore"),      # the queue marker's claim
    ({"lock_mode": "queued_and_running"}, "hmget"),  # its claim record
    ({"lock_rate": "10/s"}, "hmget"),                # the rate's state
])
def test_a_refused_command_of_the_markers_or_a_rate_is_named(
        server: EmbeddedRedis, redis_url: str, options: dict[str, str],
        command: str) -> None:
    """The queue markers' and the rates' scripts name a command the user may not run,
    as the lock's do: InvalidLockConfig naming it, not an outage."""
    from celery_helpers import close_app, test_app

    from celery_dlock import LockedTask

    prefix = f"dlm{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(server.url)
    user = f"lacks-{command}"
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}",
                          f"~{prefix}:*", "+@all", f"-{command}")
    url = f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0"
    app = test_app(f"mk-acl{uuid.uuid4().hex[:4]}", redis_url, dlock_url=url,
                   dlock_key_prefix=prefix)

    @app.task(base=LockedTask, shared=False, lock_key="k:{x}", **options)
    def work(x: str) -> str:
        return x

    try:
        with pytest.raises(InvalidLockConfig, match=command.upper()):
            if "lock_rate" in options:
                # a worker takes the rate where the body would start (an eager run
                # takes none): the same call, on the store a worker asks
                from celery_dlock.core.rates import parse_rate
                from celery_dlock.task.backend import backend_for

                backend_for(app).rates().take(prefix, "k:a",
                                              parse_rate(options["lock_rate"]))
            else:
                work.apply_async(("a",))  # the marker is claimed where the call is sent
    finally:
        close_app(app)
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()
