"""Rotary frequencies and their scalings (linear, dynamic NTK, Llama 3, YaRN, per-
frequency factors), computed as transformers' modeling_rope_utils computes them:
`rope_frequencies(dim, base, scaling)` -> (inverse frequencies (dim/2,), cos/sin factor).
RotaryEmbedding (mhsa.nn.positional) rotates with them."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.checks import int_at_least

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "factors")


def rope_type(scaling: dict | None) -> str:
    """The scaling's "rope_type" (older configs: "type"); "default" for None."""
    _check_scaling(scaling)
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _check_scaling(scaling: object) -> None:
    if scaling is not None and not isinstance(scaling, dict):
        raise TypeError(
            f"rope scaling must be a dict (a config's rope_scaling, e.g. "
            f"{{'rope_type': 'linear', 'factor': 2.0}}) or None, got {scaling!r}"
        )


def rope_frequencies(
    dim: int,
    base: float = 10000.0,
    scaling: dict | None = None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[Tensor, float]:
    """Rotary inverse frequencies (dim/2,) float32 for `dim` rotated channels, and the
    factor cos and sin are multiplied by, computed as transformers' modeling_rope_utils.

    scaling: None (plain RoPE) or a dict with "rope_type" (older configs: "type") and
    that type's keys, as in a Hugging Face config's rope_parameters / rope_scaling:
        linear   factor: every frequency divided by factor (positions interpolated)
        dynamic  factor: NTK-aware, the base grows once seq_len (the largest position + 1)
                 passes max_position_embeddings; below it, plain RoPE
        llama3   factor, low_freq_factor, high_freq_factor, original_max_position_embeddings:
                 long wavelengths divided by factor, short ones kept, a smooth ramp between
        yarn     factor, original_max_position_embeddings, optional beta_fast (32),
                 beta_slow (1), truncate (True), attention_factor (else 0.1 ln(factor) + 1,
                 or the mscale / mscale_all_dim ratio): the ramp of YaRN, with cos and sin
                 scaled by the attention factor
        factors  factors: dim/2 divisors, one per frequency (a GGUF file's rope_freqs, as
                 llama.cpp applies it: Llama 3.1 and later's llama3 scaling)
    """
    int_at_least("dim", dim, 1)
    if isinstance(base, bool) or not (
        isinstance(base, int | float) and math.isfinite(base) and base > 0
    ):
        raise ValueError(f"base must be a finite number > 0 (10000.0 is RoPE's), got {base!r}")
    _check_scaling(scaling)
    scaling = dict(scaling or {})
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported; use one of {ROPE_TYPES}")
    context = "original_max_position_embeddings"
    needs = {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "yarn": (context,),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", context),
        "factors": ("factors",),
    }
    needs = needs.get(kind, ())
    missing = [key for key in needs if scaling.get(key) is None]
    if kind == "dynamic" and max_position_embeddings is None:
        missing.append("max_position_embeddings")
    if missing:
        raise ValueError(f"rope scaling {kind!r} needs {missing}; add them to the scaling dict")
    factor = scaling.get("factor")
    if factor is not None and (
        isinstance(factor, bool)
        or not (isinstance(factor, int | float) and math.isfinite(factor) and factor > 0)
    ):
        raise ValueError(f"rope scaling factor must be a finite number > 0, got {factor!r}")
    if kind in ("llama3", "yarn"):
        int_at_least(context, scaling[context], 1, " (the pretraining context length)")
    if kind == "dynamic":
        base = dynamic_base(dim, base, factor, max_position_embeddings, torch.tensor(seq_len or 0))
    exponents = _exponents(dim, None)
    inv_freq = 1.0 / (base**exponents)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, base, exponents, scaling, max_position_embeddings)
    if kind == "factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            got, want = tuple(factors.shape), inv_freq.numel()
            raise ValueError(f"rope scaling 'factors' needs dim/2 = {want} factors, got {got}")
        return inv_freq / factors, 1.0
    return inv_freq, 1.0


def _exponents(dim: int, device: torch.device | None) -> Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def dynamic_base(
    dim: int, base: float, factor: float, max_position_embeddings: int, seq_len: Tensor
) -> Tensor:
    """Dynamic NTK's base for calls whose longest position + 1 is seq_len (an int64
    0-d tensor, read on its device: no host sync, so compiled steps trace it): grown
    once seq_len passes max_position_embeddings, in float32 as transformers does."""
    seq_len = seq_len.clamp(min=max_position_embeddings)
    growth = factor * seq_len / max_position_embeddings - (factor - 1)
    return base * growth ** (dim / (dim - 2))


def dynamic_frequencies(
    inv_freq: Tensor, base: float, factor: float, max_position_embeddings: int, seq_len: Tensor
) -> Tensor:
    """The inverse frequencies (dim/2,) of dynamic NTK for a call whose longest position
    + 1 is seq_len: inv_freq (plain RoPE's) up to max_position_embeddings, from the
    grown base past it."""
    dim = 2 * inv_freq.numel()
    grown = dynamic_base(dim, base, factor, max_position_embeddings, seq_len)
    scaled = 1.0 / (grown ** _exponents(dim, seq_len.device))
    return torch.where(seq_len > max_position_embeddings, scaled, inv_freq.to(seq_len.device))


def _llama3(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1: wavelengths above context/low_freq_factor divided by factor, below
    context/high_freq_factor kept, and a linear blend in 1/wavelength between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, blended, scaled)


def _yarn(
    dim: int, base: float, exponents: Tensor, scaling: dict, max_position_embeddings: int | None
) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies by factor, keep high ones, ramp between the
    dimensions that turn beta_fast and beta_slow times over the original context."""
    context = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("rope scaling 'yarn' without a factor needs max_position_embeddings")
        factor = max_position_embeddings / context

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor)
        if m and m_all:
            attention_factor = mscale(factor, m) / mscale(factor, m_all)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base**exponents
    extrapolation = 1 - ramp  # the share of each frequency kept unscaled
    interpolated, kept = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + kept * extrapolation
    return inv_freq, float(attention_factor)
