#!/usr/bin/env bash
# make-demo, train, eval, predict and export end to end on a tiny demo, with the bad-input
# cases; `resume` mode kills a run with SIGKILL, and stops one with SIGINT, and checks each resumed
# run's weights against an uninterrupted one.
#   train_cli_test.sh {tiny|resume} FRAMEFIT PYTHON WORKDIR
set -euo pipefail
mode=$1 framefit=$2 python=$3 work=$4
rm -rf "$work" && mkdir -p "$work" && cd "$work"
export FRAMEFIT_CACHE_DIR="$work/cache"

fail() { echo "FAIL: $*"; exit 1; }
# expect_error "fragment" command...: the command fails and says `fragment` on stderr.
expect_error() {
  local fragment=$1; shift
  if "$@" 2> err.txt; then fail "expected an error from: $*"; fi
  grep -qF -- "$fragment" err.txt || { cat err.txt; fail "expected '$fragment' in the error"; }
}

"$framefit" make-demo --out demo --train-videos 3 --val-videos 1 --test-videos 1 \
  --min-frames 40 --max-frames 60 > make.txt
test -f demo/manifest.csv && test -f demo/manifest_frames.csv && test -f demo/videos/video05.mp4
test "$(ls demo/frames/video01 | wc -l)" -eq "$(($(wc -l < demo/labels/video01.txt) - 1))"

cat > tiny.yaml <<'EOF'
model: {encoder: resnet18, norm: group_norm, groups: 8, head: lstm}
data:
  manifest: demo/manifest.csv
  classes: [Preparation, Dissection, Irrigation, Suturing, Inspection]
  fps: 12.5
  resize: 32
  crop: 32
train: {epochs: 2, lr: 0.001, precision: fp32, budget: 1GiB, chunk: auto, seed: 0, out_dir: run}
EOF

if [ "$mode" = tiny ]; then
  # The doctor on a phases config probes every split without training; a missing video fails it.
  "$framefit" doctor --config tiny.yaml > doctor.txt
  grep -q "3 training videos, the longest" doctor.txt || { cat doctor.txt; fail "doctor summary"; }
  grep -q "no problems found" doctor.txt || { cat doctor.txt; fail "doctor findings"; }
  sed 's|videos/video04.mp4|videos/none.mp4|' demo/manifest.csv > demo/broken.csv
  if "$framefit" doctor --config tiny.yaml --set data.manifest=demo/broken.csv > doctor.txt; then
    fail "the doctor passed a manifest naming a missing video"
  fi
  grep -q "none.mp4: cannot open" doctor.txt || { cat doctor.txt; fail "doctor on a missing video"; }
  # The demo drawn with tools and configs/demo_tools.yaml: two steps, then eval scores the tools
  # (10 annotated frames per 250-frame video).
  "$framefit" make-demo --out demo_tools --tools --train-videos 2 --val-videos 0 --test-videos 1 \
    --min-frames 250 --max-frames 250 --no-frame-folders > make_tools.txt
  grep -q "tools: \[Clip, Probe\]" make_tools.txt || { cat make_tools.txt; fail "make-demo --tools"; }
  test -f demo_tools/tools/video03-tool.txt
  "$framefit" train --config "$(dirname "$0")/../../configs/demo_tools.yaml" \
    --set train.max_steps=2 --set train.validate=false --set data.resize=32 --set data.crop=32 \
    --set train.out_dir=run_tools > train_tools.txt 2>&1 || { cat train_tools.txt; fail "tools run"; }
  "$framefit" eval --checkpoint run_tools/best.pt --set data.test_split=train > eval_tools.txt
  grep -Eq "^  mean \(mAP\) +[0-9.]+$" eval_tools.txt || { cat eval_tools.txt; fail "tool mAP"; }
fi

