"""Score functions: changes to attention scores that are not yes/no masks.

A score function rewrites each scaled score s = (q . k) * scale of query position i
and key position j, elementwise: `ALiBi` and `RelativeBias` add a per-head value of
i - j, `Softcap` squashes s into (-cap, cap) (Gemma 2), and `ScoreMod` applies any
function written with torch ops, with FlexAttention's signature
fn(score, batch, head, q_idx, kv_idx). Several compose in order:
`ALiBi(slopes).then(Softcap(30.0))`, or pass a list to `mhsa.attention(score=...)`.

Positions are global and aligned bottom-right like causal masks: query row r of L
sits at position r + S - L, so the newest query of a KV cache is at S - 1.

Like masks they are data: the reference backend materialises them; the flash engine
evaluates them per tile from index vectors and never builds an (L, S) tensor; its
backward differentiates through them, to `tensors()` as well (slopes, a bias table,
tensors a ScoreMod closes over).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .checks import int_at_least
from .score_checks import (
    Probe,
    check_per_head,
    closure_tensors,
    describe,
    probe_once,
    tile_indices,
    unique_tensors,
)
from .tracing import constant_when_traced


class ScoreFunction:
    """Base class. Arguments of __call__ broadcast to (B, H, rows, keys): score is
    float, batch (B, 1, 1, 1), head (1, H, 1, 1), q_pos (1, 1, rows, 1) and
    k_pos (1, 1, 1, keys) are int64 global indices."""

    # an additive function returns score + bias(batch, head, q_pos, k_pos), the bias
    # not depending on the score: engines may add it to a tile's float mask
    additive: bool = False

    def __call__(
        self, score: Tensor, batch: Tensor, head: Tensor, q_pos: Tensor, k_pos: Tensor
    ) -> Tensor:
        return score + self.bias(batch, head, q_pos, k_pos).to(score.dtype)

    def bias(self, batch: Tensor, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} is not additive")

    # an additive function whose bias, on tiles whose keys all precede their queries,
    # is a row term plus a key term (split_left): engines then pass the fused kernel
    # one (H, keys) row of values for the whole tile
    separable: bool = False

    def apply_(
        self, score: Tensor, batch: Tensor, head: Tensor, q_pos: Tensor, k_pos: Tensor
    ) -> Tensor:
        """self(score, ...), overwriting score where the function can (engines call it
        on scratch tiles, without autograd)."""
        if self.additive:
            return score.add_(self.bias(batch, head, q_pos, k_pos).to(score.dtype))
        return self(score, batch, head, q_pos, k_pos)

    def split_left(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """For a separable function and keys k_pos (keys,) all before the queries q_pos
        (rows,): the bias as (row term (1, H, rows, 1), key term (1, H, 1, keys)), each no
        larger in magnitude than the bias itself (so adding them loses no precision)."""
        raise NotImplementedError(f"{type(self).__name__} is not separable")

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors the function reads that gradients may flow to."""
        return ()

    # input_grad knows the score's gradient without autograd
    grad_from_output: bool = False

    # the function reads positions only through k_pos - q_pos (or not at all): moving
    # every query and key by one amount changes nothing (packed sequences rely on it)
    relative: bool = False

    # the function reads q_pos or k_pos at all (Softcap does not)
    reads_positions: bool = True

    def input_grad(self, out: Tensor, grad_out: Tensor) -> Tensor:
        """The gradient of the score given the function's output `out` and its gradient
        (where grad_from_output); it may overwrite both arguments."""
        if not self.additive:
            raise NotImplementedError(f"{type(self).__name__} needs autograd for its gradient")
        return grad_out

    def check(
        self, num_heads: int, device: torch.device, dtype: torch.dtype, probe: Probe | None = None
    ) -> None:
        """Raise ValueError if the function cannot serve a call with num_heads heads whose
        scores are computed in dtype on device; probe: where a function of your own is
        tried (default Probe(): 3 x 4 positions from 0; a call's own: Probe.within)."""

    def then(self, other: ScoreFunction) -> ScoreFunction:
        """This function, then `other` on its result."""
        return Compose(self, other)


