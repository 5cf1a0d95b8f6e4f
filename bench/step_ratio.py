"""The chunked step's time against framefit's naive step, measured alone and over more rounds
than bench/step_bench.py gives it (the issue's target: <= 1.35x where naive fits). ResNet-18 +
LSTM(512) + Linear(7), 112x112 frames, chunk 32 (or the chunks given), keep 1, fp32, framefit's
default layout: the step benchmark's rows. Writes bench/results/<name>.{md,json} (step_ratio).

  /usr/bin/python3 bench/step_ratio.py                       # T = 256 (7 rounds), 1024 (5)
  /usr/bin/python3 bench/step_ratio.py --lengths 256 --rounds 3
  /usr/bin/python3 bench/step_ratio.py --lengths 1024,2048 --chunks 32,64 --name step_ratio_chunks
  /usr/bin/python3 bench/step_ratio.py --in-process --lengths 1024,2048 --name step_ratio_inprocess
  /usr/bin/python3 bench/step_ratio.py --pool   # every recorded round, no new runs
  /usr/bin/python3 bench/step_ratio.py --lengths 1024,2048 --rounds 3 --budgets 2GiB,4GiB \
      --name step_ratio_budgets   # and the planner's choice (chunk, keep) within each budget

Each run is its own process (`framefit bench-step`, one warm-up step, then the median of 3
measured steps at T <= 256, 1 beyond). Within a round naive and each chunk size run back to
back, in alternating order from round to round, and the round's ratio is chunked / naive; the
median of the rounds' ratios is reported, so that drift of a shared machine between rounds
cancels. With --in-process, one process per T and chunk runs both (`bench-step --versus-naive`:
after a warm-up of each, naive and chunked steps alternate, order swapped every pair, each timed
step after one of its own mode), so a round's two steps are seconds apart rather than a process
apart. With --budgets, each round also runs the planner's choice within each budget
(`--chunk auto --budget B`: the chunk and how many chunks' graphs are kept), the time such a
budget buys back; the --pool rows leave these out (they are not the fixed chunk's rounds).
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_bench import ROOT, framefit, machine, mib  # noqa: E402

SEPARATE_METHOD = ("every run its own process (one warm-up step, then the median of the measured "
                   "steps); within a round naive and chunked back to back, order alternating "
                   "between rounds")
IN_PROCESS_METHOD = ("one process per T and chunk (`bench-step --versus-naive`): after a warm-up "
                     "of each, a round is one naive and one chunked step, order swapped every "
                     "round, each timed step after one of its own mode")


def recorded_rounds(out):
    """Every recorded round's chunked / naive ratio, by (T, chunk): the step_ratio*.json files
    and the step benchmark's framefit rows (its rounds pair by index; a naive run measured once
    pairs with every chunked round)."""
    pooled = {}
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name.startswith("step_ratio") and name.endswith(".json") and "pooled" not in name:
            data = json.load(open(path))
            for row in data["rows"]:
                if "budget" in row:
                    continue  # the planner's choice within a budget, not a fixed chunk's rounds
                if "cold switch" in row.get("method", ""):
                    continue  # step_ratio_inprocess_cold: measures the order effect, not the ratio
                key = (row["T"], row.get("chunk", data.get("chunk")), row.get("method", "processes"))
                pooled.setdefault(key, []).extend((x, name) for x in row["ratios"])
    for bench in sorted(n for n in os.listdir(out) if n.startswith("step_bench") and n.endswith(".json")):
        rows = json.load(open(os.path.join(out, bench)))["rows"]
        by_name = {(r["T"], r["name"]): r for r in rows if r.get("precision") == "fp32"}
        for (T, name), chunked in sorted(by_name.items()):
            naive = by_name.get((T, "framefit naive"))
            if name != "framefit chunked" or naive is None:
                continue
            n, c = naive["round_seconds"], chunked["round_seconds"]
            pairs = zip(n, c) if len(n) == len(c) else ((n[0], x) for x in c) if len(n) == 1 else []
            pooled.setdefault((T, chunked["chunk"], "processes"), []).extend(
                (y / x, bench) for x, y in pairs)
    return pooled


def pool(out):
    pooled = recorded_rounds(out)
    lines = [
        "# Chunked step vs naive step: every recorded round", "",
        "Pooled by `bench/step_ratio.py --pool` from the rounds in `bench/results/step_ratio*.json` "
        "and `step_bench*.json` (framefit's rows; each file names its machine and its run): "
        "ResNet-18 + LSTM(512) + Linear(7), 112x112, fp32, keep 1. Each round's ratio is chunked / "
        "naive measured back to back, in two processes (method \"processes\") or alternating in one "
        "(\"in-process\", `bench-step --versus-naive`); the runs are from different sessions on the same shared 2-core "
        "machine, so the median over all of them is less at the mercy of one noisy run.", "",
        "| T | chunk | method | rounds | median | range | rounds <= 1.35x | target <= 1.35x (median) "
        "| files |",
        "|---:|---:|---|---:|---:|---|---:|---|---|",
    ]
    result = []
    for (T, chunk, method), items in sorted(pooled.items()):
        ratios = [x for x, _ in items]
        median = statistics.median(ratios)
        files = sorted({f for _, f in items})
        result.append({"T": T, "chunk": chunk, "method": method, "ratios": ratios, "median_ratio": median,
                       "files": files})
        lines.append(f"| {T} | {chunk} | {method} | {len(ratios)} | {median:.2f}x | {min(ratios):.2f}-"
                     f"{max(ratios):.2f}x | {sum(x <= 1.35 for x in ratios)} of {len(ratios)} | "
                     f"{'met' if median <= 1.35 else 'not met'} | {', '.join(files)} |")
    with open(os.path.join(out, "step_ratio_pooled.json"), "w") as f:
        json.dump({"rows": result}, f, indent=1)
    with open(os.path.join(out, "step_ratio_pooled.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def chosen(result):
    """What a run with the planner's choice ran with."""
    if result["chunk"] == 0:
        return "naive"
    return (f"chunk {result['chunk']}, keep {result['keep']}"
            + (", BatchNorm recomputed" if result.get("recompute_norm") else ""))


