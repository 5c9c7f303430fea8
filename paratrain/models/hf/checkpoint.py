"""A Hugging Face checkpoint folder as paratrain reads it, whatever the family, and the registry that
picks the family's mapping.

``HFCheckpoint.open(path)`` reads config.json and hands the folder to the class registered for it
(``register_checkpoint``: by config.json's ``model_type``, else its architecture); a family's
hf.py subclasses ``HFCheckpoint`` with its own config translation, name table and layouts
(``from_folder``, ``check_shapes``, ``read``, ``entries``, ``export_config``), and nothing here names
a family. What is generic lives here: the layer count against the tensor names before anything is
built, the shapes checked from headers before allocation (``expected_shapes``), loading into a
(possibly sharded) model, the tokenizer files, and config.validate's checks of ``--init-from``.

Reading is per rank and per slice: ``read(name, spec)`` opens the safetensors file with
``safe_open`` and reads what the shard ``spec`` describes. Writing is models/hf/write.py's,
the export command models/hf/export.py's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from paratrain.config import Config, DataConfig, ModelConfig, bullets
from paratrain.models.hf.files import HFError, hf_folder, read_json, tokenizer_file, tokenizer_files
from paratrain.models.hf.write import Entry
from paratrain.models.registry import build_model, model_kind
from paratrain.safeload import Fields
from paratrain.sharding import TensorShard, shard_of

# [model] keys an imported model may override: they change the training loss or routing capacity,
# not the weights. The shape keys (and n_experts, top_k) always come from config.json.
TRAIN_OVERRIDES = ("capacity_factor", "aux_loss_coef", "z_loss_coef")


LAYER_INDEX = re.compile(r"\.(\d+)\.")  # searched: a tensor name's first number, its block


@dataclass(frozen=True)
class TensorSource:
    """Where a paratrain weight lies in the family's Hugging Face layout (PEFT adapters follow it):
    tensor ``hf``; ``rope``: its rows follow the family's head layout (``rows_to_hf``); ``conv1d``:
    stored transposed; ``part``: its third (q, k, v) of a fused tensor."""

    hf: str
    rope: bool = False
    conv1d: bool = False
    part: int | None = None


@dataclass
class HFCheckpoint:
    """A local Hugging Face model folder: its config, its weights by name, its tokenizer. A family's
    subclass (registered with ``register_checkpoint``) knows its names and layouts."""

    folder: Path
    hf_config: dict
    model_cfg: object  # the family's config class (a ModelShape)
    weight_files: dict[str, Path]  # Hugging Face tensor name -> the safetensors file holding it

    LAYERS_KEY: ClassVar[str] = "num_hidden_layers"  # config.json's layer count (GPT-2: n_layer)
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()  # config.json's model_type values this class reads
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ()  # config.json's architectures it reads
    CONFIG: ClassVar[type | None] = None  # the paratrain config class it writes back (export)

    def __post_init__(self) -> None:
        """The layer count of config.json against the blocks the weights hold, from the tensor names
        alone: before anything is built from it (a num_hidden_layers of 60,000 on a 2-layer folder
        cost 108 s and 2.5 GB of meta modules before check_shapes refused it)."""
        found = {int(m.group(1)) for n in self.weight_files if (m := LAYER_INDEX.search(n))}
        if found and found != set(range(self.model_cfg.n_layers)):
            where = self.folder / "config.json"
            raise HFError(f"{where}: {self.LAYERS_KEY} is {self.model_cfg.n_layers} but "
                          f"the weights hold {len(found)} layers (indices {min(found)}..{max(found)}): is "
                          "config.json the one these weights were saved with?")

    @classmethod
    def open(cls, path: str, **train_overrides: object) -> HFCheckpoint:
        """The checkpoint of the folder ``path``, read by its family's class. ``train_overrides``:
        config fields that shape training, not the weights (the MoE coefficients of TRAIN_OVERRIDES)
        and replace what config.json implies."""
        folder = hf_folder(path)
        hf = read_json(folder / "config.json")
        family = checkpoint_class(hf, str(folder / "config.json")) if cls is HFCheckpoint else cls
        return family.from_folder(folder, hf, **train_overrides)

    @classmethod
    def from_folder(cls, folder: Path, hf: dict, **train_overrides: object) -> HFCheckpoint:
        """The family's reading of config.json (``hf``) and the folder's weights."""
        raise NotImplementedError(f"{cls.__name__} reads no folder: a family's hf.py subclass does")

    @classmethod
    def for_config(cls, cfg: Config) -> HFCheckpoint:
        """The checkpoint of ``cfg.model.init_from`` with the run's --capacity-factor,
        --aux-loss-coef, --z-loss-coef applied (what training and export use)."""
        m = cfg.model
        overrides = {k: getattr(m, k) for k in TRAIN_OVERRIDES if getattr(m, k) is not None}
        return cls.open(m.init_from, **overrides)

    @property
    def tokenizer_path(self) -> Path:
        return tokenizer_file(self.folder)

    def optional_json(self, name: str) -> dict | None:
        path = self.folder / name
        return read_json(path) if path.is_file() else None

    def tokenizer_files(self) -> dict[str, str]:
        """The text of the folder's tokenizer files and named chat templates, by relative name."""
        return tokenizer_files(self.folder)

    # -- what a family's class says (import) --

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> list[str]:
        """Problems between the tensors on disk (headers only) and the shapes config.json implies."""
        raise NotImplementedError

    def read(self, name: str, spec: TensorShard) -> torch.Tensor:
        """This rank's fp32 slice (``spec.slice`` of the full value) of paratrain tensor ``name``."""
        raise NotImplementedError

    @staticmethod
    def tensor_source(weight: str, cfg: object) -> TensorSource:
        """Where paratrain's parameter ``weight`` lies in the Hugging Face layout (KeyError: nowhere)."""
        raise KeyError(weight)

    @staticmethod
    def rows_to_hf(t: torch.Tensor, cfg: object) -> torch.Tensor:
        """A ``rope`` tensor's rows in the Hugging Face layout (and ``rows_from_hf`` back): as is."""
        return t

    @staticmethod
    def rows_from_hf(t: torch.Tensor, cfg: object) -> torch.Tensor:
        return t

    @staticmethod
    def sliding_window(hf: dict, cfg: object) -> int | None:
        """The sliding-window size config.json gives attention, if any layer uses one."""
        return None

    # -- how a run of this family is written back (models/hf/export.py) --

    @staticmethod
    def entries(source: Path, cfg: object) -> Iterator[Entry]:
        raise NotImplementedError

    @staticmethod
    def export_config(cfg: object, base: dict | None = None, **extra: object) -> dict:
        raise NotImplementedError

    @staticmethod
    def export_problems(cfg: object) -> tuple[str, list[str]]:
        """(the architecture written, what keeps ``cfg`` from being one): nothing by default."""
        return "", []

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module) -> None:
        """Fill every (materialised, possibly sharded) parameter from the checkpoint."""
        for name, p in model.named_parameters():  # a tied head appears once (as the embedding)
            p.copy_(self.read(name, shard_of(p)).to(dtype=p.dtype, device=p.device))