class ALiBi(ScoreFunction):
    """Attention with linear biases: score - slopes[h] * |i - j|.

    slopes (H,): one per query head (mhsa.nn.positional.alibi_slopes(H) gives the
    paper's); a tensor that requires grad is learned."""

    additive = grad_from_output = relative = True

    def __init__(self, slopes: Tensor) -> None:
        if not isinstance(slopes, Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
            raise ValueError(
                f"ALiBi slopes must be a 1-D float tensor (H,), got {describe(slopes)}"
            )
        self.slopes = slopes

    def _slopes(self, head: Tensor) -> Tensor:
        """slopes[head] in float32 at least: bfloat16 positions (a model cast with
        .to(torch.bfloat16)) would round distances past 256, by 8 at 1024."""
        return self.slopes[head].to(torch.promote_types(self.slopes.dtype, torch.float32))

    def bias(self, batch, head, q_pos, k_pos):
        slopes = self._slopes(head)
        return -slopes * (q_pos.to(slopes.dtype) - k_pos.to(slopes.dtype)).abs()

    separable = True

    def split_left(self, head, q_pos, k_pos):
        # -slope * (i - j) = slope * (j - c) - slope * (i - c), c the first query: both
        # terms are between the bias and 0
        first = q_pos[:1]
        slopes = self._slopes(head).view(1, -1, 1, 1)
        rows = -slopes * (q_pos - first).to(slopes.dtype).view(1, 1, -1, 1)
        keys = slopes * (k_pos - first).to(slopes.dtype).view(1, 1, 1, -1)
        return rows, keys

    def tensors(self):
        return (self.slopes,)

    def check(self, num_heads, device, dtype, probe=None):
        check_per_head("ALiBi slopes", self.slopes, 0, num_heads, device)

    def __repr__(self) -> str:
        return f"ALiBi(slopes of {self.slopes.shape[0]} heads)"


def check_t5_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    """T5's bucketing needs at least one exact bucket per direction and a max_distance
    beyond the exact ones (its log scale divides by log(max_distance / exact))."""
    min_buckets = 4 if bidirectional else 2
    int_at_least("num_buckets", num_buckets, min_buckets)
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    hint = f" (beyond the {exact} offsets bucketed one by one)"
    int_at_least("max_distance", max_distance, exact + 1, hint)


def t5_bucket(offsets: Tensor, num_buckets: int, max_distance: int, bidirectional: bool) -> Tensor:
    """T5's bucket id of key-minus-query offsets (int64, any shape).

    Offsets below num_buckets / 2 (per direction when bidirectional) get their own
    bucket; larger ones share logarithmically wider buckets up to max_distance."""
    buckets = num_buckets
    result = torch.zeros_like(offsets)
    if bidirectional:
        buckets //= 2
        result = result + (offsets > 0).long() * buckets
        distance = offsets.abs()
    else:
        distance = (-offsets).clamp(min=0)  # only the past is distinguished
    exact = buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (buckets - exact)).long()).clamp(max=buckets - 1)
    return result + torch.where(distance < exact, distance, large)


class RelativeBias(ScoreFunction):
    """T5's bucketed relative position bias: score + table[bucket(j - i), h].

    table (num_buckets, H), usually an nn.Embedding's weight (learned)."""

    additive = grad_from_output = relative = True

    def __init__(
        self,
        table: Tensor,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
    ) -> None:
        check_t5_buckets(num_buckets, max_distance, bidirectional)
        if (
            not isinstance(table, Tensor)
            or table.dim() != 2
            or table.shape[0] != num_buckets
            or not table.is_floating_point()
        ):
            raise ValueError(
                f"RelativeBias table must be a float tensor (num_buckets "
                f"{num_buckets}, H), got {describe(table)}"
            )
        self.table, self.num_buckets = table, num_buckets
        self.max_distance, self.bidirectional = max_distance, bidirectional

    def bias(self, batch, head, q_pos, k_pos):
        bucket = t5_bucket(k_pos - q_pos, self.num_buckets, self.max_distance, self.bidirectional)
        return self.table[bucket, head]

    def tensors(self):
        return (self.table,)

    def check(self, num_heads, device, dtype, probe=None):
        check_per_head("RelativeBias table", self.table, 1, num_heads, device)

    def __repr__(self) -> str:
        return (
            f"RelativeBias({self.num_buckets} buckets, max_distance {self.max_distance}, "
            f"{'bidirectional' if self.bidirectional else 'causal'})"
        )


