"""ZeRO-3's units at run time: their gathered buffers and the autograd hooks that gather and
release them (zero/fsdp.py builds the units and steps them; this is when each one is in memory).

    forward   pre-hook:  all-gather unit i (wait if prefetched), then start the all-gather of
                         unit i+1 (async); a unit holding frozen parameters also watches its inputs
              post-hook: free unit i (reshard_after_forward); hook its first output needing a
                         gradient, so backward announces itself
    backward  output-grad hook of unit i: all-gather unit i again, prefetch the next unit that has
                         a backward (a frozen embedding's output needs no gradient: skipped)
              post-accumulate-grad hooks: when unit i's last trainable gradient lands, reduce
                         (``Zero3._reduce``) and release the unit ...
              input-gradient hook (units with frozen parameters): ... once its inputs' gradients
                         exist too: a frozen weight's backward node fires no gradient hook, so
                         only the input gradients say it has run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from paratrain.comm import collectives as C
from paratrain.models.rerun import recomputing
from paratrain.zero.flat import FlatLayout


@dataclass
class Frozen:
    """A unit's frozen parameters of one dtype: sharded and gathered, nothing else."""

    layout: FlatLayout
    dtype: torch.dtype  # the narrower of the parameters' own dtype and the compute dtype
    full: torch.Tensor | None = None  # [padded]; storage resized to 0 while resharded
    shard: torch.Tensor | None = None  # [shard]: what this rank keeps


@dataclass
class Unit:
    name: str
    modules: list[nn.Module]
    layout: FlatLayout | None  # its trainable parameters (None: all frozen)
    frozen: list[Frozen] = field(default_factory=list)  # its frozen parameters, by dtype
    full: torch.Tensor | None = None  # [padded] compute dtype; storage resized to 0 while resharded
    shard: torch.Tensor | None = None  # [shard] compute dtype: what this rank keeps
    index: int | None = None  # the trainable layout's place in the store (Zero3.layouts)
    gathered: bool = False
    work: list = field(default_factory=list)  # in-flight all-gathers
    ready: int = 0  # gradients landed in sync since the last reduction (when all have: reduce)
    landed: int = 0  # gradients landed since this unit's backward began (when all have: release)
    grads_in: bool = False  # every trainable gradient landed since this unit's backward began
    inputs_pending: int = 0  # forward inputs whose gradients backward has not produced yet
    has_backward: bool = False  # a forward since the last step produced an output needing a gradient
    grad_shard: torch.Tensor | None = None
    grad_flat: torch.Tensor | None = None
    rs_work: object = None
    replicas_due: bool = False  # HSDP: the shard still has to be summed across the replicas
    ar_work: object = None  # HSDP: that all-reduce, in flight
    uses: list[int] = field(default_factory=list)  # units whose parameters this unit's modules use
    streamed: int | None = None  # its frozen shards' file in the base stream (zero/base_stream.py)

    @property
    def params(self) -> list[nn.Parameter]:
        layouts = [self.layout] if self.layout is not None else []
        return [p for layout in layouts + [f.layout for f in self.frozen] for p in layout.params]

    def parts(self) -> list[tuple[FlatLayout, torch.Tensor, torch.Tensor, str]]:
        """(layout, gathered buffer, shard, what) of the trainable part and each frozen part."""
        out = [(self.layout, self.full, self.shard, f"all-gather of unit {self.name}")]
        out += [(f.layout, f.full, f.shard, f"all-gather of unit {self.name}'s frozen {f.dtype} parameters")
                for f in self.frozen]
        return [part for part in out if part[0] is not None]

    @property
    def nbytes(self) -> int:
        return sum(layout.padded * full.element_size() for layout, full, _, _ in self.parts())


