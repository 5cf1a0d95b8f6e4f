"""Does the data pipeline keep up with training? Decoding + transforms vs what training eats.

  /usr/bin/python3 bench/data_bench.py            # 3 repeats, medians
  /usr/bin/python3 bench/data_bench.py --quick    # 1 repeat, shorter videos

Source media at Cholec80's size (854x480, 25 fps H.264, and the same frames as a JPEG folder),
made with the ffmpeg CLI from its testsrc2 pattern. `framefit bench-data` decodes a split
through the prefetching workers exactly as training reads it (resize to 112 on the shorter side,
random 112x112 crop, flip), with 1 and 2 workers, every frame and sampled at 5 and 1 fps
(Cholec80's usual rate), the video with `data.skip_unsampled` on and off side by side, and with colour jitter and rotation. Training's
appetite is `framefit bench-step` for ResNet-18 + LSTM at 112x112 (T = 256, planner-chosen
chunk, fp32). Target (issue #5): delivered frames/s >= 2x trained frames/s.

Writes bench/results/data_pipeline.{md,json}.
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEFIT = os.path.join(ROOT, "build", "src", "cli", "framefit")
OUT = os.path.join(ROOT, "bench", "results")


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def make_media(work, videos, frames):
    os.makedirs(os.path.join(work, "labels"), exist_ok=True)
    rows_video, rows_frames = ["name,video,labels,split,fps"], ["name,video,labels,split,fps"]
    for v in range(videos):
        name = f"v{v}"
        mp4 = os.path.join(work, name + ".mp4")
        folder = os.path.join(work, name)
        os.makedirs(folder, exist_ok=True)
        src = ["-f", "lavfi", "-i", f"testsrc2=size=854x480:rate=25", "-frames:v", str(frames)]
        subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *src, "-c:v", "libx264",
                        "-pix_fmt", "yuv420p", "-preset", "veryfast", mp4], check=True)
        subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *src, "-q:v", "3",
                        os.path.join(folder, "%06d.jpg")], check=True)
        labels = os.path.join(work, "labels", name + ".txt")
        with open(labels, "w") as f:
            f.write("Frame\tPhase\n")
            for i in range(frames):
                f.write(f"{i}\t{'a' if i < frames // 2 else 'b'}\n")
        rows_video.append(f"{name},{mp4},{labels},train,")
        rows_frames.append(f"{name},{folder},{labels},train,25")
    for file, rows in (("video.csv", rows_video), ("frames.csv", rows_frames)):
        with open(os.path.join(work, file), "w") as f:
            f.write("\n".join(rows) + "\n")
    with open(os.path.join(work, "config.yaml"), "w") as f:
        f.write("data:\n  classes: [a, b]\n  resize: 112\n  crop: 112\n  augment: true\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    videos, frames = (2, 250) if args.quick else (4, 750)
    work = tempfile.mkdtemp(prefix="framefit_data_bench_")
    make_media(work, videos, frames)
    config = os.path.join(work, "config.yaml")

    # Every configuration once per round, rounds repeated: side by side on a noisy machine.
    configs = []
    for source, manifest in (("H.264 854x480", "video.csv"), ("JPEG folder 854x480", "frames.csv")):
        for fps in ((0, 5, 1) if manifest == "video.csv" else (0, 5)):
            for workers in (1, 2):
                # Skipping unsampled frames only applies to a sampled video file.
                skips = (True, False) if manifest == "video.csv" and fps else (None,)
                for skip in skips:
                    configs.append((source, manifest, fps, workers, skip, False))
    # Colour jitter (ColorJitter(0.1, 0.1, 0.1, 0.05)) and rotation (RandomRotation(5)) on top of
    # crop and flip, with 2 workers.
    configs.append(("H.264 854x480", "video.csv", 1, 2, True, True))
    configs.append(("JPEG folder 854x480", "frames.csv", 0, 2, None, True))
    runs = {c: [] for c in configs}
    machine = None
    for _ in range(repeats):
        for c in configs:
            source, manifest, fps, workers, skip, jitter = c
            cmd = [FRAMEFIT, "bench-data", "--config", config, "--json",
                   "--set", f"data.manifest={os.path.join(work, manifest)}",
                   "--set", f"data.fps={fps}", "--set", f"data.workers={workers}"]
            if skip is not None:
                cmd += ["--set", f"data.skip_unsampled={'true' if skip else 'false'}"]
            if jitter:
                cmd += ["--set", "data.brightness=0.1", "--set", "data.contrast=0.1",
                        "--set", "data.saturation=0.1", "--set", "data.hue=0.05",
                        "--set", "data.rotation=5"]
            read = run_json(cmd)
            # bench-data counts a video's frames as its samples.
            read["frames"], read["frames_per_second"] = read["samples"], read["samples_per_second"]
            runs[c].append(read)
            machine = runs[c][-1]["machine"]
            print(c, runs[c][-1]["frames_per_second"], flush=True)
    rows = []
    for c in configs:
        source, manifest, fps, workers, skip, jitter = c
        r = runs[c]
        row = {"source": source, "fps": fps or 25, "workers": workers, "skip_unsampled": skip,
               "color_jitter": jitter,
               "frames": r[0]["frames"],
               "frames_per_second": statistics.median(x["frames_per_second"] for x in r),
               "peak_bytes": r[0]["peak_bytes"],
               "rss_peak_bytes": max(x["rss_peak_bytes"] for x in r)}
        if jitter:
            plain = runs[(source, manifest, fps, workers, skip, False)]
            row["vs_without_jitter"] = statistics.median(
                a["frames_per_second"] / b["frames_per_second"] for a, b in zip(r, plain))
        elif skip:
            off = runs[(source, manifest, fps, workers, False, False)]
            row["vs_decoding_every_frame"] = statistics.median(
                a["frames_per_second"] / b["frames_per_second"] for a, b in zip(r, off))
        rows.append(row)

    steps = [run_json([FRAMEFIT, "bench-step", "--model", "resnet18", "--head", "lstm", "--frames", "256",
                       "--size", "112", "--chunk", "auto", "--json"]) for _ in range(repeats)]
    trained = statistics.median(s["frames_per_second"] for s in steps)
    print("training consumes", trained, "frames/s", flush=True)

    result = {"machine": machine, "repeats": repeats, "videos": videos, "source_frames": frames,
              "training_frames_per_second": trained, "rows": rows}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "data_pipeline.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        "# Data pipeline throughput vs training",
        "",
        f"Machine: {machine}. Median of {repeats} runs. {videos} videos x {frames} frames, decoded to 112x112"
        " (shorter side 112, random crop, flip) through the prefetching workers.",
        "",
        f"Training (ResNet-18 + LSTM, 112x112, T = 256, fp32, planner-chosen chunk) consumes "
        f"**{trained:.1f} frames/s**.",
        "",
        "| source | sampled fps | workers | unsampled frames | jitter, rotation | frames | delivered frames/s "
        "| x training | vs decoding every frame | vs without jitter | peak tensors | peak RSS |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        skip = {None: "", True: "skipped", False: "decoded"}[r["skip_unsampled"]]
        ratio = f"{r['vs_decoding_every_frame']:.2f}x" if "vs_decoding_every_frame" in r else ""
        jitter_ratio = f"{r['vs_without_jitter']:.2f}x" if "vs_without_jitter" in r else ""
        lines.append(f"| {r['source']} | {r['fps']} | {r['workers']} | {skip} | "
                     f"{'yes' if r['color_jitter'] else ''} | {r['frames']} | "
                     f"{r['frames_per_second']:.0f} | {r['frames_per_second'] / trained:.1f}x | "
                     f"{ratio} | {jitter_ratio} | {r['peak_bytes'] / 2**20:.0f} MiB | {r['rss_peak_bytes'] / 2**20:.0f} MiB |")
    lines += ["", "A sampled H.264 stream is decoded from its start: every frame another frame refers "
              "to must be decoded (I, P and the reference B-frames of x264's B-pyramid). "
              "`data.skip_unsampled` (the default) leaves out the other unsampled frames; "
              "`decoded` rows turn it off (`--set data.skip_unsampled=false`), and 'vs decoding "
              "every frame' is the median over rounds of the two rates' ratio. The source is x264 "
              "`-preset veryfast` (3 B-frames, B-pyramid). A frame folder reads only the sampled "
              "files. Jitter and rotation rows add `data.brightness/contrast/saturation 0.1, data.hue "
              "0.05, data.rotation 5` (torchvision's ColorJitter and RandomRotation on each "
              "video's frames, drawn per video); 'vs without jitter' compares with the same row "
              "without them.", ""]
    with open(os.path.join(OUT, "data_pipeline.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
