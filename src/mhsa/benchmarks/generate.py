"""`mhsa bench generate`: decoding speed with and without the KV cache, against
transformers' GPT-2, and with a sliding-window cache at a long prompt.

A 6-layer, d_model 384, 6-head GPT with random weights; batch 1, greedy. On another
device and dtype (run's `on`) ours and transformers' run there; CTranslate2 (and the rows
compared with it) only on the CPU.
"""

from __future__ import annotations

import copy
import time

import torch

from ..cache import KVCache
from ..models import GPT, GPTConfig
from .placement import CPU, Placement

LAYERS, D_MODEL, HEADS = 6, 384, 6
BATCH = 8  # the batched rows: copies of the prompt


def _tokens_per_s(fn, new_tokens: int, repeat: int, device: torch.device = CPU.device):
    def timed() -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed()  # warm-up
    return new_tokens / min(timed() for _ in range(repeat))


def cache_case(prompt: int, new: int, repeat: int, on: Placement = CPU) -> dict:
    config = GPTConfig(
        vocab_size=256, n_layer=LAYERS, n_head=HEADS, d_model=D_MODEL, max_len=prompt + new
    )
    model = GPT(config).eval().to(**on.kwargs)
    device = on.device
    idx = torch.randint(0, 256, (1, prompt)).to(device)
    rates = {
        "mhsa, cache": _tokens_per_s(
            lambda: model.generate(idx, new, temperature=0), new, repeat, device
        ),
        "mhsa, no cache": _tokens_per_s(
            lambda: model.generate(idx, new, temperature=0, use_cache=False), new, 1, device
        ),
    }
    try:
        import transformers
    except ImportError:
        rates["transformers"] = None
    else:
        hf_config = transformers.GPT2Config(
            vocab_size=256,
            n_positions=prompt + new,
            n_embd=D_MODEL,
            n_layer=LAYERS,
            n_head=HEADS,
            bos_token_id=None,
            eos_token_id=None,
        )
        hf = transformers.GPT2LMHeadModel(hf_config).eval()
        ours = GPT.from_hf_gpt2(hf.state_dict(), config).eval().to(**on.kwargs)
        hf.to(**on.kwargs)
        same = torch.equal(
            ours.generate(idx, 16, temperature=0),
            hf.generate(idx, max_new_tokens=16, do_sample=False, pad_token_id=0),
        )

        rates["transformers"] = _tokens_per_s(
            lambda: _hf_generate(hf, idx, new), new, repeat, device
        )
        rates["mhsa, GPT-2 weights"] = _tokens_per_s(
            lambda: ours.generate(idx, new, temperature=0), new, repeat, device
        )
        rates["same greedy tokens as transformers"] = same
        if on == CPU:  # CTranslate2 (and the rows compared with it): the CPU's
            rates.update(_ctranslate2_rates(hf, ours, idx, new, repeat))
    return {"prompt": prompt, "new_tokens": new, "tokens_per_s": rates}


def _ctranslate2_rates(hf, ours: GPT, idx: torch.Tensor, new: int, repeat: int) -> dict:
    """CTranslate2 on the same weights, batch 1 and 8, and ours at batch 8."""
    from .ctranslate2_gpt import converted_generator, greedy

    try:
        generator = converted_generator(hf, torch.get_num_threads())
    except ImportError:
        return {"CTranslate2": None}
    batch = idx.expand(BATCH, -1).contiguous()
    mine = ours.generate(idx, new, temperature=0)[0, idx.shape[1] :].tolist()
    fast = copy.deepcopy(ours).decoding_layout()
    compiled = copy.deepcopy(ours)
    started = time.perf_counter()
    compiled.generate(idx, 2, temperature=0, compile=True)  # compiles (then on disk)
    compile_seconds = time.perf_counter() - started
    return {
        "mhsa, GPT-2 weights, compiled step": _tokens_per_s(
            lambda: compiled.generate(idx, new, temperature=0, compile=True), new, repeat
        ),
        "compile seconds (first call)": compile_seconds,
        f"mhsa, GPT-2 weights, compiled step, batch {BATCH}": _tokens_per_s(
            lambda: compiled.generate(batch, new, temperature=0, compile=True), BATCH * new, repeat
        ),
        "mhsa, GPT-2 weights, decoding layout": _tokens_per_s(
            lambda: fast.generate(idx, new, temperature=0), new, repeat
        ),
        f"mhsa, GPT-2 weights, decoding layout, batch {BATCH}": _tokens_per_s(
            lambda: fast.generate(batch, new, temperature=0), BATCH * new, repeat
        ),
        "CTranslate2": _tokens_per_s(lambda: greedy(generator, idx, new), new, repeat),
        "same greedy tokens as CTranslate2": greedy(generator, idx, new)[0] == mine,
        f"mhsa, GPT-2 weights, batch {BATCH}": _tokens_per_s(
            lambda: ours.generate(batch, new, temperature=0), BATCH * new, repeat
        ),
        f"transformers, batch {BATCH}": _tokens_per_s(
            lambda: _hf_generate(hf, batch, new), BATCH * new, repeat
        ),
        f"CTranslate2, batch {BATCH}": _tokens_per_s(
            lambda: greedy(generator, batch, new), BATCH * new, repeat
        ),
    }


