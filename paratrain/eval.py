"""`paratrain eval`: mean next-token cross-entropy of a trained run or an imported model.

    paratrain eval (--run RUN | --init-from DIR) [--text-file FILE | --data PATH] [--seq-len N] [--json]

--text-file: the file's text is ONE sequence, tokenized with no special tokens added; every token
after the first is predicted from all before it (what transformers' ``model(ids, labels=ids).loss``
computes). A text longer than the context is refused, never silently cut.
--data: EVERY row of a corpus (the whole file or folder: nothing is held back), tokenized with the
model's tokenizer, text in windows of --seq-len tokens (each token after the first predicted once).
Chat or completion data (detected from the rows' fields, as `train` does) is rendered with the
model's chat template (a run's: the one it trained with) and evaluated as `train` validates it:
whole examples packed in rows, each attending only to itself, the loss over the assistant turns /
completions only (``tokens``: those counted targets).
--run RUN alone: the rows the run validated on, from its run.json: its --eval-data file, else the
rows --val-fraction held out of its --data, tokenized and split as training did.
Single process, CPU or the first CUDA device; the model is loaded whole (eval is for models a
single device holds).
--cp N: context parallelism for a file longer than one process's attention can hold: N local ranks
each load the model and hold 1/N of every row's positions (the head-tail split of
context_parallel/split.py, rows padded at the end to a multiple of 2N: ``pad_rows``), attention
(--cp-method ring | alltoall | auto) sees all of them, and the ranks' loss sums and counted targets
are summed: one process's loss (docs/context_parallel.md).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm import collectives as C
from paratrain.config import Config
from paratrain.context_parallel.apply import apply_context_parallel
from paratrain.context_parallel.split import pad_rows, split_batch
from paratrain.data import Corpus, TokenRows, load_corpus, load_eval_corpus, make_rows, prepare_corpus
from paratrain.data.packing import IGNORE_INDEX, PackedRows
from paratrain.data.tokenizer import file_hash, load_tokenizer
from paratrain.inference.folders import load_run, run_template
from paratrain.launch import DistEnv, spawn
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models.hf import check_seq_len, load_pretrained
from paratrain.models.registry import NoFamilyError, family_of

# Rows to score: inputs [n, s], their next tokens [n, s] (IGNORE_INDEX where not counted), and
# the positions of packed examples (None: 0..s-1 in every row).
Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
CP_TIMEOUT_S = 3600.0  # eval --cp's local ranks: a hang fails with every rank's stack after this long


class EvalError(ValueError):
    """The evaluation cannot run as asked; the message says what to change."""


@dataclass
class EvalResult:
    loss: float  # mean next-token cross-entropy (nats)
    tokens: int  # predicted tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else float("inf")

    def to_dict(self) -> dict:
        return {"loss": self.loss, "tokens": self.tokens, "perplexity": self.perplexity}


def load_model(run: str | None = None, init_from: str | None = None, device: torch.device | str | None = None
               ) -> tuple[nn.Module, Path, dict | None]:
    """(model, tokenizer.json, the imported config.json or None) from a run folder or an HF folder,
    on ``device`` (default: the first CUDA device, else the CPU)."""
    if (run is None) == (init_from is None):
        raise EvalError("give exactly one of --run RUN or --init-from DIR")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if init_from is not None:
        model, ckpt = load_pretrained(init_from)
        return model.to(device), ckpt.tokenizer_path, ckpt.hf_config

    model, _ = load_run(run)
    info = json.loads((Path(run) / "run.json").read_text())
    return model.to(device), Path(run) / "tokenizer.json", (info.get("hf") or {}).get("config")


@torch.no_grad()
def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             positions: torch.Tensor | None = None) -> tuple[float, int]:
    """(sum of next-token losses, counted targets): inputs x [n, s], their next tokens y [n, s]
    (IGNORE_INDEX where not counted), positions [n, s] of packed examples or None."""
    device = next(model.parameters()).device
    pos = None if positions is None else positions.to(device)
    logits = model(x.to(device)) if pos is None else model(x.to(device), positions=pos)  # [n, s, vocab]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)
    return float(loss), int((y != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class ContextParallelEval:
    """``eval --cp N``: where the rows are scored. N local ranks each load the model (from the run
    or HF folder: weights are not split, activations are) and score their 1/N of every row's
    positions; their loss sums and counted targets are summed."""

    cp: int
    method: str
    run: str | None
    init_from: str | None

    def score(self, batches: list[Batch]) -> tuple[float, int]:
        return spawn(_score_on_rank, self.cp, self, batches, timeout=CP_TIMEOUT_S)[0]


def _score_on_rank(env: DistEnv, split: ContextParallelEval, batches: list[Batch]) -> tuple[float, int]:
    """One cp rank: its positions of every row (padded to a multiple of 2 x cp) through the model
    with context-parallel attention; the sums over the cp ranks."""
    model, _, _ = load_model(split.run, split.init_from, env.device)
    mesh = ParallelMesh(MeshShape(dp=split.cp, cp=split.cp), env.rank, env.device)
    apply_context_parallel(model, mesh.cp, method=split.method)
    total, count = 0.0, 0
    for x, y, positions in batches:
        padded = pad_rows(x, y, positions, split.cp, ignore_index=IGNORE_INDEX)
        s, n = loss_sum(model, *split_batch(*padded, mesh.cp.rank, split.cp))
        total, count = total + s, count + n
    sums = torch.tensor([total, count], dtype=torch.float64, device=env.device)
    C.all_reduce(sums, mesh.cp)
    return float(sums[0]), int(sums[1])


def check_cp(model: nn.Module, cp: int, method: str) -> None:
    """What ``eval --cp`` needs of the model, checked before any rank starts."""
    if cp < 1 or method not in ("ring", "alltoall", "auto"):
        raise EvalError(f"--cp {cp} --cp-method {method}: --cp must be >= 1 and --cp-method one of ring, "
                        "alltoall, auto")
    if cp == 1:
        return
    try:
        family = family_of(model, "eval --cp")
    except NoFamilyError as e:
        raise EvalError(str(e)) from None
    if not family.attention:
        why = family.no_context_parallel or "routes no attention through paratrain's attention core"
        raise EvalError(f"the {family.name} family {why}: evaluate it with --cp 1")
    heads = model.cfg.n_heads
    if method == "alltoall" and heads % cp:
        raise EvalError(f"--cp-method alltoall scatters the {heads} query heads over the cp ranks, and {cp} "
                        "does not divide them: use --cp-method ring (or auto)")


def score(model: nn.Module, batches: Iterable[Batch], split: ContextParallelEval | None = None
          ) -> tuple[float, int]:
    """(sum of next-token losses, counted targets) of ``batches``: here, or on ``split``'s cp ranks."""
    if split is not None and split.cp > 1:
        return split.score(list(batches))
    total, count = 0.0, 0
    for batch in batches:
        s, n = loss_sum(model, *batch)
        total, count = total + s, count + n
    return total, count


