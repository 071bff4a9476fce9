"""Score functions and sinks on tiles, for the tiled engines: views of a score function
from a selection of heads or a block of a longer sequence, its values on one tile and
their gradients, and the sink softmax.

A score function (mhsa.core.scores) is evaluated on one tile at a time from index vectors;
its backward differentiates that tile with autograd, which also yields the gradients
of the tensors it reads (a learned bias table, slopes, a ScoreMod's closure). A sink is
a per-head logit of a key without a value: it joins each row's softmax denominator, so
out scales by exp(lse - lse') with lse' = logaddexp(lse, sink), the merge of a part
with no value (kernels.merge).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..scores import ScoreFunction, tile_indices
from .dense import masked_softmax
from .merge import merge_partials


class _View(ScoreFunction):
    """`score` seen through a change of indices: the engines' (batch, head, q_pos, k_pos)
    become _map's before `score` sees them. Subclasses say what the view maps."""

    score: ScoreFunction

    def _map(self, batch, head, q_pos, k_pos) -> tuple:
        raise NotImplementedError

    def __call__(self, score, batch, head, q_pos, k_pos):
        return self.score(score, *self._map(batch, head, q_pos, k_pos))

    def apply_(self, score, batch, head, q_pos, k_pos):
        return self.score.apply_(score, *self._map(batch, head, q_pos, k_pos))

    def bias(self, batch, head, q_pos, k_pos):
        return self.score.bias(*self._map(batch, head, q_pos, k_pos))

    def tensors(self):
        return self.score.tensors()

    def input_grad(self, out, grad_out):
        return self.score.input_grad(out, grad_out)

    def check(self, num_heads, device, dtype, probe=None):
        self.score.check(num_heads, device, dtype, probe)


class SelectedHeads(_View):
    """`score` seen from a call on a selection of query heads: local head h is global
    head index[h] of num_heads."""

    def __init__(self, score: ScoreFunction, index: Tensor, num_heads: int) -> None:
        self.score, self.index, self.num_heads = score, index, num_heads
        self.additive, self.separable = score.additive, score.separable
        self.grad_from_output = score.grad_from_output

    def _map(self, batch, head, q_pos, k_pos) -> tuple:
        return batch, self.index[head], q_pos, k_pos

    def split_left(self, head, q_pos, k_pos):
        return self.score.split_left(self.index[head], q_pos, k_pos)

    def check(self, num_heads, device, dtype, probe=None):
        self.score.check(self.num_heads, device, dtype, probe)


class Shifted(_View):
    """`score` seen from one block of a longer sequence: the block's query and key
    positions i, j are the sequence's i + q_offset, j + k_offset (a shard's block in
    ring attention)."""

    def __init__(self, score: ScoreFunction, q_offset: int, k_offset: int) -> None:
        self.score, self.q_offset, self.k_offset = score, q_offset, k_offset
        # not separable: which keys precede which queries is decided in global positions
        self.additive, self.grad_from_output = score.additive, score.grad_from_output

    def _map(self, batch, head, q_pos, k_pos) -> tuple:
        return batch, head, q_pos + self.q_offset, k_pos + self.k_offset

    def check(self, num_heads, device, dtype, probe=None):
        moved = None if probe is None else probe.shifted(self.q_offset, self.k_offset)
        self.score.check(num_heads, device, dtype, moved)


class AtPositions(_View):
    """`score` seen at per-token positions: the call's query row r, which the engines
    pass at r + shift (bottom-right, shift = S - L), sits at q_positions[r], and key j
    at k_positions[j] (packed sequences, whose positions restart at each segment).
    Engines call it like any score function: one mechanism for all of them."""

    def __init__(
        self, score: ScoreFunction, q_positions: Tensor, k_positions: Tensor, shift: int
    ) -> None:
        self.score, self.shift = score, shift
        self.q_positions, self.k_positions = q_positions, k_positions
        self.additive, self.grad_from_output = score.additive, score.grad_from_output

    def _map(self, batch, head, q_pos, k_pos) -> tuple:
        return batch, head, self.q_positions[q_pos - self.shift], self.k_positions[k_pos]

    def __repr__(self) -> str:
        return f"{self.score!r} at per-token positions"


def score_tile(
    score: ScoreFunction,
    scores: Tensor | None,
    batch: int,
    heads: int,
    q_start: int,
    rows: int,
    cols: Tensor,
    in_place: bool = False,
) -> Tensor:
    """score applied to a (B, H, rows, keys) tile whose first row sits at global position
    q_start and whose keys are cols (overwriting the tile where it can when in_place);
    scores None gives an additive function's bias (1 or B, H, rows, keys)."""
    q_pos = torch.arange(q_start, q_start + rows, device=cols.device)
    index = tile_indices(batch, heads, q_pos, cols)
    if scores is None:
        bias = score.bias(*index)
        return bias.expand(bias.shape[0], heads, rows, len(cols))
    apply = score.apply_ if in_place else score
    return apply(scores, *index).expand(scores.shape)


def score_grads(
    score: ScoreFunction,
    raw: Tensor,
    q_start: int,
    cols: Tensor,
    grad_scores: Tensor,
    params: tuple[Tensor, ...],
    grads: list[Tensor | None],
) -> Tensor:
    """Gradient of the raw tile scores (B, H, rows, keys) given that of the function's
    output, grad_scores, by autograd on the tile; the gradients of params are added to
    grads (same order)."""
    with torch.enable_grad():
        leaf = raw.detach().requires_grad_()
        out = score_tile(score, leaf, *raw.shape[:2], q_start, raw.shape[2], cols)
        found = torch.autograd.grad(out, (leaf, *params), grad_scores, allow_unused=True)
    for i, grad in enumerate(found[1:]):
        if grad is not None:
            grads[i] = grad if grads[i] is None else grads[i] + grad
    return torch.zeros_like(raw) if found[0] is None else found[0]


def softmax_with_sinks(scores: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """masked_softmax of (B, H, L, S) scores with each head's sink (H,) as one more key
    that has no value: (probs (B, H, L, S), lse (B, H, L))."""
    if sinks is None:
        return masked_softmax(scores)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs, lse = masked_softmax(torch.cat([scores, sink], dim=-1))
    return probs[..., :-1], lse


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of the keys -> (out, lse) with each head's sink in the denominator.
    A row with no allowed key keeps output 0 and gets lse = its sink."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)  # a part with no value: out 0
    merged, total = merge_partials([(out, lse), (out.new_zeros(()), sink)])
    return merged.to(out.dtype), total


def sink_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """Gradient of the sinks (H,) from the final lse and delta = sum(dO * O) - dlse,
    both (B, H, L): d sink_h = -sum over batch and rows of p_sink * delta."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    # a row with no key under a sink of -inf has lse -inf: its share is 0, not nan
    p_sink = p_sink.masked_fill(torch.isneginf(lse), 0.0)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
