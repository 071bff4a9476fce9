"""The band kernels on a GPU: correctness against the float32 reference, a sweep of
their launch configurations, and the peers (SDPA, compiled FlexAttention) in the same
run. Its output chose band_launch.CONFIGS.

    python -m mhsa.benchmarks.gpu_band --out DIR [--quick]

Writes DIR/band.jsonl, one JSON row per line as it goes (a run cut short keeps what
it measured). Shapes: B=4, H=16, D=128 (and D=64), bf16, L = S = 8192 by default.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from mhsa.core.attention import attention
from mhsa.core.masks import SlidingWindow, bigbird

from . import gpu_measure as measure
from .gpu_band_calls import (
    CASES,
    _backward_call,
    _band_call,
    _inputs,
    _tiles_call,
    _tiles_forward_call,
)
from .gpu_band_checks import run_checks
from .gpu_measure import JsonRows
from .timing import matmul_gflops

# the run of 2026-12-04 swept (128|64, 32|64|128, 4|8, 2|3|4); (128, 64, 8, 3) led at
# D=128 (causal 59.5% of the matmul, dense 64%), (128, 64, 4, 3) at D=64; its
# neighbours here
FORWARD = [
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 64, 8, 2),
    (128, 32, 8, 3),
    (128, 64, 8, 5),
    (64, 64, 4, 3),
    (128, 64, 4, 3),
]
TMA_FORWARD = FORWARD[:3]
# the forward's scores a block ahead (band_launch.FORWARD_AHEAD), at the D=128 configs
# of TMA_FORWARD; (128, 64, 8, 2)'s 96 KiB of shared memory would let two programs
# share an SM
AHEAD_FORWARD = TMA_FORWARD
DQ = [
    (128, 32, 4, 3),
    (128, 32, 8, 3),
    (128, 64, 8, 2),
    (64, 64, 4, 3),
    (128, 64, 4, 3),
    (64, 32, 4, 3),
]
DKV = [
    (32, 128, 4, 3),
    (32, 128, 8, 3),
    (64, 128, 8, 2),
    (64, 64, 4, 3),
    (32, 64, 4, 3),
    (64, 128, 4, 3),
]
# the dK/dV kernel adding dQ with atomics (band_launch.DQ_IN_DKV): the default first;
# (32, 128, 8, 3) is the one without register spills at sm_90
DKV_DQ = [(64, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 1), (32, 128, 8, 3), (64, 64, 8, 2)]
# sweep_backward's rows by name: the plain kernels at their defaults, the same with
# the dQ kernel's query blocks from the last, and the dK/dV kernel adding dQ (+ config)
BACKWARD_DEFAULTS = "dq and dkv, defaults"
BACKWARD_LAST_FIRST = f"{BACKWARD_DEFAULTS}, last first"
ATOMIC_DQ = "dkv+dq"
# the tile-list kernels' (function._LAUNCH) default at D=128 first, untimed when chosen;
# (128, 64, 8, *) runs half the instructions per score at sm_90 (tools/triton_compile.py)
TILES = [(64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3)]
# gpu_hf's Llama: B=1, 16 query heads over 4 KV heads, L=4096, D=128 (its 512 window
# made the training step's attention slower than full causal on 2026-12-04)
HF_SHAPE, HF_KV_HEADS = (1, 16, 4096, 128), 4


def run_sweep_forward(rows: JsonRows, device, length: int, peak: float, repeat: int, dims) -> None:
    """Every forward config on dense and causal at each head dim, the first three with
    keys and values read through TMA descriptors, AHEAD_FORWARD's with the scores a block
    ahead (each variant alone, whatever band_launch's switches say), and the first with
    both, with its query blocks from the last, and with both of those (_forward_calls)."""
    for dim in dims:
        qkv = _inputs((4, 16, length, dim), 16, torch.bfloat16, device)
        for name in ("causal", "dense"):
            mask, causal = CASES[name]
            allowed = measure.allowed_entries(mask, causal, length, device)
            fns = _forward_calls(qkv, mask, causal)
            timed = measure.time_group(fns, repeat, device, 0.02, ())
            flop = measure.flops(allowed, qkv[0].shape, backward=False)
            fields = dict(case=name, dim=dim, length=length)
            _add_configs(rows, timed, flop, peak, "sweep_forward", **fields)
        del qkv
        measure.release()


def _forward_calls(qkv, mask, causal) -> dict:
    """run_sweep_forward's calls by name: every FORWARD config with the plain kernel
    (whatever band_launch's switches say), then its variants, each alone unless named
    together."""
    plain = dict(tma=False, ahead=False, last_first=False)
    fns = {str(c): _band_call(*qkv, mask, causal, c, **plain) for c in FORWARD}

    def variant(config, **changes):
        return _band_call(*qkv, mask, causal, config, **{**plain, **changes})

    # keys and values through TMA descriptors (band_launch.USE_TMA), best configs
    fns.update({f"{c} tma": variant(c, tma=True) for c in TMA_FORWARD})
    # each block's scores issued before the previous block's softmax (FORWARD_AHEAD)
    fns.update({f"{c} ahead": variant(c, ahead=True) for c in AHEAD_FORWARD})
    best = FORWARD[0]  # two at once; the query blocks from the last (LAST_FIRST)
    fns[f"{best} tma ahead"] = variant(best, tma=True, ahead=True)
    fns[f"{best} last first"] = variant(best, last_first=True)
    fns[f"{best} ahead, last first"] = variant(best, ahead=True, last_first=True)
    return fns


def _add_configs(rows: JsonRows, timed: dict, flop: float, peak: float, section: str, **fields):
    """One row per launch config timed (time_group's rows by config), with its share of
    the matmul for flop floating-point operations."""
    for config, row in timed.items():
        share = flop / (row["ms"] * 1e-3) / peak if "ms" in row else None
        rows.add(section=section, **fields, config=config, of_matmul=share, **row)


def run_sweep_tiles(
    rows: JsonRows, device, length: int, peak: float, repeat: int, shape=None, configs=TILES
) -> None:
    """The tile-list kernels (what serves bigbird, varlen segments and other patterns)
    under each launch config of configs, forward (also with the scores a tile ahead)
    and forward+backward, on bigbird(64) and three packed sequences (Segments) (B=4,
    H=16, L=length, D=128, bf16 unless shape)."""
    from mhsa.core.masks import Segments

    shape = shape or (4, 16, length, 128)
    length = shape[2]
    qkv = _inputs(shape, shape[1], torch.bfloat16, device, grad=True)
    grad = torch.randn_like(qkv[0])
    starts = torch.tensor([0, length // 2, length * 3 // 4, length])
    cases = {"bigbird(64)": bigbird(64, seed=0), "segments": Segments(starts)}
    for name, mask in cases.items():
        allowed = measure.allowed_entries(mask, False, length, device)
        for backward in (False, True):
            if backward:
                fns = {str(c): _tiles_call(qkv, grad, mask, c, True) for c in configs}
            else:  # both through one prepared call (the scores a tile ahead: TILES_AHEAD)
                fns = {str(c): _tiles_forward_call(qkv, mask, c, False) for c in configs}
                fns.update({f"{c} ahead": _tiles_forward_call(qkv, mask, c, True) for c in configs})
            timed = measure.time_group(fns, repeat, device, 0.02, ())
            flop = measure.flops(allowed, shape, backward)
            fields = dict(case=name, backward=backward, length=length)
            _add_configs(rows, timed, flop, peak, "sweep_tiles", **fields)
    del qkv, grad
    measure.release()


def run_sweep_backward(rows: JsonRows, device, length: int, peak: float, repeat: int) -> None:
    """dq and dkv configs on causal, D=128 (the other kernel at its default), both at
    their defaults, and the dK/dV kernel adding dQ by atomics (DKV_DQ configs); the
    share of the matmul counts the backward's 2.5 forwards."""
    qkv = _inputs((4, 16, length, 128), 16, torch.bfloat16, device)
    mask, causal = CASES["causal"]
    allowed = measure.allowed_entries(mask, causal, length, device)
    flop = measure.flops(allowed, qkv[0].shape, backward=False) * measure.BACKWARD_FLOPS
    split = dict(dq_atomic=False, last_first=False)  # (whatever band_launch's switches say)
    fns = {f"dq {c}": _backward_call(*qkv, mask, causal, (c, None), **split) for c in DQ}
    fns.update({f"dkv {c}": _backward_call(*qkv, mask, causal, (None, c), **split) for c in DKV})
    # both kernels at their defaults, against dQ added by the dK/dV kernel's atomics
    fns[BACKWARD_DEFAULTS] = _backward_call(*qkv, mask, causal, None, **split)
    # the dQ kernel's query blocks from the last (band_launch.LAST_FIRST)
    fns[BACKWARD_LAST_FIRST] = _backward_call(
        *qkv, mask, causal, None, **dict(split, last_first=True)
    )
    for c in DKV_DQ:
        fns[f"{ATOMIC_DQ} {c}"] = _backward_call(*qkv, mask, causal, (None, c), dq_atomic=True)
    timed = measure.time_group(fns, repeat, device, 0.02, ())
    _add_configs(rows, timed, flop, peak, "sweep_backward", case="causal", dim=128, length=length)


def run_peers(rows: JsonRows, device, lengths, peak: float, repeat: int, cases=CASES) -> None:
    """sdpa, flex (compiled) and triton through mhsa.attention, forward and
    forward+backward, per case and length, with auto's pick."""
    for length in lengths:
        for name, (mask, causal) in cases.items():
            if name != "window" and length > 8192:
                continue
            qkv = _inputs((4, 16, length, 128), 16, torch.bfloat16, device, grad=True)
            grad = torch.randn_like(qkv[0])
            allowed = measure.allowed_entries(mask, causal, length, device)
            for backward in (False, True):
                fns = {}
                for backend in ("auto", "sdpa", "flex", "triton"):
                    fns[backend] = (
                        measure.train_call(backend, qkv, grad, mask, causal, None, False)
                        if backward
                        else measure.forward_call(backend, qkv, mask, causal, None, False)
                    )
                timed = measure.time_group(fns, repeat, device, 0.02)
                flop = measure.flops(allowed, qkv[0].shape, backward)
                for backend, row in timed.items():
                    share = flop / (row["ms"] * 1e-3) / peak if "ms" in row else None
                    rows.add(
                        section="peers",
                        case=name,
                        length=length,
                        backward=backward,
                        backend=backend,
                        of_matmul=share,
                        **row,
                    )
            del qkv, grad
            measure.release()


def run_hf_shape(rows: JsonRows, device, repeat: int, shape=HF_SHAPE, kv_heads=HF_KV_HEADS) -> None:
    """At gpu_hf's shape: the band kernels forward and backward at their defaults on
    causal and on a 512 window, the backward also with dK/dV per KV head (per query head
    is the default here) and with dQ added by atomics, beside SDPA's causal
    forward+backward; then the window's split backward under every dq and dK/dV config
    (two groups: the first one's rows are written even if the sweep runs out of time),
    so that one run tells which kernel the window loses time in."""
    qkv = _inputs(shape, kv_heads, torch.bfloat16, device)
    cases = {"causal": (None, True), "window 512": (SlidingWindow(512, 0), True)}
    headline = {}
    for name, (mask, causal) in cases.items():
        headline[f"{name} band forward"] = _band_call(*qkv, mask, causal)
        headline[f"{name} band backward"] = _backward_call(*qkv, mask, causal, None)
        # dK/dV with one program per KV head (4 here) against the default, per query head
        headline[f"{name} band backward, dkv per KV head"] = _backward_call(
            *qkv, mask, causal, None, per_head=False, dq_atomic=False
        )
        headline[f"{name} band backward, dq by atomics"] = _backward_call(
            *qkv, mask, causal, None, dq_atomic=True
        )
        # 32 query blocks a head here: the tail, which launching the last first shortens
        headline[f"{name} band forward, last first"] = _band_call(
            *qkv, mask, causal, last_first=True
        )
        headline[f"{name} band backward, last first"] = _backward_call(
            *qkv, mask, causal, None, dq_atomic=False, last_first=True
        )
    trained = [t.detach().requires_grad_() for t in qkv]
    grad = torch.randn_like(qkv[0])
    headline["causal sdpa forward+backward"] = measure.train_call(
        "sdpa", trained, grad, None, True, None, False
    )
    window = cases["window 512"]
    split = dict(dq_atomic=False)
    sweep = {
        f"window 512 backward, dq {c}": _backward_call(*qkv, *window, (c, None), **split)
        for c in DQ
    }
    for c in DKV:
        sweep[f"window 512 backward, dkv {c}"] = _backward_call(*qkv, *window, (None, c), **split)
    for fns in (headline, sweep):
        for what, row in measure.time_group(fns, repeat, device, 0.02, ()).items():
            rows.add(section="hf_shape", what=what, shape=list(shape), **row)
    del qkv, trained, grad
    measure.release()


def run_scores(rows: JsonRows, device, peak: float, repeat: int, shape=(4, 16, 4096, 128)) -> None:
    """The band kernels on causal (B, H, L, D = shape, bf16) with no score function,
    ALiBi, and Softcap(30) with tanh from exp and with the hardware's tanh.approx,
    forward and backward, the plain kernels and (", ahead": the forward's scores a block
    ahead; ", dq by atomics": the backward's) their variants: what each score function
    costs over plain causal in the same kernels (vs_plain)."""
    from mhsa.core.kernels.triton.scores import KernelScore
    from mhsa.nn.positional import alibi_slopes

    qkv = _inputs(shape, shape[1], torch.bfloat16, device)
    slopes = alibi_slopes(shape[1]).to(device)
    scores = {
        "none": (KernelScore(), None),
        "alibi": (KernelScore(alibi=1), slopes),
        "softcap(30), tanh from exp": (KernelScore(cap=30.0, hardware_tanh=False), None),
        "softcap(30), tanh.approx": (KernelScore(cap=30.0), None),
    }
    allowed = measure.allowed_entries(None, True, shape[2], device)
    for backward in (False, True):
        suffix, plain, variant = (
            (", dq by atomics", dict(dq_atomic=False), dict(dq_atomic=True))
            if backward
            else (", ahead", dict(ahead=False), dict(ahead=True))
        )
        call, args = (_backward_call, (None,)) if backward else (_band_call, ())
        fns = {}
        for name, (score, score_slopes) in scores.items():
            for label, options in ((name, plain), (name + suffix, variant)):
                if label != name and "from exp" in name:
                    continue
                fns[label] = call(
                    *qkv, None, True, *args, score=score, slopes=score_slopes, **options
                )
        flop = measure.flops(allowed, shape, backward=False)
        flop *= measure.BACKWARD_FLOPS if backward else 1
        timed = measure.time_group(fns, repeat, device, 0.02, ())
        for name, row in timed.items():
            base = timed.get("none" + suffix if name.endswith(suffix) else "none", {}).get("ms")
            rows.add(
                section="scores",
                score=name,
                backward=backward,
                shape=list(shape),
                of_matmul=flop / (row["ms"] * 1e-3) / peak if "ms" in row else None,
                vs_plain=row["ms"] / base if "ms" in row and base else None,
                **row,
            )
    del qkv
    measure.release()


def run_dispatch(rows: JsonRows, device, repeat: int, shape=(4, 16, 8192, 128)) -> None:
    """Where the time goes between a kernel and mhsa.attention, causal (B, H, L, D =
    shape, bf16, inputs requiring grad): the band forward alone, then mhsa.attention
    with backend triton and sdpa, with and without isolate_nonfinite (whose check of the
    keys and values waits for the device once a call), and SDPA called directly;
    forward and forward+backward. host_ms says where the host is what a call waits on."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qkv = _inputs(shape, shape[1], torch.bfloat16, device, grad=True)
    grad = torch.randn_like(qkv[0])

    def through(backend: str, isolate: bool):
        return lambda: attention(*qkv, causal=True, backend=backend, isolate_nonfinite=isolate)

    forwards = {"triton kernel": _band_call(*(t.detach() for t in qkv), None, True)}
    for backend in ("triton", "sdpa"):
        forwards[f"{backend}, isolate_nonfinite=False"] = through(backend, False)
        forwards[backend] = through(backend, True)
    forwards["torch sdpa"] = lambda: sdpa(*qkv, is_causal=True)
    for backward in (False, True):
        fns = {name: fn for name, fn in forwards.items() if not backward or "kernel" not in name}
        if backward:  # (each forward's output, back to q, k and v)
            fns = {name: functools.partial(_backward_of, fn, qkv, grad) for name, fn in fns.items()}
        for name, row in measure.time_group(fns, repeat, device, 0.02, ()).items():
            rows.add(section="dispatch", what=name, backward=backward, shape=list(shape), **row)


def _backward_of(forward, inputs, grad):
    return torch.autograd.grad(forward(), inputs, grad)


SECTIONS = (
    "checks",
    "sweep_forward",
    "sweep_backward",
    "sweep_tiles",
    "scores",
    "peers",
    "hf_shape",
    "dispatch",
)


def _comma_list(known, kind=str):
    """An argparse type: a comma-separated list of kind, each in known (None: any)."""

    def parse(text: str) -> list:
        try:
            items = [kind(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of {kind.__name__}"
            ) from None
        unknown = [item for item in items if known is not None and item not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(known)}")
        return items

    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, L=4096")
    parser.add_argument("--only", type=_comma_list(SECTIONS), default=",".join(SECTIONS))
    parser.add_argument(
        "--cases", type=_comma_list(CASES), default=",".join(CASES), help="the peers' cases"
    )
    parser.add_argument(
        "--dims", type=_comma_list(None, int), default="128,64", help="forward sweep head dims"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="samples per call (default 3 with --quick, "
        "else 7); 0: each call once, which compiles its kernels for a timed run to find",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device: it times the kernels on a GPU (tests run them on CPU)")
    device = torch.device("cuda")
    rows = JsonRows(args.out, "band.jsonl")
    repeat = (3 if args.quick else 7) if args.repeat is None else args.repeat
    length = 4096 if args.quick else 8192
    peak = matmul_gflops(8192, max(repeat, 1), device, torch.bfloat16) * 1e9
    rows.add(
        section="header",
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        matmul_tflops=peak / 1e12,
    )
    parts = args.only
    if "checks" in parts:
        run_checks(rows, device)
    if "sweep_forward" in parts:
        run_sweep_forward(rows, device, length, peak, repeat, args.dims)
    if "sweep_backward" in parts:
        run_sweep_backward(rows, device, length, peak, repeat)
    if "sweep_tiles" in parts:
        run_sweep_tiles(rows, device, length, peak, repeat)
    if "scores" in parts:
        run_scores(rows, device, peak, repeat)
    if "hf_shape" in parts:
        run_hf_shape(rows, device, repeat)
    if "dispatch" in parts:
        run_dispatch(rows, device, repeat)
    if "peers" in parts:
        cases = {name: CASES[name] for name in args.cases}
        run_peers(rows, device, (length, 2 * length), peak, repeat, cases)


if __name__ == "__main__":
    main()