def check_context(model: nn.Module, hf_config: dict | None, seq_len: int) -> None:
    if hf_config is not None:
        problem = check_seq_len(model.cfg, hf_config, seq_len)
        if problem:
            raise EvalError(problem)
    elif seq_len > model.cfg.max_seq_len:
        raise EvalError(f"sequence length {seq_len} exceeds the run's context ({model.cfg.max_seq_len} "
                        "tokens, its training --seq-len)")


def eval_text(model: nn.Module, tokenizer: Path, text: str, hf_config: dict | None = None,
              seq_len: int | None = None, split: ContextParallelEval | None = None) -> EvalResult:
    """The file's text as one sequence (no special tokens)."""
    ids = load_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids
    if len(ids) < 2:
        raise EvalError(f"the text is {len(ids)} token(s) long: at least 2 are needed to predict one")
    limit = seq_len or model.cfg.max_seq_len
    if len(ids) - 1 > limit:
        raise EvalError(f"the text is {len(ids)} tokens; the context is {limit} (predicting {len(ids) - 1} "
                        f"needs {len(ids) - 1}): shorten the file, or use --data to evaluate it in windows")
    check_context(model, hf_config, len(ids) - 1)
    row = torch.tensor([ids])
    total, n = score(model, [(row[:, :-1], row[:, 1:], None)], split)
    return EvalResult(total / n, n)


