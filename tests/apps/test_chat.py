"""The chat model end to end: the packaged SmolLM2-135M-Instruct (GGUF, Q4_1) on our
attention against transformers loading the same file (test extra), its weights kept
quantised against the dequantised float model, every backend alike, and `mhsa chat`."""

from __future__ import annotations

import pytest
import torch

import mhsa
from mhsa.apps.chat import load_chat_model, smollm2_path
from mhsa.cli import main
from optional import needs

pytestmark = pytest.mark.slow  # real models, servers, browsers or several processes

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
]
NEW = 16


@pytest.fixture(scope="module")
def smollm2():
    try:
        return smollm2_path()
    except FileNotFoundError as error:
        pytest.fail(f"{error} (the test setup installs it)")


@pytest.fixture(scope="module")
def exact(smollm2):
    return load_chat_model(smollm2, quantize="none")


@pytest.fixture(scope="module")
def prompts(exact):
    return [exact.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]


def _greedy(model, ids: list[int], new: int = NEW) -> list[int]:
    out = model.generate([torch.tensor(ids)], new, temperature=0.0, eos_token=[])[0]
    return out[len(ids) :].tolist()


@torch.no_grad()
def _hf_greedy(model, ids: list[int], new: int = NEW) -> list[int]:
    """Argmax decoding through stop tokens over transformers' own KV cache (its generate
    would stop, or with min_new_tokens suppress them)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = [out.logits[:, -1:].argmax(dim=-1)]
    for _ in range(new - 1):
        out = model(tokens[-1], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1:].argmax(dim=-1))
    return torch.cat(tokens, dim=1)[0].tolist()


def test_answers_the_capital_of_france(exact):
    answer = "".join(exact.reply([{"role": "user", "content": PROMPTS[0]}], max_new_tokens=20))
    assert answer == "The capital of France is Paris."


def test_greedy_tokens_and_logits_equal_transformers_on_the_same_gguf(
    exact, prompts, transformers_smollm2
):
    pytest.importorskip("accelerate")
    theirs = transformers_smollm2
    for ids in prompts:
        with torch.no_grad():
            want = theirs(torch.tensor([ids])).logits
            got = exact.model(torch.tensor([ids]))
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
        assert _greedy(exact.model, ids) == _hf_greedy(theirs, ids)


def test_the_files_quantisation_stays_close_to_the_dequantised_model(smollm2, exact, prompts):
    """Along the float model's greedy answers, the model keeping the file's Q4_1 / Q8_0
    weights predicts within 5% of the float model's logits: its prefill (the float
    matmul of the dequantised blocks) and every decoding step (torch's int4 / int8
    kernels). Where greedy answers part is reported in the README, not asserted: it
    turns on the kernels' rounding, which differs between CPUs."""
    kept = load_chat_model(smollm2)  # Q4_1 linears as int4, the Q8_0 head as int8
    layer = kept.model.layers[0]  # q, k, v and gate, up fused (fuse_projections)
    assert type(layer.attn.qkv_proj).__name__ == type(layer.ff.gate_up).__name__ == "Int4Linear"
    assert type(kept.model.lm_head).__name__ == "Int8Linear"
    for ids in prompts:
        tokens = torch.tensor([ids + _greedy(exact.model, ids)])
        with torch.no_grad():
            want = exact.model(tokens)[0, len(ids) - 1 : -1]
            caches = kept.model.make_caches(1, tokens.shape[1])
            got = [kept.model(tokens[:, : len(ids)], caches=caches, last=True)[0]]
            for i in range(len(ids), tokens.shape[1] - 1):
                got.append(kept.model(tokens[:, i : i + 1], caches=caches, last=True)[0])
        assert (torch.cat(got) - want).abs().max() < 0.05 * want.abs().max()


def test_every_backend_gives_the_same_tokens(exact, prompts):
    want = _greedy(exact.model, prompts[0])
    for backend in ("flash", "reference", "sdpa"):
        with mhsa.use_backend(backend):
            try:
                got = _greedy(exact.model, prompts[0])
            except ValueError as error:  # a backend that cannot serve a call says so
                assert backend in str(error)
                continue
        assert got == want, backend


