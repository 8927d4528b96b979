"""A lock lost while the body runs: the attempt fails with ``LockLost`` by default.

``lock_lost_action``: ``fail`` (default: the body finishes, then the attempt ends as
FAILURE ``LockLost``), ``interrupt`` (``LockLostInterrupt`` is raised inside the body;
FAILURE), ``warn`` (the explicit opt-in to warn and keep the body's result).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import states
from task_env import TaskEnv, new_app, running

from celery_dlock import LockedTask, LockLost, signals
from celery_dlock.backends.redis.marker_scripts import CLAIM

RESULT_TIMEOUT = 30


class LateClaimReplies(redis.Redis):
    """A real client whose marker claims of a name in :attr:`late` get their reply
    late: the claim ran on the server, then ``late[name]()`` runs before the reply is
    read (a reply delayed on its way)."""

    late: dict[str, Any] = {}

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        reply = super().evalsha(sha, numkeys, *keys_and_args)
        self._late(sha == CLAIM.sha, keys_and_args[:numkeys])
        return reply

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any:
        reply = super().eval(script, numkeys, *keys_and_args)  # (its first call)
        self._late(script == CLAIM.source, keys_and_args[:numkeys])
        return reply

    def _late(self, claim: bool, keys: tuple[Any, ...]) -> None:
        for name, wait in list(self.late.items()) if claim else ():
            if any(name in str(key) for key in keys):
                wait()


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[TaskEnv]:
    e = new_app(redis_url, dlock_client=lambda: LateClaimReplies.from_url(redis_url))

    def body(self: Any, x: str, after: float) -> str:
        """Delete the lock's keys, then run ``after`` seconds more."""
        e.r.delete(e.lock_key(f"l:{x}"))
        deadline = time.monotonic() + after
        while time.monotonic() < deadline:
            time.sleep(0.02)
        e.log(kind="body-end", x=x, lost=self.lock.lost)
        return "body finished"

    for action in ("default", "fail", "warn", "interrupt"):
        options: dict[str, Any] = {} if action == "default" else {
            "lock_lost_action": action}
        e.tasks[action] = e.app.task(base=LockedTask, shared=False, bind=True,
                                     name=f"lost_{action}", lock_key="l:{x}",
                                     lock_ttl=1, **options)(body)
    def reenter(self: Any, x: str) -> str:
        """Delete the lock's keys, then re-enter the lock (a nested block)."""
        e.r.delete(e.lock_key(f"l:{x}"))
        try:
            with self.lock:
                e.log(kind="inner-ran", x=x)
        except LockLost:
            e.log(kind="reentry-lost", x=x, lost=self.lock.lost, depth=self.lock.depth)
        return "body finished"

    def outlive(self: Any, x: str, after: float) -> str:
        """Run ``after`` seconds, past the task's lock_max_hold."""
        deadline = time.monotonic() + after
        while time.monotonic() < deadline:
            time.sleep(0.02)
        e.log(kind="body-end", x=x, lost=self.lock.lost)
        return "body finished"

    for action in ("fail", "warn", "interrupt"):
        e.tasks[f"max_hold_{action}"] = e.app.task(
            base=LockedTask, shared=False, bind=True, name=f"max_hold_{action}",
            lock_key="l:{x}", lock_ttl=1, lock_max_hold=2,
            lock_lost_action=action)(outlive)
    e.tasks["reenter"] = e.app.task(base=LockedTask, shared=False, bind=True,
                                    name="lost_reenter", lock_key="l:{x}",
                                    lock_ttl=30)(reenter)

    def retry_once(self: Any, x: str) -> str:
        e.log(kind="retry-body", x=x, retries=self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0, max_retries=1)
        return "retried"

    def lose_while_running(task: Any, x: str) -> bool:
        """In the body of ``task`` (lock ``l:{x}``): the lock's keys go, and this
        lasts until the watchdog found the loss, and 0.5 s more (an interrupt would be
        raised in here).  Whether the loss was found."""
        e.r.delete(e.lock_key(f"l:{x}"))
        lock = task.lock
        assert lock is not None
        deadline = time.monotonic() + 5.0
        while not lock.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        found = time.monotonic()
        while time.monotonic() < found + 0.5:
            time.sleep(0.02)
        return bool(lock.lost)

    def lose_while_publishing(x: str) -> None:
        """The retry's publish lasts until its lock was found lost."""
        e.log(kind="publish-end", x=x, lost=lose_while_running(retrying, x))

    class SlowRetryPublish(LockedTask):
        def apply_async(self, args: Any = None, kwargs: Any = None,
                        **options: Any) -> Any:
            if options.get("retries") == 1:  # the retry's publish, in the body
                lose_while_publishing(args[0])
            return super().apply_async(args, kwargs, **options)

    retrying = e.tasks["retry_interrupt"] = e.app.task(
        base=SlowRetryPublish, shared=False, bind=True, name="lost_retry_interrupt",
        lock_key="l:{x}", lock_ttl=1, lock_lost_action="interrupt")(retry_once)

    def sink(x: str) -> str:
        e.log(kind="sink-ran", x=x)
        return "sink ran"

    e.tasks["sink"] = e.app.task(base=LockedTask, shared=False, name="lost_sink",
                                 lock_key="s:{x}", lock_mode="until_finished")(sink)

    def send(self: Any, x: str) -> str:
        e.tasks["sink"].apply_async((x,), task_id=f"sink-{x}")
        e.log(kind="sent", x=x)
        return "sent"

    sender = e.tasks["send"] = e.app.task(
        base=LockedTask, shared=False, bind=True, name="lost_sender", lock_key="l:{x}",
        lock_ttl=1, lock_lost_action="interrupt")(send)

    e.tasks["lose"] = functools.partial(lose_while_running, sender)  # type: ignore[assignment]
    with running(e):
        yield e


