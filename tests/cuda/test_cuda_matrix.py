"""Every backend that claims a case, forward and backward, against the float64 reference
of the same inputs: the matrix that says mhsa is right on a GPU.

Marked `cuda`: it runs where a GPU is (skipped elsewhere; CI has none). Each backend is
asked by name; one that cannot serve a case says so ("cannot serve this call") and is
left out of that case, while `auto` must serve every case. The error rule is
FlashAttention's: a backend's error is at most twice that of the reference backend run
in the same dtype, plus a small floor (3x for gradients). A CPU slice runs the same
code on the CPU's backends in float32, so the matrix keeps working between GPU runs.
"""

from __future__ import annotations

import pytest
import torch

import mhsa
from mhsa.core.masks import (
    BlockSparse,
    Dilated,
    Document,
    GlobalTokens,
    Segments,
    SelectedBlocks,
    SlidingWindow,
    bigbird,
    longformer,
)
from mhsa.core.scores import ALiBi, RelativeBias, ScoreMod, Softcap
from mhsa.nn.positional import alibi_slopes

HEADS, Q_LEN, KV_LEN = 4, 200, 257  # lengths that are no block multiple; L != S
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _layout() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.rand(-(-Q_LEN // 32), -(-Q_LEN // 32)) > 0.6


# name -> (num_kv_heads, kv_len, attention options); options may need the device
CASES = {
    "dense": (HEADS, Q_LEN, {}),
    "causal, L != S": (HEADS, KV_LEN, {"causal": True}),
    "GQA causal": (2, Q_LEN, {"causal": True}),
    "MQA": (1, KV_LEN, {}),
    "window": (2, Q_LEN, {"mask": SlidingWindow(48, 0), "causal": True}),
    "dilated": (HEADS, Q_LEN, {"mask": Dilated(6, 3)}),
    "block-sparse": (HEADS, Q_LEN, {"mask": BlockSparse(_layout(), 32)}),
    "longformer": (HEADS, Q_LEN, {"mask": longformer(16, [0, 7])}),
    "bigbird": (HEADS, Q_LEN, {"mask": bigbird(32, seed=1)}),
    "varlen segments": (2, Q_LEN, {"mask": Segments(torch.tensor([0, 60, 61, 200]))}),
    # patterns built from tensors on the call's device (transformers' packed ids)
    "documents on the device": (HEADS, Q_LEN, {"mask": "documents"}),
    "global tokens on the device": (HEADS, Q_LEN, {"mask": "global tokens"}),
    "selected blocks per head": (HEADS, Q_LEN, {"mask": "selected"}),
    "ALiBi": (HEADS, KV_LEN, {"causal": True, "score": "alibi"}),
    "T5 bias": (HEADS, Q_LEN, {"score": "t5"}),
    "softcap": (HEADS, Q_LEN, {"causal": True, "score": Softcap(20.0)}),
    "custom score": (HEADS, Q_LEN, {"score": "custom"}),
    "sinks": (2, Q_LEN, {"causal": True, "sinks": "sinks"}),
}
BACKENDS = ["reference", "sdpa", "flash", "flex", "triton"]


def _options(options: dict, device: torch.device) -> dict:
    """The case's options, with the tensors it needs made on device."""
    options = dict(options)
    if options.get("score") == "alibi":
        options["score"] = ALiBi(alibi_slopes(HEADS).to(device))
    elif options.get("score") == "t5":
        torch.manual_seed(4)
        options["score"] = RelativeBias(torch.randn(32, HEADS, device=device) * 0.5)
    elif options.get("score") == "custom":
        options["score"] = ScoreMod(lambda s, b, h, i, j: s - 0.01 * (i - j).abs())
    if options.get("mask") == "documents":
        options["mask"] = Document(torch.arange(Q_LEN, device=device) // 70)
    elif options.get("mask") == "global tokens":
        options["mask"] = GlobalTokens(torch.tensor([0, 99], device=device))
    elif options.get("mask") == "selected":
        blocks = -(-Q_LEN // 32)
        torch.manual_seed(6)
        options["mask"] = SelectedBlocks(torch.rand(2, HEADS, blocks, blocks) < 0.4, 32)
    if options.get("sinks") == "sinks":
        torch.manual_seed(5)
        options["sinks"] = torch.randn(HEADS, device=device)
    return options


def _inputs(num_kv_heads: int, kv_len: int, head_dim: int, device) -> list[torch.Tensor]:
    torch.manual_seed(0)
    q = torch.randn(2, HEADS, Q_LEN, head_dim, device=device)
    k = torch.randn(2, num_kv_heads, kv_len, head_dim, device=device)
    v = torch.randn(2, num_kv_heads, kv_len, head_dim, device=device)
    return [q, k, v]


def _run(inputs, dtype, backend: str, options: dict):
    """(out, lse, grads of q, k, v) of one call in dtype, as float64."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out, lse = mhsa.attention(*leaves, backend=backend, return_lse=True, **options)
    torch.manual_seed(1)
    out.backward(torch.randn_like(out))
    return [out.detach().double(), lse.detach().double()] + [t.grad.double() for t in leaves]


def _errors(got, want) -> list[float]:
    return [float((g - w).abs().nan_to_num().max()) for g, w in zip(got, want, strict=True)]


def check_case(
    case: str, head_dim: int, dtype: torch.dtype, device, backends=(*BACKENDS, "auto")
) -> list[str]:
    """Every backend that serves the case against the float64 reference; returns the
    backends that served it (auto among them)."""
    num_kv_heads, kv_len, options = CASES[case]
    options = _options(options, torch.device(device))
    inputs = _inputs(num_kv_heads, kv_len, head_dim, device)
    want = _run(inputs, torch.float64, "reference", options)
    naive = _errors(_run(inputs, dtype, "reference", options), want)
    # a floor no BLAS's summation order crosses (float32 differs between Intel's and
    # AMD's kernels by a few ulps, and the reference in float32 may be the lucky one)
    floor = max(2 * torch.finfo(dtype).eps, 1e-5)
    served = []
    for backend in backends:
        try:
            got = _run(inputs, dtype, backend, options)
        except ValueError as error:
            assert backend != "auto" and "cannot serve this call" in str(error), error
            continue
        errors = _errors(got, want)
        for name, error, base, factor in zip(
            ("out", "lse", "dq", "dk", "dv"), errors, naive, (2, 2, 3, 3, 3), strict=True
        ):
            assert error <= factor * base + floor * max(1.0, float(want[0].abs().max())), (
                f"{backend} {case} D={head_dim} {dtype}: {name} error {error:.3g}, "
                f"the reference in this dtype {base:.3g}"
            )
        served.append(backend)
    return served


def check_paged(device, dtype: torch.dtype) -> None:
    """Decoding over a shuffled page table equals causal attention over each sequence's
    own keys (forward: pages are read, never trained through)."""
    torch.manual_seed(0)
    lengths, block = [1, 17, 40, 113], 16
    pool_blocks = sum(-(-n // block) for n in lengths) + 2
    k_pool = torch.randn(pool_blocks, block, 2, 64, device=device, dtype=dtype)
    v_pool = torch.randn(pool_blocks, block, 2, 64, device=device, dtype=dtype)
    order = torch.randperm(pool_blocks).tolist()
    table = torch.full((len(lengths), 9), -1, dtype=torch.long)
    for n, length in enumerate(lengths):
        count = -(-length // block)
        table[n, :count] = torch.tensor(order[:count])
        order = order[count:]
    table = table.to(device)
    q = torch.randn(len(lengths), HEADS, 1, 64, device=device, dtype=dtype)
    seq_lens = torch.tensor(lengths, device=device)
    out = mhsa.attention(q, k_pool, v_pool, causal=True, block_table=table, seq_lens=seq_lens)
    for n, length in enumerate(lengths):
        rows = table[n, : -(-length // block)]
        k = k_pool[rows].flatten(0, 1)[:length].permute(1, 0, 2).unsqueeze(0).float()
        v = v_pool[rows].flatten(0, 1)[:length].permute(1, 0, 2).unsqueeze(0).float()
        want = mhsa.attention(q[n : n + 1].float(), k, v, causal=True, backend="reference")
        naive = mhsa.attention(q[n : n + 1], k.to(dtype), v.to(dtype), causal=True)
        error, base = (
            (out[n : n + 1].float() - want).abs().max(),
            (naive.float() - want).abs().max(),
        )
        assert error <= 2 * base + 2 * torch.finfo(dtype).eps, (n, float(error), float(base))


def check_dropout(device) -> None:
    """Every backend that takes dropout: finite, and the same under the same seed."""
    q, k, v = _inputs(2, Q_LEN, 64, device)
    for backend in [*BACKENDS, "auto"]:
        runs = []
        for _ in range(2):
            torch.manual_seed(7)
            try:
                runs.append(mhsa.attention(q, k, v, causal=True, dropout_p=0.2, backend=backend))
            except ValueError as error:
                assert backend != "auto" and "cannot serve this call" in str(error), error
                break
        if runs:
            assert torch.isfinite(runs[0]).all() and torch.equal(runs[0], runs[1]), backend


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_backends_equal_the_float64_reference(case, head_dim, dtype):
    served = check_case(case, head_dim, DTYPES[dtype], "cuda")
    assert "auto" in served and len(served) >= 3, served  # reference, auto and one more


@pytest.mark.cuda
def test_cuda_paged_and_dropout():
    check_paged("cuda", torch.bfloat16)
    check_dropout("cuda")


@pytest.mark.parametrize(
    "case",
    ["causal, L != S", "bigbird", "varlen segments", "sinks", "documents on the device"]
    + ["global tokens on the device", "selected blocks per head"],
)
def test_the_matrix_runs_on_the_cpu_backends(case):
    """The same check on the CPU in float32 (triton's interpreter, slow, is tested in
    tests/core/kernels)."""
    served = check_case(case, 64, torch.float32, "cpu", ("reference", "sdpa", "flash", "auto"))
    assert {"reference", "flash", "auto"} <= set(served), served


def test_the_paged_and_dropout_checks_run_on_the_cpu():
    check_paged("cpu", torch.float32)
    check_dropout("cpu")
