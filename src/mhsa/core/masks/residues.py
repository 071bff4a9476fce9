"""Dilated attention as `dilation` sliding windows, so its cost follows the allowed
entries rather than the span of the dilated window.

A query at position p attends keys p + t * d (t in -window..window): all of them in
p's residue class mod d. Within one class, a strided view of the queries and one of
the keys (no copy), that is a plain sliding window, which the flash engine runs
densely (kernels/band.py). Positions are bottom-right aligned (query i sits at
i + S - L), so each class gets the window's offsets re-based to its own lengths.

This is pattern algebra (integers in, windows out), so it lives with the patterns; the
flash backend uses it for any pattern whose `band()` has a dilation above 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from .causal import causal_shift
from .patterns import SlidingWindow


@dataclass(frozen=True)
class ResidueClass:
    """Queries q_start, q_start + d, ... attend keys k_start, k_start + d, ... through
    `window` (bottom-right aligned on the class's own lengths)."""

    q_start: int
    k_start: int
    window: SlidingWindow


def residue_classes(
    window: int, dilation: int, causal: bool, q_len: int, kv_len: int
) -> list[ResidueClass] | None:
    """The classes of Dilated(window, dilation) (with causal, bottom-right), or None
    where some class is empty or its window does not contain its own diagonal."""
    classes = []
    shift = causal_shift(q_len, kv_len)
    for k_start in range(min(dilation, kv_len)):
        q_start = (k_start - shift) % dilation  # first query whose position is = k_start
        sub_q = len(range(q_start, q_len, dilation))
        sub_k = len(range(k_start, kv_len, dilation))
        if sub_q == 0:
            continue  # no query in this class: its keys are attended by nobody
        # query j of the class sits at key index j + offset of the class; the class's
        # window is aligned at sub_k - sub_q, so its sides move by the difference
        offset = (q_start + shift - k_start) // dilation
        move = offset - (sub_k - sub_q)
        left, right = window - move, (0 if causal else window) + move
        if left < 0 or right < 0:
            return None
        classes.append(ResidueClass(q_start, k_start, SlidingWindow(left, right)))
    if sum(len(range(c.q_start, q_len, dilation)) for c in classes) != q_len:
        return None  # some queries have no key in their class (dead rows): the plan's job
    return classes
