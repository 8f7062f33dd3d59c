#!/usr/bin/env bash
# Serve the default model (SmolLM2-135M as a bf16 GGUF, from `make llamacpp`) with llama.cpp's
# server on 127.0.0.1, in the foreground (exec), so a caller can start it in the background and
# stop it by its PID:
#
#   examples/serve_llamacpp.sh 8080 &  SERVER=$!
#   mgbench flips --endpoint http://127.0.0.1:8080/v1 --limit 8 --max-new-tokens 32
#   kill $SERVER
#
# Usage: examples/serve_llamacpp.sh [PORT] [--prefix-caching] [EXTRA LLAMA-SERVER ARGS...]   (-np 8
# slots by default; a later argument wins: -np 1 queues requests so that each is decoded alone, -m
# FILE serves another GGUF, e.g. the packaged Q4_1 file; --prefix-caching keeps llama.cpp's
# host-memory prompt cache on, for `mgbench flips --axes prefix-cache`).
# Environment: MGBENCH_LLAMA_SERVER (another llama-server binary; default the cached build),
# MGBENCH_LLAMACPP_VARIANT (default or nollamafile: the build with GGML_LLAMAFILE=OFF).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PORT="${1:-8080}"
shift || true
SERVER="${MGBENCH_LLAMA_SERVER:-$("$ROOT/examples/build_llamacpp.sh" --server "${MGBENCH_LLAMACPP_VARIANT:-default}")}"
MODEL="$("$ROOT/examples/build_llamacpp.sh" --gguf)"
if [[ ! -x "$SERVER" || ! -s "$MODEL" ]]; then
  echo "error: no llama-server build at $SERVER or no GGUF at $MODEL; run \`make llamacpp\` first" >&2
  exit 2
fi
# -cram 0: no host-memory prompt cache, and every request sends cache_prompt: false (but the
# prefix-cache axis's warm ones), so a request repeated alone is computed again (the solo repeat
# proves nothing otherwise). -t: the cores here.
CACHE=(-cram 0)
ARGS=()
for arg in "$@"; do
  if [[ "$arg" == --prefix-caching ]]; then CACHE=(); else ARGS+=("$arg"); fi
done
exec "$SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -np 8 -t "$(nproc)" -c 8192 --no-webui \
  ${CACHE[@]+"${CACHE[@]}"} ${ARGS[@]+"${ARGS[@]}"}