class Softcap(ScoreFunction):
    """Logit softcapping (Gemma 2): cap * tanh(score / cap)."""

    relative = True
    reads_positions = False

    def __init__(self, cap: float) -> None:
        if (
            isinstance(cap, bool)
            or not isinstance(cap, int | float)
            or not cap > 0
            or not math.isfinite(cap)
        ):
            raise ValueError(f"Softcap cap must be a finite number > 0, got {cap!r}")
        self.cap = float(cap)

    def __call__(self, score, batch, head, q_pos, k_pos):
        return torch.tanh(score / self.cap) * self.cap

    def apply_(self, score, batch, head, q_pos, k_pos):
        # cap * tanh(x) = 2 cap * sigmoid(2x) - cap: torch's sigmoid is several times
        # faster than its tanh on CPU; the result is within a few ulp of cap
        return score.mul_(2 / self.cap).sigmoid_().mul_(2 * self.cap).sub_(self.cap)

    grad_from_output = True

    def input_grad(self, out, grad_out):
        # d/ds cap * tanh(s / cap) = 1 - tanh(s / cap)**2 = 1 - (out / cap)**2
        return grad_out.addcmul_(grad_out, out.square_(), value=-1 / self.cap**2)

    def __repr__(self) -> str:
        return f"Softcap({self.cap:g})"


class ScoreMod(ScoreFunction):
    """Any elementwise fn(score, batch, head, q_idx, kv_idx) -> new score, written with
    torch ops that broadcast (FlexAttention's score_mod). Tensors it closes over that
    require grad receive gradients; name others in `tensors`."""

    def __init__(self, fn: Callable[..., Tensor], tensors: Sequence[Tensor] = ()) -> None:
        if not callable(fn):
            raise TypeError(
                f"ScoreMod needs a callable fn(score, b, h, q_idx, kv_idx), got {type(fn).__name__}"
            )
        self.fn = fn
        self._tensors = tuple(tensors) + closure_tensors(fn)
        self._checked: set = set()
        self._register()

    def _register(self) -> None:
        """Name it, "ScoreMod('qualname', n)", unique in this process, and list it among
        the living under that name while it lives."""
        number = next(_NAME_NUMBERS)
        self.name = f"ScoreMod({getattr(self.fn, '__qualname__', '')!r}, {number})"
        _LIVING[self.name] = self

    def __setstate__(self, state: dict) -> None:
        """A copy (copy.deepcopy, pickle) is a ScoreMod of its own, under its own name."""
        self.__dict__.update(state)
        self._register()

    def __call__(self, score, batch, head, q_pos, k_pos):
        return self.fn(score, batch, head, q_pos, k_pos)

    def tensors(self):
        return unique_tensors(self._tensors)

    def check(self, num_heads, device, dtype, probe=None):
        _probe_living(self.name, int(num_heads), device, dtype, *(probe or Probe()))

    def __repr__(self) -> str:
        return f"ScoreMod({getattr(self.fn, '__name__', self.fn)!r})"


# Every living ScoreMod by its name. The custom ops (backends.op_scores) and the probe of
# a traced graph take the name, a constant, in place of the object: torch.compile before
# torch 2.13 passes no other object to a function it calls while tracing.
_LIVING: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NAME_NUMBERS = itertools.count()


def living_score_mod(name: str) -> ScoreMod | None:
    """The ScoreMod of that name while it lives, else None."""
    return _LIVING.get(name)


@constant_when_traced  # a traced graph probes once, eagerly, unbroken
def _probe_living(
    name: str, num_heads: int, device: torch.device, dtype: torch.dtype, *probe: int
) -> bool:
    return probe_once(_LIVING[name], num_heads, device, dtype, Probe(*probe))


