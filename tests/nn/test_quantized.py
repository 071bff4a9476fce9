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
from mhsa.nn.quantized import Int4Linear, Int8Linear, quantize_linears


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


@pytest.mark.parametrize("rows", [3, 40])
def test_int4_from_blocks_equals_the_dequantised_matmul(rows):
    """torch's int4 kernel, whatever the rows: bfloat16 activations, so within
    bfloat16's rounding of x."""
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
    bound = 2**-6 * (x.abs() @ weight.abs().T) + 1e-3  # a few 2**-8 relative per term
    assert (got - want).abs().le(bound).all()


def test_int4_and_int8_from_float_stay_within_half_a_step():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(17, 64)
    want = linear(x)
    for make, steps in ((Int4Linear.from_float, 15), (Int8Linear.from_float, 254)):
        layer = make(linear.weight, linear.bias.detach())
        # each weight is within half a step of its group's range; sum over K terms, plus
        # bfloat16's rounding of the activations
        step = (linear.weight.max() - linear.weight.min()) / steps
        bound = 0.5 * step * x.abs().sum(dim=-1, keepdim=True)
        bound = bound + 2**-7 * (x.abs() @ linear.weight.abs().T)
        assert (layer(x) - want).abs().le(bound + 1e-5).all()


@pytest.mark.parametrize("make", [Int4Linear.from_float, Int8Linear.from_float])
def test_each_rows_result_is_independent_of_the_other_rows(make):
    """A row's output is bitwise the same alone or among any number of rows (a prompt
    token gives the same numbers whether a prefix was cached or not)."""
    torch.manual_seed(0)
    layer = make(torch.randn(64, 96))
    x = torch.randn(70, 96)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
    for rows in (2, 3, 5, 16, 17, 33, 70):
        assert torch.equal(layer(x[:rows]), alone[:rows])


def test_quantize_linears_replaces_all_but_the_skipped():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    quantize_linears(model, "int4", skip=("2",))
    assert isinstance(model[0], Int4Linear) and isinstance(model[2], nn.Linear)
    with pytest.raises(ValueError, match="'int8' or 'int4'"):
        quantize_linears(model, "int3")
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear.from_float(torch.randn(16, 33))
    assert Int4Linear.from_float(torch.randn(4, 32))(torch.randn(3, 32)).shape == (3, 4)


@pytest.mark.parametrize(("out_features", "in_features"), [(50, 32), (64, 24), (7, 8)])
@pytest.mark.parametrize("make", [Int4Linear.from_float, Int8Linear.from_float])
def test_shapes_off_the_kernels_multiples_of_16_equal_the_dequantised_matmul(
    make, out_features, in_features
):
    """torch's int8 kernel reads K in 16s and read past the end otherwise (nan, 9e13,
    or a segfault); its int4 format takes N in 16s (a 32001-token head was refused)."""
    if make == Int4Linear.from_float and in_features % 32:
        return  # (int4 groups are 32 wide)
    torch.manual_seed(0)
    layer = make(torch.randn(out_features, in_features))
    int4 = isinstance(layer, Int4Linear)
    weight = layer.weight_float() if int4 else layer.q * layer.scale_bf16.unsqueeze(1)
    for rows in (1, 2, 3, 17):
        x = torch.randn(rows, in_features)
        want = x.bfloat16().double() @ weight.double().T
        bound = 2**-6 * (x.abs().double() @ weight.abs().double().T) + 1e-3
        assert (layer(x).double() - want).abs().le(bound).all(), rows
    alone = torch.cat([layer(x[i : i + 1]) for i in range(17)])
    assert torch.equal(layer(x), alone)
    other = make(torch.randn(out_features, in_features))
    other.load_state_dict(layer.state_dict())  # every buffer the kernel reads follows
    assert torch.equal(other(x), layer(x))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantised_bfloat16_model_takes_bfloat16_activations(mode):
    """The quantised projections name the dtype of the weights they replaced, fused or
    not, and follow model.to(dtype) as those would."""
    from mhsa.nn import MultiHeadAttention
    from mhsa.nn.layout import fuse_linears

    torch.manual_seed(0)
    module = MultiHeadAttention(64, 4).to(torch.bfloat16).eval()
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    expected = module(x)
    quantize_linears(module, mode)
    assert module.q_proj.input_dtype == torch.bfloat16
    out = module(x)
    assert out.dtype == torch.bfloat16 and max_error(out, expected) < 0.1
    fused = fuse_linears([module.q_proj, module.k_proj])
    assert fused.input_dtype == torch.bfloat16
    assert module.float().q_proj.input_dtype == torch.float32
    assert max_error(module(x.float()), expected) < 0.1
    with pytest.raises(TypeError, match="floating point dtype"):
        Int8Linear(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2), dtype=torch.int32)
