"""Lock names derived from a task and the arguments of one call.

The call is first bound to the task's signature with defaults applied, so ``f(1)``,
``f(a=1)`` and ``f(1, b=2)`` (``b=2`` being the default) all give one name.  Then:

* a **template** (``"stock:{product_id}"``) is formatted with the bound arguments; its
  fields are checked against the signature when the task is declared;
* a **callable** gets the bound arguments (``*args, **kwargs``) and returns the name;
* **None** keys on the task name plus the bound arguments (all of them, or those named
  in ``lock_args``), canonically serialised and hashed with sha256.

A value that cannot be keyed reliably (an object whose text holds a memory address, a
type with no stable serialisation) is refused with :class:`UnkeyableArgument` rather
than producing a name that two equal calls would never share.

**A value and its JSON text are one call.**  Arguments reach a worker through a
serializer; the same call may be made with a ``UUID`` or with its string (by a client
in another language, through ``send_task``, or after a JSON round trip).  So values are
keyed as the default (JSON) serializer carries them as text, :func:`json_scalar`:
``UUID`` -> ``str(u)``; ``datetime``, ``date``, ``time`` -> ``isoformat()`` (as kombu's
JSON writes them); ``Decimal`` -> ``str(d)``; an ``IntEnum`` / ``StrEnum`` (an int or
str enum) -> its value; tuples (namedtuples too) -> lists; dictionary keys -> their
JSON object key text (``{1: x}`` is ``{"1": x}``).  Values JSON cannot carry keep a
tag of their type (bytes, sets, timedelta, other enums, dataclasses), so they never
collide with a string.  In a ``lock_key`` template a plain field (``{when}``, no format
spec, attribute or index) is filled with the same text.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import decimal
import enum
import hashlib
import inspect
import json
import math
import operator
import re
import string
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..core.errors import InvalidLockConfig, UnkeyableArgument
from ..core.text import clean_text

__all__ = ["HashedKey", "KeyFunction", "arguments_text", "canonical", "json_scalar",
           "make_key_function", "task_key_function"]

KeyFunction = Callable[[tuple[Any, ...], Mapping[str, Any]], str]

#: The longest text :func:`arguments_text` gives (characters).
ARGUMENTS_TEXT_MAX = 200


class HashedKey:
    """The key function of a task whose lock names are hashed (``lock_key=None``):
    ``key(args, kwargs)`` is the name, :meth:`describe` the arguments that made it, as
    a person reads them (``user_id=29``), for the hold's info and duplicate errors."""

    __slots__ = ("_arguments", "_key")

    def __init__(self, key: KeyFunction,
                 arguments: Callable[[tuple[Any, ...], Mapping[str, Any]],
                                     dict[str, Any]]) -> None:
        self._key = key
        self._arguments = arguments

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        return self._key(args, kwargs)

    def describe(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        text = ", ".join(f"{k}={v!r}" for k, v in self._arguments(args, kwargs).items())
        return clean_text(text, limit=ARGUMENTS_TEXT_MAX)


def arguments_text(key_fn: KeyFunction, args: tuple[Any, ...],
                   kwargs: Mapping[str, Any]) -> str | None:
    """The arguments that made a hashed lock name, for people; None when the name is
    readable itself (a template or a callable's)."""
    if not isinstance(key_fn, HashedKey):
        return None
    try:
        return key_fn.describe(args, kwargs)
    except Exception:  # a call that cannot be keyed says so where it is keyed
        return None

_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}>")


class _Unkeyable(Exception):
    def __init__(self, path: str, value: Any, why: str) -> None:
        super().__init__(path)
        self.path = path
        self.value = value
        self.why = why


def _has_address(text: str) -> bool:
    return _ADDRESS.search(text) is not None


_NO_SCALAR = object()


