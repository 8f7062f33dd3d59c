#!/usr/bin/env bash
# One table, five engines, the same token-id prompts: the in-process engine, vLLM eager, and
# llama.cpp's server with 8 slots, 8 slots built with GGML_LLAMAFILE=OFF, and 1 slot.
#
#   examples/engines_side_by_side.sh [OUT]   (default reports/side-by-side-TIME; needs `make vllm llamacpp`)
#
# Each server is started on a free loopback port and stopped by its PID (examples/demo_endpoint.py);
# the last step is `mgbench report` over all five runs ("Engines side by side").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-reports/side-by-side-$(date +%Y%m%d-%H%M%S)}"
ARGS=(--limit 16 --batch-size 8 --max-new-tokens 48)
PY=.venv/bin/python
.venv/bin/mgbench flips --dataset math500 "${ARGS[@]}" --out "$OUT/in-process"
$PY examples/demo_endpoint.py vllm "${ARGS[@]}" --out "$OUT/vllm-eager"
$PY examples/demo_endpoint.py llamacpp "${ARGS[@]}" --out "$OUT/llamacpp-np8"
$PY examples/demo_endpoint.py llamacpp --variant nollamafile "${ARGS[@]}" --out "$OUT/llamacpp-np8-nollamafile"
$PY examples/demo_endpoint.py llamacpp "${ARGS[@]}" --out "$OUT/llamacpp-np1" -- -np 1
.venv/bin/mgbench report "$OUT/in-process" "$OUT/vllm-eager" "$OUT/llamacpp-np8" "$OUT/llamacpp-np8-nollamafile" \
  "$OUT/llamacpp-np1" --out "$OUT/report"
