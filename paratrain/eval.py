"""`paratrain eval`: mean next-token cross-entropy of a trained run or an imported model.

    paratrain eval (--run RUN | --init-from DIR) (--text-file FILE | --data PATH) [--seq-len N] [--json]

--text-file: the file's text is ONE sequence, tokenized with no special tokens added; every token
after the first is predicted from all before it (what transformers' ``model(ids, labels=ids).loss``
computes). A text longer than the context is refused, never silently cut.
--data: the validation rows (the same split `paratrain train` holds out) of a corpus tokenized
with the model's tokenizer, in windows of --seq-len tokens.
Single process, CPU or the first CUDA device; the model is loaded whole (eval is for models a
single device holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from paratrain.data import TokenRows, prepare_corpus
from paratrain.data.tokenizer import load_tokenizer
from paratrain.generate import load_run
from paratrain.models.llama import Llama
from paratrain.models.llama.hf import check_seq_len, load_pretrained


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


def load_model(run: str | None = None, init_from: str | None = None) -> tuple[Llama, Path, dict | None]:
    """(model, tokenizer.json, the imported config.json or None) from a run folder or an HF folder."""
    if (run is None) == (init_from is None):
        raise EvalError("give exactly one of --run RUN or --init-from DIR")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if init_from is not None:
        model, ckpt = load_pretrained(init_from)
        return model.to(device), ckpt.tokenizer_path, ckpt.hf_config

    model, _ = load_run(run)
    import json

    info = json.loads((Path(run) / "run.json").read_text())
    return model.to(device), Path(run) / "tokenizer.json", (info.get("hf") or {}).get("config")


@torch.no_grad()
def loss_sum(model: Llama, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """(sum of next-token losses, predicted tokens): inputs x [n, s], their next tokens y [n, s]."""
    device = next(model.parameters()).device
    logits = model(x.to(device))  # [n, s, vocab]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(), reduction="sum")
    return float(loss), y.numel()


def check_context(model: Llama, hf_config: dict | None, seq_len: int) -> None:
    if hf_config is not None:
        problem = check_seq_len(model.cfg, hf_config, seq_len)
        if problem:
            raise EvalError(problem)
    elif seq_len > model.cfg.max_seq_len:
        raise EvalError(f"sequence length {seq_len} exceeds the run's context ({model.cfg.max_seq_len} "
                        "tokens, its training --seq-len)")


def eval_text(model: Llama, tokenizer: Path, text: str, hf_config: dict | None = None,
              seq_len: int | None = None) -> EvalResult:
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
    total, n = loss_sum(model, row[:, :-1], row[:, 1:])
    return EvalResult(total / n, n)


def eval_corpus(model: Llama, tokenizer: Path, data: str, seq_len: int, hf_config: dict | None = None,
                batch: int = 8, max_rows: int | None = None, cache_dir: str | None = None) -> EvalResult:
    """The held-out rows of a corpus (as `paratrain train` splits it), tokenized by the model's tokenizer."""
    check_context(model, hf_config, seq_len)
    corpus = prepare_corpus(data, 0, cache_dir, tokenizer=str(tokenizer))
    if int(corpus.tokens.max()) >= model.cfg.vocab_size:
        raise EvalError(f"token id {int(corpus.tokens.max())} is outside the model's vocabulary "
                        f"({model.cfg.vocab_size})")
    rows = TokenRows(corpus.tokens, seq_len, val_fraction=0.02, seed=0, doc_ends=corpus.doc_ends)
    n_rows = min(rows.n_val, max_rows or rows.n_val)
    total, count = 0.0, 0
    for index in range(-(-n_rows // batch)):
        x, y = rows.val_batch(index, batch, slice(0, min(batch, n_rows - index * batch)))
        s, n = loss_sum(model, x, y)
        total, count = total + s, count + n
    return EvalResult(total / count, count)
