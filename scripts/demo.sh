#!/usr/bin/env bash
# The main job (README command 1, after scripts/setup.sh): write the demo videos, train
# ResNet-18 + a causal LSTM on them end to end within a 1 GiB budget, evaluate on the held-out
# test videos, then train the same encoder with a per-frame linear head for comparison, and
# finally predict one video's phases and export the weights for PyTorch.
#   scripts/demo.sh --large                   twice the frames (videos of 300-1,500 frames at
#                                             25 fps, JPEG frame folders too) and 5 epochs
#   FRAMEFIT_DEMO_BASELINE=0 scripts/demo.sh  skips the linear-head comparison
set -euo pipefail
cd "$(dirname "$0")/.."
framefit=build/src/cli/framefit
python=/usr/bin/python3
start=$SECONDS

# The short job by default: videos of 100-400 frames at 25 fps (40-160 sampled at 10 fps), MP4
# only, 3 epochs (configs/demo.yaml).
data=demo
make=(--min-frames 100 --max-frames 400 --no-frame-folders)
overrides=()
if [ "${1:-}" = --large ]; then
  data=demo-large
  make=()
  overrides=(--set data.manifest=demo-large/manifest.csv --set train.epochs=5)
elif [ -n "${1:-}" ]; then
  echo "usage: scripts/demo.sh [--large]" >&2
  exit 2
fi
# A data set written with other make-demo flags (an earlier demo.sh) is written again.
stamp="make-demo ${make[*]}"
if [ ! -f "$data/manifest.csv" ] || [ "$(cat "$data/.made_with" 2>/dev/null)" != "$stamp" ]; then
  echo "== framefit make-demo: 19 videos (12 train, 3 validation, 4 test) in $data/"
  rm -rf "$data"
  "$framefit" make-demo --out "$data" "${make[@]}" > /dev/null
  echo "$stamp" > "$data/.made_with"
fi

echo "== framefit train: ResNet-18 + LSTM, 1 GiB budget (configs/demo.yaml)"
rm -rf runs/demo-lstm
"$framefit" train --config configs/demo.yaml "${overrides[@]}"
echo "== framefit eval: held-out test videos"
"$framefit" eval --checkpoint runs/demo-lstm/best.pt --out runs/demo-lstm/test_metrics.json

if [ "${FRAMEFIT_DEMO_BASELINE:-1}" != 0 ]; then
  echo "== the same encoder with a per-frame linear head (no temporal context)"
  rm -rf runs/demo-linear
  "$framefit" train --config configs/demo.yaml "${overrides[@]}" --set model.head=linear \
    --set train.out_dir=runs/demo-linear > /dev/null
  "$framefit" eval --checkpoint runs/demo-linear/best.pt --out runs/demo-linear/test_metrics.json
fi

echo "== framefit predict and export"
"$framefit" predict --checkpoint runs/demo-lstm/best.pt --video "$data/videos/video19.mp4" \
  --out runs/demo-lstm/video19_phases.csv
"$framefit" export --checkpoint runs/demo-lstm/best.pt --out runs/demo-lstm/weights.pt
"$python" - <<'PY'
import json, torch, torchvision
state = torch.load("runs/demo-lstm/weights.pt")
encoder = {k[len("encoder."):]: v for k, v in state.items() if k.startswith("encoder.")}
model = torchvision.models.resnet18(norm_layer=lambda c: torch.nn.GroupNorm(32, c))
model.fc = torch.nn.Identity()
model.load_state_dict(encoder)
print(f"PyTorch: the exported encoder loads into torchvision's resnet18 ({len(encoder)} tensors)")
heads = {"LSTM head": "runs/demo-lstm", "per-frame linear head": "runs/demo-linear"}
scores = {}
for head, run in heads.items():
    try:
        scores[head] = json.load(open(run + "/test_metrics.json"))
    except FileNotFoundError:
        pass
print("test frame accuracy: " +
      ", ".join(f"{head} {100 * m['accuracy']:.1f}%" for head, m in scores.items()))
print("test edit score (segments in the true order): " +
      ", ".join(f"{head} {100 * m['segments']['edit']:.1f}%" for head, m in scores.items()))
PY
echo "main job finished in $((SECONDS - start)) s"
