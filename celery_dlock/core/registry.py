"""Which backend keeps the locks: one table of URL schemes, each naming a backend by
the module that makes it, and what that backend can do (its *capabilities*).

The Celery face and ``celery dlock`` never look at a URL to decide what a backend
can do: they ask :func:`entry_for` (from the configuration alone, before any client
is made: the checks at declaration and at worker start) or the backend's own
``capabilities`` (:class:`~celery_dlock.core.protocol.Backend`).  A backend's module
is imported only when its first backend is made (:meth:`Entry.driver`), by name, so
``import celery_dlock`` imports no driver and ``task/`` imports no backend module.

A driver module has ``backend_from_url(url: str) -> Backend``; the Redis family's
(one Redis and Redlock) also ``backend_of_client(client) -> Backend`` (a client a
``dlock_client`` callable returned; a tuple of clients is a Redlock).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from .errors import InvalidLockConfig

__all__ = [
    "CAPABILITIES",
    "ENTRIES",
    "FENCING",
    "HISTORY",
    "INSPECT",
    "LIMIT",
    "MARKERS",
    "RATES",
    "REDIS_SCHEMES",
    "ClientDriver",
    "Driver",
    "Entry",
    "entry_for",
    "entry_named",
    "known_schemes",
    "redis_driver",
]

#: Queue markers: ``lock_mode`` other than ``while_running`` (enqueue-time uniqueness).
MARKERS = "markers"
#: Semaphores: ``lock_limit`` above 1.
LIMIT = "limit"
#: Per-name rates: ``lock_rate``.
RATES = "rates"
#: Fencing tokens on every hold.
FENCING = "fencing"
#: Holds listed, read and freed by force (``celery dlock ls/show/release``).
INSPECT = "inspect"
#: The recent history of each name (``dlock_record_events``, ``celery dlock top``).
HISTORY = "history"
#: Every capability, with what a user reads when one is missing.
CAPABILITIES = {
    MARKERS: "queue markers (a lock_mode other than while_running)",
    LIMIT: "semaphores (lock_limit above 1)",
    RATES: "per-name rates (lock_rate)",
    FENCING: "fencing tokens",
    INSPECT: "listing and freeing holds (celery dlock ls, show, release)",
    HISTORY: "a history of lock events (dlock_record_events)",
}


class Driver(Protocol):
    """What a backend's module offers the registry."""

    def backend_from_url(self, url: str) -> Any:
        """The backend of ``url`` (no server call)."""


class ClientDriver(Driver, Protocol):
    """The Redis family's module: its URLs in every spelling, and a backend also from
    a client made elsewhere (the Celery face makes one per app and process, with the
    app's options, or a ``dlock_client`` callable returns it)."""

    def backend_of_client(self, client: Any) -> Any:
        """The backend of ``client`` (a tuple of clients: a Redlock)."""

    def redis_url_of(self, url: Any) -> str | None:
        """``url`` as redis-py opens it, when it names one Redis (a server, a
        Cluster, Sentinel); else None."""

    def redlock_urls(self, value: Any) -> tuple[str, ...] | None:
        """The servers of a Redlock URL (or list), or None when it is not one."""

    def is_cluster_url(self, url: object) -> bool:
        """Whether ``url`` names a Redis Cluster."""

    def default_client_options(self) -> dict[str, Any]:
        """The client options every client of the locks starts from."""

    def transport_options(self, url: str, options: Any, setting: str
                          ) -> Mapping[str, Any]:
        """The transport options ``url`` takes (Sentinel's), checked."""

    def client_from_url(self, url: str, options: Mapping[str, Any],
                        transport: Any = None, where: str = ...) -> Any:
        """A client for ``url``; its errors (InvalidLockConfig, BackendUnavailable)
        name ``where`` it was given, the URL masked."""

    def check_client_options(self, client: Any) -> None:
        """Make (not open) one connection, so that a bad option is found now."""


