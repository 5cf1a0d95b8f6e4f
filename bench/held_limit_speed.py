#!/usr/bin/env python3
"""What holding the allocator's cache within the budget costs in step time: the same plan run with
train.budget_covers process (tensors and cache held within the tensors' share of train.budget)
and with train.budget_covers tensors at that same share (the cache may hold twice it), in
alternating rounds, each its own process, the medians compared.

    bench/held_limit_speed.py [--config configs/demo.yaml] [--set key=value ...] [--rounds 3]
                              [--caps] [--out FILE.json]

Prints the machine (CPU flags, caps), both plans (which must be the same), per round the steps'
summed seconds and resident peak, and the ratio of the medians.
"""
import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from main_job_peaks import ROOT, cpu_flags, kernel_env, parse_bytes, train  # noqa: E402


def run(config, overrides, env):
    stderr, records = train(config, overrides, env)
    plan = re.search(r"plan: (.*?), predicted peak", stderr).group(1)
    runtime = re.search(r"less the runtime's ([\d.,]+) (\w+)", stderr)
    steps = [r for r in records if r["type"] == "step"]
    return {
        "plan": plan,
        "runtime_bytes": parse_bytes(runtime.group(1), runtime.group(2)) if runtime else 0,
        "step_seconds": sum(s["seconds"] for s in steps),
        "rss_peak_bytes": max(r.get("rss_peak_bytes", 0) for r in records),
        "held_peak_bytes": max(s["held_bytes"] for s in steps),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.yaml"))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--caps", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    env = kernel_env(args.caps)
    budget = re.search(r"budget: ([\d.]+\w+)", open(args.config).read()).group(1)
    for s in args.set:
        if s.startswith("train.budget="):
            budget = s.split("=", 1)[1]
    units = re.match(r"([\d.]+)(\w+)", budget)
    total = parse_bytes(units.group(1), units.group(2))
    within, twice = [], []
    for _ in range(args.rounds):
        process = run(args.config, args.set + ["train.budget_covers=process"], env)
        share = int(total - process["runtime_bytes"])
        tensors = run(args.config, args.set + ["train.budget_covers=tensors",
                                               f"train.budget={share}"], env)
        if process["plan"] != tensors["plan"]:
            sys.exit(f"the plans differ: {process['plan']} / {tensors['plan']}")
        within.append(process)
        twice.append(tensors)
    model, flags = cpu_flags()
    caps = "aten=avx2 onednn=AVX2" if args.caps else "none"
    print(f"cpu: {model}; flags: {flags}; kernels capped: {caps}")
    print(f"config {os.path.relpath(args.config, ROOT)} {' '.join(args.set)}; plan: {within[0]['plan']}")
    for i, (a, b) in enumerate(zip(within, twice)):
        print(f"  round {i + 1}: held within the budget {a['step_seconds']:6.2f} s (resident peak "
              f"{a['rss_peak_bytes'] / 2**20:.0f} MiB, held {a['held_peak_bytes'] / 2**20:.0f} MiB); "
              f"twice it {b['step_seconds']:6.2f} s ({b['rss_peak_bytes'] / 2**20:.0f} MiB, "
              f"{b['held_peak_bytes'] / 2**20:.0f} MiB)")
    a = statistics.median(r["step_seconds"] for r in within)
    b = statistics.median(r["step_seconds"] for r in twice)
    print(f"median steps' time: within {a:.2f} s, twice {b:.2f} s: {a / b:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": model, "flags": flags, "kernel_caps": caps,
                       "config": os.path.relpath(args.config, ROOT), "overrides": args.set,
                       "within": within, "twice": twice, "ratio_of_medians": a / b}, f, indent=1)


if __name__ == "__main__":
    main()