if [ "$mode" = resume ]; then
  # Checkpoint every step; slow enough (64 px frames) that the kill lands mid-run.
  common=(--config tiny.yaml --set train.checkpoint_every=1 --set train.epochs=4
          --set data.resize=64 --set data.crop=56 --set model.head=tcn --set train.chunk=8)
  "$framefit" train "${common[@]}" --set train.out_dir=straight > straight.txt 2>&1
  "$framefit" train "${common[@]}" --set train.out_dir=killed > killed.txt 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    [ -f killed/checkpoints/step_00000004.pt ] && break
    sleep 0.05
  done
  kill -9 "$pid" 2>/dev/null || fail "the run finished before it could be killed"
  wait "$pid" 2>/dev/null || true
  [ -f killed/checkpoints/step_00000012.pt ] && fail "the killed run had already finished"
  ls killed/checkpoints
  "$framefit" train "${common[@]}" --set train.out_dir=killed --resume auto > resumed.txt 2>&1 \
    || { cat resumed.txt; fail "resume failed"; }
  grep -q "resuming from" resumed.txt || fail "did not resume"
  expect_error "give --config, or name the checkpoint" "$framefit" train --resume auto
  ls killed/checkpoints/*.tmp 2>/dev/null && fail "a temporary checkpoint was left behind"
  "$framefit" export --checkpoint straight/checkpoints/step_00000012.pt --out straight.pt > /dev/null
  "$framefit" export --checkpoint killed/checkpoints/step_00000012.pt --out killed.pt > /dev/null
  "$python" - <<'PY'
import torch
a, b = torch.load("straight.pt"), torch.load("killed.pt")
assert list(a) == list(b), "different keys"
different = [k for k in a if not torch.equal(a[k], b[k])]
assert not different, f"weights differ after kill and resume: {different[:5]}"
print(f"kill -9 and --resume: {len(a)} tensors identical to the uninterrupted run")
PY
  # SIGINT (Ctrl-C) stops at the next step with a checkpoint of its own (none is due: checkpoints
  # per epoch), exit code 130; resumed, the run ends with the uninterrupted run's weights.
  "$framefit" train "${common[@]}" --set train.checkpoint_every=0 --set train.out_dir=stopped \
    > stopped.txt 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    grep -q '"type":"step"' stopped/log.jsonl 2>/dev/null && break
    sleep 0.05
  done
  kill -INT "$pid" 2>/dev/null || fail "the run finished before it could be stopped"
  rc=0
  wait "$pid" || rc=$?
  [ "$rc" -eq 130 ] || { cat stopped.txt; fail "a stopped run exited with $rc, not 130"; }
  grep -q "stopped by SIGINT after step" stopped.txt || { cat stopped.txt; fail "no stop message"; }
  [ -f stopped/checkpoints/step_00000012.pt ] && fail "the stopped run had already finished"
  ls stopped/checkpoints
  # The command the stop message gives (the checkpoint alone: it holds the config) resumes it,
  # here from another folder: the run goes on in the folder that holds the checkpoint.
  checkpoint=$(grep -o 'framefit train --resume [^`]*' stopped.txt) ||
    { cat stopped.txt; fail "no resume command in the stop message"; }
  checkpoint=${checkpoint#framefit train --resume }
  mkdir -p elsewhere
  (cd elsewhere && "$framefit" train --resume "../$checkpoint" \
    --set data.manifest="$work/demo/manifest.csv" > ../resumed_stop.txt 2>&1) ||
    { cat resumed_stop.txt; fail "resume after SIGINT"; }
  grep -q "train.out_dir: stopped -> $work/stopped" resumed_stop.txt ||
    { cat resumed_stop.txt; fail "the resumed run's folder"; }
  test ! -e elsewhere/stopped
  "$framefit" export --checkpoint stopped/checkpoints/step_00000012.pt --out stopped.pt > /dev/null
  "$python" - <<'PY'
import torch
a, b = torch.load("straight.pt"), torch.load("stopped.pt")
different = [k for k in a if not torch.equal(a[k], b[k])]
assert list(a) == list(b) and not different, f"weights differ after SIGINT and resume: {different[:5]}"
print(f"SIGINT and --resume: {len(a)} tensors identical to the uninterrupted run")
PY
  exit 0
fi

# plan --config says what train will run (same calibration cache): the same settings.
"$framefit" plan --config tiny.yaml > plan.txt 2> plan.err || { cat plan.err; fail "plan --config"; }
"$framefit" plan --config tiny.yaml --json > plan.json 2> /dev/null
settings=$(sed -n 2p plan.txt | sed 's/^ *//')
test -n "$settings" || fail "no settings line in plan.txt"
# Train; the JSON result names the checkpoints; the log has steps and epochs.
"$framefit" train --config tiny.yaml --json > train.json 2> train.err
grep -qF "plan: $settings, predicted peak" train.err \
  || { cat plan.txt train.err; fail "train ran other settings than plan --config printed"; }
test -f run/best.pt && test -f run/config.yaml && test -s run/log.jsonl
# Eval on the test split (MP4) and on the same videos as JPEG frame folders.
"$framefit" eval --checkpoint run/best.pt --json --out metrics.json --predictions preds \
  --relaxed general > eval.json
