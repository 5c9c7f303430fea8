"""Context parallelism for modules paratrain does not know (context_parallel/door.py): a
transformers LlamaForCausalLM and a user's own module calling F.scaled_dot_product_attention, in the
user's own loop with Parallel(cp=2), equal to one process in float64 (losses and final weights; the
only reordering is the ring's log-sum-exp merge and the dp x cp gradient sum: ~1e-15 relative, so
1e-9 has six orders of margin and still catches any wrong mask, position or label shift, which move
weights by ~1e-3 after two AdamW steps at lr 1e-2)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.context_parallel.door import is_local_causal
from tests.dist import run

REL = 1e-9
VOCAB, SEQ, ROWS, STEPS = 64, 16, 2, 2


class TinyCausalLM(nn.Module):
    """A user's own model: learned positions (it takes the global ones), two attention layers via
    F.scaled_dot_product_attention: one ``is_causal=True``, one with its own tril mask."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos(positions)
        h = h + self._attend(h, 0)
        return self.head(h + self._attend(h, 1))

    def _attend(self, h: torch.Tensor, i: int) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv[i](h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # [b, heads, s, d]
        if i == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the mask a module builds over its own length: the global causal one under cp
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool).tril())
        return y.transpose(1, 2).reshape(b, s, -1)


def _llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    # recompute in backward: the attention function runs again there, with the same positions
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows, next-token targets and (step 1, the Llama) packed positions: documents of 7 and 9
    tokens in row 0 (the border inside chunk 1), 11 and 5 in row 1 (inside chunk 2)."""
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    y = ids[:, 1:].clone()
    y[0, :5] = -100  # a loss mask on rank 0's head chunk only: the ranks count unequal targets
    if step == 0:
        return ids[:, :-1], y, None
    packed = torch.tensor([[*range(7), *range(9)], [*range(11), *range(5)]])
    return ids[:, :-1], y, packed


def _documents_mask(positions: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool: causal inside each document (positions restart at 0 at each one)."""
    doc = (positions == 0).cumsum(1)
    return ((doc[:, :, None] == doc[:, None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril())[:, None]


def _loop(kind: str, par_kwargs: dict | None) -> dict:
    """Two AdamW steps of the user's loop (par_kwargs None: plain torch, one process)."""
    import paratrain

    if kind == "llama":
        model = _llama()
    else:
        torch.manual_seed(0)
        model = TinyCausalLM().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    par = paratrain.Parallel(**par_kwargs) if par_kwargs is not None else None
    if par is not None:
        model, opt = par.prepare(model, opt)
    losses = []
    for step in range(STEPS):
        x, y, packed = _batch(step)
        packed = packed if kind == "llama" else None  # the user module's mask is plain causal
        positions = torch.arange(SEQ).expand(ROWS, -1) if packed is None else packed
        if par is not None:
            x, y, positions = par.cp_split(x, y, packed)
        if kind == "llama":  # one process: transformers' sdpa under the packed rows' 4-D mask
            logits = model(x).logits if par is not None else model(
                x, position_ids=positions, attention_mask=_documents_mask(positions)).logits
        else:
            logits = model(x, positions)
        if par is not None:
            loss = par.token_mean_loss(logits, y)  # the global token mean: unequal counts per rank
            par.backward(loss)
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    state = par.full_state_dict(model) if par is not None else model.state_dict()
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in state.items()}}


class NotCausal(nn.Module):
    """Attention the door refuses: a mask that is not causal, or none through F.sdpa at all."""

    def __init__(self, manual: bool):
        super().__init__()
        self.lin, self.manual = nn.Linear(4, 4), manual

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.lin(x[..., None].expand(-1, -1, 4).to(self.lin.weight.dtype))[:, None]  # [b, 1, s, 4]
        if self.manual:  # attention the door cannot see
            return (q @ q.transpose(-1, -2)).softmax(-1) @ q
        return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))


def _refused(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "not refused"


def _door_runs(env) -> dict:
    import transformers  # noqa: F401 - loaded: Parallel recognises the model as a transformers one

    import paratrain

    out = {"llama": _loop("llama", {"cp": 2}), "user": _loop("user", {"cp": 2, "cp_method": "alltoall"})}
    models = []
    for model in (_llama(), NotCausal(manual=False), NotCausal(manual=True)):
        par = paratrain.Parallel(cp=2)
        model, _ = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        par.cp_split(torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long))
        models.append(model)
    llama, not_causal, manual = models
    x, positions = torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None]
    out["refused"] = [_refused(lambda: llama(x, labels=x)),
                      _refused(lambda: llama(x, attention_mask=(positions > 0).long())),
                      _refused(lambda: llama(x, (positions > 0).long())),  # a positional mask
                      _refused(lambda: not_causal(x, positions)),
                      _refused(lambda: manual(x, positions))]
    if env.rank == 0:  # one process, here: transformers is imported once per worker, not in pytest too
        out["one_process"] = {kind: _loop(kind, None) for kind in ("llama", "user")}
    return out


# transformers: a test-only oracle (the dev extra), imported by the workers only
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_llama_and_a_user_module_at_cp2_equal_one_process():
    """cp2 in the user's loop: a transformers LlamaForCausalLM (ring, GQA, RoPE from the injected
    global position_ids) and a user module (all-to-all, learned positions, is_causal and a tril
    mask), a loss mask that falls on one rank only (token_mean_loss: the global token mean). Then
    what is refused: labels= (shifted inside a chunk), a padding attention_mask (by keyword or
    positionally), a mask that is not causal, attention that does not go through
    F.scaled_dot_product_attention."""
    got = run(_door_runs, 2, timeout=120.0)
    ref = got[0]["one_process"]
    for rank_out in got:
        for kind in ("llama", "user"):
            assert rank_out[kind]["losses"] == pytest.approx(ref[kind]["losses"], rel=REL), kind
            for name, w in ref[kind]["weights"].items():
                rel = ((rank_out[kind]["weights"][name] - w).norm() / w.norm()).item()
                assert rel < REL, f"{kind} {name}: {rel:.2e}"
    labels, padding, positional, not_causal, manual = got[0]["refused"]
    assert "labels=" in labels and "par.token_mean_loss" in labels
    assert "attention_mask with masked positions" in padding
    assert "everything else by keyword" in positional
    assert "not the causal one" in not_causal
    assert "ran no attention through" in manual and "scaled_dot_product_attention" in manual


def test_local_causal_masks_are_recognised():
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(4, 4).masked_fill(~tril, float("-inf"))
    assert is_local_causal(tril, 4) and is_local_causal(additive, 4) and is_local_causal(tril[None, None], 4)
    assert not is_local_causal(torch.ones(4, 4, dtype=torch.bool), 4)
    assert not is_local_causal(additive + 0.5 * tril, 4)  # a bias on the allowed scores (ALiBi-like)
    assert not is_local_causal(tril, 8)
