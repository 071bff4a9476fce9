"""The calls gpu_band times and checks, each built once and returned as a function of
no arguments: the band kernels' forward and backward (with their variants) and the
tile-list kernels', at given launch configs."""

from __future__ import annotations

import math

import torch

from mhsa.core.masks import SlidingWindow

# gpu_band's cases: (mask, causal)
CASES = {"dense": (None, False), "causal": (None, True), "window": (SlidingWindow(1024, 0), True)}


def _inputs(shape, kv_heads, dtype, device, grad=False):
    """[q (B, H, L, D), k, v (B, kv_heads, L, D)] of shape (B, H, L, D), random normal,
    requiring grad with grad."""
    batch, heads, length, dim = shape
    q = torch.randn(batch, heads, length, dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, length, dim, device=device, dtype=dtype) for _ in "kv")
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _band_args(q, k, v, mask, causal, score=None, slopes=None) -> tuple:
    """(plan, scale, kernel score, (slopes, table, sinks)) of a band call; score a
    KernelScore (default none)."""
    from mhsa.core.kernels.triton.band_launch import band_plan
    from mhsa.core.kernels.triton.scores import KernelScore

    plan = band_plan(q, k, v, mask, None, causal)
    return plan, 1.0 / math.sqrt(q.shape[3]), score or KernelScore(), (slopes, None, None)


def _band_call(q, k, v, mask, causal, config=None, tma=False, score=None, slopes=None, **variants):
    """The band forward of one call, to time; variants: band_forward's ahead and
    last_first (default its own choice)."""
    from mhsa.core.kernels.triton.band_launch import band_forward

    args = _band_args(q, k, v, mask, causal, score, slopes)
    return lambda: band_forward(q, k, v, *args, config, tma, **variants)


def _backward_call(q, k, v, mask, causal, configs, score=None, slopes=None, **variants):
    """The band backward of one call (its forward run once first), to time; variants:
    band_backward's per_head, dq_atomic and last_first (default its own choice)."""
    from mhsa.core.kernels.triton.band_launch import band_backward, band_forward

    args = _band_args(q, k, v, mask, causal, score, slopes)
    out, lse = band_forward(q, k, v, *args)
    grad = torch.randn_like(out)
    delta = (grad.float() * out.float()).sum(-1)
    return lambda: band_backward(q, k, v, grad, delta, lse, *args, configs, **variants)


def _tiles_call(qkv, grad, mask, config, backward: bool):
    """The tile-list kernels' forward (and backward) under one launch config through
    triton_attention (its default TILES_AHEAD), to time."""
    from mhsa.core.kernels.triton import triton_attention

    def call():
        out = triton_attention(*qkv, mask, blocks=config)[0]
        return torch.autograd.grad(out, qkv, grad) if backward else out

    return call


def _tiles_forward_call(qkv, mask, config, ahead: bool):
    """The tile-list forward of one call prepared once, under one launch config (None:
    the default), with or without the scores a tile ahead (launch_forward's), to time."""
    from mhsa.core.kernels.triton.function import LaunchCall, _prepare, launch_forward

    q, k, v = (t.detach() for t in qkv)
    tiles, scale, score, _, _ = _prepare(q, k, v, mask, None, False, None, config)
    call = LaunchCall(q, k, v, None, tiles, scale, None, score)
    return lambda: launch_forward(call, ahead=ahead)
