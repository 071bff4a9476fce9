"""transformers' masks as mhsa patterns: the function registered in AttentionMaskInterface.

transformers builds every mask from a `mask_function(batch, head, q_idx, kv_idx)` made of
its own pieces (causal_mask_function, sliding_window_overlay, chunked_overlay,
padding_mask_function, packed_sequence_mask_function, blockwise_overlay, joined by
and_masks / or_masks), and hands it to the mask interface of the attn_implementation
with the sizes: query i sits at position q_offset + i, key j at kv_offset + j.
`build_mask` recognises those pieces (by the code object of each factory's closure) and
returns a `LoweredMask`:
Causal, SlidingWindow, Chunked, KeyPadding and Document patterns, never an L x S tensor (a
StaticCache's free slots after the last query are left out of the attention). What it
cannot lower exactly (a model's own overlay) becomes the dense bool mask of
transformers' own sdpa_mask: slower, still exact. The model passes the LoweredMask to
the attention function as its attention_mask.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mhsa.core.masks import Causal, Chunked, Document, Full, KeyPadding, Pattern, SlidingWindow

from . import library


@dataclass(frozen=True, eq=False)
class LoweredMask:
    """transformers' attention mask of one forward, as mhsa data.

    Attributes:
        mask: for the first keys_used keys: a pattern (queries aligned bottom-right), a
            bool tensor (B, 1, L, keys_used) where no pattern says the mask exactly, or
            None (every key, or causal alone).
        causal: and-ed with mask: query i sees keys j <= i + keys_used - L.
        batch_size, q_len, kv_len: the sizes the mask was built for.
        q_offset, kv_offset: the positions of query 0 and key 0 (a sliding-window cache
            keeps only the last keys; a StaticCache has free slots after them).
        keys_used: the keys that may be attended come first: a StaticCache's free slots
            after the last query's position are left out of the attention.
    """

    mask: Pattern | Tensor | None
    causal: bool
    batch_size: int
    q_len: int
    kv_len: int
    q_offset: int
    kv_offset: int
    keys_used: int

    @property
    def from_zero(self) -> bool:
        """Whether key j sits at position j and the queries at the last used positions,
        as mhsa's patterns assume."""
        return self.kv_offset == 0 and self.q_offset == self.keys_used - self.q_len

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, 1, L, S), as a dense mask's (some model code reads it)."""
        return (self.batch_size, 1, self.q_len, self.kv_len)

    @property
    def ndim(self) -> int:
        """4, as a dense mask's: transformers then takes it for a built mask."""
        return 4


def build_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> LoweredMask:
    """The AttentionMaskInterface entry for "mhsa", with sdpa_mask's arguments.

    attention_mask is the 2-D padding mask (B, >= kv_offset + S), True = real token.
    Never returns None: a None mask would read as "no mask at all" to the attention
    function, whatever the model asked for. An attention_mask that is already a
    LoweredMask (generate() builds the masks ahead for a StaticCache, and the model's
    forward asks again) is returned as it is.
    """
    if isinstance(attention_mask, LoweredMask):
        if attention_mask.shape != (batch_size, 1, q_length, kv_length):
            raise ValueError(
                f"a mask built for {attention_mask.shape} was passed again for "
                f"{(batch_size, 1, q_length, kv_length)}; pass the 2-D padding mask instead"
            )
        return attention_mask
    utils = library.masking_utils()
    mask_function = utils.causal_mask_function if mask_function is None else mask_function
    q_offset = int(q_offset)  # a StaticCache gives a 0-d tensor
    # the keys up to the last query's position: all of them, but for a StaticCache
    # (free slots after its keys) and cross-attention (another sequence)
    reached = q_offset - kv_offset + q_length
    tries = [reached] if q_length <= reached < kv_length else []
    for keys_used in [*tries, kv_length]:
        # queries at the last positions of the keys used, as mhsa's patterns place them
        aligned = keys_used == reached
        sizes = _Sizes(batch_size, q_length, keys_used, kv_offset, aligned)
        try:
            terms = _lower(mask_function, sizes, _pieces(utils))
            if keys_used < kv_length and (terms.right is None or terms.right > 0):
                raise _CannotLower  # the keys left out might be attended
            padding = _padding(attention_mask, sizes)
            if padding is not None:
                terms = _and(terms, padding)
            mask, causal = terms.as_mask(sizes)
        except _CannotLower:
            continue
        return LoweredMask(
            mask, causal, batch_size, q_length, kv_length, q_offset, kv_offset, keys_used
        )
    mask = utils.sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=use_vmap,
        device=device,
    )
    return LoweredMask(mask, False, batch_size, q_length, kv_length, q_offset, kv_offset, kv_length)


class _CannotLower(Exception):
    """A mask function that no pattern says exactly: use the dense mask."""


@dataclass(frozen=True)
class _Sizes:
    batch_size: int
    q_len: int
    kv_len: int
    kv_offset: int
    aligned: bool  # query i at position i + S - L in key-index coordinates


