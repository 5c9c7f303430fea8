"""ZeRO-3 / FSDP: parameters partitioned too, gathered one unit at a time, with prefetch.

Rajbhandari et al. 2020 (ZeRO stage 3, P_os+g+p) and Zhao et al. 2023 (PyTorch FSDP).

A *unit* is one transformer block, the embedding, or the final norm + LM head (with expert
parallelism, a block's experts are a unit of their own, sharded and gathered over edp: the ranks
holding the same experts; expert_parallel/). Each unit's
parameters are one flat buffer (``FlatLayout``: back to back, padded to a multiple of dp); a rank
keeps only its contiguous 1/dp shard. The model is built on the meta device and each rank
materialises only its shard, parameter by parameter from ``init_value(name)`` (the
layout-independent init), so the full model never exists on one rank. With ``--offload disk``
the construction streams: the disk store is created from the layouts first, and each unit's fp32
master shard is written to it as soon as it is built, then dropped (one unit in memory at a time).

    forward   pre-hook:  all-gather unit i (wait if prefetched), then start the all-gather of
                         unit i+1 (async: it crosses the wire while unit i computes)
              post-hook: free unit i's gathered buffer (reshard_after_forward), and hook its
                         output so backward announces itself
    backward  output-grad hook of unit i: all-gather unit i again, prefetch unit i-1
              post-accumulate-grad hooks: when unit i's last gradient lands, pack the
              gradients, reduce-scatter them (async, SUM), keep our shard, free the buffer

(The hooks and the gathered buffers live in zero/fsdp_units.py; this module builds and steps.)

The gathered buffer keeps its tensor but its storage is resized to 0 when freed (FSDP's trick):
the parameters are views into it, so autograd's saved references stay valid and see the
re-gathered values in backward. Parameters are bound with ``p.data = view`` so they keep their
own version counters and re-gathering does not trip autograd's in-place check.

Traffic: forward all-gather Ψ + backward all-gather Ψ + reduce-scatter Ψ = 3Ψ, 1.5x DDP's 2Ψ.
``reshard_after_forward=False`` keeps units gathered from forward to backward (no second gather:
2Ψ, at the memory of the whole gathered model at the end of forward). Memory per rank:
(2Ψ + 2Ψ + 12Ψ)/N in mixed precision (compute shard, gradient shard, master + moments), or
(4Ψ + 4Ψ + 8Ψ)/N in fp32, plus the gathered units in flight: at most the current and the
prefetched one (``gathered_peak_bytes``, checked by the tests).

Nested units (``NESTED``; ``--tile N``'s weight tiles, memory/tiled_linear.py): a submodule flagged
``zero3_unit`` is a unit of its own, listed right after the unit that holds it, owning its own
parameters; the outer unit does not gather them, each is gathered by its own hooks when it runs.
Backward prefetch then follows the order in which forward finished the units (the tiles, then
their block), reversed, instead of ``i - 1``.

Frozen parameters (``requires_grad=False``: a LoRA base, a frozen embedding) are sharded and
gathered like the others, in flat buffers of their own per unit (``Unit.frozen``, one per dtype: a
base stored in bf16 under fp32 compute stays bf16): no gradient, no reduce-scatter, no fp32 master
and no optimizer state (the store holds the trainable layouts only). With ``stream_frozen`` (the
trainer's ``--lora R --offload disk``) they live on disk instead: each unit's frozen shards in a
file, read for each gather on a read-ahead thread, one unit ahead (zero/base_stream.py); the
trainable shards and their optimizer state then stay in memory (no optimizer offload).
A unit holding frozen parameters cannot count landed gradients to know its backward is over (a
frozen weight's input gradient lands nowhere), so its forward also watches its inputs: it is
released once its trainable gradients have landed *and* the gradients of its inputs exist
(``register_multi_grad_hook``), i.e. once no backward node can still read its weights. A unit whose
inputs and parameters all lack gradients (a frozen embedding) has no backward at all, and the
backward prefetch skips it.

Accumulation (``no_sync``): micro-batches before the last keep their full gradients in p.grad and
skip the reduce-scatter (FSDP's no_sync: fewer bytes, more memory); the last one reduces the sum.

Inside a pipeline schedule (``pipelined``: each rank's units are its stages'): a unit is gathered
for each F and B that runs it and released once that B has produced its inputs' gradients (W
reads no weight); gradients land in sync only on the stage's last B or W (executor._sync_points),
so a unit reduces once per step, after its last gradient (docs/pipeline_parallel.md). The tied
embedding / head copies are held back from the hooks (``hold_reduction``) and reduced in
after_backward, once the executor has summed them across the two end stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from paratrain.base.strategy import Strategy
from paratrain.comm import collectives as C
from paratrain.comm.collectives import nbytes
from paratrain.device import release_host_heap
from paratrain.expert_parallel import split_expert_units
from paratrain.mesh import ParallelMesh
from paratrain.models import family_of
from paratrain.sharding import copy_info, info_of, shard_of
from paratrain.shards import ShardReader
from paratrain.zero import store8
from paratrain.zero.base_stream import BaseStream, OnDisk
from paratrain.zero.disk8 import DiskStore8, disk_store8
from paratrain.zero.flat import (
    DTYPES,
    FlatLayout,
    GroupOf,
    axis_of,
    param_key,
    wait_all,
)
from paratrain.zero.fsdp_units import Frozen, Unit, UnitHooks
from paratrain.zero.offload import DiskStore, disk_store, make_store, offload_folder
from paratrain.zero.sharded_state import ShardedState, held_sync
from paratrain.zero.units import NESTED, nest_units
from paratrain.zero.units import backward_order as _backward_order
from paratrain.zero.units import is_nested as _is_nested

__all__ = ["NESTED", "Unit", "Zero3", "family_units"]

#: Gradient reductions of units allowed in flight at once during backward (each holds a full unit's
#: gradient until it completes): the current one and the previous one overlap with compute.
REDUCES_IN_FLIGHT = 2

InitFn = Callable[[str, tuple[int, ...]], torch.Tensor]  # (name, full shape) -> full fp32 value
UnitsFn = Callable[[nn.Module], list[tuple[str, list[nn.Module]]]]  # model -> (unit name, modules)


def family_units(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """Forward-order units the model's family declares (a pipeline stage may lack some)."""
    return family_of(model, "ZeRO-3 (its units; or pass units=)").zero3_units(model)


