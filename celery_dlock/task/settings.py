"""The one reader of celery-dlock's settings: every ``dlock_*`` app setting and task
option, its default, its check, and where a value comes from.

Every setting has a task option and an app-wide ``app.conf`` key.  A value is taken
from the first of these that sets it, as Celery does for its own task options:

1. the call: the message's headers, ``apply_async(..., headers={"lock_ttl": 5})``
   (:data:`CALL_OPTIONS` only: the options that name the lock cannot change per call);
2. ``app.conf.task_annotations`` for the task;
3. the task class, most derived first (``@app.task(...)`` keywords are attributes of
   the class Celery makes);
4. ``app.conf.dlock_*``;
5. the default (:data:`SETTINGS`, one table).

No other module reads ``app.conf.dlock_*``: they call :func:`conf_value` (an app-wide
setting) or :func:`read_setting` (a task's option resolved as above), or take the
values from a task's settings mapping, which holds every option.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.errors import InvalidLockConfig
from ..core.lock_args import DEFAULT_PREFIX
from ..core.rates import Rate, check_burst, parse_rate

__all__ = [
    "CALL_OPTIONS",
    "CONF_KEYS",
    "DUPLICATE_POLICIES",
    "KEY_OPTIONS",
    "LOST_ACTIONS",
    "MODES",
    "NOT_PER_CALL",
    "OTHER_CONF",
    "POLICIES",
    "SETTINGS",
    "TASK_OPTIONS",
    "Setting",
    "check_bool",
    "check_combination",
    "check_limit_mode",
    "conf_of",
    "conf_value",
    "defaults",
    "did_you_mean",
    "enabled",
    "read_setting",
]

POLICIES = ("retry", "wait", "skip", "raise")
LOST_ACTIONS = ("fail", "interrupt", "warn")
#: Uniqueness modes (enqueue-time de-duplication on top of the runtime lock).
MODES = ("while_running", "until_started", "until_finished", "queued_and_running",
         "throttle")
#: What a duplicate enqueue gets.
DUPLICATE_POLICIES = ("return_existing", "raise", "drop", "replace")


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise InvalidLockConfig(f"{name} must be a positive number of seconds, "
                                f"got {value!r}")
    return float(value)


def _non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise InvalidLockConfig(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidLockConfig(f"{name} must be a whole number >= 0, got {value!r}")
    return value


def _limit(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidLockConfig(f"{name} must be a whole number >= 1 (how many calls "
                                f"of one key may run at once; 1: a lock), got {value!r}")
    return value


def _policy(name: str, value: Any) -> Any:
    if callable(value) or value in POLICIES:
        return value
    raise InvalidLockConfig(f"{name} must be one of {', '.join(POLICIES)} or a callable, "
                            f"got {value!r}")


def _lost_action(name: str, value: Any) -> str:
    if value in LOST_ACTIONS:
        return str(value)
    raise InvalidLockConfig(f"{name} must be one of {', '.join(LOST_ACTIONS)}, "
                            f"got {value!r}")


def _one_of(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise InvalidLockConfig(f"{name} must be one of {', '.join(choices)}, "
                                f"got {value!r}{did_you_mean(str(value), choices)}")
    return check


def _rate(name: str, value: Any) -> Rate:
    return parse_rate(value, where=name)


def _burst(name: str, value: Any) -> int:
    return check_burst(value, name)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidLockConfig(f"{name} must be True or False, got {value!r}")
    return value


def _prefix(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidLockConfig(f"{name} must be a non-empty string, got {value!r}")
    if "{" in value or "}" in value:
        raise InvalidLockConfig(f"{name} may not contain '{{' or '}}' (on Redis Cluster "
                                f"they would move the hash tag: every acquire would "
                                f"fail), got {value!r}")
    return value


@dataclass(frozen=True)
class Setting:
    """One setting: its task option, its app.conf key, default and validator."""

    option: str
    conf: str
    default: Any
    check: Callable[[str, Any], Any]
    doc: str


SETTINGS: dict[str, Setting] = {s.option: s for s in (
    Setting("lock_ttl", "dlock_ttl", 30.0, _positive,
            "seconds a hold lives after its last renewal; renewed every ttl/3"),
    Setting("lock_prefix", "dlock_key_prefix", DEFAULT_PREFIX, _prefix,
            "prefix of every Redis key"),
    Setting("on_contention", "dlock_on_contention", "retry", _policy,
            "what to do when the lock is held: retry, wait, skip, raise or a callable"),
    Setting("lock_wait", "dlock_wait", 10.0, _non_negative,
            "the wait policy blocks this long for a release before falling back to "
            "retry"),
    Setting("lock_retry_backoff", "dlock_retry_backoff", 1.0, _positive,
            "first contention retry delay cap (seconds); doubles per retry, full jitter"),
    Setting("lock_retry_backoff_max", "dlock_retry_backoff_max", 30.0, _positive,
            "largest contention retry delay cap (seconds)"),
    Setting("lock_retry_max", "dlock_retry_max", 20, _count,
            "contention retries before the task fails with LockNotAcquired "
            "(not counted against max_retries)"),
    Setting("lock_fail_open", "dlock_fail_open", False, check_bool,
            "run the body unlocked (with a warning) when Redis is unreachable"),
    Setting("lock_pause_budget", "dlock_pause_budget", None, _non_negative,
            "seconds the holder may be frozen at its deadline and still be told "
            "first (None: a tenth of the ttl, at most 2 s)"),
    Setting("lock_mode", "dlock_mode", "while_running", _one_of(MODES),
            "uniqueness at enqueue: while_running (none: runs never overlap), "
            "until_started, until_finished, queued_and_running or throttle"),
    Setting("on_duplicate", "dlock_on_duplicate", "return_existing",
            _one_of(DUPLICATE_POLICIES),
            "what a duplicate enqueue gets: return_existing, raise (AlreadyQueued), "
            "drop or replace"),
    Setting("lock_queue_ttl", "dlock_queue_ttl", 3600.0, _positive,
            "seconds a queue marker outlives its enqueue (plus any countdown/eta): "
            "the longest a lost message keeps its key from being queued again"),
    Setting("lock_max_hold", "dlock_lock_max_hold", None, _positive,
            "seconds after which a hold is no longer renewed and is lost with the "
            "reason 'max hold ... reached' (lock_lost_action applies); shorter than "
            "lock_ttl, the grant itself is cut to it (None: unbounded)"),
    Setting("lock_rate", "dlock_rate", None, _rate,
            "per lock name, cluster-wide: at most this many calls start per second, "
            "minute or hour ('5/s', '100/m', '2/h'); a call over it is parked "
            "(re-queued for its slot, not counted against max_retries)"),
    Setting("lock_rate_burst", "dlock_rate_burst", 1, _burst,
            "calls lock_rate lets start at once after a quiet spell (1: evenly "
            "spaced)"),
    Setting("lock_lost_action", "dlock_lock_lost_action", "fail", _lost_action,
            "when the lock is lost while the body runs: fail (the body finishes, the "
            "attempt ends FAILURE LockLost), interrupt (raise LockLostInterrupt inside "
            "the task; FAILURE) or warn (signal + log; the result stands)"),
    Setting("lock_fence_ttl", "dlock_fence_ttl", None, _positive,
            "seconds a name's fence counter is kept after its last grant or release "
            "(Redis); fences strictly increase unless the server's clock steps back "
            "by more than this; at least lock_ttl (None: a day, or lock_ttl when "
            "longer)"),
    Setting("lock_limit", "dlock_lock_limit", 1, _limit,
            "how many calls of one key may run at once: 1 a lock, N a semaphore of N "
            "leased slots (one Redis, Cluster or Sentinel; not Redlock)"),
)}


#: Task options that make the lock's name: no app setting, no per-call override.
KEY_OPTIONS = ("lock_key", "lock_args")
#: Every task option of a LockedTask.
TASK_OPTIONS: frozenset[str] = frozenset(SETTINGS) | frozenset(KEY_OPTIONS)
#: Options no call may override, and why.
NOT_PER_CALL = {
    **dict.fromkeys(
        (*KEY_OPTIONS, "lock_prefix"),
        "it names the lock, which every call (and the worker's main process, which "
        "frees a dead child's lock, and celery dlock) must agree on"),
    "lock_lost_action": "a lost lock is handled outside the call, from the task's "
                        "own settings",
    **dict.fromkeys(("lock_rate", "lock_rate_burst"),
                    "a rate is shared by every call of a name: one call cannot have "
                    "its own"),
    "lock_limit": "every call of one key must count its holders against one limit",
    "lock_fence_ttl": "the fence counter is kept for the name, not for one call",
}
#: Options one call may override in its message headers.
CALL_OPTIONS: frozenset[str] = frozenset(SETTINGS) - frozenset(NOT_PER_CALL)
#: The ``app.conf`` keys that are not a task option's app-wide value.
OTHER_CONF = {
    "dlock_url": "the Redis of the locks",
    "dlock_client": "a callable returning a redis-py client",
    "dlock_redis_options": "extra redis.Redis.from_url keyword arguments",
    "dlock_transport_options": "master_name and sentinel_kwargs for a sentinel:// URL",
    "dlock_record_events": "keep a history of contention for celery dlock top",
    "dlock_enabled": "False makes every lock and queue marker a no-op (tests, local "
                     "runs)",
    "dlock_check_at_start": "False: a worker does not check the lock store when it "
                            "starts (celery dlock check still does)",
}
#: Every ``app.conf.dlock_*`` key celery-dlock reads.
CONF_KEYS: frozenset[str] = frozenset(s.conf for s in SETTINGS.values()) | \
    frozenset(OTHER_CONF)


def did_you_mean(name: str, known: Iterable[str], cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]}?)" if close else ""


def _unbound(task: Any, value: Any) -> Any:
    # A function given as a task option is a class attribute, so the instance gives
    # it back bound to the task: the option is the function itself.
    if inspect.ismethod(value) and value.__self__ is task:
        return value.__func__
    return value


def conf_of(source: Any) -> Any:
    """The configuration mapping of ``source`` (an app, or already a mapping); None
    when it has none."""
    conf = getattr(source, "conf", None)
    if conf is not None:
        return conf
    return source if hasattr(source, "get") else None


def conf_value(source: Any, key: str, default: Any = None) -> Any:
    """The app setting ``key`` (``dlock_*``, or a Celery setting that locks follow
    such as ``broker_transport_options``) of ``source`` (an app or its ``conf``), as
    given (``default`` when unset); the one place that reads them."""
    conf = conf_of(source)
    if conf is None:
        return default
    value = conf.get(key)
    return default if value is None else value


def defaults() -> dict[str, Any]:
    """Every option's default, by option name (one table: :data:`SETTINGS`)."""
    return {option: s.default for option, s in SETTINGS.items()}


