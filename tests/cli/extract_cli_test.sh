#!/usr/bin/env bash
# The built CLI end to end: torchvision weights in, features out, compared with torchvision.
set -euo pipefail
framefit=$1 python=$2 reference=$3 work=$4
mkdir -p "$work"
"$python" "$reference" make "$work" >/dev/null
"$python" "$reference" frames "$work/frames.pt" 20 64 64
"$framefit" extract --model resnet18 --weights "$work/resnet18.pt" --input "$work/frames.pt" \
  --output "$work/features.pt" --chunk 6 --budget 1GiB
"$python" "$reference" check-features resnet18 "$work/resnet18.pt" "$work/frames.pt" \
  "$work/features.pt"

# From a video file: one row per sampled frame; sampling 5 of 25 fps keeps frames 0, 5, 10, ...,
# whose features are those of the same frames extracted from every frame.
clip="$(dirname "$0")/../media/clip_25fps.mp4"
"$framefit" extract --model resnet18 --weights "$work/resnet18.pt" --video "$clip" \
  --output "$work/every.pt" --chunk 16 > /dev/null
"$framefit" extract --model resnet18 --weights "$work/resnet18.pt" --video "$clip" \
  --sample-fps 5 --output "$work/sampled.pt" --chunk 4 > /dev/null
"$python" -c "
import torch
every, sampled = torch.load('$work/every.pt'), torch.load('$work/sampled.pt')
assert every.shape == (50, 512) and sampled.shape == (10, 512), (every.shape, sampled.shape)
assert torch.allclose(sampled, every[::5], rtol=1e-4, atol=1e-5), (sampled - every[::5]).abs().max()
"
if "$framefit" extract --model resnet18 --output "$work/x.pt" 2>"$work/err.txt"; then
  echo "extract ran without frames"; exit 1
fi
grep -q "give the frames as --input" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }

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
