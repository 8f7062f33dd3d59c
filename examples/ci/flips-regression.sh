#!/usr/bin/env bash
# Determinism regression check for CI: compare this build's flips audit with a recorded baseline
# (same model, dataset, requests and options) and fail when the flip rate or the share of
# diverged sequences rose beyond chance (paired one-sided exact test at --alpha).
#
#   examples/ci/flips-regression.sh record      # once, on the reference build: writes $BASELINE
#   examples/ci/flips-regression.sh check       # on every change: exit 1 on a regression
#
# Exit 0: no regression; 1: regression or a threshold broke; 2: bad input (e.g. a baseline of
# other prompts). Run from the repository root after `make setup`.
set -euo pipefail
MGBENCH=${MGBENCH:-.venv/bin/mgbench}
BASELINE=${BASELINE:-mgbench-baseline}
OUT=${OUT:-mgbench-ci}
AUDIT=(--dataset math500 --limit 16 --batch-size 8 --max-new-tokens 32)

case "${1:-check}" in
  record)
    rm -rf "$BASELINE"
    "$MGBENCH" flips "${AUDIT[@]}" --out "$BASELINE"
    ;;
  check)
    rm -rf "$OUT" && mkdir -p "$OUT"
    "$MGBENCH" flips "${AUDIT[@]}" --baseline "$BASELINE" --alpha 0.01 \
        --junit "$OUT/flips.xml" --out "$OUT/flips"
    # The batch-invariant mode must stay exact on this machine: 0 flips, every sequence = solo.
    "$MGBENCH" flips "${AUDIT[@]}" --batch-invariant --require-determinism 1.0 --max-flip-rate 0 \
        --junit "$OUT/flips-invariant.xml" --out "$OUT/flips-invariant"
    ;;
  *) echo "usage: $0 record|check" >&2; exit 2 ;;
esac
