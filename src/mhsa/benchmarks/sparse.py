"""`mhsa bench sparse`: sparse patterns on the flash engine against SDPA with the dense
mask and against compiled FlexAttention with the same mask as a BlockMask.

Float32 on the CPU by default (device and dtype: any), B=1, H=8, D=64. Times are
best-of-N, interleaved in one run. The memory figures (a fresh process's resident
memory) are the CPU's: on CUDA they are left out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhsa.core import masks
from mhsa.core.attention import attention

from .memory import measure_in_subprocess, pattern_named
from .placement import CPU, Placement
from .timing import Setup, best_times, error_line, timed_setup, versus

GIB = 2**30


def _inputs(length: int, heads: int, grad: bool = False, on: Placement = CPU):
    """q, k, v (1, heads, length, 64), placed by `on`."""
    return [torch.randn(1, heads, length, 64, **on.kwargs).requires_grad_(grad) for _ in range(3)]


def compiled_flex(mask_mod, length: int, score_mod=None, on: Placement = CPU) -> Setup:
    """Compiled flex_attention with mask_mod as a BlockMask (and score_mod) as fn(q, k,
    v); its seconds count building the mask and compiling."""

    def make():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(mask_mod, None, None, length, length, device=on.device)
        compiled = torch.compile(flex_attention)
        compiled(*_inputs(length, 8, on=on), block_mask=block_mask, score_mod=score_mod)
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, score_mod=score_mod)

    return timed_setup(make)


def _flex_backward_reason(flex, length: int, on: Placement = CPU) -> str | None:
    """None if compiled FlexAttention runs a backward here, else its error."""
    q, k, v = _inputs(length, 8, grad=True, on=on)
    try:
        flex(q, k, v).sum().backward()
    except Exception as error:  # e.g. NotImplementedError on CPU
        return error_line(error)
    return None


def window_cases(length: int, repeat: int, on: Placement = CPU) -> dict:
    pattern = masks.SlidingWindow(256, 256)
    q, k, v = _inputs(length, 8, on=on)
    dense = pattern.dense(length, length).to(on.device)

    def window_mod(b, h, q_idx, kv_idx):  # the same window, as FlexAttention's mask_mod
        return (kv_idx - q_idx >= -256) & (kv_idx - q_idx <= 256)

    setup = compiled_flex(window_mod, length, on=on)
    flex = setup.fn
    fns = {
        "flash": lambda: attention(q, k, v, pattern, backend="flash"),
        "sdpa dense mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
    }
    if flex is not None:
        fns["flex"] = lambda: flex(q, k, v)
    forward = best_times(fns, repeat, on.device)
    grads = _inputs(length, 8, grad=True, on=on)

    def flash_step():
        for t in grads:
            t.grad = None
        attention(*grads, pattern, backend="flash").sum().backward()

    backward = {"flash": best_times({"flash": flash_step}, repeat, on.device)["flash"]}
    flex_backward = None if flex is None else _flex_backward_reason(flex, length, on)
    if flex is not None and flex_backward is None:

        def flex_step():
            for t in grads:
                t.grad = None
            flex(*grads).sum().backward()

        backward["flex"] = best_times({"flex": flex_step}, repeat, on.device)["flex"]
    return {
        "pattern": repr(pattern),
        "length": length,
        "forward": forward,
        "forward_backward": backward,
        "flex_setup_seconds": setup.seconds,
        "flex_unavailable": setup.unavailable,
        "flex_backward_unavailable": flex_backward,
    }


def scaling_case(short: int, long: int, repeat: int, on: Placement = CPU) -> dict:
    pattern = masks.SlidingWindow(256, 256)
    times = {}
    for length in (short, long):
        q, k, v = _inputs(length, 8, on=on)

        def forward(q=q, k=k, v=v):
            return attention(q, k, v, pattern, backend="flash")

        times[length] = best_times({"flash": forward}, repeat, on.device)["flash"]
    return {
        "pattern": repr(pattern),
        "seconds": times,
        "ratio": times[long] / times[short],
        "length_ratio": long / short,
    }


def bigbird_case(length: int, repeat: int, on: Placement = CPU) -> dict:
    pattern = masks.bigbird(64)
    q, k, v = _inputs(length, 8, on=on)
    dense = pattern.dense(length, length).to(on.device)
    times = best_times(
        {
            "flash": lambda: attention(q, k, v, pattern, backend="flash"),
            "sdpa dense mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        },
        repeat,
        on.device,
    )
    return {
        "pattern": repr(pattern),
        "length": length,
        "forward": times,
        "allowed_fraction": dense.float().mean().item(),
    }


def dilated_case(length: int, repeat: int, on: Placement = CPU) -> dict:
    """Dilated(64, 4) against a sliding window with as many allowed keys per query (129):
    cost that follows the allowed entries makes the two alike."""
    dilated, window = masks.Dilated(64, 4), masks.SlidingWindow(64, 64)
    q, k, v = _inputs(length, 8, on=on)
    dense = dilated.dense(length, length).to(on.device)
    times = best_times(
        {
            "flash": lambda: attention(q, k, v, dilated, backend="flash"),
            "flash, same-size window": lambda: attention(q, k, v, window, backend="flash"),
            "sdpa dense mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        },
        repeat,
        on.device,
    )
    return {"pattern": repr(dilated), "length": length, "forward": times}


def memory_scaling(lengths: list[int]) -> list[dict]:
    return [measure_in_subprocess("flash", n, heads=8, pattern="window") for n in lengths]


# what the plot compares: (label, backend, causal, pattern name)
CURVES = [
    ("dense (sdpa)", "sdpa", False, None),
    ("causal (flash)", "flash", True, None),
    ("window 256+256 (flash)", "flash", False, "window"),
    ("bigbird 64 (flash)", "flash", False, "bigbird"),
]


def curves(lengths: list[int], repeat: int, on: Placement = CPU) -> list[dict]:
    """Forward time and forward+backward peak memory against L, per curve (memory on the
    CPU only)."""
    rows = []
    for label, backend, causal, name in CURVES:
        pattern = pattern_named(name)
        for length in lengths:
            q, k, v = _inputs(length, 8, on=on)

            def forward(q=q, k=k, v=v, pattern=pattern, causal=causal, backend=backend):
                return attention(q, k, v, pattern, causal=causal, backend=backend)

            seconds = best_times({label: forward}, repeat, on.device)[label]
            memory = (
                measure_in_subprocess(backend, length, 8, causal=causal, pattern=name)
                if on.cpu
                else {}
            )
            rows.append(
                {
                    "curve": label,
                    "length": length,
                    "seconds": seconds,
                    "extra_bytes": memory.get("extra_bytes"),
                }
            )
    return rows


def run(repeat: int = 3, quick: bool = False, on: Placement = CPU) -> dict:
    """Every case, placed by `on` (the memory figures on the CPU only)."""
    torch.manual_seed(0)
    where = {"placement": on.label}
    if quick:  # a small smoke run of every case
        return {
            "window": window_cases(2048, 1, on),
            "scaling": scaling_case(1024, 4096, 1, on),
            "bigbird": bigbird_case(1024, 1, on),
            "dilated": dilated_case(1024, 1, on),
            "memory": memory_scaling([1024, 2048]) if on.cpu else [],
            "curves": curves([512, 1024], 1, on),
            **where,
        }
    return {
        "window": window_cases(16384, repeat, on),
        "scaling": scaling_case(8192, 32768, repeat, on),
        "bigbird": bigbird_case(8192, repeat, on),
        "dilated": dilated_case(16384, repeat, on),
        "memory": memory_scaling([4096, 8192, 16384, 32768]) if on.cpu else [],
        "curves": curves([1024, 2048, 4096, 8192], repeat, on),
        **where,
    }


def report(result: dict) -> str:
    placement = result.get("placement", "CPU float32")
    lines = [f"{placement}, B=1, H=8, D=64; best-of-N seconds, interleaved"]
    window = result["window"]
    fwd = window["forward"]
    lines.append(f"{window['pattern']} at L=S={window['length']}, forward:")
    for name, seconds in fwd.items():
        lines.append(
            f"  {name:<16} {seconds * 1e3:9.1f} ms  {versus('flash', fwd['flash'], seconds)}"
        )
    lines.append(
        f"  targets: >= 8x vs sdpa dense mask: "
        f"{'ok' if fwd['sdpa dense mask'] / fwd['flash'] >= 8 else 'MISSED'}"
    )
    if "flex" in fwd:
        lines.append(
            f"           >= 1.5x vs flex: "
            f"{'ok' if fwd['flex'] / fwd['flash'] >= 1.5 else 'MISSED'} "
            f"(flex mask + compile {window['flex_setup_seconds']:.1f} s, excluded)"
        )
    else:
        lines.append(f"  flex unavailable: {window['flex_unavailable']}")
    back = window["forward_backward"]
    lines.append(f"{window['pattern']} at L=S={window['length']}, forward+backward:")
    lines.append(f"  flash            {back['flash'] * 1e3:9.1f} ms")
    if "flex" in back:
        ratio = back["flex"] / back["flash"]
        lines.append(
            f"  flex             {back['flex'] * 1e3:9.1f} ms  "
            f"{versus('flash', back['flash'], back['flex'])} "
            f"(target >= 1.2x faster: {'ok' if ratio >= 1.2 else 'MISSED'})"
        )
    else:
        lines.append(f"  flex             cannot run it: {window['flex_backward_unavailable']}")
    scaling = result["scaling"]
    (short, t_short), (long, t_long) = scaling["seconds"].items()
    lines.append(
        f"linear scaling, {scaling['pattern']} forward: L={short} {t_short * 1e3:.1f} ms, "
        f"L={long} {t_long * 1e3:.1f} ms, ratio {scaling['ratio']:.2f} for "
        f"{scaling['length_ratio']:.0f}x the length (target <= 4.6: "
        f"{'ok' if scaling['ratio'] <= 4.6 else 'MISSED'})"
    )
    bird = result["bigbird"]
    speedup = bird["forward"]["sdpa dense mask"] / bird["forward"]["flash"]
    lines.append(
        f"{bird['pattern']} at L=S={bird['length']} ({bird['allowed_fraction']:.1%} "
        f"allowed), forward: flash {bird['forward']['flash'] * 1e3:.1f} ms, sdpa dense "
        f"mask {bird['forward']['sdpa dense mask'] * 1e3:.1f} ms: {speedup:.1f}x "
        f"(target >= 4x: {'ok' if speedup >= 4 else 'MISSED'})"
    )
    dilated = result["dilated"]
    times = dilated["forward"]
    lines.append(
        f"{dilated['pattern']} at L=S={dilated['length']}, forward: flash "
        f"{times['flash'] * 1e3:.1f} ms, SlidingWindow(64, 64) (as many keys per "
        f"query) {times['flash, same-size window'] * 1e3:.1f} ms, sdpa dense mask "
        f"{times['sdpa dense mask'] * 1e3:.1f} ms"
    )
    lines.append("window forward+backward peak extra memory (fresh process each):")
    for row in result["memory"]:
        value = row.get("extra_bytes")
        text = f"{value / GIB:.3f} GiB" if value is not None else row.get("error")
        lines.append(f"  L={row['length']:<6} {text}")
    lines.append("curves (forward ms / fwd+bwd peak extra MiB):")
    for row in result["curves"]:
        memory = row["extra_bytes"]
        memory_text = f"{memory / 2**20:8.1f}" if memory is not None else "     n/a"
        lines.append(
            f"  {row['curve']:<24} L={row['length']:<6} {row['seconds'] * 1e3:9.1f} {memory_text}"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Time and memory against L for each curve, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib (or the 'dev' extra)"
        ) from error
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, *_ in CURVES:
        rows = [r for r in result["curves"] if r["curve"] == label]
        lengths = [r["length"] for r in rows]
        ax_time.plot(lengths, [r["seconds"] * 1e3 for r in rows], marker="o", label=label)
        ax_mem.plot(
            lengths, [(r["extra_bytes"] or 0) / 2**20 for r in rows], marker="o", label=label
        )
    for ax, ylabel in ((ax_time, "forward time (ms)"), (ax_mem, "fwd+bwd peak extra (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L = S")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=8)
    placement = result.get("placement", "CPU float32").replace(" ", ", ")
    fig.suptitle(f"mhsa: attention cost against length ({placement}, B=1, H=8, D=64)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
