"""The fault schedule of a chaos run, drawn from its seed (the driver injects it).

:func:`schedule` is a pure function of (seed, seconds, mean gap, ttl, kinds): the same
seed gives the same faults, kinds, durations and start times.  Faults of one *channel*
(the proxy, the lock's server, SIGSTOP, the broker) never overlap: a drawn fault whose
channel is still on, or was on less than ``COOLDOWN`` ttl ago, is not scheduled (so
that each one's recovery can be seen); the channels run side by side, and the kills
(instant) come at any time.  Which process a kill or a SIGSTOP hits depends on who
holds the lock at that moment, so the targets are not reproducible; the schedule is.

The lock's faults are drawn from one stream and the broker's restarts from another
(and the modes scenario's kills of whole workers from a third), so that a variant
without broker restarts (the Redis one: its broker is the lock's server) or without
some kind still gets, for the same seed, the same faults of every other kind at the
same times.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

#: kind -> (weight, channel), in the order the draws use (the order of the first
#: recorded runs: a seed's schedule does not change when a kind is renamed).
KINDS: dict[str, tuple[float, str]] = {
    "black_hole": (0.17, "proxy"),  # forward nothing for 0.5-1.5 ttl
    "server_pause": (0.15, "server"),  # every lock call waits 0.2-1.2 ttl
    "kill_child": (0.18, "kill"),  # SIGKILL a prefork child (holding or waiting)
    "kill_client": (0.07, "kill"),  # SIGKILL the standalone client
    "latency": (0.18, "proxy"),  # 20-400 ms per chunk on the lock's links
    "server_restart": (0.10, "server"),  # crash or stop the lock's server, restart
    "stop_holder": (0.15, "stop"),  # SIGSTOP the holder for 1.25-2.5 ttl, then SIGCONT
}
#: The broker's own fault (its own stream, its own channel): crash or stop it, start
#: it again from what it kept.  Drawn when the broker is not the lock's server.
BROKER_KINDS: dict[str, tuple[float, str]] = {"broker_restart": (1.0, "broker")}
#: Mean seconds between broker restarts (before the channel's quiet time).
BROKER_MEAN_GAP = 12.0
#: The modes scenario's kill of a whole ``celery worker`` (its main process and its
#: children, SIGKILL; the driver starts it again), its own stream and channel.
WORKER_KINDS: dict[str, tuple[float, str]] = {"kill_worker": (1.0, "worker")}
WORKER_MEAN_GAP = 6.0

#: ttls a channel stays quiet after one of its faults ends.
COOLDOWN = 0.75


@dataclass(frozen=True)
class Fault:
    n: int
    at: float  # seconds after the run's start
    kind: str
    duration: float  # seconds the fault stays on (0: instant)
    pick: float  # in [0, 1): which target, which variant
    amount: float  # per kind: the latency per chunk; 1 = crash the server

    @property
    def channel(self) -> str:
        return {**KINDS, **BROKER_KINDS, **WORKER_KINDS}[self.kind][1]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _durations(rng: random.Random, kind: str, ttl: float) -> tuple[float, float]:
    """(duration, amount) of a fault of ``kind``.  Every entry of the lock's tables
    is drawn whatever the kind (as the first recorded runs did), so that a seed keeps
    its schedule."""
    if kind in BROKER_KINDS:
        return rng.uniform(0.1, 1.5), float(rng.random() < 0.5)
    if kind in WORKER_KINDS:
        return 0.0, 0.0
    duration = {
        "kill_child": 0.0,
        "kill_client": 0.0,
        "stop_holder": rng.uniform(1.25, 2.5) * ttl,
        "server_restart": rng.uniform(0.1, 1.5),
        "server_pause": rng.uniform(0.2, 1.2) * ttl,
        "latency": rng.uniform(0.5, 3.0),
        "black_hole": rng.uniform(0.5, 1.5) * ttl,
    }[kind]
    amount = {"latency": rng.uniform(0.02, 0.4),
              "server_restart": float(rng.random() < 0.5)}.get(kind, 0.0)
    return duration, amount


def _draw(rng: random.Random, table: dict[str, tuple[float, str]], seconds: float,
          mean_gap: float, ttl: float, kinds: Collection[str]) -> list[Fault]:
    names = list(table)
    weights = [table[k][0] for k in names]
    faults: list[Fault] = []
    free_at: dict[str, float] = {}
    at = 2.0  # let the first holds start
    while True:
        at += rng.expovariate(1.0 / mean_gap)
        if at >= seconds:
            return faults
        kind = rng.choices(names, weights)[0]
        duration, amount = _durations(rng, kind, ttl)
        pick = rng.random()
        if kind not in kinds:
            continue
        channel = table[kind][1]
        if channel != "kill":
            if at < free_at.get(channel, 0.0):
                continue
            free_at[channel] = at + duration + COOLDOWN * ttl
        faults.append(Fault(0, round(at, 3), kind, round(duration, 3), pick,
                            round(amount, 3)))


def schedule(seed: int, seconds: float, mean_gap: float, ttl: float,
             kinds: Collection[str] | None = None) -> list[Fault]:
    """The faults of a run, in start order; only those of ``kinds`` (default: every
    kind of :data:`KINDS`, no broker restart)."""
    wanted = set(KINDS) if kinds is None else set(kinds)
    unknown = wanted - set(KINDS) - set(BROKER_KINDS) - set(WORKER_KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}")
    faults = _draw(random.Random(seed), KINDS, seconds, mean_gap, ttl, wanted)
    if wanted & set(BROKER_KINDS):
        faults += _draw(random.Random(f"{seed}/broker"), BROKER_KINDS, seconds,
                        BROKER_MEAN_GAP, ttl, wanted)
    if wanted & set(WORKER_KINDS):
        faults += _draw(random.Random(f"{seed}/worker"), WORKER_KINDS, seconds,
                        WORKER_MEAN_GAP, ttl, wanted)
    faults.sort(key=lambda f: f.at)
    return [Fault(n, f.at, f.kind, f.duration, f.pick, f.amount)
            for n, f in enumerate(faults)]
