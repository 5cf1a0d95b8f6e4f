"""Where a chunked step's extra time goes: LibTorch's operator profile of one framefit training
step, naive and chunked, side by side (ResNet-18 + LSTM, 112x112, T = 256, chunk 32, keep 1 by
default: bench/step_bench.py's T = 256 row). Writes bench/results/step_profile.{md,json}.

  /usr/bin/python3 bench/step_profile.py            # 3 rounds (about 2 min)
  /usr/bin/python3 bench/step_profile.py --quick    # 1 round, T = 64 at 64x64 (seconds)

Each run is `framefit bench-step --profile` (one warm-up step, one profiled step) in its own
process, naive and chunked alternating; per operator the self time (its slice less the slices
nested in it) is summed over the step, and the median over rounds is reported. Profiling adds
a little time per operator, more to the chunked step (it runs more, smaller operators).
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEFIT = os.path.join(ROOT, "build", "src", "cli", "framefit")

# Operator groups of the summary, by name (aten:: operators and autograd nodes).
GROUPS = [
    ("convolution backward", ("convolution_backward", "ConvolutionBackward", "_slow_conv2d_backward")),
    ("convolution forward", ("mkldnn_convolution", "_slow_conv2d_forward", "thnn_conv2d", "conv2d",
                             "_convolution", "aten::convolution")),
    ("batch norm", ("batch_norm", "BatchNorm")),
]


def group_of(name):
    for group, patterns in GROUPS:
        if any(p in name for p in patterns):
            return group
    return "everything else"


def self_times(path):
    """Self time (ms) and calls per operator name from a Chrome trace of nested slices."""
    with open(path) as f:
        events = [e for e in json.load(f) if e.get("ph") == "X"]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    self_ms, calls = collections.Counter(), collections.Counter()
    for slices in by_thread.values():
        slices.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # (name, end) of the open slices
        for e in slices:
            while stack and stack[-1][1] <= e["ts"]:
                stack.pop()
            if stack:
                self_ms[stack[-1][0]] -= e["dur"] / 1e3
            self_ms[e["name"]] += e["dur"] / 1e3
            calls[e["name"]] += 1
            stack.append((e["name"], e["ts"] + e["dur"]))
    return self_ms, calls


def profile_step(frames, size, chunk, keep, workdir):
    path = os.path.join(workdir, f"profile_{chunk}.json")
    cmd = [FRAMEFIT, "bench-step", "--model", "resnet18", "--head", "lstm", "--frames", str(frames),
           "--size", str(size), "--chunk", str(chunk), "--keep", str(keep), "--threads", "2",
           "--steps", "1", "--json", "--profile", path]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ms, calls = self_times(path)
    os.remove(path)
    return result, ms, calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--keep", type=int, default=1)
    opts = parser.parse_args()
    frames, size, rounds = (64, 64, 1) if opts.quick else (256, 112, opts.rounds)
    chunks = frames // opts.chunk + (frames % opts.chunk > 0)
    runs = {"naive": [], "chunked": []}
    machine = ""
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(rounds):
            for label, chunk in (("naive", 0), ("chunked", opts.chunk)):
                result, ms, calls = profile_step(frames, size, chunk, opts.keep, workdir)
                machine = result.get("machine", machine)
                runs[label].append({"step_seconds": result["step_seconds"], "ms": ms, "calls": calls})
                print(f"round {r + 1} {label}: step {result['step_seconds']:.2f} s")

    def median_ms(label, name):
        return statistics.median(run["ms"].get(name, 0.0) for run in runs[label])

    names = set()
    for label in runs:
        for run in runs[label]:
            names |= set(run["ms"])
    per_op = {n: {"naive_ms": median_ms("naive", n), "chunked_ms": median_ms("chunked", n),
                  "naive_calls": runs["naive"][0]["calls"].get(n, 0),
                  "chunked_calls": runs["chunked"][0]["calls"].get(n, 0)} for n in names}
    groups = collections.defaultdict(lambda: {"naive_ms": 0.0, "chunked_ms": 0.0})
    for n, row in per_op.items():
        g = groups[group_of(n)]
        g["naive_ms"] += row["naive_ms"]
        g["chunked_ms"] += row["chunked_ms"]
    step = {label: statistics.median(run["step_seconds"] for run in runs[label]) for label in runs}
    total = {label: sum(row[f"{label}_ms"] for row in per_op.values()) for label in runs}
    recomputed = chunks - min(opts.keep, chunks)

    lines = [
        "# Where the chunked step's time goes (operator profile)",
        "",
        f"Machine: {machine}. Produced by `bench/step_profile.py`: ResNet-18 + LSTM(512) + Linear(7), "
        f"{size}x{size} frames, T = {frames}, chunk {opts.chunk} ({chunks} chunks, keep {opts.keep}: "
        f"{recomputed} recomputed), AdamW, BatchNorm in train mode, framefit's default layout; "
        f"`framefit bench-step --profile`, one profiled step after a warm-up, naive and chunked "
        f"alternating, {rounds} round(s), per operator the median self time.",
        "",
        f"Step (profiled): naive {step['naive']:.2f} s, chunked {step['chunked']:.2f} s: "
        f"{step['chunked'] / step['naive']:.2f}x. Operator self time: naive {total['naive']:.0f} ms, "
        f"chunked {total['chunked']:.0f} ms.",
        "",
        "| operators | naive (ms) | chunked (ms) | chunked - naive (ms) | chunked / naive |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in [g for g, _ in GROUPS] + ["everything else"]:
        g = groups[name]
        ratio = g["chunked_ms"] / g["naive_ms"] if g["naive_ms"] else float("nan")
        lines.append(f"| {name} | {g['naive_ms']:.0f} | {g['chunked_ms']:.0f} | "
                     f"{g['chunked_ms'] - g['naive_ms']:+.0f} | {ratio:.2f}x |")
    conv = groups["convolution forward"]
    expected = conv["naive_ms"] * (chunks + recomputed) / chunks
    lines += [
        "",
        f"Recomputing {recomputed} of {chunks} chunks runs the encoder's forward {chunks + recomputed}/{chunks} "
        f"times: at naive speed its convolutions would take {expected:.0f} ms; they took "
        f"{conv['chunked_ms']:.0f} ms ({conv['chunked_ms'] / expected:.2f}x that).",
        "",
        "Largest differences by operator:",
        "",
        "| operator | naive (ms) | calls | chunked (ms) | calls | chunked - naive (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in sorted(per_op, key=lambda n: -abs(per_op[n]["chunked_ms"] - per_op[n]["naive_ms"]))[:12]:
        row = per_op[name]
        lines.append(f"| `{name}` | {row['naive_ms']:.1f} | {row['naive_calls']} | {row['chunked_ms']:.1f} | "
                     f"{row['chunked_calls']} | {row['chunked_ms'] - row['naive_ms']:+.1f} |")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    stem = os.path.join(ROOT, "bench", "results", "step_profile_quick" if opts.quick else "step_profile")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine, "frames": frames, "size": size, "chunk": opts.chunk,
                   "keep": opts.keep, "rounds": rounds, "step_seconds": step,
                   "groups": groups, "operators": per_op}, f, indent=1, sort_keys=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
