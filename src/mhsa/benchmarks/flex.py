"""`mhsa bench flex`: mhsa.flex.flex_attention against torch's flex_attention on the
CPU, in one run, with the same BlockMask and score_mod:
- forward+backward against torch's flex_attention run eagerly (torch has no CPU
  backward, pytorch#148752: its error is reported instead of a time);
- forward alone against torch.compile(flex_attention) (compile time excluded, and
  reported) and against torch's eager forward.

Float32, B=1; best-of-N seconds, interleaved (mhsa.benchmarks.timing).
"""

from __future__ import annotations

import warnings

import torch

from mhsa.core.attention import attention
from mhsa.core.masks import SlidingWindow
from mhsa.core.scores import ScoreMod
from mhsa.flex import create_block_mask, flex_attention

from .placement import CPU, Placement
from .timing import Setup, best_times, error_line, timed_setup, versus

CASES = ("causal", "causal + relative bias table", "sliding window of 256")
WINDOW = 256
NATIVE = "mhsa.attention"  # the same call through mhsa's own API, for the Flex layer's cost


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def _mask_mod(case: str):
    return _window if case.startswith("sliding window") else _causal


def _score_mod(case: str, heads: int, length: int, on: Placement = CPU):
    """None, or a tensor-indexed score_mod (a learned (H, 2L - 1) table of relative
    biases, as a FlexAttention user writes one) and its table, placed by `on`."""
    if case != "causal + relative bias table":
        return None, None
    table = (0.1 * torch.randn(heads, 2 * length - 1)).to(**on.kwargs).requires_grad_()

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx - q_idx + length - 1]

    return relative_bias, table


def _torch_api():
    from torch.nn.attention import flex_attention

    return flex_attention


def _torch_flex():
    return _torch_api().flex_attention


def _compiled(score_mod, block_mask, q, k, v) -> Setup:
    """torch.compile(flex_attention) as fn(q, k, v), compiled on a first call."""
    torch._dynamo.reset()  # each score_mod on a fresh dynamo state (see benchmarks.scores)

    def make():
        compiled = torch.compile(_torch_flex())
        with torch.no_grad():
            compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
        return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    return timed_setup(make)


def _torch_backward(score_mod, block_mask, q, k, v) -> str | None:
    """None if torch's eager flex_attention runs a backward here, else its error."""
    try:
        _torch_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask).sum().backward()
    except Exception as error:  # NotImplementedError on CPU
        return error_line(error)
    return None


def run_case(
    case: str, length: int, heads: int, head_dim: int, repeat: int, on: Placement = CPU
) -> dict:
    """Seconds of each implementation on one case, the compile time, what could not
    run, and the largest output difference against mhsa's, placed by `on`."""
    device = on.device
    score_mod, table = _score_mod(case, heads, length, on)
    block_mask = create_block_mask(_mask_mod(case), None, None, length, length, device)
    shape = (1, heads, length, head_dim)
    q, k, v = (torch.randn(shape, **on.kwargs).requires_grad_() for _ in range(3))
    params = [q, k, v] + ([table] if table is not None else [])

    # the same call through mhsa's own API (L = S: Flex's indices are its positions)
    score = None if score_mod is None else ScoreMod(score_mod)
    window = SlidingWindow(WINDOW, 0) if _mask_mod(case) is _window else None

    def native(q, k, v):
        return attention(q, k, v, window, causal=window is None, score=score)

    def step(fn):
        def run() -> None:
            for t in params:
                t.grad = None
            fn().sum().backward()

        return run

    backward = best_times(
        {
            "mhsa": step(lambda: flex_attention(q, k, v, score_mod, block_mask)),
            NATIVE: step(lambda: native(q, k, v)),
        },
        repeat,
        device,
    )
    torch_backward = _torch_backward(score_mod, block_mask, q, k, v)
    if torch_backward is None:

        def torch_step() -> None:
            for t in params:
                t.grad = None
            _torch_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask).sum().backward()

        torch_time = best_times({"torch eager": torch_step}, repeat, device)
        backward["torch eager"] = torch_time["torch eager"]
    inputs = [t.detach() for t in (q, k, v)]
    setup = _compiled(score_mod, block_mask, *inputs)
    compiled = setup.fn
    forward_fns = {
        "mhsa": lambda: flex_attention(*inputs, score_mod, block_mask),
        NATIVE: lambda: native(*inputs),
        "torch eager": lambda: _torch_flex()(*inputs, score_mod=score_mod, block_mask=block_mask),
    }
    if compiled is not None:
        forward_fns["torch compiled"] = lambda: compiled(*inputs)
    with torch.no_grad():
        forward = best_times(forward_fns, repeat, device)
        ours = forward_fns["mhsa"]()
        difference = {
            name: (fn() - ours).float().abs().max().item()
            for name, fn in forward_fns.items()
            if name != "mhsa"
        }
    mask_args = (_mask_mod(case), None, None, length, length, device)
    masks = best_times(
        {
            "mhsa": lambda: create_block_mask(*mask_args),
            "torch eager": lambda: _torch_api().create_block_mask(*mask_args),
        },
        repeat,
        device,
    )
    return {
        "case": case,
        "create_block_mask": masks,
        "shape": f"B=1 H={heads} L=S={length} D={head_dim}",
        "forward_backward": backward,
        "torch_backward_unavailable": torch_backward,
        "forward": forward,
        "compile_seconds": setup.seconds,
        "compiled_unavailable": setup.unavailable,
        "max_difference": difference,
    }


