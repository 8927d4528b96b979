"""The checker of the modes scenario (:mod:`chaos_modes`, :mod:`modes_producer`):
reads a run directory and reports.

A call is *accepted* when a message was published for it by the producer; it is *live*
(queued or running) from its claim until it ends.  Its end, as a lower bound (so that a
correct system is never flagged): the end of its first body that did not retry (or
when it was told its lock is lost); or, if it was replaced, the start of the send
that replaced it (or of a replace that superseded it at its start, whose signal did
not come: its confirmation failed); or the moment the producer revoked it; or the
start of a delivery or body whose process died (a killed body frees the name within
``lock_ttl``; so does one whose process died after its body ended, before its
delivery did, as in ``self.retry()`` waiting for the store); or its end without a
body (ignored, failed).  The producer sends from
one thread, so sends (and their claims) are in the order of their records.

Violations (``{"kind": ..., ...}``; a run is safe when there is none):

* ``overlap``: two bodies of one lock name overlap (a body lasts from ``body_start``
  until ``body_end``, or its process's last record when it was killed);
* ``two_live``: in ``until_finished``, a call accepted (published) while another
  accepted call of its name was live (a replace of a call that had not started is
  no violation, unless both then ran; a call whose body was told its lock is lost
  stops being live then, also when that body ends in ``self.retry()``);
* ``same_id_twice``: a second message published for a task id while that call was
  live (any mode with markers; in ``throttle``, within its window);
* ``replaced_ran``: a body of a call started after it was replaced;
* ``lost``: an accepted call delivered to a worker that neither ran its body to its
  end nor failed, and whose caller was not told otherwise (it was not replaced nor
  revoked, no body of it was killed, and it was not superseded by a replace before
  any body of it started): dropped as "superseded" without cause (a started call's
  retry included), rejected, or ended without running;
* ``existing_never_sent``: a caller told to wait for a call (``return_existing``,
  ``raise``, ``drop``) that the producer never got published;
* ``rate``: more than R + B body starts of a ``lock_rate`` name in a window of one
  period (the bound is on grants, on the store's clock: a start during or just
  after a fault of the store's path may stand for a grant as early as that fault's
  hold on a reply before it, three times a latency fault's delay or a black hole's,
  pause's or restart's length).

Figures (not violations): calls per outcome, bodies, retries, accepted calls the
broker never delivered or still kept at the end (broker-level, as the lock scenario
counts them), calls ended FAILURE, the largest number of rated starts in a window.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from chaos_records import read_all, read_lines

_SUPERSEDED = re.compile(r"superseded by (\S+)")
#: A rejection whose cause is the broker being down: Celery rejects a retry whose
#: publish raised (``Reject(exc, requeue=False)``), kombu's OperationalError here.
_BROKER_DOWN = re.compile(r"\bOperationalError\(")
#: task_end states that end a delivery for good.
_DONE = ("SUCCESS", "FAILURE", "IGNORED", "REVOKED", "REJECTED")
INF = math.inf


def _bodies(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each body: task id, key, name, pid, start, end, outcome (None: killed).  A body
    ends at its ``body_end``, at the latest when its process is told its lock is lost,
    or (killed) at its process's last record."""
    last_seen: dict[int, float] = defaultdict(float)
    for r in records:
        last_seen[r["pid"]] = max(last_seen[r["pid"]], r["t"])
    open_: dict[int, dict[str, Any]] = {}
    bodies: list[dict[str, Any]] = []
    for r in sorted(records, key=lambda r: r["t"]):
        if r["ev"] == "body_start":
            body = {"task_id": r["task_id"], "key": r["key"], "name": r.get("name"),
                    "pid": r["pid"], "start": r["t"], "end": None, "outcome": None}
            open_[r["pid"]] = body
            bodies.append(body)
        elif r["ev"] == "body_end" and r["pid"] in open_:
            body = open_.pop(r["pid"])
            body["end"], body["outcome"] = r["t"], r["outcome"]
            body["end"] = min(body["end"], body.get("told", body["end"]))
        elif r["ev"] == "lost" and r["pid"] in open_:
            # Told its lock is lost: the body stops believing it holds it (it is
            # interrupted at its next instruction).
            open_[r["pid"]].setdefault("told", r["t"])
    for body in bodies:
        if body["end"] is None:  # killed in its body
            body["end"] = min(last_seen[body["pid"]], body.get("told", INF))
    return bodies


