"""Online recognition (train::OnlinePredictor, framefit predict --online), measured.

  /usr/bin/python3 bench/online_bench.py [--rounds 3] [--frames 20000]

A live feed gives the head a few new frames at a time. framefit's OnlinePredictor carries the
LSTM's state and reruns the causal TCN over its receptive field only, so the time per piece
should not grow with the video; the alternative, running the head over the whole video so far
for each piece, grows with it. Both heads (LSTM 512, two-stage causal TCN; 512-d features, as
ResNet-18's) are trained for one epoch on synthetic features (model.encoder: features), then:
- online: one video of --frames rows pushed 25 at a time (one second at 25 fps): the median
  time per piece over the first and over the last tenth of the video;
- rerun: the head over the whole video so far at 1,000, 5,000 and --frames rows (one piece of
  that length: what each new piece would cost without carried state).
Rounds are interleaved; medians over rounds. Times are the head's (features in memory), from
the CLI's own clock, without start-up or file reading.

Writes bench/results/online.{md,json}.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tasks_bench import FRAMEFIT, OUT, machine  # noqa: E402

WORK = "/tmp/framefit_online_bench"
PIECE = 25
LINE = re.compile(r"online, (\d+) pieces of (\d+) rows: per piece median ([\d.]+) ms \(first "
                  r"tenth ([\d.]+) ms, last tenth ([\d.]+) ms\), (\d+) frames/s")


def checkpoint(head):
    """A features model with this head, trained one epoch on synthetic 512-d features."""
    os.makedirs(WORK, exist_ok=True)
    rows = ["name,labels,split,features"]
    torch.manual_seed(0)
    for v in range(2):
        frames = 300
        labels = (torch.arange(frames) * 3) // frames
        features = torch.randn(frames, 512) * 0.5
        features[torch.arange(frames), labels] += 2
        torch.save(features, f"{WORK}/v{v}.pt")
        with open(f"{WORK}/v{v}.txt", "w") as f:
            f.write("Frame\tPhase\n" + "".join(f"{t}\t{'abc'[l]}\n" for t, l in
                                               enumerate(labels.tolist())))
        rows.append(f"v{v},v{v}.txt,train,v{v}.pt")
    with open(f"{WORK}/manifest.csv", "w") as f:
        f.write("\n".join(rows) + "\n")
    out_dir = f"{WORK}/run_{head}"
    subprocess.run(["rm", "-rf", out_dir], check=True)
    with open(f"{WORK}/{head}.yaml", "w") as f:
        f.write(f"model: {{encoder: features, head: {head}}}\n"
                f"data: {{manifest: {WORK}/manifest.csv, classes: [a, b, c]}}\n"
                f"train: {{epochs: 1, validate: false, out_dir: {out_dir}}}\n")
    subprocess.run([FRAMEFIT, "train", "--json", "--config", f"{WORK}/{head}.yaml"], check=True,
                   capture_output=True)
    return f"{out_dir}/best.pt"


def online(model, features, piece):
    proc = subprocess.run([FRAMEFIT, "predict", "--checkpoint", model, "--features", features,
                           "--online", str(piece), "--out", "/dev/null"],
                          capture_output=True, text=True)
    match = LINE.search(proc.stderr)
    if proc.returncode != 0 or not match:
        raise RuntimeError(proc.stderr)
    return {"median_ms": float(match[3]), "first_tenth_ms": float(match[4]),
            "last_tenth_ms": float(match[5]), "frames_per_second": float(match[6])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frames", type=int, default=20000)
    opts = parser.parse_args()
    lengths = [1000, 5000, opts.frames]
    os.makedirs(WORK, exist_ok=True)
    torch.manual_seed(1)
    long = torch.randn(opts.frames, 512)
    files = {}
    for n in lengths:
        files[n] = f"{WORK}/long_{n}.pt"
        torch.save(long[:n].clone(), files[n])
    models = {head: checkpoint(head) for head in ("lstm", "tcn")}
    runs = {head: {"online": [], **{f"rerun_{n}": [] for n in lengths}} for head in models}
    for _ in range(opts.rounds):
        for head, model in models.items():
            runs[head]["online"].append(online(model, files[opts.frames], PIECE))
            for n in lengths:
                runs[head][f"rerun_{n}"].append(online(model, files[n], n)["median_ms"])
    result = {"machine": machine(), "frames": opts.frames, "piece": PIECE,
              "rounds": opts.rounds, "heads": {}}
    for head, r in runs.items():
        med = lambda key: statistics.median(x[key] for x in r["online"])  # noqa: E731
        result["heads"][head] = {
            "online_first_tenth_ms": med("first_tenth_ms"),
            "online_last_tenth_ms": med("last_tenth_ms"),
            "online_frames_per_second": med("frames_per_second"),
            **{f"rerun_{n}_ms": statistics.median(r[f"rerun_{n}"]) for n in lengths},
            "runs": r,
        }
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "online.json"), "w") as f:
        json.dump(result, f, indent=1)
    header = " | ".join(f"whole video so far, {n:,} frames (ms)" for n in lengths)
    lines = [
        "# Online recognition: time per piece of 25 frames",
        "",
        f"Machine: {machine()}. Produced by `bench/online_bench.py`: a {opts.frames:,}-frame "
        f"video of 512-d features (ResNet-18's size) pushed {PIECE} at a time through "
        "`framefit predict --online` (train::OnlinePredictor), against the head run over the "
        f"whole video so far (one piece of that length); {opts.rounds} interleaved rounds, "
        "medians. Head time only (features in memory).",
        "",
        f"| head | online: first tenth (ms) | online: last tenth (ms) | online frames/s | "
        f"{header} |",
        "|---|---:|---:|---:|" + "---:|" * len(lengths),
    ]
    for head, h in result["heads"].items():
        reruns = " | ".join(f"{h[f'rerun_{n}_ms']:.1f}" for n in lengths)
        lines.append(f"| {head} | {h['online_first_tenth_ms']:.2f} | "
                     f"{h['online_last_tenth_ms']:.2f} | {h['online_frames_per_second']:,.0f} | "
                     f"{reruns} |")
    with open(os.path.join(OUT, "online.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
