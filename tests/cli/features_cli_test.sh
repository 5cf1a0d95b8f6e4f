#!/usr/bin/env bash
# Two-stage training with the built CLI: `extract` writes each demo video's features, one is
# saved as MS-TCN does (NumPy, [D,T]), a TCN head trains on them alone (model.encoder
# features), and doctor, plan, eval, predict --features and export work on the run.
set -euo pipefail
framefit=$1 python=$2 work=$3
rm -rf "$work" && mkdir -p "$work/features"
"$framefit" make-demo --out "$work/demo" --train-videos 2 --val-videos 1 --test-videos 0 >/dev/null
for name in video01 video02 video03; do
  "$framefit" extract --model resnet18 --video "$work/demo/videos/$name.mp4" --resize 32 \
    --crop 32 --chunk 64 --output "$work/features/$name.pt" >/dev/null
done
"$python" -c "
import numpy as np, torch
features = torch.load('$work/features/video02.pt')
np.save('$work/features/video02.npy', features.numpy().T)  # MS-TCN's [D,T]
"
cat > "$work/manifest.csv" <<CSV
name,labels,split,features
video01,demo/labels/video01.txt,train,features/video01.pt
video02,demo/labels/video02.txt,train,features/video02.npy
video03,demo/labels/video03.txt,val,features/video03.pt
CSV
cat > "$work/config.yaml" <<YAML
model: {encoder: features, head: tcn}
data:
  manifest: $work/manifest.csv
  classes: [Preparation, Dissection, Irrigation, Suturing, Inspection]
train: {epochs: 3, lr: 0.003, out_dir: $work/run}
YAML
"$framefit" doctor --config "$work/config.yaml" | grep -q "precomputed features (512 per frame)"
# A features manifest not yet written is explained with the command that writes it.
if "$framefit" train --config "$work/config.yaml" --set data.manifest="$work/none/manifest.csv" \
  > /dev/null 2> "$work/missing.log"; then
  echo "train ran without its features manifest"; exit 1
fi
grep -q "written by framefit extract --checkpoint RUN/best.pt --out-dir $work/none" "$work/missing.log"
"$framefit" plan --config "$work/config.yaml" | grep -q "nothing to plan"
# bench-data reads the features files (it reported "0 frames of 0x0").
"$framefit" bench-data --config "$work/config.yaml" > "$work/data.txt"
rows=$(( $("$python" -c "import torch; print(torch.load('$work/features/video01.pt').shape[0])") +
         $("$python" -c "import numpy; print(numpy.load('$work/features/video02.npy').shape[1])") ))
grep -q "^read 2 features files, $rows feature rows of 512 features in" "$work/data.txt" ||
  { cat "$work/data.txt"; exit 1; }
"$framefit" train --config "$work/config.yaml" >"$work/train.txt" 2>&1 ||
  { cat "$work/train.txt"; exit 1; }
grep -q "the head alone on precomputed features (512 per frame)" "$work/train.txt"
"$framefit" eval --checkpoint "$work/run/best.pt" --split val --out "$work/metrics.json" >/dev/null
"$framefit" predict --checkpoint "$work/run/best.pt" --features "$work/features/video03.pt" \
  --fps 25 --out "$work/phases.csv" --segments "$work/segments.csv" 2>/dev/null
"$framefit" export --checkpoint "$work/run/best.pt" --out "$work/weights.pt" >/dev/null
# A timeline not named .png is refused before predicting (the writer refused it after).
if "$framefit" predict --checkpoint "$work/run/best.pt" --features "$work/features/video03.pt" \
  --timeline "$work/timeline.txt" > "$work/refused.csv" 2> "$work/refused.log"; then
  echo "predict wrote a timeline as timeline.txt"; exit 1