def json_scalar(value: Any) -> Any:
    """The JSON scalar a value travels as, when JSON carries it as text or a number:
    ``UUID`` -> str, ``datetime``/``date``/``time`` -> ``isoformat()``, ``Decimal`` ->
    str, int and str enums -> their value; any other value is returned as it is."""
    if isinstance(value, enum.Enum):
        if isinstance(value, int):
            return int(value)
        if isinstance(value, str):
            return str.__str__(value)
        return value
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return value


def _object_key(value: Any, path: str) -> str:
    """A dictionary key as JSON writes an object key: always text."""
    value = json_scalar(value)
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return _sort_token(_normalise(value, path))


#: The types JSON carries as they are: :func:`_normalise` returns their values as given.
_AS_IS = frozenset({str, int, bool, type(None)})


def _plain_map(value: dict[Any, Any]) -> Any:
    """What the Mapping case of :func:`_normalise` makes of a dict whose keys are
    ASCII identifiers (a call's arguments by name) and whose values are str, int,
    bool or None, made without its general steps; None for any other dict."""
    items = []
    for k, v in value.items():
        if not (type(k) is str and k.isascii() and k.isidentifier()) or (
                type(v) not in _AS_IS):
            return None
        items.append([f'"{k}"', v])  # the key's JSON text: no escapes in it
    items.sort(key=_BY_TOKEN)
    return {"__map__": items}


#: Sorts a map's [token, value] pairs by the key's token.
_BY_TOKEN = operator.itemgetter(0)


def _normalise(value: Any, path: str) -> Any:
    """A JSON-able form of ``value`` that equal values, and a value and its JSON
    text, share; what JSON cannot carry keeps a tag of its type."""
    kind = type(value)
    if kind in _AS_IS:
        return value  # the common case, first
    if kind is dict:
        plain = _plain_map(value)
        if plain is not None:
            return plain
    if kind is list or kind is tuple:
        return [_normalise(v, f"{path}[{i}]") for i, v in enumerate(value)]
    value = json_scalar(value)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, float) and not isinstance(value, enum.Enum):
        if not math.isfinite(value):
            return {"__float__": repr(value)}
        return value
    if isinstance(value, enum.Enum):
        return _normalise_enum(value, path)
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": bytes(value).hex()}
    if isinstance(value, _dt.timedelta):
        return {"__timedelta__": value.total_seconds()}
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            items.append((_sort_token(_object_key(k, f"{path} key")),
                          _normalise(v, f"{path}[{k!r}]")))
        items.sort(key=_BY_TOKEN)
        return {"__map__": [[k, v] for k, v in items]}
    if isinstance(value, (set, frozenset)):
        members = [_normalise(v, f"{path} member") for v in value]
        return {"__set__": sorted(members, key=_sort_token)}
    if isinstance(value, (list, tuple)):
        return [_normalise(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"__dataclass__": type(value).__qualname__,
                "fields": _normalise(fields, path)}
    dlock_key = getattr(value, "__dlock_key__", None)
    if callable(dlock_key):
        return {"__custom__": type(value).__qualname__,
                "key": _normalise(dlock_key(), path)}
    text = repr(value)
    if _has_address(text):
        raise _Unkeyable(path, value, "its text holds a memory address, so no two calls "
                         "would ever share a key")
    # A type with a stable repr (namedtuple-like, value objects): key on that.
    return {"__repr__": f"{type(value).__module__}.{type(value).__qualname__}",
            "text": text}


def _normalise_enum(value: enum.Enum, path: str) -> Any:
    return {"__enum__": f"{type(value).__qualname__}.{value.name}"}


# json.dumps with these options makes a new encoder at every call.
_TOKEN = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _sort_token(value: Any) -> str:
    return _TOKEN.encode(value)


def canonical(value: Any, *, where: str = "argument") -> str:
    """Canonical JSON text of ``value`` (raises :class:`UnkeyableArgument`)."""
    try:
        normalised = _normalise(value, where)
    except _Unkeyable as exc:
        raise UnkeyableArgument(
            f"cannot key {exc.path}={exc.value!r}: {exc.why}; pass a plain value "
            f"(id, string, number), give the type a __dlock_key__() method, or set "
            f"lock_key / lock_args on the task") from None
    return _CANONICAL.encode(normalised)


def _parameters(fun: Callable[..., Any], drop_first: bool) -> inspect.Signature:
    sig = inspect.signature(fun)
    if drop_first:
        params = list(sig.parameters.values())
        if params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                         inspect.Parameter.POSITIONAL_OR_KEYWORD):
            sig = sig.replace(parameters=params[1:])
    return sig