# A metrics file that cannot be written fails at once (it used to exit 0 without the file).
if "$framefit" eval --checkpoint run/best.pt --out missing/metrics.json > /dev/null 2> out.err; then
  fail "eval --out into a missing folder succeeded"
fi
grep -q "cannot write 'missing/metrics.json': the folder missing does not exist" out.err \
  || { cat out.err; fail "eval --out message"; }
# Cholec80's own relaxed rules need its 7 phases; the demo has 5.
if "$framefit" eval --checkpoint run/best.pt --relaxed cholec80 > /dev/null 2> relaxed.err; then
  fail "eval --relaxed cholec80 scored a 5-phase data set"
fi
grep -q "Cholec80's 7 phases" relaxed.err || { cat relaxed.err; fail "relaxed message"; }
"$framefit" eval --checkpoint run/best.pt --set data.manifest=demo/manifest_frames.csv --json \
  > eval_frames.json
"$framefit" predict --checkpoint run/best.pt --video demo/videos/video05.mp4 --out phases.csv \
  --segments segments.csv --timeline timeline.png
"$framefit" predict --checkpoint run/best.pt --video demo/frames/video05 --fps 25 > phases_frames.csv
"$framefit" export --checkpoint run/best.pt --out weights.pt > /dev/null
"$python" - <<'PY'
import json, torch, torchvision
plan = json.load(open("plan.json"))
assert plan["fits"] and plan["planned"], plan
assert 0 < plan["predicted_peak_bytes"] <= plan["step_budget_bytes"] < plan["budget_bytes"], plan
assert plan["videos"] == 3 and plan["frame_size"] == 32 and plan["longest_frames"] > 0, plan
assert sum(plan["breakdown"][k] for k in ("parameters", "gradients", "optimizer_state",
           "input_frames", "features", "activations", "workspace")) > 0
result = json.load(open("train.json"))
assert result["steps"] == 6 and result["best_checkpoint"].endswith("best.pt"), result
log = [json.loads(line) for line in open("run/log.jsonl")]
assert [r["type"] for r in log].count("step") == 6 and [r["type"] for r in log].count("epoch") == 2
assert "val" in log[-1] and "accuracy" in log[-1]["val"]
metrics = json.load(open("eval.json"))
assert metrics == json.load(open("metrics.json"))
for key in ("accuracy", "macro_precision", "macro_recall", "macro_f1", "macro_jaccard", "phases"):
    assert key in metrics, key
# One test video: its own metrics are the split's, and the video-level mean is its accuracy.
assert [v["name"] for v in metrics["videos"]] == ["video05"], metrics["videos"]
assert metrics["videos"][0]["accuracy"] == metrics["accuracy"]
assert metrics["video_averages"]["videos"] == 1
assert metrics["video_averages"]["accuracy_mean"] == metrics["accuracy"]
frames = json.load(open("eval_frames.json"))
assert frames["frames"] == metrics["frames"], (frames["frames"], metrics["frames"])
labels = open("demo/labels/video05.txt").read().split("\n")[1:]
rows = open("phases.csv").read().strip().split("\n")
assert rows[0] == "frame,time_seconds,phase,confidence"
expected = len(range(0, len([l for l in labels if l]), 2))  # 25 fps sampled at 12.5
assert len(rows) - 1 == expected, (len(rows) - 1, expected)
assert len(open("phases_frames.csv").read().strip().split("\n")) == len(rows)
# The predicted phases of the test video, scored here, give eval's frame accuracy and its
# segmental scores (MS-TCN's edit and F1@k, computed independently).
truth = [l.split("\t")[1] for l in labels if l][::2]
predicted = [r.split(",")[2] for r in rows[1:]]
assert sum(p == t for p, t in zip(predicted, truth)) / len(truth) == metrics["accuracy"]
def segments(seq):
    out = []
    for i, x in enumerate(seq):
        if i == 0 or x != seq[i - 1]:
            out.append([x, i, i + 1])
        else:
            out[-1][2] = i + 1
    return out