fi
grep -q "the timeline is a PNG picture; name it .png" "$work/refused.log"
test ! -s "$work/refused.csv"
# eval's accuracy is that of predict's phases against the annotation; export holds the head only.
"$python" -c "
import csv, json, torch
rows = list(csv.DictReader(open('$work/phases.csv')))
truth = [line.split('\t')[1].strip() for line in open('$work/demo/labels/video03.txt')][1:]
assert len(rows) == len(truth), (len(rows), len(truth))
assert rows[1]['time_seconds'] == '0.040', rows[1]
accuracy = sum(r['phase'] == t for r, t in zip(rows, truth)) / len(truth)
metrics = json.load(open('$work/metrics.json'))
assert abs(metrics['accuracy'] - accuracy) < 1e-9, (metrics['accuracy'], accuracy)
keys = list(torch.load('$work/weights.pt').keys())
assert keys and all(k.startswith('head.') for k in keys), keys
"
# data.features_stride 3: eval and predict take rows 0, 3, 6, ... and agree.
"$framefit" eval --checkpoint "$work/run/best.pt" --split val --set data.features_stride=3 \
  --out "$work/metrics3.json" >/dev/null
"$framefit" predict --checkpoint "$work/run/best.pt" --features "$work/features/video03.pt" \
  --fps 25 --set data.features_stride=3 --out "$work/phases3.csv" 2>/dev/null
"$python" -c "
import csv, json
rows = list(csv.DictReader(open('$work/phases3.csv')))
truth = [line.split('\t')[1].strip() for line in open('$work/demo/labels/video03.txt')][1:][::3]
assert len(rows) == len(truth), (len(rows), len(truth))
assert (rows[1]['frame'], rows[1]['time_seconds']) == ('3', '0.120'), rows[1]
accuracy = sum(r['phase'] == t for r, t in zip(rows, truth)) / len(truth)
metrics = json.load(open('$work/metrics3.json'))
assert abs(metrics['accuracy'] - accuracy) < 1e-9, (metrics['accuracy'], accuracy)
"
# A features model predicts from features, not from a video.
if "$framefit" predict --checkpoint "$work/run/best.pt" --video "$work/demo/videos/video03.mp4" \
  2>"$work/err.txt"; then
  echo "a features model predicted from a video"; exit 1
fi
grep -q "give --features F.npy|F.pt instead of --video" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }

# Stage one from a config: every split's videos sampled and cropped as the config says, each
# with the labels of its sampled frames, and a manifest a features run trains on.
cat > "$work/encoder.yaml" <<YAML
model: {encoder: resnet18, norm: group_norm, groups: 8, head: linear}
data:
  manifest: $work/demo/manifest.csv
  classes: [Preparation, Dissection, Irrigation, Suturing, Inspection]
  fps: 5
  resize: 32
  crop: 32
YAML
"$framefit" extract --config "$work/encoder.yaml" --out-dir "$work/extracted" --chunk 32 \
  >/dev/null 2>"$work/extract.txt" || { cat "$work/extract.txt"; exit 1; }
"$python" -c "
import csv, torch
rows = list(csv.DictReader(open('$work/extracted/manifest.csv')))
assert [r['split'] for r in rows] == ['train', 'train', 'val'], rows
for r in rows:
    features = torch.load('$work/extracted/' + r['features'])
    labels = open('$work/extracted/' + r['labels']).read().splitlines()[1:]
    frames = sum(1 for _ in open('$work/demo/labels/' + r['name'] + '.txt')) - 1
    assert features.shape == (len(labels), 512), (features.shape, len(labels))
    assert abs(len(labels) - frames / 5) <= 1, (len(labels), frames)  # 5 of 25 fps
    assert r['fps'] == '5', r
"
# The committed two-stage config (MS-TCN's 4 x 10 offline head) trains on that manifest.
"$framefit" train --config "$(dirname "$0")/../../configs/demo_features.yaml" \
  --set data.manifest="$work/extracted/manifest.csv" --set train.epochs=1 \
  --set train.out_dir="$work/run_extracted" >"$work/train2.txt" 2>&1 ||
  { cat "$work/train2.txt"; exit 1; }
test -f "$work/run_extracted/best.pt"
if "$framefit" extract --config "$work/encoder.yaml" 2>"$work/err.txt"; then
  echo "extract --config ran without --out-dir"; exit 1
fi
grep -q "give --out-dir" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
echo "features CLI test passed"
