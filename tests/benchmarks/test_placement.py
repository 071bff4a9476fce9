"""Placement: where a bench suite runs, and the words its reports use for it."""

from __future__ import annotations

import torch

from mhsa.benchmarks.placement import CPU, Placement


def test_the_default_is_the_cpu_in_float32_and_a_name_becomes_a_device():
    assert CPU == Placement(torch.device("cpu"), torch.float32) == Placement("cpu")
    assert CPU.cpu and CPU.kwargs == {"device": torch.device("cpu"), "dtype": torch.float32}
    assert torch.randn(2, **CPU.kwargs).dtype == torch.float32


def test_the_words_for_a_placement():
    assert (str(CPU), CPU.label, CPU.dtype_name) == ("cpu, float32", "CPU float32", "float32")
    gpu = Placement("cuda:0", torch.bfloat16)  # (no GPU needed: nothing is placed there)
    assert not gpu.cpu and gpu != CPU
    assert (str(gpu), gpu.label) == ("cuda:0, bfloat16", "cuda:0 bfloat16")