class Compose(ScoreFunction):
    """Score functions applied in order."""

    def __init__(self, *functions: ScoreFunction) -> None:
        flat: list[ScoreFunction] = []
        for f in functions:
            if not isinstance(f, ScoreFunction):
                raise TypeError(
                    "score functions must be mhsa.core.scores objects (ALiBi, "
                    "RelativeBias, Softcap, ScoreMod), "
                    f"got {type(f).__name__}"
                )
            flat.extend(f.functions if isinstance(f, Compose) else [f])
        self.functions = tuple(flat)
        self.additive = all(f.additive for f in flat)
        self.separable = all(f.separable for f in flat)
        self.relative = all(f.relative for f in flat)
        # additive functions pass the gradient through unchanged, so only the last
        # function's derivative (from the final output) counts
        last = flat[-1] if flat else None
        self.grad_from_output = all(f.additive for f in flat[:-1]) and (
            last is None or last.grad_from_output
        )

    def __call__(self, score, batch, head, q_pos, k_pos):
        for f in self.functions:
            score = f(score, batch, head, q_pos, k_pos)
        return score

    def apply_(self, score, batch, head, q_pos, k_pos):
        for f in self.functions:
            score = f.apply_(score, batch, head, q_pos, k_pos)
        return score

    def bias(self, batch, head, q_pos, k_pos):
        return sum(f.bias(batch, head, q_pos, k_pos) for f in self.functions)

    def split_left(self, head, q_pos, k_pos):
        parts = [f.split_left(head, q_pos, k_pos) for f in self.functions]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def tensors(self):
        return unique_tensors(t for f in self.functions for t in f.tensors())

    def input_grad(self, out, grad_out):
        if not self.grad_from_output:
            raise NotImplementedError("this composition needs autograd for its gradient")
        return self.functions[-1].input_grad(out, grad_out) if self.functions else grad_out

    def check(self, num_heads, device, dtype, probe=None):
        for f in self.functions:
            f.check(num_heads, device, dtype, probe)

    def __repr__(self) -> str:
        return " then ".join(repr(f) for f in self.functions)


def kinds(score: ScoreFunction | None) -> tuple[str, ...]:
    """The class names of score's functions in order (a Compose's, flattened): what an
    AttentionSpec carries for backends that evaluate only some kinds."""
    if score is None:
        return ()
    functions = score.functions if isinstance(score, Compose) else (score,)
    return tuple(type(f).__name__ for f in functions)


def as_score(score) -> ScoreFunction | None:
    """None, a ScoreFunction, or a sequence of them composed in order."""
    if score is None or isinstance(score, ScoreFunction):
        return score
    if isinstance(score, list | tuple):
        return Compose(*score) if score else None
    raise TypeError(
        f"score must be an mhsa.core.scores function (ALiBi, RelativeBias, Softcap, "
        f"ScoreMod) or a list of them, got {type(score).__name__}"
    )


def apply_score(
    score_fn: ScoreFunction,
    scores: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    heads: Tensor | None = None,
) -> Tensor:
    """score_fn on a (B, H, rows, keys) tile whose rows sit at global q_pos (rows,) and
    keys at k_pos (keys,); heads are the tile's query heads (default 0..H-1)."""
    index = tile_indices(scores.shape[0], scores.shape[1] if heads is None else heads, q_pos, k_pos)
    return score_fn(scores, *index).expand(scores.shape)


def composed(first: ScoreFunction | None, then: ScoreFunction | None) -> ScoreFunction | None:
    """first, then `then` on its result; either alone where the other is None."""
    if first is None or then is None:
        return then if first is None else first
    return first.then(then)


def sees_query_position(score: ScoreFunction) -> bool:
    """Whether a row's softmax under score changes when its query moves with the keys
    fixed (a static cache places the query after all its slots): a separable bias
    shifts the row by a constant and a function reading no position changes nothing,
    but a function after a positional bias, or any other positional one, sees it."""
    shifted = False
    for f in score.functions if isinstance(score, Compose) else (score,):
        if f.separable:
            shifted = True
        elif f.reads_positions or shifted:
            return True
    return False
