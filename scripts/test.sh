#!/usr/bin/env bash
# Sets up (installs dependencies, builds) and runs every test. Extra arguments go to ctest,
# e.g. scripts/test.sh -L fast
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
mkdir -p Testing
status=0
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@" | tee Testing/ctest_output.txt || status=$?
# ctest lists skipped tests without GoogleTest's reason: each one's reason, from its log.
awk '/^[0-9]+\/[0-9]+ Test: /{name=$3}
     /: Skipped$/{grab=1; reason=""; next}
     grab && /^\[  SKIPPED \]/{print "  " name ": " reason; grab=0; next}
     grab{reason=reason (reason == "" ? "" : " ") $0}' Testing/Temporary/LastTest.log \
  > Testing/skip_reasons.txt
if [ -s Testing/skip_reasons.txt ]; then
  echo "Why the skipped tests did not run:"
  cat Testing/skip_reasons.txt
  # ctest's own closing line stays the last one.
  grep -E "tests passed, [0-9]+ tests failed out of" Testing/ctest_output.txt || true
fi
exit "$status"
