#!/usr/bin/env bash
# Build llama.cpp's own llama-perplexity from the llama.cpp sources inside the llama-cpp-python 0.3.36 sdist
# (the same llama.cpp the capture runs), CPU only, into $1 (default: ~/.cache/llorch_ref/llama-perplexity/).
#
#   bash tools/build_llama_perplexity.sh [OUT_DIR]     # prints the binary's path on its last line
#   NATIVE=OFF bash tools/build_llama_perplexity.sh DIR # a portable build (no -march=native kernels)
set -euo pipefail
OUT=${1:-${LLORCH_HOME:-$HOME/.cache/llorch_ref}/llama-perplexity}
mkdir -p "$OUT"
if [ -x "$OUT/bin/llama-perplexity" ]; then echo "$OUT/bin/llama-perplexity"; exit 0; fi
WORK=$(mktemp -d "$OUT/.build-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
python -m pip download --no-deps --no-binary=:all: -d "$WORK" llama-cpp-python==0.3.36 >&2
tar xzf "$WORK"/llama_cpp_python-0.3.36.tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
sha256sum "$WORK"/llama_cpp_python-0.3.36.tar.gz >&2
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=${NATIVE:-ON} \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$WORK/build" --target llama-perplexity -j "$(nproc)" >&2
mkdir -p "$OUT/bin"
cp "$WORK/build/bin/llama-perplexity" "$OUT/bin/llama-perplexity"
echo "$OUT/bin/llama-perplexity"
