#!/usr/bin/env bash
# The built CLI end to end: torchvision weights in, features out, compared with torchvision.
set -euo pipefail
framefit=$1 python=$2 reference=$3 work=$4
mkdir -p "$work"
"$python" "$reference" make "$work" >/dev/null
"$python" "$reference" frames "$work/frames.pt" 20 64 64
"$framefit" extract --model resnet18 --weights "$work/resnet18.pt" --input "$work/frames.pt" \
  --output "$work/features.pt" --chunk 6 --budget 1GiB --threads 2
"$python" "$reference" check-features resnet18 "$work/resnet18.pt" "$work/frames.pt" \
  "$work/features.pt"

# Bad input: a clear message naming the file, and a non-zero exit code.
if "$framefit" extract --model resnet18 --input "$work/resnet18.pt" --output "$work/x.pt" \
  2>"$work/err.txt"; then
  echo "extract accepted a state_dict as a video"; exit 1
fi
grep -q "resnet18.pt" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
# A budget too small for one chunk: an out-of-memory error (exit code 3), not a crash.
if "$framefit" extract --model resnet18 --input "$work/frames.pt" --output "$work/x.pt" \
  --budget 4MiB 2>"$work/err.txt"; then
  echo "extract ran within an impossible budget"; exit 1
else
  rc=$?; [ "$rc" -eq 3 ] || { echo "expected exit code 3, got $rc"; cat "$work/err.txt"; exit 1; }
fi
grep -q "out of memory" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
echo "cli extract end to end: ok"
