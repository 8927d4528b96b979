#!/usr/bin/env bash
# Check the lock protocol model (dlock.pml) and the marker protocol model (markers.pml,
# enqueue-time uniqueness) with spin: each model as implemented must hold every
# property, assertions and invalid end states (deadlocks) both: pan runs without -E;
# each mutant must break one (so the properties are not vacuous).
#
# Search: bitstate (supertrace), 2^BITS bits, a search for counterexamples rather than
# a proof: the exhaustive state space of the model does not fit this machine (see
# docs/protocol.md, "Coverage"). Each run prints the states it stored and pan's hash
# factor; the base run is repeated with other hash seeds. Usage: model/check.sh [BITS]
set -euo pipefail
cd "$(dirname "$0")"
BITS=${1:-26}
MUTANT_BITS=24
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp dlock.pml markers.pml "$work/"
cd "$work"
status=0
MODEL=dlock.pml

run() {  # run NAME BITS FLAGS... ; prints the verdict line, sets $errors
  local name=$1 bits=$2
  shift 2
  rm -f pan pan.* ./*.trail
  spin "$@" -a "$MODEL" >/dev/null
  gcc -O2 -DSAFETY -DBITSTATE -w -o pan pan.c
  ./pan -m2000 -w"$bits" -h"${PAN_SEED:-0}" > out.txt 2>&1 || true
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' out.txt | tail -1)
  states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' out.txt | tail -1)
  factor=$(sed -n 's/^hash factor: \([0-9.e+]*\).*/\1/p' out.txt | tail -1)
  what=$( (grep -o 'assertion violated.*(at' out.txt || grep -o 'invalid end state (at' out.txt \
           || true) | head -1 | sed 's/ (at$//')
  printf '%-50s errors=%s states=%s hash-factor=%s %s\n' "$name" "${errors:-?}" \
    "${states:-?}" "${factor:-?}" "$what"
}

expect_pass() {
  run "$@"
  if [ "${errors:-1}" != 0 ]; then
    echo "!! $1: the model as implemented breaks a property"; status=1
  fi
}

