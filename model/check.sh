#!/usr/bin/env bash
# Check the lock protocol model (dlock.pml) with spin: the model as implemented must
# hold every property; each mutant must break one (so the properties are not vacuous).
#
# Search: bitstate (supertrace), 2^BITS bits; the exhaustive state space of the full
# model does not fit this machine (see docs/protocol.md). Usage: model/check.sh [BITS]
set -euo pipefail
cd "$(dirname "$0")"
BITS=${1:-26}
MUTANT_BITS=24
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp dlock.pml "$work/"
cd "$work"
status=0

run() {  # run NAME BITS FLAGS... ; prints the verdict line, sets $errors
  local name=$1 bits=$2
  shift 2
  rm -f pan pan.* ./*.trail
  spin "$@" -a dlock.pml >/dev/null
  gcc -O2 -DSAFETY -DBITSTATE -w -o pan pan.c
  ./pan -m2000 -w"$bits" -E > out.txt 2>&1 || true
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' out.txt | tail -1)
  states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' out.txt | tail -1)
  what=$(grep -o 'assertion violated.*(at' out.txt | head -1 | sed 's/ (at$//' || true)
  printf '%-46s errors=%s states=%s %s\n' "$name" "${errors:-?}" "${states:-?}" "$what"
}

expect_pass() {
  run "$@"
  if [ "${errors:-1}" != 0 ]; then
    echo "!! $1: the model as implemented breaks a property"; status=1
  fi
}

expect_fail() {
  run "$@"
  if [ "${errors:-0}" = 0 ]; then
    echo "!! $1: this mutant breaks nothing: a property is vacuous"; status=1
  fi
}

echo "-- the protocol as implemented (must hold)"
expect_pass "as implemented" "$BITS"
expect_pass "as implemented, lost replies re-sent" "$BITS" -DLOST_REPLIES
expect_pass "pause beyond the bound: fencing still holds" "$BITS" -DPAUSE=2 -DBEYOND_BOUND
echo "-- mutants (each must produce a counterexample)"
expect_fail "no operation ids" "$MUTANT_BITS" -DNO_OPID -DLOST_REPLIES
expect_fail "no local deadline (no watchdog)" "$MUTANT_BITS" -DNO_DEADLINE
expect_fail "re-entry or renewal may shorten" "$MUTANT_BITS" -DSHORTEN
expect_fail "pause beyond the margin" "$MUTANT_BITS" -DPAUSE=2
expect_fail "resource without fence check" "$MUTANT_BITS" -DPAUSE=2 -DBEYOND_BOUND -DNO_FENCE_CHECK
exit $status
