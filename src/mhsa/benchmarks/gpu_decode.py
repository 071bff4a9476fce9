"""Batch-1 decoding on a GPU (issue 45): mhsa's generate, eager and with its step
captured in a CUDA graph (mhsa.models.graph_step), against transformers' generate,
with its dynamic cache and with cache_implementation="static" compiled, on a
SmolLM2-135M-shaped Llama with random weights, the same weights in both, bf16.

    python -m mhsa.benchmarks.gpu_decode --out DIR

writes DIR/gpu_decode.jsonl, one JSON row per line as each finishes (flushed): the
setup, then per decoder its tokens/s (new tokens over the best timed call, the
prompt's prefill included, as generate runs it), the untimed first call's seconds
(compiling, capturing), and whether its greedy tokens equal mhsa's eager ones (where
they part: random bf16 weights make near-ties, so a late parting is rounding). A row
that fails records its error and the run goes on; transformers missing is recorded
and mhsa still timed. Sized to finish in about two minutes on an H200.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

# SmolLM2-135M's config.json sizes (random weights: no download)
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
}
DEVICE = "cuda"  # (the CPU smoke test sets "cpu")
BUDGET_S = 140.0  # rows not started by then are recorded as skipped


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _hf_model(dtype: torch.dtype):
    """transformers' LlamaForCausalLM of SMOLLM2_135M's sizes, random, on DEVICE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in SMOLLM2_135M.items() if k != "model_type"})
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None  # never stops
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def _ours(hf, dtype: torch.dtype):
    """mhsa's Llama of the same sizes: hf's weights when given, else its own random ones."""
    from mhsa.models.llama import Llama, LlamaConfig

    config = LlamaConfig.from_hf_config(dict(SMOLLM2_135M))
    config.eos_token = ()
    if hf is not None:
        return Llama.from_hf(hf.state_dict(), config, dtype=dtype).eval()
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Llama(config)
    return model.to(dtype).eval()


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(call: Callable[[], list[int]], repeat: int) -> tuple[float, list[int]]:
    """(best seconds of `repeat` calls, the last call's new tokens)."""
    best, tokens = float("inf"), []
    for _ in range(repeat):
        _sync()
        started = time.perf_counter()
        tokens = call()
        _sync()
        best = min(best, time.perf_counter() - started)
    return best, tokens


