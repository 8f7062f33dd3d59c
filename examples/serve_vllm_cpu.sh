#!/usr/bin/env bash
# Serve the default model (SmolLM2-135M, its cached dense bf16 folder) with vLLM's CPU build on
# 127.0.0.1, in the foreground, so a caller can start it in the background and stop it by its PID:
#
#   examples/serve_vllm_cpu.sh 8000 &  SERVER=$!
#   mgbench flips --endpoint http://127.0.0.1:8000/v1 --limit 8 --max-new-tokens 32
#   kill $SERVER
#
# Usage: examples/serve_vllm_cpu.sh [PORT] [--prefix-caching] [EXTRA VLLM ARGS...]   (eager by
# default; pass --no-enforce-eager for the compiled mode, --served-model-name NAME to rename it;
# --prefix-caching turns vLLM's prefix cache on, for `mgbench flips --axes prefix-cache`).
# Environment: MGBENCH_VLLM_VENV (default .venv-vllm, from `make vllm`), MGBENCH_PYTHON (the
# mgbench venv's python, default .venv/bin/python), MGBENCH_MODEL_DIR (serve another folder),
# VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, default 2). vLLM's own CPU binding is kept: on a few cores
# it keeps one for its API server, so on 2 cores the engine decodes on one; VLLM_CPU_NUM_OF_RESERVED_CPU=0
# gives it both (on the 2-core AVX2 EPYC 1.4x to 1.8x faster, and no longer batch-invariant there:
# docs/engines.md).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PORT="${1:-8000}"
shift || true
VLLM_VENV="${MGBENCH_VLLM_VENV:-$ROOT/.venv-vllm}"
MGBENCH_PYTHON="${MGBENCH_PYTHON:-$ROOT/.venv/bin/python}"
if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
  echo "error: no vLLM venv at $VLLM_VENV; run \`make vllm\` first" >&2
  exit 2
fi
if [[ -z "${MGBENCH_MODEL_DIR:-}" ]]; then
  # The default model's dense folder (converted from the packaged GGUF on first use).
  MGBENCH_MODEL_DIR="$("$MGBENCH_PYTHON" -c 'from mgbench.assets.models import resolve_source; print(resolve_source("smollm2-135m"))')"
fi
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
# Prefix caching off unless --prefix-caching (vLLM's own default is on). mgbench's audit is cold
# either way: every request it means to compute afresh carries a cache_salt of its own, which vLLM
# hashes into each cached block, and only its prefix-cache axis's warm pair shares one. Off, a
# client that sends no salt (curl, a bare benchmark) gets a repeated prompt computed again too.
CACHING=--no-enable-prefix-caching
ARGS=()
for arg in "$@"; do
  if [[ "$arg" == --prefix-caching ]]; then CACHING=--enable-prefix-caching; else ARGS+=("$arg"); fi
done
# `vllm serve` looks up package metadata named vllm (this distribution is vllm-cpu): the API
# server module is the entry point that works as installed.
exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MGBENCH_MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 --enforce-eager --max-model-len 2048 "$CACHING" ${ARGS[@]+"${ARGS[@]}"}
