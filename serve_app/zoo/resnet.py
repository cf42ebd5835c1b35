"""ResNet-style CNN with basic and bottleneck residual blocks (He et al. 2015).

Pixel normalisation lives inside the graph so that clients send plain
0..1 RGB tensors and cannot get the mean/std wrong.
"""

from __future__ import annotations

import torch
from torch import nn

from serve_app.presets import ResNetConfig

PIXEL_MEAN = (0.5, 0.5, 0.5)
PIXEL_STD = (0.25, 0.25, 0.25)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut = _shortcut(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut = _shortcut(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


class ResNet(nn.Module):
    """image (B, 3, H, W) float32 in [0, 1] -> logits (B, n_classes)."""

    mean: torch.Tensor  # buffers (register_buffer), typed for the checker
    std: torch.Tensor

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        block = BasicBlock if cfg.block == "basic" else Bottleneck
        stem = cfg.widths[0]
        # ImageNet-size inputs get the 7x7/2 stem and max-pool; small ones keep resolution.
        if cfg.image_size >= 128:
            self.stem = nn.Sequential(
                nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
            )
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, stem, 3, 1, 1, bias=False), nn.BatchNorm2d(stem), nn.ReLU(inplace=True))
        stages: list[nn.Module] = []
        c_in = stem
        for i, (n, width) in enumerate(zip(cfg.layers, cfg.widths, strict=True)):
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                stages.append(block(c_in, width, stride))
                c_in = width * block.expansion
        self.stages = nn.Sequential(*stages)
        if cfg.zero_init_residual:
            for b in stages:
                last_norm = b.body[-1]  # type: ignore[index]
                assert isinstance(last_norm, nn.BatchNorm2d)
                nn.init.zeros_(last_norm.weight)
        self.head = nn.Linear(c_in, cfg.n_classes)
        self.register_buffer("mean", torch.tensor(PIXEL_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(PIXEL_STD).view(1, 3, 1, 1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = (image - self.mean) / self.std
        x = self.stages(self.stem(x))  # (B, C, h, w)
        return self.head(x.mean(dim=(2, 3)))


@torch.no_grad()
def calibrate_batchnorm(net: ResNet, image_size: int, batches: int = 4, batch_size: int = 16) -> None:
    """Estimate BatchNorm running statistics from generated images, leaving the weights untrained.

    A freshly initialised net in eval mode normalises nothing (mean 0, var 1), so
    activations grow block after block; a deep preset (ResNet-50) then gives logits in
    the thousands, unlike any real checkpoint, and float32 noise fails the parity check.
    """
    from serve_app.zoo.data import TRAIN_SEED, shapes_dataset

    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration batches
    net.train()
    images, _ = shapes_dataset(batches * batch_size, TRAIN_SEED, image_size)
    for i in range(batches):
        net(torch.from_numpy(images[i * batch_size : (i + 1) * batch_size]))
    net.eval()