def levenshtein(a, b):
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return d[-1][-1]
p_seg, t_seg = segments(predicted), segments(truth)
edit = 1 - levenshtein([s[0] for s in p_seg], [s[0] for s in t_seg]) / max(len(p_seg), len(t_seg))
scored = metrics["segments"]
assert abs(scored["edit"] - edit) < 1e-12, (scored, edit)
assert scored["true_segments"] == len(t_seg) and scored["predicted_segments"] == len(p_seg)
for threshold in (0.1, 0.25, 0.5):
    hit, tp = [False] * len(t_seg), 0
    for label, start, end in p_seg:
        ious = [(min(end, e) - max(start, s)) / (max(end, e) - min(start, s)) if l == label else -1
                for l, s, e in t_seg]
        best = max(range(len(t_seg)), key=lambda j: ious[j])
        if ious[best] >= threshold and not hit[best]:
            hit[best], tp = True, tp + 1
    fp, fn = len(p_seg) - tp, len(t_seg) - tp
    f1 = 2 * tp / (2 * tp + fp + fn)
    assert abs(scored["f1@%d" % round(100 * threshold)] - f1) < 1e-12, (threshold, scored, f1)
assert metrics["videos"][0]["segments"] == scored
assert metrics["video_averages"]["edit_mean"] == scored["edit"]
assert "segments" in log[-1]["val"]
# predict --segments: the runs of the per-frame phases, in order, covering every frame once.
segment_rows = [r.split(",") for r in open("segments.csv").read().strip().split("\n")]
assert segment_rows[0] == ["segment", "phase", "first_frame", "last_frame", "first_seconds",
                           "last_seconds", "frames", "confidence"], segment_rows[0]
frame_rows = [r.split(",") for r in rows[1:]]
assert len(segment_rows) - 1 == len(p_seg), (len(segment_rows), len(p_seg))
position = 0
for (index, phase, first, last, first_s, last_s, count, confidence), (label, start, end) in zip(
        segment_rows[1:], p_seg):
    assert phase == label and int(count) == end - start == int(count), (phase, label)
    assert first == frame_rows[start][0] and last == frame_rows[end - 1][0]
    assert first_s == frame_rows[start][1] and last_s == frame_rows[end - 1][1]
    mean = sum(float(r[3]) for r in frame_rows[start:end]) / (end - start)
    assert abs(float(confidence) - mean) < 2e-4, (confidence, mean)
    assert start == position
    position = end
assert position == len(frame_rows)
# predict --timeline and eval --predictions' NAME.png: PNG pictures one column per frame, one
# ribbon (24 pixels) per row: the prediction, or the labels 4 pixels above it.
import struct
for path, rows in (("timeline.png", 1), ("preds/video05.png", 2)):
    head = open(path, "rb").read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    assert struct.unpack(">II", head[16:24]) == (len(frame_rows), 24 * rows + 4 * (rows - 1)), path
# eval --predictions: the test video's frames as predict gives them, with their labels.
evaluated = [r.split(",") for r in open("preds/video05.csv").read().strip().split("\n")]
assert evaluated[0] == ["frame", "time_seconds", "phase", "confidence", "truth"], evaluated[0]
assert [r[:4] for r in evaluated[1:]] == frame_rows
assert [r[4] for r in evaluated[1:]] == truth
# The confusion matrix counts those frames by (truth, prediction).
phases = ["Preparation", "Dissection", "Irrigation", "Suturing", "Inspection"]
counts = [[0] * 5 for _ in phases]
for r in evaluated[1:]:
    counts[phases.index(r[4])][phases.index(r[2])] += 1
assert metrics["confusion"] == counts, (metrics["confusion"], counts)
# eval --relaxed general: the evaluation script's relaxed accuracy of the test video, computed
# here as its MATLAB does (the early-transition mask of a segment's last t frames indexes its
# first t), with 10 s = 125 frames at the sampled 12.5 fps.
def relaxed_accuracy(pred, true, boundary):
    diff = [p - t for p, t in zip(pred, true)]
    start = 0
    while start < len(true):
        end = start
        while end < len(true) and true[end] == true[start]:
            end += 1
        cur, t = diff[start:end], min(boundary, end - start)
        cur = [0 if k < t and d == -1 else d for k, d in enumerate(cur)]
        mask = [cur[len(cur) - t + k] == 1 for k in range(t)]
        diff[start:end] = [0 if k < t and mask[k] else d for k, d in enumerate(cur)]
        start = end
    return sum(d == 0 for d in diff) / len(diff)