@pytest.fixture
def lost_signals() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kw: Any) -> None:
        seen.append(kw)

    signals.lock_lost.connect(receiver, weak=False)
    yield seen
    signals.lock_lost.disconnect(receiver)


def _x() -> str:
    return uuid.uuid4().hex[:8]


@pytest.mark.parametrize("action", ["default", "fail"])
def test_lost_lock_fails_the_attempt_by_default(env: TaskEnv, action: str,
                                                lost_signals: list[dict[str, Any]]
                                                ) -> None:
    x = _x()
    res = env.tasks[action].delay(x, 1.5)  # renewal (every 1/3 s) finds it gone
    with pytest.raises(LockLost) as info:
        res.get(timeout=RESULT_TIMEOUT)
    assert res.state == states.FAILURE
    assert f"'l:{x}'" in str(info.value) and "lost" in str(info.value)
    (end,) = env.events(kind="body-end", x=x)
    assert end["lost"] is True  # the body was not interrupted: it ran to its end
    assert len([s for s in lost_signals if s["name"] == f"l:{x}"]) == 1


def test_lost_lock_found_only_at_release_fails_too(env: TaskEnv) -> None:
    x = _x()
    res = env.tasks["default"].delay(x, 0.0)  # ends before any renewal
    with pytest.raises(LockLost, match="expired"):
        res.get(timeout=RESULT_TIMEOUT)
    assert res.state == states.FAILURE


def test_warn_is_the_opt_in_to_keep_the_result(env: TaskEnv,
                                               lost_signals: list[dict[str, Any]]
                                               ) -> None:
    x = _x()
    assert env.tasks["warn"].delay(x, 1.5).get(timeout=RESULT_TIMEOUT) == "body finished"
    assert len([s for s in lost_signals if s["name"] == f"l:{x}"]) == 1


def test_interrupt_stops_the_body_and_fails(env: TaskEnv) -> None:
    x = _x()
    res = env.tasks["interrupt"].delay(x, 5.0)
    with pytest.raises(LockLost):
        res.get(timeout=RESULT_TIMEOUT)
    assert res.state == states.FAILURE
    assert not env.events(kind="body-end", x=x)


def test_an_interrupt_never_loses_the_retry_being_published(
        env: TaskEnv, lost_signals: list[dict[str, Any]]) -> None:
    """The lock is lost while the body's ``self.retry()`` publishes: the retry stands
    and runs.  (Raised inside the publish, the interrupt made Celery reject the
    message: the call never ran again, and its caller was not told.)"""
    x = _x()
    res = env.tasks["retry_interrupt"].delay(x)
    assert res.get(timeout=15) == "retried"
    assert [b["retries"] for b in env.events(kind="retry-body", x=x)] == [0, 1]
    (published,) = env.events(kind="publish-end", x=x)
    assert published["lost"] is True  # the loss was found while it published
    assert len([s for s in lost_signals if s["name"] == f"l:{x}"]) == 1  # told once


