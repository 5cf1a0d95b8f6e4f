#!/usr/bin/env bash
# The main job until the trainer lands: per-frame features of a whole synthetic video with
# torchvision-layout ResNet-18 weights, memory bounded by the chunk, checked against
# torchvision. Run scripts/setup.sh first (the README's command does).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${FRAMEFIT_DEMO_DIR:-build/demo}
python=/usr/bin/python3
mkdir -p "$work"
echo "== demo data: random-weight ResNet-18 (torch.save of its state_dict) and a 600-frame video"
"$python" tests/python/reference.py make "$work"
"$python" tests/python/reference.py frames "$work/video.pt" 600 112 112
echo "== framefit extract, 16 frames per chunk"
build/src/cli/framefit extract --model resnet18 --weights "$work/resnet18.pt" \
  --input "$work/video.pt" --output "$work/features.pt" --chunk 16
echo "== the same with all 600 frames in one pass, for comparison"
build/src/cli/framefit extract --model resnet18 --weights "$work/resnet18.pt" \
  --input "$work/video.pt" --output "$work/features_one_pass.pt" --chunk 600
echo "== torchvision on the same frames"
"$python" tests/python/reference.py check-features resnet18 "$work/resnet18.pt" \
  "$work/video.pt" "$work/features.pt"
