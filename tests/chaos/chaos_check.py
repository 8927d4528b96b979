"""The checker of a chaos run: reads a run directory (:mod:`chaos_driver`) and the
database, and reports.

``check()`` returns, among its figures, ``violations``: one entry per safety violation
(``{"kind": ..., "holds": [...], ...}``), and a run is safe when that list is empty.
A hold is named by its holder and acquisition (``(pid, n)``: the process's n-th
acquisition), never by its fence, so a lock that repeats fences is caught.  The kinds:

* ``overlap``: two holds whose intervals overlap as their holders saw them (from
  ``acquired`` until told lost or released; a killed holder's until its last record)
  where no fault explains it.  Only a pause (SIGSTOP) of the older holder can, when the
  server keeps its data (the chaos lock servers restart from what they synced: Redis
  from an AOF with ``appendfsync always``, PostgreSQL from its WAL, ZooKeeper from
  its transaction log): the pause must cover the moment the newer hold began, up to
  the older holder's news (plus a ttl of slack for the holder to be scheduled again);
* ``fence_reused``: one fence handed to two holds;
* ``interleaved_writes``: in the database's commit log, writes of one hold, then of
  another, then of the first again;
* ``stale_write_accepted``: a committed write whose fence is lower than one committed
  before it;
* ``lost_increment``: the counter differs from the number of committed writes, a
  logged value is not the previous one plus one, or a write its writer saw accepted is
  missing.

Also (figures, not violations): **unfenced overlaps** (pairs of holds, older fence A
and newer fence B, where A began a write after B's first write had committed and the
database took it), **locks left behind** (holds still on the lock's server ttl + 5 s
after every process stopped), writes refused as stale (before or after the writer was
told), the time from the end of each fault to the next accepted write, and the
broker-level accounting (tasks sent and never run, run twice, worker restarts).
"""

from __future__ import annotations

import bisect
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from chaos_records import hold_of, read_all, read_lines