def _hf_generate(hf, idx: torch.Tensor, new: int) -> None:
    with torch.no_grad():
        hf.generate(
            idx,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )


def window_case(prompt: int, new: int, window: int, repeat: int, on: Placement = CPU) -> dict:
    config = GPTConfig(
        vocab_size=256,
        n_layer=LAYERS,
        n_head=HEADS,
        d_model=D_MODEL,
        max_len=prompt + new,
        position="rotary",
        window=window,
    )
    model = GPT(config).eval().to(**on.kwargs)
    idx = torch.randint(0, 256, (1, prompt)).to(on.device)
    head_dim = D_MODEL // HEADS

    def run(full: bool):
        if full:  # a full cache for the same windowed model
            caches = [KVCache(1, HEADS, prompt + new, head_dim, **on.kwargs) for _ in model.blocks]
        else:
            caches = model.make_caches(1, prompt + new)
        with torch.no_grad():
            logits = model(idx, caches=caches)[:, -1]
            for _ in range(new):
                nxt = logits.argmax(-1, keepdim=True)
                logits = model(nxt, caches=caches)[:, -1]
        return sum(c.k.numel() + c.v.numel() for c in caches) * caches[0].k.element_size()

    rows = {}
    for name, full in (("sliding-window cache", False), ("full cache", True)):
        memory = run(full)
        rows[name] = {
            "tokens_per_s": _tokens_per_s(lambda full=full: run(full), new, repeat, on.device),
            "cache_bytes": memory,
        }
    return {"prompt": prompt, "new_tokens": new, "window": window, "results": rows}


def run(repeat: int = 3, quick: bool = False, on: Placement = CPU) -> dict:
    """Both cases, placed by `on` (CTranslate2's rows on the CPU only)."""
    torch.manual_seed(0)
    if quick:
        result = {"cache": cache_case(32, 16, 1, on), "window": window_case(64, 8, 16, 1, on)}
    else:
        result = {
            "cache": cache_case(256, 256, repeat, on),
            "window": window_case(2048, 256, 256, repeat, on),
        }
    if on != CPU:
        result["placement"] = str(on)
    return result


def report(result: dict) -> str:
    cache = result["cache"]
    rates = cache["tokens_per_s"]
    lines = [
        f"GPT {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, random weights, batch 1, "
        f"greedy, {result.get('placement', 'cpu, float32')}; prompt {cache['prompt']}, "
        f"{cache['new_tokens']} new tokens"
    ]
    base = rates["mhsa, cache"]
    for name, value in rates.items():
        if name.startswith("compile seconds"):
            lines.append(f"  {name}: {value:.1f} s")
        elif isinstance(value, bool) or value is None:
            lines.append(f"  {name}: {value if value is not None else 'transformers missing'}")
        else:
            lines.append(
                f"  {name:<22} {value:8.1f} tokens/s  (mhsa cache / this: {base / value:5.2f}x)"
            )
    nocache = rates["mhsa, no cache"]
    lines.append(f"  target cache >= 5x no cache: {'ok' if base / nocache >= 5 else 'MISSED'}")
    if rates.get("transformers"):
        ratio = rates["mhsa, GPT-2 weights"] / rates["transformers"]
        lines.append(
            f"  target >= 2.0x transformers: {ratio:.2f}x {'ok' if ratio >= 2.0 else 'MISSED'}"
        )
    for suffix in ("", f", batch {BATCH}"):
        peer = rates.get("CTranslate2" + suffix)
        if peer:  # ours: the fastest of the eager layouts and the compiled step
            ours = max(
                rates["mhsa, GPT-2 weights" + suffix],
                rates["mhsa, GPT-2 weights, decoding layout" + suffix],
                rates["mhsa, GPT-2 weights, compiled step" + suffix],
            )
            ratio, hf = ours / peer, ours / rates["transformers" + suffix]
            lines.append(
                f"  target >= 1.0x CTranslate2{suffix}: {ratio:.2f}x "
                f"{'ok' if ratio >= 1.0 else 'MISSED'} (vs transformers "
                f"{hf:.2f}x, target 2x)"
            )
    window = result["window"]
    lines.append(
        f"window {window['window']}, prompt {window['prompt']}, {window['new_tokens']} new tokens:"
    )
    for name, row in window["results"].items():
        lines.append(
            f"  {name:<22} {row['tokens_per_s']:8.1f} tokens/s, cache "
            f"{row['cache_bytes'] / 2**20:7.1f} MiB"
        )
    return "\n".join(lines)