def read_setting(task: Any, option: str) -> Any:
    """Task option (annotations, class) > ``app.conf`` > default, validated.

    Per-call values are merged on top by :func:`call_overrides`.
    """
    setting = SETTINGS[option]
    value = _unbound(task, getattr(task, option, None))
    where = f"task {getattr(task, 'name', task)!r} option {option}"
    if value is None:
        value = conf_value(getattr(task, "app", None), setting.conf)
        where = f"app.conf.{setting.conf}"
    if value is None:
        return setting.default
    return setting.check(where, value)


def enabled(app: Any) -> bool:
    """``app.conf.dlock_enabled`` (default True): False turns every lock and queue
    marker of the app into a no-op."""
    return conf_value(app, "dlock_enabled", True) is not False


def check_limit_mode(where: str, mode: Any, limit: Any) -> None:
    """Refuse ``lock_mode="until_finished"`` with a ``lock_limit`` above 1: the mode
    allows one call of a name queued or running, the limit lets N run at once."""
    if mode == "until_finished" and isinstance(limit, int) and limit > 1:
        raise InvalidLockConfig(
            f"{where}: lock_mode='until_finished' (one call of a name queued or "
            f"running) cannot go with lock_limit={limit} (that many running at once); "
            f"use until_started or queued_and_running, whose marker bounds the queued "
            f"calls while the limit bounds the running ones (docs/modes.md)")


def check_combination(where: str, mode: Any, policy: Any) -> None:
    """Refuse a lock_mode and on_duplicate that cannot go together."""
    if mode == "throttle" and policy == "replace":
        raise InvalidLockConfig(
            f"{where}: on_duplicate='replace' cannot go with lock_mode='throttle' (the "
            f"window's call may have run already); use drop, raise or return_existing")


def check_fence_ttl_setting(where: str, ttl: Any, fence_ttl: Any) -> None:
    """Refuse a lock_fence_ttl shorter than the lock_ttl (when both are numbers; each
    alone is checked as a setting)."""
    numbers = (int, float)
    if isinstance(ttl, numbers) and isinstance(fence_ttl, numbers) \
            and not isinstance(ttl, bool) and not isinstance(fence_ttl, bool) \
            and fence_ttl < ttl:
        raise InvalidLockConfig(
            f"{where}: lock_fence_ttl ({fence_ttl!r} s, how long a name's fence counter "
            f"is kept after its last hold) may not be shorter than lock_ttl ({ttl!r} s)")
