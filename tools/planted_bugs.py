"""Plant realistic bugs in a copy of src/, one at a time, and run the test file that owns
the code: every bug must make it fail. Nothing in the working tree is changed.

    python tools/planted_bugs.py            # all bugs
    python tools/planted_bugs.py rotary     # those whose name contains "rotary"

Prints one line per bug (caught or MISSED, the failing tests) and exits 1 if any
bug went unnoticed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (file under src/mhsa, original text, planted text, owning test file)
BUGS = {
    "gpt window one too wide": (
        "models/gpt.py",
        "SlidingWindow(window - 1, 0)",
        "SlidingWindow(window, 0)",
        "tests/models/test_gpt.py",
    ),
    "custom scale ignored": (
        "core/validate.py",
        "if scale is None else float(scale)",
        "if scale is None else 1.0 / math.sqrt(q.shape[-1])",
        "tests/core/test_attention.py",
    ),
    "rotary rotation sign flipped": (
        "nn/positional.py",
        "torch.cat((-sin, sin), dim=-1)",
        "torch.cat((sin, -sin), dim=-1)",
        "tests/nn/test_positional.py",
    ),
    "rotary frequencies wrong": (
        "nn/rope_scaling.py",
        "return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim",
        "return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / (dim // 2)",
        "tests/nn/test_positional.py",
    ),
    "softmax without max subtraction": (
        "core/kernels/dense.py",
        "row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))",
        "row_max = torch.zeros_like(row_max)",
        "tests/core/backends/test_backends.py",
    ),
    "dropout hash ignores head and batch": (
        "core/kernels/dropout.py",
        "heads = torch.arange(batch * num_heads, device=device, dtype=torch.int64)",
        "heads = torch.zeros(batch * num_heads, device=device, dtype=torch.int64)",
        "tests/core/backends/test_backends.py",
    ),
    "zero_grad after backward": (
        "apps/train/__init__.py",
        "        optimizer.zero_grad(set_to_none=True)\n        loss.backward()\n",
        "        loss.backward()\n        optimizer.zero_grad(set_to_none=True)\n",
        "tests/apps/test_train.py",
    ),
    "vit interpolation height and width swapped": (
        "models/vit.py",
        "size=(grid_h, grid_w)",
        "size=(grid_w, grid_h)",
        "tests/models/test_vit.py",
    ),
    "seq2seq embeddings not scaled by sqrt(d)": (
        "models/seq2seq.py",
        "x = table(ids) * math.sqrt(self.config.d_model)",
        "x = table(ids)",
        "tests/models/test_seq2seq.py",
    ),
    "sampling multiplies by the temperature": (
        "models/sampling.py",
        "logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature",
        "logits = (logits - logits.amax(dim=-1, keepdim=True)) * temperature",
        "tests/models/test_gpt.py",
    ),
    "paged attention lets a query see its own key late": (
        "core/kernels/paged.py",
        "visible.positions(row_pos[: tile.active], tile.k_pos)",
        "visible.positions(row_pos[: tile.active] - 1, tile.k_pos)",
        "tests/core/kernels/test_paged_attention.py",
    ),
    "paged step's plan kept for another window": (
        "core/paged.py",
        "        window,\n        scale,\n",
        "        scale,\n",
        "tests/core/kernels/test_paged_plans.py",
    ),
    "a stop token is output before the request ends": (
        "models/sampling.py",
        "        if choice.stops():\n            return\n",
        "        if choice.stops():\n            yield int(choice.tokens[0])\n            return\n",
        "tests/apps/serve/test_engine.py",
    ),
    "the stop rule ends a sequence one token late": (
        "models/sampling.py",
        "generated + 1 >= self.max_tokens",
        "generated >= self.max_tokens",
        "tests/models/test_generation_core.py",
    ),
    "the scheduler preempts the oldest request": (
        "apps/serve/scheduler.py",
        "self.preempt(self.running[-1])",
        "self.preempt(self.running[0])",
        "tests/apps/serve/test_scheduler.py",
    ),
    "admission forgets what running requests may still take": (
        "apps/serve/scheduler.py",
        "self.pool.free_blocks - self._spoken_for() >=",
        "self.pool.free_blocks >=",
        "tests/apps/serve/test_scheduler.py",
    ),
    "a preempted request resumes from its prompt alone": (
        "apps/serve/scheduler.py",
        "return (self.prompt + self.output)[start:stop]",
        "return self.prompt[start:stop]",
        "tests/apps/serve/test_scheduler.py",
    ),
    # found by the mutation run (tools/mutation.py), not in the original list
    "learning rate schedule never applied": (
        "apps/train/__init__.py",
        '            group["lr"] = lr_at(step, config)\n',
        "            pass\n",
        "tests/apps/test_train.py",
    ),
    "a nan gradient with a finite loss is stepped": (
        "apps/train/parallel.py",
        "torch.isfinite(loss) & torch.isfinite(grad_norm)",
        "torch.isfinite(loss) | torch.isfinite(grad_norm)",
        "tests/apps/test_train.py",
    ),
    "partial results merged without normalising the weights": (
        "core/kernels/merge.py",
        "weights = (weights / safe_total).unsqueeze(-1)",
        "weights = weights.unsqueeze(-1)",
        "tests/core/kernels/test_merge.py",
    ),
    "causal queries aligned top-left": (
        "core/masks/causal.py",
        "    return kv_len - q_len",
        "    return 0 * kv_len",
        "tests/core/masks/test_causal.py",
    ),
    "transformers window one too wide": (
        "integrations/transformers/masks.py",
        "return _Terms(int(window) - 1, None)",
        "return _Terms(int(window), None)",
        "tests/integrations/test_transformers.py",
    ),
    "transformers padding read from key 0 of a sliding cache": (
        "integrations/transformers/masks.py",
        "real = padding[:, sizes.kv_offset : sizes.kv_offset + sizes.kv_len].bool()",
        "real = padding[:, : sizes.kv_len].bool()",
        "tests/integrations/test_transformers.py",
    ),
    "flex score_mod sees mhsa's bottom-right positions": (
        "integrations/flex_scores.py",
        "q_offset=-causal_shift(q_len, kv_len)",
        "q_offset=0",
        "tests/integrations/test_flex_api.py",
    ),
    "flex full blocks ignored": (
        "integrations/flex_blocks.py",
        "return full | (partial & allowed)",
        "return partial & allowed",
        "tests/integrations/test_flex_api.py",
    ),
    "flex tail blocks counted as full": (
        "integrations/flex_blocks.py",
        "padded = F.pad(allowed, pad, value=False)",
        "padded = F.pad(allowed, pad, value=True)",
        "tests/integrations/test_flex_blocks.py",
    ),
    "flex band taken without checking its partial blocks": (
        "integrations/flex_blocks.py",
        "if not bool((mine == window.allowed(rows, cols, length, length)).all()):",
        "if False:",
        "tests/integrations/test_flex_blocks.py",
    ),
    "band forward a block ahead keeps the first block's values": (
        "core/kernels/triton/band.py",
        "                s = s_next\n                v = v_next\n",
        "                s = s_next\n",
        "tests/core/kernels/triton/test_triton_band.py",
    ),
    "query blocks from the last skip the first": (
        "core/kernels/triton/band.py",
        "qi = tl.num_programs(0) - 1 - qi",
        "qi = tl.num_programs(0) - qi",
        "tests/core/kernels/triton/test_triton_band.py",
    ),
    "delta shifted by dlse on rows with no key": (
        "core/kernels/triton/delta.py",
        "delta -= tl.where(finite, dlse, 0.0)",
        "delta -= dlse",
        "tests/core/kernels/triton/test_triton_delta.py",
    ),
    "dQ by atomics left unscaled": (
        "core/kernels/triton/band_grad.py",
        "dq = _dot(tl.trans(ds_t), k, PREC, UPCAST, tl.float32) * scale",
        "dq = _dot(tl.trans(ds_t), k, PREC, UPCAST, tl.float32)",
        "tests/core/kernels/triton/test_triton_band.py",
    ),
    "tile forward a tile ahead keeps the first tile's columns": (
        "core/kernels/triton/attention.py",
        "cols, v, s = cols_next, v_next, s_next",
        "cols, v, s = cols, v_next, s_next",
        "tests/core/kernels/triton/test_triton.py",
    ),
}


def run_with_bug(name: str, workdir: Path) -> tuple[bool, str]:
    """(caught, the failing tests or the run's last line) for one planted bug."""
    relative, original, planted, test_file = BUGS[name]
    src = workdir / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    target = src / "mhsa" / relative
    text = target.read_text()
    if text.count(original) != 1:
        raise SystemExit(f"{name}: the original text is not found once in {relative}")
    target.write_text(text.replace(original, planted))
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT / 'tests'}"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        str(ROOT / test_file),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir)
    failed = [
        line.split(" ")[1] for line in result.stdout.splitlines() if line.startswith("FAILED ")
    ]
    last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return result.returncode != 0, ", ".join(failed) or last


def main(argv: list[str]) -> int:
    chosen = [name for name in BUGS if not argv or any(a in name for a in argv)]
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            caught, detail = run_with_bug(name, Path(tmp))
            missed += not caught
            print(f"{'caught' if caught else 'MISSED'}  {name}: {detail}", flush=True)
    print(f"{len(chosen) - missed} of {len(chosen)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
