#!/usr/bin/env bash
# framefit bench-layers end to end on tiny networks: checkpointing lets a larger batch fit the
# same budget, the planner's batch is close to the largest that runs, every-stage recompute runs.
#   layers_cli_test.sh FRAMEFIT PYTHON
set -euo pipefail
framefit=$1 python=$2
unet=(--net unet --input 3,32,32 --width 8 --depth 2 --classes 3 --batch 0 --budget 48MiB
      --repeat 1 --threads 1 --json)
"$framefit" bench-layers "${unet[@]}" --checkpoint off > off.json
"$framefit" bench-layers "${unet[@]}" --checkpoint auto > auto.json
"$framefit" bench-layers --net clip3d --input 3,4,16,16 --batch 2 --checkpoint all --repeat 1 \
  --threads 1 --json > all.json
"$python" - <<'PY'
import json
off, auto, every = (json.load(open(f)) for f in ("off.json", "auto.json", "all.json"))
budget = 48 * 2**20
for r in (off, auto):
    assert r["fits"] and r["largest_batch"] >= 1, r
    assert r["peak_bytes"] <= budget, r
    # The planner's batch is within a quarter of the largest batch that ran.
    assert abs(r["planned_batch"] - r["largest_batch"]) <= max(1, r["largest_batch"] // 4), r
assert auto["largest_batch"] > off["largest_batch"] * 3 // 2, (auto["largest_batch"], off["largest_batch"])
assert auto["recomputed"], auto
assert every["fits"] and sum(e - s for s, e in every["recomputed"]) == every["stages"], every
print(f"bench-layers: largest batch {off['largest_batch']} -> {auto['largest_batch']} with checkpointing")
PY
# A fixed batch no plan fits runs its least-memory plan, says so and exits 2 (not 3: the
# out-of-memory error comes out of autograd's backward).
status=0
"$framefit" bench-layers --net unet --input 3,32,32 --width 8 --depth 2 --classes 3 --batch 240 \
  --budget 40MiB --checkpoint auto --repeat 1 --threads 1 --json > tight.json || status=$?
[ "$status" = 2 ] || { echo "bench-layers over its budget exited $status, not 2"; exit 1; }
"$python" - <<'PY'
import json
r = json.load(open("tight.json"))
assert not r["plan_fits"] and not r["fits"] and "out of memory" in r["error"], r
assert r["predicted_peak_bytes"] > r["plan_budget_bytes"] == r["budget_bytes"], r
PY
# Bad input is named.
if "$framefit" bench-layers --net unet --input 3,30,30 --depth 2 --batch 1 2> err.txt; then
  echo "a 30x30 UNet input was accepted"; exit 1
fi
grep -q "multiple" err.txt || { cat err.txt; exit 1; }
echo "bench-layers CLI: ok"