Hold = tuple[int, Any]  # (pid, acquisition number)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def check(out: Path) -> dict[str, Any]:
    meta = json.loads((out / "meta.json").read_text())
    cfg = meta["config"]
    records = list(read_all(out / "records"))
    driver = read_lines(out / "driver.jsonl")

    # -- holds and writes, as the holders saw them -----------------------------------
    start: dict[Hold, float] = {}
    end: dict[Hold, float] = {}
    told: dict[Hold, float] = {}
    names: set[str] = set()
    last_seen: dict[int, float] = defaultdict(float)
    writes: list[dict[str, Any]] = []
    fence_of: dict[Hold, Any] = {}
    for rec in records:
        pid = rec["pid"]
        last_seen[pid] = max(last_seen[pid], rec["t"])
        key = hold_of(rec)
        if rec["ev"] == "acquired":
            start[key] = rec["t"]
            fence_of[key] = rec.get("fence")
            names.add(rec["name"])
        elif rec["ev"] == "lost":
            told.setdefault(key, rec["t"])
            end[key] = min(end.get(key, rec["t"]), rec["t"])
        elif rec["ev"] in ("releasing", "released"):
            # A holder stops believing it holds the lock when it starts releasing it.
            end[key] = min(end.get(key, rec["t"]), rec["t"])
        elif rec["ev"] == "write":
            writes.append(rec)
    for key in start:
        end.setdefault(key, last_seen[key[0]])  # killed while holding
    accepted = [w for w in writes if w["ok"]]
    refused = [w for w in writes if not w["ok"]]
    refused_after_told = sum(1 for w in refused
                             if hold_of(w) in told and told[hold_of(w)] <= w["t0"])

    violations: list[dict[str, Any]] = []
    driver_faults = [r for r in driver if r["ev"] == "fault"]
    pauses = [(f["target"], f["start"], f["end"]) for f in driver_faults
              if f["kind"] == "stop_holder" and isinstance(f.get("target"), int)]
    slack = float(cfg.get("ttl", 2.0))

    def paused(pid: int, since: float, until: float) -> bool:
        return any(target == pid and p0 <= until and p1 + slack >= since
                   for target, p0, p1 in pauses)

    # -- overlapping holds (holder's view) --------------------------------------------
    order = sorted(start, key=lambda h: start[h])
    overlapping = 0
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if start[b] >= end[a]:
                break
            overlapping += 1
            if not paused(a[0], start[b], end[a]):
                violations.append({"kind": "overlap", "holds": [a, b],
                                   "from": start[b], "to": end[a]})

    # -- one fence, one hold ------------------------------------------------------------
    by_fence: dict[Any, list[Hold]] = defaultdict(list)
    for h, fence in fence_of.items():
        if fence is not None:
            by_fence[fence].append(h)
    for fence, holds in sorted(by_fence.items(), key=lambda kv: str(kv[0])):
        if len(holds) > 1:
            violations.append({"kind": "fence_reused", "fence": fence,
                               "holds": sorted(holds, key=lambda h: start[h])})

    # -- unfenced overlaps (writers' clocks) ------------------------------------------
    first_commit: dict[Hold, float] = {}
    last_begin: dict[Hold, float] = {}
    for w in accepted:
        h = (w["pid"], w["fence"])
        first_commit[h] = min(first_commit.get(h, w["t"]), w["t"])
        last_begin[h] = max(last_begin.get(h, w["t0"]), w["t0"])
    unfenced = []
    for a, begun in last_begin.items():
        for b, committed in first_commit.items():
            if b[1] > a[1] and committed < begun:
                unfenced.append({"older": a, "newer": b})

    # -- the database ------------------------------------------------------------------
    db_value, db_fence, rows = meta["db_read"]
    stale_accepted, top = 0, 0
    bad_values, prev = 0, 0
    writer_order: list[str] = []
    for row_id, who, _seq, fence, value in rows:
        if fence < top:
            stale_accepted += 1
            violations.append({"kind": "stale_write_accepted", "row": row_id,
                               "fence": fence, "highest_before": top, "writer": who})
        top = max(top, fence)
        if value != prev + 1:
            bad_values += 1
            violations.append({"kind": "lost_increment", "row": row_id,
                               "value": value, "previous": prev})
        prev = value
        if not writer_order or writer_order[-1] != who:
            writer_order.append(who)
    # Writes of one hold, another's, then the first's again: two holders both wrote.
    seen_before: dict[str, int] = {}
    for i, who in enumerate(writer_order):
        if who in seen_before:
            violations.append({"kind": "interleaved_writes",
                               "holds": [who, writer_order[seen_before[who] + 1]]})
        seen_before[who] = i
    logged = {(who, seq, fence) for _id, who, seq, fence, _v in rows}
    who_of = {r["pid"]: ("task" if r["file"].startswith("worker") else "client")
              for r in records}

    def writer(w: dict[str, Any]) -> str:
        base = f"{who_of[w['pid']]}-{w['pid']}"
        return f"{base}.{w['acq']}" if "acq" in w else base

    seen_ok = {(writer(w), w["seq"], w["fence"]) for w in accepted}
    missing = len(seen_ok - logged)
    unrecorded = len(logged - seen_ok)
    if db_value != len(rows):
        violations.append({"kind": "lost_increment", "counter": db_value,
                           "rows": len(rows)})
    for who, seq, fence in sorted(seen_ok - logged, key=str):
        violations.append({"kind": "lost_increment", "missing_write": [who, seq, fence]})

    # -- faults and recovery -----------------------------------------------------------
    commits = sorted(w["t"] for w in accepted)
    faults = driver_faults
    by_kind: dict[str, list[float]] = defaultdict(list)
    no_target: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for f in faults:
        if f.get("error"):
            errors[f["kind"]] += 1
        if f.get("target") is None:
            no_target[f["kind"]] += 1
        i = bisect.bisect_right(commits, f["end"])
        if i < len(commits):
            by_kind[f["kind"]].append(commits[i] - f["end"])
    kinds = Counter(f["kind"] for f in faults)
    recovery = {k: {"n": len(v), "median": _pct(v, 0.5), "p95": _pct(v, 0.95),
                    "max": _pct(v, 1.0)} for k, v in sorted(by_kind.items())}

    # -- the broker ---------------------------------------------------------------------
    sent = {r["task_id"] for r in driver if r["ev"] == "sent"}
    started = Counter(r["task_id"] for r in records if r["ev"] == "task_start")
    states: dict[str, list[str]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r["t"]):
        if r["ev"] == "task_end":
            states[r["task_id"]].append(str(r.get("state")))
    held_by_task: dict[str, set[Hold]] = defaultdict(set)
    for r in records:
        if r["ev"] == "acquired" and r.get("task_id"):
            held_by_task[r["task_id"]].add((r["pid"], r["fence"]))
    logs = "".join(p.read_text(errors="replace") for p in sorted(out.glob("worker*.log")))
    unrun = [t for t in sent if "SUCCESS" not in states[t]]
    # Its message still in the broker after the stop (None: the run did not look).
    kept = meta.get("broker_left", {}).get("ids")
    queued = None if kept is None else sum(1 for t in unrun if t in set(kept))
    broker_failed = set(re.findall(
        r"chaos\.bump\[(\w+)\] raised unexpected: "
        r"(?:OperationalError|ConnectionError|TimeoutError)", logs))
    broker = {
        "sent": len(sent),
        "send_failed": sum(1 for r in driver if r["ev"] == "send_failed"),
        "succeeded": len(sent) - len(unrun),
        # sent, never succeeded, and its message no longer in the broker at the end
        "lost": None if queued is None else len(unrun) - queued,
        # not run to the end yet, its message still in the broker (not lost)
        "still_queued_at_end": queued,
        # the message was taken off the queue (or never got there) and no worker
        # ever started it
        "never_started": sum(1 for t in unrun if not started[t]),
        # a child was killed while running it; it was not run again by the end
        "killed_not_redelivered": sum(1 for t in unrun if started[t]
                                      and not states[t]),
        # its retry (after its lock wait ran out) or its failure could not be
        # published: the broker was down
        "failed_broker_unreachable": sum(1 for t in unrun if t in broker_failed),
        # its retry was published and never delivered
        "retry_never_delivered": sum(1 for t in unrun if states[t]
                                     and states[t][-1] == "RETRY"
                                     and t not in broker_failed),
        "other_unfinished": sum(1 for t in unrun if states[t]
                                and states[t][-1] not in ("RETRY",)
                                and t not in broker_failed),
        # at-least-once delivery: acks_late + reject_on_worker_lost re-run a task
        # whose child was killed (each run under its own hold)
        "bodies_run_more_than_once": sum(1 for t in sent if len(held_by_task[t]) > 1),
        "worker_main_exits": sum(1 for r in driver if r["ev"] == "worker_exit"),
        "hostname_attribute_errors": logs.count("has no attribute 'hostname'"),
    }

    report = {
        "seed": cfg["seed"], "config": cfg,
        "duration_s": round(meta["end"] - meta["t0"], 1),
        "faults_scheduled": meta["scheduled"], "faults_injected": len(faults),
        "faults_by_kind": dict(sorted(kinds.items())),
        "faults_without_target": dict(no_target), "fault_errors": dict(errors),
        "lock_names": sorted(names),
        "holds": len(start), "holds_told_lost": len(told),
        "writes": len(writes), "writes_accepted": len(accepted),
        "stale_writes_refused": len(refused),
        "stale_writes_refused_before_told": len(refused) - refused_after_told,
        "overlapping_holds_holder_view": overlapping,
        "unfenced_overlaps": len(unfenced), "unfenced_examples": unfenced[:5],
        "violations": violations,
        "stale_writes_accepted": stale_accepted,
        "counter": db_value, "counter_last_fence": db_fence, "log_rows": len(rows),
        "lost_increments": abs(db_value - len(rows)) + bad_values + missing,
        "accepted_writes_missing_from_db": missing,
        "commits_unrecorded_by_writer": unrecorded,
        "locks_left": meta["left"]["keys"],
        "locks_cleared_after_s": meta["left"]["cleared_after"],
        "recovery_s": recovery,
        "broker": broker,
        "drain_s": meta.get("drain", {}).get("seconds"),
        "forced_stops": meta.get("stop", {}).get("forced"),
    }
    return report


