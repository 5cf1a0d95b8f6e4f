#!/usr/bin/env bash
# Writes the checkpoints of tests/train/checkpoint_format_test.cpp: run in this folder with a
# framefit built from the commit whose format they keep (0875f54), e.g.
#   FRAMEFIT=/path/to/that/build/src/cli/framefit tests/media/checkpoints/make.sh
# phases/: five videos of per-frame features (6 per frame, phases a, b, c in thirds, each phase
# raising its own dimension; v4 for validation) and a TCN head stopped at step 2.
# segmentation/: four training and two validation 16x16 images with a square of class 1, and a
# UNet (width 4, depth 2) stopped at step 2. Each with its weights as `framefit export` wrote them.
set -euo pipefail
cd "$(dirname "$0")"
framefit=${FRAMEFIT:?the framefit binary of the format to keep}
python=/usr/bin/python3
(cd phases && "$python" - <<'PY'
import torch
torch.manual_seed(7)
rows = ["name,labels,split,features"]
for v in range(5):
    T = 30 + 7 * v
    labels = torch.div(torch.arange(T) * 3, T, rounding_mode="floor")
    f = torch.randn(T, 6) * 0.5
    f[torch.arange(T), labels] += 2
    torch.save(f, f"v{v}.pt")
    with open(f"v{v}.txt", "w") as out:
        out.write("Frame\tPhase\n" + "".join(f"{t}\t{'abc'[int(labels[t])]}\n" for t in range(T)))
    rows.append(f"v{v},v{v}.txt,{'train' if v < 4 else 'val'},v{v}.pt")
open("manifest.csv", "w").write("\n".join(rows) + "\n")
PY
)
(cd segmentation && "$python" - <<'PY'
import os
import numpy as np
from PIL import Image
rng = np.random.default_rng(3)
for split, n in [("train", 4), ("val", 2)]:
    os.makedirs(f"{split}/images", exist_ok=True)
    os.makedirs(f"{split}/masks", exist_ok=True)
    for i in range(n):
        mask = np.zeros((16, 16), np.uint8)
        x, y = rng.integers(0, 8, 2)
        mask[y:y + 8, x:x + 8] = 1
        image = (rng.random((16, 16, 3)) * 60).astype(np.uint8)
        image[mask == 1] = [200, 40, 40]
        Image.fromarray(image).save(f"{split}/images/im{i}.png")
        Image.fromarray(mask).save(f"{split}/masks/im{i}.png")
PY
)
for task in phases segmentation; do
  (cd "$task" && rm -rf run && "$framefit" train --config config.yaml --threads 1 > /dev/null &&
   cp run/checkpoints/step_00000002.pt . &&
   "$framefit" export --checkpoint step_00000002.pt --out step_00000002_weights.pt > /dev/null &&
   rm -rf run)
done
