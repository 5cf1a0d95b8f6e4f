#!/usr/bin/env bash
# The Cholec80 recipe on a tiny copy of Cholec80's layout (3 videos of 4 s at 25 fps, phase
# files with one line per frame): scripts/cholec80_manifest.py writes the manifests for the
# videos and for 1 fps frame folders extracted with the ffmpeg CLI, and configs/cholec80.yaml's
# data settings read both (doctor probes every video: labels by time for the folders). A short
# run trains on it, with the tool annotations (every 25th frame), and eval --relaxed cholec80
# scores it; the tool AP is recomputed in Python from eval's per-frame predictions.
#   cholec80_cli_test.sh FRAMEFIT PYTHON SOURCE_DIR WORK_DIR
set -euo pipefail
framefit=$1 python=$2 source=$3 work=$4
rm -rf "$work" && mkdir -p "$work/cholec80/videos" "$work/cholec80/phase_annotations" \
  "$work/cholec80/tool_annotations" "$work/frames"
cd "$work"
phases=(Preparation CalotTriangleDissection ClippingCutting GallbladderDissection
        GallbladderPackaging CleaningCoagulation GallbladderRetraction)
for v in 01 02 03; do
  ffmpeg -loglevel error -y -f lavfi -i "testsrc2=size=64x48:rate=25:duration=4" \
    -c:v libx264 -pix_fmt yuv420p "cholec80/videos/video$v.mp4"
  {
    printf 'Frame\tPhase\n'
    for f in $(seq 0 99); do printf '%d\t%s\n' "$f" "${phases[$(( f * 7 / 100 ))]}"; done
  } > "cholec80/phase_annotations/video$v-phase.txt"
  {  # Grasper from 2 s on, Hook in video 3's first second; the others never.
    printf 'Frame\tGrasper\tBipolar\tHook\tScissors\tClipper\tIrrigator\tSpecimenBag\n'
    for f in 0 25 50 75; do
      printf '%d\t%d\t0\t%d\t0\t0\t0\t0\n' "$f" $(( f >= 50 )) $(( v == 3 && f < 25 ))
    done
  } > "cholec80/tool_annotations/video$v-tool.txt"
  mkdir -p "frames/video$v"
  ffmpeg -loglevel error -y -i "cholec80/videos/video$v.mp4" -vf fps=1 "frames/video$v/%05d.jpg"
done
"$python" "$source/scripts/cholec80_manifest.py" cholec80 --split 1,1,1 > videos.csv
"$python" "$source/scripts/cholec80_manifest.py" cholec80 --split 2,0,1 --frames frames > frames.csv
grep -q "^video03,.*,test,,,.*/tool_annotations/video03-tool.txt$" videos.csv ||
  { cat videos.csv; exit 1; }
grep -q "^video02,.*,train,1,25,.*video02-tool.txt$" frames.csv || { cat frames.csv; exit 1; }
"$python" "$source/scripts/cholec80_manifest.py" cholec80 --split 1,1,1 --no-tools > plain.csv
grep -q "^name,video,labels,split,fps,labels_fps$" plain.csv || { cat plain.csv; exit 1; }
if "$python" "$source/scripts/cholec80_manifest.py" cholec80 --split 4,0,0 > /dev/null 2> missing.txt; then
  echo "a manifest for a missing video"; exit 1
fi
grep -q "video04.mp4" missing.txt || { cat missing.txt; exit 1; }
# The recipe on CPU, small: no ImageNet file, ResNet-18, 48-pixel frames.
small=(--set model.weights= --set model.encoder=resnet18 --set data.resize=48 --set data.crop=40
       --set device=cpu --set train.budget=1GiB --set data.workers=1)
for manifest in videos.csv frames.csv; do
  out=$("$framefit" doctor --config "$source/configs/cholec80.yaml" --set "data.manifest=$manifest" \
    "${small[@]}" 2>&1) || { echo "$out"; exit 1; }
  # Probed: 4 s at 1 fps (the folders as ffmpeg's fps filter extracted them); the TCN's receptive
  # field being longer than such videos is a warning, not an error.
  grep -Eq "training videos, the longest [45] sampled frames at 40x40" <<<"$out" ||
    { echo "$out"; exit 1; }
