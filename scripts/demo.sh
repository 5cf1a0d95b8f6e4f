#!/usr/bin/env bash
# The main job until the trainer lands (issue #5): per-frame features of a whole synthetic video
# with torchvision-layout ResNet-18 weights, memory bounded by the chunk, checked against
# torchvision; then one end-to-end training step (ResNet-18 + LSTM) over all 600 frames, chunked
# and naive, side by side. Run scripts/setup.sh first (the README's command does).
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
echo "== one training step over all 600 frames: ResNet-18 + LSTM head, recomputing 32-frame chunks"
build/src/cli/framefit bench-step --model resnet18 --head lstm --frames 600 --size 112 --chunk 32
echo "== the same step trained naively (every frame's activations kept for backward)"
build/src/cli/framefit bench-step --model resnet18 --head lstm --frames 600 --size 112 --chunk 0
echo "== the planner: seeds/000 at full size (ResNet-50 + LSTM, 2,000 frames of 224x224) in 8 GiB"
build/src/cli/framefit plan --model resnet50 --head lstm --frames 2000 --size 224 --budget 8GiB \
  --precision auto
