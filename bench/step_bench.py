"""Side-by-side benchmark of one training step: framefit (naive and chunked) against the PyTorch
recipes of shared/workloads.md (naive, torch.utils.checkpoint per chunk, ETAD), ResNet-18 + LSTM
at 112x112, in one run on one machine. Writes bench/results/step_bench.{md,json,png}.

  /usr/bin/python3 bench/step_bench.py            # T in 64, 256, 1024, 2048 (about 30 min)
  /usr/bin/python3 bench/step_bench.py --quick    # T in 64, 256 (a few minutes)
  /usr/bin/python3 bench/step_bench.py --full-size  # adds seeds/000's ResNet-50, T=2000, 224x224

Each configuration runs in its own process (so its peak RSS is its own) after one warm-up step;
with several measured steps the median time is reported. PyTorch peers run with and without
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc's trimming makes them up to 5x slower otherwise).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEFIT = os.path.join(ROOT, "build", "src", "cli", "framefit")
PEERS = os.path.join(ROOT, "bench", "pytorch_peers.py")
PYTHON = "/usr/bin/python3"
NAIVE_LIMIT_FRAMES = 1024  # PyTorch naive beyond this takes minutes per step on 2 cores
TUNED = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def machine():
    flags = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"]
                flags = " ".join(w for w in wanted if f" {w}" in line)
                break
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return f"{model}; {os.cpu_count()} cores; threads 2; flags: {flags}; {platform.platform()}"


def run(cmd, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall_seconds"] = time.time() - t0
    return out


def framefit(frames, chunk, steps, precision="fp32", channels_last=False, model="resnet18",
             size=112, extra=()):
    cmd = [FRAMEFIT, "bench-step", "--model", model, "--head", "lstm", "--frames", str(frames),
           "--size", str(size), "--chunk", str(chunk), "--precision", precision, "--threads", "2",
           "--steps", str(steps), "--json", *extra]
    if channels_last:
        cmd.append("--channels-last")
    return run(cmd)


def peer(recipe, frames, chunk, steps, precision="fp32", tuned=False):
    cmd = [PYTHON, PEERS, "--recipe", recipe, "--frames", str(frames), "--size", "112",
           "--chunk", str(chunk), "--precision", precision, "--steps", str(steps), "--threads", "2"]
    return run(cmd, TUNED if tuned else None)


def mib(b):
    return f"{b / 2**20:,.0f}" if b else "n/a"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full-size", action="store_true")
    ap.add_argument("--lengths", help="comma-separated T values (overrides --quick)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    lengths = [64, 256] if a.quick else [64, 256, 1024, 2048]
    if a.lengths:
        lengths = [int(x) for x in a.lengths.split(",")]
    chunk = 32
    rows = []

    def add(T, name, precision, result):
        result.update({"T": T, "name": name, "precision": precision})
        rows.append(result)
        status = result.get("error") or f"{result['step_seconds']:.2f} s, RSS {mib(result['rss_peak_bytes'])} MiB"
        print(f"T={T:5d} {precision} {name:38s} {status}", flush=True)

    print(machine(), flush=True)
    for T in lengths:
        steps = 3 if T <= 256 else 1
        add(T, "framefit chunked", "fp32", framefit(T, chunk, steps))
        add(T, "framefit chunked, channels-last", "fp32", framefit(T, chunk, steps, channels_last=True))
        add(T, "framefit naive", "fp32", framefit(T, 0, steps))
        for tuned in (False, True):
            suffix = " (malloc tuned)" if tuned else ""
            if T <= NAIVE_LIMIT_FRAMES:
                add(T, "PyTorch naive" + suffix, "fp32", peer("naive", T, chunk, steps, tuned=tuned))
            add(T, "PyTorch checkpoint" + suffix, "fp32", peer("checkpoint", T, chunk, steps, tuned=tuned))
            add(T, "PyTorch ETAD" + suffix, "fp32", peer("etad", T, chunk, steps, tuned=tuned))
    T = lengths[min(1, len(lengths) - 1)]
    add(T, "framefit chunked", "bf16", framefit(T, chunk, 3, "bf16"))
    add(T, "framefit chunked, channels-last", "bf16", framefit(T, chunk, 3, "bf16", channels_last=True))
    for tuned in (False, True):
        suffix = " (malloc tuned)" if tuned else ""
        add(T, "PyTorch checkpoint" + suffix, "bf16", peer("checkpoint", T, chunk, 3, "bf16", tuned))
        add(T, "PyTorch ETAD" + suffix, "bf16", peer("etad", T, chunk, 3, "bf16", tuned))
    full = None
    if a.full_size:
        full = framefit(2000, 8, 1, model="resnet50", size=224, extra=["--no-warmup"])
        print("full size:", full, flush=True)

    with open(os.path.join(a.out, "step_bench.json"), "w") as f:
        json.dump({"machine": machine(), "rows": rows, "full_size": full}, f, indent=1)
    write_markdown(a.out, rows, full)
    write_plot(a.out, rows)


def targets(rows):
    """The issue's targets, computed from this run's rows."""
    lines = []
    by = {(r["T"], r["name"], r["precision"]): r for r in rows if "error" not in r}
    Ts = sorted({r["T"] for r in rows})
    base = by.get((Ts[0], "framefit chunked", "fp32"))
    for T in Ts:
        for layout in ("framefit chunked", "framefit chunked, channels-last"):
            ours = by.get((T, layout, "fp32"))
            if not ours:
                continue
            peers = [r for (t, n, p), r in by.items() if t == T and p == "fp32" and n.startswith("PyTorch")
                     and ("checkpoint" in n or "ETAD" in n)]
            if peers:
                fastest = min(peers, key=lambda r: r["step_seconds"])
                lines.append(f"| {T} | {layout} | {ours['step_seconds'] / fastest['step_seconds']:.2f}x "
                             f"({fastest['name']}) | " + (
                                 f"{ours['step_seconds'] / by[(T, 'framefit naive', 'fp32')]['step_seconds']:.2f}x"
                                 if (T, "framefit naive", "fp32") in by else "n/a") + " | "
                             + ("yes" if all(ours["rss_peak_bytes"] < p["rss_peak_bytes"] for p in
                                             [r for (t, n, pr), r in by.items() if t == T and pr == "fp32" and n.startswith("PyTorch")])
                                else "no") + " |")
    growth = ""
    longest = by.get((Ts[-1], "framefit chunked", "fp32"))
    if base and longest:
        extra = (Ts[-1] - Ts[0]) * (512 * 4 * 2 + 3 * 112 * 112)  # features + grads, uint8 frames
        growth = (f"Peak tensor memory T={Ts[0]}: {mib(base['peak_bytes'])} MiB, T={Ts[-1]}: "
                  f"{mib(longest['peak_bytes'])} MiB; allowed by the target (T={Ts[0]} peak + features + "
                  f"frames, +10%): {mib((base['peak_bytes'] + extra) * 1.1)} MiB -> "
                  + ("met" if longest["peak_bytes"] <= (base["peak_bytes"] + extra) * 1.1 else "NOT met"))
    return lines, growth


def write_markdown(out, rows, full):
    lines = ["# One training step: framefit vs PyTorch recipes", "",
             f"Machine: {machine()}", "",
             "ResNet-18 encoder + LSTM(512) + Linear(7), 112x112 frames, chunk 32 (framefit keeps the last "
             "chunk's graph), AdamW, BatchNorm in train mode. Generated by `bench/step_bench.py`; each row is "
             "its own process. Peak tensor memory is framefit's tracking allocator (PyTorch on CPU has no "
             "such counter); peak RSS is the process's VmHWM / ru_maxrss.", "",
             "| T | precision | run | step (s) | frames/s | peak tensors (MiB) | peak RSS (MiB) |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['T']} | {r['precision']} | {r['name']} | failed: {r['error']} | | | |")
            continue
        lines.append(f"| {r['T']} | {r['precision']} | {r['name']} | {r['step_seconds']:.2f} | "
                     f"{r['frames_per_second']:.1f} | {mib(r.get('peak_bytes'))} | {mib(r['rss_peak_bytes'])} |")
    ratio_lines, growth = targets(rows)
    lines += ["", "## Targets", "", growth, "",
              "| T | framefit | time vs fastest chunked PyTorch peer (target <= 0.8x) | vs framefit naive "
              "(target <= 1.35x) | RSS below every peer |", "|---:|---|---|---|---|", *ratio_lines]
    if full:
        lines += ["", "## seeds/000 at full size", ""]
        if "error" in full:
            lines.append(f"ResNet-50 + LSTM, T=2000, 224x224, fp32, chunk 8: failed: {full['error']}")
        else:
            lines.append(f"ResNet-50 + LSTM, T=2000, 224x224, fp32, chunk 8, one step timed once (no warm-up): "
                         f"{full['step_seconds']:.0f} s ({full['frames_per_second']:.1f} frames/s), peak tensor "
                         f"memory {mib(full['peak_bytes'])} MiB, peak RSS {mib(full['rss_peak_bytes'])} MiB "
                         f"(target: under 24 GiB, aim under 4 GiB).")
    with open(os.path.join(out, "step_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(out, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = sorted({r["name"] for r in rows if r["precision"] == "fp32"})
    for name in names:
        pts = sorted((r["T"], r) for r in rows if r["name"] == name and r["precision"] == "fp32" and "error" not in r)
        if len(pts) < 2:
            continue
        Ts = [t for t, _ in pts]
        style = "-o" if name.startswith("framefit") else "--s"
        ax1.plot(Ts, [r["rss_peak_bytes"] / 2**30 for _, r in pts], style, label=name)
        ax2.plot(Ts, [r["step_seconds"] for _, r in pts], style, label=name)
    for ax, title in ((ax1, "peak RSS (GiB)"), (ax2, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("frames per video (T)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle("ResNet-18 + LSTM, 112x112, fp32, one training step (2 cores)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "step_bench.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
