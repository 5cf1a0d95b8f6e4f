#!/usr/bin/env python3
"""framefit manifest for Cholec80 as CAMMA distributes it.

  python3 scripts/cholec80_manifest.py CHOLEC80_DIR [--split 40,8,32] [--frames DIR] [--no-tools] > cholec80.csv

CHOLEC80_DIR holds videos/videoNN.mp4 and phase_annotations/videoNN-phase.txt (one phase per
25 fps frame, as framefit reads them). Videos are assigned to train, val and test in number
order: --split 40,8,32 (TeCNO's split, the default) or 40,0,40 (train on the first 40, test on
the last 40). With --frames DIR, each video is the frame folder DIR/videoNN extracted at 1 fps
(ffmpeg -i videoNN.mp4 -vf fps=1 DIR/videoNN/%05d.jpg): the rows give fps 1 and labels_fps 25,
so each frame takes the phase at its time. The tools column names tool_annotations/videoNN-tool.txt
(tool presence every 25th frame, for data.tools); --no-tools leaves it out. A missing file is an
error naming it.
"""
import argparse
import os
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the Cholec80 folder (videos/, phase_annotations/)")
    parser.add_argument("--split", default="40,8,32",
                        help="videos for train, val and test, in number order (default 40,8,32)")
    parser.add_argument("--frames", default="",
                        help="use the frame folders DIR/videoNN extracted at 1 fps instead of the videos")
    parser.add_argument("--no-tools", action="store_true",
                        help="leave out the tools column (tool_annotations/videoNN-tool.txt)")
    args = parser.parse_args()
    try:
        counts = [int(x) for x in args.split.split(",")]
    except ValueError:
        counts = []
    if len(counts) != 3 or min(counts) < 0 or sum(counts) == 0:
        sys.exit(f"--split: expected three counts such as 40,8,32, got {args.split!r}")
    root = os.path.abspath(args.root)
    frames = os.path.abspath(args.frames) if args.frames else ""
    rows = ["name,video,labels,split,fps,labels_fps" + ("" if args.no_tools else ",tools")]
    missing = []
    number = 0
    for split, count in zip(("train", "val", "test"), counts):
        for _ in range(count):
            number += 1
            name = f"video{number:02d}"
            labels = os.path.join(root, "phase_annotations", f"{name}-phase.txt")
            video = os.path.join(frames, name) if frames else os.path.join(root, "videos", f"{name}.mp4")
            tools = "" if args.no_tools else os.path.join(root, "tool_annotations", f"{name}-tool.txt")
            for path in (video, labels, tools):
                if path and not os.path.exists(path):
                    missing.append(path)
            # A video file's annotation has one line per frame; a 1 fps folder's is at 25 fps.
            rows.append(f"{name},{video},{labels},{split},{'1,25' if frames else ','}" +
                        ("" if args.no_tools else f",{tools}"))
    if missing:
        sys.exit("missing Cholec80 files (" + str(len(missing)) + "): " + ", ".join(missing[:5]) +
                 (" ..." if len(missing) > 5 else ""))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
