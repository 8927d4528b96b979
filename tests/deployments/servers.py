"""Throwaway Redis topologies for the deployment tests: a cluster, a Sentinel group.

Every server is a ``redis-server`` child process on 127.0.0.1 (free ports, no
persistence, a temporary directory), started and stopped by the tests themselves.
Sentinels run as ``redis-server CONFIG --sentinel`` (Debian ships no separate
``redis-sentinel`` binary in the server package).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from celery_dlock.ops.embedded import find_redis_server

__all__ = ["Cluster", "SentinelGroup", "Server", "free_port", "make_certificates",
           "supports_cluster"]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections and ``bind(0)``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Ports this process handed out already: a server is configured with its port (and
#: its TLS port) before it binds, so two picks in a row must not return the same one.
_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too, both below the
    kernel's ephemeral range: a port picked from inside that range can be taken by any
    outgoing connection between this check and the server's own bind."""
    low, top = 10000, min(_ephemeral_floor(), 55536) - 10000
    if top - low < 2000:  # a kernel whose ephemeral range starts low: take the rest
        low, top = 20000, 45536
    for _ in range(500):
        port = random.randrange(low, top)
        if port in _handed_out or port + 10000 in _handed_out:
            continue
        if _bindable(port) and _bindable(port + 10000):
            _handed_out.update((port, port + 10000))
            return port
    raise RuntimeError("no free port pair found")


def _bounded_wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


class Server:
    """One ``redis-server`` process with a config file of its own."""

    def __init__(self, directory: str, lines: Sequence[str], *, sentinel: bool = False,
                 binary: str | None = None, port: int | None = None,
                 password: str | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.dir = Path(directory) / str(self.port)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sentinel = sentinel
        self.binary = binary or find_redis_server()
        self.config = self.dir / ("sentinel.conf" if sentinel else "redis.conf")
        base = [f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}",
                "save \"\"", "appendonly no", "loglevel warning",
                f"logfile {self.dir / 'server.log'}", "daemonize no"]
        if sentinel:
            base = [b for b in base if not b.startswith(("save", "appendonly"))]
        self.config.write_text("\n".join([*base, *lines]) + "\n")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> Server:
        args = [self.binary, str(self.config)] + (["--sentinel"] if self.sentinel else [])
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        client = self.client(socket_timeout=1)
        try:
            _bounded_wait(client.ping, timeout, f"redis-server on port {self.port}")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {self.log()[-800:]}") from None
        finally:
            client.close()
        return self

    def client(self, **kwargs: object) -> redis.Redis:
        kwargs.setdefault("password", self.password)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "server.log").read_text(errors="replace")
        return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                proc.wait(10)

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def supports_cluster(binary: str | None = None) -> str | None:
    """None when this redis-server can run a cluster, else why not."""
    try:
        binary = binary or find_redis_server()
    except Exception as exc:
        return str(exc)
    with tempfile.TemporaryDirectory(prefix="dlock-probe-") as tmp:
        server = Server(tmp, ["cluster-enabled yes", "cluster-config-file nodes.conf"],
                        binary=binary)
        try:
            server.start(timeout=5)
        except RuntimeError as exc:
            return f"{binary} cannot run in cluster mode: {exc}"
        finally:
            server.stop()
    return None


