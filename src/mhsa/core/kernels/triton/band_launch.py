"""Launch code for the band kernels (.band): which calls they serve, their launch
configurations, and the forward and backward launches.

A call is a band call when its mask is None, Causal() or a pattern that is exactly a
band (SlidingWindow; Pattern.band() with dilation 1), with causal folded in, and it
has no bias, no dropout and equal head dims. Score functions and sinks ride along;
the gradients of ALiBi slopes and RelativeBias tables come from the tile-list kernels
(function.py falls back to them when those are wanted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...masks import Pattern
from ...masks.causal import causal_shift
from ...masks.patterns import Causal
from .band import BIG, _band_fwd
from .band_grad import _band_bwd_dkv, _band_bwd_dq
from .checks import interpreting
from .options import kernel_options, strides
from .scores import KernelScore

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of each kernel, by (16-bit inputs, head dim
# up to). The 16-bit D <= 128 rows were chosen on an H200 by
# `python -m mhsa.benchmarks.gpu_band` (2026-12-04, B=4, H=16, L=8192, bf16; the rows
# are docs/gpu-runs/2026-12-04-band.jsonl and, for the first run, -band-sweep1.jsonl):
# forward (128, 64, 8, 3) at 2.47 ms causal (the best of 14 configs), dq (128, 64, 8, 2)
# and dkv (32, 64, 4, 3), each the best of 6 with the other kernel at its old default;
# forward at D=64 (128, 64, 4, 3), the best of 10 in the first run. dkv at D=64 follows
# D=128 (its 32 x 128 tiles on 4 warps took twice the time there); the rest are
# unmeasured.
_DKV = {
    (True, 64): (32, 64, 4, 3),
    (True, 128): (32, 64, 4, 3),
    (True, 256): (32, 64, 8, 1),
    (False, 64): (32, 64, 4, 2),
    (False, 128): (32, 64, 4, 2),
    (False, 256): (32, 32, 8, 1),
}
CONFIGS = {
    "forward": {
        (True, 64): (128, 64, 4, 3),
        (True, 128): (128, 64, 8, 3),
        (True, 256): (64, 32, 8, 2),
        (False, 64): (64, 32, 4, 2),
        (False, 128): (64, 32, 4, 2),
        (False, 256): (32, 32, 8, 1),
    },
    "dq": {
        (True, 64): (128, 32, 4, 3),
        (True, 128): (128, 64, 8, 2),
        (True, 256): (64, 32, 8, 1),
        (False, 64): (64, 32, 4, 2),
        (False, 128): (64, 32, 4, 2),
        (False, 256): (32, 32, 8, 1),
    },
    "dkv": _DKV,
    # the dK/dV kernel adding dQ with atomics (DQ_IN_DKV), untimed; dkv's launches but at
    # 16-bit D <= 128: at sm_90 and D=128, (64, 128, 8, 3) issues 24 instructions a
    # score for all five products, where the dQ and dK/dV kernels issue 31 together for
    # seven, and spills the fewest registers inside its loops of the 64 x 128 tiles
    # (tools/triton_compile.py --sass)
    "dkv+dq": {**_DKV, (True, 64): (64, 128, 8, 2), (True, 128): (64, 128, 8, 3)},
}


# the dK/dV kernel runs one program per query head, not per KV head, where the KV heads
# give it fewer programs than this (B=1 with grouped-query heads: 256 at L=4096 with 4
# KV heads, about 2 per SM of an H200) and the heads' float32 shares of dK and dV fit
# in PER_HEAD_BYTES (64 MiB at that shape)
PER_HEAD_BELOW = 1024
PER_HEAD_BYTES = 512 * 2**20


def dkv_per_head(key_shape: tuple, num_heads: int, block_n: int) -> bool:
    """Whether the dK/dV kernel for keys of key_shape (B, H_kv, S, D) and num_heads
    query heads runs one program per query head (see PER_HEAD_BELOW)."""
    batch, num_kv_heads, kv_len, head_dim = key_shape
    programs = -(-kv_len // block_n) * batch * num_kv_heads
    share_bytes = 2 * 4 * batch * num_heads * kv_len * head_dim  # float32 dK and dV
    grouped = num_heads > num_kv_heads
    return grouped and programs < PER_HEAD_BELOW and share_bytes <= PER_HEAD_BYTES


def band_config(kernel: str, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of kernel ("forward", "dq", "dkv" or
    "dkv+dq"); 16 x 16 tiles under the interpreter."""
    if interpreting():
        return 16, 16, 4, 1
    dim = next(d for d in (64, 128, 256) if head_dim <= d)
    return CONFIGS[kernel][(dtype in (torch.float16, torch.bfloat16), dim)]


