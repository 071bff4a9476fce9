"""Compile our Triton kernels for a GPU without one: Triton's front end, its MLIR
passes and ptxas run on the CPU, so a kernel that the GPU's Triton cannot compile
fails here first, for a device run's cost of nothing.

    python tools/triton_compile.py [--arch 90] [--sass] [--only NAME]

Run it under the GPU machine's Triton too (pip install --target DIR triton==X, then
PYTHONPATH=DIR:src): kernels that one version compiles can fail in another. Prints
each kernel's shared memory and fails on the first error. --sass also counts, in the
machine code (nvdisasm), what a kernel's speed turns on: tensor-core ops, special-
function ops (exp2, tanh), float32 ops, loads, conversions and register spills to
local memory; and for each loop, the (instructions, special-function ops,
conversions, special-function ops issued while a tensor-core op runs) one iteration
issues on its straight path.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

POINTERS = {
    "Lens": "*i32",
    "ScoreTable": "*fp32",
    "Part": "*fp32",
    "Lse": "*fp32",
    "Delta": "*fp32",
    "Slopes": "*fp32",
    "Table": "*fp32",
    "Sinks": "*fp32",
    "Buckets": "*i32",
}
DATA = ("Q", "K", "V", "DO", "DQ", "DK", "DV", "Out")
FLOATS = ("scale", "cap")


def compile_kernel(
    fn, constants: dict, arch: int, warps: int, stages: int, dtype="bf16", pointers=None
):
    """Compile fn with its constexprs from constants (and the arguments passed as None
    at run time; the rest: pointers by name, with `pointers` overriding POINTERS, floats
    by name, else int32) for sm_{arch}, specialised as Triton's JIT specialises a call
    on contiguous tensors whose sizes are multiples of 16 (the benchmarks' calls):
    last-dim strides are the constant 1, and pointers and ints are marked divisible by
    16. Returns the compiled kernel."""
    pointers = {**POINTERS, **(pointers or {})}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr or name in constants:  # (a None argument is a constexpr)
            signature[name] = "constexpr"
            constexprs[(index,)] = constants[name]
        elif _is_one(name):  # the JIT makes an int argument equal to 1 a constant
            signature[name] = "constexpr"
            constexprs[(index,)] = 1
        elif name in FLOATS:
            signature[name] = "fp32"
        else:  # pointers (torch aligns them) and ints, all multiples of 16 as the JIT sees
            signature[name] = pointers.get(name, f"*{dtype}" if name in DATA else "i32")
            if not signature[name].startswith("tensordesc"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    options = {"num_warps": warps, "num_stages": stages}
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _is_one(name: str) -> bool:
    """Whether an int argument is 1 in the benchmarks' calls: the last-dim strides of
    contiguous tensors (sqd, skd, ...) and the query heads per KV head without GQA."""
    return name == "group" or (len(name) == 3 and name[0] == "s" and name[2] == "d")


def band_kernels():
    """(name, kernel, constexprs, warps, stages, pointers) of the band kernels' default
    configs, with and without score functions, and the forward reading keys and values
    through TMA tensor descriptors."""
    from mhsa.core.kernels.triton import band, band_grad
    from mhsa.core.kernels.triton.band_launch import CONFIGS

    plain = dict(
        ALIBI=0, RELATIVE=0, SOFTCAP=False, PREC=None, UPCAST=False, BLOCK_D=128, EVEN_D=True
    )
    scored = dict(plain, ALIBI=1, SOFTCAP=2)  # 2: the hardware tanh
    for label, base in (("plain", plain), ("alibi+softcap", scored)):
        no_tma = dict(KDesc=None, VDesc=None, TMA=False, AHEAD=False, LAST_FIRST=False)
        dkv = dict(EVEN_M=True, DQ=None, DQ_ATOMIC=False)
        atomic = dict(EVEN_M=True, DQ_ATOMIC=True)  # (DQ: float32)
        for kernel, config, fn, extra in (
            ("forward", "forward", band._band_fwd, dict(HAS_SINKS=label != "plain", **no_tma)),
            ("dq", "dq", band_grad._band_bwd_dq, dict(LAST_FIRST=False)),
            ("dkv", "dkv", band_grad._band_bwd_dkv, dict(dkv, PER_HEAD=False)),
            ("dkv per query head", "dkv", band_grad._band_bwd_dkv, dict(dkv, PER_HEAD=True)),
            ("dkv with atomic dq", "dkv+dq", band_grad._band_bwd_dkv, dict(atomic, PER_HEAD=False)),
        ):
            block_m, block_n, warps, stages = CONFIGS[config][(True, 128)]
            constants = dict(base, BLOCK_M=block_m, BLOCK_N=block_n, **extra)
            pointers = {  # (float32 buffers: dQ's atomics, dK and dV shares per head)
                "dkv with atomic dq": {"DQ": "*fp32"},
                "dkv per query head": {"DK": "*fp32", "DV": "*fp32"},
            }.get(kernel)
            yield f"band {kernel} ({label})", fn, constants, warps, stages, pointers
    block_m, block_n, warps, stages = CONFIGS["forward"][(True, 128)]
    one_score = dict(
        KDesc=None, VDesc=None, TMA=False, HAS_SINKS=False, AHEAD=False, LAST_FIRST=False
    )
    for label, score in (("alibi", dict(ALIBI=1)), ("softcap", dict(SOFTCAP=2))):
        constants = dict(plain, BLOCK_M=block_m, BLOCK_N=block_n, **one_score, **score)
        yield f"band forward ({label})", band._band_fwd, constants, warps, stages, None
    constants = dict(plain, BLOCK_M=block_m, BLOCK_N=block_n, **one_score, SOFTCAP=1)
    yield "band forward (softcap, tanh from exp)", band._band_fwd, constants, warps, stages, None
    constants = dict(plain, BLOCK_M=block_m, BLOCK_N=block_n, **dict(one_score, AHEAD=True))
    yield "band forward (scores a block ahead)", band._band_fwd, constants, warps, stages, None
    constants = dict(plain, BLOCK_M=block_m, BLOCK_N=block_n, **dict(one_score, LAST_FIRST=True))
    yield "band forward (last block first)", band._band_fwd, constants, warps, stages, None
    descriptor = f"tensordesc<bf16[1, 1, {block_n}, 128]>"
    constants = dict(
        plain,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_SINKS=False,
        TMA=True,
        AHEAD=False,
        LAST_FIRST=False,
    )
    descriptors = {"KDesc": descriptor, "VDesc": descriptor}
    yield "band forward (TMA)", band._band_fwd, constants, warps, stages, descriptors


def tile_kernels():
    """The tile-list kernels with a compact-tile mask (patterns), ALiBi and their
    gradients, at the default launch of D=128."""
    from mhsa.core.kernels.triton import attention
    from mhsa.core.kernels.triton.function import _LAUNCH

    block_m, block_n, warps, stages = _LAUNCH[(True, 128)]
    base = dict(
        HAS_BIAS=False,
        MASK_MODE=2,
        EVEN=True,  # (L and S multiples of the tiles, as at the benchmarks' lengths)
        CAUSAL=True,
        DROPOUT=False,
        ALIBI=1,
        RELATIVE=0,
        SOFTCAP=False,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=128,
        BLOCK_DV=128,
        PREC=None,
        UPCAST=False,
        ACC=tl.float32,
    )
    tiles = {
        "Mask": "*u8",
        "Tiles": "*u8",
        "row_ptr": "*i32",
        "col_ptr": "*i32",
        "blk_idx": "*i32",
        "blk_kind": "*i32",
        "blk_tile": "*i32",
        "Bias": "*fp32",
        "DBias": "*fp32",
        "DSlope": "*fp32",
        "DTable": "*fp32",
    }
    forward = dict(base, HAS_SINKS=True, AHEAD=False)
    yield "tiles forward", attention._attn_fwd, forward, warps, stages, tiles
    ahead = dict(forward, AHEAD=True)
    yield "tiles forward (scores a tile ahead)", attention._attn_fwd, ahead, warps, stages, tiles
    softcap = dict(forward, HAS_SINKS=False, ALIBI=0, SOFTCAP=2)  # (2: the hardware tanh)
    yield "tiles forward (softcap)", attention._attn_fwd, softcap, warps, stages, tiles
    grads = dict(base, BIAS_GRAD=False, SLOPE_GRAD=True, TABLE_GRAD=False, BLOCK_NB=16)
    yield "tiles dq", attention._attn_bwd_dq, grads, warps, stages, tiles
    yield "tiles dkv", attention._attn_bwd_dkv, base, warps, stages, tiles


def delta_kernels():
    """The backward's delta (rowsum(dO * O) - dlse) at D=128, bf16, as row_delta
    launches it."""
    from mhsa.core.kernels.triton.delta import _delta

    constants = dict(HAS_DLSE=True, BLOCK_L=32, BLOCK_D=128, ACC=tl.float32)
    yield "delta", _delta, constants, 4, 3, {"DLse": "*fp32"}


def paged_kernels():
    """The paged decoding kernel (with a window and ALiBi, and without) and its merge."""
    from mhsa.core.kernels.triton import paged

    base = dict(
        HAS_WINDOW=False,
        ALIBI=0,
        RELATIVE=0,
        SOFTCAP=False,
        BLOCK_M=16,
        BLOCK_N=64,
        BLOCK_D=128,
        BLOCK_DV=128,
        PREC=None,
        UPCAST=False,
        ACC=tl.float32,
    )
    table = {"Table": "*i32"}
    yield "paged forward (plain)", paged._paged_fwd, base, 4, 2, table
    scored = dict(base, HAS_WINDOW=True, ALIBI=1, SOFTCAP=2)
    yield "paged forward (window, alibi, softcap)", paged._paged_fwd, scored, 4, 2, table
    merge = dict(BLOCK_S=paged.MERGE_BLOCK, BLOCK_DV=128)
    yield "paged merge", paged._merge_splits, merge, 4, 1, None


# machine-code opcodes by what they cost: tensor cores, the special-function unit,
# float32 arithmetic, loads (global, asynchronous copies to shared, TMA) and spills
SASS_GROUPS = {
    "tensor": ("HGMMA", "HMMA"),
    "special": ("MUFU",),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP"),
    "loads": ("LDG", "LDGSTS", "UTMALDG"),
    "convert": ("I2F", "I2FP", "F2I"),
    "spills": ("LDL", "STL"),
}


INSTRUCTION = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


def disassemble(kernel) -> list[str]:
    """The kernel's machine code (SASS), a line each, by Triton's own nvdisasm."""
    from triton.backends.nvidia import compiler

    disassembler = Path(compiler.__file__).parent / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run(
            [str(disassembler), "-c", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    return text.splitlines()


def _opcodes(lines: list[str]) -> collections.Counter:
    return collections.Counter(
        m.group(1).split(".")[0] for m in map(INSTRUCTION.search, lines) if m
    )


def sass_counts(lines: list[str]) -> dict[str, int]:
    """How many instructions of each SASS_GROUPS group the machine code holds (static
    counts: a loop once)."""
    opcodes = _opcodes(lines)
    return {group: sum(opcodes[o] for o in ops) for group, ops in SASS_GROUPS.items()}


def loop_costs(lines: list[str]) -> list[tuple[int, int, int, int]]:
    """(instructions, special-function ops, conversions, special-function ops under a
    tensor-core op) of each loop body (a branch back to a label), leaving out what a
    forward branch inside it can jump over: what one iteration issues per thread on its
    straight path. The last counts the special-function ops (exp2, tanh) issued between
    a warpgroup MMA (HGMMA) and the next wait (WARPGROUP.DEPBAR): those that run while
    the tensor cores work. A lower bound: a wait that leaves some MMAs running ends the
    count too."""
    labels, costs = {}, []
    for end, line in enumerate(lines):
        if found := LABEL.match(line):
            labels[found.group(1)] = end
        target = BRANCH.search(line)
        if not target or labels.get(target.group(1), end) >= end:
            continue
        body = lines[labels[target.group(1)] : end + 1]
        inside = {m.group(1): at for at, b in enumerate(body) if (m := LABEL.match(b))}
        skipped = set()
        for at, inner in enumerate(body):
            jump = BRANCH.search(inner)
            if jump and "@" in inner and inside.get(jump.group(1), at) > at:  # conditional
                skipped.update(range(at + 1, inside[jump.group(1)]))
        straight = [b for at, b in enumerate(body) if at not in skipped]
        ops = _opcodes(straight)
        converts = sum(ops[o] for o in SASS_GROUPS["convert"])
        overlapped, mma_running = 0, False
        for op in (m.group(1) for m in map(INSTRUCTION.search, straight) if m):
            running = mma_running and not op.startswith("WARPGROUP.DEPBAR")
            mma_running = op.startswith("HGMMA") or running
            overlapped += mma_running and op.startswith("MUFU")
        costs.append((sum(ops.values()), ops["MUFU"], converts, overlapped))
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--sass", action="store_true", help="count machine-code instructions")
    parser.add_argument("--only", default="", help="kernels whose name holds this text")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}")
    for name, fn, constants, warps, stages, pointers in (
        *band_kernels(),
        *tile_kernels(),
        *delta_kernels(),
        *paged_kernels(),
    ):
        if args.only not in name:
            continue
        start = time.perf_counter()
        kernel = compile_kernel(fn, constants, args.arch, warps, stages, pointers=pointers)
        seconds = time.perf_counter() - start
        counts = ""
        if args.sass:
            lines = disassemble(kernel)
            counts = f", {sass_counts(lines)}, loops {loop_costs(lines)}"
        print(f"{name}: ok in {seconds:.1f} s, shared memory {kernel.metadata.shared} B{counts}")


if __name__ == "__main__":
    main()
