"""gpu_band's checks on the GPU: the band kernels against the float32 reference at
awkward shapes, and each kernel variant (TMA, scores a block ahead, query blocks from
the last, dQ by atomics, the tile-list forward a tile ahead) against the plain kernels'
bits."""

from __future__ import annotations

import functools

import torch

from mhsa.core.attention import attention
from mhsa.core.masks import SlidingWindow, bigbird

from . import gpu_measure as measure
from .gpu_band_calls import CASES, _backward_call, _band_call, _tiles_forward_call
from .gpu_measure import JsonRows

CHECK_SHAPES = ((torch.bfloat16, 128, (300, 1037)), (torch.float32, 64, (1000, 1000)))


def run_checks(rows: JsonRows, device, shapes=CHECK_SHAPES) -> None:
    """Max errors of out, dq, dk, dv of backend='triton' (the band kernels) against the
    float32 reference, at awkward shapes (dtype, D, (L, S)): L != S, GQA, D=64 and 128."""
    from mhsa.nn.positional import alibi_slopes
    from mhsa.scores import ALiBi, Softcap

    for name, (mask, causal) in {**CASES, "longformer": (SlidingWindow(100, 100), False)}.items():
        for dtype, dim, (q_len, kv_len) in shapes:
            scores = (None, ALiBi(alibi_slopes(8).to(device)), Softcap(30.0))
            for score in scores if name == "causal" else (None,):
                try:
                    torch.manual_seed(0)
                    q = torch.randn(2, 8, q_len, dim, device=device, dtype=dtype)
                    k, v = (
                        torch.randn(2, 2, kv_len, dim, device=device, dtype=dtype) for _ in "kv"
                    )
                    grad = torch.randn_like(q)
                    found = []
                    for backend, cast in (("reference", torch.float32), ("triton", dtype)):
                        inputs = [t.to(cast).requires_grad_() for t in (q, k, v)]
                        out = attention(*inputs, mask, causal=causal, backend=backend, score=score)
                        grads = torch.autograd.grad(out, inputs, grad.to(cast))
                        found.append([t.detach().float() for t in (out, *grads)])
                    errors = [float((a - b).abs().max()) for a, b in zip(*found, strict=True)]
                    rows.add(
                        section="check",
                        case=name,
                        dtype=str(dtype),
                        dim=dim,
                        lengths=[q_len, kv_len],
                        score=repr(score)[:40],
                        max_errors=errors,
                    )
                except Exception as error:
                    rows.add(section="check", case=name, dim=dim, skipped=measure.failure(error))
            _check_variants(rows, name, mask, causal, dtype, dim, q_len, kv_len, device)


def _check_variants(
    rows: JsonRows, name, mask, causal, dtype, dim, q_len, kv_len, device, heads=(2, 8, 2)
):
    """Whether the forward through TMA descriptors, the one with scores a block ahead and
    the one with the query blocks from the last give the plain forward's bits (and the
    dQ kernel with its blocks from the last its gradients'), and how far dQ, dK, dV with
    dQ added by atomics are from the dQ kernel's (the dK/dV launch differs too), on
    (B, L, H, D) storage as projections leave it; with mask None, also the tile-list
    forward with scores a tile ahead on bigbird(64) (L = S). A row per check, or its
    failure. heads: (batch, query heads, KV heads)."""
    batch, num_heads, num_kv_heads = heads
    torch.manual_seed(0)
    q = torch.randn(batch, q_len, num_heads, dim, device=device, dtype=dtype).transpose(1, 2)
    k, v = (
        torch.randn(batch, kv_len, num_kv_heads, dim, device=device, dtype=dtype).transpose(1, 2)
        for _ in "kv"
    )

    def same_bits(plain, found) -> dict:
        return dict(
            same_bits=all(torch.equal(a, b) for a, b in zip(plain, found, strict=True)),
            max_difference=float((plain[0].float() - found[0].float()).abs().max()),
        )

    plain_variants = dict(tma=False, ahead=False, last_first=False)
    plain = functools.cache(_band_call(q, k, v, mask, causal, **plain_variants))

    def band_bits(**changes) -> dict:  # (the plain forward runs once, for all)
        return same_bits(
            plain(), _band_call(q, k, v, mask, causal, **{**plain_variants, **changes})()
        )

    def backward_pair(flag: str) -> list:  # (dq, dk, dv) with flag off, then on
        grads = []
        for on in (False, True):
            torch.manual_seed(1)  # (the same dO)
            variants = {"dq_atomic": False, "last_first": False, flag: on}
            grads.append(_backward_call(q, k, v, mask, causal, None, **variants)())
        return grads

    def atomic_distance() -> dict:
        pairs = zip(*backward_pair("dq_atomic"), strict=True)
        return dict(max_differences=[float((a.float() - b.float()).abs().max()) for a, b in pairs])

    def tiles_bits() -> dict:
        keys = [t[:, :, : min(q_len, kv_len)] for t in (q, k, v)]
        calls = (_tiles_forward_call(keys, bigbird(64, seed=0), None, a) for a in (False, True))
        return same_bits(*(call() for call in calls))

    checks = {
        "check_tma": lambda: band_bits(tma=True),
        "check_ahead": lambda: band_bits(ahead=True),
        "check_tma_ahead": lambda: band_bits(tma=True, ahead=True),
        "check_last_first": lambda: band_bits(last_first=True),
        "check_dq_last_first": lambda: same_bits(*backward_pair("last_first")),
        "check_dq_atomic": atomic_distance,
    }
    if mask is None and not causal:
        checks["check_tiles_ahead"] = tiles_bits
    for section, check in checks.items():
        fields = dict(section=section, case=name, dtype=str(dtype), dim=dim)
        try:
            rows.add(**fields, **check())
        except Exception as error:
            rows.add(**fields, skipped=measure.failure(error))