def mask_band(mask, causal: bool) -> tuple[int, int] | None:
    """(left, right) of a call whose allowed keys are a band around each query's
    position, or None: keys p - left .. p + right (BIG for an open side)."""
    if mask is None:
        left, right = BIG, BIG
    elif isinstance(mask, Causal):
        left, right = BIG, 0
    elif isinstance(mask, Pattern) and mask.batch_size is None:
        band = mask.band()
        if band is None or band.dilation != 1:
            return None
        left, right = band.left, band.right
    else:
        return None
    return (left, min(right, 0)) if causal else (left, right)


@dataclass(frozen=True)
class BandPlan:
    """A band call's plan: the band and the causal shift (query row 0's position)."""

    left: int
    right: int
    shift: int


# positions the band kernels take ALiBi at: they form its offsets in float32, exact
# below 2**24 (the tile-list kernels take longer ALiBi calls)
ALIBI_POSITIONS = 2**24 - 1024


def band_plan(
    q: Tensor, k: Tensor, v: Tensor | None, mask, bias, causal: bool, alibi: bool = False
):
    """The BandPlan of a call without dropout that the band kernels serve, else None;
    alibi: the call has an ALiBi score function."""
    if bias is not None or v is None or v.shape[3] != q.shape[3]:
        return None
    if alibi and max(q.shape[2], k.shape[2]) > ALIBI_POSITIONS:  # (|positions| <= max(L, S))
        return None
    band = mask_band(mask, causal)
    if band is None:
        return None
    return BandPlan(band[0], band[1], causal_shift(q.shape[2], k.shape[2]))


# dQ added by the dK/dV kernel with float32 atomics (5 products a tile, FlashAttention-2's
# split) instead of recomputed by its own kernel (7, deterministic): off until a device
# run measures it (gpu_band's sweep_backward, "dkv+dq" rows); never under
# torch.use_deterministic_algorithms, as the atomics' order varies
DQ_IN_DKV = False


def dq_atomic_default() -> bool:
    """Whether band_backward adds dQ with atomics when not told (DQ_IN_DKV, unless
    deterministic algorithms are asked for)."""
    return DQ_IN_DKV and not torch.are_deterministic_algorithms_enabled()


# the forward's unmasked loop with each block's q k^T issued before the previous
# block's softmax (band._fwd_blocks, AHEAD): at sm_90 ptxas then runs the exp2s while
# the tensor cores compute the next scores (FlashAttention-3's overlap within a
# warpgroup), where the plain loop waits for them; same bits. Off until a device run
# times it (gpu_band's sweep_forward, "ahead")
FORWARD_AHEAD = False
# the same for the tile-list forward (function.launch_forward; gpu_band's sweep_tiles):
# at sm_90 it overlaps 62 of 68 exp2s with (128, 64, 8, 2) tiles, but none with the
# default (64, 64, 8, 2), whose plain loop overlaps 10 of 35
TILES_AHEAD = False


# the forward's and dQ's query blocks launched from the last (band._query_block): with
# causal the long rows first, the short ones in the tail; same bits. Off until a device
# run times it (gpu_band's sweeps, "last first")
LAST_FIRST = False


# Hopper's TMA (tensor descriptors) for the forward's keys and values: off until a
# device run measures it against pointer loads (gpu_band's sweep_forward, "tma")
USE_TMA = False


