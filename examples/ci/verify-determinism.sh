#!/usr/bin/env bash
# Determinism guard for CI: calibrate the MarginGate threshold once (cached), then fail the build
# when any batched output differs from its solo reference. Exit 1: determinism broke; 2: bad input.
# Run from the repository root after `make setup`; set MGBENCH to another entry point if needed.
set -euo pipefail
MGBENCH=${MGBENCH:-.venv/bin/mgbench}
OUT=${OUT:-mgbench-ci}
rm -rf "$OUT" && mkdir -p "$OUT"

"$MGBENCH" calibrate --dataset math500 --limit 16 --max-new-tokens 48 --out "$OUT/calibration"
"$MGBENCH" verify --dataset math500 --limit 8 --max-new-tokens 48 --batch-sizes 4,8 \
    --threshold-from "$OUT/calibration/calibration.json" \
    --require-determinism 1.0 --junit "$OUT/verify.xml" --out "$OUT/verify"
