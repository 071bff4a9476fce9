"""The block bookkeeping of a paged cache: reference counts, the free blocks, and the
prefix cache (full blocks of prompt tokens found again by a chained hash of their ids).

No tensors here: a block is an id in 0..num_blocks-1, and what it holds is the
PagedKVCache's business.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence


class PoolExhausted(ValueError):
    """The pool has fewer free blocks than a step needs (PagedKVCache.blocks_needed
    says how many beforehand): free a sequence, or build the cache with more blocks."""


def chain_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The digest of each full block of tokens, chained: block i's digest covers its
    own token ids and block i-1's digest, so equal digests mean equal prefixes; the
    first block's also covers salt, so prefixes under different salts never meet."""
    digests, previous = [], hashlib.sha256(b"salt:" + salt).digest() if salt else b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        ids = array("q", tokens[start : start + block_size]).tobytes()
        previous = hashlib.sha256(previous + ids).digest()
        digests.append(previous)
    return digests


class BlockAllocator:
    """Block ids with reference counts (the live sequences holding each block). A block
    no sequence holds is free; if the prefix cache knows it, it stays findable until an
    allocation needs it (least recently released first)."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.unused: deque[int] = deque(range(num_blocks))  # free, holding nothing known
        self.cached: OrderedDict[int, None] = OrderedDict()  # free, in the prefix cache
        self.digest_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}

    @property
    def free(self) -> int:
        """Blocks no live sequence holds (those of the prefix cache included)."""
        return len(self.unused) + len(self.cached)

    def allocate(self) -> int:
        """A free block, held once; a cached one is forgotten by the prefix cache."""
        if self.unused:
            block = self.unused.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.block_of[self.digest_of.pop(block)]
        else:
            raise PoolExhausted("no free block left in the pool")
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more sequence holds block."""
        if self.refs[block] == 0:
            del self.cached[block]  # (only cached blocks are found while free)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One sequence fewer holds block; at none it is free (and still cached)."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.digest_of:
                self.cached[block] = None
            else:
                self.unused.append(block)

    def lookup(self, digest: bytes) -> int | None:
        """The block holding the prefix with this digest, if cached."""
        return self.block_of.get(digest)

    def remember(self, block: int, digest: bytes) -> None:
        """block (written, held) holds the prefix with this digest; the first block
        remembered for a digest keeps it."""
        if digest not in self.block_of and block not in self.digest_of:
            self.block_of[digest] = block
            self.digest_of[block] = digest
