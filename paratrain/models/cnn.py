"""cnn-tiny: a small convolutional classifier with BatchNorm, and its synthetic image task.

It exists to exercise SyncBatchNorm (data_parallel/sync_batchnorm.py): Llama has no BatchNorm.

    image [b, 3, 16, 16]
      -> 3 x (conv 3x3 -> BatchNorm2d -> ReLU), strides 1, 2, 2   # [b, 32, 4, 4]
      -> global average pool -> linear                           # [b, 10] logits

The data set is synthetic and deterministic: each class has a fixed low-frequency pattern, and
row ``r`` of the training stream is its class's pattern plus Gaussian noise, both drawn from a
generator seeded by (seed, r). So the rows of the global batch at step k are the same whatever
the layout, and no file is needed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.models.init import param_seed
from paratrain.models.registry import ModelKind

# What --model cnn-tiny is: no decoder, data parallelism only, fp32 (models/__init__.py registers it).
CNN_KIND = ModelKind("cnn-tiny", decoder=False, tensor_parallel=False, pipeline=False, zero3_units=False,
                     blocks=False, tiling=False, mixed_precision=False)


@dataclass(frozen=True)
class CNNConfig:
    in_channels: int = 3
    image_size: int = 16
    channels: tuple[int, ...] = (16, 32, 32)
    strides: tuple[int, ...] = (1, 2, 2)
    n_classes: int = 10
    noise: float = 1.0  # std of the per-pixel noise added to the class pattern
    pattern_cells: int = 4  # the class pattern is a pattern_cells x pattern_cells grid, upsampled

    def to_dict(self) -> dict:
        return asdict(self)

    def n_params(self) -> int:
        total, c_in = 0, self.in_channels
        for c_out in self.channels:
            total += c_out * c_in * 9 + 2 * c_out  # conv (no bias) + BatchNorm weight and bias
            c_in = c_out
        return total + c_in * self.n_classes + self.n_classes

    def forward_macs(self) -> int:
        """Multiply-accumulates of one image's forward pass (convolutions and the head)."""
        macs, c_in, size = 0, self.in_channels, self.image_size
        for c_out, stride in zip(self.channels, self.strides):
            size = (size - 1) // stride + 1  # 3x3 kernel, padding 1
            macs += size * size * c_out * c_in * 9
            c_in = c_out
        return macs + c_in * self.n_classes


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        # No conv bias: the BatchNorm right after it subtracts any per-channel constant anyway.
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    def __init__(self, cfg: CNNConfig):
        super().__init__()
        c_ins = (cfg.in_channels, *cfg.channels[:-1])
        self.blocks = nn.Sequential(*[ConvBlock(c_in, c_out, stride)
                                      for c_in, c_out, stride in zip(c_ins, cfg.channels, cfg.strides)])
        self.head = nn.Linear(cfg.channels[-1], cfg.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x)  # [b, c, h', w']
        return self.head(h.mean(dim=(2, 3)))  # [b, n_classes]


def full_init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Full initial value of parameter ``name``: a function of (seed, name) only."""
    if name.endswith("bn.weight"):
        return torch.ones(shape)
    if name.endswith(("bn.bias", "head.bias")):
        return torch.zeros(shape)
    fan_in = math.prod(shape[1:])
    # He init for convolutions followed by ReLU; 1/sqrt(fan_in) for the classifier.
    std = math.sqrt(2.0 / fan_in) if name.endswith("conv.weight") else 1.0 / math.sqrt(fan_in)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def reset_buffers(model: nn.Module) -> None:
    """Fresh BatchNorm running statistics (mean 0, variance 1, no batches seen)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            m.reset_running_stats()
