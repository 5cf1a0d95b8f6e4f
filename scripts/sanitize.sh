#!/usr/bin/env bash
# Builds framefit with AddressSanitizer and UndefinedBehaviorSanitizer in build-sanitize/ and runs
# the fast tests there (after scripts/setup.sh has installed the dependencies; about 45 minutes
# on 2 cores). Extra arguments go to ctest, e.g. scripts/sanitize.sh -R VideoWriter
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DFRAMEFIT_SANITIZE=address,undefined
cmake --build build-sanitize --parallel "$(nproc)"
# Leaks are checked too (LeakSanitizer, on with ASan): the suite ran clean with it.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
cd build-sanitize
ctest --output-on-failure --timeout 1800 -j "$(nproc)" -L fast "$@"
