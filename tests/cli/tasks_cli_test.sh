#!/usr/bin/env bash
# framefit train / eval / export on the shipped clips and segmentation configs, shortened, on a
# tiny demo data set; PyTorch loads the exported weights; predict refuses a clips model.
#   tasks_cli_test.sh FRAMEFIT PYTHON SOURCE_DIR WORK_DIR
set -euo pipefail
framefit=$1 python=$2 source=$3 work=$4
rm -rf "$work" && mkdir -p "$work" && cd "$work"
"$framefit" make-demo --out demo --train-videos 3 --val-videos 1 --test-videos 1 \
  --min-frames 100 --max-frames 150 --no-frame-folders > /dev/null 2>&1
test -f demo/segmentation/train/masks/0000.png

# The doctor checks the named network from its options; a UNet that cannot halve the images.
"$framefit" doctor --config "$source/configs/demo_segmentation.yaml" | grep -q "no problems found"
if "$framefit" doctor --config "$source/configs/demo_segmentation.yaml" --set data.resize=60 \
  > doctor.txt 2>&1; then
  echo "the doctor passed data.resize 60 for a UNet of depth 3"; exit 1
fi
grep -q "set data.resize to 64" doctor.txt
# The plan train will use, before training: planned batch within the budget, in parts.
"$framefit" plan --config "$source/configs/demo_segmentation.yaml" --json > plan.json
cat plan.json
"$python" -c "
import json
p = json.load(open('plan.json'))
assert p['fits'] and p['planned'] and p['batch'] >= 1, p
assert p['predicted_peak_bytes'] == p['static_bytes'] + p['input_bytes'] + p['activation_bytes'], p
assert p['predicted_peak_bytes'] <= p['step_budget_bytes'] <= p['budget_bytes'], p
# Evaluation (no grad) planned on its own: at least the training batch, within the same budget.
assert p['eval_batch'] >= p['batch'], p
assert p['static_bytes'] < p['eval_predicted_peak_bytes'] <= p['step_budget_bytes'], p
"
"$framefit" train --config "$source/configs/demo_segmentation.yaml" --set train.epochs=2 \
  --set train.out_dir=seg > seg.txt 2> seg.log
cat seg.log seg.txt
grep -q "plan: batch" seg.log
grep -q "pixel accuracy" seg.txt
grep -q "IoU" seg.txt
"$framefit" eval --checkpoint seg/best.pt --split val --json > seg_eval.json
grep -q '"macro_jaccard"' seg_eval.json
"$framefit" export --checkpoint seg/best.pt --out seg_weights.pt
"$python" -c "
import torch, sys
state = torch.load('seg_weights.pt')
assert 'out.weight' in state and state['out.weight'].shape[0] == 3, list(state)[:5]
"

"$framefit" train --config "$source/configs/demo_clips.yaml" --set train.epochs=1 \
  --set train.out_dir=clips --set data.clip_length=4 > clips.txt 2> clips.log
cat clips.log clips.txt
grep -q "clips of 4 frames" clips.log
grep -q "clip accuracy" clips.txt
# Resuming a finished run is allowed and changes nothing; predicting phases is refused.
"$framefit" train --config "$source/configs/demo_clips.yaml" --set train.epochs=1 \
  --set train.out_dir=clips --set data.clip_length=4 --resume auto > /dev/null 2>&1
if "$framefit" predict --checkpoint clips/best.pt --video demo/videos/video01.mp4 2> predict.log; then
  echo "predict accepted a clips model"; exit 1
fi
grep -q "is a clips model" predict.log
echo "tasks CLI: ok"