def tma_descriptors(k: Tensor, v: Tensor, block_n: int, block_d: int) -> tuple:
    """TensorDescriptors of k and v (B, H_kv, S, D) in blocks (1, 1, block_n, block_d),
    or (None, None) where TMA cannot read them: before Hopper, or a tensor whose last
    dimension is not contiguous or whose base or other strides are not 16-byte aligned."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if k.device.type == "cuda" and torch.cuda.get_device_capability(k.device)[0] < 9:
        return None, None
    for t in (k, v):
        size = t.element_size()
        if t.stride(3) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:3]):
            return None, None
    block = [1, 1, block_n, block_d]
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), block) for t in (k, v))


def _options(kernel: str, q: Tensor, score: KernelScore, config) -> dict:
    """The constexprs and launch options of one kernel."""
    launch = config or band_config(kernel, q.shape[3], q.dtype)
    options = kernel_options(q, score, launch, acc=False)  # (float32 accumulators)
    return dict(options, EVEN_D=options["BLOCK_D"] == q.shape[3])


def band_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: BandPlan,
    scale: float,
    score: KernelScore,
    tensors: tuple,
    config: tuple | None = None,
    tma: bool | None = None,
    ahead: bool | None = None,
    last_first: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D) in q's dtype, lse (B, H, L) float32) of a band call; tensors
    (slopes, table, sinks), None where absent; config overrides the launch; tma: read
    keys and values through tensor descriptors where they allow it (default USE_TMA);
    ahead: issue each block's scores before the previous block's softmax (default
    FORWARD_AHEAD); last_first: launch each head's query blocks from the last (default
    LAST_FIRST)."""
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    out = q.new_empty(batch, num_heads, q_len, head_dim)
    lse = torch.empty(batch, num_heads, q_len, dtype=torch.float32, device=q.device)
    options = _options("forward", q, score, config)
    descriptors = (None, None)
    if USE_TMA if tma is None else tma:
        descriptors = tma_descriptors(k, v, options["BLOCK_N"], options["BLOCK_D"])
    grid = (-(-q_len // options["BLOCK_M"]), batch * num_heads)
    _band_fwd[grid](
        q,
        k,
        v,
        out,
        lse,
        *strides(q, k, v, out),
        num_heads,
        num_heads // num_kv_heads,
        q_len,
        kv_len,
        head_dim,
        scale,
        plan.shift,
        plan.left,
        plan.right,
        *score.args(*tensors, like=q),
        *descriptors,
        HAS_SINKS=tensors[2] is not None,
        TMA=descriptors[0] is not None,
        AHEAD=FORWARD_AHEAD if ahead is None else ahead,
        LAST_FIRST=LAST_FIRST if last_first is None else last_first,
        **options,
    )
    return out, lse


def band_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad_out: Tensor,
    delta: Tensor,
    lse: Tensor,
    plan: BandPlan,
    scale: float,
    score: KernelScore,
    tensors: tuple,
    configs: tuple | None = None,
    per_head: bool | None = None,
    dq_atomic: bool | None = None,
    last_first: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtype of a band call, given dO (B, H, L, D), delta =
    rowsum(dO * O) - dlse (B, H, L) float32 and the forward's lse; configs (dq, dkv)
    overrides the launches; per_head: the dK/dV kernel's programs per query head, their
    shares summed over each group after it (default: with grouped-query heads, where
    per KV head gives fewer than PER_HEAD_BELOW programs and the shares fit in
    PER_HEAD_BYTES); dq_atomic: the dK/dV kernel adds dQ with atomics, no dQ kernel
    (default dq_atomic_default()); last_first: the dQ kernel's query blocks launched
    from the last (default LAST_FIRST)."""
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    if dq_atomic is None:
        dq_atomic = dq_atomic_default()
    slopes, table, _ = tensors
    score_args = score.args(slopes, table, None, like=q)
    del score_args[3]  # (no sinks: their gradient comes from lse and delta)
    sizes = [q_len, kv_len, head_dim, scale, plan.shift, plan.left, plan.right, *score_args]
    stride_args = strides(q, k, v, grad_out)
    lse, delta = lse.contiguous(), delta.contiguous()
    dq_config, dkv_config = configs or (None, None)
    if dq_atomic:  # float32 (B, H, L, D) that the dK/dV kernel adds into
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        options = _options("dq", q, score, dq_config)
        grid = (-(-q_len // options["BLOCK_M"]), batch * num_heads)
        _band_bwd_dq[grid](
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            dq,
            *stride_args,
            num_heads,
            num_heads // num_kv_heads,
            *sizes,
            LAST_FIRST=LAST_FIRST if last_first is None else last_first,
            **options,
        )
    options = _options("dkv+dq" if dq_atomic else "dkv", q, score, dkv_config)
    key_blocks = -(-kv_len // options["BLOCK_N"])
    if per_head is None:
        per_head = dkv_per_head(k.shape, num_heads, options["BLOCK_N"])
    heads = num_heads if per_head else num_kv_heads
    shares = (batch, heads, kv_len, head_dim)  # per query head: float32, summed below
    dk, dv = (
        torch.empty(shares, dtype=torch.float32 if per_head else k.dtype, device=k.device)
        for _ in "kv"
    )
    grid = (key_blocks, batch * heads)
    _band_bwd_dkv[grid](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dk,
        dv,
        dq if dq_atomic else None,
        *stride_args,
        num_heads,
        num_kv_heads,
        num_heads // num_kv_heads,
        *sizes,
        EVEN_M=q_len % options["BLOCK_M"] == 0,
        PER_HEAD=per_head,
        DQ_ATOMIC=dq_atomic,
        **options,
    )
    if dq_atomic:
        dq = dq.to(q.dtype)
    if per_head:  # each group's query heads in order: the same sum every run
        dk, dv = (t.view(batch, num_kv_heads, group, kv_len, head_dim).sum(2) for t in (dk, dv))
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
    return dq, dk, dv
