"""Generation across ranks: tensor parallel (--tp), pipeline parallel (--pp) and both, local workers
(--nproc) or torchrun.

Each rank builds the model on ``meta``, splits it as training does (tensor_parallel/plan.py, then
pipeline/stage.py), materialises only its part and reads only its slices from the weights
(inference/weights.py): no rank ever holds the whole model. Its KV cache fills itself with the
rank's heads (tp) and layers (pp). ``distributed_step`` is the decode loop's StepFn:

    first stage: ids -> embedding -> its blocks ---send h--> next stage: its blocks ... -> last stage:
    norm -> head on each row's last position -> vocabulary shards all-gathered over tp (padding cut)
    -> logits broadcast over pp from the last stage -> every rank samples the same token.

Every rank runs the same loop on identical logits, so every rank draws the same tokens and ends on
the same step; rank 0 writes the outputs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.config import ConfigError
from paratrain.engine.engine import make_mesh
from paratrain.inference.folders import for_inference
from paratrain.inference.loop import Generated, StepFn, decode, head_on_last_position
from paratrain.inference.prompts import stop_check
from paratrain.inference.request import GenerateRequest, PreparedPrompts
from paratrain.inference.weights import open_weights
from paratrain.launch import DistEnv, init_from_torchrun, spawn, under_torchrun
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models.kv_cache import KVCache
from paratrain.models.registry import build_model, family_of, materialize
from paratrain.pipeline.schedules import stage_rank
from paratrain.pipeline.stage import StageChunk, split_for_pipeline
from paratrain.planner.inference import generation_bytes
from paratrain.sharding import info_of, name_params, shard_of
from paratrain.tensor_parallel.plan import apply_tensor_parallel

WORKER_TIMEOUT_S = 3600.0  # local workers: a hang fails with every rank's stack after this long


def check_layout(cfg: object, tp: int, pp: int, world: int) -> None:
    """Refuse, before any worker starts, a layout the model or the processes cannot take."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp {tp} --pp {pp}: both must be >= 1")
    if tp * pp != world:
        raise ConfigError(f"--tp {tp} x --pp {pp} = {tp * pp} ranks but there are {world} processes: "
                          "generation splits the model only, so make --nproc (or torchrun's world) tp x pp")
    if cfg.n_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide the model's {cfg.n_heads} attention heads: choose a "
                          "divisor of it")
    if pp > cfg.n_layers:
        raise ConfigError(f"--pp {pp} is more stages than the model's {cfg.n_layers} layers: lower --pp")