def make_certificates(directory: Path) -> None:
    """A throwaway CA (``ca.crt``) and a server certificate for 127.0.0.1 and localhost
    signed by it (``server.crt``, ``server.key``), made with ``openssl``."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True,
                       capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
        "-out", "ca.crt", "-days", "2", "-subj", "/CN=celery-dlock test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
        "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "ext", "-out", "server.crt")


class Cluster:
    """``masters`` cluster-enabled servers with the 16384 slots split between them.

    With ``certificates`` (a directory made by :func:`make_certificates`) every node
    also listens with TLS on ``tls_ports`` and the cluster bus runs over TLS
    (``tls-cluster yes``): a client that connects with TLS is then told the nodes'
    TLS ports, one that connects in the clear their plain ports.
    """

    def __init__(self, masters: int = 3, *, certificates: Path | None = None,
                 replicas: int = 0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="dlock-cluster-")
        self.tls_ports: list[int] = []
        self.servers = []
        self.masters = masters
        for _ in range(masters * (1 + replicas)):
            lines = ["cluster-enabled yes", "cluster-config-file nodes.conf",
                     "cluster-node-timeout 2000", "cluster-require-full-coverage no"]
            if certificates is not None:
                self.tls_ports.append(free_port())
                lines += [f"tls-port {self.tls_ports[-1]}",
                          f"tls-cert-file {certificates / 'server.crt'}",
                          f"tls-key-file {certificates / 'server.key'}",
                          f"tls-ca-cert-file {certificates / 'ca.crt'}",
                          "tls-auth-clients no", "tls-cluster yes"]
            self.servers.append(Server(self._tmp.name, lines))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.servers[0].port}/0"

    def start(self) -> Cluster:
        try:
            for server in self.servers:
                server.start()
            everyone = [s.client(socket_timeout=5) for s in self.servers]
            clients = everyone[:self.masters]
            per = 16384 // len(clients)
            for i, c in enumerate(clients):
                end = 16384 if i == len(clients) - 1 else (i + 1) * per
                # (ADDSLOTS, not ADDSLOTSRANGE: that is Redis 7 only)
                c.execute_command("CLUSTER ADDSLOTS", *range(i * per, end))
            # the bus listens at the client port + 10000: with tls-cluster, the TLS one
            meet = self.tls_ports[0] if self.tls_ports else self.servers[0].port
            for c in everyone[1:]:
                c.execute_command("CLUSTER MEET", "127.0.0.1", meet)

            def ready() -> bool:
                # every node sees every slot served by one of the three, none of them
                # still in handshake
                for c in clients:
                    info = c.execute_command("CLUSTER INFO")
                    state = (info.get("cluster_state") if isinstance(info, dict)
                             else info.decode())
                    if "ok" not in str(state):
                        return False
                    covered, owners = 0, set()
                    for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                        covered += int(end) - int(start) + 1
                        owners.add(int(master[1]))
                    if covered != 16384 or len(owners) != len(clients):
                        return False
                    nodes = c.execute_command("CLUSTER NODES")
                    text = str(nodes)
                    if len(nodes) != len(everyone) or "handshake" in text or \
                            "fail" in text:
                        return False
                return True

            _bounded_wait(ready, 20, "the cluster to agree on its slots")
            if len(everyone) > len(clients):
                self._attach_replicas(everyone)
            for c in everyone:
                c.close()
        except BaseException:
            self.stop()
            raise
        return self

    def _attach_replicas(self, everyone: list[redis.Redis]) -> None:
        """Make server ``masters + i`` a replica of master ``i % masters`` and wait
        until every replica has caught up with its master."""
        ids = [c.execute_command("CLUSTER MYID") for c in everyone[:self.masters]]
        for i, c in enumerate(everyone[self.masters:]):
            master = ids[i % self.masters]
            master_id = master.decode() if isinstance(master, bytes) else str(master)

            def knows_master(c: redis.Redis = c, master_id: str = master_id) -> bool:
                return master_id in str(c.execute_command("CLUSTER NODES"))

            _bounded_wait(knows_master, 20, "a replica to learn of its master")
            c.execute_command("CLUSTER REPLICATE", master_id)

        def synced() -> bool:
            return all(c.info("replication").get("master_link_status") == "up"
                       for c in everyone[self.masters:])

        _bounded_wait(synced, 30, "the replicas to sync with their masters")

    def master_of(self, key: str) -> Server:
        """The server that is master of ``key``'s slot now."""
        import redis.cluster

        client = redis.cluster.RedisCluster(host="127.0.0.1", port=self._entry().port)
        try:
            port = client.get_node_from_key(key).port
        finally:
            client.close()
        return next(s for s in self.servers if s.port == port)

    def _entry(self) -> Server:
        """A node that is running (a test may have killed the first)."""
        return next(s for s in self.servers
                    if s.process is not None and s.process.poll() is None)

    def client(self, **kwargs: object) -> redis.cluster.RedisCluster:
        import redis.cluster

        return redis.cluster.RedisCluster(host="127.0.0.1", port=self._entry().port,
                                          **kwargs)  # type: ignore[arg-type]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self._tmp.cleanup()