@pytest.mark.parametrize(
    "speculate", [[], ["--speculate", "prompt-lookup"]], ids=["plain", "lookup"]
)
def test_mhsa_chat_prompt_answers_and_reports_speed(capsys, smollm2, speculate):
    # the exact float path: the quantised kernels' rounding differs between CPUs
    args = ["chat", "--prompt", PROMPTS[0], "--max-new-tokens", "20", "--quantize", "none"]
    assert main([*args, *speculate]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "The capital of France is Paris."
    assert "tokens/s" in err


def test_speculation_gives_the_plain_greedy_answer_on_the_default_weights(smollm2):
    """Prompt lookup drafts, verified in one pass, give the same greedy answer as plain
    decoding on the int4 weights: both run over the paged cache, whose rows do not
    depend on what else a call holds (before, plain decoding used contiguous caches
    and these two answers parted at their 2nd and 18th tokens)."""
    from mhsa.models.speculative import PromptLookup

    kept = load_chat_model(smollm2)
    for prompt in (
        "Translate 'good morning' to Spanish and German.",
        "Explain attention in transformers briefly.",
    ):
        messages = [{"role": "user", "content": prompt}]
        plain = "".join(kept.reply(messages, max_new_tokens=24))
        fast = "".join(kept.reply(messages, max_new_tokens=24, speculate=PromptLookup()))
        assert fast == plain


def test_bad_chat_arguments_are_one_line_errors(capsys, tmp_path):
    assert main(["chat", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"]) == 2
    assert "no model at" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantize must be one of"):
        load_chat_model(quantize="int3")
    assert main(["chat", "--prompt", " "]) == 2
    assert "--prompt must not be empty" in capsys.readouterr().err


def test_a_transformers_directory_chats_like_its_model(tmp_path, exact):
    """--model DIR: a (random, tiny) transformers Llama saved with SmolLM2's tokenizer
    (tokenizer.json) and chat template (tokenizer_config.json) answers with the tokens
    transformers' own greedy decoding gives."""
    needs("transformers")
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = len(exact.tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=exact.stop_ids,
        tie_word_embeddings=True,
    )
    theirs = LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    exact.tokenizer._backend.save(str(tmp_path / "tokenizer.json"))
    eos = exact.tokenizer.tokens[exact.stop_ids[0]]
    settings = {"chat_template": exact.tokenizer.chat_template, "eos_token": eos}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    chat = load_chat_model(tmp_path)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    ids = chat.prompt_ids(messages)
    assert ids == exact.prompt_ids(messages)
    want = _hf_greedy(theirs, ids, 8)
    stop = next((i for i, t in enumerate(want) if t in exact.stop_ids), len(want))
    answer = "".join(chat.reply(messages, max_new_tokens=8))
    assert answer == exact.tokenizer.decode(want[:stop], skip_special_tokens=True)
    assert "".join(chat.reply(messages, max_new_tokens=8, compile=True)) == answer
    assert chat.stop_ids == exact.stop_ids


def test_bench_chat_report_states_modes_ratios_and_the_bound():
    from mhsa.benchmarks.chat import report

    def mode(prefill, decode, tokens):
        return {
            "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": decode,
            "batch8_tokens_per_s": 40.0,
            "peak_extra_bytes": 2**30,
            "tokens": tokens,
        }

    result = {
        "prompt": 512,
        "new": 128,
        "threads": 2,
        "streaming_bound_tokens_per_s": 20.0,
        "streaming_pass_seconds": {"F.linear (out, in)": 0.07, "mm (in, out)": 0.05},
        "modes": {
            "mhsa float32": mode(400.0, 18.0, [1, 2]),
            "mhsa file (Q4_1/Q8_0)": {"error": "boom"},
            "transformers float32": mode(300.0, 15.0, [1, 2]),
        },
    }
    text = report(result)
    assert "bound (float32) 20.0 tokens/s" in text and "mm (in, out) 50.0 ms" in text
    assert "0.90x  1.20x" in text  # 18 / 20 of the bound, 18 / 15 of transformers
    assert "unavailable: boom" in text and "identical" in text
