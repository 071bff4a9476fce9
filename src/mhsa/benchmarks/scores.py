"""`mhsa bench scores`: score functions inside the flash engine against the same call
without one (causal, B=1, H=8, D=64, float32, forward + backward), and forward only
against compiled FlexAttention with the same score_mod, in one run.

Time: best of `repeat`, interleaved. Memory: peak extra resident memory of one
forward + backward in a fresh process (mhsa.benchmarks.memory), against the same call
without a score function and against ALiBi given as the dense (H, L, S) bias it was
before score functions (estimated: H * L * S * 4 bytes, twice with its gradient).
On another device or dtype (run's `on`) the timings run there; the memory
figures are the CPU's and are left out.
"""

from __future__ import annotations

import torch

from .memory import measure_in_subprocess, score_named
from .placement import CPU, Placement
from .sparse import compiled_flex
from .timing import best_times, versus

HEADS, HEAD_DIM = 8, 64
SCORES = (None, "alibi", "softcap")


def _step(q, k, v, score):
    from mhsa.core.attention import attention

    def run() -> None:
        out = attention(q, k, v, causal=True, backend="flash", score=score)
        torch.autograd.grad(out.sum(), (q, k, v))

    return run


def _flex_score_mods(heads: int, device: torch.device | str = "cpu") -> dict:
    """FlexAttention score_mods written as a FlexAttention user would, equal to ours."""
    from mhsa.nn.positional import alibi_slopes

    slopes, cap = alibi_slopes(heads).to(device), score_named("softcap", heads).cap

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return {"alibi": alibi, "softcap": softcap}


def flex_forward(length: int, repeat: int, on: Placement = CPU) -> dict:
    """Forward-only seconds of the flash engine and compiled FlexAttention (causal
    BlockMask) for each score function, and the largest difference of their outputs."""
    from mhsa.core.attention import attention

    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, **on.kwargs) for _ in range(3))
    result: dict = {"seconds": {}, "max_difference": {}, "setup_seconds": {}}
    for name, score_mod in _flex_score_mods(HEADS, on.device).items():
        # a second score_mod compiled in the same process can fail to lower (torch
        # 2.13, CPU: "unbacked_bindings"); each is measured on a fresh dynamo state
        torch._dynamo.reset()
        flex, setup, unavailable = compiled_flex(
            lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, length, score_mod, on
        )
        if flex is None:
            return {"unavailable": unavailable}
        score = _score(name, on)
        fns = {
            f"flash {name}": lambda s=score: attention(
                q, k, v, causal=True, score=s, backend="flash"
            ),
            f"flex {name}": lambda f=flex: f(q, k, v),
        }
        result["seconds"].update(best_times(fns, repeat, on.device))
        difference = (fns[f"flash {name}"]() - fns[f"flex {name}"]()).float().abs().max().item()
        result["max_difference"][name], result["setup_seconds"][name] = difference, setup
    return result


def run(
    length: int = 4096,
    repeat: int = 3,
    memory: bool = True,
    flex: bool = True,
    on: Placement = CPU,
) -> dict:
    """The timings, placed by `on`; the memory figures on the CPU only."""
    torch.manual_seed(0)
    shape = (1, HEADS, length, HEAD_DIM)
    q, k, v = (torch.randn(shape, **on.kwargs).requires_grad_() for _ in range(3))
    fns = {str(name): _step(q, k, v, _score(name, on)) for name in SCORES}
    seconds = best_times(fns, repeat, on.device)
    result = {"length": length, "heads": HEADS, "head_dim": HEAD_DIM, "seconds": seconds}
    if on != CPU:
        result["placement"] = f"{on.device} {on.dtype_name}"
    if memory and on.cpu:
        result["extra_bytes"] = {
            str(name): measure_in_subprocess(
                "flash", length, HEADS, HEAD_DIM, causal=True, score=name
            ).get("extra_bytes")
            for name in (None, "alibi")
        }
    result["dense_bias_bytes"] = HEADS * length * length * 4
    if flex:
        result["flex_forward"] = flex_forward(length, repeat, on)
    return result


def _score(name: str | None, on: Placement):
    """score_named's score function with its tensors (ALiBi's slopes) on on.device."""
    score = score_named(name, HEADS)
    if name == "alibi" and not on.cpu:
        from mhsa.core.scores import ALiBi

        score = ALiBi(score.slopes.to(on.device))
    return score


def report(result: dict) -> str:
    seconds, base = result["seconds"], result["seconds"]["None"]
    lines = [
        f"score functions in the flash engine: causal, B=1, H={result['heads']}, "
        f"D={result['head_dim']}, L=S={result['length']}, "
        f"{result.get('placement', 'float32')}, forward+backward",
        f"{'score':>10} {'time (s)':>9} {'vs none':>8}",
    ]
    for name, value in seconds.items():
        lines.append(f"{name:>10} {value:9.3f} {value / base:7.2f}x")
    extra = result.get("extra_bytes")
    if extra and extra.get("None"):
        none, alibi = extra["None"] / 2**20, extra["alibi"] / 2**20
        dense = result["dense_bias_bytes"] / 2**20
        lines.append(
            f"peak extra memory: none {none:.0f} MiB, alibi {alibi:.0f} MiB "
            f"({alibi / none:.2f}x); a dense ALiBi bias is {dense:.0f} MiB"
        )
    flex = result.get("flex_forward")
    if flex and "unavailable" in flex:
        lines.append(f"compiled FlexAttention unavailable: {flex['unavailable']}")
    elif flex:
        lines.append(
            "forward only, against compiled FlexAttention (causal BlockMask, the "
            "same score_mod; compile time excluded):"
        )
        for name, difference in flex["max_difference"].items():
            ours, theirs = flex["seconds"][f"flash {name}"], flex["seconds"][f"flex {name}"]
            lines.append(
                f"{name:>10} flash {ours:7.3f} s  flex {theirs:7.3f} s  "
                f"{versus('flash', ours, theirs)} (outputs within {difference:.1e})"
            )
    return "\n".join(lines)