def eval_corpus(model: nn.Module, tokenizer: Path, data: str, seq_len: int, hf_config: dict | None = None,
                batch: int = 8, max_rows: int | None = None, cache_dir: str | None = None,
                run: str | None = None, split: ContextParallelEval | None = None) -> EvalResult:
    """Every row of a corpus (the whole file or folder, none held back), tokenized by the model's
    tokenizer (``run``: the run folder the model comes from, whose chat template chat data needs)."""
    check_context(model, hf_config, seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        tok, where = chat_tokenizer(run, Path(tmp)) if run is not None else (tokenizer, None)
        corpus = prepare_corpus(data, 0, cache_dir, tokenizer=str(tok), template_where=where)
    cfg = Config()
    cfg.data.seq_len = seq_len
    return evaluate_rows(model, corpus, make_rows(corpus, cfg, whole=True), data, batch, max_rows, split)


def eval_run_split(model: nn.Module, run: str, seq_len: int | None = None, hf_config: dict | None = None,
                   batch: int = 8, max_rows: int | None = None,
                   split: ContextParallelEval | None = None) -> EvalResult:
    """The rows a run validated on: its --eval-data whole, else the rows --val-fraction held out of its
    --data, tokenized and split as training did (its run.json's configuration)."""
    info = json.loads((Path(run) / "run.json").read_text())
    if "config" not in info:
        raise EvalError(f"{Path(run) / 'run.json'} records no configuration: give --data FILE")
    cfg = Config.from_dict(info["config"])
    cfg.data.seq_len = seq_len or cfg.data.seq_len
    check_context(model, hf_config, cfg.data.seq_len)
    for name, path in (("--data", cfg.data.path), ("--eval-data", cfg.data.eval_path)):
        if path is not None and not Path(path).exists():
            raise EvalError(f"the run's {name} {path!r} (its run.json) does not exist here: give --data "
                            "FILE, or run eval from the folder the run was started in")
    corpus = load_corpus(cfg)
    if corpus.manifest["tokenizer"]["hash"] != file_hash(Path(run) / "tokenizer.json"):
        raise EvalError(f"the run's data now tokenizes with another tokenizer than {run}/tokenizer.json: "
                        "give --data FILE to evaluate it with the run's own")
    if cfg.data.eval_path:
        corpus = load_eval_corpus(cfg, corpus)
        return evaluate_rows(model, corpus, make_rows(corpus, cfg, whole=True), cfg.data.eval_path, batch,
                             max_rows, split)
    source = cfg.data.path or "the default corpus"
    where = f"the rows --val-fraction {cfg.data.val_fraction} holds out of {source}"
    return evaluate_rows(model, corpus, make_rows(corpus, cfg), where, batch, max_rows, split)


def evaluate_rows(model: nn.Module, corpus: Corpus, rows: TokenRows | PackedRows, where: str, batch: int = 8,
                  max_rows: int | None = None, split: ContextParallelEval | None = None) -> EvalResult:
    """Mean loss over the counted targets of the validation rows of ``rows`` (at most ``max_rows``)."""
    if int(corpus.tokens.max()) >= model.cfg.vocab_size:
        raise EvalError(f"token id {int(corpus.tokens.max())} is outside the model's vocabulary "
                        f"({model.cfg.vocab_size})")
    n_rows = min(rows.n_val, max_rows or rows.n_val)
    batches = (rows.val_batch(index, batch, slice(0, min(batch, n_rows - index * batch)))
               for index in range(-(-n_rows // batch)))  # read as scored (cp ranks are handed them all)
    total, count = score(model, ((*b, None) if len(b) == 2 else b for b in batches), split)
    if count == 0:
        raise EvalError(f"{where}: no counted target (no assistant turn or completion): nothing to evaluate")
    return EvalResult(total / count, count)


def chat_tokenizer(run: str, folder: Path) -> tuple[Path, str | None]:
    """A tokenizer folder for a run's chat data: its tokenizer.json beside a tokenizer_config.json
    holding the chat template (and special tokens) it trained with, which a run folder keeps in
    run.json; the run's tokenizer.json alone when it has no template. With it, the file the
    template's errors name: the run's run.json, where it came from, not the copy in ``folder``."""
    template = run_template(run)
    if template is None:
        return Path(run) / "tokenizer.json", None
    shutil.copy(Path(run) / "tokenizer.json", folder / "tokenizer.json")
    config = {"chat_template": template.source, **template.special_tokens}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json", template.where