@dataclass(frozen=True)
class _Terms:
    """An intersection: a band of key offsets from the query's position (None: no
    bound; (None, 0) is causal) and patterns."""

    left: int | None = None
    right: int | None = None
    patterns: tuple[Pattern, ...] = ()

    def as_mask(self, sizes: _Sizes) -> tuple[Pattern | None, bool]:
        """(pattern or None, causal)."""
        causal = self.left is None and self.right == 0
        parts = list(self.patterns)
        if not causal and (self.left, self.right) != (None, None):
            if (self.left or 0) < 0 or (self.right or 0) < 0:
                raise _CannotLower  # a band not containing the query's own position
            # one unbounded side: a bound past every key of these sizes
            reach = sizes.kv_len + sizes.q_len
            left = reach if self.left is None else self.left
            right = reach if self.right is None else self.right
            parts.insert(0, SlidingWindow(left, right))
        if not parts:
            return None, causal
        pattern = parts[0]
        for part in parts[1:]:
            pattern = pattern & part
        return pattern, causal


def _and(a: _Terms, b: _Terms) -> _Terms:
    return _Terms(_tighter(a.left, b.left), _tighter(a.right, b.right), a.patterns + b.patterns)


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


@functools.cache
def _pieces(utils) -> _Pieces:
    return _Pieces(utils)


class _Pieces:
    """The code object of each of transformers' mask factories' closures: a mask
    function is one of those pieces when its code is that code."""

    def __init__(self, utils) -> None:
        mask = utils.causal_mask_function
        ids = torch.zeros(1, 1, dtype=torch.long)
        self.utils = utils
        self.codes = {}
        makers = {
            "and": lambda: utils.and_masks(mask),
            "or": lambda: utils.or_masks(mask),
            "sliding": lambda: utils.sliding_window_overlay(1),
            "sliding_bidirectional": lambda: utils.sliding_window_bidirectional_overlay(1),
            "chunked": lambda: utils.chunked_overlay(1, ids[0]),
            "padding": lambda: utils.padding_mask_function(ids.bool()),
            "packed": lambda: utils.packed_sequence_mask_function(ids),
            "remap": lambda: utils.remap_positions_for_packed_sequence(mask, ids),
            "blockwise": lambda: utils.blockwise_overlay(ids),
        }
        for name, make in makers.items():
            with contextlib.suppress(AttributeError):  # a factory this transformers lacks
                self.codes[make().__code__] = name

    def kind(self, fn: Callable) -> str | None:
        if fn is getattr(self.utils, "causal_mask_function", None):
            return "causal"
        if fn is getattr(self.utils, "bidirectional_mask_function", None):
            return "bidirectional"
        return self.codes.get(getattr(fn, "__code__", None))


def _cells(fn: Callable, *names: str) -> list:
    """The values fn's closure holds under these names."""
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    if not all(name in cells for name in names):
        raise _CannotLower
    return [cells[name].cell_contents for name in names]


def _lower(fn: Callable, sizes: _Sizes, pieces: _Pieces, remapped: bool = False) -> _Terms:
    """fn as terms, in key-index coordinates (query i at i + S - L). remapped: inside
    remap_positions_for_packed_sequence, where only offsets within one document count."""
    kind = pieces.kind(fn)
    if not sizes.aligned and kind not in ("and", "or", "bidirectional", "padding"):
        raise _CannotLower  # a piece that compares query and key positions
    if kind == "causal":
        return _Terms(None, 0)
    if kind == "sliding":  # kv > q - w: offsets down to -(w - 1)
        (window,) = _cells(fn, "sliding_window")
        return _Terms(int(window) - 1, None)
    if kind == "sliding_bidirectional":  # |q - kv| <= w
        (window,) = _cells(fn, "sliding_window")
        return _Terms(int(window), int(window))
    if kind == "and":
        (parts,) = _cells(fn, "mask_functions")
        return _lower_and(parts, sizes, pieces, remapped)
    if remapped:  # the rest depend on absolute positions
        raise _CannotLower
    if kind == "bidirectional":  # q >= 0: every key
        return _Terms()
    if kind == "or":
        (parts,) = _cells(fn, "mask_functions")
        return _lower_or(parts, sizes, pieces)
    if kind == "padding":
        (padding,) = _cells(fn, "padding_mask")
        terms = _padding(padding, sizes)
        return _Terms() if terms is None else terms
    if kind == "chunked":
        return _chunked(fn, sizes)
    if kind == "packed":
        (ids,) = _cells(fn, "packed_sequence_mask")
        if ids.dim() != 2 or ids.shape[-1] != sizes.kv_len or sizes.q_len != sizes.kv_len:
            raise _CannotLower
        return _Terms(patterns=(Document(ids),))
    raise _CannotLower  # remap outside an and with its documents, or not transformers'


