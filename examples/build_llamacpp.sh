#!/usr/bin/env bash
# llama.cpp's server, built offline from the source vendored in the PyPI sdist of llama-cpp-python,
# and the default model as a bf16 GGUF converted by that source's own converter.
#
#   examples/build_llamacpp.sh            build what is missing (cached: a machine builds once)
#   examples/build_llamacpp.sh --server [nollamafile]   print the llama-server path of a variant
#   examples/build_llamacpp.sh --gguf     print the bf16 GGUF path
#
# Cache: $MGBENCH_LLAMACPP_CACHE (default ~/.cache/mgbench/llama.cpp), one folder per key. The
# key is the sdist version, the cmake flags and the processor model: GGML_NATIVE=ON compiles for
# the build machine's vector units, so a binary built on an AVX-512 Xeon must not run on an
# AVX2-only EPYC. Two variants share one build tree: the default (llamafile's sgemm kernels on)
# and GGML_LLAMAFILE=OFF (ggml's own kernels), which only rebuilds the CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
PYTHON="${MGBENCH_PYTHON:-.venv/bin/python}"
CACHE="${MGBENCH_LLAMACPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mgbench/llama.cpp}"
# Without the UI options the configure step tries to download a web UI (no network here).
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF)
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || uname -m)"

key() {  # key VARIANT_FLAGS...
  printf '%s\n' "$VERSION" "${FLAGS[@]}" "$@" "$CPU" | sha256sum | cut -c1-12
}
server_path() {  # server_path default|nollamafile
  case "$1" in
    default) echo "$CACHE/server-$VERSION-$(key -DGGML_LLAMAFILE=ON)/llama-server" ;;
    nollamafile) echo "$CACHE/server-$VERSION-$(key -DGGML_LLAMAFILE=OFF)/llama-server" ;;
    *) echo "unknown variant $1 (default or nollamafile)" >&2; exit 2 ;;
  esac
}
SOURCE="$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
GGUF="$CACHE/models/smollm2-135m-bf16-$VERSION.gguf"

case "${1:-}" in
  --server) server_path "${2:-default}"; exit 0 ;;
  --gguf) echo "$GGUF"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--server [default|nollamafile] | --gguf]" >&2; exit 2 ;;
esac

if [ ! -f "$SOURCE/CMakeLists.txt" ]; then
  echo "== llama.cpp source: llama-cpp-python==$VERSION sdist (vendor/llama.cpp)"
  mkdir -p "$CACHE/src"
  scratch="$(mktemp -d "$CACHE/src/.download-XXXXXX")"
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$scratch"
  tar xzf "$scratch/llama_cpp_python-$VERSION.tar.gz" -C "$scratch"
  rm -rf "$CACHE/src/llama_cpp_python-$VERSION"
  mv "$scratch/llama_cpp_python-$VERSION" "$CACHE/src/"  # whole or not at all
  rm -rf "$scratch"
fi

build_variant() {  # build_variant default|nollamafile ON|OFF
  local target
  target="$(server_path "$1")"
  if [ -x "$target" ]; then
    return
  fi
  echo "== llama-server ($1: GGML_LLAMAFILE=$2), $(nproc) cores; the first build takes minutes"
  local tree="$CACHE/build-$VERSION-$(key)"
  cmake -S "$SOURCE" -B "$tree" -G Ninja "${FLAGS[@]}" "-DGGML_LLAMAFILE=$2" >"$tree.configure.log" 2>&1 \
    || { tail -20 "$tree.configure.log"; exit 1; }
  cmake --build "$tree" --target llama-server -j "$(nproc)"
  mkdir -p "$(dirname "$target")"
  cp "$tree/bin/llama-server" "$target.partial"
  mv "$target.partial" "$target"
  "$target" --version 2>&1 | head -2
}
build_variant default ON
build_variant nollamafile OFF

if [ ! -s "$GGUF" ]; then
  echo "== bf16 GGUF of the default model (the vendored convert_hf_to_gguf.py)"
  # The converter imports sentencepiece before it falls back to the BPE vocabulary.
  "$PYTHON" -c "import sentencepiece" 2>/dev/null || "$PYTHON" -m pip install --quiet sentencepiece
  dense="$("$PYTHON" -c 'from mgbench.assets.models import resolve_source; print(resolve_source("smollm2-135m"))')"
  mkdir -p "$(dirname "$GGUF")"
  PYTHONPATH="$SOURCE/gguf-py:$SOURCE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$SOURCE/convert_hf_to_gguf.py" \
    "$dense" --outtype bf16 --outfile "$GGUF.partial" >"$GGUF.log" 2>&1 || { tail -20 "$GGUF.log"; exit 1; }
  mv "$GGUF.partial" "$GGUF"
fi
echo "llama-server: $(server_path default)"
echo "llama-server (GGML_LLAMAFILE=OFF): $(server_path nollamafile)"
echo "model: $GGUF"
