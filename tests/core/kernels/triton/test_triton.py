"""The triton backend's kernels, run in Triton's CPU interpreter, against the float64
reference: forward, lse, gradients (q, k, v, bias), patterns, dropout, GQA, dtypes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from optional import needs

needs("triton")  # the interpreter is switched on in conftest.py

import mhsa
from helpers import (
    assert_2x_3x_rule,
    assert_matches_reference,
    make_qkv,
    max_error,
    reference_with_grads,
)
from mhsa.core.backends import AttentionSpec, registry
from mhsa.core.backends.reference import attention_probs
from mhsa.core.backends.triton import TritonBackend
from mhsa.core.kernels.dense import apply_dropout, probs_times_v
from mhsa.core.kernels.dropout import keep_mask
from mhsa.core.kernels.triton import (
    build_tiles,
    interpreting,
    triton_attention,
    triton_attention_weights,
    triton_keep_mask,
)
from mhsa.core.masks import BoolMask, KeyPadding, SelectedBlocks, SlidingWindow, bigbird

assert interpreting(), "conftest.py sets TRITON_INTERPRET=1 before triton is imported"


PER_HEAD = SelectedBlocks(
    torch.rand(2, 2, 3, 3, generator=torch.Generator().manual_seed(0)) > 0.4, 16
)
# an (H, L, S) mask as a pattern: its tiles broadcast from the right, the first dim is H
PER_HEAD_3D = BoolMask(torch.rand(2, 48, 48, generator=torch.Generator().manual_seed(1)) > 0.4)

CASES = {
    # name: (H, H_kv, L, S, D, D_v, mask, causal, bias shape, (BLOCK_M, BLOCK_N) or None)
    "causal-LneS-gqa": (4, 2, 37, 53, 48, 48, None, True, None, None),
    "causal-LgtS-mqa-dead-rows": (2, 1, 45, 29, 16, 16, None, True, None, (16, 32)),
    "bool-mask-dead-row": (2, 2, 33, 40, 64, 64, "dense", False, None, None),
    "single-query-key-padding": (2, 1, 1, 50, 16, 16, "padding", True, None, None),
    "bias-grad-causal": (2, 1, 21, 37, 16, 16, None, True, (1, 2, 21, 37), None),
    "bias-broadcast-mask-dv": (2, 2, 30, 30, 32, 16, "dense", False, (30, 1), None),
    "sliding-window": (2, 2, 50, 50, 16, 16, SlidingWindow(7, 2), False, None, (32, 16)),
    "bigbird-causal": (2, 1, 80, 80, 16, 16, bigbird(16, 3, 1, 1), True, None, None),
    "key-padding-pattern": (2, 2, 20, 40, 16, 16, KeyPadding([40, 17]), False, None, None),
    "head-dim-256": (1, 1, 5, 7, 256, 256, None, True, None, None),
    # a selection per sequence and head: the tiles would differ by head (a dense mask)
    "per-head-selected-blocks": (2, 1, 48, 48, 16, 16, PER_HEAD, False, None, (16, 16)),
    "per-head-bool-mask-3d": (2, 1, 48, 48, 16, 16, PER_HEAD_3D, True, None, (16, 16)),
    # L and S multiples of the tiles: no bounds check in the kernels (EVEN)
    "aligned-bool-mask-dead-row": (2, 1, 64, 48, 16, 16, "dense", False, None, None),
}


def make_case(name: str, dtype=torch.float32):
    heads, kv_heads, q_len, kv_len, dim, vdim, mask, causal, bias_shape, blocks = CASES[name]
    q, k, v = make_qkv(
        2,
        heads,
        kv_heads,
        q_len,
        kv_len,
        dim,
        vdim,
        dtype=dtype,
        noncontiguous=name == "causal-LneS-gqa",
        requires_grad=True,
    )
    if mask == "dense":
        mask = torch.rand(2, heads, q_len, kv_len) > 0.4
        mask[:, :, 3] = False  # a fully masked row
        mask[:, :, :, 16:32] = False  # whole empty tiles
    elif mask == "padding":
        mask = torch.ones(2, 1, 1, kv_len, dtype=torch.bool)
        mask[0, ..., 20:] = False
    bias = None
    if bias_shape is not None:
        bias = torch.randn(bias_shape, dtype=dtype).requires_grad_()
    return q, k, v, mask, bias, causal, blocks


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case):
    q, k, v, mask, bias, causal, blocks = make_case(case)
    out, lse = triton_attention(q, k, v, mask, bias=bias, causal=causal, blocks=blocks)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, mask, bias, causal, grad_out)
    assert out.dtype == torch.float32
    assert_matches_reference(out, lse, (q, k, v, bias), ref_out, ref_lse, ref_grads)


@pytest.mark.parametrize("case", list(CASES))
def test_scores_a_tile_ahead_give_the_plain_forwards_bits(case):
    """The tile-list forward with each tile's scores issued before the previous tile's
    softmax (ahead; off by default until a GPU run times it) does the same arithmetic in
    the same order: the same out and lse to the bit, with biases, masks, dead rows and
    score functions, sinks and dropout."""
    from mhsa.core.kernels.triton.function import LaunchCall, _prepare, launch_forward
    from mhsa.core.scores import ALiBi, Compose, Softcap
    from mhsa.nn.positional import alibi_slopes

    q, k, v, mask, bias, causal, blocks = (
        t.detach() if isinstance(t, torch.Tensor) else t for t in make_case(case)
    )
    heads = q.shape[1]
    score = Compose(ALiBi(alibi_slopes(heads)), Softcap(20.0)) if bias is None else None
    sinks = torch.randn(heads) if bias is None else None
    tiles, scale, kernel, slopes, table = _prepare(q, k, v, mask, bias, causal, None, blocks, score)
    dropout = (0.2, 11) if case == "sliding-window" else None
    call = LaunchCall(q, k, v, bias, tiles, scale, dropout, kernel, (slopes, table, sinks))
    plain, ahead = (launch_forward(call, ahead=a) for a in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(plain, ahead, strict=True))


def test_tiles_follow_the_block_plan():
    """Empty tiles are not listed; full tiles carry no mask; partial tiles of a pattern
    get a compact mask buffer (one (BLOCK_M, BLOCK_N) slice each)."""
    shape = (2, 2, 64, 64)
    causal = build_tiles(None, True, shape, "cpu", (16, 16, 4, 1))
    assert causal.row_ptr.tolist() == [0, 1, 3, 6, 10]  # lower triangle of 4 x 4 blocks
    assert causal.row_kind.tolist() == [1, 2, 1, 2, 2, 1, 2, 2, 2, 1]
    assert causal.col_ptr.tolist() == [0, 4, 7, 9, 10]
    window = build_tiles(SlidingWindow(4, 0), False, shape, "cpu", (16, 16, 4, 1))
    assert window.tiles.shape == (1, int((window.row_kind == 1).sum()), 16, 16)
    padding = build_tiles(KeyPadding([64, 20]), False, shape, "cpu", (16, 16, 4, 1))
    assert padding.tiles.shape[0] == 2  # a per-sequence pattern: one buffer per batch
    # cached for equal patterns and for no mask; rebuilt for tensors, other shapes/blocks
    assert build_tiles(SlidingWindow(4, 0), False, shape, "cpu", (16, 16, 4, 1)) is window
    assert build_tiles(None, True, shape, "cpu", (16, 16, 4, 1)) is causal
    assert build_tiles(None, True, shape, "cpu", (32, 16, 4, 1)) is not causal
    dense = torch.ones(64, 64, dtype=torch.bool)
    assert build_tiles(dense, False, shape, "cpu", (16, 16, 4, 1)) is not build_tiles(
        dense, False, shape, "cpu", (16, 16, 4, 1)
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_by_the_2x_3x_rule(dtype):
    q, k, v, _, _, _, _ = make_case("causal-LneS-gqa", dtype)
    out, lse = triton_attention(q, k, v, causal=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, _, ref_grads = reference_with_grads(q, k, v, None, None, True, grad_out)
    assert_2x_3x_rule(q, k, v, out, grad_out, ref_out, ref_grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_of_the_tile_lists_come_in_the_inputs_dtype(dtype):
    """The tile-list kernels (blocks= names their tiles) store dQ, dK and dV in the
    inputs' dtype, rounded once from their float32 sums: the 2x/3x rule on causal with
    L != S and grouped-query heads, on (B, L, H, D) storage."""
    q, k, v, _, _, _, _ = make_case("causal-LneS-gqa", dtype)
    out, _ = triton_attention(q, k, v, causal=True, blocks=(16, 16))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert all(t.grad.dtype == dtype for t in (q, k, v))
    ref_out, _, ref_grads = reference_with_grads(q, k, v, None, None, True, grad_out)
    assert_2x_3x_rule(q, k, v, out, grad_out, ref_out, ref_grads)


@pytest.mark.parametrize("seed", [1, 2**31 - 2])
@pytest.mark.parametrize("p", [0.1, 0.75])
def test_dropout_mask_equals_cpu_keep_mask(seed, p):
    got = triton_keep_mask(seed, 2, 3, 37, 45, p, "cpu")
    want = keep_mask(seed, 2, 3, 0, 37, torch.arange(45), p)
    assert torch.equal(got, want)


def test_dropout_with_pattern_matches_reference_given_the_same_mask():
    q, k, v = make_qkv(2, 4, 2, 40, 40, 16, requires_grad=True)
    mask, p, seed = SlidingWindow(12, 3), 0.3, 1234
    out, _ = triton_attention(q, k, v, mask, causal=True, dropout_p=p, seed=seed)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    probs, _ = attention_probs(q64, k64, mask=mask, bias=None, causal=True, scale=0.25)
    ref = probs_times_v(apply_dropout(probs, p, seed), v64)
    ref.backward(grad_out.double())
    assert max_error(out, ref) < 2e-5
    for got, want in ((q, q64), (k, k64), (v, v64)):
        assert max_error(got.grad, want.grad) < 1e-4
    other, _ = triton_attention(q, k, v, mask, causal=True, dropout_p=p, seed=seed + 1)
    assert max_error(other, out) > 1e-3  # another seed drops other entries


def test_dropout_through_the_backend_uses_torch_seed():
    q, k, v = make_qkv(1, 2, 1, 20, 24, 16)
    torch.manual_seed(7)
    out, _ = TritonBackend().forward(
        q, k, v, mask=None, bias=None, causal=True, scale=0.25, dropout_p=0.2, return_lse=False
    )
    torch.manual_seed(7)
    ref = mhsa.attention(
        q.double(), k.double(), v.double(), causal=True, dropout_p=0.2, backend="reference"
    )
    assert max_error(out, ref) < 2e-5


def test_fully_masked_rows_give_zero_and_zero_gradients():
    q, k, v = make_qkv(1, 2, 2, 20, 24, 16, requires_grad=True)
    mask = torch.ones(1, 2, 20, 24, dtype=torch.bool)
    mask[:, 0, 5] = mask[:, 1, 17] = False
    bias = torch.randn(2, 20, 24, requires_grad=True)
    out, lse = triton_attention(q, k, v, mask, bias=bias)
    out.sum().backward()
    assert (out[:, 0, 5] == 0).all() and (out[:, 1, 17] == 0).all()
    assert torch.isneginf(lse[:, 0, 5]).all() and torch.isneginf(lse[:, 1, 17]).all()
    for grad in (q.grad, k.grad, v.grad, bias.grad):
        assert torch.isfinite(grad).all()
    assert (q.grad[:, 0, 5] == 0).all() and (bias.grad[0, 5] == 0).all()


def test_transformers_finfo_min_padding_gives_the_reference():
    """A padding bias of finfo.min (transformers' float masks) over a whole first key
    block: times log2(e) it overflowed to -inf, and the row's max made nan of every
    left-padded row that sees real keys; an all-padding row averages v, as reference."""
    q, k, v = make_qkv(2, 2, 2, 4, 200, 16, requires_grad=True)
    bias = torch.zeros(2, 1, 1, 200)
    bias[0, ..., :150] = torch.finfo(torch.float32).min
    bias[1, ..., :] = torch.finfo(torch.float32).min  # (no real key at all)
    out = triton_attention(q, k, v, bias=bias)[0]
    want = mhsa.attention(q, k, v, bias=bias, backend="reference")
    assert torch.isfinite(out).all() and max_error(out, want) < 1e-5
    grads = torch.autograd.grad(out[0].sum(), (q, k, v), retain_graph=True)  # (row 0: real keys)
    wants = torch.autograd.grad(want[0].sum(), (q, k, v))
    for got, expected in zip(grads, wants, strict=True):
        assert max_error(got, expected) < 1e-5
    # an all-padding row's gradients are finite (its lse loses the count at -1e38: they
    # are not the reference's, docs/attention.md)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_lse_gradient_flows():
    q, k, v = make_qkv(1, 2, 1, 20, 24, 16, requires_grad=True)
    out, lse = triton_attention(q, k, v, causal=True)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    ((out * grad_out).sum() + (lse * grad_lse).sum()).backward()
    t64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = mhsa.attention(*t64, causal=True, backend="reference", return_lse=True)
    ((ref * grad_out.double()).sum() + (ref_lse * grad_lse.double()).sum()).backward()
    for got, want in zip((q, k, v), t64, strict=True):
        assert max_error(got.grad, want.grad) < 1e-4


def test_attention_weights_from_lse():
    q, k, v = make_qkv(2, 4, 2, 30, 37, 16)
    mask = torch.rand(2, 1, 30, 37) > 0.3
    mask[..., 4, :] = False
    bias = torch.randn(4, 30, 37)
    _, lse = triton_attention(q, k, v, mask, bias=bias, causal=True)
    probs = triton_attention_weights(q, k, mask, bias=bias, causal=True, lse=lse)
    want = mhsa.attention_weights(
        q.double(), k.double(), mask, bias=bias.double(), causal=True, backend="reference"
    )
    assert probs.shape == (2, 4, 30, 37) and max_error(probs, want) < 1e-6
    pattern = triton_attention_weights(q, k, SlidingWindow(5, 0))  # lse from its own forward
    want = mhsa.attention_weights(q.double(), k.double(), SlidingWindow(5, 0).dense(30, 37))
    assert max_error(pattern, want) < 1e-6


def test_mhsa_attention_weights_with_the_triton_backend():
    q, k, _ = make_qkv(2, 4, 2, 30, 37, 16)
    mask = torch.rand(2, 1, 30, 37) > 0.3
    for pattern in (mask, SlidingWindow(5, 2)):
        options = {"causal": True, "heads": [1, 3], "rows": [0, 7, 29]}
        got = mhsa.attention_weights(q, k, pattern, backend="triton", **options)
        want = mhsa.attention_weights(
            q.double(), k.double(), pattern, backend="reference", **options
        )
        assert got.shape == (2, 2, 3, 37) and max_error(got, want) < 1e-6


def test_gradcheck_float64():
    """float64 runs (statistics in float64) only under the interpreter: for gradcheck."""
    q, k, v = make_qkv(1, 2, 1, 5, 6, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 2, 5, 6) > 0.3
    mask[:, :, 1] = False
    bias = torch.randn(1, 1, 5, 6, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias):
        out, lse = triton_attention(q, k, v, mask, bias=bias, causal=True, dropout_p=0.3, seed=5)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), fast_mode=True)


def test_backend_dispatch(monkeypatch):
    backend = TritonBackend()
    assert backend.available() is None
    spec = AttentionSpec.example(q_len=2048, kv_len=2048, has_mask=True)
    assert backend.supports(spec) is None
    assert "float64" in backend.supports(AttentionSpec.example(dtype=torch.float64))
    assert "256" in backend.supports(AttentionSpec.example(head_dim=320, value_dim=320))
    monkeypatch.setitem(registry._BACKENDS, "triton", backend)
    assert registry.select(spec, "auto").name != "triton"  # never auto on CPU
    assert registry.select(spec, "triton") is backend
    q, k, v = make_qkv(1, 2, 1, 9, 11, 16)
    out = mhsa.attention(q, k, v, SlidingWindow(3, 0), backend="triton")
    want = mhsa.attention(
        q.double(), k.double(), v.double(), SlidingWindow(3, 0), backend="reference"
    )
    assert max_error(out, want) < 2e-5


def test_bad_input_says_what_to_do():
    q, k, v = make_qkv(1, 2, 1, 4, 4, 16)
    with pytest.raises(ValueError, match="head dims up to 256"):
        triton_attention(*make_qkv(1, 1, 1, 4, 4, 320))
    with pytest.raises(ValueError, match="does not broadcast"):
        triton_attention(q, k, v, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be bool"):
        triton_attention(q, k, v, torch.ones(4, 4))


COMPILE_FOR_GPU = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mhsa.core.kernels.triton import attention
from mhsa.core.kernels.triton.function import block_sizes

POINTERS = {"Mask": "*u8", "Tiles": "*u8", "row_ptr": "*i32", "col_ptr": "*i32",
            "blk_idx": "*i32", "blk_kind": "*i32", "blk_tile": "*i32", "Buckets": "*i32"}
STATS = {"Lse", "Delta", "DQ", "DK", "DV", "DBias", "P", "DSlope", "DTable"}
for dtype, torch_dtype, dim, mask_mode in (("bf16", torch.bfloat16, 128, 1),
                                          ("fp32", torch.float32, 64, 2)):
    block_m, block_n, warps, stages = block_sizes(dim, dim, torch_dtype)
    # every score path: ALiBi before the softcap, RelativeBias after it, sinks, gradients
    constants = dict(HAS_BIAS=True, BIAS_GRAD=True, MASK_MODE=mask_mode, CAUSAL=True,
                     EVEN=dtype == "bf16",
                     DROPOUT=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=dim, BLOCK_DV=dim,
                     PREC="ieee" if dtype == "fp32" else None, UPCAST=False, ACC=tl.float32,
                     ALIBI=1, RELATIVE=2, SOFTCAP=2 if dtype == "bf16" else 1,
                     HAS_SINKS=True, SLOPE_GRAD=True,
                     TABLE_GRAD=True, BLOCK_NB=32, AHEAD=dtype == "bf16")
    for kernel in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkv", "_attn_probs"):
        fn = getattr(attention, kernel)
        consts = {k: v for k, v in constants.items() if k in fn.arg_names}
        signature = {}
        for name in fn.arg_names:
            if name in consts:
                signature[name] = "constexpr"
            elif name in POINTERS:
                signature[name] = POINTERS[name]
            elif name in STATS:
                signature[name] = "*fp32"
            elif name[0].isupper():
                signature[name] = "*" + dtype
            else:
                signature[name] = "fp32" if name in ("scale", "keep_scale", "cap") else "i32"
        source = ASTSource(fn=fn, signature=signature, constexprs=consts)
        triton.compile(source, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_a_gpu():
    """Compile forward, backward and probability kernels to sm_90 code (ptxas ships with
    triton; no GPU needed): catches what the interpreter accepts but the compiler does not."""
    needs("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_GPU],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert "compiled" in result.stdout, result.stderr[-3000:]


def test_launch_config_override():
    q, k, v, _, _, _, _ = make_case("causal-LneS-gqa", torch.float32)
    default, _ = triton_attention(q, k, v, causal=True)
    tuned, _ = triton_attention(q, k, v, causal=True, blocks=(32, 16, 4, 1))
    # other tiles sum in another order: a few float32 ulps apart (1.01e-6 on an AMD EPYC)
    assert max_error(tuned, default) < 1e-5
    for bad in [(16,), (24, 16), (16, 16, 0, 1), (16, 16, 4)]:
        with pytest.raises(ValueError, match="blocks must be"):
            triton_attention(q, k, v, causal=True, blocks=bad)
