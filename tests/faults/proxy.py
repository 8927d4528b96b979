"""A TCP fault-injection proxy for the test suite (loopback only).

It sits between a Redis client and the suite's own ``redis-server`` and can, per
connection or for all of them at once:

* ``pass``: forward bytes both ways (the default);
* ``black_hole()``: keep every connection open but forward nothing either way and
  send no RST: the client waits until its own socket timeout, as behind a partition;
  new connections are accepted and black-holed too.  What was sent meanwhile is lost,
  and :meth:`FaultProxy.heal` closes the connections it was lost on (their byte
  streams are broken), so a request that timed out never reaches the server late;
* ``drop_reply(pattern)``: forward the next request that contains ``pattern`` (so the
  server runs it) and swallow every reply on that connection from then on: the client
  times out, reconnects and may re-send the command, as redis-py's ``Retry`` does;
* ``point_to(port)``: send new connections to another server (a failover);
* ``delay(seconds)``: hold every chunk for ``seconds`` before forwarding it;
* ``hold_request(pattern)``: hold the next request that contains ``pattern`` until
  the test lets it go (:class:`HeldRequest`), then forward it, even when the client
  gave up on it meanwhile: a request that reaches the server late, at a moment the
  test chooses.

Everything is bounded: pump threads poll with a short timeout and stop with
:meth:`FaultProxy.close`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from types import TracebackType

__all__ = ["FaultProxy", "HeldRequest"]

_POLL = 0.05
#: The longest a held request waits for the test to let it go (seconds).
_HOLD_MAX = 30.0


class HeldRequest:
    """A request :meth:`FaultProxy.hold_request` holds: ``arrived`` is set when the
    proxy has it, ``forwarded`` once it went on to the server after :meth:`let_go`."""

    def __init__(self, pattern: bytes) -> None:
        self.pattern = pattern
        self.arrived = threading.Event()
        self.forwarded = threading.Event()
        self._go = threading.Event()

    def let_go(self) -> None:
        self._go.set()

    def wait_to_go(self) -> None:
        self.arrived.set()
        self._go.wait(_HOLD_MAX)


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: FaultProxy, client: socket.socket,
                 upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.drop_replies = False
        self.lost_bytes = 0
        self.closed = False
        self.threads = [
            threading.Thread(target=self._pump, args=(client, upstream, True),
                             daemon=True, name="fault-proxy-up"),
            threading.Thread(target=self._pump, args=(upstream, client, False),
                             daemon=True, name="fault-proxy-down"),
        ]
        for t in self.threads:
            t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while not self.closed and not self.proxy.closed:
                if self.lost_bytes and not self.proxy.holding:
                    break  # the stream lost bytes in the black hole: it is broken
                ready, _, _ = select.select([src], [], [], _POLL)
                if not ready:
                    continue
                chunk = src.recv(65536)
                if not chunk:
                    break
                if self.proxy.holding:
                    self.lost_bytes += len(chunk)  # black hole: say nothing
                    continue
                self._forward(chunk, dst, upstream)
        except OSError:
            pass
        finally:
            self.close()

    def _forward(self, chunk: bytes, dst: socket.socket, upstream: bool) -> None:
        proxy = self.proxy
        if proxy.delay_s > 0:
            time.sleep(proxy.delay_s)
        if upstream:
            held = proxy.take_held(chunk)
            if held is not None:
                held.wait_to_go()
                dst.sendall(chunk)
                held.forwarded.set()
                return
            if proxy.take_match(chunk):
                self.drop_replies = True
        elif self.drop_replies:
            proxy.dropped_bytes += len(chunk)
            return
        dst.sendall(chunk)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.close()


class FaultProxy:
    """Listen on 127.0.0.1 (a free port) and forward to ``upstream_port``."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        if upstream_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the fault proxy only forwards to loopback")
        self.upstream = (upstream_host, upstream_port)
        self.closed = False
        self.holding = False
        self.delay_s = 0.0
        self.dropped_bytes = 0
        self._patterns: list[bytes] = []
        self._drops_left = 0
        self._matched = threading.Event()
        self._held: list[HeldRequest] = []
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._accepter = threading.Thread(target=self._accept, daemon=True,
                                          name="fault-proxy-accept")
        self._accepter.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- faults ---------------------------------------------------------------------

    def point_to(self, upstream_port: int) -> None:
        """New connections go to ``upstream_port`` from now on (a failover behind a
        DNS name or a virtual IP); open ones stay where they are until closed."""
        self.upstream = (self.upstream[0], upstream_port)

    def black_hole(self) -> None:
        """Forward nothing, on old and new connections, and never reset them."""
        self.holding = True

    def heal(self) -> None:
        """Back to ``pass``: no more delay or drops; connections that lost bytes in
        the black hole are closed."""
        self.delay_s = 0.0
        with self._lock:
            self._patterns = []
            self._drops_left = 0
        self.holding = False

    def delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def drop_reply(self, *patterns: bytes, times: int = 1) -> threading.Event:
        """Swallow the replies on the connection of the next request matching one of
        ``patterns`` (``times`` such requests); the returned event is set on a match."""
        with self._lock:
            self._patterns = list(patterns)
            self._drops_left = times
            self._matched.clear()
        return self._matched

    def hold_request(self, pattern: bytes) -> HeldRequest:
        """Hold the next request that contains ``pattern`` (on whatever connection)
        until the returned :class:`HeldRequest` is let go."""
        held = HeldRequest(pattern)
        with self._lock:
            self._held.append(held)
        return held

    def take_held(self, chunk: bytes) -> HeldRequest | None:
        with self._lock:
            for held in self._held:
                if held.pattern in chunk:
                    self._held.remove(held)
                    return held
        return None

    def take_match(self, chunk: bytes) -> bool:
        with self._lock:
            if self._drops_left <= 0:
                return False
            if not any(p in chunk for p in self._patterns):
                return False
            self._drops_left -= 1
        self._matched.set()
        return True

    def cut_all(self) -> None:
        """Close every current connection (an RST-like reset, for reconnect tests)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    # -- plumbing -------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.closed:
            try:
                ready, _, _ = select.select([self._listener], [], [], _POLL)
                if not ready:
                    continue
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._links.append(_Link(self, client, upstream))

    def close(self) -> None:
        self.closed = True
        with self._lock:
            held, self._held = self._held, []
        for h in held:
            h.let_go()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut_all()
        self._accepter.join(timeout=2)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
