"""Mixture of experts (paratrain/models/moe.py): router and combine against a naive per-token
loop, the aux losses against their formulas by hand, token dropping, and the per-row accounting
that makes the aux loss the same whatever the micro-batching."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from paratrain.models.families.llama import PRESETS, Llama, preset
from paratrain.models.moe import MoE, moe_loss_sum, moe_metrics
from paratrain.perf.flops import lm_flops_per_token


def make_moe(*, capacity_factor: float = 0.0, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(dim=16, ffn_dim=24, n_experts=4, top_k=2, capacity_factor=capacity_factor).double()
    return m


def naive(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-2, renormalise, weighted sum of the chosen experts."""
    out = torch.zeros_like(x)
    for i, tok in enumerate(x):
        p = F.softmax(m.router.weight @ tok, dim=-1)
        w, e = p.topk(2)
        w = w / w.sum()
        for wj, ej in zip(w, e):
            out[i] += wj * m.experts[str(int(ej))](tok[None])[0]
    return out


def test_router_and_combine_match_a_per_token_loop():
    m = make_moe()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    got = m(x)
    want = naive(m, x.reshape(-1, 16)).view(3, 5, 16)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_aux_and_z_loss_match_the_formula_by_hand():
    m = make_moe()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    m(x)
    aux_rows, z = [], 0.0
    for row in x:
        logits = row @ m.router.weight.t()  # [s, E]
        p = logits.softmax(-1)
        chosen = p.topk(2).indices
        f = torch.tensor([(chosen == e).sum().item() / (2 * 6) for e in range(4)], dtype=torch.float64)
        aux_rows.append(4 * (f * p.mean(0)).sum())
        z += torch.logsumexp(logits, -1).pow(2).sum()
    torch.testing.assert_close(m.stats.aux_sum, sum(aux_rows) * 6)  # token units: x seq_len
    torch.testing.assert_close(m.stats.z_sum, z)
    assert m.stats.dropped == 0 and int(m.stats.load.sum()) == 2 * 6 * 2


def test_aux_loss_is_the_same_whatever_the_micro_batching():
    """One call on 4 rows == the sum of two calls on 2 rows each (what dp2 or 2 micro-batches see),
    value and gradient; a per-micro-batch f*P product would fail this."""
    m = make_moe(seed=1)
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    m(x)
    whole = moe_loss_sum(m, aux_loss_coef=0.01, z_loss_coef=0.001, n_moe_layers=1)
    g_whole = torch.autograd.grad(whole, m.router.weight)[0]
    parts = []
    for half in (x[:2], x[2:]):
        m(half)
        parts.append(moe_loss_sum(m, aux_loss_coef=0.01, z_loss_coef=0.001, n_moe_layers=1))
    g_parts = torch.autograd.grad(parts[0] + parts[1], m.router.weight)[0]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-15)


def test_capacity_drops_tokens_of_a_skewed_router_and_reports_it():
    m = make_moe(capacity_factor=1.0)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 50.0  # every token with x[0] > 0 prefers expert 0
        m.router.weight[1, 0] = 25.0
    x = torch.randn(1, 32, 16, dtype=torch.float64).abs()
    out = m(x)
    # capacity = ceil(1.0 * 32 * 2 / 4) = 16 per expert: experts 0 and 1 get 32 each, 16 are dropped
    assert m.stats.dropped == 32 and m.stats.assigned == 64
    met = moe_metrics(m, n_tokens=32)
    assert met["moe_dropped_fraction"] == 0.5
    assert met["moe_expert_load"] == [0.5, 0.5, 0.0, 0.0]
    # kept tokens are the first 16 in token order; the rest get no MLP output at all
    assert out[0, 16:].abs().max() == 0 and out[0, :16].abs().min() > 0
    dropless = make_moe(capacity_factor=0.0)
    dropless.load_state_dict(m.state_dict())
    dropless(x)
    assert dropless.stats.dropped == 0


def test_dense_model_unchanged_and_moe_presets_count_every_expert():
    dense = PRESETS["tiny"]
    assert dense.n_experts == 0 and dense.n_moe_layers == 0 and dense.n_active_params() == dense.n_params()
    torch.manual_seed(0)
    model = Llama(preset("tiny-moe"))
    assert sum(p.numel() for p in model.parameters()) == preset("tiny-moe").n_params()
    assert "layers.3.mlp.experts.3.down.weight" in dict(model.named_parameters())
    torch.manual_seed(0)
    assert not any("experts" in n for n, _ in Llama(dense).named_parameters())
    # Mixtral 8x7B: 46.7 B total, 12.9 B active (Mistral AI's published figures)
    mixtral = PRESETS["mixtral-8x7b"]
    assert round(mixtral.n_params() / 1e9, 1) == 46.7
    assert round(mixtral.n_active_params() / 1e9, 1) == 12.9
    every2 = preset("tiny-moe", moe_every=2)
    assert [every2.is_moe_block(i) for i in range(4)] == [False, True, False, True]


def test_an_expert_without_tokens_still_gets_a_zero_gradient():
    """Else its DDP bucket / ZeRO-3 unit waits forever on the rank where it got no token (seen:
    ranks diverged at a ZeRO-3 reduce-scatter) and AdamW skips it in one layout but not another."""
    m = make_moe()
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = m.router.weight[1, 0] = 50.0  # experts 0 and 1 take every token
    x = torch.randn(1, 8, 16, dtype=torch.float64).abs()
    m(x).sum().backward()
    assert int(m.stats.load[2]) == int(m.stats.load[3]) == 0
    for e in ("2", "3"):
        grads = [p.grad for p in m.experts[e].parameters()]
        assert all(g is not None and not g.any() for g in grads)
    assert m.experts["0"].gate.weight.grad.abs().sum() > 0


def _measured_train_flops_per_token(cfg, seq_len: int) -> float:
    """Forward + backward FLOPs per token as torch's FlopCounterMode counts the ops that ran."""
    torch.manual_seed(0)
    model, tokens = Llama(cfg), torch.randint(0, cfg.vocab_size, (2, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    return counter.get_total_flops() / tokens.numel()


def test_mfu_counts_the_active_experts_and_the_router():
    """The MoE model's extra FLOPs over the dense one of the same shape, against a count of the
    matmuls that actually ran. Attention is the same in both, so it cancels in the difference
    (whatever FlopCounterMode makes of CPU attention); the count is exact, hence ==."""
    dense, moe = preset("tiny"), preset("tiny-moe")
    measured = _measured_train_flops_per_token(moe, 32) - _measured_train_flops_per_token(dense, 32)
    assert measured > 0
    assert lm_flops_per_token(moe, 32) - lm_flops_per_token(dense, 32) == measured


class _Bf16Out(torch.nn.Module):
    """An expert whose output is bf16 while its input is fp32: what CUDA autocast gives."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).bfloat16()


def test_moe_combines_bf16_expert_outputs_into_the_fp32_stream():
    # Seen on a GPU with --precision bf16: index_copy of the bf16 expert output into the fp32 slot
    # buffer failed (CPU autocast promotes index_copy, CUDA's does not: simulated here).
    m = make_moe().float()
    x = torch.randn(2, 6, 16)
    want = m(x)
    m.experts = torch.nn.ModuleDict({name: _Bf16Out(e) for name, e in m.experts.items()})
    got = m(x)
    got.sum().backward()
    assert got.dtype == torch.float32 and m.router.weight.grad is not None
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)  # outputs rounded to bf16 (8 bits)
