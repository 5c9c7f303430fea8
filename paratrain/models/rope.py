"""Rotary position embeddings (RoPE): the cos/sin tables a decoder rotates q and k by, and the
scalings released checkpoints use to stretch their context.

Every decoder family with RoPE computes its tables here, from its config's ``rope_theta`` and
``rope_scaling`` (None: plain RoPE, the angle of pair i at position p is ``p * theta^(-2i/d)``).
The four scalings are those of transformers' ``modeling_rope_utils`` (the reference the import
tests check against), computed with the same float32 operations in the same order so an imported
model's tables equal transformers' own:

* ``linear`` (position interpolation): every frequency divided by ``factor``.
* ``dynamic`` (NTK-aware, "dynamic NTK"): up to ``original_max_position_embeddings`` tokens plain
  RoPE; beyond, the base grows with the sequence's length L:
  ``theta * (factor * L / original - (factor - 1)) ** (d / (d - 2))``.
* ``yarn`` (Peng et al. 2023): high frequencies kept, low ones interpolated by ``factor``, a linear
  ramp between (``beta_fast``/``beta_slow`` rotations), and cos/sin scaled by the attention factor
  ("mscale", ``0.1 ln(factor) + 1`` unless given).
* ``llama3`` (Llama 3.1-3.3): wavelengths longer than ``original / low_freq_factor`` divided by
  ``factor``, shorter than ``original / high_freq_factor`` kept, smoothly mixed between.

Dynamic scaling depends on the length of the sequence a token belongs to. transformers takes the
largest position of the call + 1 (over the whole batch, and it keeps the largest frequencies a
module has seen until a short call resets them). paratrain takes it per example (a packed row's
runs and a left-padded prompt each count alone), from the positions of the call alone: a row
computes what it computes alone in any batch, data-parallel slice or micro-batch, and one greedy
generation equals transformers' (each cached key keeps the rotation of the step that made it, as
in transformers: the prefill's length, then one more per decoded token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paratrain.safeload import Fields

KINDS = ("linear", "dynamic", "yarn", "llama3")
SUPPORTED = "default (plain RoPE), " + ", ".join(KINDS)
# The keys of each kind beyond ``factor`` (the names transformers' config.json uses).
KIND_KEYS = {
    "linear": (),
    "dynamic": (),
    "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
OPTIONAL_NUMBERS = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                    "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class RopeScaling:
    """How a model stretches RoPE beyond the length it was pretrained at (a field of its config).

    ``original_max_position_embeddings``: the pretraining length (llama3, yarn); for ``dynamic``
    the length beyond which the base grows (config.json's ``max_position_embeddings``, as in
    transformers); unused by ``linear``. Optional yarn fields stay None when config.json omits
    them (transformers' defaults apply), so an export writes back what was read."""

    kind: str
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these values (None: nothing), naming config.json's key."""
        if self.kind not in KINDS:
            return f"rope_type {self.kind!r} is not implemented; paratrain supports {SUPPORTED}"
        if not _finite(self.factor) or self.factor < 1:
            return f"factor = {self.factor!r} must be a finite number >= 1"
        orig = self.original_max_position_embeddings
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            return f"original_max_position_embeddings = {orig!r} must be an integer >= 1"
        for key in OPTIONAL_NUMBERS:
            value = getattr(self, key)
            if value is not None and not _finite(value):
                return f"{key} = {value!r} must be a finite number"
        return self._range_problem()

    def _range_problem(self) -> str | None:
        if self.kind == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            if low is None or high is None:
                return "llama3 scaling needs low_freq_factor and high_freq_factor"
            if not 0 < low < high:
                return (f"low_freq_factor = {low!r} and high_freq_factor = {high!r} must satisfy "
                        "0 < low_freq_factor < high_freq_factor")
        for key in ("beta_fast", "beta_slow"):  # rotations: 0 is transformers' "unset" (32 and 1)
            if (getattr(self, key) or 0) < 0:
                return f"{key} = {getattr(self, key)!r} must be >= 0"
        if self.attention_factor is not None and self.attention_factor <= 0:
            return f"attention_factor = {self.attention_factor!r} must be > 0"
        return None

    def context(self, max_position_embeddings: int) -> int:
        """The longest sequence the scaled model is meant for: config.json's
        ``max_position_embeddings``, or factor x the pretraining length where that is longer
        (Qwen's yarn and dynamic configs keep the pretraining length there)."""
        if self.kind == "linear":
            return max_position_embeddings
        return max(max_position_embeddings, int(self.factor * self.original_max_position_embeddings))

    def hf_dict(self) -> dict:
        """The keys config.json's ``rope_scaling`` / ``rope_parameters`` hold (rope_theta aside)."""
        out: dict[str, object] = {"rope_type": self.kind, "factor": self.factor}
        for key in KIND_KEYS[self.kind]:
            value = getattr(self, key)
            if value is not None and (key != "truncate" or value is False):
                out[key] = value
        return out


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


# --------------------------------------------------------------------------------------------
# Inverse frequencies [head_dim/2], as transformers' _compute_*_parameters compute them
# --------------------------------------------------------------------------------------------


def _exponents(head_dim: int, device: torch.device | str | None) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim  # 2i/d


def plain_inv_freq(head_dim: int, theta: float, device: torch.device | str | None) -> torch.Tensor:
    return 1.0 / theta ** _exponents(head_dim, device)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """transformers' _compute_llama3_parameters, line for line."""
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen = old_context_len / s.low_freq_factor
    high_freq_wavelen = old_context_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / s.factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn(head_dim: int, theta: float, s: RopeScaling, device: torch.device | str | None) -> torch.Tensor:
    """transformers' _compute_yarn_parameters (the frequencies; ``attention_factor`` the scale)."""
    dim = head_dim
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1  # `or`: transformers treats 0 as unset

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        original = s.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** _exponents(dim, device)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (s.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor


def attention_factor(s: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by (YaRN's "mscale"; 1 for every other kind)."""
    if s is None or s.kind != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(get_mscale(s.factor, s.mscale) / get_mscale(s.factor, s.mscale_all_dim))
    return get_mscale(s.factor)


def static_inv_freq(head_dim: int, theta: float, s: RopeScaling | None,
                    device: torch.device | str | None) -> torch.Tensor:
    """[head_dim/2] for every kind whose frequencies do not depend on the length (not dynamic)."""
    if s is None:
        return plain_inv_freq(head_dim, theta, device)
    if s.kind == "linear":
        return plain_inv_freq(head_dim, theta, device) / s.factor
    if s.kind == "llama3":
        return _llama3(plain_inv_freq(head_dim, theta, device), s)
    if s.kind == "yarn":
        return _yarn(head_dim, theta, s, device)
    raise ValueError(f"{s.kind} frequencies depend on the length: use dynamic_inv_freq")


def dynamic_inv_freq(head_dim: int, theta: float, s: RopeScaling, lengths: torch.Tensor) -> torch.Tensor:
    """[..., head_dim/2]: dynamic NTK frequencies for sequences of ``lengths`` [...] (int64).

    Up to the original length transformers keeps the frequencies it computed at init (Python
    floats); beyond, it recomputes them from the length as a tensor (float32): both are kept."""
    dim, original = head_dim, s.original_max_position_embeddings
    short_base = theta * ((s.factor * original / original) - (s.factor - 1)) ** (dim / (dim - 2))
    short = 1.0 / (short_base ** _exponents(dim, lengths.device))
    seq_len = torch.maximum(lengths, torch.tensor(original, dtype=lengths.dtype, device=lengths.device))
    base = theta * ((s.factor * seq_len / original) - (s.factor - 1)) ** (dim / (dim - 2))  # float32
    long = 1.0 / (base[..., None] ** _exponents(dim, lengths.device))
    return torch.where((lengths > original)[..., None], long, short)


def example_lengths(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] int64: the length of the example each token belongs to (its run's largest position
    + 1; runs restart where positions are 0, as in models/decoder.py's block_causal_mask). A KV
    cache's decode step (positions t, no 0) is one run: length t + 1."""
    run = torch.cumsum(positions == 0, dim=1)  # [b, s]
    b, s = positions.shape
    longest = torch.zeros(b, s + 1, dtype=torch.long, device=positions.device)
    longest = longest.scatter_reduce(1, run, positions.long(), "amax")
    return longest.gather(1, run) + 1


# --------------------------------------------------------------------------------------------
# The tables and the rotation
# --------------------------------------------------------------------------------------------


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | str | None,
                positions: torch.Tensor | None = None,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles, computed in fp32: [seq, head_dim/2] for positions 0..seq-1,
    or [b, seq, head_dim/2] at ``positions`` [b, seq] (packed rows restart at each example)."""
    if scaling is not None and scaling.kind == "dynamic":
        if positions is None:
            inv_freq = dynamic_inv_freq(head_dim, theta, scaling, torch.tensor(seq_len, device=device))
        else:
            inv_freq = dynamic_inv_freq(head_dim, theta, scaling, example_lengths(positions))  # [b, s, hd/2]
    else:
        inv_freq = static_inv_freq(head_dim, theta, scaling, device)
    if positions is not None:
        angles = positions.to(torch.float32)[..., None] * inv_freq  # same products as the outer below
    else:
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    scale = attention_factor(scaling)
    if scale != 1.0:  # YaRN: transformers scales the tables, so q.k grows by scale^2
        cos, sin = cos * scale, sin * scale
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by the position's angle. x: [batch, seq, heads, head_dim];
    cos/sin: [seq, head_dim/2] (every row) or [batch, seq, head_dim/2]."""
    x2 = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, 2))  # [b, s, h, hd/2, 2]
    a, b = x2[..., 0], x2[..., 1]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).type_as(x)


# --------------------------------------------------------------------------------------------
# config.json: transformers 5's ``rope_parameters``, or the older ``rope_theta`` + ``rope_scaling``
# --------------------------------------------------------------------------------------------


def read_hf_rope(hf: dict, max_position_embeddings: int, where: str,
                 error: type[Exception]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of a config.json dict, as transformers reads it: a non-empty
    ``rope_scaling`` wins over ``rope_parameters``; theta from the chosen one, else the top-level
    ``rope_theta``, else 10000. A wrong value or an unknown type raises ``error`` naming the key."""
    fields = Fields(hf, where, error)
    key = "rope_scaling" if fields.obj("rope_scaling") else "rope_parameters"
    params = Fields(fields.obj(key), f"{where}: {key}", error)
    theta = params.number("rope_theta", None, positive=True)
    theta = theta or fields.number("rope_theta", 10000.0, positive=True)
    if not math.isfinite(theta):
        raise error(f"{where}: rope_theta = {theta!r} must be a finite number > 0")
    kind = params.text("rope_type", None) or params.text("type", None) or "default"
    if kind == "default":
        return theta, None
    if kind not in KINDS:
        raise error(f"{where}: {key}.rope_type = {kind!r}: RoPE scaling type {kind!r} is not implemented; "
                    f"paratrain supports {SUPPORTED}")
    partial = params.number("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise error(f"{where}: {key}.partial_rotary_factor = {partial!r} (RoPE on part of each head) is not "
                    "implemented; paratrain supports 1.0")
    try:
        return theta, _scaling(params, kind, max_position_embeddings)
    except error:  # a typed read's message already names the file and the key
        raise
    except ValueError as e:  # RopeScaling's check
        raise error(f"{where}: {key}: {e}") from None


def _scaling(params: Fields, kind: str, max_position_embeddings: int) -> RopeScaling:
    """The RopeScaling of one rope_scaling / rope_parameters object (typed reads by ``params``)."""
    original = max_position_embeddings  # dynamic's threshold; llama3/yarn's default, as transformers'
    if kind in ("llama3", "yarn"):
        original = params.integer("original_max_position_embeddings", max_position_embeddings)
    factor = params.number("factor", None) if kind == "yarn" else params.number("factor")
    values: dict[str, object] = {k: params.number(k, None) for k in KIND_KEYS[kind] if k in OPTIONAL_NUMBERS}
    if kind == "yarn":
        if factor is None:  # transformers' fallback
            factor = max_position_embeddings / original
        values["truncate"] = params.flag("truncate", True)
    return RopeScaling(kind, factor, original, **values)


def hf_rope_fields(theta: float, scaling: RopeScaling | None) -> dict:
    """What an export writes to config.json for RoPE: ``rope_parameters`` (transformers 5),
    ``rope_theta`` and, when scaled, ``rope_scaling`` (transformers 4; 5 reads it first)."""
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is None:
        return {"rope_parameters": params, "rope_theta": theta}
    return {"rope_parameters": {**scaling.hf_dict(), "rope_theta": theta}, "rope_theta": theta,
            "rope_scaling": scaling.hf_dict()}
