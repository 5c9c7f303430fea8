"""MFU's denominator: the peak FLOP/s of the run's devices, never under-estimated.

MFU is the model's FLOP/s over the devices' peak, so it cannot exceed 1 by definition; a figure
above 1 means the peak was measured too low (issue 35: ``mfu 192%`` after the matmul peak was
measured once, at start, on a loaded machine). Three guards keep the denominator an upper bound:

* the measurement is the best of several short windows (``device.measure_matmul_peak``), and the
  best of the process's measurements so far (a process building several runs measures once);
* on a GPU the vendor's published peak is used where the model is known (``perf.hardware``),
  or the measurement where that is higher (e.g. TF32 matmuls running an "fp32" run);
* a step whose model FLOP/s exceeds the peak proves it low: the peak is measured again once (the
  load may have passed) and raised to at least what the step achieved; the row says so
  (``peak_flops_source: "raised"``), and MFU is then at most 1.
"""

from __future__ import annotations

import torch

from paratrain.device import matmul_peak
from paratrain.perf.hardware import published_peak


class PeakFlops:
    """The run's peak FLOP/s (every rank's devices together) and the MFU of a step against it."""

    def __init__(self, device: torch.device, precision: str, world_size: int):
        self.device, self.precision, self.world_size = device, precision, world_size
        measured = matmul_peak(device, precision)
        published = None
        if device.type == "cuda":
            published = published_peak(torch.cuda.get_device_name(device), precision)
        per_rank = max((p for p in (measured, published) if p), default=None)
        self.flops = per_rank * world_size if per_rank else None
        self.source = "published" if published and per_rank == published else "measured"
        self.remeasured = False

    def mfu(self, achieved: float) -> float | None:
        """MFU of a step that achieved `achieved` model FLOP/s (None when no peak is known)."""
        if self.flops is None:
            return None
        if achieved > self.flops:
            self.raise_to(achieved)
        return achieved / self.flops

    def raise_to(self, achieved: float) -> None:
        """A step ran faster than the peak: measure again, once, and keep at least `achieved`."""
        if not self.remeasured:
            self.remeasured = True
            again = matmul_peak(self.device, self.precision, fresh=True)
            self.flops = max(self.flops, (again or 0.0) * self.world_size)
        self.flops = max(self.flops, achieved)
        self.source = "raised"

    def row(self) -> dict:
        """The denominator and where it came from, for a metrics row."""
        return {"peak_flops": self.flops, "peak_flops_source": self.source}
