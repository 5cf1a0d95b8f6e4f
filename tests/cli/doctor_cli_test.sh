#!/usr/bin/env bash
# framefit doctor --config on seeds/001's network as written (must fail, naming fc1 and its
# 48.43 GiB) and on the fix (must pass, with the largest batch for 12 GiB).
#   doctor_cli_test.sh FRAMEFIT SOURCE_DIR
set -euo pipefail
framefit=$1 source=$2
if out=$("$framefit" doctor --config "$source/configs/seeds001_as_written.yaml" 2>&1); then
  echo "the doctor passed seeds/001's network as written:"; echo "$out"; exit 1
fi
echo "$out"
for expected in "fc1: Linear expects 25,392,000 input features but the flattened input has 3,119,040" \
                "48.43 GiB" "fix:"; do
  grep -qF "$expected" <<<"$out" || { echo "missing: $expected"; exit 1; }
done
out=$("$framefit" doctor --config "$source/configs/clip3d.yaml" --batch 2)
echo "$out"
grep -q "no problems found" <<<"$out"
grep -q "largest batch" <<<"$out"
json=$("$framefit" doctor --config "$source/configs/clip3d.yaml" --json)
grep -q '"largest_batch":' <<<"$json"
# Too large a batch is an error with the largest that fits.
if "$framefit" doctor --config "$source/configs/clip3d.yaml" --batch 1000 > big.txt 2>&1; then
  echo "batch 1000 passed in 12 GiB"; exit 1
fi
grep -q "use a batch of at most" big.txt
# A clips config without model.input: the input follows from data.clip_length and data.crop.
# The doctor probes its data too: a tiny demo data set.
rm -rf doctor_work && mkdir doctor_work && cd doctor_work
"$framefit" make-demo --out demo --train-videos 3 --val-videos 1 --test-videos 1 \
  --min-frames 100 --max-frames 150 --no-frame-folders > /dev/null 2>&1
out=$("$framefit" doctor --config "$source/configs/demo_clips.yaml")
grep -q "data: train .* clips of 8 frames from 3 videos" <<<"$out" || { echo "$out"; exit 1; }
grep -q "on input 3 x 8 x 64 x 64 (per sample)" <<<"$out" || { echo "$out"; exit 1; }
grep -q "no problems found" <<<"$out"
# Its largest batch is for what a training step may use: train.budget less the prefetch reserve.
grep -qF "step budget 192.00 MiB (budget 256.00 MiB less the prefetch reserve)" <<<"$out" ||
  { echo "$out"; exit 1; }
json=$("$framefit" doctor --config "$source/configs/demo_clips.yaml" --json)
python3 -c "import json, sys; d = json.loads(sys.argv[1]); \
assert d['step_budget_bytes'] == 192 << 20 and d['budget_bytes'] == 256 << 20, d" "$json"
# A missing video is named.
rm demo/videos/video02.mp4
if "$framefit" doctor --config "$source/configs/demo_clips.yaml" > missing.txt 2>&1; then
  echo "the doctor passed a clips config with a missing video"; exit 1
fi
grep -q "video02.mp4" missing.txt || { cat missing.txt; exit 1; }
echo "doctor CLI: ok"