expect_fail() {  # bitstate may prune the path to a counterexample: try other hash seeds
  local name=$1 bits=$2 seed wider
  shift 2
  wider=$((bits + 2))
  for try in "$bits 0" "$bits 1" "$wider 0" "$wider 1"; do
    set -- "$name" ${try% *} "$@"
    PAN_SEED=${try#* } run "$@"
    shift 2
    [ "${errors:-0}" = 0 ] || return 0
  done
  echo "!! $name: this mutant breaks nothing: a property is vacuous"; status=1
}

echo "-- the protocol as implemented (must hold, no assertion, no invalid end state)"
expect_pass "as implemented" "$BITS"
PAN_SEED=7 expect_pass "as implemented, hash seed 7" "$BITS"
PAN_SEED=13 expect_pass "as implemented, hash seed 13" "$BITS"
expect_pass "as implemented, lost replies re-sent" "$BITS" -DLOST_REPLIES
expect_pass "a renewal never answered" "$BITS" -DRENEW_HANG
expect_pass "pause beyond the bound: fencing still holds" "$BITS" -DPAUSE=2 -DBEYOND_BOUND
expect_pass "force release: told at next contact, fenced" "$BITS" -DFORCE -DLOST_REPLIES
expect_pass "data loss: told at next contact, fences rise" "$BITS" -DDATA_LOSS -DLOST_REPLIES
echo "-- mutants (each must produce a counterexample)"
expect_fail "no operation ids" "$MUTANT_BITS" -DNO_OPID -DLOST_REPLIES
expect_fail "a re-sent final release is not recognised" "$MUTANT_BITS" \
  -DNO_RELEASE_MEMORY -DLOST_REPLIES
expect_fail "no local deadline (no watchdog)" "$MUTANT_BITS" -DNO_DEADLINE
expect_fail "re-entry or renewal may shorten" "$MUTANT_BITS" -DSHORTEN
expect_fail "pause beyond the margin" "$MUTANT_BITS" -DPAUSE=2
expect_fail "resource without fence check" "$MUTANT_BITS" -DPAUSE=2 -DBEYOND_BOUND -DNO_FENCE_CHECK
expect_fail "watchdog in the renewer's loop, renewal hangs" "$MUTANT_BITS" \
  -DWATCHDOG_IN_RENEWER -DRENEW_HANG
expect_fail "renewal without a timeout (deadlock)" "$MUTANT_BITS" -DNO_RENEW_TIMEOUT -DRENEW_HANG
expect_fail "re-entry takes a new hold after force release" "$MUTANT_BITS" -DOLD_REENTRY -DFORCE
expect_fail "re-entry takes a new hold after data loss" "$MUTANT_BITS" -DOLD_REENTRY -DDATA_LOSS
expect_fail "fence = counter + 1 (repeats after data loss)" "$MUTANT_BITS" -DOLD_FENCE -DDATA_LOSS
expect_fail "a waiter joins the line without flagging the hold" "$MUTANT_BITS" -DNO_LINE_FLAG

MODEL=markers.pml
MARKER_BITS=$((BITS - 1))  # one less than the lock's: the marker runs stay near 2 minutes
echo "-- the marker protocol as implemented (must hold)"
expect_pass "until_finished: an id sent again, retries" "$MARKER_BITS" -DMODE=UF -DSAME_ID \
  -DLOST_REPLY
expect_pass "until_finished, replace: worker restart" "$MARKER_BITS" -DMODE=UF -DREPLACE -DRESTART \
  -DLOST_REPLY
expect_pass "until_finished, replace: rate parks" "$MARKER_BITS" -DMODE=UF -DREPLACE -DPARK
expect_pass "until_started: an id sent again, retries" "$MARKER_BITS" -DMODE=US -DSAME_ID
expect_pass "until_started, replace: worker restart" "$MARKER_BITS" -DMODE=US -DREPLACE -DRESTART \
  -DLOST_REPLY
expect_pass "until_started, replace: rate parks" "$MARKER_BITS" -DMODE=US -DREPLACE -DPARK
expect_pass "throttle: rate parks, retries" "$MARKER_BITS" -DMODE=TH -DPARK
expect_pass "until_started, replace: a worker dies, nothing written" "$MARKER_BITS" \
  -DMODE=US -DREPLACE -DDEATH
expect_pass "until_started: an id sent again, a worker dies" "$MARKER_BITS" -DMODE=US \
  -DSAME_ID -DDEATH
echo "-- marker mutants (each must produce a counterexample)"
expect_fail "a second send of an id is 'ours' (1)" "$MUTANT_BITS" -DMODE=UF -DSAME_ID \
  -DSAME_ID_OURS
expect_fail "the claim always answers 'ours' (1)" "$MUTANT_BITS" -DMODE=UF -DALWAYS_OURS
expect_fail "a re-sent claim is a duplicate of itself (1)" "$MUTANT_BITS" -DMODE=UF -DSAME_ID \
  -DLOST_REPLY -DNO_CLAIM_OP
expect_fail "until_started: an id sent again during its retry (1)" "$MUTANT_BITS" -DMODE=US \
  -DSAME_ID -DNO_RETRY_STATE
expect_fail "replaced ids kept as long as the new marker (2)" "$MUTANT_BITS" -DMODE=UF \
  -DREPLACE -DRESTART -DSHORT_RECORD
expect_fail "a replaced call's re-queue outlives its record (2)" "$MUTANT_BITS" -DMODE=UF \
  -DREPLACE -DPARK -DREQUEUE_REPLACED
expect_fail "a failed replace still revokes (3)" "$MUTANT_BITS" -DMODE=UF -DREPLACE \
  -DFAIL_REVOKES
expect_fail "a replace of a pending replace (3)" "$MUTANT_BITS" -DMODE=UF -DREPLACE -DCHAIN
expect_fail "a started call's retry superseded (4)" "$MUTANT_BITS" -DMODE=US \
  -DRETRY_SUPERSEDED
expect_fail "a re-queue restarts the throttle window (5)" "$MUTANT_BITS" -DMODE=TH -DPARK \
  -DWINDOW_RESTART
expect_fail "a canvas duplicate's id gets no outcome (6)" "$MUTANT_BITS" -DMODE=UF -DSAME_ID \
  -DNO_FORWARD
expect_fail "a replace replaces a started call's retry" "$MUTANT_BITS" -DMODE=UF -DREPLACE \
  -DREPLACE_STARTED
expect_fail "a confirm with no record revokes anyway" "$MUTANT_BITS" -DMODE=UF -DREPLACE \
  -DPARK -DCONFIRM_BLIND
expect_fail "a re-sent claim of a call taken back is claimed" "$MUTANT_BITS" -DMODE=US \
  -DREPLACE -DRESTART -DLOST_REPLY -DCLAIM_REPLACED
expect_fail "an undo gives back a marker shorter than the re-queue" "$MUTANT_BITS" \
  -DMODE=UF -DREPLACE -DPARK -DNO_PDL_RAISE
expect_fail "until_started: the retry state read apart from the claim" "$MUTANT_BITS" \
  -DMODE=US -DSAME_ID -DRESULT_STORE_CHECK
expect_fail "an undo forgets the op that wrote the marker it gives back" "$MUTANT_BITS" \
  -DNS=2 -DMODE=UF -DREPLACE -DLOST_REPLY -DOP_IN_RECORD
expect_fail "until_started: a replace taken back never runs" "$MUTANT_BITS" -DMODE=US \
  -DREPLACE -DOLD_TAKE_BACK
expect_fail "a started call's id not kept from its start to its end" "$MUTANT_BITS" \
  -DMODE=US -DREPLACE -DDEATH -DNO_KEEP
expect_fail "a started call's message come back claims as a new call" "$MUTANT_BITS" \
  -DMODE=US -DREPLACE -DDEATH -DNO_ADOPT
exit $status
