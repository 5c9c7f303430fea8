"""Keys and values of a batch being decoded: what makes a generation step cost one token's work.

Generation feeds the model its prompts once (the prefill), then one new token per row per step.
Each attention layer keeps the keys and values it computed (RoPE already applied) in its slot of a
``KVCache``, so a step computes q/k/v for the new tokens only and attends over all before them.

* Grouped-query models stay grouped: a slot holds the layer's n_kv_heads, never repeated copies
  (the core attention groups them inside ``scaled_dot_product_attention``, ``enable_gqa``).
* A slot takes its shape, dtype and device from the first keys it gets: under tensor parallelism
  a layer computes its rank's local heads, so each rank caches only its heads; a pipeline stage
  only ever fills the slots of its own layers.
* Rows are left-padded to one length by the decode loop; ``valid`` marks the slots that hold real
  tokens. ``begin`` sets the mask of the next forward (the new tokens see the real tokens before
  them and themselves; padding is never seen), ``end`` commits the new tokens.

A layer's use of it (models/families/llama/model.py ``Attention``):

    k, v = cache.append(k, v)            # [b, kv_heads, length + s, hd]: everything so far
    y = core(q, k, v, cache.mask, causal=cache.causal, grouped=True)
"""

from __future__ import annotations

import torch


class CacheFull(ValueError):
    """More tokens than the cache was sized for (the decode loop sizes it; a bug if it happens)."""


class LayerCache:
    """One attention layer's keys and values, [b, kv_heads, capacity, head_dim], filled to ``length``."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor | None:
        return self.owner.mask

    @property
    def causal(self) -> bool:
        return self.owner.causal

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values [b, heads, s, hd]; return all of them so far (views)."""
        if self.k is None:
            b, heads, _, hd = k.shape
            shape = (b, heads, self.owner.capacity, hd)
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        start, end = self.owner.length, self.owner.length + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


class KVCache:
    """The per-layer caches of one batch, their fill level and the mask of the current forward."""

    def __init__(self, batch: int, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = capacity
        self.length = 0  # slots filled, the same in every layer
        self.step = 0  # tokens per row in the forward under way (between begin and end)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.layers: dict[str, LayerCache] = {}
        self.mask: torch.Tensor | None = None  # [b, 1, s, length + s] bool, or None (see begin)
        self.causal = True

    def layer(self, key: str) -> LayerCache:
        """The slot of block ``key`` (the model's ``layers`` key), created on first use."""
        if key not in self.layers:
            self.layers[key] = LayerCache(self)
        return self.layers[key]

    def begin(self, new_valid: torch.Tensor) -> None:
        """Prepare a forward of s new tokens per row; ``new_valid`` [b, s]: which are real tokens.

        The mask is None when no slot so far is padding and either nothing is cached yet (plain
        causal attention, the fast kernel) or one token per row is fed (it sees every slot)."""
        s, start = new_valid.shape[1], self.length
        if start + s > self.capacity:
            raise CacheFull(f"{start + s} tokens per row but the cache holds {self.capacity}")
        self.step = s
        self.valid[:, start:start + s] = new_valid.to(self.valid.device)
        seen = self.valid[:, :start + s]  # [b, keys]
        if bool(seen.all()) and (start == 0 or s == 1):
            self.mask, self.causal = None, start == 0 and s > 1
            return
        query_slot = torch.arange(start, start + s, device=seen.device)[:, None]  # [s, 1]
        key_slot = torch.arange(start + s, device=seen.device)[None, :]  # [1, keys]
        causal = key_slot <= query_slot  # [s, keys]
        itself = key_slot == query_slot  # a padding query sees itself: no empty softmax row
        self.mask = ((seen[:, None, :] & causal) | itself)[:, None]  # [b, 1, s, keys]
        self.causal = False

    def end(self) -> None:
        """Commit the tokens of the forward begun last."""
        self.length += self.step
        self.step = 0

    def nbytes(self) -> int:
        """Bytes the keys and values of every layer hold on this rank."""
        return sum(layer.nbytes() for layer in self.layers.values())