class UnitHooks:
    """Gather, release and prefetch of ``self.units`` (mixed into Zero3)."""

    units: list[Unit]
    shards_on_disk: bool = False  # fp32 + disk offload: the compute shard is read from the store
    base_stream = None  # frozen shards on disk, read per gather (zero/base_stream.py), or None
    #: Under a pipeline schedule (pipelined = True) several forwards of a unit are in flight, and a
    #: zero-bubble B leaves the linears' gradients to W: a unit is released when the B now running
    #: has produced its inputs' gradients (no later node of that B reads its weights; W reads none),
    #: and its prefetches stay inside its own stage (``prefetch_group``: a V rank's other chunk
    #: runs in another pass, maybe much later).
    pipelined: bool = False
    prefetch_group: list[int] | None = None  # unit -> its stage's index on this rank (pipelined)
    held: set[int]  # units reduced in after_backward only (hold_reduction: the tied pair)
    #: The hooks watching units' inputs (``_watch_inputs``), removed when the step's backward is
    #: over (``_drop_input_watches``). Left on a leaf input (a pipeline stage's received
    #: activation) they keep it alive for ever: torch's multi-grad hook holds the leaf's gradient
    #: accumulator, which holds the leaf, in a closure stored on the leaf itself, a cycle through
    #: C++ that Python's gc cannot see (measured: every received activation of every step stayed).
    input_watches: list

    # -- gather / free ------------------------------------------------------------------------------

    def _gather(self, i: int, async_op: bool) -> None:
        u = self.units[i]
        if u.gathered:
            return
        u.gathered = True
        self._load_shard(u)
        self.gathered_bytes += u.nbytes
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, self.gathered_bytes)
        for layout, full, shard, what in u.parts():
            full.untyped_storage().resize_(layout.padded * full.element_size())
            axis = getattr(self.mesh, layout.axis)
            work = C.all_gather_into(full, shard, axis, async_op=async_op, what=what)
            if work is not None:
                u.work.append(work)
        if not u.work:  # gathered already (one process: a copy): the streamed shards can go now
            self._drop_streamed(u)

    def _wait(self, i: int) -> None:
        self._gather(i, async_op=False)
        u = self.units[i]
        for work in u.work:
            work.wait()
        u.work = []
        self._drop_shard(u)

    def _free(self, i: int) -> None:
        u = self.units[i]
        if not u.gathered:
            return
        for work in u.work:  # a prefetch nobody used (e.g. eval stopped early)
            work.wait()
        u.work = []
        self._drop_shard(u)
        for _, full, _, _ in u.parts():
            full.untyped_storage().resize_(0)
        u.gathered = False
        self.gathered_bytes -= u.nbytes

    def _load_shard(self, u: Unit) -> None:
        """fp32 + disk offload keeps no compute shard: the store's master is read for the gather
        (held only until the gather completes)."""
        if self.shards_on_disk and u.layout is not None:
            u.shard = self.store.read(u.index, "param").to(self.mesh.device)
        if u.streamed is not None:  # the frozen shards, read ahead while the previous unit computed
            for part, shard in zip(u.frozen, self.base_stream.take(u.streamed)):
                part.shard = shard.to(self.mesh.device)

    def _drop_shard(self, u: Unit) -> None:
        if self.shards_on_disk and u.layout is not None:
            u.shard = None
        self._drop_streamed(u)

    def _drop_streamed(self, u: Unit) -> None:
        if u.streamed is not None and u.frozen[0].shard is not None:
            for part in u.frozen:
                part.shard = None
            self.base_stream.release(u.streamed)

    # -- hooks ------------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        for i, u in enumerate(self.units):
            for j, m in enumerate(u.modules):
                m.register_forward_pre_hook(self._pre_forward(i, first=j == 0), with_kwargs=True)
            u.modules[-1].register_forward_hook(self._post_forward(i))
            for p in u.layout.params if u.layout is not None else ():
                p.register_post_accumulate_grad_hook(self._grad_hook(i))

    def _pre_forward(self, i: int, first: bool):
        def hook(module, args, kwargs):
            for k in self.units[i].uses:
                self._wait(k)
            if first and self.prefetch and i + 1 < len(self.units) and self._same_pass(i, i + 1):
                self._gather(i + 1, async_op=True)
            # pipelined: the first module's inputs, whose gradients come last in the unit's backward
            if first if self.pipelined else self.units[i].frozen:
                self._watch_inputs(i, (args, kwargs))
        return hook

    def _watch_inputs(self, i: int, inputs: tuple) -> None:
        """A unit holding frozen parameters stays gathered in backward until its inputs' gradients
        exist: a frozen weight's backward (the input gradient it carries) fires no gradient hook.
        Not in activation checkpointing's re-run: its inputs never get gradients."""
        if not torch.is_grad_enabled() or recomputing():
            return
        tensors = [t for t in tree_leaves(inputs) if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            self.units[i].inputs_pending += 1
            watch = torch.autograd.graph.register_multi_grad_hook(tensors, self._inputs_done(i))
            self.input_watches.append(watch)

    def _drop_input_watches(self) -> None:
        """Remove the input hooks of the step's forwards (``input_watches`` says why); their
        backward is over, and removing them inside it would change the hooks torch is running."""
        for handle in self.input_watches:
            handle.remove()
        self.input_watches = []

    def _inputs_done(self, i: int):
        def hook(grads):
            u = self.units[i]
            u.inputs_pending = max(0, u.inputs_pending - 1)
            if self.pipelined:  # this B is past the unit's weights (other forwards may be in flight)
                for k in u.uses:
                    self._free(k)
            else:
                self._release_if_done(i)
        return hook

    def _same_pass(self, i: int, j: int) -> bool:
        """Whether units i and j run in the same pipeline pass (always, without a pipeline)."""
        return self.prefetch_group is None or self.prefetch_group[i] == self.prefetch_group[j]

    def _release_if_done(self, i: int) -> None:
        """Free the unit once no backward node can still read it: its trainable gradients landed
        and the gradients of the inputs its forwards took exist."""
        u = self.units[i]
        if u.inputs_pending == 0 and (u.layout is None or u.grads_in):
            self._free(i)  # (a tied weight's owner is freed by its own hooks)

    def _post_forward(self, i: int):
        def hook(module, args, output):
            grad_mode = torch.is_grad_enabled()
            if self.reshard_after_forward or not grad_mode:
                for k in self.units[i].uses:
                    self._free(k)
            if grad_mode:  # the first output that carries a gradient announces the unit's backward
                first = next((t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad), None)
                if first is not None:
                    self.units[i].has_backward = True
                    self._announce(first, self._pre_backward(i))
        return hook

    @staticmethod
    def _announce(output: torch.Tensor, hook) -> None:
        """Run ``hook`` when backward reaches ``output``: as a pre-hook of the node that made it,
        which runs after the tensor hooks on that gradient, so a later unit watching it as its input
        (``_watch_inputs``) is released before this unit prefetches the next one."""
        if output.grad_fn is not None:
            output.grad_fn.register_prehook(hook)
        else:  # a leaf (a module returning a parameter): its own tensor hook
            output.register_hook(hook)

    def _pre_backward(self, i: int):
        def hook(grad):
            self.units[i].grads_in, self.units[i].landed = False, 0
            for k in self.units[i].uses:
                self._wait(k)
            nxt = self._backward_next[i]
            while nxt is not None and not self.units[nxt].has_backward:  # a frozen embedding has none
                nxt = self._backward_next[nxt]
            if self.prefetch and nxt is not None and self._same_pass(i, nxt):
                self._gather(nxt, async_op=True)
        return hook  # returns None: the gradient passes unchanged

    def _grad_hook(self, i: int):
        def hook(p):
            u = self.units[i]
            # Reduce once every gradient landed in sync: under a pipeline schedule each one lands in
            # sync exactly once per step, in its stage's last B (norms, biases) or last W (linears).
            if self._sync and i not in self.held:
                u.ready += 1
                if u.ready == len(u.layout.params):
                    u.ready = 0
                    self._reduce(u)
            u.landed += 1
            if u.landed < len(u.layout.params):
                return
            u.landed, u.grads_in = 0, True
            self._release_if_done(i)  # the unit's backward is over, unless frozen weights still serve
        return hook
