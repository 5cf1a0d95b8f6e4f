"""Reference outputs from PyTorch/torchvision for framefit's tests (run by Debian's python3).

  reference.py make OUTDIR
      Random-weight resnet18/resnet50 state_dicts (saved as OrderedDicts, the usual way),
      an input batch, and torchvision's logits and features for it, in eval mode; the same for
      the video models r3d_18/r2plus1d_18 with a small clip batch (video_input.pt).
  reference.py check-load ARCH WEIGHTS INPUT EXPECTED
      Loads a state_dict written by framefit into torchvision (strict), runs INPUT through it
      and compares with EXPECTED (framefit's output): exit 0 if within 1e-4 relative.
  reference.py frames OUT T H W
      A uint8 video tensor [T,3,H,W] for the CLI test.
  reference.py check-features ARCH WEIGHTS FRAMES FEATURES
      torchvision features of uint8 FRAMES (normalised with ImageNet statistics) vs FEATURES.
"""
import sys

import torch
import torchvision

IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


VIDEO_ARCHS = ["r3d_18", "r2plus1d_18"]


def build(arch, num_classes=None):
    """Random-weight torchvision model; num_classes defaults to ImageNet's or Kinetics-400's."""
    video = arch in VIDEO_ARCHS
    if num_classes is None:
        num_classes = 400 if video else 1000
    models = torchvision.models.video if video else torchvision.models
    return getattr(models, arch)(weights=None, num_classes=num_classes)


def randomize(model, seed):
    """Non-trivial BatchNorm parameters and statistics, so parity tests see them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                m.num_batches_tracked.fill_(7)
    return model


def features_of(model, x):
    fc = model.fc
    model.fc = torch.nn.Identity()
    try:
        return model(x)
    finally:
        model.fc = fc


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def make(outdir):
    import os
    os.makedirs(outdir, exist_ok=True)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    torch.save(x, f"{outdir}/input.pt")
    for i, arch in enumerate(["resnet18", "resnet50"]):
        torch.manual_seed(i + 1)
        model = randomize(build(arch), seed=i + 10).eval()
        torch.save(model.state_dict(), f"{outdir}/{arch}.pt")  # an OrderedDict
        with torch.no_grad():
            torch.save(model(x), f"{outdir}/{arch}_logits.pt")
            torch.save(features_of(model, x), f"{outdir}/{arch}_features.pt")
        with open(f"{outdir}/{arch}_keys.txt", "w") as f:
            f.write("\n".join(model.state_dict().keys()) + "\n")
    # Clips [N,3,T,H,W]: small, so the 3D convolutions stay quick on two cores.
    torch.manual_seed(5)
    clips = torch.randn(2, 3, 4, 32, 32)
    torch.save(clips, f"{outdir}/video_input.pt")
    for i, arch in enumerate(VIDEO_ARCHS):
        torch.manual_seed(i + 20)
        model = randomize(build(arch), seed=i + 30).eval()
        torch.save(model.state_dict(), f"{outdir}/{arch}.pt")
        with torch.no_grad():
            torch.save(model(clips), f"{outdir}/{arch}_logits.pt")
            torch.save(features_of(model, clips), f"{outdir}/{arch}_features.pt")
        with open(f"{outdir}/{arch}_keys.txt", "w") as f:
            f.write("\n".join(model.state_dict().keys()) + "\n")
    make_torchscript(outdir)
    make_colors(outdir)
    print(f"reference data written to {outdir}")


def make_colors(outdir):
    """uint8 frames and torchvision's colour adjustments of them (ColorJitter's functions)."""
    F = torchvision.transforms.functional
    g = torch.Generator().manual_seed(3)
    frames = (torch.rand(5, 3, 24, 32, generator=g) * 256).to(torch.uint8)
    frames[:, :, :4, :4] = 128  # gray pixels: hue's equal-channel branch
    frames[:, 0, 4:8, :4] = 255  # saturated red: hue near 0 and 1
    torch.save(frames, f"{outdir}/colors_input.pt")
    torch.save(F.adjust_brightness(frames, 1.3), f"{outdir}/colors_brightness.pt")
    torch.save(F.adjust_contrast(frames, 0.6), f"{outdir}/colors_contrast.pt")
    torch.save(F.adjust_saturation(frames, 1.7), f"{outdir}/colors_saturation.pt")
    torch.save(F.adjust_hue(frames, 0.21), f"{outdir}/colors_hue.pt")
    torch.save(F.adjust_hue(frames, -0.37), f"{outdir}/colors_hue_negative.pt")
    # ColorJitter's order [3, 1, 0, 2]: hue, contrast, brightness, saturation.
    x = F.adjust_hue(frames, 0.1)
    x = F.adjust_contrast(x, 1.2)
    x = F.adjust_brightness(x, 0.8)
    torch.save(F.adjust_saturation(x, 0.5), f"{outdir}/colors_sequence.pt")
    # RandomRotation's call: nearest, no expansion, fill 0.
    for name, angle in (("rotated", 7.3), ("rotated_negative", -23.0)):
        torch.save(F.rotate(frames, angle, fill=[0.0, 0.0, 0.0]), f"{outdir}/colors_{name}.pt")


class TinyEncoder(torch.nn.Module):
    """A per-frame encoder with BatchNorm and dropout, scripted for framefit's TorchScript test."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.0)  # random streams differ between Python and C++
        self.fc = torch.nn.Linear(8, 6)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(self.drop(x))