relaxed = metrics["relaxed"]
assert relaxed["rules"] == "general" and relaxed["videos"] == 1, relaxed
expected = relaxed_accuracy([phases.index(p) for p in predicted], [phases.index(t) for t in truth], 125)
assert abs(relaxed["per_video"][0]["accuracy"] - expected) < 1e-12, (relaxed["per_video"], expected)
assert relaxed["accuracy_mean"] == relaxed["per_video"][0]["accuracy"] >= metrics["accuracy"]
# The exported encoder loads into torchvision's ResNet-18 (GroupNorm, no classifier) strictly.
state = torch.load("weights.pt")
encoder = {k[len("encoder."):]: v for k, v in state.items() if k.startswith("encoder.")}
model = torchvision.models.resnet18(norm_layer=lambda c: torch.nn.GroupNorm(8, c))
model.fc = torch.nn.Identity()
model.load_state_dict(encoder, strict=True)
assert any(k.startswith("head.") for k in state)
torch.manual_seed(0)
torch.save(torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8), "frames.pt")
print("train/eval/predict/export: ok, test accuracy", metrics["accuracy"])
PY
# The export starts an encoder again: extract finds its weights under "encoder." and gives
# torchvision's features of the same frames.
"$framefit" extract --model resnet18 --norm group_norm --groups 8 --weights weights.pt \
  --input frames.pt --output features.pt 2> extract.err
grep -q 'weights taken from the keys under "encoder."' extract.err || { cat extract.err; fail "prefix"; }
"$python" - <<'PY'
import torch, torchvision
state = torch.load("weights.pt")
model = torchvision.models.resnet18(norm_layer=lambda c: torch.nn.GroupNorm(8, c))
model.fc = torch.nn.Identity()
model.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("encoder.")})
frames = torch.load("frames.pt").float() / 255
mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
with torch.no_grad():
    expected = model.eval()((frames - mean) / std)
got = torch.load("features.pt")
assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
print("export -> extract: torchvision's features")
PY

# Bad input: each error names what is wrong.
expect_error "unknown key \`train.lrr\`" "$framefit" train --config tiny.yaml --set train.lrr=1
expect_error "train.lr: expected a number" "$framefit" train --config tiny.yaml --set train.lr=fast
printf 'train:\n  epochs: [1\n' > broken.yaml
expect_error "broken.yaml: not valid YAML" "$framefit" train --config broken.yaml
expect_error "already holds checkpoints" "$framefit" train --config tiny.yaml
expect_error "nowhere.csv" "$framefit" train --config tiny.yaml --set data.manifest=nowhere.csv \
  --set train.out_dir=run2
# A label file one frame short, and a truncated video: fail by default, skipped with on_error.
mkdir -p bad && cp demo/labels/video01.txt bad/short.txt && sed -i '$d' bad/short.txt
head -c 3000 demo/videos/video02.mp4 > bad/truncated.mp4
{ echo "name,video,labels,split"
  echo "short,demo/videos/video01.mp4,bad/short.txt,train"
  echo "truncated,bad/truncated.mp4,demo/labels/video02.txt,train"
  echo "good,demo/videos/video03.mp4,demo/labels/video03.txt,train"; } > bad.csv
sed -i 's#demo/#../demo/#g; s#bad/#../bad/#g' bad.csv && mkdir -p m && mv bad.csv m/bad.csv
expect_error "short.txt has" "$framefit" train --config tiny.yaml --set data.manifest=m/bad.csv \
  --set train.out_dir=run3
"$framefit" train --config tiny.yaml --set data.manifest=m/bad.csv --set data.on_error=skip \
  --set train.out_dir=run4 --set train.validate=false --json > skip.json 2> skip.err
grep -q "warning: skipping video short" skip.err || { cat skip.err; fail "no warning for short"; }
grep -q "truncated" skip.err || { cat skip.err; fail "no warning for the truncated video"; }
"$python" -c "import json; r = json.load(open('skip.json')); assert r['skipped_videos'] == 2, r"
echo "bad input: ok"
# A config.yaml that says what the run ran is kept as it is, comments included: the finished run
# resumed with its own config.yaml, a comment added (train rewrote the file without it).
{ echo "# my notes"; cat run/config.yaml; } > notes.yaml && cp notes.yaml run/config.yaml
"$framefit" train --config run/config.yaml --resume auto > again.txt 2>&1 ||
  { cat again.txt; fail "resume with the run's own config.yaml"; }
cmp -s notes.yaml run/config.yaml || fail "train rewrote a config.yaml that says the same"
"$framefit" train --config run/config.yaml --resume auto --set train.lr=0.002 > again.txt 2>&1 ||
  { cat again.txt; fail "resume with a changed rate"; }
grep -q "lr: 0.002" run/config.yaml && ! grep -q "# my notes" run/config.yaml ||
  fail "a changed config was not written"