def _parting(tokens: list[int], reference: list[int] | None) -> dict:
    if reference is None:
        return {"matches_mhsa_eager": None}
    first = next(
        (i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None
    )
    if first is None and len(tokens) != len(reference):
        first = min(len(tokens), len(reference))
    return {"matches_mhsa_eager": first is None, "first_difference": first}


def _row(
    name: str, warm: Callable[[], object], call, repeat: int, new: int, reference
) -> tuple[dict, list[int]]:
    """One decoder's row and its new tokens: warm (untimed), then `repeat` timed calls."""
    started = time.perf_counter()
    warm()
    _sync()
    warmup_s = time.perf_counter() - started
    seconds, tokens = _timed(call, repeat)
    return {
        "row": name,
        "tokens_per_s": len(tokens) / seconds,
        "seconds": seconds,
        "new_tokens": len(tokens),
        "requested_new_tokens": new,
        "warmup_s": warmup_s,
        "repeat": repeat,
        **_parting(tokens, reference),
        "tokens_head": tokens[:8],
    }, tokens


def run(out: Path, prompt_len: int = 512, new: int = 128, repeat: int = 3) -> list[dict]:
    """Every row, each written to out/gpu_decode.jsonl as it finishes."""
    out.mkdir(parents=True, exist_ok=True)
    path, begun, rows = out / "gpu_decode.jsonl", time.perf_counter(), []

    def write(row: dict) -> None:
        row["elapsed_s"] = round(time.perf_counter() - begun, 2)
        rows.append(row)
        with open(path, "a") as file:
            file.write(json.dumps(row) + "\n")
            file.flush()
        print(json.dumps(row), flush=True)

    dtype = torch.bfloat16
    hf_version = _version("transformers")
    write(
        {
            "row": "setup",
            "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
            "torch": torch.__version__,
            "triton": _version("triton"),
            "transformers": hf_version or "missing: transformers rows skipped",
            "model": "SmolLM2-135M sizes, random weights, bf16",
            "prompt": prompt_len,
            "new_tokens": new,
            "batch": 1,
        }
    )
    hf = None
    if hf_version is not None:
        try:
            hf = _hf_model(dtype)
        except Exception as error:
            write({"row": "transformers model", "error": repr(error)[:2000]})
    ours = _ours(hf, dtype)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, SMOLLM2_135M["vocab_size"], (1, prompt_len), generator=generator)
    prompt = prompt.to(DEVICE)
    reference: list[int] | None = None

    def mhsa(count: int, **options) -> list[int]:
        got = ours.generate(prompt, count, temperature=0.0, eos_token=[], **options)
        return got[0, prompt_len:].tolist()

    def hf_generate(count: int, **options) -> list[int]:
        got = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=count,
            do_sample=False,
            **options,
        )
        return got[0, prompt_len:].tolist()

    cases = [
        (  # (name, warm-up, timed call, repeats)
            "mhsa generate (eager)",
            lambda: mhsa(4, cuda_graph=False),
            lambda: mhsa(new, cuda_graph=False),
            1,
        ),
        (
            "mhsa generate (CUDA graph)",
            lambda: mhsa(new, cuda_graph=True),
            lambda: mhsa(new, cuda_graph=True),
            repeat,
        ),
    ]
    if hf is not None:
        cases += [
            (
                'transformers generate (cache_implementation="static", compiled)',
                lambda: _hf_static(hf, hf_generate, new),
                lambda: _hf_static(hf, hf_generate, new),
                repeat,
            ),
            ("transformers generate", lambda: hf_generate(4), lambda: hf_generate(new), 1),
        ]
    cases.append(
        (
            "mhsa generate(compile=True), uncaptured",
            lambda: mhsa(4, compile=True, cuda_graph=False),
            lambda: mhsa(new, compile=True, cuda_graph=False),
            1,
        )
    )
    for name, warm, call, times in cases:
        if time.perf_counter() - begun > BUDGET_S:
            write({"row": name, "skipped": f"past the {BUDGET_S:.0f} s budget"})
            continue
        try:
            row, tokens = _row(name, warm, call, times, new, reference)
            if name == "mhsa generate (CUDA graph)":
                row.update(_graph_facts(ours))
            if name == "mhsa generate (eager)":
                reference = tokens  # what the other rows' greedy tokens are checked against
            write(row)
        except Exception as error:
            write(
                {
                    "row": name,
                    "error": repr(error)[:2000],
                    "traceback": traceback.format_exc()[-4000:],
                }
            )
    write({"row": "done", "seconds": round(time.perf_counter() - begun, 2)})
    return rows


def _hf_static(hf, hf_generate, new: int) -> list[int]:
    """transformers with a static cache, compiled as its docs say: generate compiles the
    forward itself (generation_config.compile_config, reduce-overhead) where the
    version does; an older one gets model.forward = torch.compile(..., mode=
    "reduce-overhead", fullgraph=True) once."""
    if not hasattr(hf.generation_config, "compile_config") and not getattr(
        hf, "_mhsa_bench_compiled", False
    ):
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        hf._mhsa_bench_compiled = True
    return hf_generate(new, cache_implementation="static")


def _graph_facts(model) -> dict:
    """Whether the captured path really ran (a capture that failed is an error under
    cuda_graph=True), and the compile seconds."""
    from mhsa.models.compiled_step import step_memo
    from mhsa.models.decoding import compile_seconds

    lease = step_memo(model).lease
    step = None if lease is None else lease.step
    return {
        "captured": step is not None and step.graph is not None,
        "slots": None if step is None else step.slots,
        "compile_s": compile_seconds(model),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_decode.jsonl")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="timed calls of the fast rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch sees none)")
    run(args.out, args.prompt, args.new, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
