"""Weight-only quantised linears (mhsa.nn.quantized) and GGML block unpacking
(mhsa.formats.ggml_blocks): the integer weights and scales reproduce the file's values
exactly, and the quantised matmuls equal x @ W^T of the dequantised weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from helpers import max_error
from mhsa.formats.ggml_blocks import dequantize_blocks, unpack_q4, unpack_q8_0
from mhsa.nn.quantized import KERNEL_ROWS, Int4Linear, Int8Linear, quantize_linears


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_unpacked_blocks_equal_ggufs_own_dequantisation(kind):
    gguf = pytest.importorskip("gguf")
    weights = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    kind_enum = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(weights, kind_enum)
    want = torch.from_numpy(gguf.quants.dequantize(raw, kind_enum).copy())
    if kind == "Q8_0":
        q, scale = unpack_q8_0(raw)
        got = dequantize_blocks(q, scale)
    else:
        q, scale, zero = unpack_q4(raw, kind)
        assert q.min() >= 0 and q.max() <= 15
        got = dequantize_blocks(q, scale, zero)
    assert got.shape == (6, 96)
    assert max_error(got, want) <= 1e-6 * want.abs().max()


def test_unpacking_refuses_other_formats_and_ragged_rows():
    with pytest.raises(ValueError, match="Q5_K"):
        unpack_q4(np.zeros((2, 20), np.uint8), "Q5_K")
    with pytest.raises(ValueError, match="20-byte blocks"):
        unpack_q4(np.zeros((2, 21), np.uint8), "Q4_1")


@pytest.mark.parametrize("rows", [3, 40], ids=["kernel", "float"])
def test_int4_from_blocks_equals_the_dequantised_matmul(rows):
    """Few rows run torch's int4 kernel (bfloat16 activations: within bfloat16's
    rounding of x); many rows the float32 matmul of the dequantised weight (exact)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 96), generator=generator)
    scale = torch.rand(48, 3, generator=generator) * 0.1 + 0.01
    zero = torch.randn(48, 3, generator=generator) * 0.1
    bias = torch.randn(48, generator=generator)
    layer = Int4Linear.from_blocks(q, scale, zero, bias)
    x = torch.randn(2, rows, 96, generator=generator)
    weight = dequantize_blocks(q, scale, zero)
    assert torch.equal(layer.weight_float(), weight)
    want = x @ weight.T + bias
    got = layer(x)
    assert got.shape == (2, rows, 48) and got.dtype == torch.float32
    if rows > KERNEL_ROWS:
        assert max_error(got, want) < 1e-5 * want.abs().max()
    else:  # bfloat16 activations (and scales): a few 2**-8 relative per term
        bound = 2**-6 * (x.abs() @ weight.abs().T) + 1e-3
        assert (got - want).abs().le(bound).all()


def test_int4_and_int8_from_float_stay_within_half_a_step():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(KERNEL_ROWS + 1, 64)  # the float path: only the weights' rounding
    want = linear(x)
    for make, steps in ((Int4Linear.from_float, 15), (Int8Linear.from_float, 254)):
        layer = make(linear.weight, linear.bias.detach())
        # each weight is within half a step of its group's range; sum over K terms
        step = (linear.weight.max() - linear.weight.min()) / steps
        bound = 0.5 * step * x.abs().sum(dim=-1, keepdim=True)
        assert (layer(x) - want).abs().le(bound + 1e-5).all()
        # the kernel (a few rows, bfloat16 activations) agrees with the float path
        few = x[:3]
        assert (layer(few) - layer(x)[:3]).abs().max() < 2**-6 * (
            few.abs() @ linear.weight.abs().T
        ).max()


def test_quantize_linears_replaces_all_but_the_skipped():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    quantize_linears(model, "int4", skip=("2",))
    assert isinstance(model[0], Int4Linear) and isinstance(model[2], nn.Linear)
    with pytest.raises(ValueError, match="'int8' or 'int4'"):
        quantize_linears(model, "int3")
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear.from_float(torch.randn(16, 33))
    with pytest.raises(ValueError, match="divisible by 16"):
        Int4Linear.from_float(torch.randn(4, 32))