done
"$framefit" train --config "$source/configs/cholec80.yaml" --set data.manifest=videos.csv \
  "${small[@]}" --set train.max_steps=2 --set train.out_dir=run > train.txt 2>&1 ||
  { cat train.txt; exit 1; }
"$framefit" eval --checkpoint run/best.pt --relaxed cholec80 --predictions predicted --json > eval.json
"$framefit" eval --checkpoint run/best.pt > eval.txt
grep -Eq "^  mean \(mAP\) +[0-9.]+$" eval.txt || { cat eval.txt; exit 1; }
"$framefit" predict --checkpoint run/best.pt --video cholec80/videos/video01.mp4 --out p.csv \
  --timeline timeline.png
# The phases' ribbon and one per tool: 8 ribbons of 24 pixels, 4 apart, one column per frame.
"$python" -c "
import struct
head = open('timeline.png', 'rb').read(24)
assert head[12:16] == b'IHDR' and struct.unpack('>II', head[16:24]) == (4, 8 * 24 + 7 * 4), head
"
head -1 p.csv | grep -q "^frame,time_seconds,phase,confidence,Grasper,Bipolar,Hook,.*,SpecimenBag$" ||
  { head -2 p.csv; exit 1; }
"$python" -c "
import csv, json, math
m = json.load(open('eval.json'))
# Tool AP from the per-frame probabilities eval wrote and the tool file, as scikit-learn's
# average_precision_score computes it.
rows = list(csv.DictReader(open('predicted/video03.csv')))
truth = {}
for line in open('cholec80/tool_annotations/video03-tool.txt').read().split(chr(10))[1:]:
    if line:
        f, *v = line.split()
        truth[int(f)] = [int(x) for x in v]
names = ['Grasper', 'Bipolar', 'Hook', 'Scissors', 'Clipper', 'Irrigator', 'SpecimenBag']
def ap(scores, labels):
    pairs = sorted(zip(scores, labels), reverse=True)
    positives, total, tp, recall_before = sum(labels), 0.0, 0, 0.0
    for i, (s, y) in enumerate(pairs):
        tp += y
        if i + 1 < len(pairs) and pairs[i + 1][0] == s:
            continue
        total += (tp / positives - recall_before) * tp / (i + 1)
        recall_before = tp / positives
    return total
t = m['tools']
assert t['frames'] == 4, t
for k, name in enumerate(names):
    scores = [float(r[name]) for r in rows if int(r['frame']) in truth]
    labels = [truth[int(r['frame'])][k] for r in rows if int(r['frame']) in truth]
    expected = ap(scores, labels) if sum(labels) else None
    got = t['average_precision'][name]
    assert (got is None) == (expected is None) and (got is None or abs(got - expected) < 1e-3), (name, got, expected)
    said = [y for s, y in zip(scores, labels) if s >= 0.5]  # predicted present
    errors = (len(said) - sum(said)) + (sum(labels) - sum(said))
    for key, want in (('precision', sum(said) / len(said) if said else None),
                      ('recall', sum(said) / sum(labels) if sum(labels) else None),
                      ('f1', 2 * sum(said) / (2 * sum(said) + errors) if sum(said) + errors else None)):
        have = t[key][name]
        assert (have is None) == (want is None) and (have is None or abs(have - want) < 1e-9), (key, name, have, want)
present = [v for v in t['average_precision'].values() if v is not None]
assert abs(t['mean_average_precision'] - sum(present) / len(present)) < 1e-9, t
# One test video: the mean over videos is its own mAP, which is the pooled one.
v = m['video_averages']
assert v['tool_videos'] == 1 and v['tool_map_std'] == 0, v
assert abs(v['tool_map_mean'] - m['videos'][0]['tools']['mean_average_precision']) < 1e-12, v
assert abs(v['tool_map_mean'] - t['mean_average_precision']) < 1e-12, v
r = m['relaxed']
assert r['rules'] == 'cholec80' and r['videos'] == 1, r
assert r['accuracy_mean'] >= m['accuracy'] - 1e-12, (r['accuracy_mean'], m['accuracy'])
assert sorted(r['jaccard']) == sorted(['Preparation', 'CalotTriangleDissection', 'ClippingCutting',
    'GallbladderDissection', 'GallbladderPackaging', 'CleaningCoagulation', 'GallbladderRetraction'])
"
echo "cholec80 recipe: ok"
