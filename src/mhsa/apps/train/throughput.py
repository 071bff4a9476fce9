"""What a training run needs to use its device and to say how well it uses it: batches
moved there, autocast's context, and model flops utilisation (MFU).

MFU is counted as nanoGPT counts it: a token costs 6 N flops for the forward and
backward matmuls of the N parameters that multiply activations, plus 12 x layers x
width x context for attention's two matmuls (forward and backward); tokens/s times that,
over the rate of a large matmul in the training dtype measured on the same device at
the start of the run (a GPU's or CPU's real rate, not its data sheet's).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "MatmulRate",
    "StepClock",
    "autocast",
    "flops_per_token",
    "matmul_params",
    "measure_matmul",
    "to_device",
]


def to_device(value, device: torch.device | str):
    """value with every tensor in it (nested in tuples, lists and dicts) on device; the
    same objects where they are there already."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(item, device) for item in value)
    return value


def autocast(device: torch.device | str, dtype: torch.dtype | str):
    """torch.autocast to dtype on device, or a context that does nothing for float32."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def matmul_params(model: nn.Module) -> int:
    """nanoGPT's N: the parameters that multiply activations, i.e. all but embedding
    lookups (nn.Embedding), except a token embedding that is also the output head (a
    model whose lm_head is None reads its embedding_name's weight there: GPT's tok_emb,
    BERT's MLM head, the Seq2Seq output)."""
    total = sum(p.numel() for p in model.parameters())
    lookups = sum(
        p.numel()
        for module in model.modules()
        if isinstance(module, nn.Embedding)
        for p in module.parameters(recurse=False)
    )
    name = getattr(model, "embedding_name", None)
    tied = getattr(model, name, None) if name and getattr(model, "lm_head", 0) is None else None
    head = tied.weight.numel() if isinstance(tied, nn.Embedding) else 0
    return total - lookups + head


def _shape(config) -> tuple[int, int]:
    """(layers, width) of a model config, whatever its fields are called (encoder and
    decoder layers added)."""
    layers = sum(
        getattr(config, name, 0) or 0
        for name in ("n_layer", "num_layers", "n_encoder_layer", "n_decoder_layer")
    )
    width = next((getattr(config, n) for n in ("d_model", "hidden_size") if hasattr(config, n)), 0)
    return layers, width


def flops_per_token(model: nn.Module, context: int) -> float:
    """Training flops per token, nanoGPT's count: 6 N (matmul_params) + 12 x layers x
    width x context (attention's scores and values, forward and backward, each query
    against the whole context as nanoGPT counts it, causal or not)."""
    layers, width = _shape(getattr(model, "config", None))
    return 6 * matmul_params(model) + 12 * layers * width * context


@dataclass(frozen=True)
class MatmulRate:
    """A matmul's measured rate on a device in a dtype: MFU's yardstick. processes: the
    data-parallel ranks that share the work, each with a device of this rate."""

    flops_per_second: float
    device: str
    dtype: str
    size: int
    processes: int = 1

    def describe(self) -> str:
        """In words: the bfloat16 matmul measured at start, 612.3 TFLOP/s on cuda:0
        (and ", times 2 processes" under data parallel)."""
        rate = self.flops_per_second
        text = f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
        group = f", times {self.processes} processes" if self.processes > 1 else ""
        return f"the {self.dtype} matmul measured at start, {text} on {self.device}{group}"

    def mfu(self, tokens_per_second: float, flops_per_token: float) -> float:
        """The share of every process's rate that the group's tokens_per_second x
        flops_per_token is."""
        return tokens_per_second * flops_per_token / (self.flops_per_second * self.processes)


class StepClock:
    """The training rate of a run: tokens over the time spent in training steps, leaving
    out evaluations, checkpoints and the run's first step (torch.compile compiles there
    and the allocator and GPU clocks warm up) once a second step is done. start(now)
    before each step, stop(tokens, now) after it, with the caller's clock readings."""

    def __init__(self) -> None:
        self.started = 0.0
        self.tokens, self.seconds = 0, 0.0
        self.first: tuple[int, float] | None = None  # (tokens, seconds) of the first step

    def start(self, now: float) -> None:
        self.started = now

    def stop(self, tokens: int, now: float) -> None:
        self.tokens += tokens
        self.seconds += now - self.started
        if self.first is None:
            self.first = (self.tokens, self.seconds)

    def tokens_per_second(self) -> float:
        """Tokens/s of the steps after the first; the first's own before there are any."""
        tokens, seconds = self.tokens, self.seconds
        if self.first is not None and tokens > self.first[0]:
            tokens, seconds = tokens - self.first[0], seconds - self.first[1]
        return tokens / max(seconds, 1e-9)


def measure_matmul(
    device: torch.device | str,
    dtype: torch.dtype | str = torch.float32,
    size: int | None = None,
    repeat: int = 5,
) -> MatmulRate:
    """The best of repeat (size x size) @ (size x size) matmuls on device in dtype, after
    a warm-up; size defaults to 8192 on CUDA (where smaller ones leave the GPU idle part
    of the time) and 1024 on the CPU (a tenth of a second or so). Measured once per
    process for each device, dtype and size (later runs in the process reuse it)."""
    device = torch.device(device)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    size = size or (8192 if device.type == "cuda" else 1024)
    return _measure(device, dtype, size, repeat)


@functools.lru_cache(maxsize=8)
def _measure(device: torch.device, dtype: torch.dtype, size: int, repeat: int) -> MatmulRate:
    generator = torch.Generator(device=device).manual_seed(0)  # the run's RNG untouched
    a, b = (
        torch.randn(size, size, device=device, dtype=dtype, generator=generator) for _ in range(2)
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):  # warm-up (a GPU's clocks rise)
        a @ b
    sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    name = str(dtype).removeprefix("torch.")
    return MatmulRate(2 * size**3 / max(best, 1e-9), str(device), name, size)
