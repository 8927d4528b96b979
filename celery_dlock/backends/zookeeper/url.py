"""``zookeeper://`` URLs: which ensemble, which chroot, which credentials.

``zookeeper://[user:password@]host:port[,host:port...][/chroot][?connect_timeout=5]``

* several ``host:port`` pairs name the members of one ensemble (kazoo connects to one
  of them and moves to another when it fails);
* the path, when given, is a chroot: every lock lives under it;
* ``user:password`` is ZooKeeper's ``digest`` authentication (percent-encode ``:``,
  ``@``, ``/`` in it: README, "Settings");
* ``connect_timeout`` (seconds, default 10): how long the first connection may take
  before a call fails with :class:`~celery_dlock.BackendUnavailable`.

A URL that cannot be read raises :class:`~celery_dlock.InvalidLockConfig`, and no
message shows its password.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

from ...core.errors import InvalidLockConfig
from ...core.urls import ambiguity, mask_url

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "SCHEME", "ZkSpec", "parse_url"]

SCHEME = "zookeeper"
#: How long the first connection to the ensemble may take (seconds).
DEFAULT_CONNECT_TIMEOUT = 10.0

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+))"
                        r"(?::(?P<port>[0-9]{1,5}))?$")
_CHROOT_PART = re.compile(r"^[^\x00-\x1f\x7f]+$")


@dataclass(frozen=True)
class ZkSpec:
    """Where an ensemble is and how to log in: what a session is made from."""

    #: ``host:port`` pairs, in the order given.
    hosts: tuple[str, ...]
    #: The chroot ("" for none), as ``/a/b``.
    chroot: str = ""
    #: ``user:password`` for the digest scheme, or None.
    digest: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT

    @property
    def connect_string(self) -> str:
        """kazoo's ``hosts`` argument (the chroot appended)."""
        return ",".join(self.hosts) + self.chroot

    def __repr__(self) -> str:
        login = "**@" if self.digest else ""
        return f"ZkSpec('zookeeper://{login}{self.connect_string}')"


def parse_url(url: str, *, connect_timeout: float | None = None) -> ZkSpec:
    """The :class:`ZkSpec` of a ``zookeeper://`` URL; InvalidLockConfig saying what is
    wrong (naming no password) for anything else."""
    if not isinstance(url, str) or not url.startswith(f"{SCHEME}://"):
        shown = mask_url(url) if isinstance(url, str) else repr(url)
        raise InvalidLockConfig(f"a ZooKeeper URL starts with {SCHEME}://, got {shown}")
    why = ambiguity(url)
    if why is not None:
        raise InvalidLockConfig(f"cannot read the ZooKeeper URL: {why}")
    rest = url[len(SCHEME) + 3:]
    rest, _, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    digest = None
    if "@" in authority:
        userinfo, _, authority = authority.rpartition("@")
        user, colon, password = userinfo.partition(":")
        if not user or not colon:
            raise InvalidLockConfig(f"a ZooKeeper URL's login is user:password "
                                    f"(digest), got {mask_url(url)}")
        digest = f"{unquote(user)}:{unquote(password)}"
    hosts = []
    for part in authority.split(","):
        found = _HOST_PORT.match(part.strip())
        if found is None:
            raise InvalidLockConfig(f"a ZooKeeper URL names host:port pairs separated "
                                    f"by commas, got {part.strip()!r} in "
                                    f"{mask_url(url)}")
        port = int(found["port"] or 2181)
        if not 0 < port < 65536:
            raise InvalidLockConfig(f"port {port} is out of range in {mask_url(url)}")
        host = f"[{found['v6']}]" if found["v6"] else found["host"]
        hosts.append(f"{host}:{port}")
    chroot = ""
    if slash and path.strip("/"):
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if any(p in (".", "..") or not _CHROOT_PART.match(p) for p in parts):
            raise InvalidLockConfig(f"a ZooKeeper chroot is /name[/name...] (no '.', "
                                    f"'..' or control characters), got /{path}")
        chroot = "/" + "/".join(parts)
    options = dict(parse_qsl(query, keep_blank_values=True))
    timeout = connect_timeout
    raw = options.pop("connect_timeout", None)
    if raw is not None and timeout is None:
        try:
            timeout = float(raw)
        except ValueError:
            timeout = math.nan
    if options:
        raise InvalidLockConfig(f"unknown option(s) {sorted(options)} in a ZooKeeper "
                                f"URL (known: connect_timeout)")
    if timeout is None:
        timeout = DEFAULT_CONNECT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout < math.inf:
        raise InvalidLockConfig(f"connect_timeout must be a positive number of "
                                f"seconds, got {timeout!r}")
    return ZkSpec(tuple(hosts), chroot, digest, float(timeout))
