"""`mhsa bench chat`: the packaged SmolLM2-135M-Instruct, batch 1: a `prompt`-token
prompt then `new` greedy tokens, prefill and decode tokens/s, for our float32 model
(the GGUF dequantised), our model keeping the file's Q4_1 / Q8_0 weights, and
transformers (float32, the same GGUF dequantised by its own loader; test extra),
against the weight-streaming bound measured in the same run: one matrix-vector pass
over the float32 model's weights. Then batch 8 (prompts of different lengths): total
new tokens/s. Each mode runs in a fresh process, which also gives its peak memory.

On a GPU (run's `on`) the modes are ours and transformers' in that dtype,
eager and (ours) compiled; the file's quantised weights are the CPU's and are left
out; the bound is the matrix-vector pass on the GPU, the peak its allocator's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from .placement import CPU, Placement

MODES = (
    "mhsa float32",
    "mhsa float32, compiled",
    "mhsa file (Q4_1/Q8_0)",
    "mhsa file, compiled",
    "transformers float32",
)


def modes(on: Placement = CPU) -> tuple:
    """The modes measured where `on` says: MODES on the CPU in float32; elsewhere ours
    (eager, compiled) and transformers' in on.dtype."""
    name = on.dtype_name
    if on.cpu and name == "float32":
        return MODES
    return (f"mhsa {name}", f"mhsa {name}, compiled", f"transformers {name}")


def _mode_dtype(mode: str) -> torch.dtype:
    """float32 of "mhsa float32, compiled", bfloat16 of "transformers bfloat16"; the
    file's modes compute in float32."""
    word = mode.split()[1].rstrip(",")
    return getattr(torch, word) if word in ("float32", "bfloat16", "float16") else torch.float32


def _prompt_ids(tokenizer, length: int) -> list[int]:
    from mhsa.data.text import stdlib_corpus

    text = stdlib_corpus(limit_bytes=40_000)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def _ours(quantize: str, compiled: bool, device="cpu", dtype=torch.float32):
    from mhsa.apps.chat import load_chat_model
    from mhsa.models.decoding import compiled_decode_step

    chat = load_chat_model(quantize=quantize, device=device, dtype=dtype)
    model, tokenizer = chat.model, chat.tokenizer

    def prefill(ids: torch.Tensor, new: int):
        caches = model.make_caches(ids.shape[0], ids.shape[1] + new)
        logits = model.prefill(ids, caches)
        # the compiled step (compiled on the first repeat, which the best-of drops)
        return (compiled_decode_step(model, caches) if compiled else caches), logits

    def step(token: torch.Tensor, caches):
        if compiled:
            return caches(token.view(-1, 1))
        return model.step(token.view(-1, 1), caches)

    def batch(prompts: list[torch.Tensor], new: int):
        return model.generate(prompts, new, temperature=0.0, eos_token=[], compile=compiled)

    return tokenizer, prefill, step, batch


