"""One chaos run: the lock's server (Redis with an AOF, PostgreSQL or ZooKeeper:
:mod:`chaos_servers`) behind the fault proxy, the broker (that Redis, another one, or
RabbitMQ), the database, ``celery worker`` prefork subprocesses and the standalone
client, a producer that keeps the queue fed, and the fault threads of
:mod:`chaos_faults`.  Everything lands in a run directory:
``records/*.jsonl`` (the processes' own records), ``driver.jsonl`` (faults, sent
tasks, restarts) and ``meta.json``; :mod:`chaos_check` reads them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import chaos_db
import chaos_servers
from chaos_faults import BROKER_KINDS, KINDS, WORKER_KINDS, Fault, schedule
from chaos_records import Recorder, Tail, read_all, read_lines

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
REPO = TESTS.parent
for extra in (TESTS / "faults", TESTS / "fencing", TESTS):
    if str(extra) not in sys.path:
        sys.path.append(str(extra))

from dlock_helpers import child_pids  # noqa: E402
from proxy import FaultProxy  # noqa: E402


@dataclass
class Config:
    seed: int = 1
    seconds: float = 60.0
    lock: str = "redis"  # the lock's server: or "postgresql", "zookeeper"
    broker: str = "redis"  # or "amqp" (RabbitMQ)
    db: str = "sqlite"  # or "postgresql"
    workers: int = 1  # celery worker main processes
    concurrency: int = 2  # prefork children each
    ttl: float = 2.0
    mean_gap: float = 0.6  # mean seconds between fault starts
    writes: int = 4  # fenced increments per hold
    gap: float = 0.1  # seconds between them
    settle: float = 10.0  # fault-free seconds at the end, before draining
    drain: float = 60.0  # at most this long waiting for sent tasks to end
    scenario: str = "lock"  # or "modes" (chaos_modes: lock_mode, on_duplicate, rates)
    own_broker: bool = False  # a Redis broker apart from the lock's Redis

    @property
    def shared_broker(self) -> bool:
        """Whether the broker is the lock's server (Redis for both)."""
        return self.lock == "redis" and self.broker == "redis" and not self.own_broker

    def kinds(self) -> list[str]:
        """The faults of this run: the lock's, and the broker's restarts when the
        broker is a server of its own (docs/chaos.md).  The modes scenario has no
        standalone client and pauses no holder; it kills whole workers too."""
        broker = [] if self.shared_broker else [*BROKER_KINDS]
        if self.scenario == "modes":
            return [*(k for k in KINDS if k not in ("kill_client", "stop_holder")),
                    *broker, *WORKER_KINDS]
        return [*KINDS, *broker]

    @property
    def modes(self) -> bool:
        return self.scenario == "modes"


