"""The single-device model and its layout-independent initialisation."""

import torch

from paratrain.models import build_model, init_weights, materialize, preset
from paratrain.models.families.llama import full_init_value
from paratrain.models.init import param_seed
from paratrain.sharding import TensorShard, set_shard


def test_forward_shapes_and_param_count():
    cfg = preset("tiny")
    model = build_model(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params()
    tied = preset("tiny", tie_embeddings=True)
    assert sum(p.numel() for p in build_model(tied).parameters()) == tied.n_params()


def test_causal_prefix_does_not_see_the_future():
    cfg = preset("tiny")
    model = build_model(cfg)
    init_weights(model, 0, cfg)
    x = torch.randint(0, cfg.vocab_size, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(x)[:, :8], model(y)[:, :8], rtol=0, atol=0)


def test_init_depends_on_seed_and_name_only():
    cfg = preset("tiny")
    a, b = build_model(cfg), build_model(cfg, "meta")
    init_weights(a, 7, cfg)
    materialize(b, "cpu")
    init_weights(b, 7, cfg)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        assert torch.equal(pa, pb)
    assert param_seed(7, "embed.weight") != param_seed(8, "embed.weight")
    assert param_seed(7, "embed.weight") != param_seed(7, "lm_head.weight")


def test_a_shard_is_the_slice_of_the_full_value():
    cfg = preset("tiny")
    full = build_model(cfg)
    init_weights(full, 3, cfg)
    # A fake 2-way split of wq along its output features: each half must equal the full slice.
    for index in range(2):
        model = build_model(cfg, "meta")
        wq = model.layers["0"].attn.wq
        wq.weight = torch.nn.Parameter(torch.empty(cfg.dim // 2, cfg.dim, device="meta"))
        set_shard(wq.weight, TensorShard((cfg.dim, cfg.dim), dim=0, index=index, count=2))
        materialize(model, "cpu")
        init_weights(model, 3, cfg)
        expected = full.layers["0"].attn.wq.weight.chunk(2, dim=0)[index]
        assert torch.equal(model.layers["0"].attn.wq.weight, expected)


def test_padded_shard_rows_are_zero_and_gather_cuts_them():
    spec = TensorShard((5, 3), dim=0, index=1, count=2, padded_size=6)
    full = torch.arange(15.0).view(5, 3)
    local = spec.slice(full)
    assert local.shape == (3, 3) and torch.equal(local[-1], torch.zeros(3))
    assert torch.equal(local[:2], full[3:5])


def test_norm_weights_start_at_one_and_tied_head_is_the_embedding():
    cfg = preset("tiny", tie_embeddings=True)
    model = build_model(cfg)
    init_weights(model, 1, cfg)
    assert torch.equal(model.norm.weight, torch.ones(cfg.dim))
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, full_init_value("embed.weight", (cfg.vocab_size, cfg.dim), 1, cfg))
