#!/usr/bin/env bash
# Sets up (installs dependencies, builds) and runs every test. Extra arguments go to ctest,
# e.g. scripts/test.sh -L fast
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
