"""`mhsa bench moba`: MoBA (block choice per head, the flash engine's block plan) against
dense causal attention on the same engine, forward+backward.

Float32 on the CPU by default (device and dtype: any), B=1, D=64; times are best-of-N,
interleaved in one run; peak memory (on the CPU only) is each side's extra resident
memory in a fresh process (benchmarks.memory).
"""

from __future__ import annotations

import torch

from mhsa.core.attention import attention
from mhsa.core.moba import moba_attention, moba_select

from .memory import measure_in_subprocess
from .placement import CPU, Placement
from .timing import best_times

MIB = 2**20


def computed_fraction(chosen: torch.Tensor, length: int, block_size: int) -> float:
    """The share of causal attention's (query, key) pairs that MoBA computes, from its
    choice (B, H, n, n): the own blocks' triangles and the chosen blocks."""
    blocks = torch.full((chosen.shape[-1],), block_size)
    blocks[-1] = length - block_size * (chosen.shape[-1] - 1)
    own = (blocks * (blocks + 1) // 2).sum()
    chosen_pairs = (chosen * (blocks.view(-1, 1) * blocks.view(1, -1))).sum(dim=(-1, -2))
    causal = length * (length + 1) // 2
    return float(((own + chosen_pairs).double() / causal).mean())


def run(
    length: int | None = None,
    block_size: int | None = None,
    top_k: int = 3,
    heads: int | None = None,
    head_dim: int = 64,
    repeat: int = 1,
    quick: bool = False,
    memory: bool = True,
    on: Placement = CPU,
) -> dict:
    """Times and peak memory of MoBA and dense causal attention (both backend="flash"),
    placed by `on` (memory on the CPU only). length, block_size and heads not given:
    32768, 4096 and 4, or 1024, 128 and 2 when quick."""
    sizes = (1024, 128, 2) if quick else (32768, 4096, 4)
    given = (length, block_size, heads)
    pairs = zip(given, sizes, strict=True)
    length, block_size, heads = (size if g is None else g for g, size in pairs)
    shape = (1, heads, length, head_dim)
    q, k, v = (torch.randn(shape, **on.kwargs).requires_grad_() for _ in range(3))

    def moba() -> None:
        moba_attention(q, k, v, block_size, top_k, backend="flash").sum().backward()

    def causal() -> None:
        attention(q, k, v, causal=True, backend="flash").sum().backward()

    seconds = best_times({"moba": moba, "dense causal": causal}, repeat, on.device)
    result = {
        "length": length,
        "block_size": block_size,
        "top_k": top_k,
        "heads": heads,
        "head_dim": head_dim,
        "repeat": repeat,
        "seconds": seconds,
        "computed_fraction": computed_fraction(
            moba_select(q, k, block_size, top_k).cpu(), length, block_size
        ),
        "threads": torch.get_num_threads(),
        "placement": str(on),
    }
    if memory and on.cpu:
        rows = {
            "moba": measure_in_subprocess(
                "flash", length, heads, head_dim, moba=(block_size, top_k)
            ),
            "dense causal": measure_in_subprocess("flash", length, heads, head_dim, causal=True),
        }
        result["extra_bytes"] = {name: row.get("extra_bytes") for name, row in rows.items()}
        result["memory_errors"] = {
            name: row["error"] for name, row in rows.items() if "error" in row
        }
    return result


def report(result: dict) -> str:
    seconds = result["seconds"]
    lines = [
        f"MoBA against dense causal attention, both on the flash engine: B=1, "
        f"H={result['heads']}, D={result['head_dim']}, L=S={result['length']}, blocks of "
        f"{result['block_size']}, top-{result['top_k']}, "
        f"{result.get('placement', 'cpu, float32')}, forward+backward, best of "
        f"{result['repeat']}, {result['threads']} threads",
        f"MoBA computes {result['computed_fraction']:.1%} of causal attention's pairs",
        f"{'':>13} {'time (s)':>9} {'peak extra MiB':>15}",
    ]
    extra = result.get("extra_bytes", {})
    for name, value in seconds.items():
        memory = extra.get(name)
        shown = f"{memory / MIB:15.0f}" if memory else f"{'-':>15}"
        lines.append(f"{name:>13} {value:9.2f} {shown}")
    moba, dense = seconds["moba"], seconds["dense causal"]
    lines.append(f"MoBA is {dense / moba:.2f}x the speed of dense causal")
    if extra.get("moba") and extra.get("dense causal"):
        lines.append(
            f"memory ratio MoBA / dense causal: {extra['moba'] / extra['dense causal']:.2f}"
        )
    for name, error in result.get("memory_errors", {}).items():
        lines.append(f"memory of {name} not measured: {error}")
    return "\n".join(lines)
