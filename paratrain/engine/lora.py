"""LoRA in a run: the spec from ``[lora]``, where the engine applies it, and what it composes with.

engine/build.py (through the trainer's door, engine/parallelize.py) applies the adapters to the
model built on the meta device, *before* every other technique (so tensor parallelism's styles see
``LoRALinear``s and build their LoRA variants, tensor_parallel/lora.py), and freezes the base again
once the techniques have replaced modules
(a style builds new, trainable parameters); then ``--base-precision bf16`` stores the frozen
matrices in bf16, before they are materialised (models/lora.py ``store_base_in``).

``check_lora`` refuses, before any worker starts, what cannot work: targets naming nothing, a rank
out of range, a model without a family (and no --lora-targets), and the combinations listed in
``NOT_WITH_LORA`` with the reason.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from paratrain.config import Config
from paratrain.engine.checkpoint import find_checkpoint, open_reader
from paratrain.models import build_model, model_kind
from paratrain.models.from_config import model_shape
from paratrain.models.hf import HFError
from paratrain.models.hf.export import export_run
from paratrain.models.lora import (
    LoraError,
    LoraSpec,
    apply_lora,
    default_targets,
    freeze_base,
    is_adapter_name,
    store_base_in,
)
from paratrain.optim.nf4 import CODES, PARTS, TP_ALIGN, dequantise_weight, kind_of
from paratrain.refusals import emit
from paratrain.shards import TORCH_DTYPES, write_safetensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lora_spec(cfg: Config) -> LoraSpec | None:
    """The run's adapters, or None for a full fine-tune (``--lora 0``)."""
    c = cfg.lora
    if not c.rank:
        return None
    return LoraSpec(rank=c.rank, alpha=c.alpha, dropout=c.dropout, targets=tuple(c.targets or ()))


def apply_run_lora(model: nn.Module, cfg: Config) -> list[str]:
    """Adapters on the (meta) model before any technique; [] without --lora."""
    spec = lora_spec(cfg)
    if spec is None:
        return []
    names = apply_lora(model, spec)
    return names


def settle_base(model: nn.Module, cfg: Config) -> None:
    """After the techniques replaced modules (a style's new parameters are trainable): adapters
    only train; the frozen matrices take --base-precision (still on the meta device)."""
    if lora_spec(cfg) is None:
        return
    freeze_base(model)
    if cfg.lora.base_precision in DTYPES and cfg.lora.base_precision != "fp32":  # nf4/int8: engine/qlora.py
        store_base_in(model, DTYPES[cfg.lora.base_precision])


def streams_base(cfg: Config) -> bool:
    """``--lora R --zero 3 --offload disk``: the frozen base's shards live on disk, each unit's
    read for its gathers (zero/base_stream.py); the adapters and their optimizer state stay in
    memory (zero/fsdp.py: no optimizer offload then). Under
    ZeRO-1/2 --offload disk keeps its one meaning (the optimizer partition): they hold the frozen
    base whole on every rank, as DDP does, with no per-unit gathers to read it for."""
    p = cfg.parallel
    return bool(cfg.lora.rank) and p.zero == 3 and p.offload == "disk"


