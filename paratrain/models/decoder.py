"""What paratrain's decoder families share: one layout and its declaration.

A decoder here is ``embed`` -> ``layers`` ("0", "1", ...) -> ``norm`` -> ``lm_head``, and a pipeline
stage keeps only some of them (the others are None). Llama and GPT-2 differ inside the blocks and
the embedding, not in this; so their models subclass ``Decoder`` for the forward, share
``CoreAttention`` (softmax(q k^T) v, selective recompute's target), and ``decoder_family`` writes
the parts of their declaration that follow from the layout.

Packed rows. ``positions`` [b, s] (or None: 0..s-1, one causal sequence per row) restart at 0 at
each example's first token; every block gets them (``block(h, positions)``) and its attention
builds ``block_causal_mask(positions)``: a token attends only to the tokens before it in its own
run (a run: positions rising by 1 from a 0), so packed examples never see each other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.models.family import ModelFamily, call_part
from paratrain.models.kv_cache import KVCache


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over grouped-query heads: the "core attention" of Korthikanti et
    al. 2022, a module of its own (no parameters, so no name changes) so that selective
    recomputation can checkpoint exactly this part. q, k, v: [b, heads, s, hd] -> [b, heads, s, hd].

    ``positions`` [b, s]: packed rows' positions, from which it builds their block-diagonal causal
    mask [b, 1, s, s] (``block_causal_mask``), or None for plain causal attention (``is_causal``:
    the fast path pretraining keeps). They are arguments, not state, so selective recompute's re-run
    in backward sees its own micro-batch's. Context parallelism swaps this module for one with the
    same call (context_parallel/apply.py), which reads the positions to know which tokens it holds.
    Generation passes a KV cache's keys (models/kv_cache.py): more keys than queries, its mask."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                *, causal: bool = True, grouped: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``causal`` (with no mask): query i sees keys 0..i, else every key (a decode step's one
        query); ``grouped``: keep grouped kv heads grouped (a KV cache's keys), not repeated;
        ``mask`` (a KV cache's) or ``positions`` (packed rows), not both."""
        if positions is not None:
            mask = block_causal_mask(positions)
        if k.shape[1] != q.shape[1] and not grouped:  # each kv head serves a group of q heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


def block_causal_mask(positions: torch.Tensor | None) -> torch.Tensor | None:
    """The attention mask of packed rows, [b, 1, s, s] bool (True: may attend), or None (causal).

    Runs are numbered by counting the restarts (positions == 0) along the sequence; query i may
    see key j when both lie in one run and j <= i. Every query sees at least itself, so no softmax
    row is empty (no NaN), whatever the padding."""
    if positions is None:
        return None
    run = torch.cumsum(positions == 0, dim=1)  # [b, s]: which example each token belongs to
    same = run[:, :, None] == run[:, None, :]  # [b, s(query), s(key)]
    s = positions.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]  # [b, 1, s, s]: broadcast over heads


class Decoder(nn.Module):
    """The forward of every decoder family; subclasses build the four parts in ``__init__``."""

    embed: nn.Module | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    lm_head: nn.Module | None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens [b, s] (positions [b, s] or None) -> logits [b, s, vocab]; a pipeline stage may
        take/return hidden states. With ``cache`` (generation, models/kv_cache.py) x holds only the
        new tokens, positions their absolute positions, and each block reads and fills its slot."""
        h = call_part(self.embed, x, positions) if self.embed is not None else x  # [b, s, dim]
        for key, block in self.layers.items():
            h = block(h, positions) if cache is None else block(h, positions, cache.layer(key))
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def decoder_family(name: str, tp_plan: dict[str, str], embedding_weight: str,
                   init_value: Callable[..., torch.Tensor], lora_targets: tuple[str, ...],
                   config_names: tuple[str, ...], planned: bool = False,
                   context_parallel: bool = False) -> ModelFamily:
    """The declaration of a ``Decoder`` whose blocks hold ``attn`` (its parameter-free core at
    ``attn.core``), ``mlp_norm`` and ``mlp``; ``embedding_weight`` is the weight a tied head copies;
    ``lora_targets`` the linears LoRA adapts by default; ``config_names`` its config's ``family``
    values. ``context_parallel``: its attention calls ``core(q, k, v, positions=positions)`` with
    plain causal (or packed) masking, so context parallelism may swap the core (a family with its
    own masks, sliding windows or score caps, leaves it off and --cp is refused)."""
    return ModelFamily(
        name=name,
        blocks="layers",
        before=("embed",),
        after=("norm", "lm_head"),
        tp_plan=tp_plan,
        recompute={"full": "", "selective": "attn.core"},  # attn.core: softmax(qk^T)v, no parameters
        mlp="mlp",
        attention="attn.core" if context_parallel else "",
        mlp_norm="mlp_norm",
        head="lm_head",
        tied=("lm_head.weight", embedding_weight),
        init_value=init_value,
        lora_targets=lora_targets,
        config_names=config_names,
        planned=planned,
    )