class SentinelGroup:
    """A master, ``replicas`` replicas and ``sentinels`` sentinels watching them (quorum:
    a majority), marking the master down after ``down_after`` ms.  ``password`` is the
    master's (and replicas') ``requirepass``, ``sentinel_password`` the sentinels'."""

    def __init__(self, master_name: str = "dlockmaster", down_after: int = 1000, *,
                 replicas: int = 1, sentinels: int = 3, password: str | None = None,
                 sentinel_password: str | None = None) -> None:
        self.master_name = master_name
        self._tmp = tempfile.TemporaryDirectory(prefix="dlock-sentinel-")
        auth = [f"requirepass {password}", f"masterauth {password}"] if password else []
        self.master = Server(self._tmp.name, auth, password=password)
        self.replicas = [Server(self._tmp.name,
                                [f"replicaof 127.0.0.1 {self.master.port}", *auth],
                                password=password)
                         for _ in range(replicas)]
        quorum = sentinels // 2 + 1
        sentinel_auth = ([f"requirepass {sentinel_password}"] if sentinel_password
                         else [])
        if password:
            sentinel_auth.append(f"sentinel auth-pass {master_name} {password}")
        self.sentinels = [
            Server(self._tmp.name, [
                f"sentinel monitor {master_name} 127.0.0.1 {self.master.port} {quorum}",
                f"sentinel down-after-milliseconds {master_name} {down_after}",
                f"sentinel failover-timeout {master_name} 10000",
                f"sentinel parallel-syncs {master_name} 1",
                *sentinel_auth], sentinel=True, password=sentinel_password)
            for _ in range(sentinels)]
        self.password = password
        self.sentinel_password = sentinel_password

    @property
    def servers(self) -> list[Server]:
        return [self.master, *self.replicas]

    def url(self) -> str:
        """Celery's spelling of this group (the master's password in the first URL)."""
        auth = f":{self.password}@" if self.password else ""
        return ";".join(f"sentinel://{auth if i == 0 else ''}127.0.0.1:{s.port}"
                        for i, s in enumerate(self.sentinels))

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", s.port) for s in self.sentinels]

    def start(self) -> SentinelGroup:
        try:
            for server in self.servers:
                server.start()
            master = self.master.client(socket_timeout=5, password=self.password)
            _bounded_wait(lambda: master.info("replication")["connected_slaves"]
                          >= len(self.replicas), 20, "the replicas to connect")
            master.close()
            for s in self.sentinels:
                s.start()
            _bounded_wait(self._sentinels_know_everything, 30,
                          "the sentinels to find the replicas and each other")
            _bounded_wait(self.replicas_ready, 30, "the replicas to be in sync")
        except BaseException:
            self.stop()
            raise
        return self

    def _sentinel_client(self, server: Server) -> redis.Redis:
        return server.client(socket_timeout=2)

    def _sentinels_know_everything(self) -> bool:
        for s in self.sentinels:
            c = self._sentinel_client(s)
            try:
                info = c.execute_command("SENTINEL", "MASTER", self.master_name)
                fields = dict(zip(info[::2], info[1::2], strict=True)) \
                    if isinstance(info, list) else info
                replicas = int(fields.get(b"num-slaves", fields.get("num-slaves", 0)))
                others = int(fields.get(b"num-other-sentinels",
                                        fields.get("num-other-sentinels", 0)))
                if replicas < len(self.replicas) or others < len(self.sentinels) - 1:
                    return False
            finally:
                c.close()
        return True

    def server_on(self, port: int) -> Server:
        return next(s for s in self.servers if s.port == port)

    def replicas_ready(self) -> bool:
        """Every replica is in sync with the current master and every sentinel
        counts it as a healthy replica (so it can be promoted)."""
        try:
            return self._replicas_ready()
        except (redis.RedisError, RuntimeError, StopIteration):
            return False

    def _replicas_ready(self) -> bool:
        master = self.server_on(self.current_master_port()).client(socket_timeout=2)
        try:
            info = master.info("replication")
            online = [v for k, v in info.items() if k.startswith("slave")
                      and isinstance(v, dict) and v.get("state") == "online"]
            if len(online) < len(self.replicas):
                return False
        finally:
            master.close()
        # ...and each replica says so too: its initial sync is over (Valkey 9 shows a
        # replica still loading it as "online" on the master's side, and counts it for
        # WAIT)
        for server in self.servers:
            if server.port == self.current_master_port():
                continue
            c = server.client(socket_timeout=2)
            try:
                info = c.info("replication")
            finally:
                c.close()
            if info.get("master_link_status") != "up" or \
                    int(info.get("master_sync_in_progress", 0)):
                return False
        for s in self.sentinels:
            c = self._sentinel_client(s)
            try:
                replicas = c.execute_command("SENTINEL", "REPLICAS", self.master_name)
            finally:
                c.close()
            healthy = 0
            for entry in replicas:
                fields = (dict(zip(entry[::2], entry[1::2], strict=True))
                          if isinstance(entry, list) else entry)
                flags = fields.get(b"flags", fields.get("flags", b""))
                flags = flags.decode() if isinstance(flags, bytes) else str(flags)
                if "down" not in flags and "disconnected" not in flags:
                    healthy += 1
            if healthy < len(self.replicas):
                return False
        return True

    def current_master_port(self) -> int:
        for s in self.sentinels:
            c = self._sentinel_client(s)
            try:
                with contextlib.suppress(redis.RedisError):
                    _, port = c.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
                    return int(port)
            finally:
                c.close()
        raise RuntimeError("no sentinel answers")

    def stop(self) -> None:
        everyone = (*self.sentinels, *self.servers)
        for server in everyone:  # all at once: each takes a moment to shut down
            if server.process is not None and server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)
                server.process.terminate()
        for server in everyone:
            server.stop()
        self._tmp.cleanup()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def tls_unsupported(binary: str | None = None) -> str | None:
    """None when this redis-server was built with TLS, else why not (a server without
    TLS refuses the ``tls-port`` directive; one with TLS asks for a certificate)."""
    binary = binary or find_redis_server()
    try:
        out = subprocess.run([binary, "--port", "0", "--tls-port", "1", "--save", "",
                              "--daemonize", "no"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{binary} could not be probed for TLS: {exc}"
    said = out.stdout + out.stderr
    if "Bad directive" in said:
        return f"{binary} was built without TLS (it refuses tls-port)"
    if "Failed finding TLS support" in said:  # Valkey without its TLS module
        return f"{binary} was built without TLS (it has no TLS connection type)"
    return None
