"""Three independent redis-servers for the Redlock tests."""

from __future__ import annotations

import signal
from typing import Any

import redis
from servers import Server

__all__ = ["Trio"]


class Trio:
    """Three independent redis-servers (no persistence: a restart starts empty)."""

    def __init__(self, directory: str) -> None:
        self.servers = [Server(directory, ["maxmemory-policy noeviction"])
                        for _ in range(3)]
        self._clients: list[redis.Redis] = []

    def start(self) -> Trio:
        for s in self.servers:
            s.start()
        return self

    def clients(self, **kwargs: Any) -> list[redis.Redis]:
        kwargs.setdefault("socket_timeout", 5)
        made = [s.client(**kwargs) for s in self.servers]
        self._clients += made
        return made

    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{s.port}/0" for s in self.servers]

    def stop_process(self, i: int) -> None:
        self.servers[i].kill(signal.SIGSTOP)

    def resume(self, i: int) -> None:
        self.servers[i].kill(signal.SIGCONT)

    def restart_empty(self, i: int) -> None:
        server = self.servers[i]
        server.kill(signal.SIGKILL)
        server.start()

    def restart_keeping_data(self, i: int) -> None:
        """Node ``i`` saved to disk, killed and started again: its data is back, and
        every connection made to it before is closed."""
        server = self.servers[i]
        c = server.client(socket_timeout=5)
        try:
            c.save()
        finally:
            c.close()
        server.kill(signal.SIGKILL)
        server.start()

    def holders(self, key: str) -> list[str | None]:
        """The owner of ``key`` on each node, asked directly."""
        out: list[str | None] = []
        for s in self.servers:
            c = s.client(socket_timeout=5)
            try:
                value = c.hget(key, "owner")
            finally:
                c.close()
            out.append(value.decode() if value is not None else None)
        return out

    def close(self) -> None:
        for c in self._clients:
            c.close()
        for s in self.servers:
            s.stop()
