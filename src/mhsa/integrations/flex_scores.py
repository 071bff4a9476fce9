"""A FlexAttention score_mod as a score function of mhsa's engine: evaluated per tile at
Flex's indices (q_idx counted from 0 in the query, where the engine's positions are
aligned bottom-right), differentiated per tile with autograd in the backward, so that
gradients reach the tensors it closes over; and the check that none is hidden from
the closure (its gradient would be lost silently)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..core.kernels.scored import Shifted
from ..core.masks.causal import causal_shift
from ..core.scores import Probe, ScoreFunction, ScoreMod, tile_indices

ScoreModFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

# the probe that checks a score_mod once per call uses query indices 0..2 and key indices
# 0..3 (mhsa.core.scores.ScoreMod.check); shorter calls skip it
_PROBE_ROWS, _PROBE_KEYS = 3, 4


class FlexScore(Shifted):
    """A FlexAttention score_mod as an mhsa score function for a call of L queries and
    S keys: the engine's global query positions p (query row r at r + S - L) become
    Flex's q_idx = p - (S - L) = r; key positions are kv_idx already."""

    def __init__(self, score_mod: ScoreModFn | ScoreFunction, q_len: int, kv_len: int) -> None:
        inner = score_mod if isinstance(score_mod, ScoreFunction) else ScoreMod(score_mod)
        super().__init__(inner, q_offset=-causal_shift(q_len, kv_len), k_offset=0)
        self.q_len, self.kv_len = q_len, kv_len

    def check(self, num_heads, device, dtype, probe=None):
        """The score_mod tried within its call (q_idx < L, kv_idx < S)."""
        traced = torch.compiler.is_compiling()  # (the lengths may be symbols there)
        probe = Probe() if traced else Probe.within(self.q_len, self.kv_len)
        self.score.check(num_heads, device, dtype, probe)

    def check_gradients_reach(self, num_heads: int, device, dtype) -> None:
        """ValueError if score_mod reads a tensor that requires grad but is not one of
        tensors(): its gradient would be lost silently (a tensor in a dict or list it
        closes over). Found by evaluating score_mod on a small tile and walking the
        autograd graph of the result."""
        if not isinstance(self.score, ScoreMod):
            return  # mhsa's own score functions name their tensors
        declared = self.tensors()
        rows = torch.arange(min(self.q_len, _PROBE_ROWS))
        keys = torch.arange(min(self.kv_len, _PROBE_KEYS))
        with torch.enable_grad():
            score = torch.zeros(1, min(num_heads, 2), len(rows), len(keys), dtype=dtype)
            score = score.to(device).requires_grad_()
            index = tile_indices(1, score.shape[1], rows.to(device), keys.to(device))
            try:
                out = self.score.fn(score, *index)
            except Exception:
                return  # ScoreMod.check, on every call, reports a score_mod that fails
        hidden = _hidden_leaf(getattr(out, "grad_fn", None), declared, score)
        if hidden is not None:
            raise ValueError(
                f"score_mod reads a tensor of shape {tuple(hidden.shape)} that requires grad "
                "but is held where mhsa does not look (in a dict or list it closes over, "
                "say): its gradient would be lost. mhsa differentiates the tensors a "
                "score_mod closes over directly, as parameters of a module it closes over, "
                "as functools.partial arguments or as attributes of a method's object: "
                "write it as a function that uses the tensor, e.g. "
                "def score_mod(score, b, h, q_idx, kv_idx): return score + table[h]"
            )

    def __repr__(self) -> str:
        return f"FlexScore({self.score!r})"


def _hidden_leaf(node, declared: tuple[Tensor, ...], score: Tensor) -> Tensor | None:
    """A leaf tensor requiring grad that the graph from node reaches without passing
    through one of declared (or score), or None."""
    stops = {t.grad_fn for t in declared if t.grad_fn is not None}
    known = {id(t) for t in declared if t.grad_fn is None} | {id(score)}
    seen, todo = set(), [node]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf
        if variable is not None and id(variable) not in known:
            return variable
        todo.extend(next_node for next_node, _ in node.next_functions)
    return None