#: The faults that can hold a rate grant's reply (or the start-up after it) back.
_LAGS = ("latency", "black_hole", "server_pause", "server_restart")


def _lag(faults: list[dict[str, Any]], start: float, period: float) -> float:
    """How long before ``start`` its grant may have been, by the faults of the
    store's path during the period before it (0 with none)."""
    lag = 0.0
    for f in faults:
        if f["start"] <= start and f["end"] >= start - period:
            held = 3 * float(f.get("amount") or 0) if f["kind"] == "latency" else \
                f["end"] - f["start"]
            lag = max(lag, held)
    return lag


def check(out: Path) -> dict[str, Any]:
    meta = json.loads((out / "meta.json").read_text())
    cfg = meta["config"]
    records = list(read_all(out / "records"))
    driver = read_lines(out / "driver.jsonl")
    calls = [r for r in driver if r["ev"] == "call"]
    # old id -> each replace of it: (the replacing send's start, the new id).  The
    # signal comes after the new call's publish, so the new call's record (logged after
    # its send) is the next ``call`` record.
    replaced_by: dict[str, list[tuple[float, str]]] = defaultdict(list)
    pending_replace: list[dict[str, Any]] = []
    for r in driver:
        if r["ev"] == "replaced" and r.get("old"):
            pending_replace.append(r)
        elif r["ev"] == "call":
            for rp in pending_replace:
                replaced_by[rp["old"]].append((r["t0"], rp["new"]))
            pending_replace = []
    revoked_at: dict[str, list[float]] = defaultdict(list)
    for r in driver:
        if r["ev"] == "revoke":
            revoked_at[r["task_id"]].append(r["t0"])
    bodies = _bodies(records)
    bodies_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for b in bodies:
        bodies_of[b["task_id"]].append(b)
    starts: dict[str, list[float]] = defaultdict(list)
    # Deliveries whose process died in them: its last records are of a delivery that
    # has no task_end (its start or its body's; or its body's end, as when it died in
    # self.retry(), waiting for the store to write its retry's marker: the retry may
    # never have been published, and the message comes back).
    last_of: dict[int, dict[str, Any]] = {}
    open_delivery: dict[int, str | None] = {}
    for r in sorted(records, key=lambda r: r["t"]):
        last_of[r["pid"]] = r
        if r["ev"] == "task_start":
            starts[r["task_id"]].append(r["t"])
            open_delivery[r["pid"]] = r["task_id"]
        elif r["ev"] == "task_end":
            open_delivery[r["pid"]] = None
    killed: dict[str, list[float]] = defaultdict(list)
    for pid, r in last_of.items():
        in_body = r["ev"] in ("task_start", "body_start")
        after_body = r["ev"] in ("body_end", "lost") and open_delivery.get(pid) \
            is not None and r.get("task_id") == open_delivery[pid]
        if in_body or after_body:
            killed[r["task_id"]].append(r["t"])
    ends: dict[str, list[tuple[float, str]]] = defaultdict(list)
    # Ignored at its start, superseded: (when, by which call: None when not named).
    superseded: dict[str, list[tuple[float, str | None]]] = defaultdict(list)
    # Rejected because the broker was down (its retry never published): when.
    unpublished: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["ev"] == "task_end":
            ends[r["task_id"]].append((r["t"], str(r.get("state"))))
            if r.get("state") == "REJECTED" and \
                    _BROKER_DOWN.search(str(r.get("reason") or "")):
                unpublished[r["task_id"]].append(r["t"])
            found = _SUPERSEDED.search(str(r.get("reason") or ""))
            if r.get("state") == "IGNORED" and found:
                superseded[r["task_id"]].append((r["t"], found.group(1)))
    published = [c for c in calls if c["outcome"] == "accepted"]
    first_pub: dict[str, dict[str, Any]] = {}
    for c in published:
        first_pub.setdefault(c["task_id"], c)
    kept = set(meta.get("broker_left", {}).get("ids") or [])
    discarded: dict[str, list[float]] = defaultdict(list)  # revoked, by a worker
    for r in records:
        if r["ev"] == "revoked":
            discarded[r["task_id"]].append(r["t"])

    def end_of(task_id: str, since: float) -> float:
        """When the call sent at ``since`` stopped being live, at the earliest (see
        the module's docstring)."""
        mine = [b for b in bodies_of[task_id] if b["start"] >= since]
        # A body that ended (well or not; told its lock is lost at the latest), or
        # one killed: not one that ended in self.retry() (its retry is queued), unless
        # it was told its lock is lost first (its retry may then have been published
        # without its marker, as docs/modes.md states: the name is free from then).
        found = [b["end"] for b in mine if b["outcome"] not in ("retry", None)
                 or (b["outcome"] == "retry" and "told" in b)]
        found += [b["start"] for b in mine if b["outcome"] is None]
        found += [t for t, _ in replaced_by[task_id] if t >= since]
        found += [t for t in revoked_at[task_id] if t >= since]
        found += [t for t, state in ends[task_id]
                  if t >= since and state in _DONE and state != "SUCCESS"]
        found += [t for t in discarded[task_id] if t >= since]
        # Killed in a delivery, before or in its body: the name frees within lock_ttl.
        found += [t for t in killed[task_id] if t >= since]
        # Superseded by a replace sent later: from that call's claim on (a replace
        # the signal did not report, as its confirmation failed).
        found += [first_pub[by]["t0"] for t, by in superseded[task_id]
                  if t >= since and by in first_pub and first_pub[by]["t0"] >= since
                  and first_pub[by]["policy"] == "replace"]
        return min(found, default=INF)

    violations: list[dict[str, Any]] = []
    window = float(cfg.get("ttl", 2.0))  # throttle's window: the task's lock_ttl

    # -- bodies of one name never overlap --------------------------------------------
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for b in bodies:
        by_name[b["name"] or b["key"]].append(b)
    for name, group in sorted(by_name.items()):
        group.sort(key=lambda b: b["start"])
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if b["start"] >= a["end"]:
                    break
                violations.append({"kind": "overlap", "name": name,
                                   "calls": [a["task_id"], b["task_id"]],
                                   "from": b["start"], "to": a["end"]})

    # -- what was accepted, while what was live --------------------------------------
    def ran_after(task_id: str, since: float) -> bool:
        return any(b["start"] >= since and b["outcome"] == "ok"
                   for b in bodies_of[task_id])

    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in published:
        by_key[c["key"]].append(c)
    for key, sends in sorted(by_key.items()):
        for i, later in enumerate(sends):
            for earlier in sends[:i]:
                if later["t"] >= end_of(earlier["task_id"], earlier["t0"]):
                    continue
                if earlier["task_id"] == later["task_id"]:
                    # throttle: a call of its name is a duplicate within the window
                    # (lock_ttl from the accepted enqueue), queued or not.
                    if later["mode"] != "while_running" and not (
                            later["mode"] == "throttle"
                            and later["t0"] >= earlier["t"] + window):
                        violations.append({"kind": "same_id_twice", "key": key,
                                           "task_id": later["task_id"],
                                           "first": earlier["n"], "again": later["n"]})
                elif later["mode"] == "until_finished" and \
                        earlier["mode"] == "until_finished":
                    if later["policy"] == "replace" and not any(
                            earlier["t0"] <= b["start"] < later["t0"]
                            for b in bodies_of[earlier["task_id"]]) and not (
                            ran_after(earlier["task_id"], later["t0"])
                            and ran_after(later["task_id"], later["t0"])):
                        # A replace of a call not started yet; one of the two ran
                        # (the earlier one when it started before the replace was
                        # confirmed: the later one is superseded).
                        continue
                    violations.append({"kind": "two_live", "key": key,
                                       "live": earlier["task_id"],
                                       "accepted": later["task_id"],
                                       "at": later["t"]})

    # -- a replaced call never runs -----------------------------------------------------
    for old, by in sorted(replaced_by.items()):
        if not by:
            continue
        t, new = by[0]
        # (until the id is sent again and accepted: that is a call of its own)
        again = min((c["t0"] for c in published if c["task_id"] == old and c["t0"] > t),
                    default=INF)
        for b in bodies_of[old]:
            if t < b["start"] < again:
                violations.append({"kind": "replaced_ran", "task_id": old,
                                   "replaced_by": new, "body_start": b["start"]})

    # -- no accepted call is lost --------------------------------------------------------
    # Judged per message published (a task id may be sent again once its call ended):
    # what happened to that id after that send.
    never_delivered = still_queued = failed = retry_undelivered = 0
    retry_unpublished = 0
    killed_not_redelivered = 0
    superseded_at_start = 0
    for c in published:
        task_id, since = c["task_id"], c["t0"]
        mine = [b for b in bodies_of[task_id] if b["start"] >= since]
        if any(b["outcome"] in ("ok", None) for b in mine) or \
                any(t >= since for t, _ in replaced_by[task_id]) or \
                any(t >= since for t in revoked_at[task_id]):
            continue
        # Superseded when it started, before any body of it ran, by a replace: of
        # it, sent later (whose signal did not come, as its confirmation failed), or
        # its own, lost to the start of the call it replaced (sent earlier); its
        # result says so.  Never after a body of it started (its retry keeps the
        # name), never by a call that is no replace or was never published (a
        # replace whose publish failed replaces nothing).  Superseded by "a later
        # call" (not named): see _unnamed_replace.
        if any(t >= since and not any(b["start"] < t for b in mine)
               and (_by_a_replace(c, first_pub.get(by or "")) or (
                   by not in first_pub and _unnamed_replace(c, t, published,
                                                            bodies)))
               for t, by in superseded[task_id]):
            superseded_at_start += 1
            continue
        states = [s for t, s in sorted(ends[task_id]) if t >= since]
        if "FAILURE" in states:
            failed += 1
            continue
        if task_id in kept:
            still_queued += 1
            continue
        if not starts[task_id] or max(starts[task_id]) < since:
            never_delivered += 1
            continue
        if killed[task_id] and max(killed[task_id]) >= max(starts[task_id]):
            killed_not_redelivered += 1  # its message is the broker's to bring back
            continue
        if states and states[-1] == "RETRY":
            retry_undelivered += 1
            continue
        if any(t >= since for t in unpublished[task_id]):
            # Celery's, not the lock's: its retry's publish failed (the broker down),
            # and Celery drops such a call (Reject, requeue=False)
            retry_unpublished += 1
            continue
        violations.append({"kind": "lost", "task_id": task_id, "key": c["key"],
                           "mode": c["mode"], "policy": c["policy"],
                           "retry": c.get("retry"), "call": c["n"],
                           "deliveries": sum(1 for t in starts[task_id] if t >= since),
                           "states": states, "bodies": len(mine)})

    # -- a caller told "wait for that call" is told of a call that exists ---------------
    for c in calls:
        other = c.get("other")
        if c["outcome"] in ("existing", "raised", "dropped") and other and \
                other not in first_pub:
            violations.append({"kind": "existing_never_sent", "call": c["n"],
                               "key": c["key"], "other": other})

    # -- the rate bound -----------------------------------------------------------------
    # The bound is on grants, timed by the store's server; a body starts after its
    # grant by the rest of its start-up, and by a fault on the way (a reply held
    # in a black hole or a paused server, or re-sent after a restart, answers as
    # the first run; a latency fault delays the reply and the steps after it):
    # each start may stand for a grant as early as that lag before it.
    rate = meta.get("rate") or cfg.get("rate") or {}
    most_in_window = 0
    if rate:
        bound, period = int(rate["n"]) + int(rate["burst"]), float(rate["period"])
        store_faults = [r for r in driver if r["ev"] == "fault" and r["kind"] in _LAGS]
        for name, group in sorted(by_name.items()):
            if not name.startswith("rated:"):
                continue
            starts = sorted(b["start"] for b in group)
            earliest = [s - _lag(store_faults, s, period) for s in starts]
            for a, first in enumerate(earliest):
                within = [starts[i] for i in range(len(starts))
                          if earliest[i] >= first and starts[i] < first + period]
                most_in_window = max(most_in_window, len(within))
                if len(within) > bound and starts[a] == min(within):
                    violations.append({"kind": "rate", "name": name,
                                       "starts": within, "bound": bound})

    faults = [r for r in driver if r["ev"] == "fault"]
    return {
        "seed": cfg.get("seed"), "config": cfg,
        "duration_s": round(meta["end"] - meta["t0"], 1),
        "faults_injected": len(faults),
        "faults_by_kind": dict(sorted(Counter(f["kind"] for f in faults).items())),
        "fault_errors": dict(Counter(f["kind"] for f in faults if f.get("error"))),
        "calls": len(calls),
        "outcomes": dict(sorted(Counter(c["outcome"] for c in calls).items())),
        "publish_errors": dict(Counter(c.get("error") for c in calls
                                       if c["outcome"] == "publish_failed")),
        "accepted": len(first_pub),
        "replaced": sum(1 for by in replaced_by.values() if by),
        "revoked": sum(1 for ts in revoked_at.values() if ts),
        "same_id_sends": len(calls) - len({c["task_id"] for c in calls}),
        "bodies": len(bodies), "bodies_killed": sum(1 for b in bodies
                                                    if b["outcome"] is None),
        "bodies_retried": sum(1 for b in bodies if b["outcome"] == "retry"),
        "keys": sorted({c["key"] for c in calls}),
        "modes": sorted({c["mode"] for c in calls}),
        "policies": sorted({c["policy"] for c in calls if c["task"] == "chaos.mode"}),
        "rated_most_starts_in_a_period": most_in_window,
        "violations": violations,
        "broker": {"never_delivered": never_delivered, "still_queued_at_end":
                   still_queued, "retry_never_delivered": retry_undelivered,
                   "retry_unpublished_broker_down": retry_unpublished,
                   "ended_failure": failed, "superseded_at_start": superseded_at_start,
                   "killed_not_redelivered": killed_not_redelivered,
                   "worker_main_exits": sum(1 for r in driver
                                            if r["ev"] == "worker_exit")},
        "drain_s": meta.get("drain", {}).get("seconds"),
    }


