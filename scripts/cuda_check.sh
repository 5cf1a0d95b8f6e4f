#!/usr/bin/env bash
# Builds framefit against the CUDA LibTorch of the python3 on PATH (a GPU machine's PyTorch)
# and runs the fast tests, the CUDA ones included. No Debian packages are needed there: libzip is
# left out (.pt files are read without their CRC-32 check), GoogleTest is built from its source
# tree, and the other libraries come from copies of Debian's files under prefixes in
# $FRAMEFIT_DEPS (default .device):
#   googletest/  /usr/src/googletest (source)
#   json/        /usr/include/nlohmann and /usr/share/cmake/nlohmann_json (include/, share/cmake/)
#   yaml/        /usr/include/yaml-cpp, libyaml-cpp.so* and its cmake folder (include/, lib/<arch>/)
#   cli11/, fmt/ (optional: the CLI is built when both are there) likewise from libcli11-dev,
#                libfmt-dev and libfmt9
#   ffmpeg/      (optional: without it the data pipeline is left out) FFmpeg's shared libraries,
#                headers and relocatable pkg-config files: Debian's FFmpeg source built with only
#                the decoders, demuxers and encoders framefit's tests and demo use
#   pkgconf/     Debian's pkgconf, for machines without pkg-config
#   scripts/device_deps.sh writes all of these from Debian's packages.
#   scripts/cuda_check.sh [build-dir]     FRAMEFIT_TESTS=<gtest filter> limits the tests run
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cuda}
deps=$(realpath "${FRAMEFIT_DEPS:-.device}")
torch_dir=$(python3 -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
prefixes="$deps/json;$deps/yaml"
cli=OFF
ffmpeg=OFF
if [[ -d $deps/ffmpeg/lib/pkgconfig ]]; then
  export PKG_CONFIG_PATH="$deps/ffmpeg/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  ffmpeg=ON
  # Debian's pkgconf with its library (pkgconf/pkg-config runs it) where the machine has none.
  if ! command -v pkg-config > /dev/null && [[ -x $deps/pkgconf/pkg-config ]]; then
    export PKG_CONFIG="$deps/pkgconf/pkg-config"
  fi
fi
targets=(framefit_tests_fast)
if [[ -d $deps/cli11 && -d $deps/fmt ]]; then
  prefixes="$prefixes;$deps/cli11;$deps/fmt"
  cli=ON
  targets+=(framefit_exe)
fi
# PyTorch's wheels ship their own, newer fmt headers, which torch's include path puts first: fmt
# is compiled header-only so that no fmt library has to match them.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
  -DCMAKE_CXX_FLAGS=-DFMT_HEADER_ONLY=1 -DCMAKE_CXX_STANDARD=20 -DFRAMEFIT_BUILD_CLI=$cli -DFRAMEFIT_WITH_FFMPEG=$ffmpeg -DFRAMEFIT_WITH_LIBZIP=OFF \
  -DFRAMEFIT_GTEST_SOURCE_DIR="$deps/googletest" -DCMAKE_PREFIX_PATH="$prefixes"
# -k 0: one build shows every error at once (GPU time is short).
cmake --build "$build" --parallel "$(nproc)" --target "${targets[@]}" -- -k 0
"$build/tests/framefit_tests_fast" --gtest_filter="${FRAMEFIT_TESTS:-*}"
