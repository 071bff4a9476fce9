"""The Pattern base class: an attention mask as data, at element and block resolution.

A pattern says which keys each query may attend, for any (L, S), with queries
aligned bottom-right (query i sits at position i + S - L, as for causal masks):
    dense(L, S)                 bool (L, S), or (B, 1, L, S) for per-sequence patterns
    block_layout(L, S, block)   int8 (ceil(L/block), ceil(S/block)): EMPTY, PARTIAL, FULL
Patterns compose: `a | b` allows what either allows, `a & b` what both allow.
Subclasses implement `allowed(rows, cols, L, S)` and, where it can be computed without
the dense mask, `kinds(L, S, block_q, block_k)`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import int_at_least
from .blocks import EMPTY, FULL, PARTIAL, reduce_blocks

__all__ = ["EMPTY", "FULL", "PARTIAL", "Band", "Pattern"]


def block_ranges(length: int, block: int) -> tuple[Tensor, Tensor]:
    """(first, last) index of each block, int64 (num_blocks,)."""
    first = torch.arange(0, length, block)
    return first, (first + block - 1).clamp(max=length - 1)


@dataclass(frozen=True)
class Band:
    """A (dilated) sliding window: the query at position p attends the keys at
    p + t * dilation for t in -left..right. Tiled engines have fast paths for it."""

    left: int
    right: int
    dilation: int = 1


class Pattern:
    """Base class of attention patterns. Instances are immutable."""

    batch_size: int | None = None  # set by per-sequence patterns
    block_size: int | None = None  # set by block-structured patterns: a tiling hint
    # built from plain values only, so that repr(pattern) rebuilds it (the flash op of
    # a traced graph takes it so); False for patterns that hold tensors
    plain_values: bool = True
    # allows nothing that Causal() forbids, so that and-ing Causal() changes nothing
    # (with_causal then keeps the pattern alone, with its fast paths)
    within_causal: bool = False
    # a rule of global positions alone (query row i at i + S - L, key j at j): flex's
    # mask_mod and the paged kernels call positions() element by element, no bitmap
    by_position: bool = False

    def positions(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """For a by_position pattern, whether queries at global positions q_pos see keys
        at k_pos: bool, the two broadcast. allowed() is this at rows + S - L."""
        raise NotImplementedError(f"{self!r} is not a rule of positions alone")

    def allowed(self, rows: Tensor, cols: Tensor, q_len: int, kv_len: int) -> Tensor:
        """Element mask for query indices rows (R, 1) and key indices cols (1, C):
        bool broadcastable to (B, 1, R, C), True = may attend."""
        raise NotImplementedError

    def kinds(self, q_len: int, kv_len: int, block_q: int, block_k: int) -> Tensor:
        """Block kinds (EMPTY/PARTIAL/FULL), int8 (num_q_blocks, num_k_blocks).

        The default reduces the dense mask; patterns with structure override it.
        """
        return reduce_blocks(self.dense(q_len, kv_len), q_len, kv_len, block_q, block_k)

    def block_entries(
        self, q_len: int, kv_len: int, block_q: int, block_k: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The blocks that are not EMPTY as (query block, key block, kind), int64 (n,)
        each, sorted by query block then key block: what block plans are built from.
        The default reads kinds(); a pattern with few such blocks among many (packed
        sequences) overrides it, so that planning costs what the blocks cost."""
        kinds = self.kinds(q_len, kv_len, block_q, block_k)
        rows, cols = (kinds != EMPTY).nonzero(as_tuple=True)
        return rows, cols, kinds[rows, cols].long()

    def diagonal_pieces(self, q_len: int, kv_len: int) -> list[tuple] | None:
        """The mask as pieces that need no element mask, or None (the default): row
        ranges (q0, q1, [(k0, k1, kind), ...]) in order, kind "full" (every key) or
        "lower" (local key c <= local row r); rows in no range see no key. Kernels that
        tile internally then make one call per piece (packed sequences)."""
        return None

    def lower_triangular(self, q0: int, q1: int, k0: int, k1: int, q_len: int, kv_len: int) -> bool:
        """Whether the tile's mask is exactly local key c <= local row r."""
        return False

    def upper_triangular(self, q0: int, q1: int, k0: int, k1: int, q_len: int, kv_len: int) -> bool:
        """Whether the tile is square and its mask is exactly local key c >= local row r."""
        return False

    def band(self) -> Band | None:
        """The band this pattern is exactly, or None. Engines take their band fast paths
        from this, so a new pattern opts in here; a subclass of a band pattern that
        changes `allowed` must return None."""
        return None

    # public API -----------------------------------------------------------------

    def dense(self, q_len: int, kv_len: int, device: torch.device | str | None = None) -> Tensor:
        """The element mask, bool (L, S) or (B, 1, L, S); True = may attend."""
        _check_sizes(q_len, kv_len)
        self.check_lengths(q_len, kv_len)
        rows = torch.arange(q_len, device=device).view(-1, 1)
        cols = torch.arange(kv_len, device=device).view(1, -1)
        mask = self.allowed(rows, cols, q_len, kv_len)
        return mask.expand(*mask.shape[:-2], q_len, kv_len)

    def block_layout(
        self, q_len: int, kv_len: int, block: int, block_k: int | None = None
    ) -> Tensor:
        """int8 (ceil(L/block), ceil(S/block_k)): EMPTY (0), PARTIAL (1) or FULL (2)."""
        _check_sizes(q_len, kv_len)
        self.check_lengths(q_len, kv_len)
        block_k = block if block_k is None else block_k
        int_at_least("block", block, 1)
        int_at_least("block_k", block_k, 1)
        return self.kinds(q_len, kv_len, block, block_k).to(torch.int8)

    def tile(self, q0: int, q1: int, cols: Tensor, q_len: int, kv_len: int) -> Tensor:
        """The element mask of query rows q0..q1-1 and the key indices cols (int64,
        1-D): bool broadcastable to (B, 1, q1 - q0, len(cols)). What the tiled engines
        read for a partial tile of their block plan."""
        rows = torch.arange(q0, q1, device=cols.device).view(-1, 1)
        return self.allowed(rows, cols.view(1, -1), q_len, kv_len)

    def check_lengths(self, q_len: int, kv_len: int) -> None:
        """Raise ValueError if the pattern cannot describe an (L, S) attention."""

    def cache_key(self) -> tuple:
        """Hashable, equal for patterns built from equal plain values (SlidingWindow(256,
        0) twice); a pattern holding a tensor is keyed by its identity. Private
        attributes (a pattern's own caches) are left out. Computed once: patterns are
        immutable, and backends ask on every call."""
        key = vars(self).get("_cache_key")
        if key is not None:
            return key
        fields = {name: value for name, value in vars(self).items() if not name.startswith("_")}
        if any(isinstance(value, Tensor) for value in fields.values()):
            key = ("id", id(self))
        else:
            parts = tuple(
                tuple(p.cache_key() for p in value)
                if isinstance(value, (tuple, list)) and all(isinstance(p, Pattern) for p in value)
                else repr(value)
                for _, value in sorted(fields.items())
            )
            key = (type(self).__name__, parts)
        self._cache_key = key
        return key

    def fingerprint(self) -> str:
        """A digest of the pattern's content: its type and every public field, tensors by
        their dtype, shape and values (unlike repr, which elides long ones). Equal on
        two processes exactly when the patterns are equal. Computed once, as cache_key."""
        cached = vars(self).get("_fingerprint")
        if cached is not None:
            return cached
        digest = hashlib.sha256(type(self).__name__.encode())
        for name, value in sorted(vars(self).items()):
            if not name.startswith("_"):
                digest.update(name.encode())
                _feed(digest, value)
        self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def of_heads(self, heads: Tensor) -> Pattern:
        """The pattern of the query heads `heads` (1-D int64) alone, for attention over
        a selection of heads; patterns that hold no per-head data are it already."""
        return self

    def check_batch(self, batch: int) -> None:
        if self.batch_size is not None and self.batch_size not in (1, batch):
            raise ValueError(
                f"{type(self).__name__} was built for batch size {self.batch_size}, "
                f"but q has batch size {batch}"
            )

    def __or__(self, other: Pattern) -> Pattern:
        return Union(self, other)

    def __and__(self, other: Pattern) -> Pattern:
        return Intersection(self, other)