def _by_a_replace(call: dict[str, Any], by: dict[str, Any] | None) -> bool:
    """Whether ``call``, superseded by ``by`` (its first publish; None: never
    published), was replaced by it or lost its own replace of it."""
    if by is None:
        return False
    if by["t0"] > call["t0"]:
        return bool(by["policy"] == "replace")
    # Its own replace lost to the start of the call it replaced: only where a running
    # call is a duplicate (until_finished); in the other modes it stays queued and runs.
    return bool(call["policy"] == "replace" and call["mode"] == "until_finished")


def _unnamed_replace(call: dict[str, Any], t: float, published: list[dict[str, Any]],
                     bodies: list[dict[str, Any]]) -> bool:
    """Whether ``call``, superseded at ``t`` by "a later call" (the hand-over does not
    name it), was so by a replace: a replace of its name published after it, or (its
    own replace lost to the start of the call it replaced) another call of its name
    whose body started after it was sent."""
    key, since = call["key"], call["t0"]
    if any(p["key"] == key and p["policy"] == "replace" and since < p["t0"] < t
           for p in published):
        return True
    return call["policy"] == "replace" and call["mode"] == "until_finished" and any(
        b["key"] == key and b["task_id"] != call["task_id"] and since < b["start"] < t
        for b in bodies)


