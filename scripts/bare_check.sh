#!/usr/bin/env bash
# Builds framefit as scripts/cuda_check.sh does on a GPU machine (no FFmpeg, no libzip), but
# against this machine's LibTorch, and runs the fast tests. A GPU session is short: this catches
# code that compiles only with those libraries, and tests that need them without skipping,
# before one is spent. From scratch about 20 minutes on 2 cores (first run built in parts).
#   scripts/bare_check.sh [build-dir]     (default build-bare)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-bare}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFRAMEFIT_WITH_FFMPEG=OFF \
  -DFRAMEFIT_WITH_LIBZIP=OFF
# -k 0: every compile error at once.
cmake --build "$build" --parallel "$(nproc)" --target framefit_tests_fast framefit_exe -- -k 0
"$build/tests/framefit_tests_fast"