class Run:
    def __init__(self, cfg: Config, out: Path) -> None:
        self.cfg = cfg
        self.out = out
        self.records = out / "records"
        self.records.mkdir(parents=True, exist_ok=True)
        self.log = Recorder(out / "driver.jsonl")
        self.prefix = f"chaos{cfg.seed}x{uuid.uuid4().hex[:6]}"
        self.queue = f"q-{self.prefix}"
        self.lock_name = "chaos:counter"
        self.stopping = threading.Event()
        self.faults_over = threading.Event()
        self.server_lock = threading.Lock()  # held while the lock's server is down
        self.workers: list[subprocess.Popen[bytes]] = []
        self.client: subprocess.Popen[bytes] | None = None
        self.stopped: set[int] = set()
        self.t0 = time.time()
        self.tail = Tail(self.records)
        self.server: chaos_servers.LockServer | None = None
        self.broker: chaos_servers.Broker | None = None
        self.proxy: FaultProxy | None = None
        self.pg: Any = None
        try:
            self.start_servers(out)
        except BaseException:
            self.stop_servers()
            raise

    def start_servers(self, out: Path) -> None:
        cfg = self.cfg
        self.server = server = chaos_servers.lock_server(cfg.lock, out)
        if cfg.shared_broker:
            assert isinstance(server, chaos_servers.RedisServer)
            self.broker = server
        else:
            self.broker = chaos_servers.broker(cfg.broker, out)
        self.broker_url = self.broker.url
        self.proxy = FaultProxy(server.port)
        self.lock_url = server.lock_url(self.proxy.port)
        if cfg.db == "postgresql":
            from pg_server import PostgresServer

            self.pg = PostgresServer().start()
            self.dsn = self.pg.url
        else:
            self.dsn = str(out / "chaos.sqlite3")
        chaos_db.create(cfg.db, self.dsn)
        if cfg.db == "sqlite":
            conn = chaos_db.connect("sqlite", self.dsn)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.close()

    def stop_servers(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        for each in {id(x): x for x in (self.server, self.broker, self.pg)}.values():
            if each is not None:
                with contextlib.suppress(Exception):
                    each.stop()

    # -- processes --------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "CHAOS_BROKER_URL": self.broker_url, "CHAOS_BROKER": self.cfg.broker,
            "CHAOS_LOCK_URL": self.lock_url,
            "CHAOS_PREFIX": self.prefix, "CHAOS_QUEUE": self.queue,
            "CHAOS_DB": self.cfg.db, "CHAOS_DSN": self.dsn,
            "CHAOS_RECORDS": str(self.records), "CHAOS_TTL": str(self.cfg.ttl),
            # modes: a killed worker's messages come back sooner (countdowns < 3 s)
            "CHAOS_VISIBILITY": "8" if self.cfg.modes else "30",
            "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]),
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def start_worker(self, n: int) -> subprocess.Popen[bytes]:
        proc = start_worker(self.out / f"worker{n}.log", self.env(), self.queue,
                            f"chaos{n}-{self.prefix}", self.cfg.concurrency)
        self.log("worker_start", n=n, worker_pid=proc.pid)
        return proc

    def start_client(self) -> subprocess.Popen[bytes]:
        log = open(self.out / "client.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "chaos_client.py"), "--lock-url", self.lock_url,
             "--prefix", self.prefix, "--name", self.lock_name, "--ttl",
             str(self.cfg.ttl), "--db", self.cfg.db, "--dsn", self.dsn, "--records",
             str(self.records), "--writes", str(self.cfg.writes), "--gap",
             str(self.cfg.gap)],
            cwd=HERE, env=self.env(), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.log("client_start", client_pid=proc.pid)
        return proc

    def children(self) -> list[int]:
        return [pid for w in self.workers for pid in child_pids(w.pid)]

    def supervise(self) -> None:
        """Restart a worker whose main process exited (a broker reconnect can crash
        it) and the client after a kill, until the run stops."""
        while not self.stopping.wait(0.3):
            for i, w in enumerate(self.workers):
                if w.poll() is not None:
                    self.log("worker_exit", n=i, worker_pid=w.pid, code=w.returncode)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(w.pid, signal.SIGKILL)  # orphaned children
                    self.workers[i] = self.start_worker(i)
            if self.client is not None and self.client.poll() is not None:
                self.client = self.start_client()

    # -- the producer -----------------------------------------------------------------

    def produce(self, app: Any) -> None:
        assert self.broker is not None
        target = 2 * (self.cfg.workers * self.cfg.concurrency)
        while not self.stopping.is_set() and not self.faults_over.is_set():
            try:
                if self.broker.queue_length(self.queue) < target:
                    task_id = uuid.uuid4().hex
                    app.send_task("chaos.bump", kwargs={
                        "key": "counter", "writes": self.cfg.writes,
                        "gap": self.cfg.gap}, task_id=task_id, queue=self.queue)
                    self.log("sent", task_id=task_id)
                    continue
            except Exception as exc:  # the server is down or paused: try again
                self.log("send_failed", error=type(exc).__name__)
            time.sleep(0.1)
        self.log("producer_stopped")

    # -- faults -----------------------------------------------------------------------

    def fresh_holder(self, since: float, timeout: float) -> int | None:
        """The pid of a hold acquired after ``since`` and not yet released or told
        lost (waiting up to ``timeout`` for one): a holder with writes still to make."""
        deadline = time.monotonic() + timeout
        while True:
            self.tail.read()
            pid = self.tail.newest_open(since)
            if pid is not None or time.monotonic() > deadline or self.stopping.is_set():
                return pid
            time.sleep(0.01)

    def inject(self, f: Fault) -> dict[str, Any]:
        """Start the fault, keep it on for its duration, end it; what it hit."""
        kind = f.kind
        if kind == "kill_child":
            kids = self.children()
            if not kids:
                return {"target": None}
            pid = kids[int(f.pick * len(kids))]
            os.kill(pid, signal.SIGKILL)
            return {"target": pid}
        if kind == "kill_worker":
            if not self.workers:
                return {"target": None}
            pid = self.workers[int(f.pick * len(self.workers))].pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # its children too (its session)
            return {"target": pid}
        if kind == "kill_client":
            if self.client is None:
                return {"target": None}
            pid = self.client.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return {"target": pid}
        if kind == "stop_holder":
            holder = self.fresh_holder(time.time(), 2 * self.cfg.ttl)
            if holder is None:  # nobody acquired meanwhile: any writer
                kids = self.children() + ([self.client.pid] if self.client else [])
                holder = kids[int(f.pick * len(kids))] if kids else None
            if holder is None:
                return {"target": None}
            pid = holder
            self.stopped.add(pid)
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(f.duration)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                self.stopped.discard(pid)
            return {"target": pid}
        assert self.server is not None and self.broker is not None
        assert self.proxy is not None
        if kind == "server_restart":
            with self.server_lock:
                how = self.server.restart(bool(f.amount), f.duration)
            return {"target": self.cfg.lock, "how": how}
        if kind == "server_pause":
            with self.server_lock:
                self.server.pause(f.duration)
            return {"target": self.cfg.lock}
        if kind == "broker_restart":
            how = self.broker.restart(bool(f.amount), f.duration)
            return {"target": self.cfg.broker, "how": how}
        if kind == "latency":
            self.proxy.delay(f.amount)
            time.sleep(f.duration)
            self.proxy.heal()
            return {"target": "proxy"}
        if kind == "black_hole":
            self.proxy.black_hole()
            time.sleep(f.duration)
            self.proxy.heal()
            return {"target": "proxy"}
        raise ValueError(kind)

    def channel(self, faults: list[Fault]) -> None:
        for f in faults:
            wait = self.t0 + f.at - time.time()
            if wait > 0 and self.stopping.wait(wait):
                return
            start = time.time()
            try:
                hit = self.inject(f)
                error = None
            except Exception as exc:
                hit, error = {}, f"{type(exc).__name__}: {exc}"
            self.log("fault", **f.as_dict(), start=start, end=time.time(), error=error,
                     **hit)

    # -- the run ----------------------------------------------------------------------

    def execute(self) -> None:
        from celery import Celery

        cfg = self.cfg
        faults = schedule(cfg.seed, cfg.seconds, cfg.mean_gap, cfg.ttl, cfg.kinds())
        meta: dict[str, Any] = {"config": asdict(cfg), "prefix": self.prefix,
                                "lock_name": self.lock_name, "scheduled": len(faults),
                                "kinds": cfg.kinds(), "t0": self.t0,
                                "python": sys.version.split()[0]}
        app = Celery("chaos_producer", set_as_current=False)
        app.conf.update(broker_url=self.broker_url, task_ignore_result=True,
                        broker_connection_retry_on_startup=True)
        if cfg.broker == "amqp":  # a send counts once the broker has it on disk
            app.conf.broker_transport_options = {"confirm_publish": True}
        threads: list[threading.Thread] = []
        try:
            self.workers = [self.start_worker(i) for i in range(cfg.workers)]
            if cfg.modes:  # the modes scenario's producer (modes_producer.py)
                import modes_producer

                meta.update(modes_producer.meta(cfg.lock))
                produce = threading.Thread(target=modes_producer.produce,
                                           args=(self,), daemon=True)
            else:
                self.client = self.start_client()
                produce = threading.Thread(target=self.produce, args=(app,),
                                           daemon=True)
            threads.append(threading.Thread(target=self.supervise, daemon=True))
            threads.append(produce)
            by_channel: dict[str, list[Fault]] = {}
            for f in faults:
                by_channel.setdefault(f.channel, []).append(f)
            fault_threads = [threading.Thread(target=self.channel, args=(fs,),
                                              daemon=True)
                             for fs in by_channel.values()]
            for t in threads + fault_threads:
                t.start()
            end = self.t0 + cfg.seconds + 60 * max(5.0, cfg.seconds / 10)
            for t in fault_threads:
                t.join(timeout=max(1.0, end - time.time()))
            meta["faults_end"] = time.time()
            self.log("faults_over")
            time.sleep(cfg.settle)
            self.faults_over.set()
            meta["drain"] = self.drain()
        finally:
            self.stopping.set()
            for t in threads:
                t.join(timeout=10)
            meta["stop"] = self.stop_processes()
            assert self.server is not None and self.broker is not None
            meta["broker_left"] = chaos_servers.kept_tasks(self.broker, self.queue)
            meta["left"] = chaos_servers.locks_left_after(self.server, self.prefix,
                                                          self.cfg.ttl + 5)
            meta["end"] = time.time()
            meta["db_read"] = chaos_db.read(cfg.db, self.dsn)
            (self.out / "meta.json").write_text(json.dumps(meta, indent=1))
            app.close()
            self.stop_servers()

    def drain(self) -> dict[str, Any]:
        """Wait until every task sent has ended (modes: every accepted call), or
        nothing changes for 20 s (modes: 12 s), or ``drain`` seconds have passed."""
        started = time.monotonic()
        last_change, last = started, -1
        while time.monotonic() - started < self.cfg.drain:
            sent, ended = set(), set()
            for rec in read_lines(self.out / "driver.jsonl"):
                if rec["ev"] == "sent":
                    sent.add(rec["task_id"])
            for rec in read_all(self.records):
                if rec["ev"] == "task_end" and rec.get("state") == "SUCCESS":
                    ended.add(rec["task_id"])
            pending = len(sent - ended)
            if self.cfg.modes:
                import modes_check

                pending = modes_check.pending(self.out)
            if pending == 0:
                break
            if pending != last:
                last, last_change = pending, time.monotonic()
            elif time.monotonic() - last_change > (12 if self.cfg.modes else 20):
                # (modes: a killed worker's messages are back within 8 s)
                break
            time.sleep(0.5)
        return {"seconds": round(time.monotonic() - started, 1)}

    def stop_processes(self) -> dict[str, Any]:
        procs = [*self.workers, *([self.client] if self.client else [])]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        forced = 0
        for p in procs:
            if p.poll() is None:
                forced += 1
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        return {"forced": forced, "stopped_at": time.time()}


def start_worker(log_path: Path, env: dict[str, str], queue: str, name: str,
                 concurrency: int) -> subprocess.Popen[bytes]:
    """A ``celery -A chaos_app worker`` (prefork) in a session of its own."""
    log = open(log_path, "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "chaos_app", "worker",
         "--pool=prefork", "-c", str(concurrency), "-Q", queue,
         "-n", f"{name}@%h", "--without-gossip",
         "--without-mingle", "--without-heartbeat", "-l", "warning"],
        cwd=HERE, env=env, stdin=subprocess.DEVNULL, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def run(cfg: Config, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    Run(cfg, out).execute()
    return out