def pending(out: Path) -> int:
    """Accepted calls not ended yet (the driver's drain waits for none)."""
    driver = read_lines(out / "driver.jsonl")
    accepted = {r["task_id"] for r in driver
                if r["ev"] == "call" and r["outcome"] == "accepted"}
    done = {r["old"] for r in driver if r["ev"] == "replaced"}
    done |= {r["task_id"] for r in driver if r["ev"] == "revoke"}
    for r in read_all(out / "records"):
        if (r["ev"] == "body_end" and r.get("outcome") == "ok") or (
                r["ev"] == "task_end" and r.get("state") in _DONE
                and r.get("state") != "SUCCESS"):
            done.add(r["task_id"])
    return len(accepted - done)


def markdown(rep: dict[str, Any]) -> str:
    kinds = Counter(v["kind"] for v in rep["violations"])
    return "\n".join([
        f"- modes scenario, seed {rep['seed']}, {rep['duration_s']} s, lock "
        f"{rep['config'].get('lock', 'redis')}, modes {', '.join(rep['modes'])}, "
        f"policies {', '.join(rep['policies'])}",
        "- faults injected: " + ", ".join(
            f"{k} {v}" for k, v in rep["faults_by_kind"].items()),
        f"- calls: {rep['calls']} (" + ", ".join(
            f"{k} {v}" for k, v in rep["outcomes"].items())
        + f"); replaced {rep['replaced']}, revoked {rep['revoked']}, same-id sends "
        f"{rep['same_id_sends']}; publish errors {rep['publish_errors']}",
        f"- bodies: {rep['bodies']} (killed {rep['bodies_killed']}, ended in "
        f"self.retry() {rep['bodies_retried']}); most rated starts in one period: "
        f"{rep['rated_most_starts_in_a_period']}",
        f"- **violations: {len(rep['violations'])}**"
        + "".join(f"; {k} {n}" for k, n in sorted(kinds.items())),
        "- broker level: " + ", ".join(f"{k.replace('_', ' ')} {v}"
                                       for k, v in rep["broker"].items()),
    ])