def trainable_count(model: nn.Module) -> int:
    """Elements of the single-device model that train (the full shapes of the local parameters)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


LORAS = ("lora", "lora-bf16", "qlora")
# Combinations LoRA cannot run, with why (each refused before any worker starts; "--lora does not
# compose with <flags[1]>: <reason>").
NOT_WITH_LORA = (
)
def check_lora(cfg: Config, problems: list[str]) -> None:
    """Every LoRA problem (engine/checks.py calls it before any worker starts)."""
    c = cfg.lora
    if not c.rank:
        if c.base_precision != "fp32":
            problems.append("--base-precision applies to LoRA's frozen base: add --lora RANK or drop it")
        if c.export != "merged":
            problems.append("--lora-export says what a LoRA run's end writes: add --lora RANK or drop it")
        return
    decoder = model_kind(cfg.model.name).decoder
    if not decoder:
        problems.append(f"--lora does not compose with {cfg.model.name}: it declares no model family: "
                        "LoRA adapts the decoders of the families in paratrain/models/")
    emit(NOT_WITH_LORA, cfg, problems)
    _check_streamed_base(cfg, problems)
    if not decoder:
        return
    try:
        model = build_model(model_shape(cfg), "meta")
    except (KeyError, OSError, ValueError):
        return  # an unknown model or folder is reported elsewhere
    try:
        apply_lora(model, lora_spec(cfg))
    except LoraError as e:
        problems.append(str(e))
        return
    tp = cfg.parallel.tp
    if c.base_precision in CODES and TP_ALIGN % tp:  # split weights are quantised in pieces
        problems.append(f"--base-precision {c.base_precision} with --tp {tp}: a weight tensor parallelism "
                        f"splits is quantised as gcd(its size, {TP_ALIGN}) pieces, so --tp must divide "
                        f"{TP_ALIGN} (optim/nf4.py); use --tp 2, 4, 8 or 16")


def _check_streamed_base(cfg: Config, problems: list[str]) -> None:
    """What streaming the frozen base from disk (``streams_base``) needs."""
    p = cfg.parallel  # --offload disk without ZeRO: the ddp x offload refusal says it (engine/checks.py)
    if streams_base(cfg) and not p.reshard_after_forward:
        problems.append("--lora with --zero 3 --offload disk reads each block's frozen base from disk for "
                        "its forward and again for its backward; parallel.reshard_after_forward = false "
                        "would keep every block gathered from forward to backward (the whole base in "
                        "memory): drop it, or use --offload cpu/none")


def run_record(model_cfg: object, cfg: Config) -> dict:
    """What run.json keeps under "lora" (the resolved settings, the adapted modules) and the
    single-device model's trainable parameters; {} without --lora."""
    spec = lora_spec(cfg)
    if spec is None:
        return {}
    model = build_model(model_cfg, "meta")
    names = apply_lora(model, spec)
    return {"rank": spec.rank, "alpha": spec.resolved_alpha, "scale": spec.scale, "dropout": spec.dropout,
            "targets": list(spec.targets or default_targets(model)), "modules": names,
            "base_precision": cfg.lora.base_precision, "from_dir": cfg.lora.from_dir,
            "n_trainable_params": trainable_count(model),
            "export": cfg.lora.export, "files": final_files(cfg.lora.export)}


def final_files(export: str) -> dict[str, str]:
    """The files a LoRA run's end writes (``--lora-export``), each with what it holds."""
    merged = {"model.safetensors": "merged (W + scale * B @ A)"} if export == "merged" else {}
    return {**merged, "adapters.safetensors": "adapters"}


