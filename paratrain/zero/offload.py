"""Where the fp32 master shard and the AdamW moments live, and where they are stepped.

Every ZeRO stage hands its optimizer a list of flat fp32 *master shards* (one per flat buffer,
``[shard]`` each), cut into *pieces* that share a weight decay. A store owns those tensors and
steps them with AdamW; three stores, one per ``--offload`` value:

* ``DeviceStore`` (``none``): masters and moments on the compute device, ``torch.optim.AdamW``
  (``foreach=False``, the per-tensor loop whose elementwise arithmetic is that of the
  single-process optimizer, so a slice steps bit for bit like the whole tensor).
* ``HostStore`` (``cpu``, ZeRO-Offload): a separate host copy, pinned where CUDA; the gradient
  shard is copied to the host, stepped there, and the updated master copied back, explicitly. On a
  CPU-only machine this moves nothing physically, but the state is a separate buffer, counted as
  offloaded, never aliased with the compute parameters.
* ``DiskStore`` (``disk``, ZeRO-Infinity's NVMe idea): the master and both moments are ``np.memmap``
  files in a working folder of this process under ``offload_dir`` (``offload_folder``); the step
  streams them through memory ``chunk`` elements at a time
  (map a window, step it, flush, unmap), so resident optimizer memory is ``3 * 4 * chunk`` bytes
  whatever the model size. ``max_resident_bytes`` records it; tests assert it. The files are
  created empty (sparse zeros) and each master written with ``write_master``, one at a time, so
  ZeRO-3 can stream its masters in as it builds them and never hold them all (fsdp.py). The
  gradient may stay half precision: each window is converted to fp32 on its own.

All three call the same per-element AdamW (``torch.optim.adam.adam``, decoupled decay), so the
three ``--offload`` settings produce identical weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.optim.adam import adam as adam_step

import paratrain.scratch as scratch
from paratrain.base.strategy import OptimizerSettings
from paratrain.comm.collectives import nbytes
from paratrain.zero.base_stream import BASE_FILES
from paratrain.zero.recipe import OptimizerRecipe

MOMENTS = ("exp_avg", "exp_avg_sq")
#: Elements per streamed window of the disk store (4 MiB per file at fp32). Small enough to bound
#: resident memory, large enough that the per-window Python overhead is negligible.
DISK_CHUNK = 1 << 20
#: The disk stores' working folders under --offload-dir: DIR/paratrain-offload-<pid>-<random>/, one per
#: rank (its own pid), holding only the rank's shard files (DiskStore's *.f32, DiskStore8's *.bin)
#: and a streamed LoRA base's (zero/base_stream.py).
OFFLOAD = scratch.Kind(prefix="paratrain-offload-",
                       files=("rank*_shard*_*.f32", "rank*_shard*_*.bin", BASE_FILES))


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of master shard ``index``, all with the same weight decay."""

    index: int
    start: int
    end: int
    weight_decay: float
    group: int = 0  # the user's param group this piece was cut from (OptimizerRecipe)


def _hparams(optim_cfg) -> dict:
    o = optim_cfg
    return {"beta1": o.beta1, "beta2": o.beta2, "eps": o.eps}



