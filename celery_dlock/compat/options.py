"""What the peer shims share: setting the options a peer's spelling translates to,
without overriding one the task gives itself, and warning once about a peer's
settings that have no meaning here."""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from ..core.errors import InvalidLockConfig
from ..task.settings import did_you_mean

__all__ = ["argument_names", "check_keys", "positive_seconds", "set_translated",
           "warn_unused_once"]

logger = logging.getLogger("celery_dlock.compat")

#: On each class: the options it got from a translation, and their values.
_AUTO = "_dlock_compat_auto"

_warned: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _given_by_user(cls: type, name: str, root: type) -> bool:
    """Whether ``name`` is set on ``cls`` or a class between it and ``root`` by the
    user (a task keyword, a class attribute, an annotation), not by a translation."""
    for klass in cls.__mro__:
        if klass is root:
            return False
        if name in klass.__dict__:
            auto: Mapping[str, Any] = klass.__dict__.get(_AUTO, {})
            if name in auto and auto[name] == klass.__dict__[name]:
                continue
            return True
    return False


def set_translated(cls: type, root: type, values: Mapping[str, Any]) -> None:
    """Set each option of ``values`` on ``cls`` unless the task sets it itself
    (then its own value wins: ``lock_mode=`` beside ``once=``)."""
    auto = dict(cls.__dict__.get(_AUTO, {}))
    for name, value in values.items():
        if _given_by_user(cls, name, root):
            continue
        setattr(cls, name, value)
        auto[name] = value
    setattr(cls, _AUTO, auto)


def positive_seconds(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise InvalidLockConfig(f"{where} must be a positive number of seconds, "
                                f"got {value!r}")
    return float(value)


def argument_names(where: str, value: Any, *, one_string: bool) -> tuple[str, ...]:
    """A list of argument names (and, with ``one_string``, one name alone)."""
    if isinstance(value, str):
        if one_string:
            return (value,)
        raise InvalidLockConfig(f"{where} must be a list of argument names, got the "
                                f"string {value!r} (write [{value!r}])")
    if not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise InvalidLockConfig(f"{where} must be a list of argument names, "
                                f"got {value!r}")
    names = tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise InvalidLockConfig(f"{where} must be a list of argument names, "
                                f"got {value!r}")
    return names


def check_keys(where: str, given: Mapping[str, Any], known: Iterable[str]) -> None:
    known = tuple(known)
    for key in given:
        if key not in known:
            raise InvalidLockConfig(f"{where}: unknown key {key!r}"
                                    f"{did_you_mean(str(key), known)}; known: "
                                    f"{', '.join(known)}")


def warn_unused_once(app: Any, what: str, message: str) -> None:
    """Log ``message`` once per app and ``what``."""
    try:
        seen = _warned.setdefault(app, set())
    except TypeError:  # an app that cannot be weakly referenced
        seen = set()
    if what in seen:
        return
    seen.add(what)
    logger.warning(message)