def read_slice(file: Path, hf: str, spec: TensorShard,
               index: Callable[[list[slice], tuple[int, ...]], tuple] | None = None) -> torch.Tensor:
    """This rank's fp32 slice (as ``spec.slice(full)`` would give) of tensor ``hf`` in ``file``,
    reading only those rows/columns from disk; vocabulary padding rows are zeros. ``index``: where
    the paratrain slice (one slice per dimension) lies in the stored tensor, when the file stores
    it inside a larger one (Mixtral's fused experts); else the slice is the stored tensor's."""
    from safetensors import safe_open

    full = spec.full_shape
    where = [slice(None)] * len(full)  # this rank's slice, per dimension of the paratrain tensor
    with safe_open(str(file), framework="pt") as f:
        part = f.get_slice(hf)
        if not (spec.is_split or spec.padded_size is not None):
            return (part[index(where, full)] if index else part[:]).float()
        d = spec.dim
        chunk = (spec.padded_size or full[d]) // spec.count
        a = min(spec.index * chunk, full[d])
        b = min(a + chunk, full[d])
        where[d] = slice(a, b)
        at = index(where, full) if index else tuple(where[:d + 1])
        local = part[at] if b > a else torch.zeros([0 if i == d else s for i, s in enumerate(full)])
        if b - a < chunk:  # vocabulary padding rows are zeros
            pad = [0, 0] * (len(full) - d - 1) + [0, chunk - (b - a)]
            local = torch.nn.functional.pad(local.float(), pad)
    return local.float()


# --------------------------------------------------------------------------------------------
# The families' checkpoint classes, found by config.json or by a run's model config
# --------------------------------------------------------------------------------------------

_CLASSES: list[type[HFCheckpoint]] = []


def register_checkpoint(cls: type[HFCheckpoint]) -> type[HFCheckpoint]:
    """Make a family's Hugging Face mapping known (its hf.py calls this; usable as a decorator)."""
    _CLASSES.append(cls)
    return cls


def architectures() -> list[str]:
    """Every architecture paratrain imports, in registration order."""
    return [a for cls in _CLASSES for a in cls.ARCHITECTURES]


def checkpoint_class(hf: dict, where: str = "config.json") -> type[HFCheckpoint]:
    """The class that reads a folder with config.json ``hf``: by its model_type, else by its
    architecture (a model_type a family owns is read by it, which refuses an architecture it lacks)."""
    model_type = Fields(hf, where, HFError).text("model_type", "")
    for cls in _CLASSES:
        if model_type in cls.MODEL_TYPES:
            return cls
    archs = hf.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    for cls in _CLASSES:
        if arch in cls.ARCHITECTURES:
            return cls
    raise HFError(f"{where}: architecture {arch!r} is not supported; paratrain imports "
                  f"{', '.join(architectures())}")