class DeviceStore:
    """Masters + moments on the compute device, stepped by torch AdamW (no offload)."""

    location = "device"
    max_resident_bytes: int | None = None  # nothing on disk (base.strategy.StateStore)

    def __init__(self, masters: list[torch.Tensor], pieces: list[Piece], optim_cfg, *,
                 aliased: bool = False):
        # aliased: the masters *are* the fp32 compute parameters (fp32 without offload), so they
        # are counted under parameters, not again under optimizer state.
        self.masters, self.pieces, self.aliased = masters, pieces, aliased
        self.views = [nn.Parameter(masters[pc.index][pc.start:pc.end], requires_grad=False) for pc in pieces]
        # The user's own optimizer class and groups (library), or AdamW from the OptimConfig (CLI).
        self.recipe = optim_cfg if isinstance(optim_cfg, OptimizerRecipe) else None
        if self.recipe is not None:
            self.optimizer = self.recipe.build(self.views, [pc.group for pc in pieces])
        else:
            o = optim_cfg
            groups = [{"params": [v], "weight_decay": pc.weight_decay} for v, pc in zip(self.views, pieces)]
            self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                               foreach=False)
        self.steps = 0

    def step(self, grads: list[torch.Tensor], lr: float | None, outs: list[torch.Tensor | None]) -> None:
        """grads[i]: fp32 gradient shard of master i (device); outs[i]: where the updated values go.
        lr None: keep the groups' own settings (a recipe takes the user's current ones)."""
        for v, pc in zip(self.views, self.pieces):
            v.grad = grads[pc.index][pc.start:pc.end]
        if self.recipe is not None:
            self.recipe.apply(self.optimizer, [pc.group for pc in self.pieces])
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        for v in self.views:
            v.grad = None
        self.steps += 1
        for master, out in zip(self.masters, outs):
            if out is not None and out.data_ptr() != master.data_ptr():
                out.copy_(master)

    def read(self, index: int, which: str) -> torch.Tensor:
        """Master shard ``index`` ("param") or one of its moments, fp32 on the CPU."""
        if which == "param":
            return self.masters[index].detach().float().cpu()
        out = torch.zeros(self.masters[index].numel())
        for v, pc in zip(self.views, self.pieces):
            if pc.index == index and which in self.optimizer.state.get(v, {}):
                out[pc.start:pc.end] = self.optimizer.state[v][which].cpu()
        return out

    @torch.no_grad()
    def write(self, index: int, which: str, values: torch.Tensor, step: int | None = None) -> None:
        if which == "param":
            self.masters[index].copy_(values)
            return
        for v, pc in zip(self.views, self.pieces):
            if pc.index != index:
                continue
            st = self.optimizer.state[v]
            if which not in st:  # optimizers create their state lazily: create it, or it is lost
                st[which] = torch.zeros_like(v)
            st["step"] = torch.tensor(float(step if step is not None else self.steps))
            st[which].copy_(values[pc.start:pc.end])
        if step is not None:
            self.steps = step

    def state_keys(self) -> list[str]:
        """Per-element state tensors the optimizer holds (beyond the master)."""
        return sorted({k for v in self.views for k, t in self.optimizer.state.get(v, {}).items()
                       if torch.is_tensor(t) and t.shape == v.shape and v.dim() > 0})

    def scalars(self) -> dict[str, torch.Tensor]:
        """Per-parameter scalar state (step counts, NAdam's mu product): the same for every piece."""
        for v in self.views:
            st = self.optimizer.state.get(v, {})
            if st:
                keys = self.state_keys()
                return {k: t.clone() if torch.is_tensor(t) else t for k, t in st.items() if k not in keys}
        return {}

    def set_scalars(self, values: dict) -> None:
        for v in self.views:
            st = self.optimizer.state[v]
            for k, t in values.items():
                st[k] = t.clone() if torch.is_tensor(t) else t

    def bytes(self) -> dict[str, int]:
        moments = sum(nbytes(t) for st in self.optimizer.state.values() for k, t in st.items()
                      if k in MOMENTS or (self.recipe is not None and torch.is_tensor(t) and t.dim() > 0))
        masters = 0 if self.aliased else sum(nbytes(m) for m in self.masters)
        return {"device": masters + moments, "host": 0, "disk": 0}


class HostStore(DeviceStore):
    """ZeRO-Offload: masters and moments in (pinned, where CUDA) host memory, stepped there."""

    location = "host"

    def __init__(self, masters: list[torch.Tensor], pieces: list[Piece], optim_cfg, **_):
        pin = torch.cuda.is_available()
        host = [m.detach().to("cpu", torch.float32, copy=True) for m in masters]
        if pin:
            host = [h.pin_memory() for h in host]
        super().__init__(host, pieces, optim_cfg, aliased=False)

    def step(self, grads: list[torch.Tensor], lr: float, outs: list[torch.Tensor]) -> None:
        # Gradients device -> host, AdamW on the host, updated masters host -> device (in outs).
        host_grads = [g.to("cpu", torch.float32, non_blocking=True) for g in grads]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        super().step(host_grads, lr, outs)

    def bytes(self) -> dict[str, int]:
        return {"device": 0, "host": super().bytes()["device"], "disk": 0}


