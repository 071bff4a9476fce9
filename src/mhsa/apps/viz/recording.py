"""Record one input's attention for the explorer: every head's thumbnail and summary,
the full maps (uint8 per row) of the heads and rows asked for, and the attention
rollout across layers (Abnar & Zuidema 2020) for self-attention stacks.

Each layer's probabilities are recomputed from its inputs by
MultiHeadAttention.attention_map (mhsa.attention_weights), a block of query rows at a
time, and reduced at once: no layer's full (H, L, S) map is ever kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .maps import capture
from .quantize import quantize_rows, spread_rows
from .sources import Source
from .stats import HeadStats

THUMB = 48  # thumbnail cells per side, at most
CHUNK_FLOATS = 1 << 22  # probabilities computed at once (16 MB of float32)


@dataclass
class Recording:
    """What the explorer page shows. maps (n, R, K) uint8 and map_scales (n, R) hold
    the stored heads (layer, head) in `stored` order, for the query rows `rows` and
    the first K keys; thumbs (layers, H, tr, tc) uint8 with thumb_scales (layers, H);
    rollout (R, K) with rollout_scales (R,), or None; stats[name][layer][head].
    When keys past the first K are left out (rest_label names them), map_rest (n, R)
    holds each stored row's probability on them, in float32."""

    title: str
    note: str
    layer_names: list[str]
    num_heads: int
    queries: list[str]
    keys: list[str]
    self_attention: bool
    rows: list[int]
    stored: list[tuple[int, int]]
    maps: Tensor
    map_scales: Tensor
    thumbs: Tensor
    thumb_scales: Tensor
    stats: dict[str, list[list[float | None]]] = field(default_factory=dict)
    rollout: Tensor | None = None
    rollout_scales: Tensor | None = None
    rest_label: str | None = None
    map_rest: Tensor | None = None


def parse_heads(spec: str | None) -> list[tuple[int | None, int]] | None:
    """--heads "0,3" (those heads in every layer) or "2:5,4:1" (LAYER:HEAD pairs), or
    a mix, as (layer or None, head) pairs; None for every head."""
    if spec is None:
        return None
    pairs = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(
                "--heads must be head indices (every layer) or LAYER:HEAD pairs, "
                f"comma-separated (e.g. 0,3 or 2:5,4:1), got {spec!r}"
            )
        numbers = [int(p) for p in parts]
        pairs.append((None, numbers[0]) if len(numbers) == 1 else (numbers[0], numbers[1]))
    return pairs


def select_heads(
    pairs: Sequence[tuple[int | None, int]] | None, layers: int, heads: int
) -> list[tuple[int, int]]:
    """The (layer, head) pairs of parse_heads' answer, in order, checked against the
    model's layers and heads per layer."""
    if pairs is None:
        return [(layer, head) for layer in range(layers) for head in range(heads)]
    chosen = set()
    for layer, head in pairs:
        if not 0 <= head < heads:
            raise ValueError(
                f"--heads: head {head} is out of range; the model has {heads} "
                f"heads per layer (0..{heads - 1})"
            )
        if layer is not None and not 0 <= layer < layers:
            raise ValueError(
                f"--heads: layer {layer} is out of range; the model has {layers} "
                f"attention layers (0..{layers - 1})"
            )
        chosen.update((i, head) for i in range(layers) if layer is None or i == layer)
    return sorted(chosen)