def checkpoint_class_for(cfg: object) -> type[HFCheckpoint]:
    """The class that writes a run whose model config is ``cfg`` (export)."""
    for cls in _CLASSES:
        if cls.CONFIG is not None and isinstance(cfg, cls.CONFIG):
            return cls
    raise HFError(f"{type(cfg).__name__}: no Hugging Face mapping is registered for this model")


def check_seq_len(cfg: object, hf: dict, seq_len: int) -> str | None:
    """A problem (or None) with running sequences of seq_len tokens on this imported model."""
    window = checkpoint_class_for(cfg).sliding_window(hf, cfg)
    if window is not None and window < seq_len:
        return (f"the model uses sliding-window attention of {window} tokens, shorter than the sequence "
                f"length {seq_len}: sliding windows are not implemented; use --seq-len <= {window}")
    if seq_len > cfg.max_seq_len:
        return (f"sequence length {seq_len} exceeds the model's max_position_embeddings "
                f"({cfg.max_seq_len}): use --seq-len <= {cfg.max_seq_len}")
    return None


# --------------------------------------------------------------------------------------------
# Loading, and the checks before any worker
# --------------------------------------------------------------------------------------------


def expected_shapes(cfg: object) -> dict[str, tuple[int, ...]]:
    """Full shapes of the single-device model's parameters (ties listed once), built on meta."""
    return {n: tuple(p.shape) for n, p in build_model(cfg, "meta").named_parameters()}


def load_pretrained(path: str) -> tuple[torch.nn.Module, HFCheckpoint]:
    """The whole imported model on the CPU in one process (eval, generate)."""
    ckpt = HFCheckpoint.open(path)
    problems = ckpt.check_shapes(expected_shapes(ckpt.model_cfg))
    if problems:
        raise HFError(f"{ckpt.folder}:" + bullets(problems))
    model = build_model(ckpt.model_cfg, "cpu")
    ckpt.load_into(model)
    return model.eval(), ckpt


def _ignored_with_init_from(cfg, path: str) -> list[str]:
    """Settings the imported model replaces: a run must not look as if they took effect."""
    out = []
    if cfg.model.name != ModelConfig.name:
        out.append(f"model.name = {cfg.model.name!r} cannot be combined with --init-from: the model is "
                   f"{path}; drop --model")
    if cfg.data.vocab_size != DataConfig.vocab_size:
        out.append(f"data.vocab_size = {cfg.data.vocab_size} cannot be combined with --init-from: the "
                   f"vocabulary is the imported model's and its tokenizer's; drop --vocab-size")
    return out


def check_init_from(cfg: Config, problems: list[str]) -> None:
    """config.validate's checks of ``model.init_from`` (before any worker starts)."""
    path = cfg.model.init_from
    if not path:
        return
    shape_keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "n_experts",
                  "top_k")
    set_keys = [k for k in shape_keys if getattr(cfg.model, k) is not None]
    if set_keys:
        problems.append(f"model.{', model.'.join(set_keys)} cannot be set with --init-from: the shape comes "
                        f"from {path}/config.json")
    if not model_kind(cfg.model.name).decoder:
        problems.append(f"--init-from imports a decoder ({'/'.join(architectures())}): drop --model "
                        f"{cfg.model.name}")
    else:
        problems.extend(_ignored_with_init_from(cfg, path))
    try:
        ckpt = HFCheckpoint.for_config(cfg)
        tok = ckpt.tokenizer_path
    except HFError as e:
        problems.append(str(e))
        return
    problems.extend(ckpt.check_shapes(expected_shapes(ckpt.model_cfg)))
    seq = check_seq_len(ckpt.model_cfg, ckpt.hf_config, cfg.data.seq_len)
    if seq:
        problems.append(seq)
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).resolve() not in (tok.resolve(), tok.parent.resolve()):
        problems.append(f"data.tokenizer ({cfg.data.tokenizer}) differs from the imported model's "
                        f"({tok}): token ids must be the model's; drop data.tokenizer")
    from tokenizers import Tokenizer

    try:
        n_tok = Tokenizer.from_file(str(tok)).get_vocab_size()
    except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception for every parse error
        problems.append(f"{tok} is not a tokenizer the tokenizers library can read ({e}): copy the model's "
                        "tokenizer.json again, or save one with AutoTokenizer.save_pretrained(DIR)")
        return
    if n_tok > ckpt.model_cfg.vocab_size:
        problems.append(f"{tok} has {n_tok} tokens but the model's vocab_size is "
                        f"{ckpt.model_cfg.vocab_size}: the tokenizer does not belong to these weights")
