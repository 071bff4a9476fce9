"""The logsumexp merge of partial attention results, said once.

Attention over a set of keys split into disjoint parts can be computed a part at a
time: part r gives out_r, normalised over its own keys, and lse_r, the logsumexp of
its scores (-inf for a row that sees none of its keys). The whole is

    lse = log(sum_r exp(lse_r)),    out = sum_r exp(lse_r - lse) * out_r.

The tiled engine merges its key runs, paged attention its tiles of pages, ring
attention the shards it receives, cluster attention its hash rounds, and a sink is a
part with no value (out 0, lse = the sink's logit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Combine partial results [(out_r (..., D_v), lse_r (...)), ...] over disjoint
    keys into (out (..., D_v), lse (...)) over all of them.

    The weights are computed in the first lse's dtype (keep it float32 or float64);
    out comes in the dtype that out_r and the weights promote to. A row that sees no
    key in any part gets out 0, lse -inf and zero gradients (never NaN). out_r may be
    any tensor that broadcasts (a sink's part is a zero scalar).
    """
    if not parts:
        raise ValueError("merge_partials needs at least one (out, lse) part, got none")
    if len(parts) == 1:
        return parts[0]
    first = parts[0][1]
    lses = torch.stack([lse.to(first.dtype).expand_as(first) for _, lse in parts])
    top = lses.amax(dim=0)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # rows with no key
    weights = torch.exp(lses - top)  # (parts, ...), 0 for a part a row sees nothing of
    total = weights.sum(dim=0)
    alive = total > 0
    safe_total = torch.where(alive, total, torch.ones_like(total))
    lse = torch.where(alive, top + torch.log(safe_total), torch.full_like(top, -torch.inf))
    weights = (weights / safe_total).unsqueeze(-1)
    out = weights[0] * parts[0][0]
    for weight, (out_r, _) in zip(weights[1:], parts[1:], strict=True):
        out = out + weight * out_r
    return out, lse
