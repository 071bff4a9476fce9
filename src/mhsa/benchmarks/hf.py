"""transformers models on mhsa (attn_implementation="mhsa") against their own sdpa and
eager attention, in one run.

- speed: SmolLM2-135M loaded by transformers from the packaged GGUF (float32); prefill
  at each length and greedy decoding over transformers' DynamicCache, best-of-N,
  the three implementations interleaved.
- window: a small random Llama, forward+backward over one long sequence where each
  token sees the previous `window` tokens: mhsa with the pattern (set_pattern) against
  sdpa given the same pattern as a dense 4-D mask; peak memory and time, each in a
  fresh process so that peaks do not mix.

On another device and dtype (run's `on`) both run there: the window case's peak is then
the device's allocator peak (torch.cuda.max_memory_allocated), not resident memory.

    python -m mhsa.benchmarks.hf --window-case mhsa --length 16384 --window 512
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from .memory import peak_bytes, reset_peak, rss_bytes
from .placement import CPU, Placement
from .timing import best_times

IMPLEMENTATIONS = ("mhsa", "sdpa", "eager")


def _smollm2(dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    from mhsa.apps.chat import smollm2_path
    from mhsa.integrations import transformers as mhsa_hf

    mhsa_hf.register()
    path = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype
    ).eval()


@torch.inference_mode()
def speed(
    lengths=(512, 4096),
    new: int = 32,
    repeat: int = 2,
    on: Placement = CPU,
) -> dict:
    """Prefill seconds at each length and decoding tokens/s, per implementation, placed
    by `on`."""
    device = on.device
    model = _smollm2(on.dtype).to(device)
    vocab = model.config.vocab_size

    def use(name: str):
        def run(fn):
            def timed():
                model.set_attn_implementation(name)
                return fn()

            return timed

        return run

    prefill = {}
    for length in lengths:
        ids = torch.randint(3, vocab, (1, length)).to(device)
        step = lambda ids=ids: model(ids, use_cache=True, logits_to_keep=1)  # noqa: E731
        prefill[length] = best_times({n: use(n)(step) for n in IMPLEMENTATIONS}, repeat, device)

    prompt = torch.randint(3, vocab, (1, 128)).to(device)

    def decode() -> None:
        out = model(prompt, use_cache=True, logits_to_keep=1)
        name = "cache" if "cache" in out else "past_key_values"  # (transformers 5 / 4)
        cache, token = out[name], out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new):
            out = model(token, use_cache=True, logits_to_keep=1, **{name: cache})
            token = out.logits[:, -1].argmax(-1, keepdim=True)

    decoding = best_times({n: use(n)(decode) for n in IMPLEMENTATIONS}, repeat, device)
    where = "" if on.cpu else f", on {device}"
    return {
        "model": "SmolLM2-135M-Instruct (transformers, from the packaged GGUF, "
        f"{on.dtype_name}{where})",
        "threads": torch.get_num_threads(),
        "prefill_seconds": {str(length): times for length, times in prefill.items()},
        "decode": {"prompt": 128, "new_tokens": new, "seconds": decoding},
    }


def window_case(implementation: str, length: int, window: int, device: str = "cpu") -> dict:
    """One forward+backward of a small random Llama over `length` tokens in which token
    i sees tokens i - window + 1 .. i; in this process (run it in a fresh one), on
    device (a GPU's peak: its allocator's)."""
    import transformers

    from mhsa.core.masks import SlidingWindow
    from mhsa.integrations import transformers as mhsa_hf

    mhsa_hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=length,
    )
    model = transformers.LlamaForCausalLM(config).to(device)
    model.set_attn_implementation(implementation)
    ids = torch.randint(0, 256, (1, length)).to(device)
    cuda = torch.device(device).type == "cuda"
    if implementation == "mhsa":
        mhsa_hf.set_pattern(model, SlidingWindow(window - 1, 0))
    model(ids[:, :64], labels=ids[:, :64]).loss.backward()  # warm-up (one-time allocations)
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline, exact_peak = torch.cuda.memory_allocated(device), True
    else:
        baseline, exact_peak = rss_bytes(), reset_peak()
    start = time.perf_counter()
    options = {}
    if implementation != "mhsa":  # the pattern as the dense mask a model without it needs
        rows = torch.arange(length, device=device).view(-1, 1)
        offset = rows - torch.arange(length, device=device).view(1, -1)
        options["attention_mask"] = ((offset >= 0) & (offset < window)).view(1, 1, length, length)
    model(ids, labels=ids, **options).loss.backward()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if cuda else peak_bytes()
    return {
        "implementation": implementation,
        "length": length,
        "window": window,
        "seconds": seconds,
        "peak_extra_bytes": peak - baseline,
        "peak_reset": exact_peak,
    }


def window_in_subprocess(
    implementation: str, length: int, window: int, device: torch.device | str = "cpu"
) -> dict:
    cmd = [sys.executable, "-m", "mhsa.benchmarks.hf", "--window-case", implementation]
    cmd += ["--length", str(length), "--window", str(window), "--device", str(device)]
    ran = subprocess.run(cmd, capture_output=True, text=True)
    if ran.returncode != 0:
        error = (ran.stderr.strip().splitlines() or ["killed"])[-1]
        return {"implementation": implementation, "length": length, "error": error}
    return json.loads(ran.stdout.strip().splitlines()[-1])


def run(quick: bool = False, repeat: int = 2, on: Placement = CPU) -> dict:
    """Both cases on on.device; the speed case in on.dtype (the window case trains:
    float32)."""
    lengths, new, window_length = ((128, 512), 8, 2048) if quick else ((512, 4096), 32, 16384)
    return {
        "speed": speed(lengths, new, repeat, on),
        "window": [
            window_in_subprocess(name, window_length, 512, on.device) for name in ("mhsa", "sdpa")
        ],
    }


def report(result: dict) -> str:
    speed_ = result["speed"]
    lines = [f"{speed_['model']}, {speed_['threads']} threads; best-of-N seconds, interleaved"]
    for length, times in speed_["prefill_seconds"].items():
        ours = times["mhsa"]
        peers = ", ".join(f"{n} {times[n]:.3f} s ({times[n] / ours:.2f}x)" for n in times)
        lines.append(f"  prefill L={length}: {peers}  (peer / mhsa: >1 = mhsa faster)")
    decode = speed_["decode"]
    rates = {n: decode["new_tokens"] / s for n, s in decode["seconds"].items()}
    lines.append(
        f"  decode ({decode['prompt']}-token prompt, {decode['new_tokens']} new): "
        + ", ".join(f"{n} {r:.1f} tokens/s" for n, r in rates.items())
    )
    rows = {row["implementation"]: row for row in result["window"]}
    lines.append("small Llama (2 layers, d 256), forward+backward, each token sees the last 512:")
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"  {name:<5} L={row['length']}: failed ({row['error']})")
            continue
        how = "pattern" if name == "mhsa" else "dense 4-D mask"
        lines.append(
            f"  {name:<5} ({how}) L={row['length']}: {row['seconds']:.2f} s, "
            f"peak +{row['peak_extra_bytes'] / 2**30:.2f} GiB"
        )
    if all("error" not in row for row in rows.values()) and len(rows) == 2:
        ours, theirs = rows["mhsa"], rows["sdpa"]
        lines.append(
            f"  sdpa / mhsa: time {theirs['seconds'] / ours['seconds']:.2f}x, "
            f"memory {theirs['peak_extra_bytes'] / max(ours['peak_extra_bytes'], 1):.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window-case", choices=("mhsa", "sdpa"), required=True)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(json.dumps(window_case(args.window_case, args.length, args.window, args.device)))


if __name__ == "__main__":
    main()
