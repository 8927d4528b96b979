"""The producer of the modes scenario: calls of :mod:`chaos_modes`'s tasks, drawn from
the run's seed, each recorded with what its caller was told.

Every call is one ``call`` record in ``driver.jsonl``: the task id asked for, the key
and its (mode, policy), ``t0``/``t`` around the send, and ``outcome``:

* ``accepted``: a message was published for it (Celery's ``after_task_publish`` fired
  in this process during the send: the only way to tell a same-id duplicate, whose
  result carries the call's own id, from a second message);
* ``existing``: told the existing call's id (``return_existing``; ``other``);
* ``raised``: :class:`~celery_dlock.AlreadyQueued` (``other``: the existing call);
* ``dropped``: a :class:`~celery_dlock.DroppedResult` (``other``);
* ``publish_failed``: the send raised (``error``: the serializer refused an argument,
  the broker or the lock's server was down).

A replace that went through also records ``replaced`` (``old``, ``new``: the
``lock_duplicate`` signal with ``policy="replace"``, sent where the call is made), and
each revoke the producer sends records ``revoke``.

The actions: a new call; the same task id again (one of the key's recent calls, never
one replaced or revoked: Celery's workers discard every message of a revoked id);
a storm of replaces; a call whose body retries once (``self.retry()``); a revoke of a
recent call; a call the serializer refuses; a burst of ``chaos.rated`` calls.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery
from celery import signals as celery_signals
from chaos_records import Recorder

from celery_dlock import AlreadyQueued, DroppedResult
from celery_dlock import signals as dlock_signals

#: action -> weight (the order the draws use).
ACTIONS: dict[str, float] = {
    "new": 0.38, "same_id": 0.14, "replace_storm": 0.08, "retry": 0.10,
    "revoke": 0.08, "unencodable": 0.07, "rated": 0.15,
}


class Producer:
    """Sends calls and records each (see the module)."""

    def __init__(self, app: Celery, log: Recorder, seed: int,
                 keys: Sequence[tuple[str, str, str]], *, rated: bool,
                 queue: str) -> None:
        self.app = app
        self.log = log
        self.rng = random.Random(f"{seed}/modes")
        self.keys = list(keys)
        self.rated = rated
        self.queue = queue
        self.recent: dict[str, list[str]] = {k: [] for k, _, _ in keys}
        self.gone: set[str] = set()  # replaced or revoked: never sent again
        self._published: list[str] = []
        self._me = threading.get_ident()
        self.n = 0
        celery_signals.after_task_publish.connect(self._on_publish, weak=False)
        dlock_signals.lock_duplicate.connect(self._on_duplicate, weak=False)

    def close(self) -> None:
        celery_signals.after_task_publish.disconnect(self._on_publish)
        dlock_signals.lock_duplicate.disconnect(self._on_duplicate)

    def _on_publish(self, headers: Any = None, **_: Any) -> None:
        if threading.get_ident() == self._me and isinstance(headers, dict):
            self._published.append(str(headers.get("id")))

    def _on_duplicate(self, task_id: str | None = None, existing: str | None = None,
                      policy: str | None = None, **_: Any) -> None:
        if policy == "replace" and threading.get_ident() == self._me:
            self.log("replaced", old=existing, new=task_id)
            self._forget(existing)

    def _forget(self, task_id: str | None) -> None:
        """A replaced or revoked call's id is not sent again: Celery's workers keep
        discarding the messages of a revoked id (and a replace revokes)."""
        if task_id is None:
            return
        self.gone.add(task_id)
        for key, recent in self.recent.items():
            self.recent[key] = [t for t in recent if t != task_id]

    # -- one call -------------------------------------------------------------------

    def send(self, key: str, mode: str, policy: str, *, task_id: str | None = None,
             seconds: float = 0.3, retry: int = 0, payload: Any = None,
             countdown: float | None = None, task: str = "chaos.mode") -> str:
        """Send one call; record it; the outcome."""
        task_id = task_id or uuid.uuid4().hex
        self.n += 1
        kwargs: dict[str, Any] = {"key": key, "seconds": seconds}
        options: dict[str, Any] = {"task_id": task_id, "queue": self.queue}
        if task == "chaos.mode":
            kwargs.update(retry=retry, payload=payload)
            options.update(lock_mode=mode, on_duplicate=policy)
        if countdown:
            options["countdown"] = countdown
        self._published.clear()
        fields: dict[str, Any] = {"n": self.n, "task": task, "task_id": task_id,
                                  "key": key, "mode": mode, "policy": policy,
                                  "retry": retry, "countdown": countdown,
                                  "t0": time.time()}
        try:
            result = self.app.tasks[task].apply_async(kwargs=kwargs, **options)
        except AlreadyQueued as exc:
            fields.update(outcome="raised", other=exc.task_id)
        except Exception as exc:
            fields.update(outcome="publish_failed", error=type(exc).__name__)
        else:
            if task_id in self._published:
                fields.update(outcome="accepted")
            elif isinstance(result, DroppedResult):
                fields.update(outcome="dropped", other=result.duplicate_of)
            else:
                fields.update(outcome="existing", other=result.id)
        fields["published"] = task_id in self._published
        self.log("call", **fields)
        if fields["outcome"] == "accepted" and task_id not in self.gone:
            recent = self.recent.setdefault(key, [])
            if task_id not in recent:
                recent.append(task_id)
            del recent[:-4]
        return str(fields["outcome"])

    # -- the actions ------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        action = rng.choices(list(ACTIONS), list(ACTIONS.values()))[0]
        key, mode, policy = rng.choice(self.keys)
        seconds = round(rng.uniform(0.1, 0.8), 2)
        countdown = round(rng.uniform(0.5, 3.0), 2) if rng.random() < 0.2 else None
        if action == "same_id" and self.recent[key]:
            self.send(key, mode, policy, task_id=rng.choice(self.recent[key]),
                      seconds=seconds)
        elif action == "replace_storm":
            replacing = [k for k in self.keys if k[2] == "replace"] or self.keys
            key, mode, policy = rng.choice(replacing)
            for _ in range(rng.randint(2, 5)):
                self.send(key, mode, policy, seconds=seconds, countdown=countdown)
        elif action == "retry":
            self.send(key, mode, policy, seconds=seconds, retry=1, countdown=countdown)
        elif action == "revoke" and self.recent[key]:
            victim = rng.choice(self.recent[key])
            self._forget(victim)
            t0 = time.time()
            try:
                self.app.control.revoke(victim)
                self.log("revoke", task_id=victim, key=key, t0=t0)
            except Exception as exc:  # the broker is down: the revoke never left
                self.log("revoke_failed", task_id=victim, key=key,
                         error=type(exc).__name__)
        elif action == "unencodable":
            self.send(key, mode, policy, seconds=seconds, payload=complex(1, 1))
        elif action == "rated" and self.rated:
            # Short bodies: calls that waited for the lock (its holder killed, the
            # server paused) could start back to back if the rate did not hold.
            for _ in range(rng.randint(1, 4)):
                self.send("r", "while_running", "return_existing", seconds=0.02,
                          task="chaos.rated")
        else:
            self.send(key, mode, policy, seconds=seconds, countdown=countdown)

    def run(self, keep_going: Callable[[], bool], backlog: Callable[[], int],
            target: int) -> None:
        """Send until ``keep_going()`` is false, keeping at most ``target`` messages
        waiting in the queue."""
        while keep_going():
            try:
                if backlog() >= target:
                    time.sleep(0.1)
                    continue
            except Exception:  # the broker is down: try again
                time.sleep(0.1)
                continue
            self.step()
            time.sleep(self.rng.uniform(0.02, 0.2))
        self.log("producer_stopped")


def producer_app(broker_url: str, lock_url: str, prefix: str, queue: str,
                 ttl: float, rates: bool) -> Celery:
    """The app the producer sends with: the scenario's tasks, on the run's lock URL
    (through the fault proxy) and broker."""
    import chaos_modes

    app = Celery("chaos_modes_producer", set_as_current=False)
    app.conf.update(broker_url=broker_url, dlock_url=lock_url, dlock_key_prefix=prefix,
                    task_default_queue=queue, task_ignore_result=True,
                    broker_connection_retry_on_startup=True,
                    broker_transport_options={"max_retries": 1},
                    broker_connection_max_retries=1)
    chaos_modes.register(app, None, ttl=ttl, rates=rates)
    app.finalize()
    return app


def meta(lock: str) -> dict[str, Any]:
    """What a run's ``meta.json`` says of the scenario: its keys, and its rate."""
    import chaos_modes

    found: dict[str, Any] = {"keys": chaos_modes.keys_for(lock)}
    if chaos_modes.rated(lock):
        found["rate"] = {"n": chaos_modes.RATE_N, "period": chaos_modes.RATE_PERIOD,
                         "burst": chaos_modes.RATE_BURST}
    return found


def produce(run: Any) -> None:
    """The modes scenario's producer thread of a chaos run (:class:`chaos_driver.
    Run`): sends until the faults are over, keeping the queue fed."""
    import chaos_modes

    cfg, broker = run.cfg, run.broker
    app = producer_app(run.broker_url, run.lock_url, run.prefix, run.queue, cfg.ttl,
                       chaos_modes.rated(cfg.lock))
    producer = Producer(app, run.log, cfg.seed, chaos_modes.keys_for(cfg.lock),
                        rated=chaos_modes.rated(cfg.lock), queue=run.queue)
    try:
        producer.run(lambda: not (run.stopping.is_set() or run.faults_over.is_set()),
                     lambda: broker.queue_length(run.queue),
                     2 * cfg.workers * cfg.concurrency)
    finally:
        producer.close()
        app.close()
