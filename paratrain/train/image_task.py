"""The task of the data-parallel example ``cnn-tiny`` (models/cnn.py): synthetic images, one loss
unit per image, BatchNorm buffers (SyncBatchNorm under DP)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.engine.task import Task
from paratrain.models.cnn import CNN, CNNConfig, full_init_value, reset_buffers
from paratrain.models.init import param_seed
from paratrain.sharding import shard_of


class ImageTask(Task):
    """The Task (engine/task.py) for cnn-tiny on synthetic images: loss units are images."""

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
                    rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Images and labels of rows ``rows`` (default: all) of the global batch at ``step``
        (no positions: images are not token rows; every label counts)."""
        return (*self._batch("train", step * global_batch, global_batch, rows), None)

    def val_batch(self, index: int, global_batch: int,
                  rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor, None]:
        return (*self._batch("val", index * global_batch, global_batch, rows), None)
