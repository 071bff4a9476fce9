"""The backward's delta kernel in Triton's CPU interpreter against its torch formula:
rowsum(dO * O) in the statistics dtype, minus dlse where lse is finite, over awkward
shapes (rows off the block, D not a power of two), strided dO as projections leave
it, an expanded dlse, and float64."""

from __future__ import annotations

import pytest
import torch

from optional import needs

needs("triton")  # the interpreter is switched on in conftest.py

from mhsa.core.kernels.triton.delta import row_delta


def _formula(grad_out, out, lse, grad_lse):
    acc = lse.dtype
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    if grad_lse is not None:
        delta = delta - torch.where(torch.isfinite(lse), grad_lse.to(acc), 0.0)
    return delta


@pytest.mark.parametrize(
    ("dtype", "stats", "dim", "q_len"),
    [
        (torch.float32, torch.float32, 40, 37),
        (torch.bfloat16, torch.float32, 64, 70),
        (torch.float16, torch.float32, 16, 1),
        (torch.float64, torch.float64, 24, 33),
    ],
)
@pytest.mark.parametrize("dlse", [None, "random", "expanded"])
def test_delta_matches_its_formula(dtype, stats, dim, q_len, dlse):
    generator = torch.Generator().manual_seed(0)
    # every other entry of a wider tensor: strided along D
    out = torch.randn(2, 3, q_len, 2 * dim, generator=generator).to(dtype)[..., ::2]
    # (B, L, H, D) storage, as a projection's gradient arrives
    grad_out = torch.randn(2, q_len, 3, dim, generator=generator).to(dtype).transpose(1, 2)
    lse = torch.randn(2, 3, q_len, generator=generator).to(stats)
    lse[0, 1, 0] = float("-inf")  # a row with no key: its dlse does not count
    lse[1, 2, -1] = float("nan")
    grad_lse = None
    if dlse == "random":  # each row its own
        grad_lse = torch.randn(2, 3, q_len, generator=generator).to(stats)
    if dlse == "expanded":  # as autograd hands it down from lse.sum(): no storage per row
        grad_lse = torch.tensor(0.75, dtype=stats).expand(2, 3, q_len)
    found = row_delta(grad_out, out, lse, grad_lse)
    expected = _formula(grad_out, out, lse, grad_lse)
    assert found.dtype == stats and found.is_contiguous()
    tolerance = 1e-12 if stats == torch.float64 else 1e-5
    assert torch.allclose(found, expected, rtol=tolerance, atol=tolerance)
    if grad_lse is not None:  # the -inf row keeps its rowsum; the others move by dlse
        shift = _formula(grad_out, out, lse, None) - found
        assert abs(shift[0, 1, 0]) < tolerance
        assert abs(shift[0, 0, 0] - grad_lse[0, 0, 0]) < 10 * tolerance


def test_no_rows_give_an_empty_delta():
    out = torch.randn(1, 2, 0, 8)
    lse = torch.empty(1, 2, 0)
    assert row_delta(out, out, lse, None).shape == (1, 2, 0)
