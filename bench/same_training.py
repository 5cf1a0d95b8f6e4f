#!/usr/bin/env python3
"""Does a change keep training bit-identical, and as fast? Runs one or two framefit builds on the
same jobs, with fixed plans and one calibration cache, and compares what they train: every
step's loss (exactly) and the exported weights (SHA-256), and the steps' time (median of
alternating repeats, as a ratio).

    bench/same_training.py --framefit BEFORE [--framefit AFTER] [--repeats 3]
                           [--out bench/results/same_training.json]

A build is a framefit binary; its libframefit.so is looked for beside it first (a copy of a
build: cp build/src/cli/framefit build/libframefit.so /tmp/before/), else where it was built.
The jobs: the main job (configs/demo.yaml, one epoch, chunk 32, keep 1, fp32), clip
classification (configs/demo_clips.yaml, one epoch, batch 8) and segmentation
(configs/demo_segmentation.yaml, two epochs, batch 4), on demo/ (scripts/demo.sh writes it).
Prints the machine and, per job and build, the losses' digest and the steps' time.
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from main_job_peaks import ROOT, cpu_flags  # noqa: E402

JOBS = {
    "phases": ("configs/demo.yaml", ["train.epochs=1", "train.chunk=32", "train.keep=1",
                                     "train.precision=fp32"]),
    "clips": ("configs/demo_clips.yaml", ["train.epochs=1", "train.batch=8"]),
    "segmentation": ("configs/demo_segmentation.yaml", ["train.epochs=2", "train.batch=4"]),
}


def run(framefit, args, env):
    lib_dir = os.path.dirname(os.path.abspath(framefit))
    env = dict(env)
    if os.path.exists(os.path.join(lib_dir, "libframefit.so")):
        env["LD_LIBRARY_PATH"] = lib_dir + ":" + env.get("LD_LIBRARY_PATH", "")
    done = subprocess.run([framefit] + args, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{framefit} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stderr


def train(framefit, job, cache, threads):
    config, overrides = JOBS[job]
    out_dir = tempfile.mkdtemp(prefix=f"framefit_same_{job}_")
    args = ["train", "--config", config, "--threads", str(threads),
            "--set", f"train.out_dir={out_dir}"]
    for s in overrides:
        args += ["--set", s]
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    run(framefit, args, env)
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r["type"] == "step"]
    weights = os.path.join(out_dir, "weights.pt")
    run(framefit, ["export", "--checkpoint", os.path.join(out_dir, "best.pt"), "--out", weights],
        env)
    with open(weights, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    shutil.rmtree(out_dir)
    return {"losses": [s["loss"] for s in steps], "weights_sha256": digest,
            "step_seconds": sum(s["seconds"] for s in steps)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framefit", action="append", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--out")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(ROOT, "demo", "manifest.csv")):
        sys.exit("no demo/manifest.csv: run scripts/demo.sh (or framefit make-demo) first")
    model, flags = cpu_flags()
    print(f"cpu: {model}; flags: {flags}; threads {args.threads}; repeats {args.repeats}")
    cache = tempfile.mkdtemp(prefix="framefit_same_cache_")  # one calibration for every build
    result = {"cpu": model, "flags": flags, "builds": args.framefit, "jobs": {}}
    identical = True
    for job in args.jobs.split(","):
        runs = {b: [] for b in args.framefit}
        for _ in range(args.repeats):
            for build in args.framefit:  # alternating, so that noise falls on both
                runs[build].append(train(build, job, cache, args.threads))
        first = runs[args.framefit[0]][0]
        entry = {}
        for build in args.framefit:
            same = all(r["losses"] == first["losses"] and
                       r["weights_sha256"] == first["weights_sha256"] for r in runs[build])
            identical &= same
            seconds = statistics.median(r["step_seconds"] for r in runs[build])
            entry[build] = {"losses": runs[build][0]["losses"],
                            "weights_sha256": runs[build][0]["weights_sha256"],
                            "identical_to_first": same,
                            "step_seconds": [r["step_seconds"] for r in runs[build]],
                            "median_step_seconds": seconds}
            print(f"{job:13s} {build}: {len(first['losses'])} steps, last loss "
                  f"{runs[build][0]['losses'][-1]!r}, weights {runs[build][0]['weights_sha256'][:16]}"
                  f"{'' if same else ' DIFFERENT'}, steps {seconds:.2f} s (median)")
        if len(args.framefit) == 2:
            a, b = (entry[x]["median_step_seconds"] for x in args.framefit)
            entry["time_ratio"] = b / a
            print(f"{job:13s} second / first build's steps' time: {b / a:.3f}x")
        result["jobs"][job] = entry
    shutil.rmtree(cache)
    result["identical"] = identical
    print("bit-identical training" if identical else "TRAINING DIFFERS between runs or builds")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(0 if identical else 1)


if __name__ == "__main__":
    main()