def _quick_arguments(
    sig: inspect.Signature,
    bind: Callable[[tuple[Any, ...], Mapping[str, Any]], inspect.BoundArguments],
) -> Callable[[tuple[Any, ...], Mapping[str, Any]], dict[str, Any]]:
    """``arguments_of(args, kwargs)``: ``dict(bind(args, kwargs).arguments)``, without
    ``Signature.bind`` for a call it can match by itself: when every parameter is
    positional-or-keyword, and the call names each at most once and no other.  Any
    other call (or a missing argument, whose error ``bind`` words) goes to ``bind``.
    The key of a call is the same either way (the names and values are)."""
    params = sig.parameters
    P = inspect.Parameter
    if not all(p.kind is P.POSITIONAL_OR_KEYWORD for p in params.values()):
        return lambda args, kwargs: dict(bind(args, kwargs).arguments)
    names = tuple(params)
    defaults = tuple(p.default for p in params.values())

    def arguments_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if len(args) > len(names):
            return dict(bind(args, kwargs).arguments)
        values = dict(zip(names, args, strict=False))
        used = 0
        for i in range(len(args), len(names)):
            name = names[i]
            if name in kwargs:
                values[name] = kwargs[name]
                used += 1
            elif defaults[i] is not P.empty:
                values[name] = defaults[i]
            else:  # missing: bind says so
                return dict(bind(args, kwargs).arguments)
        if used != len(kwargs):  # a name it does not take, or one given twice
            return dict(bind(args, kwargs).arguments)
        return values

    return arguments_of


def _template_fields(template: str) -> list[str]:
    fields = []
    for _, field_name, _, _ in string.Formatter().parse(template):
        if field_name is None:
            continue
        if field_name == "" or field_name.isdigit():
            raise ValueError("positional fields ({} or {0}) are not allowed: name the "
                             "argument, as in {product_id}")
        fields.append(re.split(r"[.\[]", field_name, maxsplit=1)[0])
    return fields


def _plain_fields(template: str) -> set[str]:
    """Fields used as they are (``{x}``: no format spec, conversion, attribute or
    index): these are filled with the value's JSON text (:func:`json_scalar`)."""
    plain, other = set(), set()
    for _, field_name, spec, conversion in string.Formatter().parse(template):
        if not field_name:
            continue
        root = re.split(r"[.\[]", field_name, maxsplit=1)[0]
        if root == field_name and not spec and conversion is None:
            plain.add(root)
        else:
            other.add(root)
    return plain - other