def markdown(rep: dict[str, Any]) -> str:
    lines = [
        f"- seed {rep['seed']}, {rep['duration_s']} s, lock "
        f"{rep['config'].get('lock', 'redis')}, broker "
        f"{rep['config'].get('broker', 'redis')}, database {rep['config']['db']}, "
        f"{rep['config']['workers']} worker(s) x {rep['config']['concurrency']} "
        f"prefork children + 1 standalone client, ttl {rep['config']['ttl']} s",
        f"- faults injected: {rep['faults_injected']} of {rep['faults_scheduled']} "
        f"scheduled: " + ", ".join(f"{k} {v}" for k, v in rep["faults_by_kind"].items()),
        f"- holds: {rep['holds']} ({rep['holds_told_lost']} told lost); writes: "
        f"{rep['writes']}, accepted {rep['writes_accepted']}, refused as stale "
        f"{rep['stale_writes_refused']} ({rep['stale_writes_refused_before_told']} "
        f"before the writer was told of its loss)",
        f"- holds overlapping in time as their holders saw them: "
        f"{rep['overlapping_holds_holder_view']}",
        f"- **safety violations: {len(rep['violations'])}**"
        + "".join(f"; {k} {n}" for k, n in sorted(Counter(
            v["kind"] for v in rep["violations"]).items())),
        f"- unfenced overlaps: {rep['unfenced_overlaps']}; **stale writes accepted: "
        f"{rep['stale_writes_accepted']}**; **lost increments: "
        f"{rep['lost_increments']}** (counter {rep['counter']}, log rows "
        f"{rep['log_rows']}); **locks left behind: {len(rep['locks_left'])}**",
        "",
        "| fault | injected | recovered (n) | median s | p95 s | max s |",
        "|---|---|---|---|---|---|",
    ]
    for kind, n in rep["faults_by_kind"].items():
        r = rep["recovery_s"].get(kind, {"n": 0, "median": None, "p95": None,
                                         "max": None})
        lines.append(f"| {kind} | {n} | {r['n']} | {r['median']} | {r['p95']} | "
                     f"{r['max']} |")
    b = rep["broker"]
    lines += ["", "Broker level (not the lock's): " + ", ".join(
        f"{k.replace('_', ' ')} {v}" for k, v in b.items())]
    return "\n".join(lines)
