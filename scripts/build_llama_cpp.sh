#!/usr/bin/env bash
# Build the llama.cpp the tests compare against: the tree vendored in the llama-cpp-python sdist pinned below
# (llama.cpp of 2026-10-01), fetched from PyPI, built into a cache folder outside the clone and reused when present.
#
#   scripts/build_llama_cpp.sh            # build (or reuse) and print the bin folder on the last line of stdout
#   export MTPQ_LLAMA_CPP_BIN=$(scripts/build_llama_cpp.sh | tail -1)
#   export MTPQ_LLAMA_CPP_SRC=$MTPQ_LLAMA_CPP_BIN/../..
#
# MTPQ_LLAMA_CPP_CACHE (default ~/.cache/mtpq) holds the download, the source and the build. ~15 min on 2 cores.
# GGML_NATIVE=OFF with AVX2/FMA/F16C: a native build dies with SIGILL on quantized types on VMs that advertise
# AVX-512/AMX they cannot run.
set -euo pipefail

PIN="0.3.36"
CACHE="${MTPQ_LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mtpq}"
ROOT="$CACHE/llama-cpp-python-$PIN"
SRC="$ROOT/llama_cpp_python-$PIN/vendor/llama.cpp"
BUILD="$SRC/build"
STAMP="$BUILD/.mtpq-complete"
JOBS="${MTPQ_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
PYTHON="${PYTHON:-python3}"
# What the tests run: quantize bytes, KLD, imatrix, split parity, drafting (server and speculative-simple), RPC,
# and libllama for the MTP-context harness (a shared library: BUILD_SHARED_LIBS=ON).
TARGETS=(llama-quantize llama-perplexity llama-imatrix llama-gguf-split llama-server llama-speculative-simple
         llama-cli llama-tokenize ggml-rpc-server llama ggml-base)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "${TARGETS[*]}" ]; then
  echo "llama.cpp $PIN: reusing $BUILD/bin" >&2
  echo "$BUILD/bin"
  exit 0
fi

mkdir -p "$ROOT"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "llama.cpp $PIN: fetching the llama-cpp-python sdist from PyPI" >&2
  tmp="$(mktemp -d "$ROOT/dl.XXXXXX")"
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
      -d "$tmp" "llama-cpp-python==$PIN" >&2 2>/dev/null \
    || "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$PIN" >&2
  tar -xzf "$tmp/llama_cpp_python-$PIN.tar.gz" -C "$tmp"
  rm -rf "$ROOT/llama_cpp_python-$PIN"
  mv "$tmp/llama_cpp_python-$PIN" "$ROOT/"
  rm -rf "$tmp"
fi

echo "llama.cpp $PIN: building ${TARGETS[*]} in $BUILD with $JOBS jobs" >&2
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DGGML_RPC=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON >&2
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" >&2
for t in llama-quantize llama-perplexity llama-imatrix llama-gguf-split llama-server llama-speculative-simple; do
  [ -x "$BUILD/bin/$t" ] || { echo "llama.cpp $PIN: $t was not built" >&2; exit 1; }
done
echo "${TARGETS[*]}" > "$STAMP"
echo "$BUILD/bin"