def test_an_interrupt_waits_for_the_send_of_a_marked_call(env: TaskEnv) -> None:
    """The sender's lock is lost while its send of an ``until_finished`` call waits
    for the claim's reply: the send completes (the call is published, and runs), then
    the interrupt stops the sender.  (Raised inside the send, it left the claimed
    marker with nothing published: the name stayed taken, for the marker's ttl, by a
    call that never ran.)"""
    x = _x()
    LateClaimReplies.late[f"s:{x}"] = lambda: env.tasks["lose"](x)
    try:
        res = env.tasks["send"].delay(x)
        with pytest.raises(LockLost):
            res.get(timeout=RESULT_TIMEOUT)
    finally:
        LateClaimReplies.late.pop(f"s:{x}", None)
    assert res.state == states.FAILURE
    assert not env.events(kind="sent", x=x)  # stopped right after the send
    sunk = env.tasks["sink"].AsyncResult(f"sink-{x}")
    assert sunk.get(timeout=15) == "sink ran"
    # The marker went with the call: the name takes a new call.
    again = env.tasks["sink"].apply_async((x,), task_id=f"again-{x}")
    assert again.id == f"again-{x}" and again.get(timeout=15) == "sink ran"


def test_a_reentry_that_finds_the_hold_gone_fails_the_attempt(
        env: TaskEnv, lost_signals: list[dict[str, Any]]) -> None:
    # Long before any renewal (ttl 30 s): the nested block is what finds the loss.
    x = _x()
    res = env.tasks["reenter"].delay(x)
    with pytest.raises(LockLost):
        res.get(timeout=RESULT_TIMEOUT)
    assert res.state == states.FAILURE
    assert not env.events(kind="inner-ran", x=x)
    (seen,) = env.events(kind="reentry-lost", x=x)
    assert seen["lost"] is True and seen["depth"] == 1
    (signal,) = [s for s in lost_signals if s["name"] == f"l:{x}"]
    assert "key" not in signal  # the lock is named by name only
    assert signal["reason"] == "expired"  # the keys were deleted: nobody holds it


@pytest.mark.parametrize("action", ["fail", "warn", "interrupt"])
def test_max_hold_ends_the_hold_and_lock_lost_action_applies(
        env: TaskEnv, action: str, lost_signals: list[dict[str, Any]]) -> None:
    x = _x()
    started = time.monotonic()
    res = env.tasks[f"max_hold_{action}"].delay(x, 4.0)
    if action == "warn":
        assert res.get(timeout=RESULT_TIMEOUT) == "body finished"
    else:
        # An interrupt raises inside the body with its generic words; the reason
        # travels in the signal.
        with pytest.raises(LockLost, match="max hold" if action == "fail" else "lost"):
            res.get(timeout=RESULT_TIMEOUT)
        assert res.state == states.FAILURE
    (signal,) = [s for s in lost_signals if s["name"] == f"l:{x}"]
    assert signal["reason"] == "max hold of 2s reached"
    ends = env.events(kind="body-end", x=x)
    if action == "interrupt":
        assert not ends  # stopped at the bound, not after its 4 s
        assert time.monotonic() - started < 4.0
    else:
        assert [end["lost"] for end in ends] == [True]


@pytest.mark.parametrize("after", [1.5, 0.0],
                         ids=["found-by-renewal", "found-at-release"])
def test_a_lost_hold_is_one_warning_naming_the_lock(env: TaskEnv, after: float,
                                                    caplog: pytest.LogCaptureFixture
                                                    ) -> None:
    """However the loss is found (the renewal, the release, or both at once), its log
    is one WARNING that names the lock and the task, never the storage key."""
    x = _x()
    with caplog.at_level("DEBUG", logger="celery_dlock"):
        res = env.tasks["default"].delay(x, after)
        with pytest.raises(LockLost):
            res.get(timeout=RESULT_TIMEOUT)
        time.sleep(0.5)  # a second report, if any, would come from the watchdog
    # (Celery's own ERROR line for the failed task is Celery's, not ours)
    lost = [r for r in caplog.records if r.name.startswith("celery_dlock")
            and r.levelno >= 30 and f"l:{x}" in r.getMessage()]
    assert len(lost) == 1, [r.getMessage() for r in lost]
    assert f"'l:{x}'" in lost[0].getMessage() and res.id in lost[0].getMessage()
    storage_key = env.lock_key(f"l:{x}")
    assert not [r for r in caplog.records if storage_key in r.getMessage()]