def label(config, result):
    """A run's configuration as the progress lines name it: the chunk, or the budget and what
    the planner chose within it."""
    return f"{config}: {chosen(result)}" if isinstance(config, str) else f"chunk {config}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1024", help="comma-separated T values")
    ap.add_argument("--rounds", type=int, help="rounds per T (default: 7 at T <= 256, else 5)")
    ap.add_argument("--chunks", default="32", help="comma-separated chunk sizes (32: the step "
                    "benchmark's, where the PyTorch peers are measured)")
    ap.add_argument("--name", default="step_ratio", help="output file name, without extension")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--in-process", action="store_true",
                    help="naive and chunked steps alternating in one process per T and chunk")
    ap.add_argument("--budgets", default="", help="comma-separated budgets (e.g. 2GiB,4GiB): "
                    "each round also runs the planner's choice within each (--chunk auto)")
    ap.add_argument("--pool", action="store_true",
                    help="pool every recorded round from --out (no new runs) into step_ratio_pooled")
    a = ap.parse_args()
    if a.pool:
        return pool(a.out)
    machine_line = machine()
    print(machine_line, flush=True)
    chunks = [int(x) for x in a.chunks.split(",")]
    budgets = [x for x in a.budgets.split(",") if x]
    if budgets and a.in_process:
        sys.exit("--budgets runs separate processes: leave out --in-process")
    rows = []
    for T in [int(x) for x in a.lengths.split(",")]:
        steps = 3 if T <= 256 else 1
        rounds = a.rounds or (7 if T <= 256 else 5)
        if a.in_process:
            for chunk in chunks:
                result = framefit(T, chunk, rounds, extra=("--versus-naive",))
                if "error" in result:
                    sys.exit(f"T={T} chunk {chunk}: {result['error']}")
                pairs = result["pairs"]
                ratios = [p["chunked_seconds"] / p["naive_seconds"] for p in pairs]
                print(f"T={T} chunk {chunk}: " + ", ".join(f"{x:.3f}x" for x in ratios), flush=True)
                rows.append({
                    "T": T, "chunk": chunk, "method": "in-process", "rounds": rounds, "steps": 1,
                    "ratios": ratios, "median_ratio": statistics.median(ratios),
                    "naive_seconds": [p["naive_seconds"] for p in pairs],
                    "chunked_seconds": [p["chunked_seconds"] for p in pairs],
                    # Tracked peak: the chunked steps'; RSS: the process's, naive included.
                    "naive_peak_bytes": 0, "chunked_peak_bytes": result["peak_bytes"],
                    "naive_rss_bytes": 0, "chunked_rss_bytes": result["rss_peak_bytes"],
                })
            continue
        # A configuration is a fixed chunk (0: naive) or a budget the planner chooses within.
        configs = [0] + chunks + budgets
        runs = {c: [] for c in configs}
        for r in range(rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for config in order:
                if isinstance(config, str):
                    result = framefit(T, "auto", steps, extra=("--budget", config))
                else:
                    result = framefit(T, config, steps)
                if "error" in result:
                    sys.exit(f"T={T} {config}: {result['error']}")
                runs[config].append(result)
            naive_s = runs[0][-1]["step_seconds"]
            print(f"T={T} round {r + 1}: naive {naive_s:.2f} s, " + ", ".join(
                f"{label(c, runs[c][-1])} {runs[c][-1]['step_seconds']:.2f} s "
                f"({runs[c][-1]['step_seconds'] / naive_s:.3f}x)" for c in configs[1:]), flush=True)
        for config in chunks + budgets:
            naive, chunked = runs[0], runs[config]
            ratios = [c["step_seconds"] / n["step_seconds"] for n, c in zip(naive, chunked)]
            row = {"T": T}
            if isinstance(config, str):
                row.update(budget=config, chosen=[chosen(c) for c in chunked])
            else:
                row["chunk"] = config
            row.update({
                "rounds": rounds, "steps": steps, "ratios": ratios,
                "median_ratio": statistics.median(ratios),
                "naive_seconds": [n["step_seconds"] for n in naive],
                "chunked_seconds": [c["step_seconds"] for c in chunked],
                "naive_peak_bytes": naive[0]["peak_bytes"],
                "chunked_peak_bytes": max(c["peak_bytes"] for c in chunked),
                "naive_rss_bytes": max(n["rss_peak_bytes"] for n in naive),
                "chunked_rss_bytes": max(c["rss_peak_bytes"] for c in chunked),
            })
            rows.append(row)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name + ".json"), "w") as f:
        json.dump({"machine": machine_line, "chunks": chunks, "rows": rows}, f, indent=1)
    lines = [
        "# Chunked step vs naive step (framefit alone)", "",
        f"Machine: {machine_line}", "",
        "ResNet-18 + LSTM(512) + Linear(7), 112x112 frames, fp32, AdamW, BatchNorm in train mode, "
        f"framefit's default layout; chunked: chunk {a.chunks}, keep 1 (the last chunk's graph "
        "kept, the others recomputed)" + (f"; and the planner's choice within {', '.join(budgets)} "
        "(`--chunk auto --budget B`: chunk and keep as the rows say)" if budgets else "") +
        ". Generated by `bench/step_ratio.py`: " + (IN_PROCESS_METHOD
        if a.in_process else SEPARATE_METHOD) + "; ratio = chunked / naive within the round, "
        "reported as the median over rounds. Peak tensor memory from the tracking allocator, peak "
        "RSS the highest of the runs" + (" (in one process: naive's included)" if a.in_process
                                          else "") + ".", "",
        "| T | chunk | rounds | naive step (s), median | chunked step (s), median | chunked / naive: median "
        "(range) | target <= 1.35x | peak tensors naive / chunked (MiB) | peak RSS naive / chunked "
        "(MiB) |",
        "|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in rows:
        what = r["chunk"] if "budget" not in r else "planner in " + r["budget"] + ": " + ", ".join(
            sorted(set(r["chosen"])))
        lines.append(
            f"| {r['T']} | {what} | {r['rounds']} | {statistics.median(r['naive_seconds']):.2f} | "
            f"{statistics.median(r['chunked_seconds']):.2f} | {r['median_ratio']:.2f}x "
            f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) | "
            f"{'met' if r['median_ratio'] <= 1.35 else 'not met'} | "
            f"{mib(r['naive_peak_bytes'])} / {mib(r['chunked_peak_bytes'])} | "
            f"{mib(r['naive_rss_bytes'])} / {mib(r['chunked_rss_bytes'])} |")
    lines += ["", "Per round (chunked / naive): " + "; ".join(
        f"T={r['T']}, " + (f"chunk {r['chunk']}" if "budget" not in r else r["budget"]) + ": " + ", ".join(f"{x:.2f}" for x in r["ratios"]) for r in rows), ""]
    with open(os.path.join(a.out, a.name + ".md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
