"""Positional information: encodings added to the input, and positions inside attention.

Added to token embeddings (B, L, d_model):
    SinusoidalPositionalEncoding, LearnedPositionalEmbedding
Used inside attention (pass as `position=` to mhsa.nn.MultiHeadAttention):
    RotaryEmbedding (rotates q and k), ALiBiPosition and RelativeBiasPosition (modules
    that give the score functions mhsa.core.scores.ALiBi and RelativeBias, evaluated per tile
    inside the attention engine)

Positions inside attention follow the causal convention: with L queries and S keys,
keys sit at positions 0..S-1 and queries at S-L..S-1 (bottom-right).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..core import scores
from ..core.backends.common import tracing
from ..core.checks import int_at_least, is_int_tensor
from ..core.masks.causal import causal_shift
from .rope_scaling import (  # noqa: F401 (ROPE_TYPES, rope_type: public here)
    ROPE_TYPES,
    dynamic_frequencies,
    rope_frequencies,
    rope_type,
)


def _check_positive(name: str, value: int) -> None:
    int_at_least(name, value, 1)


def _check_fits(length: int, offset: int, max_len: int) -> None:
    if offset < 0 or offset + length > max_len:
        raise ValueError(
            f"positions {offset}..{offset + length - 1} exceed max_len={max_len}; "
            "build the encoding with a larger max_len"
        )


def _check_added(x: Tensor, d_model: int, positions: Tensor | None) -> None:
    """x (B, L, d_model) and positions (L,) or (B, L) integers, one per token of x."""
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must be (batch, length, {d_model}), got {tuple(x.shape)}")
    if positions is None:
        return
    if not is_int_tensor(positions):
        raise TypeError(f"positions must hold integer positions, got {positions.dtype}")
    if positions.shape != (1, x.shape[1]):  # ((1, L) broadcasts over the batch, as (L,))
        _check_rotary_positions(positions, x)


def _check_positions(positions: Tensor, max_len: int) -> None:
    if torch.compiler.is_compiling():
        return  # a value check would break the graph (eager calls check)
    if positions.numel() and int(positions.max()) >= max_len:
        raise ValueError(
            f"position {int(positions.max())} exceeds max_len={max_len}; "
            "build the encoding with a larger max_len"
        )
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")


def sinusoidal_table(length: int, d_model: int, base: float = 10000.0) -> Tensor:
    """(length, d_model) float32: PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(...)."""
    if isinstance(base, bool) or not isinstance(base, int | float) or not 0 < base < math.inf:
        raise ValueError(f"base must be a finite number > 0, got {base!r}")
    positions = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    even = torch.arange(0, d_model, 2, dtype=torch.float64)
    angles = positions / base ** (even / d_model)  # (length, ceil(d/2))
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.float()


class SinusoidalPositionalEncoding(nn.Module):
    """The fixed sin/cos encoding of "Attention Is All You Need", added to x (B, L, d)."""

    def __init__(self, d_model: int, max_len: int = 4096, base: float = 10000.0) -> None:
        super().__init__()
        _check_positive("d_model", d_model)
        _check_positive("max_len", max_len)
        self.register_buffer("table", sinusoidal_table(max_len, d_model, base), persistent=False)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """x (B, L, d_model) -> x + PE[offset : offset + L], or x + PE[positions] for
        per-sequence positions (B, L) (e.g. left-padded batches)."""
        _check_added(x, self.table.shape[1], positions)
        if positions is not None:
            _check_positions(positions, self.table.shape[0])
            return x + self.table[positions].to(x.dtype)
        _check_fits(x.shape[1], offset, self.table.shape[0])
        return x + self.table[offset : offset + x.shape[1]].to(x.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """A trained embedding per position (BERT, GPT-2), added to x (B, L, d)."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        _check_positive("max_len", max_len)
        _check_positive("d_model", d_model)
        self.embedding = nn.Embedding(max_len, d_model)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """x (B, L, d_model) -> x + E[offset : offset + L], or x + E[positions] for
        per-sequence positions (B, L)."""
        _check_added(x, self.embedding.embedding_dim, positions)
        if positions is not None:
            _check_positions(positions, self.embedding.num_embeddings)
            return x + self.embedding(positions).to(x.dtype)
        _check_fits(x.shape[1], offset, self.embedding.num_embeddings)
        positions = torch.arange(offset, offset + x.shape[1], device=x.device)
        return x + self.embedding(positions).to(x.dtype)


