"""PagedKVCache: the keys and values of many sequences in one pool of fixed-size blocks
per layer (vLLM's PagedAttention), for serving sequences that come and go.

Each sequence has a block table (its blocks in order) and a length. Blocks are taken
from the pool as a sequence grows and given back when it ends. Blocks are reference
counted: a fork shares all of its sequence's blocks, and sequences whose prompts start
with the same full blocks of tokens (a system prompt) share those blocks through the
prefix cache; a shared block is copied before it is written (copy on write).

One forward pass over some sequences: `layers = cache.batch(seq_ids, new_tokens)`, then
`model(idx, caches=layers)` with idx (len(seq_ids), new_tokens). Each PagedLayer, as
MultiHeadAttention's `cache`, writes the new keys and values into the sequences' slots
and hands out their pages: the module attends over them with
mhsa.paged_attention(q, k_pool, v_pool, layer.paged_step), causal per sequence. The
pass's PagedStep (its block table and lengths, checked once in batch()) is one object
that every layer's call takes, and the next batch() makes a new one: nothing about a
pass outlives it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.checks import int_at_least, int_list, is_int
from ..core.paged_step import PagedStep
from .base import MultiLayerCache
from .blocks import BlockAllocator, PoolExhausted, chain_hashes
from .contiguous import _check_positive
from .paged_layer import PagedLayer, PagedPass


@dataclass
class _Sequence:
    tokens: list[int]  # the prompt's token ids: the prefix cache's keys
    digests: list[bytes]  # chain_hashes(tokens): one per full block of the prompt
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens stored
    remembered: int = 0  # leading blocks handed to the prefix cache


class PagedKVCache(MultiLayerCache):
    """A pool of num_blocks blocks of block_size tokens per layer: keys
    (num_layers, num_blocks, block_size, H_kv, D) and values (..., H_kv, D_v), zeroed.
    value_dim 0 keeps no values (latent attention reads them from the keys).

    add_sequence registers a prompt and reuses cached blocks of an identical prefix;
    batch(seq_ids, new_tokens) gives the `caches` of one forward pass (layer(i) and
    update(k, v, i) then answer for layer i of that pass); free ends a sequence; fork
    copies one (copy on write). See the module docstring.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        _check_positive(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
        )
        int_at_least("value_dim", value_dim, 0)
        shape = (num_layers, num_blocks, block_size, num_kv_heads)
        self.k = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(*shape, value_dim, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)
        self.sequences: dict[int, _Sequence] = {}
        self._next_id = 0
        self._pass: PagedPass | None = None  # the last batch()'s, with its PagedStep

    @classmethod
    def for_layout(cls, layout, *, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        """A pool shaped by a model's cache_layout (mhsa.models.decoder.CacheLayout:
        layers, kv heads, key and value widths, dtype, device)."""
        return cls(
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            value_dim=layout.value_dim,
            dtype=layout.dtype,
            device=layout.device,
        )

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def free_blocks(self) -> int:
        """Blocks no live sequence holds (blocks kept only by the prefix cache count)."""
        return self.allocator.free

    @property
    def used_blocks(self) -> int:
        """Blocks live sequences hold (a shared block once)."""
        return self.num_blocks - self.free_blocks

    def add_sequence(self, tokens: Sequence[int] | Tensor, *, salt: bytes = b"") -> int:
        """Register a sequence whose prompt is `tokens` (token ids); return its id.

        Leading full blocks of the prompt whose keys are cached (the same tokens from
        the start, in a live or recently ended sequence) are shared, not recomputed;
        the last prompt token is never among them. length(id) tells how many prompt
        tokens are stored: the caller runs the rest, tokens[length(id):]. A block is
        cached once every layer has written it, so a second prompt finds the first's
        blocks after the first's prefill. salt names the prefix cache's namespace: a
        prompt finds only blocks cached under the same salt (one per tenant, say)."""
        tokens = _token_ids(tokens)
        if not isinstance(salt, bytes):
            raise TypeError(f"salt must be bytes (a namespace of the prefix cache), got {salt!r}")
        size = self.block_size
        seq = _Sequence(tokens, chain_hashes(tokens, size, salt))
        for digest in seq.digests[: (len(tokens) - 1) // size]:
            block = self.allocator.lookup(digest)
            if block is None:
                break
            self.allocator.hold(block)
            seq.blocks.append(block)
        seq.length, seq.remembered = len(seq.blocks) * size, len(seq.blocks)
        return self._add(seq)

    def _add(self, seq: _Sequence) -> int:
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.sequences[seq_id] = seq
        return seq_id

    def _sequence(self, seq_id: int) -> _Sequence:
        if seq_id not in self.sequences:
            raise ValueError(
                f"no live sequence {seq_id!r} in this cache (ids come from "
                "add_sequence or fork; free ends one)"
            )
        return self.sequences[seq_id]

    def length(self, seq_id: int) -> int:
        """Tokens stored for the sequence (a shared prefix included)."""
        return self._sequence(seq_id).length

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks in order."""
        return list(self._sequence(seq_id).blocks)

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing all of seq_id's blocks (copied when either writes)."""
        seq = self._sequence(seq_id)
        self._touch(seq_id)
        for block in seq.blocks:
            self.allocator.hold(block)
        copy = _Sequence(
            list(seq.tokens), seq.digests, list(seq.blocks), seq.length, seq.remembered
        )
        return self._add(copy)

    def free(self, seq_id: int) -> None:
        """End the sequence: its blocks are released (cached prompt blocks stay
        findable until the pool needs them)."""
        seq = self._sequence(seq_id)
        self._touch(seq_id)
        for block in seq.blocks:
            self.allocator.release(block)
        del self.sequences[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the sequence's first `length` tokens (speculative decoding: drop the
        rejected drafts); blocks past them go back to the pool. The prompt blocks in the
        prefix cache stay: length may not cut into them."""
        seq = self._sequence(seq_id)
        floor = seq.remembered * self.block_size
        if (
            isinstance(length, bool)
            or not isinstance(length, int)
            or not floor <= length <= seq.length
        ):
            raise ValueError(
                f"length must be an int in {floor}..{seq.length} (the sequence's tokens, "
                f"not cutting into its {floor} cached prompt tokens), got {length!r}"
            )
        self._touch(seq_id)
        keep = math.ceil(length / self.block_size)
        for block in seq.blocks[keep:]:
            self.allocator.release(block)
        del seq.blocks[keep:]
        seq.length = length

    def _touch(self, seq_id: int) -> None:
        """A change to seq_id's blocks: PagedLayers of a pending pass holding it go stale."""
        if self._pass is not None and seq_id in self._pass.seq_ids:
            self._pass.valid = False

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Blocks that writing new_tokens more tokens to the sequence would take from the
        pool: new ones, and a copy of a shared last block that is partly filled (when
        every sequence sharing it writes in one step, the last keeps it: the sum over a
        step's sequences may be one more per such block than batch takes)."""
        seq = self._sequence(seq_id)
        int_at_least("new_tokens", new_tokens, 0)
        size = self.block_size
        needed = math.ceil((seq.length + new_tokens) / size) - len(seq.blocks)
        copy = new_tokens > 0 and seq.length % size and self.allocator.refs[seq.blocks[-1]] > 1
        return needed + int(bool(copy))

    def _needed(self, seq_ids: list[int], new_tokens: int) -> int:
        """Blocks a step takes: blocks_needed of each sequence, except that of a shared
        block every holder writes, the last writer keeps the original."""
        needed = sum(self.blocks_needed(seq_id, new_tokens) for seq_id in seq_ids)
        size, refs = self.block_size, self.allocator.refs
        last = Counter(
            self.sequences[seq_id].blocks[-1]
            for seq_id in seq_ids
            if self.sequences[seq_id].length % size
        )
        return needed - sum(1 for block, count in last.items() if count == refs[block] > 1)

    def batch(self, seq_ids: Sequence[int], new_tokens: int) -> list[PagedLayer]:
        """The `caches` of one forward pass in which each of the sequences seq_ids adds
        new_tokens tokens (a decoding step: 1; a prefill chunk: its length), one
        PagedLayer per layer. Takes the blocks the step needs (PoolExhausted, with
        nothing changed, if the pool has too few) and counts the new tokens in each
        sequence's length at once: run exactly one forward pass with the result."""
        seq_ids = list(seq_ids)
        if not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(
                f"seq_ids must be a non-empty list of distinct sequence ids, got {seq_ids}"
            )
        _check_positive(new_tokens=new_tokens)
        needed = self._needed(seq_ids, new_tokens)
        if needed > self.free_blocks:
            raise PoolExhausted(
                f"this step needs {needed} blocks but {self.free_blocks} of "
                f"{self.num_blocks} are free: check blocks_needed before "
                "batch, free a sequence, or use more num_blocks"
            )
        if self._pass is not None:
            self._pass.valid = False
        size = self.block_size
        slots, completed = [], []
        for seq_id in seq_ids:
            seq = self.sequences[seq_id]
            if new_tokens and seq.length % size and self.allocator.refs[seq.blocks[-1]] > 1:
                seq.blocks[-1] = self._copy(seq.blocks[-1])
            while len(seq.blocks) * size < seq.length + new_tokens:
                seq.blocks.append(self.allocator.allocate())
            slots += [
                seq.blocks[p // size] * size + p % size
                for p in range(seq.length, seq.length + new_tokens)
            ]
            seq.length += new_tokens
            full = min(seq.length, len(seq.tokens)) // size
            completed += [(seq_id, i) for i in range(seq.remembered, full)]
        self._pass = self._make_pass(seq_ids, new_tokens, slots, completed)
        return [PagedLayer(self._pass, layer) for layer in range(self.num_layers)]

    def layer(self, index: int) -> PagedLayer:
        """Layer `index`'s part of the forward pass the last batch() prepared."""
        if self._pass is None:
            raise ValueError("no forward pass is prepared: call batch(seq_ids, new_tokens)")
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < self.num_layers
        ):
            raise ValueError(f"layer must be in 0..{self.num_layers - 1}, got {index!r}")
        return PagedLayer(self._pass, index)

    def _copy(self, block: int) -> int:
        """A new block holding what `block` holds, in every layer, in place of it."""
        new = self.allocator.allocate()
        self.k[:, new] = self.k[:, block]
        self.v[:, new] = self.v[:, block]
        self.allocator.release(block)
        return new

    def _make_pass(self, seq_ids, new_tokens, slots, completed) -> PagedPass:
        """The pass's sequences, its PagedStep (the table and lengths every layer's
        attention reads, checked here once), and where its new tokens go."""
        seqs = [self.sequences[seq_id] for seq_id in seq_ids]
        width = max(len(seq.blocks) for seq in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            table[row, : len(seq.blocks)] = torch.tensor(seq.blocks)
        lengths = [seq.length for seq in seqs]
        rows = torch.arange(new_tokens)
        positions = torch.tensor(lengths).view(-1, 1) - new_tokens + rows
        device = self.k.device
        paged = PagedStep(
            table.to(device), lengths, num_blocks=self.num_blocks, block_size=self.block_size
        )
        return PagedPass(
            self.k,
            self.v,
            seq_ids,
            paged,
            positions.to(device),
            torch.tensor(slots, device=device),
            lambda: self._remember(completed),
        )

    def _remember(self, completed: list[tuple[int, int]]) -> None:
        """Every layer wrote a step: the full prompt blocks (sequence id, block index) it
        completed join the prefix cache."""
        for seq_id, index in completed:
            seq = self.sequences[seq_id]
            self.allocator.remember(seq.blocks[index], seq.digests[index])
            seq.remembered = max(seq.remembered, index + 1)

    def gather(self, seq_id: int, layer: int) -> tuple[Tensor, Tensor]:
        """The sequence's keys (H_kv, length, D) and values (H_kv, length, D_v) in
        `layer`, gathered from its blocks (for inspection; attention never does this)."""
        seq = self._sequence(seq_id)
        blocks = torch.tensor(seq.blocks, dtype=torch.long, device=self.k.device)

        def pages(pool: Tensor) -> Tensor:
            rows = pool[layer].index_select(0, blocks).flatten(0, 1)[: seq.length]
            return rows.transpose(0, 1)

        return pages(self.k), pages(self.v)


def _token_ids(tokens: Sequence[int] | Tensor) -> list[int]:
    tokens = int_list("tokens", tokens)
    if not tokens:
        raise ValueError("tokens must hold the prompt's token ids, at least one")
    bad = [t for t in tokens if not is_int(t) or not 0 <= t < 2**63]
    if bad:
        raise ValueError(f"tokens must be token ids (ints >= 0), got {bad[0]!r}")
    return tokens
