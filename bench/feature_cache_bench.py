"""The frozen encoder's feature cache (train.cache_features), measured on the demo data.

  /usr/bin/python3 bench/feature_cache_bench.py [--rounds 3]

configs/demo.yaml (ResNet-18 + LSTM, 64x64, 1 GiB) with the encoder frozen whole
(model.freeze=layer4) and data.augment=false, trained with train.cache_features auto and off,
interleaved, for 1 and for 3 epochs: (3-epoch time - 1-epoch time) / 2 is the wall time of a
later epoch (steps, decoding and validation), the median over rounds; the 1-epoch time includes
start-up and the first epoch, which computes the features in both settings. Also the summed step
time (compute only, from log.jsonl) of the later epochs, and the final weights' equality.
Needs the demo data (scripts/demo.sh or framefit make-demo --out demo).

Writes bench/results/feature_cache.{md,json}.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tasks_bench import FRAMEFIT, OUT, ROOT, machine  # noqa: E402

WORK = "/tmp/framefit_feature_cache_bench"


def run(cache, epochs):
    out_dir = os.path.join(WORK, f"{cache}_{epochs}")
    subprocess.run(["rm", "-rf", out_dir], check=True)
    args = [FRAMEFIT, "train", "--config", "configs/demo.yaml", "--json"]
    for o in ("model.freeze=layer4", "data.augment=false", f"train.cache_features={cache}",
              f"train.epochs={epochs}", f"train.out_dir={out_dir}"):
        args += ["--set", o]
    start = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"cache {cache}, {epochs} epochs failed:\n{proc.stderr}")
    later_steps = 0.0
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record["type"] == "step" and record["epoch"] > 1:
                later_steps += record["seconds"]
    return {"seconds": seconds, "later_step_seconds": later_steps, "out_dir": out_dir}


def weights_equal(a, b):
    script = (
        "import sys, torch\n"
        "x, y = torch.load(sys.argv[1]), torch.load(sys.argv[2])\n"
        "print(all(torch.equal(x[k], y[k]) for k in x) and x.keys() == y.keys())\n")
    exported = []
    for out_dir in (a, b):
        path = os.path.join(out_dir, "weights.pt")
        subprocess.run([FRAMEFIT, "export", "--checkpoint", os.path.join(out_dir, "best.pt"),
                        "--out", path], check=True, capture_output=True)
        exported.append(path)
    proc = subprocess.run(["/usr/bin/python3", "-c", script, *exported], capture_output=True,
                          text=True, check=True)
    return proc.stdout.strip() == "True"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not os.path.exists(os.path.join(ROOT, "demo", "manifest.csv")):
        raise SystemExit("no demo data: run scripts/demo.sh or framefit make-demo --out demo")
    os.makedirs(WORK, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for cache in ("auto", "off"):
            one, three = run(cache, 1), run(cache, 3)
            row[cache] = {"one_epoch_seconds": one["seconds"],
                          "three_epoch_seconds": three["seconds"],
                          "later_epoch_seconds": (three["seconds"] - one["seconds"]) / 2,
                          "later_epoch_step_seconds": three["later_step_seconds"] / 2,
                          "out_dir": three["out_dir"]}
        row["same_weights"] = weights_equal(row["auto"]["out_dir"], row["off"]["out_dir"])
        rounds.append(row)
        print(f"round {r + 1}: later epoch {row['auto']['later_epoch_seconds']:.2f} s cached, "
              f"{row['off']['later_epoch_seconds']:.2f} s recomputed; "
              f"same weights: {row['same_weights']}", flush=True)

    def median(cache, key):
        return statistics.median(r[cache][key] for r in rounds)

    ratio = statistics.median(r["off"]["later_epoch_seconds"] / r["auto"]["later_epoch_seconds"]
                              for r in rounds)
    result = {"machine": machine(), "rounds": rounds, "later_epoch_speedup_median": ratio}
    lines = [
        "# Frozen encoder: feature cache on and off",
        "",
        f"Machine: {machine()}. `bench/feature_cache_bench.py`, {args.rounds} rounds, "
        "interleaved; medians. configs/demo.yaml (ResNet-18 + LSTM, 64x64 frames, 12 training "
        "and 3 validation videos sampled at 10 fps, 1 GiB) with `model.freeze=layer4`, "
        "`data.augment=false`.",
        "",
        "| train.cache_features | 1 epoch (start-up + first epoch) | 3 epochs | a later epoch "
        "(wall) | a later epoch (step compute) |",
        "|---|---:|---:|---:|---:|",
    ]
    for cache in ("auto", "off"):
        lines.append(f"| {cache} | {median(cache, 'one_epoch_seconds'):.1f} s | "
                     f"{median(cache, 'three_epoch_seconds'):.1f} s | "
                     f"{median(cache, 'later_epoch_seconds'):.2f} s | "
                     f"{median(cache, 'later_epoch_step_seconds'):.2f} s |")
    lines += ["",
              f"A later epoch is {ratio:.1f}x faster with the cache (median of the rounds' "
              "ratios). Final weights identical in every round: "
              f"{all(r['same_weights'] for r in rounds)}.", ""]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "feature_cache.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(OUT, "feature_cache.json"), "w") as f:
        json.dump(result, f, indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