class _Layer:
    """One layer's reductions, fed a block of rows at a time."""

    def __init__(self, rec: _Recorder, index: int, q_len: int, kv_len: int) -> None:
        self.rec, self.index = rec, index
        heads, shown = rec.num_heads, rec.key_count
        self.stats = HeadStats(heads, q_len, kv_len, rec.self_attention, shown)
        self.tr, self.tc = min(q_len, THUMB), min(shown, THUMB)
        self.thumb = torch.zeros(heads, self.tr, self.tc)
        self.key_bin = torch.arange(shown) * self.tc // shown
        if q_len != kv_len:  # rollout chains square maps only
            rec.rollout = None
        self.mean = torch.zeros(q_len, kv_len) if rec.rollout is not None else None
        self.heads = [
            (slot, head) for slot, (layer, head) in enumerate(rec.stored) if layer == index
        ]

    def update(self, probs: Tensor, rows: Tensor) -> None:
        """probs (H, r, S) of query rows `rows`."""
        rec = self.rec
        self.stats.update(probs, rows)
        shown = probs[..., : rec.key_count]  # (H, r, K)
        pooled = torch.zeros(*shown.shape[:2], self.tc).index_add_(2, self.key_bin, shown)
        row_bin = rows * self.tr // len(rec.queries)
        self.thumb.index_add_(1, row_bin, pooled)
        if self.mean is not None:
            self.mean[rows] = probs.mean(0)
        where = [i for i, row in enumerate(rec.rows) if rows[0] <= row <= rows[-1]]
        if where and self.heads:
            picked = torch.tensor([rec.rows[i] for i in where]) - rows[0]
            slots, heads = zip(*self.heads, strict=True)
            values, scales = quantize_rows(shown[list(heads)][:, picked])
            rec.maps[list(slots), where[0] : where[-1] + 1] = values
            rec.map_scales[list(slots), where[0] : where[-1] + 1] = scales
            if rec.map_rest is not None:
                rest = probs[list(heads)][:, picked, rec.key_count :].sum(-1)
                rec.map_rest[list(slots), where[0] : where[-1] + 1] = rest

    def finish(self) -> None:
        rec, q_len = self.rec, len(self.rec.queries)
        cells = torch.bincount(torch.arange(q_len) * self.tr // q_len, minlength=self.tr)
        widths = torch.bincount(self.key_bin, minlength=self.tc)
        thumb = self.thumb / (cells[:, None] * widths[None, :]).clamp_min(1)
        flat, scales = quantize_rows(thumb.flatten(1))
        rec.thumbs.append(flat.view_as(thumb))
        rec.thumb_scales.append(scales)
        for name, values in self.stats.result().items():
            rec.stats.setdefault(name, []).append(values)
        if self.mean is not None:  # rollout: (0.5 A + 0.5 I), rows renormalised, chained
            step = 0.5 * self.mean + 0.5 * torch.eye(q_len)
            step = step / step.sum(-1, keepdim=True)
            rec.rollout = step @ rec.rollout


class _Recorder:
    def __init__(self, source: Source, stored: list[tuple[int, int]], max_rows: int) -> None:
        self.queries = source.queries
        self.num_heads = source.num_heads
        self.self_attention = source.self_attention
        keys = source.queries if source.keys is None else source.keys
        self.key_count = len(keys) if source.key_limit is None else source.key_limit
        self.keys = keys[: self.key_count]
        self.rest_label = None
        if self.key_count < len(keys):
            self.rest_label = f"{keys[self.key_count]}\u2026{keys[-1]}"
        self.stored = stored
        self.rows = spread_rows(len(self.queries), max_rows)
        self.maps = torch.zeros(len(stored), len(self.rows), self.key_count, dtype=torch.uint8)
        self.map_scales = torch.zeros(len(stored), len(self.rows))
        self.map_rest = None if self.rest_label is None else torch.zeros_like(self.map_scales)
        self.thumbs: list[Tensor] = []
        self.thumb_scales: list[Tensor] = []
        self.stats: dict[str, list] = {}
        length = len(self.queries)
        self.rollout = torch.eye(length) if self.self_attention else None

    def on_call(self, index: int, module, args: tuple, kwargs: dict) -> None:
        """The forward-pre-hook's work for attention layer `index`: its probabilities,
        a block of query rows at a time, reduced into a _Layer."""
        q_len = len(self.queries)
        key = args[1] if len(args) > 1 else kwargs.get("key")
        kv_len = (args[0] if key is None else key).shape[1]
        layer = _Layer(self, index, q_len, kv_len)
        chunk = max(1, CHUNK_FLOATS // (self.num_heads * kv_len))
        for start in range(0, q_len, chunk):
            rows = torch.arange(start, min(q_len, start + chunk))
            probs = module.attention_map(*args, rows=None if chunk >= q_len else rows, **kwargs)
            layer.update(probs[0].float().cpu(), rows)  # (H, r, S), on the CPU
        layer.finish()


def record(source: Source, heads: str | None = None, max_rows: int = 256) -> Recording:
    """Run source's model once and record its attention for the explorer: the full maps
    of `heads` (parse_heads' syntax; default all) for at most max_rows query rows
    (evenly spread), and every head's thumbnail and summary."""
    if max_rows < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_rows}")
    stored = select_heads(parse_heads(heads), len(source.layers), source.num_heads)
    rec = _Recorder(source, stored, max_rows)
    capture([m for _, m in source.layers], source.run, rec.on_call)
    if len(rec.thumbs) != len(source.layers):
        raise RuntimeError(f"{len(rec.thumbs)} of {len(source.layers)} attention layers ran")
    rollout = scales = None
    if rec.rollout is not None:
        rollout, scales = quantize_rows(rec.rollout[rec.rows])
    return Recording(
        title=source.title,
        note=source.note,
        layer_names=[n for n, _ in source.layers],
        num_heads=source.num_heads,
        queries=source.queries,
        keys=rec.keys,
        self_attention=source.self_attention,
        rows=rec.rows,
        stored=stored,
        maps=rec.maps,
        map_scales=rec.map_scales,
        thumbs=torch.stack(rec.thumbs),
        thumb_scales=torch.stack(rec.thumb_scales),
        stats=rec.stats,
        rollout=rollout,
        rollout_scales=scales,
        rest_label=rec.rest_label,
        map_rest=rec.map_rest,
    )