def run(
    length: int | None = None,
    heads: int = 8,
    head_dim: int = 64,
    repeat: int | None = None,
    quick: bool = False,
    on: Placement = CPU,
) -> dict:
    """Every case at L = S = length, best of repeat, placed by `on`; not given: 2048
    and 3, or 256 and 1 when quick."""
    torch.manual_seed(0)
    length = length or (256 if quick else 2048)
    repeat = repeat or (1 if quick else 3)
    with warnings.catch_warnings():  # torch warns that its eager flex_attention is slow
        warnings.simplefilter("ignore")
        cases = [run_case(case, length, heads, head_dim, repeat, on) for case in CASES]
    return {"cases": cases, "placement": on.label}


def report(result: dict) -> str:
    lines = [
        "mhsa.flex.flex_attention vs torch's flex_attention, "
        f"{result.get('placement', 'CPU float32')}, the same "
        "BlockMask (128-blocks) and score_mod; best-of-N, interleaved; "
        f"{NATIVE}: the same call through mhsa's own API"
    ]
    for row in result["cases"]:
        lines.append(f"{row['case']} ({row['shape']}):")
        for label, times in (
            ("forward+backward", row["forward_backward"]),
            ("forward", row["forward"]),
        ):
            lines.append(f"  {label:<17} mhsa.flex      {times['mhsa'] * 1e3:9.1f} ms")
            for name in (NATIVE, "torch compiled", "torch eager"):
                if name not in times:
                    continue
                text = f"  {'':<17} {name:<14} {times[name] * 1e3:9.1f} ms  "
                text += versus("mhsa", times["mhsa"], times[name])
                if label == "forward" and name in row["max_difference"]:
                    text += f" (max |difference| {row['max_difference'][name]:.1e})"
                lines.append(text)
            if label == "forward+backward" and "torch eager" not in times:
                lines.append(
                    f"  {'':<17} torch          cannot: {row['torch_backward_unavailable']}"
                )
        masks = row["create_block_mask"]
        lines.append(
            f"  create_block_mask mhsa.flex      {masks['mhsa'] * 1e3:9.1f} ms\n"
            f"  {'':<17} torch          {masks['torch eager'] * 1e3:9.1f} ms  "
            + versus("mhsa", masks["mhsa"], masks["torch eager"])
        )
        if row["compile_seconds"] is not None:
            lines.append(f"  (torch.compile took {row['compile_seconds']:.1f} s, excluded)")
        else:
            lines.append(f"  torch compiled unavailable: {row['compiled_unavailable']}")
    return "\n".join(lines)
