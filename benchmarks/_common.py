"""Shared plumbing for the lock-core benchmarks.

Every benchmark script starts one throwaway ``redis-server`` (see
:class:`celery_dlock.ops.embedded.EmbeddedRedis`) for all of its variants, or uses
``--redis-url``.  Results go to stdout as Markdown tables and, with ``--json`` (the
default in full mode), to a JSON file that ``plot.py`` turns into the PNGs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from celery_dlock.ops.embedded import EmbeddedRedis

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: The packages whose versions a result file records.
PACKAGES = ("celery-dlock", "redis", "python-redis-lock", "hiredis", "celery", "kombu",
            "billiard", "celery-once", "celery-singleton")


def base_parser(description: str, name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny counts: checks that the benchmark runs, "
                             "numbers mean nothing")
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis instead of starting a throwaway "
                             "redis-server (its database is not flushed; keys are "
                             "prefixed per run)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help=f"write results here (default in full mode: "
                             f"benchmarks/results/{name}.json; none with --smoke)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="first wait up to this long for the machine to be idle "
                             "(other work keeps < 0.15 CPUs busy for 3 s in a row)")
    parser.add_argument("--retry-disturbed", type=int, default=None, metavar="N",
                        help="repeat a round during which other work kept more than "
                             "--disturbed-threshold CPUs busy, at most N times in all "
                             "(default 12; smoke 0)")
    parser.add_argument("--disturbed-threshold", type=float, default=0.15,
                        metavar="CPUS", help="see --retry-disturbed (default 0.15)")
    return parser


class RetryBudget:
    """Repeats rounds that other work on the machine disturbed, within a budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        retries = args.retry_disturbed
        self.left = (0 if args.smoke else 12) if retries is None else retries
        self.threshold = args.disturbed_threshold
        self.repeated = 0
        self.kept_disturbed = 0

    def keep(self, load: dict[str, Any], what: str) -> bool:
        """Whether a round that ran under ``load`` (a LoadMonitor result) counts."""
        other = load["other_cpus_busy"]
        if other is None or other <= self.threshold:
            return True
        if self.left <= 0:
            self.kept_disturbed += 1
            return True
        self.left -= 1
        self.repeated += 1
        print(f"  {what}: other work kept {other:.2f} CPUs busy; repeating it")
        wait_quiet(120)
        return False

    def as_dict(self) -> dict[str, Any]:
        return {"threshold_cpus": self.threshold, "repeated_rounds": self.repeated,
                "kept_disturbed_rounds": self.kept_disturbed}


def wait_quiet(limit: float, threshold: float = 0.15, calm_for: int = 3) -> bool:
    """Wait up to ``limit`` seconds until the machine is idle; True when it is."""
    if limit <= 0:
        return True
    deadline = time.monotonic() + limit
    calm = 0
    prev = _busy_jiffies()
    while prev is not None and time.monotonic() < deadline:
        time.sleep(1.0)
        cur = _busy_jiffies()
        if cur is None:
            break
        calm = calm + 1 if cur[0] - prev[0] < threshold else 0
        prev = cur
        if calm >= calm_for:
            return True
    print(f"WARNING: the machine did not become idle within {limit:g} s")
    return False


def json_path(args: argparse.Namespace, name: str) -> Path | None:
    if args.json:
        return Path(args.json)
    if args.smoke:
        return None
    return RESULTS / f"{name}.json"


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[tuple[str, EmbeddedRedis | None]]:
    """Yield ``(url, server)``; ``server`` is None when ``url`` was given."""
    if url:
        yield url, None
        return
    with EmbeddedRedis() as server:
        yield server.url, server


def run_id() -> str:
    return f"bench{os.getpid()}x{int(time.time()) % 100000}"


