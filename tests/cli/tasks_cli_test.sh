#!/usr/bin/env bash
# framefit train / eval / export on the shipped clips and segmentation configs, shortened, on a
# tiny demo data set; PyTorch loads the exported weights; predict on both (clip classes as CSV,
# masks as PNG scored against evaluation).
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
# And the data: every image and mask read as training reads them, each bad one named.
cp -r demo/segmentation bad_segmentation
"$python" -c "
import numpy as np
from PIL import Image
mask = np.array(Image.open('bad_segmentation/train/masks/0001.png'))
mask[0, 0] = 7
Image.fromarray(mask).save('bad_segmentation/train/masks/0001.png')
"
head -c 100 demo/segmentation/val/images/0000.png > bad_segmentation/val/images/0000.png
if "$framefit" doctor --config "$source/configs/demo_segmentation.yaml" \
  --set "data.images=bad_segmentation/{split}/images" \
  --set "data.masks=bad_segmentation/{split}/masks" > doctor.txt 2>&1; then
  echo "the doctor passed a mask with class id 7 and a corrupt image"; exit 1
fi
cat doctor.txt
grep -q "masks/0001.png has class id 7 but there are 3 classes" doctor.txt
grep -q "val/images/0000.png: cannot decode" doctor.txt
# bench-data reads every image and mask of a split as training does (it asked for a manifest),
# and the clips config's videos.
"$framefit" bench-data --config "$source/configs/demo_segmentation.yaml" --json > data.json
if "$framefit" bench-data --config "$source/configs/demo_segmentation.yaml" --split tset \
  > /dev/null 2> split.txt; then
  echo "bench-data read a split without images"; exit 1
fi
grep -q 'no images in split "tset": demo/segmentation/tset/images does not exist (data.images' \
  split.txt || { cat split.txt; exit 1; }
"$framefit" bench-data --config "$source/configs/demo_clips.yaml" --set data.resize=32 \
  --set data.crop=32 --json > clips_data.json
"$python" -c "
import json, os
d = json.load(open('data.json'))
n = len(os.listdir('demo/segmentation/train/images'))
assert d['task'] == 'segmentation' and d['unit'] == 'image' and d['units'] == d['samples'] == n, d
assert d['height'] == d['width'] == 64 and d['samples_per_second'] > 0, d
c = json.load(open('clips_data.json'))
assert c['unit'] == 'video' and c['units'] == 3 and c['sample'] == 'frame', c
assert c['height'] == c['width'] == 32 and c['samples'] > 3, c
"
# The plan train will use, before training: planned batch within the budget, in parts.
"$framefit" plan --config "$source/configs/demo_segmentation.yaml" --set train.lr_batch=4 \
  --set train.lr_scaling=sqrt --json > plan.json
cat plan.json
"$python" -c "
import json
p = json.load(open('plan.json'))
assert p['fits'] and p['planned'] and p['batch'] >= 1, p
assert p['predicted_peak_bytes'] == (p['static_bytes'] + p['library_bytes'] + p['input_bytes']
                                    + p['activation_bytes']), p
assert p['predicted_peak_bytes'] <= p['step_budget_bytes'] <= p['budget_bytes'], p
# Evaluation (no grad) planned on its own: at least the training batch, within the same budget.
assert p['eval_batch'] >= p['batch'], p
assert p['static_bytes'] < p['eval_predicted_peak_bytes'] <= p['step_budget_bytes'], p
# The table of peaks per batch: the planned batch's row is the plan, the next batch does not fit.
rows = {r['batch']: r for r in p['table']}
b = p['largest_batch']
assert rows[b]['fits'] and not rows[b + 1]['fits'], rows
assert rows[p['batch']]['planned_peak_bytes'] == p['predicted_peak_bytes'], (rows, p)
assert all(r['planned_peak_bytes'] <= r['plain_peak_bytes'] for r in p['table']), rows
# train.lr_batch: the rate the planned batch will train at.
lr = 0.003 * (p['batch'] * p['accumulate'] / 4) ** 0.5
assert abs(p['learning_rate'] - lr) < 1e-12 * lr, (p['learning_rate'], lr)
"
"$framefit" plan --config "$source/configs/demo_segmentation.yaml" --table > table.txt
cat table.txt
grep -q "predicted peak per batch" table.txt
"$framefit" train --config "$source/configs/demo_segmentation.yaml" --set train.epochs=2 \
  --set train.out_dir=seg > seg.txt 2> seg.log
cat seg.log seg.txt
grep -q "plan: batch" seg.log
grep -q "pixel accuracy" seg.txt
grep -q "IoU" seg.txt
"$framefit" eval --checkpoint seg/best.pt --split val --json > seg_eval.json
grep -q '"macro_jaccard"' seg_eval.json
"$framefit" export --checkpoint seg/best.pt --out seg_weights.pt
# predict writes a mask PNG per image (class ids, at the image's size) and each image's class
# shares; the masks score as evaluation does on the same images.
"$framefit" predict --checkpoint seg/best.pt --image demo/segmentation/val/images --out masks \
  > shares.csv
"$framefit" eval --checkpoint seg/best.pt --split val --json > seg_val.json
# One image: the mask file named, or NAME.png in an existing folder.
"$framefit" predict --checkpoint seg/best.pt --image demo/segmentation/val/images/0003.png \
  --out one.png > /dev/null
test -f one.png
"$framefit" predict --checkpoint seg/best.pt --image demo/segmentation/val/images/0003.png \
  --out masks > /dev/null
