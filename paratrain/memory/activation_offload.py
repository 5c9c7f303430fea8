"""Activation offload: tensors saved for backward go to host memory and come back when needed.

``torch.autograd.graph.saved_tensors_hooks`` gives the two seams: ``pack`` runs when autograd
saves a tensor in forward, ``unpack`` when backward reads it. Parameters (and views of them) are
not moved: they stay on the device anyway (under ZeRO-3 they are gathered again for backward),
so copying them would only cost bandwidth. Small
tensors (below ``min_bytes``) stay too: a transfer's fixed cost outweighs their bytes.

On CUDA the host copies are pinned and ``non_blocking``, so the device-to-host copy runs on the
copy engine while the CPU keeps queueing the next kernels; the host-to-device copy in backward is
issued when autograd unpacks the tensor. (A dedicated side stream with prefetch of the next
layer's tensors would hide the copies fully; not done here.)

On a CPU device the "device" already is host memory: the hooks still copy (so the code path is
exercised and tested on any machine) but nothing is saved; the trainer says so.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


class ActivationOffload:
    """A context factory: ``with offload(): loss = model(x)`` offloads what that forward saves."""

    def __init__(self, model: nn.Module, *, min_bytes: int = 1024):
        self.model, self.min_bytes = model, min_bytes
        self.offloaded_bytes = 0  # bytes moved to host in the last forward(s) since reset()

    def reset(self) -> None:
        self.offloaded_bytes = 0

    def _is_parameter(self, t: torch.Tensor) -> bool:
        # Read at every pack, not once: ZeRO-3 binds parameters to a unit's gathered buffer only
        # while that unit runs, and DDP/ZeRO may replace storage with flat buffers.
        ptr = t.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self.model.parameters())

    def _pack(self, t: torch.Tensor):
        if t.nbytes < self.min_bytes or self._is_parameter(t):
            return t
        pin = t.device.type == "cuda"
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        self.offloaded_bytes += t.nbytes
        return (t.device, host)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=device.type == "cuda")

    def __call__(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