def load_for_generation(source: object, mesh: ParallelMesh | None, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> nn.Module:
    """This rank's part of the model (TP split, PP stage), its weights read slice by slice (mesh
    None: the whole model, as one process reads it from a sharded checkpoint)."""
    model = build_model(for_inference(source.model_cfg), "meta")
    if mesh is not None and mesh.tp.size > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=False)
    if mesh is not None and mesh.pp.size > 1:
        split_for_pipeline(model, mesh)
    name_params(model)  # a tied copy on the last stage reads its owner's (the embedding's) weight
    materialize(model, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(source.read(info_of(p).name or name, shard_of(p)).to(device))
    return model.to(dtype).eval()


def distributed_step(model: nn.Module, mesh: ParallelMesh, chunks: list[StageChunk] | None = None,
                     placement: str = "loop") -> StepFn:
    """The StepFn of this rank's part: stage to stage, logits gathered over tp, broadcast over pp.
    ``chunks``: this rank's stages as the pipeline split made them (virtual stages: several per
    rank, visited in stage order, rank ``schedules.stage_rank(s, p, placement)`` running stage
    s); None: one stage per rank, the blocks it holds."""
    pp, vocab = mesh.pp, model.cfg.vocab_size
    if chunks is None:
        family = family_of(model, "pipeline-parallel generation")
        blocks = sorted(int(k) for k in family.blocks_of(model))
        chunks = [StageChunk(model, pp.rank, blocks, pp.rank == 0, pp.rank == pp.size - 1, family)]
    mine = {c.stage: c for c in chunks}
    n_stages = len(chunks) * pp.size  # every rank holds as many stages
    owner = [stage_rank(s, pp.size, placement) for s in range(n_stages)]
    dtype = next(model.parameters()).dtype

    def step(ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        h = ids
        for s in sorted(mine):
            if s > 0 and owner[s - 1] != pp.rank:
                h = _receive(ids.shape + (model.cfg.dim,), dtype, ids.device, pp, owner[s - 1])
            c = mine[s]
            with head_on_last_position(model):
                h = c.family.forward_stage(model, h, c.layers, c.is_first, c.is_last, positions, cache)
            if s + 1 < n_stages and owner[s + 1] != pp.rank:
                _send(h, pp, owner[s + 1])
        if owner[-1] == pp.rank:
            logits = _full_vocab(h[:, -1].float(), mesh, vocab)
        else:
            logits = torch.empty(ids.shape[0], vocab, dtype=torch.float32, device=ids.device)
        if pp.size > 1:
            C.broadcast(logits, pp, src_index=owner[-1])
        return logits

    return step


def _full_vocab(local: torch.Tensor, mesh: ParallelMesh, vocab: int) -> torch.Tensor:
    """[b, vocab/tp (padded)] shards of every tp rank -> [b, vocab] (the padding's -inf cut)."""
    if mesh.tp.size == 1:
        return local
    return torch.cat(C.all_gather_list(local.contiguous(), mesh.tp), dim=-1)[:, :vocab]


def _send(h: torch.Tensor, axis: C.Axis, peer: int) -> None:
    for work in C.batch_p2p([C.p2p_op_send(h.contiguous(), axis, peer)]):
        work.wait()


def _receive(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, axis: C.Axis,
             peer: int) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    for work in C.batch_p2p([C.p2p_op_recv(buf, axis, peer)]):
        work.wait()
    return buf


def rank_generate(env: DistEnv, request: GenerateRequest, ids: list[list[int]], tokenizer: object,
                  dtype: torch.dtype = torch.float32) -> tuple[list[Generated], dict[str, int]]:
    """One rank's part of a generate request: (the generated rows, this rank's measured bytes)."""
    mesh = make_mesh(MeshShape(pp=request.pp, tp=request.tp), env.rank, env.device, check_collectives=False)
    source = open_weights(request.run, request.init_from, request.checkpoint)
    model = load_for_generation(source, mesh, env.device, dtype)
    stop = stop_check(tokenizer, request.stop) if request.stop else None
    cache_bytes: list[int] = []
    step = _measuring(distributed_step(model, mesh), cache_bytes)
    out = decode(step, ids, request.sampling, env.device, stop)
    held = {"weights": sum(p.numel() * p.element_size() for p in model.parameters()),
            "kv_cache": cache_bytes[-1] if cache_bytes else 0}
    return out, held


def _measuring(step: StepFn, seen: list[int]) -> StepFn:
    """The step, noting the cache's bytes after each call (the last note is the run's cache)."""

    def measured(ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        logits = step(ids, positions, cache)
        seen.append(cache.nbytes())
        return logits

    return measured


def _worker(env: DistEnv, request: GenerateRequest, ids: list[list[int]], tokenizer: object
            ) -> tuple[list[Generated], dict[str, int]]:
    return rank_generate(env, request, ids, tokenizer)


def generate_ids(request: GenerateRequest, prepared: PreparedPrompts) -> list[Generated]:
    """Contract 5's backend for --nproc/--tp/--pp (or torchrun): rank 0's rows, in prompt order."""
    world = _world(request)
    source = open_weights(request.run, request.init_from, request.checkpoint)
    check_layout(source.model_cfg, request.tp, request.pp, world)
    if under_torchrun():
        env = init_from_torchrun()
        out, held = rank_generate(env, request, prepared.ids, prepared.tokenizer)
        _report(request, prepared, source.model_cfg, [held] if env.rank == 0 else [])
        return out
    results = spawn(_worker, world, request, prepared.ids, prepared.tokenizer, timeout=WORKER_TIMEOUT_S,
                    preload=(__name__,))  # the workers import this module: the forkserver does, once
    _report(request, prepared, source.model_cfg, [held for _, held in results])
    return results[0][0]


def _world(request: GenerateRequest) -> int:
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return request.nproc if request.nproc > 1 else request.tp * request.pp


def _report(request: GenerateRequest, prepared: PreparedPrompts, cfg: object,
            held: list[dict[str, int]]) -> None:
    """Each rank's bytes (weights, KV cache) beside the formula's (planner/inference.py), on stderr."""
    capacity = max(len(p) for p in prepared.ids) + request.sampling.max_new_tokens
    for rank, got in enumerate(held):
        pp_rank, tp_rank = divmod(rank, request.tp)
        want = generation_bytes(cfg, request.tp, request.pp, batch=len(prepared.ids), capacity=capacity,
                                element=4, pp_rank=pp_rank, tp_rank=tp_rank)
        print(f"paratrain: rank {rank} (pp {pp_rank}, tp {tp_rank}) holds weights "
              f"{got['weights'] / 2**20:.2f} MiB (formula {want['weights'] / 2**20:.2f}), KV cache "
              f"{got['kv_cache'] / 2**20:.2f} MiB (formula {want['kv_cache'] / 2**20:.2f})", file=sys.stderr)
