"""Draw the flash engine's block plans for a few patterns (docs/images/block_plan.svg).

    PYTHONPATH=src python tools/plot_block_plan.py docs/images/block_plan.svg

Every tile's colour comes from the real plan (mhsa.core.kernels.plan.build_plan on
masks.with_causal(pattern, causal)): white tiles are EMPTY (never visited), green
ones FULL runs (no mask applied), blue ones triangular runs (the kernel's causal
mode), orange ones PARTIAL runs (element mask applied).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from mhsa.core import masks  # noqa: E402
from mhsa.core.kernels.plan import build_plan  # noqa: E402

BLOCK = 64
COLOURS = {"full": "#4caf50", "triangle": "#2196f3", "partial": "#ff9800"}
CASES = (  # title, pattern, causal, q_len, kv_len
    ("causal, L = S = 1024", None, True, 1024, 1024),
    ("causal, L = 384 < S = 1024", None, True, 384, 1024),
    ("SlidingWindow(200, 0)", masks.SlidingWindow(200, 0), False, 1024, 1024),
    ("bigbird(64) & causal", masks.bigbird(BLOCK, seed=0), True, 1024, 1024),
)


def run_kind(run) -> str:
    if run.full:
        return "full"
    return "triangle" if run.triangle else "partial"


def draw(ax, title: str, pattern, causal: bool, q_len: int, kv_len: int) -> None:
    """One plan: a rectangle per (row range, key run), in element coordinates."""
    what = masks.with_causal(pattern, causal)
    plan = build_plan(what, q_len, kv_len, block_q=BLOCK, block_k=BLOCK, merge_rows=False)
    for row in plan.rows:
        for run in row.runs:
            corner, width, height = (run.k0, row.q0), run.k1 - run.k0, row.q1 - row.q0
            colour = COLOURS[run_kind(run)]
            ax.add_patch(Rectangle(corner, width, height, facecolor=colour, edgecolor="white"))
    ax.set_xlim(0, kv_len)
    ax.set_ylim(q_len, 0)  # query 0 at the top, as a matrix
    ax.set_aspect("equal")
    ax.set_title(f"{title}\nvisited {plan.visited_fraction:.0%} of L x S", fontsize=9)
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query", fontsize=8)
    ax.tick_params(labelsize=7)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the figure to write (.svg or .png)")
    args = parser.parse_args(argv)
    plt.rcParams["svg.hashsalt"] = "mhsa"  # the same SVG on every run
    fig, axes = plt.subplots(2, 2, figsize=(8, 8))
    for ax, case in zip(axes.flat, CASES, strict=True):
        draw(ax, *case)
    labels = {"full": "FULL run", "triangle": "causal-mode run", "partial": "PARTIAL run"}
    handles = [Patch(color=COLOURS[k], label=v) for k, v in labels.items()]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="EMPTY: never visited"))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, metadata={"Date": None} if args.out.suffix == ".svg" else None)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
