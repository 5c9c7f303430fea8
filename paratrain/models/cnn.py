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

from paratrain.models.llama import param_seed
from paratrain.sharding import shard_of


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


class ImageTask:
    """The Task protocol (train/task.py) for cnn-tiny on synthetic images: loss units are images."""

    name = "image"
    units_per_row = 1

    def __init__(self, cfg, model_cfg: CNNConfig | None = None):
        self.model_cfg = model_cfg or CNNConfig()
        self.seed = cfg.train.seed
        self.n_params = self.model_cfg.n_params()
        self.flops_per_unit = 6.0 * self.model_cfg.forward_macs()  # forward + backward = 3 x 2 FLOPs/MAC
        self.patterns = self._class_patterns()  # [n_classes, c, size, size]

    # -- model ---------------------------------------------------------------------------------

    def build_model(self, device: torch.device | str) -> nn.Module:
        with torch.device(device):
            return CNN(self.model_cfg)

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        model.to_empty(device=device)
        reset_buffers(model)

    @torch.no_grad()
    def init_weights(self, model: nn.Module, seed: int) -> None:
        for name, p in model.named_parameters():
            spec = shard_of(p)
            p.copy_(spec.slice(full_init_value(name, spec.full_shape, seed)).to(p.device, p.dtype))
        reset_buffers(model)

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, reduction="sum")

    # -- data ----------------------------------------------------------------------------------

    def _class_patterns(self) -> torch.Tensor:
        c = self.model_cfg
        gen = torch.Generator().manual_seed(param_seed(self.seed, "cnn-tiny/class-patterns"))
        coarse = torch.randn(c.n_classes, c.in_channels, c.pattern_cells, c.pattern_cells, generator=gen)
        # Low-frequency patterns (blocks of pixels) so that convolutions have something to find.
        return F.interpolate(coarse, size=(c.image_size, c.image_size), mode="nearest")

    def _sample(self, stream: str, index: int) -> tuple[torch.Tensor, int]:
        c = self.model_cfg
        gen = torch.Generator().manual_seed(param_seed(self.seed, f"cnn-tiny/{stream}/{index}"))
        label = int(torch.randint(c.n_classes, (1,), generator=gen))
        noise = torch.randn(c.in_channels, c.image_size, c.image_size, generator=gen)
        return self.patterns[label] + c.noise * noise, label

    def _batch(self, stream: str, first: int, global_batch: int, rows: slice | None):
        positions = range(first, first + global_batch)[rows or slice(None)]
        samples = [self._sample(stream, p) for p in positions]
        x = torch.stack([s[0] for s in samples])  # [b, c, size, size]
        y = torch.tensor([s[1] for s in samples], dtype=torch.long)  # [b]
        return x, y

    def train_batch(self, step: int, global_batch: int,
                    rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and labels of rows ``rows`` (default: all) of the global batch at ``step``."""
        return self._batch("train", step * global_batch, global_batch, rows)

    def val_batch(self, index: int, global_batch: int,
                  rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch("val", index * global_batch, global_batch, rows)
