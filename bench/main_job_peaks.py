#!/usr/bin/env python3
"""The main job's memory promise, checked step by step: runs `framefit train` on a config (by
default configs/demo.yaml, the README's first command) and compares every step's tracked peak in
log.jsonl with the prediction the plan line printed, and the process's resident peak (VmHWM from
the first step on, validation included) with train.budget and the plan's expected RSS.

    bench/main_job_peaks.py [--config configs/demo.yaml] [--set key=value ...] [--caps]
                            [--out bench/results/main_job_peaks.json]

--caps runs with ATen's and oneDNN's kernels capped at AVX2 (an AVX2-only CPU's kernels).
Prints the machine (CPU flags, caps), the plan, and per step: frames, peak, peak / predicted.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEFIT = os.path.join(ROOT, "build", "src", "cli", "framefit")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_bytes(number, unit):
    return float(number.replace(",", "")) * UNITS[unit]


def cpu_flags():
    wanted = {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}
    model, flags = "unknown", []
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = [w for w in line.split(":", 1)[1].split() if w in wanted]
    return model, " ".join(flags)


def kernel_env(caps):
    """The environment to run framefit in: with caps, ATen's and oneDNN's kernels at AVX2."""
    env = dict(os.environ)
    if caps:
        env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    return env


def train(config, overrides, env):
    """Runs `framefit train` on config with --set overrides into a fresh folder; returns its
    stderr (the plan line) and log.jsonl's records."""
    out_dir = tempfile.mkdtemp(prefix="framefit_bench_train_")
    command = [FRAMEFIT, "train", "--config", config, "--set", f"train.out_dir={out_dir}"]
    for s in overrides:
        command += ["--set", s]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"framefit train failed ({run.returncode}):\n{run.stderr[-3000:]}")
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return run.stderr, [json.loads(line) for line in f]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.yaml"))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--caps", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    stderr, records = train(args.config, args.set, kernel_env(args.caps))
    plan = re.search(r"plan: (.*?), predicted peak ([\d.,]+) (\w+) of ([\d.,]+) (\w+)", stderr)
    budget = re.search(r"budget: ([\d.]+)(\w+)", open(args.config).read())
    predicted = parse_bytes(plan.group(2), plan.group(3))
    step_budget = parse_bytes(plan.group(4), plan.group(5))
    steps = [s for s in records if s.get("type") == "step"]
    rss_peak = max(r.get("rss_peak_bytes", 0) for r in records)
    expected = re.search(r"expected RSS about ([\d.,]+) (\w+)", stderr)
    expected_rss = parse_bytes(expected.group(1), expected.group(2)) if expected else None
    peaks = [s["peak_bytes"] for s in steps]
    ratios = [p / predicted for p in peaks]
    model, flags = cpu_flags()
    caps = "aten=avx2 onednn=AVX2" if args.caps else "none"
    result = {
        "cpu": model, "flags": flags, "kernel_caps": caps, "config": os.path.relpath(args.config, ROOT),
        "overrides": args.set, "plan": plan.group(1), "predicted_peak_bytes": predicted,
        "step_budget_bytes": step_budget, "steps": len(steps),
        "frames": [s["frames"] for s in steps], "peak_bytes": peaks,
        "rss_bytes": [s["rss_bytes"] for s in steps], "rss_peak_bytes": rss_peak,
        "expected_rss_bytes": expected_rss,
        "held_bytes": [s.get("held_bytes") for s in steps],
        "pipeline_bytes": [s.get("pipeline_bytes") for s in steps],
        "step_seconds": sum(s["seconds"] for s in steps),
        "largest_ratio": max(ratios), "steps_above_5_percent": sum(r > 1.05 for r in ratios),
        "steps_above_step_budget": sum(p > step_budget for p in peaks),
    }
    print(f"cpu: {model}; flags: {flags}; kernels capped: {caps}")
    print(f"plan: {plan.group(1)}, predicted peak {predicted / 2**20:.2f} MiB of "
          f"{step_budget / 2**20:.2f} MiB")
    for s, r in zip(steps, ratios):
        print(f"  step {s['step']:3d}: {s['frames']:5d} frames, peak {s['peak_bytes'] / 2**20:8.2f} MiB"
              f" ({r:.3f}x predicted), rss {s['rss_bytes'] / 2**30:.2f} GiB")
    print(f"largest peak {max(peaks) / 2**20:.2f} MiB = {max(ratios):.3f}x predicted; "
          f"{result['steps_above_5_percent']} of {len(steps)} steps above +5%, "
          f"{result['steps_above_step_budget']} above the step budget; resident peak "
          f"{rss_peak / 2**20:.1f} MiB"
          + (f" (expected about {expected_rss / 2**20:.1f} MiB)" if expected_rss else "")
          + (f" against train.budget {budget.group(1)}{budget.group(2)}" if budget else "")
          + f"; steps took {result['step_seconds']:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
