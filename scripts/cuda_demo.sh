#!/usr/bin/env bash
# The README's main job on a GPU: ResNet-18 + causal LSTM trained end to end on the demo videos
# on CUDA within configs/demo.yaml's 1 GiB budget, evaluated on the held-out test videos, one
# video's phases predicted; then the clip (3D CNN) and segmentation (UNet) demos.
# Needs a CUDA build with FFmpeg and the CLI (scripts/cuda_check.sh with ffmpeg/, cli11/ and fmt/
# in $FRAMEFIT_DEPS) and the demo data (written with the build's encoders when missing).
#   scripts/cuda_demo.sh [build-dir] [out-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cuda}
out=${2:-runs-cuda}
framefit=$build/src/cli/framefit
[[ -f demo/manifest.csv ]] || "$framefit" make-demo --out demo --no-frame-folders > /dev/null
mkdir -p "$out"
timed() {  # label, command...: runs it and says how long it took
  local label=$1 start=$SECONDS
  shift
  "$@"
  echo "== $label: $((SECONDS - start)) s"
}
timed "phases: train" "$framefit" train --config configs/demo.yaml --set device=cuda \
  --set "train.out_dir=$out/demo-lstm"
timed "phases: eval" "$framefit" eval --checkpoint "$out/demo-lstm/best.pt" \
  --out "$out/demo-lstm/test_metrics.json"
timed "phases: predict" "$framefit" predict --checkpoint "$out/demo-lstm/best.pt" \
  --video demo/videos/video19.mp4 --out "$out/demo-lstm/video19_phases.csv"
timed "clips: train" "$framefit" train --config configs/demo_clips.yaml --set device=cuda \
  --set "train.out_dir=$out/demo-clips"
timed "clips: eval" "$framefit" eval --checkpoint "$out/demo-clips/best.pt" \
  --out "$out/demo-clips/test_metrics.json"
# 64 MiB, the CPU's budget for it, is less than what cuBLAS alone keeps on an H200 (65 MiB).
timed "segmentation: train" "$framefit" train --config configs/demo_segmentation.yaml \
  --set device=cuda --set train.budget=192MiB --set "train.out_dir=$out/demo-segmentation"
timed "segmentation: eval" "$framefit" eval --checkpoint "$out/demo-segmentation/best.pt" \
  --out "$out/demo-segmentation/test_metrics.json"