def _join_owner(plan: list[Unit], uname: str, modules: list[nn.Module]) -> None:
    """A unit that owns nothing (a user's LM head whose weight is the embedding's) joins the unit
    that owns its first parameter: that unit is then gathered around these modules' forward and
    backward too, and released once the shared gradient is complete (an empty unit of its own
    would gather and reduce nothing)."""
    params = [p for m in modules for p in m.parameters()]
    if not params:
        raise ValueError(f"ZeRO-3 unit {uname!r} has no parameters: name modules that hold some")
    for owner in plan:
        if any(q is params[0] for q in owner.params):
            owner.modules.extend(modules)
            return
    raise AssertionError(f"unit {uname!r}: the unit owning its parameters was not found")


class Zero3(UnitHooks, ShardedState, Strategy):
    """Fully sharded data parallel over mesh.dp (mesh.dp_shard under HSDP); takes the model on the
    meta device."""

    reduces_during_backward = True

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg, *, init_value: InitFn,
                 precision: str = "fp32", reduce_dtype: torch.dtype | None = None,
                 reshard_after_forward: bool = True, offload: str = "none", offload_dir: str | None = None,
                 offload_chunk: int | None = None, prefetch: bool = True, units: UnitsFn | None = None,
                 group_of: GroupOf | None = None, stream_frozen: bool = False,
                 trim_host_heap: bool = True):
        self.compute_dtype = DTYPES[precision]
        # units: which modules form each unit, in forward order (the library passes its policy).
        self.units_of, self.group_of = units or family_units, group_of
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        if stream_frozen and offload != "disk":
            raise ValueError("stream_frozen: the frozen shards stream from --offload disk's folder")
        # --lora's --offload disk is the frozen base's: the adapters and their optimizer partition
        # (a fraction of a percent) stay in memory, where reading them every step costs nothing
        self.stream_frozen, offload = stream_frozen, "none" if stream_frozen else offload
        self.trim_host_heap = trim_host_heap  # False: --no-trim-host-heap (memory/host_heap.py)
        self.offload, self.offload_dir, self.offload_chunk = offload, offload_dir, offload_chunk
        self._sync, self._factor = True, 1.0
        self.gathered_bytes = self.gathered_peak_bytes = self.last_gathered_peak_bytes = 0
        self.model, self.mesh, self.optim_cfg = model, mesh, optim_cfg  # _materialize needs them
        self._in_flight: list[Unit] = []  # units whose gradient reduction is launched, oldest first
        self.pipelined, self.held, self.input_watches = mesh.pp.size > 1, set(), []
        self._materialize(init_value)
        super().__init__(model, mesh, optim_cfg)
        self._install_hooks()

    # -- construction: shards only, straight from the layout-independent init --------------------

    @torch.no_grad()
    def _materialize(self, init_value: InitFn) -> None:
        """Lay out every unit (meta, free), then materialise this rank's shard of one unit at a time.

        With ``--offload disk`` the store exists before any value does: each unit's fp32 master
        shard goes to disk as soon as it is built and is dropped, so construction holds the compute
        shards built so far plus one unit's fp32 master and one full parameter value (the init is by
        full tensor), never every master at once. ``init_peak_bytes`` counts exactly that.
        """
        self.units = self._plan_units()
        self.trained = [u for u in self.units if u.layout is not None]  # the store's order
        # Host memory only, and only when frozen buffers join the gathers (device.release_host_heap).
        self._trim_host_heap = (self.trim_host_heap and self.mesh.device.type == "cpu"
                                and any(u.frozen for u in self.units))
        self.layouts = [u.layout for u in self.trained]
        for i, u in enumerate(self.trained):
            u.index = i
        self.pieces = [pc for i, layout in enumerate(self.layouts)
                       for pc in layout.pieces(i, self.optim_cfg.weight_decay)]
        # fp32 + disk: the master on disk *is* the compute shard, so it is not kept in memory too:
        # each gather reads it from the store (``_load_shard``); 4 Psi / N bytes less per rank.
        self.shards_on_disk = self.offload == "disk" and self.compute_dtype == torch.float32
        self.store = self._disk_store() if self.offload == "disk" else None
        # --lora with --offload disk: the frozen shards in files of a working folder (zero/base_stream.py)
        self.base_stream = None
        if self.stream_frozen:
            self.base_stream = BaseStream(offload_folder(self.offload_dir), self.mesh.rank)
        self._masters: list[torch.Tensor] = []
        self.init_kept_bytes = self.init_peak_bytes = 0  # bytes of tensors this constructor holds
        for i, u in enumerate(self.units):
            if u.layout is not None:
                u.shard, u.full = self._build_trained(u.index, u.layout, init_value)
            for part in u.frozen:
                part.shard, part.full = self._build_frozen(part.layout, part.dtype, init_value)
            if self.base_stream is not None and u.frozen:
                self._stream_frozen(i, u)
        owner = {id(p): i for i, u in enumerate(self.units) for p in u.params}
        nested = {id(p) for u in self.units if _is_nested(u.modules) for p in u.params}
        for i, u in enumerate(self.units):
            # The whole model as a unit's module (the library's unit of leftover parameters) uses
            # only that unit: its submodules gather their own units in their own hooks (so do nested
            # units: a block does not gather its tiles, each tile gathers itself).
            u.uses = sorted({i} | {owner[id(p)] for m in u.modules if m is not self.model
                                   for p in m.parameters() if id(p) not in nested or _is_nested(u.modules)})
        self._backward_next = _backward_order([_is_nested(u.modules) for u in self.units])

    def _disk_store(self) -> DiskStore | DiskStore8:
        """The empty disk store of every unit's master shard (and its AdamW or 8-bit AdamW state)."""
        sizes = [layout.shard for layout in self.layouts]
        if not store8.is_8bit(self.optim_cfg):
            return disk_store(sizes, [pc for pc, _ in self.pieces], self.optim_cfg, rank=self.mesh.rank,
                              directory=self.offload_dir, chunk=self.offload_chunk)
        return disk_store8(self.layouts, self.optim_cfg, directory=self.offload_dir, rank=self.mesh.rank,
                           chunk=self.offload_chunk)

    def _build_trained(self, index: int, layout: FlatLayout,
                       init_value: InitFn) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(shard, gathered buffer) of a unit's trainable part; its fp32 master to the store (no shard
        kept when the store's master is the shard: ``shards_on_disk``)."""
        aliased = self.compute_dtype == torch.float32 and self.offload == "none"
        master = self._init_master(layout, init_value)  # [shard] fp32
        shard = master if aliased or self.shards_on_disk else master.to(self.compute_dtype)
        extra = 0 if shard is master else nbytes(shard)
        self.init_peak_bytes = max(self.init_peak_bytes, self.init_kept_bytes + nbytes(master) + extra)
        if self.shards_on_disk:
            shard = None
        else:
            self.init_kept_bytes += nbytes(shard)
        if self.store is not None:
            self.store.write_master(index, master)  # window by window; the in-memory master is dropped
        else:
            self._masters.append(master)
            self.init_kept_bytes += nbytes(master) if shard is not master else 0
        del master
        return shard, self._gathered_buffer(layout)

    def _build_frozen(self, layout: FlatLayout, dtype: torch.dtype,
                      init_value: InitFn) -> tuple[torch.Tensor, torch.Tensor]:
        """(shard, gathered buffer) of a unit's frozen part: the shard in ``dtype`` only, no master."""
        value = self._init_master(layout, init_value)
        shard = value if value.dtype == dtype else value.to(dtype)
        self.init_peak_bytes = max(self.init_peak_bytes, self.init_kept_bytes + nbytes(value) + nbytes(shard))
        self.init_kept_bytes += nbytes(shard)
        return shard, self._gathered_buffer(layout, dtype)

    def _stream_frozen(self, key: int, u: Unit) -> None:
        """Write the unit's frozen shards to its file and keep none of them in memory."""
        self.base_stream.put(key, [part.shard for part in u.frozen])
        self.init_kept_bytes -= sum(nbytes(part.shard) for part in u.frozen)
        for part in u.frozen:
            part.shard = None
        u.streamed = key

    def _gathered_buffer(self, layout: FlatLayout, dtype: torch.dtype | None = None) -> torch.Tensor:
        full = torch.empty(layout.padded, dtype=dtype or self.compute_dtype, device=self.mesh.device)
        self._swap_params(layout, full)
        full.untyped_storage().resize_(0)
        return full

    def _plan_units(self) -> list[Unit]:
        """Each unit's flat layouts (trainable, frozen) over the meta parameters it owns (a tied
        weight: its first unit)."""
        # single-device names (meta): a weight tile's record names the full tensor it slices
        names = {id(p): info_of(p).name or n for n, p in self.model.named_parameters()}
        units = self.units_of(self.model)
        if self.mesh.ep.size > 1:  # expert-parallel experts: units of their own, over edp
            units = split_expert_units(units)
        units = nest_units(units)
        seen = {id(p) for _, modules in units if _is_nested(modules) for m in modules for p in m.parameters()}
        plan: list[Unit] = []
        for uname, modules in units:
            named = []
            for m in modules:
                for p in m.parameters():
                    if _is_nested(modules) and id(p) in seen:
                        seen.discard(id(p))  # a nested unit claims its own parameters
                    if id(p) not in seen:
                        seen.add(id(p))
                        named.append((names[id(p)], p))
            if not named:  # every parameter is tied to an earlier unit's: that unit serves these modules too
                _join_owner(plan, uname, modules)
                continue
            plan.append(Unit(uname, modules, self._layout([np_ for np_ in named if np_[1].requires_grad]),
                             self._frozen([np_ for np_ in named if not np_[1].requires_grad])))
        return plan

    def _frozen(self, named: list[tuple[str, nn.Parameter]]) -> list[Frozen]:
        """Frozen parameters by the dtype they are held in: the narrower of their own and the
        compute dtype (a base stored in bf16 under fp32 compute stays bf16: half its memory)."""
        by_dtype: dict[torch.dtype, list] = {}
        for n, p in named:
            dtype = p.dtype if p.dtype.itemsize < self.compute_dtype.itemsize else self.compute_dtype
            by_dtype.setdefault(dtype, []).append((n, p))
        return [Frozen(self._layout(group, frozen=True), dtype) for dtype, group in by_dtype.items()]

    def _layout(self, named: list[tuple[str, nn.Parameter]], frozen: bool = False) -> FlatLayout | None:
        """The flat layout of these parameters, sorted into optimizer segments (none when frozen:
        no optimizer reads a frozen layout's pieces)."""
        if not named:
            return None
        dp = axis_of(named, self.mesh)
        if frozen:
            return FlatLayout.build(named, [(False, 1)] * len(named), dp.size, dp.rank, axis=dp.name)
        named.sort(key=lambda np_: param_key(np_[0], np_[1], self.mesh, self.group_of), reverse=True)
        keys = [param_key(n, p, self.mesh, self.group_of) for n, p in named]
        return FlatLayout.build(named, keys, dp.size, dp.rank, axis=dp.name,
                                **store8.align_kwargs(named, self.optim_cfg))

    def _init_master(self, layout: FlatLayout, init_value: InitFn) -> torch.Tensor:
        """This rank's [shard] fp32 slice of the unit, one parameter's full init value at a time."""
        master = torch.zeros(layout.shard, dtype=torch.float32, device=self.mesh.device)
        for name, p, off in zip(layout.names, layout.params, layout.offsets):
            a, b = max(off, layout.lo), min(off + p.numel(), layout.lo + layout.shard)
            if a < b:  # only this rank's part of the parameter survives the slice
                spec = shard_of(p)
                value = init_value(name, spec.full_shape)
                self.init_peak_bytes = max(self.init_peak_bytes, self.init_kept_bytes + nbytes(master)
                                           + nbytes(value))
                local = spec.slice(value).reshape(-1)
                master[a - layout.lo:b - layout.lo].copy_(local[a - off:b - off])
        return master

    def _swap_params(self, layout: FlatLayout, full: torch.Tensor) -> None:
        """Replace meta parameters (everywhere in the model: ties) by views into the gathered buffer."""
        new_of: dict[int, nn.Parameter] = {}
        for p, view in zip(layout.params, layout.views(full)):
            new = nn.Parameter(torch.empty(0, dtype=full.dtype, device=full.device),
                               requires_grad=p.requires_grad)
            new.data = view
            copy_info(p, new)
            new_of[id(p)] = new
        for sub in self.model.modules():
            for key, p in list(sub._parameters.items()):
                if p is not None and id(p) in new_of:
                    sub._parameters[key] = new_of[id(p)]
        layout.params[:] = [new_of[id(p)] for p in layout.params]

    def build_optimizer(self) -> None:
        aliased = self.compute_dtype == torch.float32 and self.offload == "none"
        if store8.is_8bit(self.optim_cfg) and self.store is None:  # none | cpu (disk: built already)
            self.store = store8.make_store8(self.offload, self._masters, self.layouts, self.optim_cfg,
                                            aliased=aliased)
        if self.store is None:  # none | cpu: the store takes the masters built in _materialize
            self.store = make_store(self.offload, self._masters, [pc for pc, _ in self.pieces],
                                    self.optim_cfg, aliased=aliased, directory=self.offload_dir,
                                    rank=self.mesh.rank, chunk=self.offload_chunk)
        # The store holds its own copy (host, disk, or fp32 beside a bf16 shard), or the masters are
        # the compute shards themselves (fp32, no offload): either way this list is no longer needed.
        del self._masters
        return None

    def _reduce(self, u: Unit) -> None:
        """Pack the unit's gradients, free them, reduce-scatter (async) into our shard."""
        self.note_held_grads()
        u.grad_flat = u.layout.flatten([p.grad for p in u.layout.params], self.reduce_dtype, self.mesh.device)
        for p in u.layout.params:
            p.grad = None
        u.grad_shard = torch.empty(u.layout.shard, dtype=self.reduce_dtype, device=self.mesh.device)
        u.rs_work = C.reduce_scatter_auto(u.grad_shard, u.grad_flat, getattr(self.mesh, u.layout.axis),
                                          async_op=True,
                                          what=f"reduce-scatter of unit {u.name}'s gradients")
        u.replicas_due = True
        # Each launched reduction holds its unit's full [padded] gradient until it completes: bound
        # how many are in flight, or backward ends holding every unit's full gradient (Psi, not Psi/N).
        self._in_flight.append(u)
        while len(self._in_flight) > REDUCES_IN_FLIGHT:
            self._finish_reduce(self._in_flight.pop(0))

    def _finish_reduce(self, u: Unit, replicas: bool = True) -> None:
        """Wait for the unit's reduce-scatter; under HSDP then launch its shard's all-reduce across
        the replicas (zero/flat.py), which crosses the slow link while backward goes on."""
        if u.rs_work is not None:
            u.rs_work.wait()
        u.rs_work, u.grad_flat = None, None
        if u.replicas_due and replicas:
            u.ar_work = self.over_replicas(u.layout, u.grad_shard)
        u.replicas_due = False

    # -- Strategy ---------------------------------------------------------------------------------

    no_sync = held_sync

    def after_backward(self) -> None:
        for u in self.trained:
            if u.rs_work is None and u.grad_shard is None:  # no gradient reached it: reduce zeros
                self._reduce(u)
        for i, u in enumerate(self.units):
            self._finish_reduce(u)
            self._reset_backward(u)
            self._free(i)
        self._drop_input_watches()
        self._in_flight = []
        self._wait_replicas()

    def _wait_replicas(self) -> None:
        wait_all([u.ar_work for u in self.trained])
        for u in self.trained:
            u.ar_work = None

    @staticmethod
    def _reset_backward(u: Unit) -> None:
        u.ready, u.landed, u.inputs_pending, u.grads_in, u.has_backward = 0, 0, 0, False, False

    def hold_reduction(self, params: list[nn.Parameter]) -> bool:
        """The units owning ``params`` keep their full gradients until after_backward (pipeline: the
        tied embedding and head, summed across the two end stages first): Psi of those units."""
        ids = {id(p) for p in params}
        self.held |= {i for i, u in enumerate(self.units) if any(id(q) in ids for q in u.params)}
        return True

    def prefetch_within(self, passes: list[list[nn.Module]]) -> None:
        """Under a pipeline: the modules each stage on this rank runs; a unit prefetches only units of
        its own stage (its first module's)."""
        where = {id(m): k for k, modules in enumerate(passes) for m in modules}
        self.prefetch_group = [where.get(id(u.modules[0]), -1) for u in self.units]

    def grads_for_norm(self) -> list[tuple[torch.Tensor, int]]:
        return [(self.trained[pc.index].grad_shard[pc.start:pc.end], copies) for pc, copies in self.pieces
                if self.trained[pc.index].grad_shard is not None]

    def scale_grads(self, factor: float) -> None:
        self._factor *= factor  # applied in fp32 inside step(), as in ZeRO-1/2

    @torch.no_grad()
    def step(self, lr: float) -> None:
        shards = [u.shard for u in self.trained]  # None when on disk: the store's master is the shard
        self.step_partition([u.grad_shard for u in self.trained], shards, lr)
        self.after_partition_step(shards)

    def zero_grad(self) -> None:
        for u in self.trained:
            u.grad_shard, u.ready = None, 0
            for p in u.layout.params:
                p.grad = None
        self.last_gathered_peak_bytes = self.gathered_peak_bytes
        self.gathered_peak_bytes = self.gathered_bytes
        self._grads_noted = False
        if self._trim_host_heap:
            release_host_heap()  # device.py says why: the host heap grows around freed buffers

    def discard_backward(self) -> None:
        """A backward that will not be stepped: its reductions waited for and dropped, every unit
        resharded (a trial stopped midway may leave some gathered), gradients and counters reset."""
        for i, u in enumerate(self.units):
            self._finish_reduce(u, replicas=False)  # dropped: no need to sum it across replicas
            self._reset_backward(u)
            self._free(i)
        self._drop_input_watches()
        self._in_flight = []
        self._wait_replicas()  # launched before the discard (the in-flight bound): let them land
        self.zero_grad()
        self._factor = 1.0
        self.gathered_peak_bytes, self.last_gathered_peak_bytes = self.gathered_bytes, 0

    def frozen_flats(self) -> list[tuple[FlatLayout, torch.Tensor | OnDisk]]:
        return [(f.layout, f.shard if u.streamed is None else OnDisk(self.base_stream, u.streamed, j))
                for u in self.units for j, f in enumerate(u.frozen)]

    def close(self) -> None:
        if self.base_stream is not None:
            self.base_stream.close()

    def state_bytes(self) -> dict[str, int]:
        grads = sum(nbytes(u.grad_shard) for u in self.trained if u.grad_shard is not None)
        grads += sum(nbytes(p.grad) for u in self.trained for p in u.layout.params if p.grad is not None)
        s = self.store.bytes()
        params = sum(nbytes(shard) for u in self.units for _, _, shard, _ in u.parts() if shard is not None)
        streamed = self.base_stream.file_bytes if self.base_stream is not None else 0
        return {"params": params, "grads": grads, "optim": s["device"],
                "offloaded": s["host"] + s["disk"] + streamed}

    def step_metrics(self) -> dict[str, float]:
        return {"zero3_gathered_peak_bytes": self.last_gathered_peak_bytes,
                "zero_grads_held_bytes": self.grads_held_bytes,
                "zero3_unit_max_bytes": max(u.nbytes for u in self.units), **self.offload_metrics(),
                **(self.base_stream.metrics() if self.base_stream is not None else {})}

    @torch.no_grad()
    def load_state_pieces(self, reader: ShardReader, optimizer_step: int) -> None:
        self._load_flats(reader, optimizer_step)
        self.load_unsharded(reader)  # frozen parameters included (held sharded: frozen_flats)
        self.load_buffers(reader)
        self.publish_masters()

    @torch.no_grad()
    def publish_masters(self) -> None:
        """The store's masters into the compute shards (the next gather reads them; on disk, the
        store's master is the shard already)."""
        if self.shards_on_disk:
            return
        for i, u in enumerate(self.trained):
            u.shard.copy_(self.store.read(i, "param").to(self.mesh.device, self.compute_dtype))
