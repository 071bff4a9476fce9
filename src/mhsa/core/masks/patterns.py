"""The attention patterns. Queries are aligned bottom-right: with L queries and S keys,
query i sits at position i + S - L (so with L == S, at position i)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..checks import as_4d, int_at_least, is_int_tensor
from .base import Band, Pattern, block_ranges
from .blocks import EMPTY, FULL, PARTIAL, num_blocks, reduce_blocks
from .causal import causal_allows, causal_shift


def _kinds_from(full: Tensor, empty: Tensor) -> Tensor:
    kinds = torch.full(full.shape, PARTIAL, dtype=torch.int8)
    kinds[empty] = EMPTY
    kinds[full] = FULL
    return kinds


def _query_positions(q_len: int, kv_len: int, block_q: int) -> tuple[Tensor, Tensor]:
    first, last = block_ranges(q_len, block_q)
    shift = causal_shift(q_len, kv_len)
    return first + shift, last + shift


class Full(Pattern):
    """Every query attends every key."""

    def allowed(self, rows, cols, q_len, kv_len):
        return torch.ones(rows.shape[0], cols.shape[1], dtype=torch.bool, device=rows.device)

    def kinds(self, q_len, kv_len, block_q, block_k):
        return torch.full(
            (num_blocks(q_len, block_q), num_blocks(kv_len, block_k)), FULL, dtype=torch.int8
        )

    def __repr__(self) -> str:
        return "Full()"


class Causal(Pattern):
    """Query at position p attends keys j <= p (bottom-right aligned)."""

    by_position = True

    def positions(self, q_pos, k_pos):
        return causal_allows(q_pos, k_pos)

    def allowed(self, rows, cols, q_len, kv_len):
        return self.positions(rows + causal_shift(q_len, kv_len), cols)

    def kinds(self, q_len, kv_len, block_q, block_k):
        # a tile is full if its first row sees its last key, empty if its last row sees
        # none of its keys
        p_first, p_last = _query_positions(q_len, kv_len, block_q)
        k_first, k_last = block_ranges(kv_len, block_k)
        full = causal_allows(p_first.view(-1, 1), k_last.view(1, -1))
        empty = ~causal_allows(p_last.view(-1, 1), k_first.view(1, -1))
        return _kinds_from(full, empty)

    def lower_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        return k0 == q0 + causal_shift(q_len, kv_len)

    def __repr__(self) -> str:
        return "Causal()"


class BoolMask(Pattern):
    """A bool tensor as a pattern: True = may attend, broadcastable to (B, H, L, S) at
    the lengths it was made for. How the engines plan with a tensor mask."""

    plain_values = False

    def __init__(self, mask: Tensor) -> None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() < 2:
            raise TypeError(f"BoolMask needs a bool tensor (..., L, S), got {_describe(mask)}")
        self.mask = mask
        self.batch_size = mask.shape[0] if mask.dim() == 4 else None

    def check_lengths(self, q_len, kv_len):
        rows, cols = self.mask.shape[-2:]
        if rows not in (1, q_len) or cols not in (1, kv_len):
            # rows are read from 0, so a mask made for other lengths would pick wrong rows
            raise ValueError(
                f"BoolMask of shape {tuple(self.mask.shape)} does not fit (q_len, kv_len) = "
                f"({q_len}, {kv_len}): its last two sizes must be those lengths (or 1)"
            )

    def allowed(self, rows, cols, q_len, kv_len):
        rows = rows if self.mask.shape[-2] > 1 else torch.zeros_like(rows)
        cols = cols if self.mask.shape[-1] > 1 else torch.zeros_like(cols)
        return self.mask[..., rows, cols]

    def tile(self, q0, q1, cols, q_len, kv_len):
        rows = self.mask if self.mask.shape[-2] == 1 else self.mask[..., q0:q1, :]
        return rows if rows.shape[-1] == 1 else rows.index_select(-1, cols)

    def kinds(self, q_len, kv_len, block_q, block_k):
        return reduce_blocks(self.mask, q_len, kv_len, block_q, block_k)

    def of_heads(self, heads: Tensor) -> BoolMask:
        mask = as_4d(self.mask)
        if mask.shape[1] == 1:
            return self
        return BoolMask(mask.index_select(1, heads.to(mask.device)))

    def __repr__(self) -> str:
        return f"BoolMask(<{tuple(self.mask.shape)}>)"


def with_causal(mask: Tensor | Pattern | None, causal: bool) -> Pattern | None:
    """What may attend in a call: its mask (a bool tensor or a pattern) and, with causal,
    Causal() as one pattern, from which the engines build their block plans; None
    when everything may attend."""
    pattern = BoolMask(mask) if isinstance(mask, Tensor) else mask
    if not causal or (pattern is not None and pattern.within_causal):
        return pattern
    return Causal() if pattern is None else pattern & Causal()


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


class SlidingWindow(Pattern):
    """Query at position p attends keys p - left .. p + right, inclusive.

    right=0 is causal local attention; SlidingWindow(w, w) is Longformer's window.
    """

    def __init__(self, left: int, right: int) -> None:
        self.left = int_at_least("left", left, 0)
        self.right = int_at_least("right", right, 0)

    by_position = True

    def positions(self, q_pos, k_pos):
        offset = k_pos - q_pos
        return (offset >= -self.left) & (offset <= self.right)

    def allowed(self, rows, cols, q_len, kv_len):
        return self.positions(rows + causal_shift(q_len, kv_len), cols)

    def kinds(self, q_len, kv_len, block_q, block_k):
        p_first, p_last = _query_positions(q_len, kv_len, block_q)
        k_first, k_last = block_ranges(kv_len, block_k)
        p_first, p_last = p_first.view(-1, 1), p_last.view(-1, 1)
        # full: every row's window covers the whole key block; empty: no row reaches it
        full = (k_first >= p_last - self.left) & (k_last <= p_first + self.right)
        empty = (k_last < p_first - self.left) | (k_first > p_last + self.right)
        return _kinds_from(full, empty)

    def lower_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        # the right edge runs along the tile's diagonal; the left edge never cuts in
        first = q0 + causal_shift(q_len, kv_len)  # position of the tile's first query
        return k0 == first + self.right and q1 - q0 - 1 <= self.left + self.right

    def upper_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        # the left edge runs along the diagonal of a square tile; the right never cuts
        first = q0 + causal_shift(q_len, kv_len)
        return k1 - k0 == q1 - q0 and k0 == first - self.left and k1 - 1 <= first + self.right

    def band(self) -> Band:
        return Band(self.left, self.right)

    def __repr__(self) -> str:
        return f"SlidingWindow({self.left}, {self.right})"


class Dilated(Pattern):
    """Query at position p attends keys p + t * dilation for t in -window..window."""

    def __init__(self, window: int, dilation: int) -> None:
        self.window = int_at_least("window", window, 0)
        self.dilation = int_at_least("dilation", dilation, 1)
        span = self.window * self.dilation
        self._span = SlidingWindow(span, span)

    def allowed(self, rows, cols, q_len, kv_len):
        offset = cols - (rows + causal_shift(q_len, kv_len))
        return self._span.allowed(rows, cols, q_len, kv_len) & (offset % self.dilation == 0)

    def kinds(self, q_len, kv_len, block_q, block_k):
        kinds = self._span.kinds(q_len, kv_len, block_q, block_k).clone()
        if self.dilation > 1:  # a full window block still skips keys between the steps
            kinds[kinds == FULL] = PARTIAL
        return kinds

    def band(self) -> Band:
        return Band(self.window, self.window, self.dilation)

    def __repr__(self) -> str:
        return f"Dilated({self.window}, {self.dilation})"


class GlobalTokens(Pattern):
    """Longformer's global attention: the tokens at these positions attend every key,
    and every query attends them."""

    plain_values = False  # holds tensors

    def __init__(self, indices: Sequence[int] | Tensor, *, beyond_keys: str = "error") -> None:
        """beyond_keys="ignore" lets indices past the last key mean nothing (for presets
        whose global tokens are "the first n", however many a sequence has)."""
        idx = torch.as_tensor(indices).flatten()
        if idx.numel() and not is_int_tensor(idx):
            raise TypeError(f"indices must be integer positions, got {idx.tolist()[:6]}")
        idx = idx.long()
        if idx.numel() and idx.min() < 0:
            raise ValueError(f"indices must be >= 0, got {idx.tolist()}")
        if beyond_keys not in ("error", "ignore"):
            raise ValueError(f"beyond_keys must be 'error' or 'ignore', got {beyond_keys!r}")
        self.indices = idx.unique().cpu()  # a few positions: block plans read them on the CPU
        self.beyond_keys = beyond_keys
        # read once: a check on the tensor per call would break a compiled graph
        self._last = int(idx.max()) if idx.numel() else -1

    def check_lengths(self, q_len, kv_len):
        if self.beyond_keys == "error" and self._last >= kv_len:
            raise ValueError(f"global token index {self._last} is out of range for {kv_len} keys")

    def _is_global(self, positions: Tensor) -> Tensor:
        return torch.isin(positions, self.indices.to(positions.device))

    def allowed(self, rows, cols, q_len, kv_len):
        return self._is_global(rows + causal_shift(q_len, kv_len)) | self._is_global(cols)

    def kinds(self, q_len, kv_len, block_q, block_k):
        shift = causal_shift(q_len, kv_len)
        q_blocks = num_blocks(q_len, block_q)
        k_blocks = num_blocks(kv_len, block_k)
        rows = self.indices - shift
        rows = rows[(rows >= 0) & (rows < q_len)]
        row_count = torch.bincount(rows // block_q, minlength=q_blocks)
        cols = self.indices[self.indices < kv_len]
        col_count = torch.bincount(cols // block_k, minlength=k_blocks)
        row_first, row_last = block_ranges(q_len, block_q)
        col_first, col_last = block_ranges(kv_len, block_k)
        row_size, col_size = row_last - row_first + 1, col_last - col_first + 1
        full = (row_count == row_size).view(-1, 1) | (col_count == col_size).view(1, -1)
        empty = (row_count == 0).view(-1, 1) & (col_count == 0).view(1, -1)
        return _kinds_from(full, empty)

    def __repr__(self) -> str:
        idx = self.indices.tolist()
        shown = idx if len(idx) <= 6 else [*idx[:3], "...", idx[-1]]
        return f"GlobalTokens([{', '.join(map(str, shown))}])"


class KeyPadding(Pattern):
    """Per sequence, only the first lengths[b] keys are real (or a (B, S) bool tensor,
    True = real key)."""

    plain_values = False  # holds tensors

    def __init__(self, lengths: Sequence[int] | Tensor) -> None:
        t = _as_ints(lengths)
        if t.dtype == torch.bool:
            if t.dim() != 2:
                raise ValueError(
                    f"a key padding mask must be (batch, S) bool, got {tuple(t.shape)}"
                )
            self.keys = t.clone()  # patterns are immutable: backward reads the same keys
        else:
            if t.dim() != 1 or t.is_floating_point() or (t.numel() and t.min() < 0):
                raise ValueError(f"lengths must be a 1-D sequence of ints >= 0, got {lengths!r}")
            self.keys = None
            self.lengths = t.long().clone()
            self._longest = int(t.max()) if t.numel() else 0  # (read once, as GlobalTokens)
        self.batch_size = t.shape[0]

    def _real(self, cols: Tensor, kv_len: int) -> Tensor:
        """(B, 1, 1, C) bool: which of the key indices are real."""
        if self.keys is not None:
            return self.keys.to(cols.device)[:, cols.flatten()].view(self.batch_size, 1, 1, -1)
        return cols.view(1, 1, 1, -1) < self.lengths.to(cols.device).view(-1, 1, 1, 1)

    def check_lengths(self, q_len, kv_len):
        if self.keys is not None and self.keys.shape[1] != kv_len:
            raise ValueError(f"key padding mask covers {self.keys.shape[1]} keys, S is {kv_len}")
        if self.keys is None and self._longest > kv_len:
            raise ValueError(f"a length {self._longest} exceeds S = {kv_len}")

    def allowed(self, rows, cols, q_len, kv_len):
        return self._real(cols, kv_len)

    def kinds(self, q_len, kv_len, block_q, block_k):
        real = self._real(torch.arange(kv_len).view(1, -1), kv_len)  # (B, 1, 1, S)
        return reduce_blocks(real, q_len, kv_len, block_q, block_k)

    def __repr__(self) -> str:
        return "KeyPadding(...)"


class Document(Pattern):
    """Packed sequences: a query attends only keys of its own document.

    ids: (S,) or (B, S) document id of every key position; queries take the ids of
    their positions (bottom-right).
    """

    plain_values = False  # holds tensors

    def __init__(self, ids: Sequence[int] | Tensor) -> None:
        t = _as_ints(ids)
        if t.dim() not in (1, 2) or t.is_floating_point():
            raise ValueError(f"ids must be int, (S,) or (batch, S), got {tuple(t.shape)}")
        rows = t.shape[0] if t.dim() == 2 else 1  # (explicit: -1 cannot size an empty S)
        self.ids = t.long().reshape(rows, t.shape[-1]).clone()  # (1 or B, S), the caller's apart
        self.batch_size = t.shape[0] if t.dim() == 2 else None

    def check_lengths(self, q_len, kv_len):
        if self.ids.shape[1] != kv_len or q_len > kv_len:
            raise ValueError(
                f"ids cover {self.ids.shape[1]} positions; need S = {kv_len} and L <= S "
                f"(got L = {q_len})"
            )

    def allowed(self, rows, cols, q_len, kv_len):
        ids = self.ids.to(rows.device)
        q_pos = rows + causal_shift(q_len, kv_len)
        q_ids = ids[:, q_pos.flatten()].view(ids.shape[0], 1, -1, 1)
        k_ids = ids[:, cols.flatten()].view(ids.shape[0], 1, 1, -1)
        same = q_ids == k_ids
        return same if self.batch_size is not None else same[0, 0]

    def kinds(self, q_len, kv_len, block_q, block_k):
        ids = self.ids.cpu()  # block plans are made on the CPU, whatever the ids' device
        if not (ids[:, 1:] >= ids[:, :-1]).all():
            return super().kinds(q_len, kv_len, block_q, block_k)  # unsorted: reduce
        q_ids = ids[:, causal_shift(q_len, kv_len) :]

        def ranges(ids: Tensor, block: int) -> tuple[Tensor, Tensor]:
            first, last = block_ranges(ids.shape[1], block)
            return ids[:, first], ids[:, last]  # sorted: min and max of each block

        q_lo, q_hi = ranges(q_ids, block_q)
        k_lo, k_hi = ranges(ids, block_k)
        q_lo, q_hi = q_lo.unsqueeze(-1), q_hi.unsqueeze(-1)
        k_lo, k_hi = k_lo.unsqueeze(-2), k_hi.unsqueeze(-2)
        full = ((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all(0)
        empty = ((q_hi < k_lo) | (k_hi < q_lo)).all(0)
        return _kinds_from(full, empty)

    def __repr__(self) -> str:
        return "Document(...)"


class PrefixLM(Pattern):
    """The first n keys are visible to every query (bidirectional prefix); the rest
    causally."""

    def __init__(self, n: int) -> None:
        self.n = int_at_least("n", n, 0)

    def allowed(self, rows, cols, q_len, kv_len):
        return causal_allows(rows + causal_shift(q_len, kv_len), cols) | (cols < self.n)

    def kinds(self, q_len, kv_len, block_q, block_k):
        causal = Causal().kinds(q_len, kv_len, block_q, block_k)
        k_first, k_last = block_ranges(kv_len, block_k)
        prefix = torch.where(k_last < self.n, FULL, torch.where(k_first < self.n, PARTIAL, EMPTY))
        return torch.maximum(causal, prefix.to(torch.int8).view(1, -1))

    def __repr__(self) -> str:
        return f"PrefixLM({self.n})"


def _as_ints(values: Sequence[int] | Tensor) -> Tensor:
    """values as a tensor; an empty list as int64 (torch.as_tensor([]) is float)."""
    t = torch.as_tensor(values)
    return t.long() if t.numel() == 0 and not isinstance(values, Tensor) else t