class AttentionPosition(nn.Module):
    """Base for positions applied inside attention; each subclass overrides one hook."""

    def rotate(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        """q (B, H, L, D), k (B, H_kv, L_k, D) of new tokens starting at `offset`."""
        return q, k

    def attention_bias(self, q_len: int, kv_len: int) -> Tensor | None:
        """(H, L, S) float bias added to the scores, or None (a dense tensor: prefer
        `score`, which the engine evaluates per tile)."""
        return None

    def score(self) -> scores.ScoreFunction | None:
        """An mhsa.core.scores function applied to the scores inside attention, or None."""
        return None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first R channels of x (B, H, L, D) by cos, sin of shape (L, R/2) or
    (B, L, R/2): pairs (c, c + R/2) (the "rotate half" layout); channels R.. pass through.
    Computed in float32, returned in x's dtype."""
    return _rotate(x, *_full_width(cos, sin))


def _full_width(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin (..., L, R/2) -> (cos, cos) and (-sin, sin) (..., L, R), with a head axis
    when per sequence ((B, L, R/2) -> (B, 1, L, R)), as _rotate takes them."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + swap_halves(x) * sin over the first R = cos.shape[-1] channels: for pair
    (a, b) that is (a cos - b sin, b cos + a sin), bit for bit (the negation is exact)."""
    rotary_dim = cos.shape[-1]
    part = x.float() if rotary_dim == x.shape[-1] else x[..., :rotary_dim].float()
    rotated = (part * cos + part.roll(rotary_dim // 2, dims=-1) * sin).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class RotaryEmbedding(AttentionPosition):
    """Rotary position embedding (RoFormer): rotates q and k so q.k depends on j - i.

    Channel pairs are (c, c + R/2) (the "rotate half" layout of Llama in transformers);
    frequency of pair c is base^(-2c/R) before any scaling. R = rotary_dim (default
    head_dim) rotates the first R channels of each head only (partial rotary, as
    partial_rotary_factor R / head_dim in transformers); the others pass through.
    scaling and max_position_embeddings: see rope_frequencies (linear, dynamic, llama3,
    yarn). With dynamic scaling the frequencies depend on the largest position of each
    call, so cached keys keep the frequencies of the call that made them (as in
    transformers).
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        rotary_dim: int | None = None,
        scaling: dict | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        _check_positive("head_dim", head_dim)
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        _check_positive("rotary_dim", rotary_dim)
        if head_dim % 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(
                "head_dim must be even for rotary embeddings, and rotary_dim even and <= "
                f"head_dim; got head_dim {head_dim}, rotary_dim {rotary_dim}"
            )
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self.scaling, self.max_position_embeddings = scaling, max_position_embeddings
        inv_freq, self.attention_factor = rope_frequencies(
            rotary_dim, base, scaling, max_position_embeddings=max_position_embeddings
        )
        self.dynamic = rope_type(scaling) == "dynamic"
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (L,) or (B, L) -> cos, sin float32 (..., L, rotary_dim / 2), times
        the attention factor (YaRN)."""
        inv_freq = self.inv_freq
        if self.dynamic and positions.numel():
            longest = positions.max().long() + 1
            # traced: tensor math alone (no host read); eager: skipped below the limit
            if tracing() or int(longest) > self.max_position_embeddings:
                inv_freq = dynamic_frequencies(
                    inv_freq,
                    self.base,
                    self.scaling["factor"],
                    self.max_position_embeddings,
                    longest,
                )
        angles = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """x (B, H, L, D) at positions offset..offset+L-1, or at `positions` (L,) or
        (B, L) when given (a shard of a longer sequence, left-padded sequences)
        -> rotated x, same shape."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x has head_dim {x.shape[-1]} but this RotaryEmbedding was built for "
                f"{self.head_dim}"
            )
        if positions is None:
            positions = torch.arange(offset, offset + x.shape[-2], device=x.device)
        else:
            _check_rotary_positions(positions, x)
        return apply_rotary(x, *self.cos_sin(positions.to(x.device)))

    def rotate(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        return self(q, offset), self(k, offset)

    def at(self, positions: Tensor) -> AttentionPosition:
        """The same rotation for tokens at fixed `positions` (L,) or (B, L), whatever
        offset attention passes: the local shard of a sequence split across processes,
        or a left-padded batch (q and k share the positions). cos and sin are computed
        once here, and reused by every layer."""
        return _RotaryAt(self, positions)


def _check_rotary_positions(positions: Tensor, x: Tensor) -> None:
    if positions.shape not in ((x.shape[-2],), (x.shape[0], x.shape[-2])):
        raise ValueError(
            f"positions must be ({x.shape[-2]},) or ({x.shape[0]}, {x.shape[-2]}), one per "
            f"token of x, got {tuple(positions.shape)}"
        )


class _RotaryAt(AttentionPosition):
    def __init__(self, rotary: RotaryEmbedding, positions: Tensor) -> None:
        super().__init__()
        self.rotary, self.positions = rotary, positions
        self.cos, self.sin = _full_width(*rotary.cos_sin(positions))  # once for every layer

    def rotate(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        for x in (q, k):
            if x.shape[-1] != self.rotary.head_dim:
                raise ValueError(
                    f"x has head_dim {x.shape[-1]} but this RotaryEmbedding was "
                    f"built for {self.rotary.head_dim}"
                )
            _check_rotary_positions(self.positions, x)
        return _rotate(q, self.cos, self.sin), _rotate(k, self.cos, self.sin)


def alibi_slopes(num_heads: int) -> Tensor:
    """(H,) ALiBi slopes: the geometric sequence 2^(-8/n), ... for the nearest power of
    two n <= H, then every other slope of the sequence for 2n for the remaining heads."""
    _check_positive("num_heads", num_heads)

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    power = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(power)
    if power < num_heads:
        slopes += geometric(2 * power)[0::2][: num_heads - power]
    return torch.tensor(slopes, dtype=torch.float32)


def relative_offsets(q_len: int, kv_len: int, device: torch.device | None = None) -> Tensor:
    """(L, S) int64: key position minus query position, queries aligned bottom-right."""
    q_pos = torch.arange(causal_shift(q_len, kv_len), kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    return k_pos - q_pos


class ALiBiPosition(AttentionPosition):
    """Attention with linear biases: score bias -slope_h * |i - j| per head h."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def score(self) -> scores.ALiBi:
        return scores.ALiBi(self.slopes)

    def dense_bias(self, q_len: int, kv_len: int) -> Tensor:
        """The (H, L, S) bias the score function adds, materialised (for inspection)."""
        distance = relative_offsets(q_len, kv_len, self.slopes.device).abs().float()
        return -self.slopes.view(-1, 1, 1) * distance


class RelativeBiasPosition(AttentionPosition):
    """T5's learned bias per head for bucketed relative positions.

    Offsets below num_buckets/2 (per direction when bidirectional) get their own
    bucket; larger ones share logarithmically wider buckets up to max_distance.
    """

    def __init__(
        self,
        num_heads: int,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
    ) -> None:
        super().__init__()
        _check_positive("num_heads", num_heads)
        _check_positive("max_distance", max_distance)
        scores.check_t5_buckets(num_buckets, max_distance, bidirectional)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.embedding = nn.Embedding(num_buckets, num_heads)

    def bucket(self, offsets: Tensor) -> Tensor:
        """Map key-minus-query offsets (any shape, int64) to bucket ids."""
        return scores.t5_bucket(offsets, self.num_buckets, self.max_distance, self.bidirectional)

    def score(self) -> scores.RelativeBias:
        return scores.RelativeBias(
            self.embedding.weight, self.num_buckets, self.max_distance, self.bidirectional
        )

    def dense_bias(self, q_len: int, kv_len: int) -> Tensor:
        """The (H, L, S) bias the score function adds, materialised (for inspection)."""
        offsets = relative_offsets(q_len, kv_len, self.embedding.weight.device)
        return self.embedding(self.bucket(offsets)).permute(2, 0, 1)
