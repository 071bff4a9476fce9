"""Score functions and sinks inside the Triton kernels.

The kernels evaluate ALiBi, RelativeBias and Softcap (mhsa.core.scores) per tile from the
tile's row and column indices, in global positions aligned bottom-right (query row r
at r + S - L), and never build an (L, S) tensor:
    ALiBi         -slopes[h] * |i - j|, slopes (H,) loaded once per program;
    RelativeBias  table[bucket(j - i), h]; the bucket of each offset in -span..span
                  (span = max_distance; beyond it every offset shares the end bucket)
                  is looked up in a (2 * span + 1,) int32 vector made by
                  mhsa.core.scores.t5_bucket itself, so kernel and torch buckets agree
                  exactly, with no float log in the kernel;
    Softcap       cap * tanh(s / cap); its backward multiplies dS by 1 - tanh**2. With
                  bfloat16 inputs on a GPU, tanh is the hardware's tanh.approx.f32 (one
                  special-function op, relative error about 2**-11, below bfloat16's
                  2**-9; float16 rounds at 2**-11 itself); else it is made from exp and
                  a division, two such ops for each score.
Each additive function has a stage: 1 before the softcap (or without one), 2 after it,
so a composition holds each kind at most once. Sinks (H,) start each row's online
softmax at (max = sink, sum = 1): the denominator includes exp(sink) and a row with no
allowed key gets output 0 and lse = sink; their gradient is computed in torch from lse
and delta (mhsa.core.kernels.scored.sink_grad).

Gradients are atomic-free: the dQ kernel, one program per (batch, head, query block),
writes its tiles' slope gradient and per-bucket table gradient sums to a partial
buffer, which torch then reduces over batches and query blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...scores import ALiBi, Compose, RelativeBias, ScoreFunction, Softcap, t5_bucket
from .checks import interpreting

KERNEL_SCORES = (ALiBi, RelativeBias, Softcap)


@triton.jit
def _tanh(x, HARDWARE: tl.constexpr):
    """tanh of float32 x: the GPU's tanh.approx.f32 with HARDWARE, else from exp (no
    libdevice: the interpreter and every GPU run it)."""
    if HARDWARE:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def key_offsets(rows, cols, shift):
    """(BLOCK_M, BLOCK_N) int32 offsets j - p of keys cols from the query positions
    rows + shift: what every score function and band mask reads."""
    return cols[None, :] - (rows + shift)[:, None]


@triton.jit
def _bucket(offset, Buckets, span):
    """The T5 bucket of each offset, looked up in Buckets (2 * span + 1,) after clamping
    the offsets to -span..span."""
    return tl.load(Buckets + span + tl.minimum(tl.maximum(offset, -span), span))


# Triton takes no structs: the helpers keep dense argument lists, which the formatter
# would spread one per line.
# fmt: off
@triton.jit
def _additive(s, offset, slope, table, stn, Buckets, span, STAGE: tl.constexpr,
              ALIBI: tl.constexpr, RELATIVE: tl.constexpr, ACC: tl.constexpr):
    """s plus the additive functions of this STAGE (1 before the softcap, 2 after)."""
    if ALIBI == STAGE:
        s -= slope * tl.abs(offset).to(ACC)
    if RELATIVE == STAGE:
        s += tl.load(table + _bucket(offset, Buckets, span) * stn).to(ACC)
    return s


@triton.jit
def _score_fn(s, offset, slope, table, stn, Buckets, span, cap,
              ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr,
              ACC: tl.constexpr):
    """(scores after the score function, tanh of the softcap's argument (s without a
    softcap), for the backward) of (BLOCK_M, BLOCK_N) scaled scores s."""
    s = _additive(s, offset, slope, table, stn, Buckets, span, 1,
                  ALIBI, RELATIVE, ACC)
    t = s
    if SOFTCAP:
        t = _tanh(s * (1.0 / cap), SOFTCAP == 2)
        s = cap * t
        s = _additive(s, offset, slope, table, stn, Buckets, span, 2,
                      ALIBI, RELATIVE, ACC)
    return s, t


@triton.jit
def _bucket_sums(bucket, g, BLOCK_NB: tl.constexpr):
    """(BLOCK_NB,) sums of g over the entries of each bucket, looping over the range of
    buckets present (a tile spans BLOCK_M + BLOCK_N - 1 offsets: few buckets)."""
    ids = tl.arange(0, BLOCK_NB)
    sums = tl.zeros([BLOCK_NB], g.dtype)
    for n in range(tl.min(bucket), tl.max(bucket) + 1):
        sums += tl.where(ids == n, tl.sum(tl.where(bucket == n, g, 0.0)), 0.0)
    return sums


@triton.jit
def _score_grad(ds, t, offset, Buckets, span, d_slope, d_table,
                ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr,
                SLOPE_GRAD: tl.constexpr, TABLE_GRAD: tl.constexpr, BLOCK_NB: tl.constexpr,
                ACC: tl.constexpr):
    """(dS of the scaled scores, d_slope + this tile's slope gradient, d_table + its
    per-bucket table gradient) from dS of the modified scores and t of _score_fn."""
    ds_in = ds
    if SOFTCAP:
        ds_in = ds * (1.0 - t * t)
    if SLOPE_GRAD:
        g = ds_in if ALIBI == 1 else ds
        d_slope -= tl.sum(g * tl.abs(offset).to(ACC))
    if TABLE_GRAD:
        g = ds_in if RELATIVE == 1 else ds
        d_table += _bucket_sums(_bucket(offset, Buckets, span), g, BLOCK_NB)
    return ds_in, d_slope, d_table
# fmt: on


@triton.jit
def _head_score(
    Slopes, Table, Sinks, h64, sth, ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, ACC: tl.constexpr
):
    """(slope, this head's table column, sink) of query head h64; 0 where absent (the
    sink's 0 is unused)."""
    slope = 0.0
    if ALIBI != 0:
        slope = tl.load(Slopes + h64).to(ACC)
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(Sinks + h64).to(ACC)
    return slope, Table + h64 * sth, sink


@dataclass(frozen=True)
class KernelScore:
    """A call's score function as the kernels evaluate it: each additive function's
    stage (0 absent, 1 before the softcap or without one, 2 after it), the cap (0.0
    without one), RelativeBias's bucketing, and whether the softcap may take the GPU's
    tanh.approx for bfloat16 inputs (hardware_tanh)."""

    alibi: int = 0
    relative: int = 0
    cap: float = 0.0
    num_buckets: int = 0
    max_distance: int = 0
    bidirectional: bool = True
    hardware_tanh: bool = True

    def constants(self, q: Tensor) -> dict:
        """The kernels' constexpr arguments for queries q: SOFTCAP 0 without a softcap,
        1 with tanh from exp, 2 with the hardware's tanh (bfloat16 q on CUDA)."""
        softcap = 0
        if self.cap > 0:
            hardware = q.is_cuda and q.dtype == torch.bfloat16 and not interpreting()
            softcap = 2 if hardware and self.hardware_tanh else 1
        return {"ALIBI": self.alibi, "RELATIVE": self.relative, "SOFTCAP": softcap}

    def args(
        self, slopes: Tensor | None, table: Tensor | None, sinks: Tensor | None, like: Tensor
    ) -> list:
        """Slopes, Table, Buckets, Sinks, stn, sth, span, cap (dummies where absent)."""
        buckets = like
        if self.relative:
            buckets = bucket_lookup(
                self.num_buckets, self.max_distance, self.bidirectional, str(like.device)
            )
        strides = (0, 0) if table is None else table.stride()
        slopes, table, sinks = (like if t is None else t for t in (slopes, table, sinks))
        return [slopes, table, buckets, sinks, *strides, self.max_distance, self.cap]


def kernel_score(score: ScoreFunction | None) -> tuple[KernelScore, Tensor | None, Tensor | None]:
    """(KernelScore, ALiBi slopes or None, RelativeBias table or None) of score; raises
    ValueError for what the kernels cannot evaluate."""
    functions = () if score is None else score.functions if isinstance(score, Compose) else (score,)
    kinds = [type(f) for f in functions]
    fields, slopes, table = {}, None, None
    for f in functions:
        if type(f) not in KERNEL_SCORES or kinds.count(type(f)) > 1:
            raise ValueError(
                f"the triton kernels evaluate ALiBi, RelativeBias and Softcap, each "
                f"at most once, got {score!r}; use backend='flash'"
            )
        stage = 2 if "cap" in fields else 1
        if isinstance(f, ALiBi):
            fields["alibi"], slopes = stage, f.slopes
        elif isinstance(f, RelativeBias):
            fields.update(
                relative=stage,
                num_buckets=f.num_buckets,
                max_distance=f.max_distance,
                bidirectional=f.bidirectional,
            )
            table = f.table
        else:
            fields["cap"] = f.cap
    return KernelScore(**fields), slopes, table


@functools.lru_cache(maxsize=32)
def bucket_lookup(num_buckets: int, max_distance: int, bidirectional: bool, device: str) -> Tensor:
    """(2 * max_distance + 1,) int32: t5_bucket of the offsets -max_distance..max_distance;
    offsets beyond share the end buckets (their log ratio is >= 1, clamped)."""
    offsets = torch.arange(-max_distance, max_distance + 1)
    buckets = t5_bucket(offsets, num_buckets, max_distance, bidirectional)
    return buckets.to(device=device, dtype=torch.int32)


def block_buckets(num_buckets: int) -> int:
    """The power of two >= num_buckets that the table gradient's partial sums take."""
    return triton.next_power_of_2(max(num_buckets, 1))


def score_of_heads(score: ScoreFunction | None, index: Tensor) -> ScoreFunction | None:
    """score as a call on the query heads `index` (1-D int64) alone sees it: ALiBi's
    slopes and RelativeBias's table columns selected (Softcap has none)."""
    if score is None:
        return None
    functions = score.functions if isinstance(score, Compose) else (score,)
    selected = []
    for f in functions:
        if isinstance(f, ALiBi):
            f = ALiBi(f.slopes.index_select(0, index))
        elif isinstance(f, RelativeBias):
            f = RelativeBias(
                f.table.index_select(1, index), f.num_buckets, f.max_distance, f.bidirectional
            )
        selected.append(f)
    return Compose(*selected)