def make_key_function(
    task_name: str,
    fun: Callable[..., Any],
    lock_key: str | Callable[..., Any] | None,
    lock_args: Iterable[str] | None = None,
    *,
    drop_first: bool = False,
) -> KeyFunction:
    """Validate a task's key settings now and return ``key(args, kwargs) -> name``.

    ``fun`` is the task's ``run``; ``drop_first`` drops its first parameter (``self``
    of a bound task).  Raises :class:`InvalidLockConfig` naming the task and the
    offending field or argument.
    """
    sig = _parameters(fun, drop_first)
    params = sig.parameters
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def bind(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise UnkeyableArgument(f"cannot bind the call to {task_name}"
                                    f"{sig}: {exc}") from None
        bound.apply_defaults()
        return bound

    arguments_of = _quick_arguments(sig, bind)

    if lock_args is not None:
        if isinstance(lock_args, str):
            lock_args = (lock_args,)
        lock_args = tuple(lock_args)
        unknown = [a for a in lock_args if a not in params]
        if unknown:
            raise InvalidLockConfig(
                f"task {task_name}: lock_args names {', '.join(map(repr, unknown))}, "
                f"which {task_name}{sig} does not have")
        if lock_key is not None:
            raise InvalidLockConfig(f"task {task_name}: lock_args goes with the default "
                                    "key (lock_key=None), not with lock_key")

    if isinstance(lock_key, str):
        template = lock_key
        if not template:
            raise InvalidLockConfig(f"task {task_name}: lock_key is an empty string")
        try:
            fields = _template_fields(template)
        except ValueError as exc:
            raise InvalidLockConfig(f"task {task_name}: lock_key {template!r}: {exc}") \
                from None
        for field in fields:
            if field not in params and not has_var_kw:
                raise InvalidLockConfig(
                    f"task {task_name}: lock_key {template!r} names {{{field}}}, but "
                    f"{task_name}{sig} has no argument {field!r}")

        plain = _plain_fields(template)

        def template_key(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            values = arguments_of(args, kwargs)
            for p in params.values():
                if p.kind is inspect.Parameter.VAR_KEYWORD:
                    values.update(values.pop(p.name, {}))
            for field in plain & values.keys():
                values[field] = json_scalar(values[field])
            try:
                name = template.format_map(values)
            except (KeyError, AttributeError, IndexError, TypeError) as exc:
                raise UnkeyableArgument(f"task {task_name}: lock_key {template!r} "
                                        f"cannot be filled from the call: {exc!r}") \
                    from None
            if _has_address(name):
                raise UnkeyableArgument(
                    f"task {task_name}: lock_key {template!r} gave {name!r}, whose text "
                    "holds a memory address, so no two calls would ever share it; key "
                    "on an id or a plain value instead")
            return name

        return template_key

    if callable(lock_key):
        key_callable = lock_key

        def callable_key(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            bound = bind(args, kwargs)
            name = key_callable(*bound.args, **bound.kwargs)
            if not isinstance(name, str) or not name:
                raise UnkeyableArgument(f"task {task_name}: lock_key callable returned "
                                        f"{name!r}; it must return a non-empty string")
            if _has_address(name):
                raise UnkeyableArgument(f"task {task_name}: lock_key callable returned "
                                        f"{name!r}, whose text holds a memory address")
            return name

        return callable_key

    if lock_key is not None:
        raise InvalidLockConfig(f"task {task_name}: lock_key must be a template string, "
                                f"a callable or None, got {lock_key!r}")

    selected = lock_args

    def keyed(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        arguments = arguments_of(args, kwargs)
        if selected is not None:
            arguments = {k: arguments[k] for k in selected}
        return arguments

    def hashed_key(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        text = canonical(dict(keyed(args, kwargs)), where=f"{task_name} argument")
        digest = hashlib.sha256(f"{task_name}\n{text}".encode()).hexdigest()
        return f"{task_name}:{digest}"

    return HashedKey(hashed_key, keyed)


def task_key_function(task_cls: type, task_name: str) -> KeyFunction | None:
    """The key function of a task class: its ``run`` and its ``lock_key`` /
    ``lock_args`` as the class sees them (the most derived class's own, or what
    ``task_annotations`` set).  None while the class has no ``run`` of its own making
    (an abstract base)."""
    run = inspect.getattr_static(task_cls, "run", None)
    if run is None:
        return None
    for klass in task_cls.__mro__:
        if "run" in klass.__dict__:
            if klass.__dict__.get("abstract"):
                return None  # celery.Task.run: nothing to bind a call to
            break
    fun = run.__func__ if isinstance(run, (staticmethod, classmethod)) else run
    lock_key = inspect.getattr_static(task_cls, "lock_key", None)
    if isinstance(lock_key, staticmethod):
        lock_key = lock_key.__func__
    return make_key_function(task_name, fun, lock_key,
                             getattr(task_cls, "lock_args", None),
                             drop_first=not isinstance(run, staticmethod))