def export_lora(folder: Path, out: Path, scale: float, export: str = "merged") -> Path:
    """A LoRA run's end: ``out/model.safetensors`` is the *merged* model (each adapted weight
    W + scale * B @ A, in fp32; every other tensor as trained), with single-device names and no
    adapter tensors, so generate, eval and ``export --hf`` read it as any run's; and
    ``out/adapters.safetensors`` holds the adapters alone (``...lora_A.weight``, fp32), which
    ``export --peft`` renames for PEFT. Streamed from the final checkpoint, a tensor at a time.
    ``export="adapters"`` (``--lora-export``) writes the adapters alone and removes an earlier end's
    model.safetensors, which these adapters no longer match; ``export="base"`` (``export --hf-base``)
    writes ``out/model.safetensors`` as the frozen base the adapters were trained on, unmerged (an
    nf4/int8 weight dequantised, in fp32), and no adapters. Returns the run's final file: the
    merged model, or the adapters."""
    reader = open_reader(folder)
    try:
        items = [(name, key, tuple(rec["shape"]), TORCH_DTYPES[rec["dtype"]])
                 for name, keys in reader.tensors.items() for key, rec in keys.items()
                 if key in ("param", "buffer")]
        adapters = [i for i in items if is_adapter_name(i[0])]
        merged = {n.removesuffix("lora_A.weight") + "weight" for n, *_ in adapters}
        shapes = {n: s for n, _, s, _ in items}
        quantised = quantised_weights(shapes, merged)  # QLoRA: weight -> its kind
        base = [i for i in items if not is_adapter_name(i[0]) and i[0] not in quantised_part_names(quantised)]
        base += [(w, "param", quantised_shape(w, shapes), torch.float32) for w in quantised]

        def full(name: str, key: str = "param") -> torch.Tensor:
            shape = tuple(reader.tensors[name][key]["shape"])
            slab = shape or (1,)
            return reader.read(name, key, (0,) * len(slab), slab).view(shape)

        def computed(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            """The base weight the run's layer computed with (nf4/int8: dequantised), in fp32."""
            if name in quantised:
                return dequantise_weight({k: full(part_name(name, k)) for k in PARTS}, quantised[name], shape)
            return full(name).float()

        def produce_base(i: int) -> torch.Tensor:
            name, key, shape, _ = base[i]
            if name not in merged:
                return full(name, key)
            if export == "base":
                return computed(name, shape)
            stem = name.removesuffix("weight")
            delta = full(stem + "lora_B.weight").float() @ full(stem + "lora_A.weight").float()
            return computed(name, shape) + scale * delta  # nf4/int8: dequantise, then merge

        model_path, adapter_path = out / "model.safetensors", out / "adapters.safetensors"
        if export == "base":
            _write_atomic(model_path, [(n, s, torch.float32 if n in merged else d) for n, _, s, d in base],
                          produce_base)
            return model_path
        _write_atomic(adapter_path, [(n, s, d) for n, _, s, d in adapters], lambda i: full(adapters[i][0]))
        if export == "adapters":
            model_path.unlink(missing_ok=True)
            return adapter_path
        entries = [(n, s, torch.float32 if n in merged else d) for n, _, s, d in base]
        _write_atomic(model_path, entries, produce_base)
    finally:
        reader.close()
    return model_path


def export_base(run: str, out: str, *, max_shard_bytes: int) -> list[Path]:
    """``export --hf-base OUT``: a LoRA run's frozen base as a Hugging Face folder, from its newest
    checkpoint (the base is frozen: every checkpoint holds the same), each adapted weight as the
    run's layers computed with it: an nf4/int8 weight dequantised from its stored parts, a bf16
    one as stored. It is the base ``export --peft``'s adapters were trained on: PeftModel on it
    gives the run's logits, where on the original ``--init-from`` folder an nf4 base's adapters
    meet weights that differ by the quantisation's error. Returns the weight files written."""
    src = Path(run)
    lora = _run_lora(src)
    if not lora.get("rank"):
        raise HFError(f"{src} was trained without LoRA (no --lora): every weight trained, so there is no "
                      "frozen base apart from the model; export the model with --hf DIR")
    folder, _ = find_checkpoint(src)
    if folder is None:
        raise HFError(f"no checkpoint under {src / 'checkpoints'}: is {run!r} the --out of a LoRA run?")
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.base-") as tmp:
        weights = export_lora(folder, Path(tmp), 0.0, "base")
        return export_run(run, out, max_shard_bytes=max_shard_bytes, weights=weights)


def base_is_quantised(run: str) -> bool:
    """Whether the finished LoRA run RUN stored its base as nf4 or int8 (``--base-precision``)."""
    return _run_lora(Path(run)).get("base_precision") in CODES  # nf4, int8


def _run_lora(src: Path) -> dict:
    """run.json's ``lora`` record of the run folder SRC ({} when it has none)."""
    try:
        info = json.loads((src / "run.json").read_text())
    except (OSError, ValueError) as e:
        raise HFError(f"cannot read {src / 'run.json'} ({e}): is {str(src)!r} the --out folder of a "
                      "finished run?") from None
    return (info.get("lora") or {}) if isinstance(info, dict) else {}


def quantised_weights(shapes: dict[str, tuple[int, ...]], merged: set[str]) -> dict[str, str]:
    """The adapted weights a checkpoint holds quantised (``<weight>_codes`` and the other parts,
    engine/qlora.py), each with its kind, told from the codes' size (nf4 packs two per byte)."""
    out = {}
    for w in merged:
        codes = shapes.get(part_name(w, "codes"))
        if codes is not None and w not in shapes:
            out[w] = kind_of(codes[0], quantised_shape(w, shapes))
    return out


def quantised_part_names(quantised: dict[str, str]) -> set[str]:
    return {part_name(w, k) for w in quantised for k in PARTS}


def quantised_shape(weight: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """[out, in] of an adapted weight, read from its adapters (B: [out, r], A: [r, in])."""
    stem = weight.removesuffix("weight")
    return shapes[stem + "lora_B.weight"][0], shapes[stem + "lora_A.weight"][1]


def part_name(weight_name: str, part: str) -> str:
    """The checkpoint name of one stored part of a quantised weight (engine/qlora.py)."""
    return f"{weight_name}_{part}"


def _write_atomic(path: Path, entries: list, produce: Callable[[int], torch.Tensor]) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        write_safetensors(tmp, entries, produce)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
