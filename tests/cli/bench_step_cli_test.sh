#!/usr/bin/env bash
# framefit bench-step end to end.
#   json FRAMEFIT PYTHON              tiny config: the JSON has the documented fields
#   exact FRAMEFIT PYTHON WORKDIR     float64: chunked and naive gradients written with
#                                     --export-grads agree to 1e-10 (read back by torch.load)
set -euo pipefail
mode=$1 framefit=$2 python=$3
case "$mode" in
json)
  out=$("$framefit" bench-step --model resnet18 --head tcn --frames 12 --size 32 --chunk 4 --json \
    --trace trace.json --profile profile.json)
  echo "$out"
  "$python" - "$out" <<'PY'
import json, sys
trace = json.load(open("trace.json"))["traceEvents"]
assert {e["name"] for e in trace if e["ph"] == "B"} >= {"encode", "head", "recompute"}
assert any(e["ph"] == "C" and e["args"]["bytes"] > 0 for e in trace)
# The operator profile: ResNet-18's 20 convolutions run for each of the 3 chunks, then again for
# the 2 recomputed ones (the last chunk's graph is kept).
ops = [e["name"] for e in json.load(open("profile.json")) if e.get("ph") == "X"]
assert ops.count("aten::conv2d") == 20 * (3 + 2), ops.count("aten::conv2d")
r = json.loads(sys.argv[1])
for key in ("peak_bytes", "rss_peak_bytes", "step_seconds", "frames_per_second", "phases"):
    assert key in r, key
assert r["peak_bytes"] > 0 and r["rss_peak_bytes"] >= r["peak_bytes"] / 2 and r["step_seconds"] > 0
assert r["chunk"] == 4 and set(r["phases"]) >= {"encode", "head", "recompute"}, r["phases"]
print("bench-step json: ok")
PY
  # A budget below the model's own size: a clear out-of-memory error, exit code 3.
  if "$framefit" bench-step --model resnet18 --head lstm --frames 8 --size 32 --chunk 2 \
      --budget 8MiB 2>err.txt; then
    echo "ran within an impossible budget"; exit 1
  else
    rc=$?; [ "$rc" -eq 3 ] || { cat err.txt; echo "exit code $rc, expected 3"; exit 1; }
  fi
  grep -q "out of memory" err.txt
  # Chunking cannot help there: the advice is the doctor's (raise the budget, freeze, ...).
  grep -q "Raise the budget to at least .*freeze early stages" err.txt
  if grep -q "Lower the chunk size" err.txt; then cat err.txt; exit 1; fi
  # bf16 autocast would leave a float64 model in float64: refused, not silently ignored.
  if "$framefit" bench-step --model resnet18 --head lstm --frames 8 --size 32 --chunk 2 \
      --dtype float64 --precision bf16 2>err.txt; then
    echo "ran bf16 on a float64 model"; exit 1
  fi
  # (Where bf16 cannot run at all, that is the reason given.)
  grep -q "use --precision fp32 with it\|bf16 cannot run here" err.txt
  # Settings no step can run with are refused before the planner's probes calibrate (which
  # took seconds, and said so, before the error).
  for bad in "--precision fp16" "--precision bf16 --dtype float64"; do
    # shellcheck disable=SC2086
    if "$framefit" bench-step --model resnet18 --head lstm --frames 8 --size 32 $bad \
        2>err.txt; then
      echo "ran with $bad on the CPU"; exit 1
    fi
    grep -q "error: .*\(fp16 autocast runs on CUDA only\|use --precision fp32 with it\|bf16 cannot run here\)" err.txt
    if grep -q calibrating err.txt; then cat err.txt; echo "calibrated before refusing $bad"; exit 1; fi
  done
  # --versus-naive: naive steps interleaved with the chunked ones, one pair per measured step.
  out=$("$framefit" bench-step --model resnet18 --head lstm --frames 8 --size 32 --chunk 2 \
    --steps 2 --versus-naive --json)
  "$python" - "$out" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
assert len(r["pairs"]) == 2 and all(p["chunked_seconds"] > 0 and p["naive_seconds"] > 0
                                    for p in r["pairs"]), r["pairs"]
ratios = sorted(p["chunked_seconds"] / p["naive_seconds"] for p in r["pairs"])
assert abs(r["ratio_median"] - ratios[1]) < 1e-9 and r["naive_step_seconds"] > 0, r
print("bench-step --versus-naive: ok")
PY
  if "$framefit" bench-step --model resnet18 --head lstm --frames 8 --size 32 --chunk 0 \
      --versus-naive 2>err.txt; then
    echo "compared naive training with itself"; exit 1
  fi
  grep -q "give --chunk > 0" err.txt
  ;;
exact)
  work=$4
  mkdir -p "$work"
  common=(bench-step --model resnet18 --head lstm --frames 10 --size 32 --dtype float64
          --norm frozen_bn --optimizer sgd --seed 3 --no-warmup)
  "$framefit" "${common[@]}" --chunk 0 --export-grads "$work/naive.pt" >/dev/null
  "$framefit" "${common[@]}" --chunk 3 --keep 1 --export-grads "$work/chunked.pt" >/dev/null
  "$python" - "$work/naive.pt" "$work/chunked.pt" <<'PY'
import sys, torch
naive, chunked = torch.load(sys.argv[1]), torch.load(sys.argv[2])
assert naive.keys() == chunked.keys() and "conv1.weight" in naive and "head.fc.weight" in naive
worst = max(((naive[k] - chunked[k]).abs().max() / naive[k].abs().max().clamp_min(1e-30)).item()
            for k in naive)
print(f"{len(naive)} gradients, largest relative difference {worst:.2e}")
assert worst <= 1e-10, worst
PY
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