class DiskStore:
    """ZeRO-Infinity style: master + moments in memory-mapped files, stepped ``chunk`` at a time."""

    location = "disk"
    FILES = ("param", *MOMENTS)

    def __init__(self, sizes: list[int], pieces: list[Piece], optim_cfg, *, directory: str, rank: int,
                 chunk: int | None = None):
        """Create the (sparse, all-zero) files for master shards of ``sizes`` elements; the masters
        are then written one at a time (``write_master``), so the caller may build them one by one."""
        self.pieces, self.hp, self.chunk = pieces, self._hyper(optim_cfg), chunk or DISK_CHUNK
        self.sizes = list(sizes)
        self.steps = 0
        self.max_resident_bytes = 0  # largest host window held (all three files during a step)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.paths = {(i, w): self.dir / f"rank{rank:03d}_shard{i:03d}_{w}.f32"
                      for i in range(len(sizes)) for w in self.FILES}
        for i in range(len(sizes)):
            for w in self.FILES:
                # Sparse files of zeros: the moments start at zero without writing a byte.
                with open(self.paths[i, w], "wb") as f:
                    f.truncate(self.sizes[i] * 4)

    _hyper = staticmethod(_hparams)

    def write_master(self, index: int, master: torch.Tensor) -> None:
        """Write fp32 master shard ``index`` window by window (one mapped window resident at a time)."""
        for a in range(0, self.sizes[index], self.chunk):
            b = min(a + self.chunk, self.sizes[index])
            self.max_resident_bytes = max(self.max_resident_bytes, 4 * (b - a))
            with self._window(index, "param", a, b) as w:
                w.copy_(master[a:b].detach().float().cpu())

    def _window(self, index: int, which: str, a: int, b: int) -> Window:
        return Window(self.paths[index, which], a, b)

    def step(self, grads: list[torch.Tensor], lr: float, outs: list[torch.Tensor],
             scale: float = 1.0) -> None:
        """``grads`` may be half precision: each window is converted to fp32 (and multiplied by
        ``scale``, the clip/unscale factor) on its own, so no whole fp32 gradient copy ever exists."""
        step_no = self.steps
        for pc in self.pieces:
            for a in range(pc.start, pc.end, self.chunk):
                b = min(a + self.chunk, pc.end)
                self._step_window(pc, a, b, grads[pc.index], lr, step_no, outs[pc.index], scale)
        self.steps += 1

    def _step_window(self, pc: Piece, a: int, b: int, grad, lr, step_no, out, scale: float) -> None:
        with self._window(pc.index, "param", a, b) as p, self._window(pc.index, "exp_avg", a, b) as m, \
                self._window(pc.index, "exp_avg_sq", a, b) as v:
            self.max_resident_bytes = max(self.max_resident_bytes, 3 * 4 * (b - a))
            # The step counter is per call (AdamW increments it before use): give it step_no.
            step_t = torch.tensor(float(step_no))
            g = grad[a:b].to("cpu", torch.float32)  # fp32 in fp32 out: a view, scaled as before in place
            adam_step([p], [g.mul_(scale) if scale != 1.0 else g], [m], [v], [], [step_t], foreach=False,
                      decoupled_weight_decay=True, amsgrad=False, lr=lr, weight_decay=pc.weight_decay,
                      maximize=False, **self.hp)
            if out is not None:
                out[a:b].copy_(p)

    def read(self, index: int, which: str) -> torch.Tensor:
        with self._window(index, which, 0, self.sizes[index]) as w:
            return w.clone()

    def write(self, index: int, which: str, values: torch.Tensor, step: int | None = None) -> None:
        with self._window(index, which, 0, self.sizes[index]) as w:
            w.copy_(values)
        if step is not None:
            self.steps = step

    def bytes(self) -> dict[str, int]:
        return {"device": 0, "host": 0, "disk": len(self.FILES) * 4 * sum(self.sizes)}

    def state_keys(self) -> list[str] | tuple[str, ...]:
        """AdamW's two moments, one file each."""
        return MOMENTS

    def scalars(self) -> dict:
        """AdamW's step count is ``steps``, saved as the checkpoint's optimizer step: nothing else."""
        return {}

    def set_scalars(self, values: dict) -> None:
        """Nothing to set (``scalars``)."""


