"""Draw the benchmark PNGs from the JSON results (needs matplotlib).

    python benchmarks/plot.py                       # results/*.json -> benchmarks/*.png
                                                    # and results/growth.png
    python benchmarks/plot.py --results DIR --out DIR

``handoff.png``: (c) delay from a release to the next acquire in another process
(distribution), hand-offs/s and fairness.  ``core.png``: (b) cost of one uncontended
acquire+release, (d) renewal round trips and CPU per pass, (e) Redis commands per
hand-off.  ``e2e.png``: (a) tasks/s and CPU ms per task on a real prefork worker.
``growth.png``, in the results folder beside its JSON files: (d) renewal cost against
held locks, (g) Redis memory per lock, (a) tasks/s against pool processes, (h) hand-off
delay, fairness and rate against waiting processes.  A missing result file leaves its
panels empty.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

HERE = Path(__file__).resolve().parent
COLORS = {
    "celery_dlock": "tab:blue",
    "redis-py sleep=0.1": "tab:orange",
    "redis-py sleep=0.001": "tab:red",
    "python-redis-lock": "tab:green",
}


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} results", ha="center", va="center",
            transform=ax.transAxes)
    ax.set_axis_off()


def _subtitle(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    return (f"{m.get('nproc')} CPUs {m.get('cpu_model')}, Python {m.get('python')}, "
            f"redis-server {m.get('redis_server')}")


def plot_handoff(data: dict[str, Any] | None, out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    if data is None:
        for ax in axes:
            _empty(ax, "bench_handoff")
    else:
        rows = data["rows"]
        procs = sorted({r["procs"] for r in rows})
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        styles = ["-", "--", ":", "-."]
        ax = axes[0]
        for row in rows:
            quant = row["delay_quantiles_ms"]
            if not quant:
                continue
            qs = sorted(quant, key=float)
            xs = [max(quant[q], 1e-3) for q in qs]
            ys = [float(q) / 100 for q in qs]
            ax.plot(xs, ys, styles[procs.index(row["procs"]) % len(styles)],
                    color=COLORS.get(row["variant"]),
                    label=f"{row['variant']}, P={row['procs']} "
                          f"({row['handoffs']} hand-offs)")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("release -> next acquire in another process (ms, log)")
        ax.set_ylabel("fraction of hand-offs")
        ax.set_title("(c) hand-off delay distribution")
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        width = 0.8 / max(1, len(variants))
        for ax, key, title in ((axes[1], "handoffs_per_s", "(c) hand-offs per second"),
                               (axes[2], "fairness",
                                "(c) fairness: min/max acquisitions per process")):
            for i, variant in enumerate(variants):
                vals = [next((r[key] for r in rows if r["variant"] == variant
                              and r["procs"] == p), 0.0) for p in procs]
                xs = [j + (i - (len(variants) - 1) / 2) * width
                      for j in range(len(procs))]
                ax.bar(xs, vals, width, color=COLORS.get(variant), label=variant)
            ax.set_xticks(range(len(procs)), [f"P={p}" for p in procs])
            ax.set_title(title)
            ax.grid(True, axis="y", alpha=0.3)
        axes[2].set_ylim(0, 1.05)
        axes[1].legend(fontsize=7)
        fig.suptitle(f"Hand-off under contention, hold {data['hold'] * 1000:g} ms "
                     f"({_subtitle(data)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_core(core: dict[str, Any] | None, renewal: dict[str, Any] | None,
              waiters: dict[str, Any] | None, out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    if core is None or not core.get("modes"):
        _empty(ax, "bench_core")
    else:
        modes = list(core["modes"])
        variants = [r["variant"] for r in core["modes"][modes[0]]]
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            rows = {r["variant"]: r for r in core["modes"][mode]}
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(variants))]
            bars = ax.bar(xs, [rows[v]["us_per_cycle"] for v in variants], width,
                          label=f"pin {mode}")
            for bar, v in zip(bars, variants, strict=True):
                ax.annotate(f"{rows[v]['ratio']:.2f}x", (bar.get_x() + bar.get_width()
                                                        / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(variants)),
                      [v.replace(" ", "\n", 1) for v in variants], fontsize=7)
        ax.set_ylabel("us per acquire+release (labels: x floor)")
        ax.set_title("(b) uncontended cycle")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[1]
    if renewal is None:
        _empty(ax, "bench_renewal")
    else:
        for variant, color in (("celery_dlock RenewalScheduler", "tab:blue"),
                               ("per-lock extend (redis-py)", "tab:orange")):
            rows = sorted((r for r in renewal["rows"] if r["variant"] == variant),
                          key=lambda r: r["holds"])
            holds = [r["holds"] for r in rows]
            ax.plot(holds, [r["round_trips"] for r in rows], "o-", color=color,
                    label=f"{variant}: round trips/pass")
            ax.plot(holds, [r["cpu_ms"] for r in rows], "s--", color=color,
                    label=f"{variant}: client CPU ms/pass")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("locks held by the process")
        ax.set_title("(d) renewal pass cost")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    if waiters is None:
        _empty(ax, "bench_waiters")
    else:
        variants = list(dict.fromkeys(r["variant"] for r in waiters["rows"]))
        for variant in variants:
            rows = sorted((r for r in waiters["rows"] if r["variant"] == variant
                           and r["redis_cmds_per_handoff"] is not None),
                          key=lambda r: r["waiters"])
            ax.plot([r["waiters"] for r in rows],
                    [r["redis_cmds_per_handoff"] for r in rows], "o-",
                    color=COLORS.get(variant), label=variant)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("waiters")
        ax.set_ylabel("Redis commands per hand-off (incl. in-script)")
        ax.set_title("(e) commands per hand-off")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    source = core or renewal or waiters
    if source is not None:
        fig.suptitle(f"Lock core ({_subtitle(source)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_e2e(data: dict[str, Any] | None, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    if data is None:
        for ax in axes:
            _empty(ax, "bench_e2e")
    else:
        rows = data["rows"]
        labels = [v.replace(" (", "\n(") if "(" in v else v.replace(" ", "\n", 1)
                  for v in (r["variant"] for r in rows)]
        xs = list(range(len(rows)))
        ax = axes[0]
        bars = ax.bar(xs, [r["tasks_per_s"] for r in rows], 0.6, color="tab:blue",
                      alpha=0.8)
        for x, row in zip(xs, rows, strict=True):
            ax.plot([x] * len(row["rounds_tasks_per_s"]), row["rounds_tasks_per_s"],
                    "k.", ms=4)
        for bar, row in zip(bars, rows, strict=True):
            ax.annotate(f"{row['ratio']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                                 bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylabel("tasks/s (bars: median, dots: rounds; labels: x plain)")
        ax.set_title("(a) throughput, first send -> last task done")
        ax.grid(True, axis="y", alpha=0.3)
        ax = axes[1]
        bottom = [0.0] * len(rows)
        for key, label in (("producer_ms", "producer"), ("worker_main_ms", "worker main"),
                           ("children_ms", "pool children"),
                           ("redis_ms", "redis-server")):
            values = [r[key] or 0.0 for r in rows]
            ax.bar(xs, values, 0.6, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylabel("CPU ms per task (medians per process group)")
        ax.set_title("(a) CPU per task, all processes involved")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
        fig.suptitle(f"End to end, prefork -c {data.get('concurrency')}, "
                     f"{data['tasks']} tasks x {data['rounds']} rounds per variant "
                     f"({_subtitle(data)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


#: Colours of the growth curves' variants beyond the lock core's.
GROWTH_COLORS = {
    **COLORS,
    "celery_dlock RenewalScheduler": "tab:blue",
    "per-lock extend (redis-py)": "tab:orange",
    "celery_dlock RedisLock": "tab:blue",
    "celery_dlock LockedTask": "tab:cyan",
    "redis-py Lock": "tab:orange",
    "celery-once": "tab:purple",
    "celery-singleton": "tab:brown",
    "plain task": "black",
    "LockedTask (hashed args)": "tab:blue",
    "LockedTask (template key)": "tab:cyan",
    "celery-once QueueOnce": "tab:purple",
    "celery-singleton Singleton": "tab:brown",
}


def _by_variant(rows: list[dict[str, Any]], x: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row["variant"], []).append(row)
    return {v: sorted(rs, key=lambda r: r[x]) for v, rs in out.items()}


def _growth_renewal(ax: Any, data: dict[str, Any]) -> None:
    for variant, rows in _by_variant(data["rows"], "holds").items():
        color = GROWTH_COLORS.get(variant)
        holds = [r["holds"] for r in rows]
        ax.plot(holds, [r["cpu_ms"] for r in rows], "o-", color=color,
                label=f"{variant}: client CPU ms")
        ax.plot(holds, [r["server_ms"] for r in rows], "^:", color=color,
                label=f"{variant}: server ms")
        ax.plot(holds, [r["round_trips"] for r in rows], "s--", color=color,
                label=f"{variant}: round trips")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("locks held by one process")
    ax.set_ylabel("per renewal interval (one pass)")
    ax.set_title("(d) renewal cost per interval")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)


def _growth_memory(ax: Any, data: dict[str, Any]) -> None:
    top = max(r["locks"] for r in data["rows"])
    rows = [r for r in data["rows"] if r["locks"] == top]
    xs = list(range(len(rows)))
    held = [r["held_bytes_per_lock"] for r in rows]
    kept = [r["left_persistent_bytes_per_name"] for r in rows]
    expiring = [r["left_bytes_per_name"] - r["left_persistent_bytes_per_name"]
                for r in rows]
    ax.bar([x - 0.2 for x in xs], held, 0.4, color="tab:blue", label="held, per lock")
    ax.bar([x + 0.2 for x in xs], kept, 0.4, color="tab:red",
           label="after release, per name: no expiry")
    ax.bar([x + 0.2 for x in xs], expiring, 0.4, bottom=kept, color="tab:pink",
           label="after release, per name: expiring (<= 60 s)")
    for x, value in zip(xs, held, strict=True):
        ax.annotate(f"{value:.0f}", (x - 0.2, value), ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(xs, [r["variant"].replace(" ", "\n", 1) for r in rows], fontsize=7)
    ax.set_ylabel("bytes (MEMORY USAGE, all keys)")
    ax.set_title(f"(g) Redis memory, {top:,} locks")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def _growth_workers(ax: Any, data: dict[str, Any]) -> None:
    for variant, rows in _by_variant(data["rows"], "workers").items():
        ax.plot([r["workers"] for r in rows], [r["tasks_per_s"] for r in rows], "o-",
                color=GROWTH_COLORS.get(variant), label=variant)
    ax.set_xscale("log", base=2)
    workers = sorted({r["workers"] for r in data["rows"]})
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prefork pool processes (-c)")
    ax.set_ylabel("tasks/s (median over rounds)")
    ax.set_title("(a) tasks/s against worker processes")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _growth_contention(axes: Any, data: dict[str, Any]) -> None:
    groups = _by_variant(data["rows"], "waiters")
    ax = axes[0]
    for variant, rows in groups.items():
        color = GROWTH_COLORS.get(variant)
        timed = [r for r in rows if r["p50_ms"] is not None]
        ws = [r["waiters"] for r in timed]
        ax.plot(ws, [r["p50_ms"] for r in timed], "o-", color=color,
                label=f"{variant} p50")
        ax.plot(ws, [r["p99_ms"] for r in timed], "s--", color=color,
                label=f"{variant} p99")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.axhline(2.0, color="grey", lw=0.8, ls="-.")
    ax.set_yscale("log")
    ax.set_ylabel("release -> next acquire elsewhere (ms)")
    ax.set_title("(h) hand-off delay (targets: p50 1 ms, p99 2 ms)")
    ax = axes[1]
    for variant, rows in groups.items():
        color = GROWTH_COLORS.get(variant)
        ws = [r["waiters"] for r in rows]
        ax.plot(ws, [r["fairness"] for r in rows], "o-", color=color,
                label=f"{variant} min/max")
        ax.plot(ws, [r.get("jain") for r in rows], "x:", color=color,
                label=f"{variant} Jain")
    ax.axhline(0.9, color="grey", lw=0.8, ls=":")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fairness over processes")
    ax.set_title("(h) fairness (target 0.9)")
    ax = axes[2]
    for variant, rows in groups.items():
        color = GROWTH_COLORS.get(variant)
        ws = [r["waiters"] for r in rows]
        ax.plot(ws, [r["handoffs_per_s"] for r in rows], "o-", color=color,
                label=f"{variant} hand-offs/s")
        ax.plot(ws, [r["acq_per_s"] for r in rows], "s--", color=color,
                label=f"{variant} acquisitions/s")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("per second (median over rounds)")
    ax.set_title(f"(h) rate, hold {data['hold'] * 1000:g} ms")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ws = sorted({r["waiters"] for r in data["rows"]})
        # Neighbours closer than 10% (31 and 32) share one tick label.
        ticks = [w for i, w in enumerate(ws) if i + 1 == len(ws) or ws[i + 1] > w * 1.1]
        ax.set_xticks(ticks, [str(w) for w in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("waiting processes (P - 1)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)


def plot_growth(renewal: dict[str, Any] | None, memory: dict[str, Any] | None,
                scaling: dict[str, Any] | None, contention: dict[str, Any] | None,
                out: Path) -> None:
    """``growth.png``: (d) renewal, (g) memory, (a) tasks/s by pool size, (h) hand-off
    delay, fairness and rate by waiting processes."""
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    for ax, data, what, draw in (
            (axes[0][0], renewal, "bench_renewal", _growth_renewal),
            (axes[0][1], memory, "bench_memory", _growth_memory),
            (axes[0][2], scaling, "bench_e2e_scaling", _growth_workers)):
        if data is None:
            _empty(ax, what)
        else:
            draw(ax, data)
    if contention is None:
        for ax in axes[1]:
            _empty(ax, "bench_contention")
    else:
        _growth_contention(axes[1], contention)
    source = renewal or memory or scaling or contention
    if source is not None:
        fig.suptitle(f"Growth ({_subtitle(source)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(HERE / "results"),
                        help="folder with the bench_*.json files (and growth.png)")
    parser.add_argument("--out", default=str(HERE),
                        help="folder for the other PNGs")
    args = parser.parse_args(argv)
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_handoff(load(results, "bench_handoff"), out / "handoff.png")
    plot_core(load(results, "bench_core"), load(results, "bench_renewal"),
              load(results, "bench_waiters"), out / "core.png")
    plot_e2e(load(results, "bench_e2e"), out / "e2e.png")
    plot_growth(load(results, "bench_renewal"), load(results, "bench_memory"),
                load(results, "bench_e2e_scaling"), load(results, "bench_contention"),
                results / "growth.png")
    print(f"wrote {out / 'handoff.png'}, {out / 'core.png'}, {out / 'e2e.png'} and "
          f"{results / 'growth.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