def part_kinds(mask: object) -> tuple[str, ...]:
    """The class names of a pattern's parts (a union's or intersection's, flattened), in
    order; () for no mask or a tensor: what an AttentionSpec carries for `auto`."""
    if not isinstance(mask, Pattern):
        return ()
    if isinstance(mask, Union):
        return tuple(kind for part in mask.parts for kind in part_kinds(part))
    return (type(mask).__name__,)


def pattern_or_none(name: str, value: object) -> Pattern | None:
    """value if it is a Pattern or None; else TypeError naming `name`."""
    if value is not None and not isinstance(value, Pattern):
        raise TypeError(
            f"{name} must be an mhsa.masks pattern (SlidingWindow(...), Causal(), ...) or "
            f"None, got {type(value).__name__}"
        )
    return value


def _check_sizes(q_len: int, kv_len: int) -> None:
    int_at_least("q_len", q_len, 0)
    int_at_least("kv_len", kv_len, 0)


def _feed(digest, value) -> None:
    """Add a pattern field's content to a hash."""
    if isinstance(value, Pattern):
        digest.update(value.fingerprint().encode())
    elif isinstance(value, Tensor):
        flat = value.detach().cpu().contiguous()
        digest.update(f"{flat.dtype}{tuple(flat.shape)}".encode())
        digest.update(flat.view(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    elif isinstance(value, (tuple, list)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(repr(value).encode())


class Union(Pattern):
    """Allowed where any part allows."""

    def __init__(self, *parts: Pattern) -> None:
        for part in parts:
            if not isinstance(part, Pattern):
                raise TypeError(f"can only combine patterns, got {type(part).__name__}")
        self.parts = parts
        given = {p.batch_size for p in parts} - {None}
        sizes = given - {1}  # a pattern of batch size 1 serves every sequence
        if len(sizes) > 1:
            raise ValueError(f"patterns for different batch sizes cannot combine: {sizes}")
        self.batch_size = sizes.pop() if sizes else (1 if given else None)
        blocks = [p.block_size for p in parts if p.block_size]
        self.block_size = math.gcd(*blocks) if blocks else None
        self.plain_values = all(p.plain_values for p in parts)
        self.within_causal = self._within(p.within_causal for p in parts)
        self.by_position = all(p.by_position for p in parts)

    # how parts' element masks join, and which block kind wins (EMPTY < PARTIAL < FULL)
    _join = staticmethod(torch.logical_or)
    _strongest = True
    _within = staticmethod(all)  # a union stays within causal if every part does

    def allowed(self, rows, cols, q_len, kv_len):
        masks = [p.allowed(rows, cols, q_len, kv_len) for p in self.parts]
        return functools.reduce(self._join, masks)

    def positions(self, q_pos, k_pos):
        return functools.reduce(self._join, [p.positions(q_pos, k_pos) for p in self.parts])

    def tile(self, q0, q1, cols, q_len, kv_len):
        tiles = [p.tile(q0, q1, cols, q_len, kv_len) for p in self.parts]
        return functools.reduce(self._join, tiles)

    def kinds(self, q_len, kv_len, block_q, block_k):
        kinds = [p.kinds(q_len, kv_len, block_q, block_k) for p in self.parts]
        stacked = torch.stack([k.expand_as(kinds[0]) for k in kinds])
        return stacked.amax(0) if self._strongest else stacked.amin(0)

    def check_lengths(self, q_len, kv_len):
        for p in self.parts:
            p.check_lengths(q_len, kv_len)

    def of_heads(self, heads: Tensor) -> Pattern:
        return type(self)(*(p.of_heads(heads) for p in self.parts))

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.parts))


class Intersection(Union):
    """Allowed where every part allows."""

    _join = staticmethod(torch.logical_and)
    _strongest = False
    _within = staticmethod(any)

    def __repr__(self) -> str:
        return " & ".join(f"({p!r})" for p in self.parts)
