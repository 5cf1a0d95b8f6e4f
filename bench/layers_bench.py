"""Layer checkpointing and the largest batch, measured (issue #6 targets).

  /usr/bin/python3 bench/layers_bench.py            # section 1: 3 interleaved rounds of 7 steps
  /usr/bin/python3 bench/layers_bench.py --quick    # small inputs only, for a smoke run
  /usr/bin/python3 bench/layers_bench.py --sections 1 --nets unet --rounds 7  # part of section 1
  /usr/bin/python3 bench/layers_bench.py --sections 3   # seeds/001 only; the rest from layers.json

1. Cost of checkpointing: the same batch trained without checkpointing, with the planner's
   choice for a budget that halves the activation memory (where none does, also at the least
   memory any plan reaches), and with every stage recomputed. Checkpointing (auto, all) also
   recomputes BatchNorm and ReLU between convolutions (models/norm_relu_conv.h: R3D-18,
   R(2+1)D-18, UNet); "off, BatchNorm recomputed" is that alone. On seeds/001's network it runs
   each convolution with its ReLU and pooling over 8 slices along time instead (models/network.h,
   nothing recomputed); "off, time slices" is that alone.
   Activation memory = tracked peak - static (parameters, gradients, Adam state).
   Target: <= 1.35x the time for >= 2x less activation memory.
2. UNet (seeds/003): the largest batch a fixed budget allows, fp32 without checkpointing vs bf16
   with the planner's checkpointing (seeds/003 reports 4 -> 16 with AMP + checkpointing + more).
3. seeds/001's corrected 3D CNN on full-size clips (3 x 60 x 230 x 230, 20 classes) within 12 GiB:
   the largest batch the planner finds, checked by real training steps under the budget, with
   framefit's lean max pooling (models/pooling.h) and with PyTorch's, without checkpointing and
   with it (which slices the convolutions along time).

Every row runs `framefit bench-layers` (tracked bytes enforce the budget on the CPU, as GPU memory
would). Writes bench/results/layers.{md,json}.
"""
import argparse
import json
import os
import statistics
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEFIT = os.path.join(ROOT, "build", "src", "cli", "framefit")
OUT = os.path.join(ROOT, "bench", "results")


# The row added where no plan halves the activation memory.
LEAST = "auto, least memory"


def bench(*args):
    proc = subprocess.run([FRAMEFIT, "bench-layers", "--json", *args], capture_output=True,
                          text=True)
    if proc.returncode not in (0, 2):
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr}")
    return json.loads(proc.stdout)


