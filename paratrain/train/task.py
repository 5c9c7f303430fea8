"""A task ties a model to its data and its loss: what the trainer needs to know about both.

``LanguageModelTask`` (the Llama decoder on token rows) is the main one; the data-parallel
example ``cnn-tiny`` (SyncBatchNorm) is another. The loss is always a *sum* over the units of a
batch (tokens, or samples), so the executor can divide by the global count and every layout
computes the same mean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.config import Config, steps_for_epochs
from paratrain.data import (
    IGNORE_INDEX,
    Corpus,
    PackedRows,
    TokenRows,
    check_batch_fits,
    check_vocab,
    load_corpus,
    load_eval_corpus,
    make_rows,
)
from paratrain.engine.checks import check_observed_steps
from paratrain.engine.task import Batch, Task, as_batch
from paratrain.models import build_model, full_init_value, init_weights, materialize, model_kind, tied_name
from paratrain.models.adapters_in import PeftAdapter
from paratrain.models.from_config import model_config, model_shape  # noqa: F401  (re-exported)
from paratrain.models.hf import HFCheckpoint
from paratrain.models.lora import is_adapter_name
from paratrain.models.moe_train import MoEAccounting
from paratrain.perf.flops import lm_flops_per_token
from paratrain.sharding import TensorShard, shard_of
from paratrain.train.image_task import ImageTask


class LanguageModelTask(Task):
    name = "lm"

    def __init__(self, cfg: Config, corpus: Corpus | None = None):
        d = cfg.data
        self.corpus = corpus or load_corpus(cfg)
        self.hf = None  # an imported Hugging Face checkpoint: weights come from it, not the seed
        if cfg.model.init_from:
            self.hf = HFCheckpoint.for_config(cfg)
        self.model_cfg = self.hf.model_cfg if self.hf else model_config(cfg, self.corpus.vocab_size)
        # --lora-from: the adapters start from a PEFT folder instead of (seed, name)
        self.adapter = PeftAdapter.open(cfg.lora.from_dir) if cfg.lora.from_dir else None
        check_vocab(self.corpus.vocab_size, self.model_cfg.vocab_size)
        self.rows = make_rows(self.corpus, cfg)  # TokenRows (text windows) or PackedRows (whole examples)
        check_batch_fits(self.rows, cfg.train.global_batch)
        # --eval-data: a separate file, every row of it validated; else the rows --data holds out
        self.eval_corpus = load_eval_corpus(cfg, self.corpus) if d.eval_path else None
        self.val_rows = make_rows(self.eval_corpus, cfg, whole=True) if self.eval_corpus else self.rows
        if cfg.train.epochs is not None:  # the steps follow from the rows, known only now
            cfg.train.steps = steps_for_epochs(cfg.train.epochs, self.rows.n_train, cfg.train.global_batch)
            check_observed_steps(cfg)  # --profile / --memory-snapshot within them
        self.steps, self.global_batch, self.eval_path = cfg.train.steps, cfg.train.global_batch, d.eval_path
        self.seed = cfg.train.seed
        self.moe = None
        self.units_per_row = d.seq_len
        self.n_params = self.model_cfg.n_params()
        self.flops_per_unit = lm_flops_per_token(self.model_cfg, d.seq_len)

    def build_model(self, device: torch.device | str) -> nn.Module:
        model = build_model(self.model_cfg, device)
        self.moe = MoEAccounting(model, self.model_cfg) if self.model_cfg.n_experts else None
        return model

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        materialize(model, device)

    @torch.no_grad()
    def init_weights(self, model: nn.Module, seed: int) -> None:
        if self.hf is None:  # LoRA adapters too: registry.full_init_value knows their names
            init_weights(model, seed, self.model_cfg)
            return
        for name, p in model.named_parameters():  # the folder's slices; LoRA adapters by (seed, name)
            spec = shard_of(p)
            value = (self.adapter_value(name, spec, seed) if is_adapter_name(name)
                     else self.hf.read(name, spec))
            p.copy_(value.to(dtype=p.dtype, device=p.device))

    def init_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Full value of parameter `name` before training (ZeRO-3 materialises shards from it)."""
        if self.hf is not None and not is_adapter_name(name):
            return self.hf.read(name, TensorShard(tuple(shape)))
        if is_adapter_name(name):
            return self.adapter_value(name, TensorShard(tuple(shape)), self.seed)
        return full_init_value(tied_name(name, self.model_cfg), shape, self.seed, self.model_cfg)

    def adapter_value(self, name: str, spec: TensorShard, seed: int) -> torch.Tensor:
        """This rank's slice of a LoRA adapter's initial value: the --lora-from folder's, else by
        (seed, name)."""
        if self.adapter is not None:
            return self.adapter.read(name, spec, self.model_cfg)
        return spec.slice(full_init_value(name, spec.full_shape, seed, self.model_cfg))

    def run_info(self) -> dict:
        """What run.json keeps: the data's format and rows (truncated examples, the chat template for
        `generate --chat`), and an imported model's own config for `paratrain export --hf`."""
        info = {"data": self._data_info()}
        if self.hf is None:
            return info
        return {**info, "hf": {"source": str(self.hf.folder), "config": self.hf.hf_config,
                       "tokenizer_config": self.hf.optional_json("tokenizer_config.json"),
                       "generation_config": self.hf.optional_json("generation_config.json"),
                       "tokenizer_files": self.hf.tokenizer_files()}}

    def _data_info(self) -> dict:
        m = self.corpus.manifest
        info = {"format": self.corpus.format, "packing": not isinstance(self.rows, TokenRows),
                "train_on_prompt": m.get("train_on_prompt", True)}
        if not isinstance(self.rows, TokenRows):
            info.update(self.rows.info())
        info.update(self.data_summary())
        if m.get("chat_template"):
            info["chat_template"] = m["chat_template"]
        return info

    def data_summary(self) -> dict:
        """What the loss counts, for the start-up line and run.json: rows, counted tokens (targets
        the loss counts, of training and validation rows), the epochs the steps amount to, and
        where the token files and the loss mask lie (the prepared folder)."""
        folder = self.corpus.tokenizer_path.parent
        out = {"rows": {"train": self.rows.n_train, "val": self.val_rows.n_val},
               "counted_tokens": {"train": _counted(self.rows, train=True),
                                  "val": _counted(self.val_rows, train=False)},
               "epochs": self.steps * self.global_batch / self.rows.n_train,
               "tokens_folder": str(folder),
               "mask": str(folder / "mask.bin") if self.corpus.mask is not None else None}
        if isinstance(self.rows, PackedRows):
            out["examples"] = len(self.rows.starts)
        if self.eval_corpus is not None:
            out["eval_data"] = {"path": self.eval_path,
                                "tokens_folder": str(self.eval_corpus.tokenizer_path.parent)}
        return out

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy sum over the counted targets (``IGNORE_INDEX`` ones are skipped); the MoE
        losses come from ``side_loss_sum`` (the executors add them)."""
        wide = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))  # >= fp32
        return F.cross_entropy(wide, targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    @property
    def side_loss_sum(self) -> Callable[[list[nn.Module], bool], torch.Tensor | None] | None:
        """Losses the layers of ``modules`` produced in the forward just run (MoE aux and z), in
        the loss's sum units, or None: ``fn(modules, train) -> tensor | None``; None for a dense model."""
        return None if self.moe is None else self.moe.side_loss_sum

    def take_side_loss_sum(self) -> float:
        """This rank's MoE aux + z loss sums since the last call (the trainer's ``ce_loss``)."""
        return 0.0 if self.moe is None else self.moe.take_step_sum()

    def step_metrics(self, gather: Callable[[object], list] | None = None) -> dict:
        """moe_* rows; ``gather(obj) -> [obj of every pipeline stage]`` when stages hold the layers."""
        if self.moe is None:
            return {}
        parts = self.moe.metric_parts()
        if gather is not None:
            parts = [p for stage in gather(parts) for p in stage]
        return self.moe.metrics(parts)

    def train_batch(self, step: int, global_batch: int, rows: slice | None = None) -> Batch:
        """(x, y, positions) of rows ``rows`` of the global batch at ``step``: positions None for
        plain text windows (one causal sequence per row)."""
        return as_batch(self.rows.train_batch(step, global_batch, rows))

    def val_batch(self, index: int, global_batch: int, rows: slice | None = None) -> Batch:
        return as_batch(self.val_rows.val_batch(index, global_batch, rows))

    def val_batches(self, global_batch: int, default: int) -> int:
        """--eval-data: the batches that visit each of its rows once; else ``default`` batches of
        the held-out rows."""
        return self.val_rows.n_val_batches(global_batch) if self.eval_corpus is not None else default

    def train_units(self, step: int, global_batch: int) -> int:
        """Counted targets (!= IGNORE_INDEX) of the whole global batch at ``step``: every rank knows it."""
        if isinstance(self.rows, TokenRows):
            return global_batch * self.units_per_row
        return self.rows.train_units(step, global_batch)

    def val_units(self, index: int, global_batch: int) -> int:
        return self.val_rows.val_units(index, global_batch)


def _counted(rows: TokenRows | PackedRows, train: bool) -> int:
    """Targets the loss counts over all training (or validation) rows."""
    if isinstance(rows, PackedRows):
        return int((rows.train_counts if train else rows.val_counts).sum())
    if train:
        return rows.n_train * rows.seq_len
    return len(rows.tokens) - 1 if rows.whole else rows.n_val * rows.seq_len


def build_task(cfg: Config, corpus: Corpus | None = None) -> Task:
    if not model_kind(cfg.model.name).decoder:
        return ImageTask(cfg)
    return LanguageModelTask(cfg, corpus)
