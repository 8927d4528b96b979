#!/usr/bin/env bash
# Full runs of the lock-core benchmarks (b-e), one after the other, then the plots.
# Each waits (up to WAIT_QUIET seconds, default 900) for the machine to be idle first.
# Tables go to benchmarks/results/*.md, raw results to benchmarks/results/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
for bench in bench_core bench_handoff bench_renewal bench_waiters; do
  "$PY" "benchmarks/$bench.py" --wait-quiet "${WAIT_QUIET:-900}" \
    | tee "benchmarks/results/$bench.md"
done
"$PY" benchmarks/plot.py