def make_torchscript(outdir):
    """tiny_encoder.pt (torch.jit.save), frames, and the loss and gradients of one training
    forward/backward in float64: features.pow(2).mean() over all frames at once."""
    torch.manual_seed(40)
    model = TinyEncoder().double().train()
    scripted = torch.jit.script(model)
    scripted.save(f"{outdir}/tiny_encoder.pt")
    x = torch.randn(10, 3, 16, 16, dtype=torch.float64)
    torch.save(x, f"{outdir}/tiny_encoder_input.pt")
    loss = scripted(x).pow(2).mean()
    loss.backward()
    ref = {"loss": loss.detach().reshape(1)}
    for name, p in scripted.named_parameters():
        ref["grad." + name] = p.grad
    for name, b in scripted.named_buffers():
        ref["buffer." + name] = b
    torch.save(ref, f"{outdir}/tiny_encoder_reference.pt")


def check_load(arch, weights, inputs, expected):
    state = torch.load(weights)
    model = build(arch, num_classes=state["fc.weight"].shape[0])
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        out = model(torch.load(inputs))
    err = relative_error(torch.load(expected), out)
    print(f"{arch}: relative error {err:.3g} between framefit and torchvision")
    return 0 if err <= 1e-4 else 1


def make_frames(out, t, h, w):
    g = torch.Generator().manual_seed(3)
    torch.save(torch.randint(0, 256, (t, 3, h, w), generator=g, dtype=torch.uint8), out)


def check_features(arch, weights, frames, features):
    model = build(arch)
    model.load_state_dict(torch.load(weights))
    model.eval()
    x = (torch.load(frames).float() / 255 - IMAGENET_MEAN) / IMAGENET_STD
    with torch.no_grad():
        ref = features_of(model, x)
    got = torch.load(features)
    if got.shape != ref.shape:
        print(f"shape {tuple(got.shape)} != torchvision's {tuple(ref.shape)}")
        return 1
    err = relative_error(got, ref)
    print(f"{arch} features: relative error {err:.3g} against torchvision")
    return 0 if err <= 1e-4 else 1


if __name__ == "__main__":
    torch.set_num_threads(2)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "make":
        make(*args)
    elif cmd == "check-load":
        sys.exit(check_load(*args))
    elif cmd == "frames":
        make_frames(args[0], *map(int, args[1:]))
    elif cmd == "check-features":
        sys.exit(check_features(*args))
    else:
        sys.exit(f"unknown command {cmd}")
