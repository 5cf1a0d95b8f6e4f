"""The PyTorch recipes framefit is measured against (run by Debian's python3, one per process).

  naive       all frames through the encoder with grad, one backward
  checkpoint  torch.utils.checkpoint per chunk (non-reentrant): the usual expert answer
  etad        ETAD's recipe: chunked forward under no_grad, head forward/backward on the detached
              features, then each chunk re-forwarded with grad and backpropagated with its slice
              of the feature gradient

Model: torchvision ResNet-18/50 (fc removed) + LSTM(512) + Linear(classes), AdamW, random uint8
frames normalised per chunk, per-frame cross-entropy. Prints one JSON object.
"""
import argparse
import json
import resource
import statistics
import time

import torch
import torchvision

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


class Head(torch.nn.Module):
    def __init__(self, dim, classes):
        super().__init__()
        self.lstm = torch.nn.LSTM(dim, 512, batch_first=True)
        self.fc = torch.nn.Linear(512, classes)

    def forward(self, feats):
        return self.fc(self.lstm(feats.unsqueeze(0))[0])[0]


def normalise(frames, channels_last=False, device="cpu"):
    x = (frames.to(device).float() - MEAN.to(device)) / STD.to(device)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", choices=["naive", "checkpoint", "etad"], required=True)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--frames", type=int, required=True)
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--steps", type=int, default=1, help="measured steps after one warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--classes", type=int, default=7)
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda: frames stay on the host as uint8; each chunk is moved over")
    p.add_argument("--channels-last", action="store_true",
                   help="encoder and its input in channels-last (NHWC) memory format")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    encoder = getattr(torchvision.models, a.model)(weights=None)
    dim = encoder.fc.in_features
    encoder.fc = torch.nn.Identity()
    if a.channels_last:
        encoder = encoder.to(memory_format=torch.channels_last)
    head = Head(dim, a.classes)
    encoder.to(a.device)
    head.to(a.device)
    opt = torch.optim.AdamW(list(encoder.parameters()) + list(head.parameters()), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 256, (a.frames, 3, a.size, a.size), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, a.classes, (a.frames,), generator=g).to(a.device)
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    chunks = [(b, min(a.frames, b + a.chunk)) for b in range(0, a.frames, a.chunk)]
    amp = torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16,
                         enabled=a.precision == "bf16")

    def step():
        opt.zero_grad(set_to_none=True)
        if a.recipe == "naive":
            with amp:
                feats = encoder(normalise(frames, a.channels_last, a.device))
            loss = torch.nn.functional.cross_entropy(head(feats.float()), labels)
            loss.backward()
        elif a.recipe == "checkpoint":
            from torch.utils.checkpoint import checkpoint
            with amp:
                feats = torch.cat([checkpoint(encoder, normalise(frames[b:e], a.channels_last, a.device), use_reentrant=False)
                                   for b, e in chunks])
            loss = torch.nn.functional.cross_entropy(head(feats.float()), labels)
            loss.backward()
        else:
            with torch.no_grad(), amp:
                feats = torch.cat([encoder(normalise(frames[b:e], a.channels_last, a.device)).float() for b, e in chunks])
            feats.requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(head(feats), labels)
            loss.backward()
            for b, e in reversed(chunks):
                with amp:
                    out = encoder(normalise(frames[b:e], a.channels_last, a.device))
                out.float().backward(feats.grad[b:e])
        opt.step()
        return loss.item()

    step()  # warm-up
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    print(json.dumps({
        "recipe": a.recipe, "frames": a.frames, "size": a.size, "chunk": a.chunk,
        "precision": a.precision, "channels_last": a.channels_last, "step_seconds": seconds, "frames_per_second": a.frames / seconds,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        # On CUDA the caching allocator's peak of allocated tensor bytes (framefit's tracker
        # reads the same counter there); the CPU has no such counter.
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "device": a.device,
        "loss": loss, "threads": torch.get_num_threads(), "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
