"""How well framefit's memory model predicts, and what the largest-chunk finder saves.

  /usr/bin/python3 bench/memory_bench.py           # the grid (14 configurations) and the finder
  /usr/bin/python3 bench/memory_bench.py --quick   # 4 configurations

1. Accuracy: for each configuration (models, sizes, lengths, heads, precisions, frozen stages,
   norms), `framefit bench-memory` calibrates from scratch (a fresh cache: the calibration time
   is reported), then runs real training steps (one warm-up, one measured) at each chunk size and
   prints the predicted and the measured (tracking allocator) peak side by side.
2. Largest chunk under a budget: `framefit plan --find` (model choice, confirmed by real steps)
   against doubling the chunk until out-of-memory (`bench-step --no-retry`, one process per
   trial, as users do it). Both report trials and wall time.

Writes bench/results/memory_model.{md,json}.
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEFIT = os.path.join(ROOT, "build", "src", "cli", "framefit")
OUT = os.path.join(ROOT, "bench", "results")

# (model, head, size, frames, precision, extra flags, chunks)
GRID = [
    ("resnet18", "lstm", 112, 256, "fp32", [], "8,32,0"),
    ("resnet18", "lstm", 112, 256, "bf16", [], "8,32,0"),
    ("resnet18", "tcn", 112, 512, "fp32", [], "16,64"),
    ("resnet18", "linear", 64, 512, "fp32", ["--norm", "group_norm"], "32,0"),
    ("resnet34", "lstm", 112, 128, "fp32", [], "16,0"),
    ("resnet34", "lstm", 112, 128, "bf16", ["--freeze", "layer1"], "16"),
    ("resnet50", "lstm", 112, 64, "fp32", [], "8,16"),
    ("resnet50", "tcn", 112, 64, "fp32", ["--freeze", "layer2"], "8"),
    ("resnet50", "tcn", 112, 64, "fp32", ["--freeze", "layer2", "--cache-frozen", "--keep", "2"], "8"),
    ("resnet50", "lstm", 112, 64, "bf16", [], "16"),
    ("resnet50", "lstm", 224, 32, "fp32", [], "8"),
    ("resnet18", "lstm", 224, 64, "fp32", ["--norm", "frozen_bn"], "8,0"),
    ("resnet50", "lstm", 224, 32, "bf16", ["--freeze", "layer1"], "8"),
    ("resnet18", "lstm", 112, 256, "fp32", ["--drop-layer4", "--layout", "channels_last"], "32"),
    ("resnet18", "lstm", 160, 1024, "fp32", [], "64"),
]
QUICK = [0, 1, 7, 11]


def machine():
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"]
    flags = ""
    model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags") and not flags:
                flags = " ".join(w for w in wanted if f" {w}" in line)
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
    return f"{model}; {os.cpu_count()} cores; threads 2; flags: {flags}; {platform.platform()}"


def run_json(cmd, env):
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if p.returncode not in (0, 2, 3):
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {}
    out["wall_seconds"] = wall
    out["returncode"] = p.returncode
    return out


def accuracy(configs):
    rows = []
    for model, head, size, frames, precision, extra, chunks in configs:
        cache = tempfile.mkdtemp(prefix="framefit-cal-")
        env = dict(os.environ, FRAMEFIT_CACHE_DIR=cache)
        base = [FRAMEFIT, "bench-memory", "--model", model, "--head", head, "--size", str(size),
                "--frames", str(frames), "--precision", precision, "--threads", "2"] + extra
        # Calibration alone first (no chunks to measure), so its time is separate.
        t0 = time.time()
        subprocess.run([FRAMEFIT, "plan", "--model", model, "--head", head, "--size", str(size),
                        "--frames", str(frames), "--precision", precision, "--threads", "2", "--json"]
                       + [a for a in extra if a not in ("--cache-frozen",)]
                       + (["--cache-frozen", "on"] if "--cache-frozen" in extra else []),
                       capture_output=True, text=True, env=env)
        calibration = time.time() - t0
        out = run_json(base + ["--chunks", chunks, "--json"], env)
        shutil.rmtree(cache, ignore_errors=True)
        for r in out["rows"]:
            r.update(model=model, head=head, size=size, frames=frames, precision=precision,
                     extra=" ".join(extra), calibration_seconds=calibration)
            rows.append(r)
            print(f"{model} {head} {size}px T={frames} {precision} {' '.join(extra)} chunk {r['chunk']}: "
                  f"predicted {r['predicted_peak_bytes']/2**20:.1f} MiB, measured {r['peak_bytes']/2**20:.1f} MiB "
                  f"({100*r['relative_error']:+.2f}%), calibration {calibration:.0f} s", flush=True)
    return rows


def finder(budget="600MiB"):
    common = ["--model", "resnet18", "--head", "lstm", "--size", "112", "--frames", "256",
              "--threads", "2", "--budget", budget]
    cache = tempfile.mkdtemp(prefix="framefit-cal-")
    env = dict(os.environ, FRAMEFIT_CACHE_DIR=cache)
    t0 = time.time()
    found = run_json([FRAMEFIT, "plan", "--find", "--keep", "1", "--json"] + common, env)
    model_seconds = time.time() - t0
    shutil.rmtree(cache, ignore_errors=True)
    doubling = []
    t0 = time.time()
    chunk = 1
    while chunk <= 256:
        r = run_json([FRAMEFIT, "bench-step", "--chunk", str(chunk), "--keep", "1", "--no-retry",
                      "--json"] + common, env)
        ok = r["returncode"] == 0
        doubling.append({"chunk": chunk, "ok": ok, "peak_bytes": r.get("peak_bytes"),
                         "wall_seconds": r["wall_seconds"]})
        print(f"doubling: chunk {chunk}: {'fits' if ok else 'out of memory'}", flush=True)
        if not ok:
            break
        chunk *= 2
    doubling_seconds = time.time() - t0
    last_ok = max((d["chunk"] for d in doubling if d["ok"]), default=0)
    return {"budget": budget, "model": found.get("largest_chunk", {}), "model_seconds": model_seconds,
            "doubling": doubling, "doubling_seconds": doubling_seconds, "doubling_chunk": last_ok}


def write(rows, find, quick):
    os.makedirs(OUT, exist_ok=True)
    errors = [abs(r["relative_error"]) for r in rows if r["peak_bytes"] > 0]
    lines = ["# Memory model: predicted vs measured peak", "",
             f"Machine: {machine()}  ",
             f"Run: `/usr/bin/python3 bench/memory_bench.py{' --quick' if quick else ''}` "
             f"({len(rows)} measurements, {len({(r['model'], r['head'], r['size'], r['frames'], r['precision'], r['extra']) for r in rows})} configurations)", "",
             "Peak = tracked tensor bytes of one training step after a warm-up step (AdamW, keep 1 unless "
             "stated; chunk 0 = naive). Predicted by `framefit plan`'s model after calibrating from "
             "scratch (the calibration column: probe time, once per configuration and machine). "
             "Error = (predicted - measured) / measured.", "",
             "| model | head | size | T | precision | flags | chunk | predicted | measured | error | peak RSS | calibration s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['head']} | {r['size']} | {r['frames']} | {r['precision']} | {r['extra']} | "
                     f"{r['chunk'] or 'naive'} | {r['predicted_peak_bytes']/2**20:.1f} MiB | {r['peak_bytes']/2**20:.1f} MiB | "
                     f"{100*r['relative_error']:+.2f}% | {r['rss_peak_bytes']/2**20:.0f} MiB | {r['calibration_seconds']:.0f} |")
    lines += ["", f"Largest |error|: **{100*max(errors):.2f}%**; median {100*sorted(errors)[len(errors)//2]:.2f}% "
              f"(target: at most 5% on every configuration).", ""]
    if find:
        m = find["model"]
        lines += ["## Largest chunk within a budget", "",
                  f"ResNet-18 + LSTM, 256 frames of 112x112, keep 1, budget {find['budget']}, 10% headroom.", "",
                  "| method | chunk found | trial steps | wall time |", "|---|---|---|---|",
                  f"| framefit plan --find (model + confirmation) | {m.get('chunk')} | {m.get('trials')} | {find['model_seconds']:.0f} s (incl. calibration) |",
                  f"| doubling until out-of-memory | {find['doubling_chunk']} | {len(find['doubling'])} | {find['doubling_seconds']:.0f} s |",
                  "", "Finder log: " + "; ".join(m.get("log", [])), ""]
    with open(os.path.join(OUT, "memory_model.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(OUT, "memory_model.json"), "w") as f:
        json.dump({"machine": machine(), "rows": rows, "finder": find}, f, indent=1)
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-finder", action="store_true")
    args = parser.parse_args()
    configs = [GRID[i] for i in QUICK] if args.quick else GRID
    rows = accuracy(configs)
    find = None if args.no_finder else finder()
    write(rows, find, args.quick)


if __name__ == "__main__":
    main()
