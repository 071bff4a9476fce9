"""Score functions and sinks on tiles, for the tiled engines.

A score function (mhsa.scores) is evaluated on one tile at a time from index vectors;
its backward differentiates that tile with autograd, which also yields the gradients
of the tensors it reads (a learned bias table, slopes, a ScoreMod's closure). A sink is
a per-head logit of a key without a value: it joins each row's softmax denominator, so
out scales by exp(lse - lse') with lse' = logaddexp(lse, sink).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..scores import ScoreFunction, tile_indices
from .dense import masked_softmax


def score_tile(
    score: ScoreFunction, scores: Tensor | None, batch: int, heads: int, q_start: int,
    rows: int, cols: Tensor, in_place: bool = False,
) -> Tensor:  # fmt: skip
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
    score: ScoreFunction, raw: Tensor, q_start: int, cols: Tensor, grad_scores: Tensor,
    params: tuple[Tensor, ...], grads: list[Tensor | None],
) -> Tensor:  # fmt: skip
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
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    total = torch.logaddexp(lse, sink.expand_as(lse))
    rescale = torch.exp(lse - total)  # 0 where lse is -inf
    return (out * rescale.unsqueeze(-1)).to(out.dtype), total


def sink_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """Gradient of the sinks (H,) from the final lse and delta = sum(dO * O) - dlse,
    both (B, H, L): d sink_h = -sum over batch and rows of p_sink * delta."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
