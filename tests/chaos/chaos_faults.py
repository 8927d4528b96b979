"""The fault schedule of a chaos run, drawn from its seed (the driver injects it).

:func:`schedule` is a pure function of (seed, seconds, mean gap, ttl): the same seed gives
the same faults, kinds, durations and start times.  Faults of one *channel* (the proxy,
the Redis server, SIGSTOP) never overlap: a drawn fault whose channel is still on, or
was on less than ``COOLDOWN`` ttl ago, is not scheduled (so that each one's recovery can
be seen); the channels run side by side, and the kills (instant) come at any time.
Which process a kill or a SIGSTOP hits depends on who holds the lock at that moment,
so the targets are not reproducible; the schedule is.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

#: kind -> (weight, channel)
KINDS: dict[str, tuple[float, str]] = {
    "kill_child": (0.18, "kill"),  # SIGKILL a prefork child (holding or waiting)
    "kill_client": (0.07, "kill"),  # SIGKILL the standalone client
    "stop_holder": (0.15, "stop"),  # SIGSTOP the holder for 1.25-2.5 ttl, then SIGCONT
    "redis_restart": (0.10, "redis"),  # SIGKILL/SIGTERM redis-server, restart from AOF
    "client_pause": (0.15, "redis"),  # CLIENT PAUSE 0.2-1.2 ttl
    "latency": (0.18, "proxy"),  # 20-400 ms per chunk on the lock's links
    "black_hole": (0.17, "proxy"),  # forward nothing for 0.5-1.5 ttl
}


#: ttls a channel stays quiet after one of its faults ends.
COOLDOWN = 0.75


@dataclass(frozen=True)
class Fault:
    n: int
    at: float  # seconds after the run's start
    kind: str
    duration: float  # seconds the fault stays on (0: instant)
    pick: float  # in [0, 1): which target, which variant
    amount: float  # per kind: the latency per chunk; 1 = SIGKILL the server

    @property
    def channel(self) -> str:
        return KINDS[self.kind][1]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def schedule(seed: int, seconds: float, mean_gap: float, ttl: float) -> list[Fault]:
    rng = random.Random(seed)
    kinds = sorted(KINDS)
    weights = [KINDS[k][0] for k in kinds]
    faults: list[Fault] = []
    free_at: dict[str, float] = {}
    at = 2.0  # let the first holds start
    while True:
        at += rng.expovariate(1.0 / mean_gap)
        if at >= seconds:
            return faults
        kind = rng.choices(kinds, weights)[0]
        duration = {
            "kill_child": 0.0,
            "kill_client": 0.0,
            "stop_holder": rng.uniform(1.25, 2.5) * ttl,
            "redis_restart": rng.uniform(0.1, 1.5),
            "client_pause": rng.uniform(0.2, 1.2) * ttl,
            "latency": rng.uniform(0.5, 3.0),
            "black_hole": rng.uniform(0.5, 1.5) * ttl,
        }[kind]
        amount = {"latency": rng.uniform(0.02, 0.4),
                  "redis_restart": float(rng.random() < 0.5)}.get(kind, 0.0)
        pick = rng.random()
        channel = KINDS[kind][1]
        if channel != "kill":
            if at < free_at.get(channel, 0.0):
                continue
            free_at[channel] = at + duration + COOLDOWN * ttl
        faults.append(Fault(len(faults), round(at, 3), kind, round(duration, 3),
                            pick, round(amount, 3)))