def _transformers(device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from mhsa.apps.chat import smollm2_path
    from mhsa.formats import read_gguf_tokenizer

    path = smollm2_path()
    model = (
        AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=dtype)
        .eval()
        .to(device)
    )
    tokenizer = read_gguf_tokenizer(path)  # the same ids for both

    def prefill(ids: torch.Tensor, new: int):
        out = model(ids, use_cache=True, logits_to_keep=1)  # as its generate does
        return out.past_key_values, out.logits[:, -1]

    def step(token: torch.Tensor, caches):
        out = model(token.view(-1, 1), past_key_values=caches, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def batch(prompts: list[torch.Tensor], new: int):
        width = max(p.numel() for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        attention = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, width - p.numel() :], attention[b, width - p.numel() :] = p, 1
        return model.generate(
            ids,
            attention_mask=attention,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )

    return tokenizer, prefill, step, batch


def _streaming_bound(repeat: int, on: Placement = CPU) -> tuple[float, float]:
    """Seconds of one matrix-vector pass over the model's weights where `on` says (every
    linear and the output head): what reading all weights once per token costs there.
    Two layouts: (out, in) through F.linear, as transformers stores them, and (in, out)
    through a matmul, as our decoding layout does (mhsa.nn.layout)."""
    from mhsa.apps.chat import load_chat_model
    from mhsa.nn.layout import TransposedLinear

    model = load_chat_model(quantize="none").model
    stored = [m.weight_t for m in model.modules() if isinstance(m, TransposedLinear)]
    stored.append(model.embed.weight.T)  # the tied head, (in, out) in our layout
    stored = [w.to(**on.kwargs) for w in stored]
    cuda = on.device.type == "cuda"

    def best(weights: list[torch.Tensor], multiply) -> float:
        vectors = [
            torch.randn(1, w.shape[0] if multiply is torch.mm else w.shape[1], **on.kwargs)
            for w in weights
        ]
        fastest = float("inf")
        with torch.no_grad():
            for _ in range(repeat + 1):
                start = time.perf_counter()
                for w, vector in zip(weights, vectors, strict=True):
                    multiply(vector, w)
                if cuda:
                    torch.cuda.synchronize(on.device)
                fastest = min(fastest, time.perf_counter() - start)
        return fastest

    transposed = best([w.contiguous() for w in stored], torch.mm)
    usual = best([w.T.contiguous() for w in stored], torch.nn.functional.linear)
    return usual, transposed


def measure(mode: str, prompt: int, new: int, repeat: int, device: str = "cpu") -> dict:
    """One mode's figures (run in a fresh process by run()), on device (a GPU's peak
    memory: its allocator's)."""
    from mhsa.benchmarks.memory import peak_bytes, rss_bytes

    cuda = torch.device(device).type == "cuda"
    baseline = torch.cuda.memory_allocated(device) if cuda else rss_bytes()
    dtype = _mode_dtype(mode)
    if mode.startswith("transformers"):
        tokenizer, prefill, step, batch = _transformers(device, dtype)
    else:
        quantize = "file" if mode.startswith("mhsa file") else "none"
        tokenizer, prefill, step, batch = _ours(quantize, mode.endswith("compiled"), device, dtype)
    ids = torch.tensor([_prompt_ids(tokenizer, prompt)], device=device)
    sync = torch.cuda.synchronize if cuda else lambda: None
    result: dict = {"mode": mode}
    best_prefill = best_decode = float("inf")
    tokens = None
    with torch.no_grad():
        for _ in range(repeat):
            start = time.perf_counter()
            caches, logits = prefill(ids, new)
            sync()
            middle = time.perf_counter()
            generated = []
            for _ in range(new):
                token = logits.argmax(dim=-1)
                generated.append(int(token))
                logits = step(token, caches)
            sync()
            end = time.perf_counter()
            best_prefill, best_decode = (
                min(best_prefill, middle - start),
                min(best_decode, end - middle),
            )
            tokens = generated
        step = min(40, prompt // 8)  # 40 tokens at the default 512; every prompt non-empty
        prompts = [ids[0, : prompt - step * i] for i in range(8)]
        batch(prompts, 2)  # warm-up (a compiled step compiles for this batch here)
        start = time.perf_counter()
        batch(prompts, new)
        sync()
        batch_seconds = time.perf_counter() - start
    result.update(
        prefill_tokens_per_s=prompt / best_prefill,
        decode_tokens_per_s=new / best_decode,
        batch8_tokens_per_s=8 * new / batch_seconds,
        tokens=tokens,
        peak_extra_bytes=(torch.cuda.max_memory_allocated(device) if cuda else peak_bytes())
        - baseline,
    )
    return result


def run(
    prompt: int = 512,
    new: int = 128,
    repeat: int = 2,
    threads: int | None = None,
    on: Placement = CPU,
) -> dict:
    """Each mode (modes(on)) measured in a fresh process with `threads` torch
    threads (default: this process's count), then the weight-streaming bound in this
    process."""
    threads = torch.get_num_threads() if threads is None else threads
    results = {"prompt": prompt, "new": new, "threads": threads, "modes": {}}
    where = str(on.device)
    if not on.cpu:
        results["device"], results["dtype"] = where, on.dtype_name
    for mode in modes(on):
        code = (
            "import json, sys, torch; from mhsa.benchmarks.chat import measure; "
            f"torch.set_num_threads({threads}); "
            f"print(json.dumps(measure({mode!r}, {prompt}, {new}, {repeat}, {where!r})))"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["failed"])[-1]
            results["modes"][mode] = {"error": last}
            continue
        results["modes"][mode] = json.loads(done.stdout.strip().splitlines()[-1])
    usual, transposed = _streaming_bound(repeat, on)
    results["streaming_pass_seconds"] = {"F.linear (out, in)": usual, "mm (in, out)": transposed}
    results["streaming_bound_tokens_per_s"] = 1 / min(usual, transposed)
    return results


def report(result: dict) -> str:
    measured, bound = result["modes"], result["streaming_bound_tokens_per_s"]
    dtype = result.get("dtype", "float32")
    hf = measured.get(f"transformers {dtype}", {})
    where = f"on {result['device']}" if "device" in result else f"{result['threads']} threads"
    lines = [
        f"SmolLM2-135M-Instruct, batch 1: {result['prompt']}-token prompt, {result['new']} "
        f"greedy tokens, {where}; weight-streaming bound ({dtype}) "
        f"{bound:.1f} tokens/s, the faster of one matrix-vector pass over the weights: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result["streaming_pass_seconds"].items()),
        f"{'mode':<24} {'prefill/s':>9} {'decode/s':>9} {'vs bound':>8} {'vs hf':>6} "
        f"{'batch8/s':>9} {'peak MiB':>8}",
    ]
    for mode, r in measured.items():
        if "error" in r:
            lines.append(f"{mode:<24} unavailable: {r['error']}")
            continue
        versus = (
            f"{r['decode_tokens_per_s'] / hf['decode_tokens_per_s']:5.2f}x"
            if "decode_tokens_per_s" in hf
            else "     -"
        )
        lines.append(
            f"{mode:<24} {r['prefill_tokens_per_s']:9.1f} {r['decode_tokens_per_s']:9.1f} "
            f"{r['decode_tokens_per_s'] / bound:7.2f}x {versus} "
            f"{r['batch8_tokens_per_s']:9.1f} {r['peak_extra_bytes'] / 2**20:8.0f}"
        )
    ours, theirs = measured.get(f"mhsa {dtype}", {}), hf
    if "tokens" in ours and "tokens" in theirs:
        same = ours["tokens"] == theirs["tokens"]
        lines.append(
            f"greedy tokens, mhsa {dtype} vs transformers: {'identical' if same else 'differ'}"
        )
    return "\n".join(lines)