class RecipeDiskStore(DiskStore):
    """Disk offload for the user's own optimizer class: one file per per-element state tensor (learnt
    from the class, e.g. SGD's momentum_buffer, Adagrad's sum), stepped ``chunk`` elements at a time
    by an instance of that class over the mapped window; per-piece scalars (step counts) in memory."""

    def __init__(self, sizes: list[int], pieces: list[Piece], recipe: OptimizerRecipe, *, directory: str,
                 rank: int, chunk: int | None = None):
        self.recipe = recipe
        self.keys = {g: recipe.state_keys(g) for g in {pc.group for pc in pieces}}
        self.FILES = ("param", *sorted({k for ks in self.keys.values() for k in ks}))
        self.piece_scalars: list[dict] = [{} for _ in pieces]
        super().__init__(sizes, pieces, recipe, directory=directory, rank=rank, chunk=chunk)

    @staticmethod
    def _hyper(recipe) -> dict:
        return {}  # the recipe's groups carry them

    def step(self, grads: list[torch.Tensor], lr: float, outs: list[torch.Tensor],
             scale: float = 1.0) -> None:
        new_scalars = []
        for k, pc in enumerate(self.pieces):
            for a in range(pc.start, pc.end, self.chunk):
                b = min(a + self.chunk, pc.end)
                after = self._recipe_window(k, pc, a, b, grads[pc.index], outs[pc.index], scale)
            new_scalars.append(after if pc.end > pc.start else self.piece_scalars[k])
        self.piece_scalars = new_scalars  # every window of a piece started from the same scalars
        self.steps += 1

    def _recipe_window(self, k: int, pc: Piece, a: int, b: int, grad, out, scale: float) -> dict:
        keys = self.keys[pc.group]
        with contextlib.ExitStack() as stack:
            p = stack.enter_context(self._window(pc.index, "param", a, b))
            state = {key: stack.enter_context(self._window(pc.index, key, a, b)) for key in keys}
            self.max_resident_bytes = max(self.max_resident_bytes, (1 + len(keys)) * 4 * (b - a))
            param = nn.Parameter(p, requires_grad=False)  # shares the mapped window
            g = grad[a:b].to("cpu", torch.float32)
            param.grad = g.mul_(scale) if scale != 1.0 else g
            opt = self.recipe.build([param], [pc.group])
            if self.steps > 0:  # before the first step the class creates its own state, as unsharded
                opt.state[param].update({**{key: t.clone() if torch.is_tensor(t) else t
                                            for key, t in self.piece_scalars[k].items()}, **state})
            with torch.no_grad():
                opt.step()
            st = opt.state[param]
            for key in keys:
                if st[key].data_ptr() != state[key].data_ptr():
                    state[key].copy_(st[key])
            if out is not None:
                out[a:b].copy_(p)
            return {key: t for key, t in st.items() if key not in keys}

    def state_keys(self) -> list[str]:
        return list(self.FILES[1:])

    def scalars(self) -> dict:
        return dict(self.piece_scalars[0]) if self.piece_scalars else {}

    def set_scalars(self, values: dict) -> None:
        self.piece_scalars = [dict(values) for _ in self.pieces]


class Window:
    """A mapped window [a, b) of a file of ``dtype`` elements (float32 unless said), as a torch
    tensor; flushed and unmapped on exit, so its pages leave this process's resident set."""

    def __init__(self, path: Path, a: int, b: int, dtype: torch.dtype = torch.float32):
        self.path, self.a, self.b, self.dtype = path, a, b, dtype

    def __enter__(self) -> torch.Tensor:
        np_dtype = np.uint8 if self.dtype == torch.uint8 else np.float32
        self.mm = np.memmap(self.path, dtype=np_dtype, mode="r+", offset=self.a * self.dtype.itemsize,
                            shape=(self.b - self.a,))
        return torch.from_numpy(self.mm)

    def __exit__(self, *exc) -> None:
        self.mm.flush()
        del self.mm


def make_store(kind: str, masters: list[torch.Tensor], pieces: list[Piece],
               optim_cfg: OptimizerSettings, *,  # OptimConfig or OptimizerRecipe
               aliased: bool, directory: str | None, rank: int,
               chunk: int | None = None) -> DeviceStore | DiskStore:
    """The store for ``--offload kind`` (none | cpu | disk)."""
    if kind == "none":
        return DeviceStore(masters, pieces, optim_cfg, aliased=aliased)
    if kind == "cpu":
        return HostStore(masters, pieces, optim_cfg)
    if kind == "disk":
        store = disk_store([m.numel() for m in masters], pieces, optim_cfg, directory=directory, rank=rank,
                           chunk=chunk)
        for i, m in enumerate(masters):
            store.write_master(i, m)
        return store
    raise ValueError(f"parallel.offload = {kind!r} is not one of none, cpu, disk")


def disk_store(sizes: list[int], pieces: list[Piece], optim_cfg: OptimizerSettings, *,
               directory: str | None, rank: int, chunk: int | None = None) -> DiskStore:
    """An empty disk store (zero masters and moments) in a new working folder under ``directory``."""
    cls = RecipeDiskStore if isinstance(optim_cfg, OptimizerRecipe) else DiskStore
    return cls(sizes, pieces, optim_cfg, directory=offload_folder(directory), rank=rank, chunk=chunk)


def offload_folder(directory: str | None) -> str:
    """A fresh, marked folder of this process under the user's --offload-dir for its disk store
    (scratch.py): the user's files there, and another run's folder, are never written or removed.
    It is only a working area (a checkpoint holds the optimizer state, which --resume writes into
    a new store), so every run makes its own; the run removes it at its end (train/trainer.py)."""
    if not directory:
        raise ValueError("--offload disk needs --offload-dir DIR (parallel.offload_dir)")
    return str(scratch.make_folder(directory, OFFLOAD))