@dataclass(frozen=True)
class Entry:
    """One kind of backend: the schemes of its URLs, the module that makes it, the
    extra that installs its driver, and its capabilities."""

    kind: str
    schemes: tuple[str, ...]
    module: str
    capabilities: frozenset[str]
    #: ``pip install 'celery-dlock[extra]'`` installs its driver (None: always there).
    extra: str | None = None
    #: The driver package, as a user knows it (for the message when it is missing).
    needs: str = ""
    #: Why it lacks a capability, where there is more to say than that it does.
    why_not: tuple[tuple[str, str], ...] = ()

    def can(self, capability: str) -> bool:
        """Whether this backend has ``capability`` (one of :data:`CAPABILITIES`)."""
        return capability in self.capabilities

    def driver(self) -> Driver:
        """The backend's module, imported now (once); :class:`InvalidLockConfig`
        naming the extra to install when its driver is missing."""
        found = _drivers.get(self.module)
        if found is not None:
            return found
        # importlib serialises imports itself: a lock of ours would only be one more
        # that a forked child could inherit held.
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            if self.extra is None:
                raise
            raise InvalidLockConfig(
                f"{self.schemes[0]}:// locks need {self.needs}: pip install "
                f"'celery-dlock[{self.extra}]' ({exc})") from None
        found = _drivers[self.module] = cast(Driver, module)
        return found

    def missing(self, capability: str, what: str) -> str:
        """``what`` (a setting) needs ``capability``, which this backend lacks."""
        why = dict(self.why_not).get(capability)
        return (f"{what} needs {CAPABILITIES[capability]}, which the {self.kind} "
                f"backend does not keep{': ' + why if why else ''} "
                f"({_who_can(capability)}; docs/backends.md)")


#: The modules imported so far, by name (a module stays imported in a forked child).
_drivers: dict[str, Driver] = {}
_ALL = frozenset(CAPABILITIES)
_REDIS_DRIVER = "celery_dlock.backends.redis.driver"
#: One Redis server (or a Cluster, or Sentinel), in redis-py's and Celery's spellings.
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "sentinel", "redis+socket",
                 "socket")

#: Every backend, in the order error messages list them.
ENTRIES: tuple[Entry, ...] = (
    Entry("redis", REDIS_SCHEMES, _REDIS_DRIVER, _ALL),
    # Redlock's holds are on several servers: each is read (--url) one at a time.
    Entry("redlock", ("redlock",), _REDIS_DRIVER, frozenset(),
          why_not=((LIMIT, "each of its independent servers would count the holders "
                           "on its own, and a quorum of them could each grant a "
                           "different set, so more than lock_limit could run at once"),)),
    Entry("postgres", ("postgresql", "postgres"),
          "celery_dlock.backends.sql.postgres",
          frozenset({FENCING, INSPECT, LIMIT, MARKERS, RATES}),
          "postgres", "psycopg 3"),
    Entry("mysql", ("mysql", "mariadb"), "celery_dlock.backends.sql.mysql",
          frozenset({FENCING, INSPECT, LIMIT, MARKERS, RATES}), "mysql", "PyMySQL"),
    Entry("zookeeper", ("zookeeper",), "celery_dlock.backends.zookeeper",
          frozenset({FENCING, INSPECT, LIMIT, MARKERS, RATES}), "zookeeper", "kazoo"),
)
_BY_SCHEME = {scheme: entry for entry in ENTRIES for scheme in entry.schemes}
_BY_KIND = {entry.kind: entry for entry in ENTRIES}


def _who_can(capability: str) -> str:
    kinds = [e.kind for e in ENTRIES if e.can(capability)]
    return "kept by: " + ", ".join(kinds)


def redis_driver() -> ClientDriver:
    """The Redis family's module (one Redis and Redlock share it)."""
    return cast(ClientDriver, _BY_KIND["redis"].driver())


def entry_named(kind: str) -> Entry:
    """The backend called ``kind`` (``redis``, ``redlock``, ``postgres``, ...)."""
    return _BY_KIND[kind]


def _scheme(url: str) -> str | None:
    head, sep, _ = url.partition("://")
    return head.strip().lower() if sep else None


def entry_for(url: Any) -> Entry | None:
    """The backend a lock URL names, from its form alone (nothing is imported nor
    parsed beyond the scheme): a list or tuple of URLs, or ``redlock://`` URLs, is a
    Redlock; otherwise the scheme decides.  None: no backend reads it."""
    if isinstance(url, (list, tuple)):
        return _BY_KIND["redlock"]
    if not isinstance(url, str):
        return None
    scheme = _scheme(url)
    return None if scheme is None else _BY_SCHEME.get(scheme)


def known_schemes() -> str:
    """The URL forms every backend reads, for error messages."""
    return ("redis://, rediss://, unix://, redis+cluster://, sentinel://, "
            "redlock://a;redlock://b;redlock://c (or a list of 3+ Redis URLs), "
            "postgresql://, postgres://, mysql://, mariadb://, "
            "zookeeper://host:port[,host:port][/chroot]")