cmp one.png masks/0003.png
if "$framefit" predict --checkpoint seg/best.pt --video demo/videos/video01.mp4 --out x.png \
  2> predict.log; then
  echo "predict on a segmentation model ran on a video"; exit 1
fi
grep -q -- "--video is for a phases or clips checkpoint" predict.log
# A mask that would replace another image's mask, or an input image, is refused before writing.
mkdir twins
cp demo/segmentation/val/images/0003.png twins/0003.png
cp demo/segmentation/val/images/0003.png twins/0003.jpg
if "$framefit" predict --checkpoint seg/best.pt --image twins --out twin_masks 2> predict.log; then
  echo "predict wrote two images' masks to one file"; exit 1
fi
grep -q "would both have their mask written to twin_masks/0003.png" predict.log
test ! -e twin_masks
rm twins/0003.jpg
if "$framefit" predict --checkpoint seg/best.pt --image twins/0003.png --out twins \
  2> predict.log; then
  echo "predict wrote a mask over its input image"; exit 1
fi
grep -q "would be written over the image twins/0003.png" predict.log
if "$framefit" predict --checkpoint seg/best.pt --image twins --out twins 2> predict.log; then
  echo "predict wrote masks into its images' folder"; exit 1
fi
grep -q -- "--out names .*/twins, which --image reads" predict.log
if "$framefit" predict --checkpoint seg/best.pt --image twins/0003.png --out mask.jpg \
  2> predict.log; then
  echo "predict wrote a mask as mask.jpg"; exit 1
fi
grep -q "a mask is written as PNG .*; name it .png" predict.log
cmp twins/0003.png demo/segmentation/val/images/0003.png
# Past 256 classes masks are 16-bit PNGs, which predict writes as training reads them.
classes=$("$python" -c "print(','.join(['background', 'disc', 'square'] + ['c%d' % i for i in range(297)]))")
"$framefit" train --config "$source/configs/demo_segmentation.yaml" --set train.epochs=1 \
  --set train.out_dir=seg300 --set "data.classes=[$classes]" > /dev/null 2>&1
"$framefit" predict --checkpoint seg300/best.pt --image twins/0003.png --out mask300.png \
  > /dev/null
"$python" -c "
from PIL import Image
mask = Image.open('mask300.png')
assert mask.mode.startswith('I') and mask.size == (64, 64), (mask.mode, mask.size)
"
"$python" -c "
import csv, json
import numpy as np
from PIL import Image
rows = list(csv.DictReader(open('shares.csv')))
assert len(rows) == 12 and list(rows[0])[4:] == ['background', 'disc', 'square'], rows[:1]
confusion = np.zeros((3, 3), np.int64)
for r in rows:
    mask = Image.open(r['mask'])
    assert mask.mode == 'L', mask.mode  # class ids as 8-bit gray
    mask = np.array(mask)
    truth = np.array(Image.open(r['image'].replace('/images/', '/masks/')))
    assert mask.shape == (64, 64) and truth.shape == (64, 64), (mask.shape, truth.shape)
    shares = np.bincount(mask.ravel(), minlength=3) / mask.size
    assert np.allclose(shares, [float(r[c]) for c in ('background', 'disc', 'square')], atol=1e-4)
    np.add.at(confusion, (truth.ravel(), mask.ravel()), 1)
tp = np.diag(confusion)
iou = [tp[c] / (confusion[c].sum() + confusion[:, c].sum() - tp[c])
       for c in range(3) if confusion[c].sum() + confusion[:, c].sum() > 0]
expected = json.load(open('seg_val.json'))['macro_jaccard']
assert abs(np.mean(iou) - expected) < 1e-6, (np.mean(iou), expected)
"
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
# Resuming a finished run is allowed and changes nothing.
"$framefit" train --config "$source/configs/demo_clips.yaml" --set train.epochs=1 \
  --set train.out_dir=clips --set data.clip_length=4 --resume auto > /dev/null 2>&1
# predict: one row per clip of the video as training cuts them (5 fps, 4 frames, stride 8).
"$framefit" predict --checkpoint clips/best.pt --video demo/videos/video01.mp4 --out clips.csv
"$python" -c "
import csv
rows = list(csv.DictReader(open('clips.csv')))
assert rows and list(rows[0]) == ['clip', 'first_frame', 'last_frame', 'first_seconds',
                                  'last_seconds', 'class', 'confidence'], rows[:1]
for i, r in enumerate(rows):
    assert int(r['clip']) == i and int(r['first_frame']) == 40 * i, r  # 25 fps sampled at 5
    assert int(r['last_frame']) == int(r['first_frame']) + 15, r
    assert r['class'] in ('Preparation', 'Dissection', 'Irrigation', 'Suturing', 'Inspection'), r
    assert 0 < float(r['confidence']) <= 1, r
"
if "$framefit" predict --checkpoint clips/best.pt --image demo/segmentation/test/images \
  --out x 2> predict.log; then
  echo "predict on a clips model ran on images"; exit 1
fi
grep -q -- "--image is for a segmentation checkpoint; this one is for task clips" predict.log
if "$framefit" predict --checkpoint clips/best.pt --video demo/videos/video01.mp4 \
  --segments s.csv 2> predict.log; then
  echo "predict --segments ran on a clips model"; exit 1
fi
grep -q -- "--segments is for a phases checkpoint" predict.log
echo "tasks CLI: ok"