def _lower_and(parts, sizes: _Sizes, pieces: _Pieces, remapped: bool) -> _Terms:
    # remap_positions_for_packed_sequence(f, positions) & packed_sequence_mask_function(ids):
    # within one document positions step by one with the index, so f's offsets are the
    # indices' offsets there, and the documents come from the packed part
    kinds = [pieces.kind(part) for part in parts]
    if "remap" in kinds:
        held = list(zip(kinds, parts, strict=True))
        documents = [_cells(part, "packed_sequence_mask")[0] for k, part in held if k == "packed"]
        positions = [_cells(part, "position_ids")[0] for k, part in held if k == "remap"]
        if not documents or not all(_steps_by_one(p, d) for p in positions for d in documents):
            raise _CannotLower
    terms = _Terms()
    for part, kind in zip(parts, kinds, strict=True):
        if kind == "remap":
            (inner,) = _cells(part, "mask_function")
            terms = _and(terms, _lower(inner, sizes, pieces, remapped=True))
        else:
            terms = _and(terms, _lower(part, sizes, pieces, remapped))
    return terms


def _steps_by_one(positions: Tensor, documents: Tensor) -> bool:
    """Whether, within each document, the positions step by one with the index."""
    if positions.shape != documents.shape:
        return False
    same = documents[:, 1:] == documents[:, :-1]
    return bool(((positions[:, 1:] - positions[:, :-1] == 1) | ~same).all())


def _lower_or(parts, sizes: _Sizes, pieces: _Pieces) -> _Terms:
    kinds = [pieces.kind(part) for part in parts]
    if "blockwise" in kinds:
        return _lower_blockwise(parts, kinds, sizes, pieces)
    patterns = []
    for part in parts:
        pattern, causal = _lower(part, sizes, pieces).as_mask(sizes)
        if causal:
            pattern = Causal() if pattern is None else pattern & Causal()
        if pattern is None:  # one part allows every key
            return _Terms()
        patterns.append(pattern)
    union = patterns[0]
    for pattern in patterns[1:]:
        union = union | pattern
    return _Terms(patterns=(union,))


def _lower_blockwise(parts, kinds: list, sizes: _Sizes, pieces: _Pieces) -> _Terms:
    """or_masks(f, blockwise_overlay(ids)): a query also sees its own block (ids >= 0,
    multimodal models' image tokens). As Document(ids) with each -1 made a block of its
    own, it adds each query's own position, which f must hold already."""
    if not sizes.aligned:
        raise _CannotLower
    others = [part for part, kind in zip(parts, kinds, strict=True) if kind != "blockwise"]
    if len(others) != 1:
        raise _CannotLower
    terms = _lower(others[0], sizes, pieces)
    if terms.patterns or (terms.left or 0) < 0 or (terms.right or 0) < 0:
        raise _CannotLower  # f is not a band holding the diagonal
    union = _as_pattern(terms, sizes)
    for part, kind in zip(parts, kinds, strict=True):
        if kind == "blockwise":
            (ids,) = _cells(part, "block_sequence_ids")
            start, end = sizes.kv_offset, sizes.kv_offset + sizes.kv_len
            if ids.dim() != 2 or ids.shape[-1] < end:
                raise _CannotLower
            ids = ids[:, start:end].long()
            alone = -1 - torch.arange(start, end, device=ids.device)  # negative, one each
            union = union | Document(torch.where(ids >= 0, ids, alone))
    return _Terms(patterns=(union,))


def _as_pattern(terms: _Terms, sizes: _Sizes) -> Pattern:
    pattern, causal = terms.as_mask(sizes)
    if causal:
        return Causal() if pattern is None else pattern & Causal()
    return Full() if pattern is None else pattern


def _padding(padding: Tensor | None, sizes: _Sizes) -> _Terms | None:
    """padding_mask[b, kv_offset + j]: KeyPadding of the real keys, None if all are."""
    if padding is None:
        return None
    if padding.dim() != 2 or padding.shape[-1] < sizes.kv_offset + sizes.kv_len:
        raise _CannotLower
    real = padding[:, sizes.kv_offset : sizes.kv_offset + sizes.kv_len].bool()
    if bool(real.all()):
        return None
    return _Terms(patterns=(KeyPadding(real),))


def _chunked(fn: Callable, sizes: _Sizes) -> _Terms:
    """(kv - pad[b]) // c == (q - pad[b]) // c: chunks of c positions counted from each
    sequence's first real token. One left padding for all: Chunked, key 0 at position
    kv_offset - pad (causal already); else documents per sequence."""
    chunk, left_padding = _cells(fn, "chunk_size", "left_padding")
    pads = left_padding.flatten().tolist()
    if len(set(pads)) <= 1:
        return _Terms(patterns=(Chunked(int(chunk), start=sizes.kv_offset - int(sum(pads[:1]))),))
    positions = torch.arange(sizes.kv_len, device=left_padding.device) + sizes.kv_offset
    ids = (positions.view(1, -1) - left_padding.view(-1, 1)).div(int(chunk), rounding_mode="floor")
    return _Terms(patterns=(Document(ids.expand(sizes.batch_size, -1)),))
