"""framefit vs the PyTorch recipes on one CUDA GPU, and layer checkpointing's cost there.

Run on a GPU machine after scripts/cuda_check.sh has built framefit against its CUDA LibTorch,
with that machine's python3 (PyTorch with CUDA) for the peers:

  python3 bench/gpu_bench.py --framefit build-cuda/src/cli/framefit --out bench/results

Rows: seeds/000's model (ResNet-50 + LSTM(512) + Linear(7), 224x224, chunk 32, AdamW, BatchNorm
in train mode) at T = 256 (where naive training fits) and T = 2,000 (full size), fp32 and bf16;
framefit's planner under a 24 GiB budget (the card seeds/000 ran out of memory on); a UNet's
step with and without layer checkpointing, and the largest UNet batch the planner finds within
8 GiB (--rows unet); seeds/001's corrected clip classifier at full size, its largest batch within
12 GiB, and R3D-18's step with and without layer checkpointing (--rows clips). Each row is one
process: one warm-up step, then the median of its measured steps. The batch plans leave the CUDA
allocator a tenth of the budget and run under all of it, with and without expandable segments. Peak tensor bytes are the CUDA caching allocator's peak of
allocated bytes for both framefit and PyTorch.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, "bench", "pytorch_peers.py")


def machine():
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); {os.cpu_count()} CPU "
            f"cores; {platform.platform()}")


class Runner:
    def __init__(self, deadline):
        self.deadline = time.time() + deadline

    def __call__(self, cmd, timeout=240, env=None):
        if time.time() > self.deadline:
            return {"error": "skipped (out of time)"}
        t0 = time.time()
        # The last run may overrun the deadline by at most 45 s.
        timeout = min(timeout, self.deadline + 45 - t0)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               env=None if env is None else {**os.environ, **env})
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        lines = p.stdout.strip().splitlines()
        # Exit code 2: bench-layers' plan does not fit the budget; its JSON says so.
        if p.returncode not in (0, 2) or not lines:
            return {"error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
        out = json.loads(lines[-1])
        if p.returncode == 2:
            return {"error": "does not fit the budget", **out}
        out["wall_seconds"] = time.time() - t0
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--framefit", required=True, help="framefit built against CUDA LibTorch")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--deadline", type=float, default=420,
                    help="seconds after which no further run starts")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    ap.add_argument("--rows", default="",
                    help="regular expression: run only the rows whose 'T precision name' matches "
                         "('unet', 'clips' for layer checkpointing and batch plans)")
    ap.add_argument("--name", default="gpu", help="output files NAME.json and NAME.md")
    ap.add_argument("--from-json", help="only write NAME.md again from a NAME.json of a run")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        first = saved["rows"][0] if saved["rows"] else {}
        write_markdown(a.out, a.name, saved["machine"], saved["rows"], saved["layers"],
                       first.get("model", "resnet50"), first.get("size", 224), first.get("chunk", 32))
        return
    run = Runner(a.deadline)
    device = "cpu" if a.quick else "cuda"
    model, size, long_t, short_t = ("resnet18", 64, 64, 32) if a.quick else ("resnet50", 224, 2000, 256)
    chunk = 32 if not a.quick else 16
    threads = str(os.cpu_count())
    rows = []
    layers = {"error": "not run"}
    wanted = lambda key: wanted_rows(a, key)

    machine_line = machine()

    def save():
        with open(os.path.join(a.out, a.name + ".json"), "w") as f:
            json.dump({"machine": machine_line, "rows": rows, "layers": layers}, f, indent=1)
        write_markdown(a.out, a.name, machine_line, rows, layers, model, size, chunk)

    def framefit(label, frames, precision, steps, extra=(), timeout=240):
        if not wanted(f"{frames} {precision} {label}"):
            return
        cmd = [a.framefit, "bench-step", "--model", model, "--head", "lstm", "--frames", str(frames),
               "--size", str(size), "--precision", precision, "--device", device, "--steps",
               str(steps), "--json", *extra]
        if "--chunk" not in extra:
            cmd += ["--chunk", str(chunk)]
        add(label, frames, precision, run(cmd, timeout))

    def peer(label, recipe, frames, precision, steps, channels_last=False):
        if not wanted(f"{frames} {precision} {label}"):
            return
        cmd = [sys.executable, PEERS, "--recipe", recipe, "--model", model, "--frames", str(frames),
               "--size", str(size), "--chunk", str(chunk), "--precision", precision, "--steps",
               str(steps), "--threads", threads, "--device", device]
        if channels_last:
            cmd.append("--channels-last")
        add(label, frames, precision, run(cmd))

    def add(label, frames, precision, out):
        out.update({"name": label, "T": frames, "precision": precision})
        rows.append(out)
        save()
        print(f"T={frames} {precision} {label}: "
              + (out.get("error") or f"{out['step_seconds']:.3f} s, peak {mib(out.get('peak_bytes'))} MiB"),
              flush=True)

    print(machine_line, flush=True)
    # seeds/000 at full size first: the row this benchmark exists for.
    for precision in ("fp32", "bf16"):
        framefit("framefit chunked", long_t, precision, 1)
        peer("PyTorch checkpoint", "checkpoint", long_t, precision, 1)
        peer("PyTorch ETAD", "etad", long_t, precision, 1)
    for precision in ("fp32", "bf16"):
        framefit("framefit chunked", short_t, precision, 3)
        framefit("framefit chunked, NCHW", short_t, precision, 3, ["--layout", "nchw"])
        framefit("framefit naive", short_t, precision, 3, ["--chunk", "0"])
        peer("PyTorch naive", "naive", short_t, precision, 3)
        peer("PyTorch checkpoint", "checkpoint", short_t, precision, 3)
        peer("PyTorch checkpoint, channels-last", "checkpoint", short_t, precision, 3, True)
        peer("PyTorch ETAD", "etad", short_t, precision, 3)
    if wanted("unet") or wanted("clips"):
        layers = layer_checkpointing(a, run, device)
        save()
    # Last: calibration makes it the longest run.
    framefit("framefit planner, budget 24GiB", long_t, "fp32", 1,
             ["--chunk", "auto", "--budget", "24GiB"], timeout=150)
    save()


def layer_checkpointing(a, run, device):
    """Layer checkpointing on the GPU: a UNet and torchvision's R3D-18 (cost at a fixed batch),
    the batch planner's CUDA margin (the UNet's largest batch within 8 GiB), and seeds/001's
    corrected clip classifier at full size within 12 GiB (issue #6's target). The CUDA budget caps
    the caching allocator's reserved bytes while plans count allocated bytes: expandable segments
    keep the two close (without them a plan at exactly the budget ran out of memory from
    fragmentation)."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    bench = [a.framefit, "bench-layers", "--json", "--device", device]
    unet_shape, unet_batch = ("3,64,64", "2") if a.quick else ("3,256,256", "32")
    unet = bench + ["--net", "unet", "--input", unet_shape, "--width", "32", "--depth", "4",
                    "--classes", "2"]
    result = {"input": unet_shape, "batch": int(unet_batch), "modes": {}, "largest": [],
              "nets": []}
    # The batch plans first: they check the planner, the costs below only measure.
    if wanted_rows(a, "unet"):
        result["largest"] = largest_batches(run, unet, "256MiB" if a.quick else "8GiB", env)
    if wanted_rows(a, "clips"):
        clip_shape, clip_budget = ("3,8,64,64", "256MiB") if a.quick else ("3,60,230,230", "12GiB")
        result["seed001"] = {"input": clip_shape, "largest": largest_batches(
            run, bench + ["--net", "clip3d", "--input", clip_shape, "--classes", "20"], clip_budget,
            env)}
        r3d_shape, r3d_batch = ("3,4,32,32", "2") if a.quick else ("3,16,112,112", "16")
        r3d = checkpointing_cost(run, bench + ["--net", "r3d_18", "--input", r3d_shape, "--classes",
                                               "400", "--batch", r3d_batch], env)
        result["nets"].append({"net": "r3d_18", "input": r3d_shape, "batch": int(r3d_batch), **r3d})
    if wanted_rows(a, "unet"):
        result.update(checkpointing_cost(run, unet + ["--batch", unet_batch], env))
    print("layers:", json.dumps(result), flush=True)
    return result


def wanted_rows(a, key):
    """Whether --rows selects the row named `key`."""
    return re.search(a.rows, key) is not None


def checkpointing_cost(run, common, env, rounds=3):
    """No checkpointing, the planner at half the activation memory, every stage recomputed;
    interleaved rounds of 5 steps; slowdown = median over rounds of the same-round ratio."""
    common = common + ["--repeat", "5"]
    modes = {"off": [], "half": [], "all": []}
    for _ in range(rounds):
        plain = run(common, env=env)
        if "error" in plain:
            return {"error": plain["error"]}
        half_budget = plain["static_bytes"] + plain["activation_bytes"] // 2
        modes["off"].append(plain)
        modes["half"].append(run(common + ["--checkpoint", "auto", "--budget", str(half_budget)],
                                 env=env))
        modes["all"].append(run(common + ["--checkpoint", "all"], env=env))
    result = {}
    for mode, runs in modes.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            first = runs[0]
            error = first.get("error")
            if first.get("plan_fits") is False:  # the budget is below the least plan
                error = f"no plan fits (least predicted peak {mib(first.get('predicted_peak_bytes'))} MiB)"
            elif first.get("plan_fits"):  # the model or the allocator's margin was wrong
                error = f"out of memory with a plan predicted to fit: {first.get('error')}"
            result[mode] = {"error": error}
            continue
        ratios = [r["step_seconds"] / p["step_seconds"] for r, p in zip(runs, modes["off"])
                  if "error" not in r]
        result[mode] = {"activation_bytes": ok[0]["activation_bytes"],
                        "step_seconds": statistics.median(r["step_seconds"] for r in ok),
                        "time_ratio": statistics.median(ratios),
                        "recomputed": ok[0].get("recomputed")}
    return {"modes": result}


def largest_batches(run, common, budget, env):
    """The planner's CUDA margin (plan::allocator_margin_bytes): the largest batch it plans within
    a budget must run there, with and without expandable segments."""
    rows = []
    for label, alloc_env in (("default allocator", {}), ("expandable segments", env)):
        out = run(common + ["--batch", "0", "--budget", budget, "--checkpoint", "auto", "--repeat",
                            "1"], env=alloc_env, timeout=300)
        tries = out.get("tries") or [{}]
        rows.append({"allocator": label, "budget": budget, "error": out.get("error"),
                     "plan_budget_bytes": out.get("plan_budget_bytes"),
                     "planned_batch": out.get("planned_batch"),
                     "planned_batch_ran": tries[0].get("fits"),
                     "peak_bytes_at_planned": tries[0].get("peak_bytes"),
                     "largest_batch": out.get("largest_batch"),
                     "peak_bytes_at_largest": out.get("peak_bytes"),
                     "predicted_at_largest": out.get("predicted_peak_bytes"),
                     "step_seconds": out.get("step_seconds")})
    return rows


def cost_table(modes, shape, batch):
    lines = [f"Input {shape}, batch {batch}, fp32; 3 interleaved rounds of 5 steps; slowdown = median "
             "over rounds of the same-round ratio to no checkpointing.", "",
             "| checkpointing | activations (MiB) | less memory | step (s) | slowdown |",
             "|---|---:|---:|---:|---:|"]
    base = modes.get("off", {})
    for mode, label in (("off", "off"), ("half", "planner at half the activations"),
                        ("all", "every stage")):
        m = modes.get(mode, {})
        if "error" in m or not m or "activation_bytes" not in base:
            lines.append(f"| {label} | {m.get('error', 'missing')} | | | |")
            continue
        less = base["activation_bytes"] / m["activation_bytes"] if m["activation_bytes"] else 0
        lines.append(f"| {label} | {mib(m['activation_bytes'])} | {less:.2f}x | "
                     f"{m['step_seconds']:.3f} | {m['time_ratio']:.2f}x |")
    return lines


def largest_table(rows):
    lines = ["| allocator | budget | planned within (MiB) | planner's batch | it ran | its peak (MiB) "
             "| largest batch that ran | its peak (MiB) | predicted for it (MiB) | its step (s) |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("error") and not r.get("planned_batch"):
            lines.append(f"| {r['allocator']} | {r['budget']} | {r['error']} | | | | | | | |")
            continue
        step = f"{r['step_seconds']:.2f}" if r.get("step_seconds") else "n/a"
        # The search's steps ran at the largest batch; the measured steps after them may not.
        largest = r["largest_batch"]
        if r.get("error"):
            largest = f"{largest} (then out of memory when measured)"
        lines.append(f"| {r['allocator']} | {r['budget']} | {mib(r['plan_budget_bytes'])} | "
                     f"{r['planned_batch']} | {'yes' if r['planned_batch_ran'] else 'no'} | "
                     f"{mib(r['peak_bytes_at_planned'])} | {largest} | "
                     f"{mib(r.get('peak_bytes_at_largest'))} | {mib(r.get('predicted_at_largest'))} | "
                     f"{step} |")
    return lines


def mib(b):
    return f"{b / 2**20:,.0f}" if b else "n/a"


def write_markdown(out, basename, machine_line, rows, layers, model, size, chunk):
    lines = ["# framefit on one GPU", "", f"Machine: {machine_line}", "",
             f"{model} + LSTM(512) + Linear(7), {size}x{size}, chunk {chunk}, AdamW, BatchNorm in train "
             "mode. Generated by `bench/gpu_bench.py`: each row is one process, one warm-up step, then "
             "the median of its measured steps (3 at T = 256, 1 at T = 2,000). framefit runs in its "
             "default layout (auto: channels-last with BatchNorm) unless the row says NCHW. Peak tensors: the "
             "CUDA caching allocator's peak of allocated bytes (framefit and PyTorch alike).", "",
             "| T | precision | run | step (s) | frames/s | peak tensors (MiB) | peak RSS (MiB) |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['T']} | {r['precision']} | {r['name']} | {r['error']} | | | |")
            continue
        extra = f" (chunk {r['chunk']})" if "planner" in r["name"] else ""
        lines.append(f"| {r['T']} | {r['precision']} | {r['name']}{extra} | {r['step_seconds']:.2f} | "
                     f"{r['T'] / r['step_seconds']:.0f} | {mib(r.get('peak_bytes'))} | "
                     f"{mib(r.get('rss_peak_bytes'))} |")
    lines += ["", "## Ratios", "", "| T | precision | framefit vs fastest chunked peer | vs framefit naive |",
              "|---:|---|---|---|"]
    by = {(r["T"], r["precision"], r["name"]): r for r in rows if "error" not in r}
    for (T, precision, name), r in sorted(by.items()):
        if name != "framefit chunked":
            continue
        peers = [p for (t, pr, n), p in by.items() if t == T and pr == precision
                 and n.startswith("PyTorch") and "naive" not in n]
        naive = by.get((T, precision, "framefit naive"))
        vs_peer = (f"{r['step_seconds'] / min(p['step_seconds'] for p in peers):.2f}x"
                   if peers else "n/a")
        vs_naive = f"{r['step_seconds'] / naive['step_seconds']:.2f}x" if naive else "n/a"
        lines.append(f"| {T} | {precision} | {vs_peer} | {vs_naive} |")
    if "error" in layers:
        lines += ["", "## Layer checkpointing", "", f"failed: {layers['error']}"]
    else:
        if layers.get("modes"):
            lines += ["", "## Layer checkpointing (UNet, width 32, depth 4; allocator with expandable "
                      "segments)", ""]
            lines += cost_table(layers["modes"], layers["input"], layers["batch"])
        if layers.get("largest"):
            lines += ["", "### Largest batch within a budget (the batch planner's CUDA margin: 10%)", "",
                      f"UNet, input {layers['input']}, `bench-layers --batch 0 --checkpoint auto`: the "
                      "planner's batch for the budget less the margin, run under the whole budget, then "
                      "larger batches (or bisection below it).", ""]
            lines += largest_table(layers["largest"])
        for net in layers.get("nets", []):
            lines += ["", f"## Layer checkpointing ({net['net']}, allocator with expandable segments)", "",
                      "Target (issue #6): >= 2x less activation memory for <= 1.35x the step time.", ""]
            lines += (cost_table(net["modes"], net["input"], net["batch"]) if "modes" in net
                      else [f"failed: {net.get('error')}"])
        if layers.get("seed001"):
            seed = layers["seed001"]
            lines += ["", f"## seeds/001 corrected (clip3d): {seed['input']} clips, 20 classes", "",
                      "`bench-layers --net clip3d --batch 0 --checkpoint auto`: the planner's batch for "
                      "the budget less the CUDA margin, run under the whole budget, then larger batches "
                      "(or bisection below it).", ""]
            lines += largest_table(seed["largest"])
    with open(os.path.join(out, basename + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
