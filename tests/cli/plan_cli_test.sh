#!/usr/bin/env bash
# framefit plan, doctor, bench-memory and bench-step --chunk auto end to end on a tiny model.
#   plan_cli_test.sh FRAMEFIT PYTHON WORKDIR
set -euo pipefail
framefit=$1 python=$2 work=$3
rm -rf "$work" && mkdir -p "$work" && cd "$work"
export FRAMEFIT_CACHE_DIR="$work/cache"
# Small frames and a light head and optimizer, so activations matter against the parameters.
shape=(--model resnet18 --head linear --optimizer sgd --norm group_norm --groups 8)
model=("${shape[@]}" --size 64)

# Plan with plenty of memory: fits; JSON has the documented fields; the calibration is cached.
"$framefit" plan "${model[@]}" --frames 128 --budget 4GiB --json > plan.json
test -s cache/calibration.json
# A BatchNorm encoder: the planner calibrates its blocks with BatchNorm recomputed too, and with
# room for any chunk keeps the plain ones.
"$framefit" plan --model resnet18 --head linear --optimizer sgd --norm bn --size 64 --frames 128 \
  --budget 4GiB --json > bn.json
grep -q "norm-recomputed" cache/calibration.json
# Does not fit: exit code 2, the minimum and how to get there.
if "$framefit" plan "${model[@]}" --frames 128 --budget 230MiB --chunk 0 --json > small.json; then
  echo "a naive plan fitted 230 MiB"; exit 1
else
  [ $? -eq 2 ] || { echo "expected exit code 2"; exit 1; }
fi
"$framefit" plan "${model[@]}" --frames 128 --budget 4GiB --table --json > table.json
# Below the static minimum the JSON answer has a plan's keys: it does not fit, and the findings.
if "$framefit" plan "${model[@]}" --frames 128 --budget 8MiB --json > static.json; then
  echo "a plan fitted 8 MiB"; exit 1
fi
"$python" -c "
import json, sys
d = json.load(open('static.json'))
assert d['fits'] is False and d['ok'] is False and d['budget_bytes'] == 8 << 20, d
assert any(f['severity'] == 'error' for f in d['findings']), d"
"$python" -c "
import json
d = json.load(open('plan.json'))
assert d['ok'] is True and isinstance(d['findings'], list), d
b = d['breakdown']
assert 0 <= b['gradient_sums'] <= b['gradients'], b"
# A budget beyond the machine is planned for, with a warning (none for one within it).
"$framefit" plan "${model[@]}" --frames 128 --budget 1024TiB --json > big.json 2> big.txt
grep -q "warning: --budget 1024.00 TiB is more than the system's available memory" big.txt ||
  { cat big.txt; exit 1; }
"$framefit" plan "${model[@]}" --frames 128 --budget 4GiB --json 2> within.txt > /dev/null
if grep -q "warning: --budget" within.txt; then cat within.txt; exit 1; fi
"$framefit" bench-memory "${model[@]}" --frames 48 --chunks 8,0 --json > bench.json
# A budget between chunked and naive: bench-step --chunk auto plans for it and stays inside.
"$framefit" bench-step "${model[@]}" --frames 128 --chunk auto --budget 300MiB --json > step.json
# A forced naive step in that budget finishes by re-planning.
"$framefit" bench-step "${model[@]}" --frames 128 --chunk 0 --budget 300MiB --json > forced.json
"$python" - <<'PY'
import json
plan = json.load(open("plan.json"))
for key in ("fits", "predicted_peak_bytes", "chunk", "breakdown", "predicted_step_seconds"):
    assert key in plan, key
assert plan["fits"] and plan["predicted_peak_bytes"] > 0
assert plan["recompute_norm"] is False, plan  # group_norm: nothing to recompute
bn = json.load(open("bn.json"))
assert bn["fits"] and bn["recompute_norm"] is False, bn
b = plan["breakdown"]
assert sum(b[k] for k in ("parameters", "gradients", "optimizer_state", "input_frames", "features",
                          "activations", "workspace")) == plan["predicted_peak_bytes"], b
small = json.load(open("small.json"))
assert not small["fits"] and small["minimum_budget_bytes"] > 230 * 2**20, small
assert small["advice"], small
table = json.load(open("table.json"))["rows"]
assert len(table) > 5 and any(r["chunk"] == 0 for r in table)
bench = json.load(open("bench.json"))["rows"]
for r in bench:
    assert r["peak_bytes"] > 0, r
    assert abs(r["relative_error"]) <= 0.05, f"memory model off by more than 5%: {r}"
step = json.load(open("step.json"))
assert step["peak_bytes"] <= 300 * 2**20 and step["chunk"] > 0, step
assert step["recompute_norm"] is False and step["keep"] >= 0, step
assert any("planned for" in note for note in step["retries"]), step["retries"]
forced = json.load(open("forced.json"))
assert forced["peak_bytes"] <= 300 * 2**20 and forced["chunk"] > 0, forced
assert any("re-planned" in r or "retrying" in r for r in forced["retries"]), forced["retries"]
print("plan/bench-memory/bench-step auto: ok; model error",
      ", ".join(f"{100 * r['relative_error']:+.2f}%" for r in bench))
PY
# The doctor: errors exit 1 and name the fix; a sound configuration exits 0.
if "$framefit" doctor "${shape[@]}" --frames 64 --size 16 --budget 4GiB > doctor.txt; then
  echo "doctor accepted 16x16 frames for resnet18"; exit 1
fi
grep -q "too small" doctor.txt
grep -q "fix:" doctor.txt
"$framefit" doctor "${model[@]}" --frames 64 --budget 4GiB
echo "doctor: ok"