# -- machine -------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def source_revision() -> str | None:
    """The checkout's commit, ``+modified`` when ``celery_dlock/`` has local edits."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "celery_dlock"],
                               cwd=HERE.parent, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+modified" if dirty else "")


def machine_info(client: redis.Redis) -> dict[str, Any]:
    server = client.info("server")
    return {
        "source": source_revision(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis_server": server.get("redis_version"),
        "packages": package_versions(),
    }


def print_machine(info: dict[str, Any]) -> None:
    pkgs = ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v)
    print(f"machine: {info['nproc']} CPUs ({info['cpu_model']}), Python "
          f"{info['python']}, redis-server {info['redis_server']}; {pkgs}; "
          f"source {info.get('source')}")


# -- other load on the machine -------------------------------------------------------


def _busy_jiffies() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    total = sum(fields[:8])
    return (total - idle) / hz, total / hz


def _server_cpu(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu.get("used_cpu_sys", 0.0)) + float(cpu.get("used_cpu_user", 0.0))


class LoadMonitor:
    """How busy the machine was with *other* work while a benchmark ran.

    Busy CPU time of the whole machine (``/proc/stat``) minus this process, its
    waited-for children and the Redis server, divided by the wall time: the average
    number of CPUs that something else kept busy.  Benchmarks on a shared machine
    are only comparable when this is near 0.  ``ours``, when given, returns the CPU
    seconds used so far by more processes of the benchmark (servers it started that
    are not its children: PostgreSQL, ZooKeeper), which are not other work either.
    """

    def __init__(self, client: redis.Redis,
                 ours: Callable[[], float] | None = None) -> None:
        self.client = client
        self.ours = ours
        self.loadavg_start = os.getloadavg()[0]
        self._t0 = time.monotonic()
        self._busy0 = _busy_jiffies()
        t = os.times()
        self._own0 = t.user + t.system + t.children_user + t.children_system
        self._srv0 = _server_cpu(client)
        self._ours0 = ours() if ours else 0.0

    def stop(self) -> dict[str, Any]:
        wall = time.monotonic() - self._t0
        busy1 = _busy_jiffies()
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system - self._own0
        srv = _server_cpu(self.client) - self._srv0
        if self.ours:
            srv += self.ours() - self._ours0
        other = None
        if self._busy0 is not None and busy1 is not None and wall > 0:
            other = max(0.0, (busy1[0] - self._busy0[0] - own - srv) / wall)
        return {"wall_s": round(wall, 2), "loadavg_1m_start": self.loadavg_start,
                "loadavg_1m_end": os.getloadavg()[0],
                "other_cpus_busy": None if other is None else round(other, 3)}


def print_load(load: dict[str, Any]) -> None:
    other = load["other_cpus_busy"]
    print(f"\nother load during the run: {fmt(other, '.2f')} CPUs busy with other "
          f"work on average (load average {load['loadavg_1m_start']:.2f} -> "
          f"{load['loadavg_1m_end']:.2f}), {load['wall_s']:.0f} s")
    if "repeated_rounds" in load:
        print(f"rounds repeated because other work disturbed them: "
              f"{load['repeated_rounds']}; disturbed rounds kept (retry budget spent): "
              f"{load['kept_disturbed_rounds']}")
    if load.get("kept_disturbed_rounds") or (
            "repeated_rounds" not in load and other is not None and other > 0.2):
        print("WARNING: the machine was busy with other work; numbers are disturbed")


# -- server statistics ---------------------------------------------------------------


def command_calls(client: redis.Redis) -> dict[str, dict[str, int]]:
    """``INFO commandstats`` as ``{command: {"calls": n, "usec": n}}``.

    The ``INFO`` calls themselves are left out, so that a delta between two snapshots
    counts only what the benchmark did.  Commands run inside Lua scripts are counted
    by Redis too (``HGET`` inside ``EVALSHA``...).
    """
    out: dict[str, dict[str, int]] = {}
    for key, value in client.info("commandstats").items():
        name = key.removeprefix("cmdstat_")
        if name == "info" or not isinstance(value, dict):
            continue
        out[name] = {"calls": int(value.get("calls", 0)),
                     "usec": int(value.get("usec", 0))}
    return out


def calls_delta(before: dict[str, dict[str, int]],
                after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for name, stats in after.items():
        prev = before.get(name, {"calls": 0, "usec": 0})
        calls = stats["calls"] - prev["calls"]
        if calls:
            out[name] = {"calls": calls, "usec": stats["usec"] - prev["usec"]}
    return out


def total_calls(delta: dict[str, dict[str, int]]) -> int:
    return sum(v["calls"] for v in delta.values())


def total_usec(delta: dict[str, dict[str, int]]) -> int:
    return sum(v["usec"] for v in delta.values())


class CountingConnection(redis.Connection):
    """A connection that counts what it sends, one round trip per send (each command,
    or a whole pipeline), between ``start_at`` and ``end_at`` (monotonic; always by
    default).  Counting on the connection counts every path alike: the client's
    pool and the renewal pool copied from the client's settings.  Each
    :func:`counting_client` has a subclass of its own."""

    sent = 0
    start_at = 0.0
    end_at = float("inf")

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        cls = type(self)
        if cls.start_at <= time.monotonic() < cls.end_at:
            cls.sent += 1
        super().send_packed_command(command, check_health=check_health)


def counting_client(url: str, **options: Any) -> redis.Redis:
    """A plain ``redis.Redis`` of ``url`` whose round trips :func:`sent` counts."""
    counting = type("CountingConnection", (CountingConnection,), {"sent": 0})
    return redis.Redis.from_url(url, connection_class=counting, **options)


def counter_of(client: redis.Redis) -> type[CountingConnection]:
    """The class that counts ``client``'s round trips (``.sent``, ``.start_at``...)."""
    cls = client.connection_pool.connection_class
    assert issubclass(cls, CountingConnection), cls
    return cls


def sent(client: redis.Redis) -> int:
    """Round trips sent so far by ``client`` (a :func:`counting_client`)."""
    return counter_of(client).sent


# -- statistics and output -------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of an already sorted sequence."""
    if not sorted_values:
        return None
    rank = max(1, min(len(sorted_values), round(q / 100.0 * len(sorted_values) + 0.5)))
    return float(sorted_values[rank - 1])


def fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value)


def markdown_table(columns: Sequence[tuple[str, str, str]],
                   rows: Sequence[dict[str, Any]]) -> str:
    """``columns`` is ``(title, key, format spec)``; returns a Markdown table."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:"
                            for i in range(len(columns))) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(key), spec)
                                       for _, key, spec in columns) + " |")
    return "\n".join(lines)


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    print(f"\nresults written to {path}")
