"""transformers on a GPU with attn_implementation="mhsa" against its own sdpa, in one
run: prefill, a training step, and a sliding window set with mhsa_pattern against
full causal attention.

    python -m mhsa.benchmarks.gpu_hf --out DIR

A random Llama (8 layers, hidden 2048, 16 heads, 4 KV heads, bf16) on CUDA; the
implementations interleaved, best of `--repeat`. Writes DIR/gpu_hf.jsonl, one JSON row
per line as it goes, and checks that prefill logits agree.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import gpu_measure as measure


def _llama(device, max_len: int, tiny: bool = False):
    import transformers

    from mhsa.integrations import transformers as mhsa_hf

    mhsa_hf.register()
    torch.manual_seed(0)
    sizes = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8)
    if tiny:  # (a smoke test on the CPU)
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=max_len,
        **sizes,
    )
    dtype = torch.float32 if tiny else torch.bfloat16
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _using(model, name: str, fn, pattern=None):
    """fn run with the model's attention set to name (and mhsa's pattern, or none)."""
    from mhsa.integrations import transformers as mhsa_hf

    def call():
        model.set_attn_implementation(name)
        if name == "mhsa":
            mhsa_hf.set_pattern(model, pattern)
        return fn()

    return call


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention implementation that attends nothing (out = the queries): a step
    with it costs everything but attention, so the difference is attention's time."""
    return query.transpose(1, 2), None


def run(rows: measure.JsonRows, device, prefill_len: int, train_len: int, repeat: int) -> None:
    from mhsa.core.masks import SlidingWindow

    model = _llama(device, max(prefill_len, train_len), tiny=device.type == "cpu")
    ids = torch.randint(0, 32000, (1, prefill_len), device=device)

    @torch.inference_mode()
    def prefill():
        return model(ids, use_cache=False, logits_to_keep=1).logits

    logits = {name: _using(model, name, prefill)().float() for name in ("mhsa", "sdpa")}
    error = float((logits["mhsa"] - logits["sdpa"]).abs().max())
    rows.add(section="hf", what="prefill logits", max_error=error)
    fns = {name: _using(model, name, prefill) for name in ("mhsa", "sdpa")}
    for name, row in measure.time_group(fns, repeat, device, 0.05, ()).items():
        rows.add(section="hf", what="prefill", length=prefill_len, implementation=name, **row)
    train_ids = torch.randint(0, 32000, (1, train_len), device=device)

    def step():
        model(train_ids, labels=train_ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    window = SlidingWindow(511, 0)  # token i sees i - 511 .. i: a 512-token window
    fns = {name: _using(model, name, step) for name in ("mhsa", "sdpa")}
    fns["mhsa window 512"] = _using(model, "mhsa", step, window)
    import transformers

    transformers.AttentionInterface.register("none", _no_attention)
    fns["no attention"] = _using(model, "none", step)
    for name, row in measure.time_group(fns, repeat, device, 0.05, ()).items():
        rows.add(section="hf", what="training step", length=train_len, implementation=name, **row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--train", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a tiny model, a smoke test")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on a GPU, or use --device cpu")
    rows = measure.JsonRows(args.out, "gpu_hf.jsonl")
    try:
        run(rows, torch.device(args.device), args.prefill, args.train, args.repeat)
    except Exception as error:  # one expensive run: say what failed, keep what was measured
        rows.add(section="hf", skipped=measure.failure(error))


if __name__ == "__main__":
    main()