def mib(n):
    return f"{n / 2**20:,.0f} MiB"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", default="1,2,3",
                        help="comma-separated sections to rerun; the others come from layers.json")
    parser.add_argument("--nets", help="comma-separated nets of section 1 to rerun (the other "
                        "nets' rows come from layers.json)")
    parser.add_argument("--rounds", type=int, help="section 1 rounds (default 3)")
    opts = parser.parse_args()
    sections = set(opts.sections.split(","))
    if opts.nets and "1" not in sections:
        parser.error("--nets reruns part of section 1: give --sections 1")
    # Steps of well under a second are noisy on a shared machine: more of them per median.
    repeat = "1" if opts.quick else "7"
    results = {"cost": [], "unet_batch": [], "seed001": []}
    machine = None
    if sections != {"1", "2", "3"} or opts.nets:
        with open(os.path.join(OUT, "layers.json")) as f:
            previous = json.load(f)
        for section, key in (("1", "cost"), ("2", "unet_batch"), ("3", "seed001")):
            if section not in sections:
                results[key] = previous[key]
        machine = previous["machine"]

    # 1. Cost of checkpointing at a fixed batch.
    nets = [("unet", "3,128,128", ["--width", "32", "--depth", "4", "--classes", "2"], "8"),
            ("r3d_18", "3,16,112,112", ["--classes", "20"], "2"),
            ("r2plus1d_18", "3,16,112,112", ["--classes", "20"], "2"),
            # tiny clips: layer2-4 take the lean convolution backward, whose cost shows there
            ("r3d_18", "3,4,32,32", ["--classes", "20"], "4"),
            ("clip3d", "3,30,115,115", ["--classes", "20"], "2"),
            # seeds/000's per-frame encoder as a chain of its 16 bottleneck blocks
            ("resnet50", "3,160,160", ["--classes", "10"], "4")]
    if opts.quick:
        nets = [("unet", "3,64,64", ["--width", "8", "--depth", "3", "--classes", "2"], "4")]
    kept_rows = []
    if "1" not in sections:
        nets = []
    elif opts.nets:
        wanted = opts.nets.split(",")
        nets = [n for n in nets if n[0] in wanted]
        kept_rows = [r for r in previous["cost"] if r["net"] not in wanted]
    # Processes run minutes apart see different machine load: the four settings of a net run
    # interleaved, `rounds` times, and each setting's slowdown is the median over rounds of its
    # time divided by the plain run's in the same round.
    rounds = opts.rounds or (1 if opts.quick else 3)
    checkpoint_modes = ("off", "auto, budget halfway", "auto, half the activations", "all")
    # Settings other than checkpointing, run plain in the same rounds: the video ResNets'
    # convolution backward through oneDNN throughout (models/conv3d.h), as LibTorch runs it.
    # seeds/001's net with PyTorch's max pooling, which keeps its input (models/pooling.h).
    # BatchNorm and ReLU recomputed with nothing else (the checkpointing modes include it).
    norm_alone = ("off, BatchNorm recomputed", ["--recompute-norm", "on"])
    other_modes = {"unet": [norm_alone], "resnet50": [norm_alone],
                   "r3d_18": [norm_alone, ("off, oneDNN backward", ["--onednn-backward"])],
                   "r2plus1d_18": [norm_alone, ("off, oneDNN backward", ["--onednn-backward"])],
                   "clip3d": [("off, time slices", ["--time-slices", "on"]),
                              ("off, PyTorch's max pooling", ["--plain-pooling"])]}
    for net, shape, extra, batch in nets:
        common = ["--net", net, "--input", shape, *extra, "--batch", batch, "--repeat", repeat]
        modes = checkpoint_modes + tuple(m for m, _ in other_modes.get(net, []))
        runs = {mode: [] for mode in modes}
        for _ in range(rounds):
            plain = bench(*common)
            machine = plain["machine"]
            activation = plain["activation_bytes"]
            every = bench(*common, "--checkpoint", "all")
            # A budget halfway between every stage recomputed and none: the planner's trade.
            middle = plain["static_bytes"] + (activation + every["activation_bytes"]) // 2
            auto = bench(*common, "--checkpoint", "auto", "--budget", str(middle))
            # The target's question: the cheapest plan with half the activation memory, if any.
            half = bench(*common, "--checkpoint", "auto", "--budget",
                         str(plain["static_bytes"] + activation // 2))
            for mode, row in zip(checkpoint_modes, (plain, auto, half, every)):
                runs[mode].append(row)
            if not half.get("plan_fits", True):
                # No plan halves it: the least memory any plan reaches (the plan printed for
                # `half`), run with 2% of room for the model's error.
                runs.setdefault(LEAST, []).append(bench(
                    *common, "--checkpoint", "auto", "--budget",
                    str(int(half["predicted_peak_bytes"] * 1.02))))
            for mode, flags in other_modes.get(net, []):
                runs[mode].append(bench(*common, *flags))
        modes += (LEAST,) if LEAST in runs else ()
        for mode in modes:
            row = runs[mode][0]  # memory and plans do not change between rounds
            entry = {"net": net, "input": shape, "batch": int(batch), "mode": mode,
                     **{k: row.get(k) for k in ("activation_bytes", "peak_bytes",
                                                "predicted_peak_bytes", "rss_peak_bytes",
                                                "recomputed", "nested", "stages", "fits",
                                                "plan_fits", "time_slices")}}
            if row.get("step_seconds") is not None:
                times = [r["step_seconds"] for r in runs[mode]]
                entry["step_seconds_rounds"] = times
                entry["step_seconds"] = statistics.median(times)
                entry["time_ratio"] = statistics.median(
                    t / r["step_seconds"] for t, r in zip(times, runs["off"]))
            results["cost"].append(entry)
        print(f"{net}: " + ", ".join(
            f"{mode} {statistics.median(r['step_seconds'] for r in runs[mode]):.2f} s"
            for mode in modes if runs[mode][0].get("step_seconds") is not None), flush=True)

    # Rows of nets not rerun keep their places (and their own round counts, noted per row).
    if kept_rows:
        order = [r["net"] for r in previous["cost"]]
        results["cost"] = sorted(kept_rows + results["cost"],
                                 key=lambda r: order.index(r["net"]) if r["net"] in order else 99)

    # 2. UNet's largest batch within a fixed budget.
    unet_shape, unet_budget = ("3,64,64", "64MiB") if opts.quick else ("3,128,128", "512MiB")
    unet_settings = (("fp32, no checkpointing", ["--precision", "fp32", "--checkpoint", "off"]),
                     ("fp32, checkpointing", ["--precision", "fp32", "--checkpoint", "auto"]),
                     ("bf16, checkpointing", ["--precision", "bf16", "--checkpoint", "auto"]))
    if "2" not in sections:
        unet_settings = ()
    unet = ["--net", "unet", "--input", unet_shape, "--width", "16", "--depth", "4", "--classes",
            "2", "--batch", "0", "--budget", unet_budget, "--repeat", "1"]
    for label, extra in unet_settings:
        row = bench(*unet, *extra)
        results["unet_batch"].append({"setting": label, "budget": unet_budget,
                                      **{k: row.get(k) for k in ("planned_batch", "largest_batch",
                                                                 "peak_bytes", "step_seconds",
                                                                 "tries", "rss_peak_bytes")}})
        print(f"unet {label}: planned {row['planned_batch']}, largest {row['largest_batch']}",
              flush=True)

    # 3. seeds/001 corrected, full-size clips, 12 GiB.
    if not opts.quick and "3" in sections:
        for label, extra in (("fp32, no checkpointing", ["--checkpoint", "off"]),
                             ("fp32, checkpointing", ["--checkpoint", "auto"]),
                             ("fp32, checkpointing, whole convolutions",
                              ["--checkpoint", "auto", "--time-slices", "off"]),
                             ("fp32, no checkpointing, PyTorch's max pooling",
                              ["--checkpoint", "off", "--plain-pooling"])):
            row = bench("--net", "clip3d", "--input", "3,60,230,230", "--classes", "20", "--batch",
                        "0", "--budget", "12GiB", "--repeat", "1", *extra)
            machine = row.get("machine", machine)
            results["seed001"].append({"setting": label, **{k: row.get(k) for k in (
                "planned_batch", "largest_batch", "peak_bytes", "predicted_peak_bytes",
                "step_seconds", "samples_per_second", "tries", "rss_peak_bytes", "recomputed",
                "time_slices")}})
            print(f"seeds/001 {label}: planned {row['planned_batch']}, largest "
                  f"{row['largest_batch']}, {row.get('step_seconds', 0):.1f} s/step", flush=True)

    results["machine"] = machine
    os.makedirs(OUT, exist_ok=True)
    suffix = "_quick" if opts.quick else ""
    with open(os.path.join(OUT, f"layers{suffix}.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["# Layer checkpointing and the largest batch", "",
             f"Machine: {machine}. Produced by `bench/layers_bench.py`"
             f"{' --quick' if opts.quick else ''}; section 1: each setting run several times (column "
             f"\"runs\"), interleaved with the others of its net, each run the median of {repeat} "
             "steps; step time is the "
             "median of the runs, \"vs off\" the median of each run's time over the plain run's in "
             "the same round (sections 2 and 3: one measured step each).", "",
             "## Cost of checkpointing (same batch)", "",
             "Target (issue #6): >= 2x less activation memory for <= 1.35x the step time.", "",
             "| net | input | batch | checkpointing | recomputed stages | activation memory | vs off "
             "| step time | vs off | target met | predicted peak | measured peak | runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in results["cost"]:
        key = (r["net"], r["input"])
        if r["mode"] == "off":
            base[key] = r
        b = base[key]
        if not r.get("fits", True) or r.get("activation_bytes") is None:
            # A step that ran out of memory with a plan predicted to fit is the model's error.
            why = "no plan fits" if not r.get("plan_fits", False) else "out of memory, planned to fit"
            lines.append(f"| {r['net']} | {r['input']} | {r['batch']} | {r['mode']} | "
                         f"{why} | | | | | no | | | |")
            continue
        recomputed = sum(e - s for s, e in r["recomputed"] or [])
        nested = sum(e - s for s, e in r.get("nested") or [])
        sliced = f", {r['time_slices']} time slices" if r.get("time_slices") else ""
        less = b["activation_bytes"] / max(1, r["activation_bytes"])
        slower = r.get("time_ratio", r["step_seconds"] / b["step_seconds"])
        planned = r["mode"] in checkpoint_modes[1:] or r["mode"] == LEAST
        met = ("yes" if less >= 2 and slower <= 1.35 else "no") if planned else "-"
        lines.append(f"| {r['net']} | {r['input']} | {r['batch']} | {r['mode']} | "
                     f"{recomputed} of {r['stages']}{f' ({nested} nested)' if nested else ''}"
                     f"{sliced} | "
                     f"{mib(r['activation_bytes'])} | "
                     f"{less:.2f}x less | {r['step_seconds']:.3f} s | {slower:.2f}x | {met} | "
                     f"{mib(r['predicted_peak_bytes'])} | {mib(r['peak_bytes'])} | "
                     f"{len(r.get('step_seconds_rounds') or [])} |")
    lines += ["", f"## UNet: largest batch within {unet_budget} (input {unet_shape}, width 16, depth 4)",
              "", "| setting | planner's batch | largest batch that ran | peak at it | step time |",
              "|---|---|---|---|---|"]
    for r in results["unet_batch"]:
        lines.append(f"| {r['setting']} | {r['planned_batch']} | {r['largest_batch']} | "
                     f"{mib(r['peak_bytes'] or 0)} | {r['step_seconds'] or 0:.2f} s |")
    if results["seed001"]:
        lines += ["", "## seeds/001 corrected: 3 x 60 x 230 x 230 clips, 20 classes, 12 GiB", "",
                  "| setting | planner's batch | largest batch that ran | peak at it | predicted | "
                  "step time | clips/s |", "|---|---|---|---|---|---|---|"]
        for r in results["seed001"]:
            lines.append(f"| {r['setting']} | {r['planned_batch']} | {r['largest_batch']} | "
                         f"{mib(r['peak_bytes'] or 0)} | {mib(r['predicted_peak_bytes'] or 0)} | "
                         f"{r['step_seconds'] or 0:.1f} s | {r['samples_per_second'] or 0:.2f} |")
    with open(os.path.join(OUT, f"layers{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
