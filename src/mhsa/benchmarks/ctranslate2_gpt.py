"""CTranslate2 as a decoding peer for `mhsa bench generate`: a transformers GPT-2 model
converted with CTranslate2's own converter (float32, as ct2-transformers-converter
does), decoded greedily by `ctranslate2.Generator` on 2 intra-op threads.

The benchmark's model has no tokenizer of its own: token i is the string "t{i}", and a
word-level tokenizer saved beside the weights gives the converter that vocabulary.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def converted_generator(hf_model, threads: int):
    """A ctranslate2.Generator over hf_model's weights (a GPT2LMHeadModel), converted in
    a temporary directory; raises ImportError without ctranslate2 or tokenizers."""
    import ctranslate2
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(hf_model.config.vocab_size)}
    with tempfile.TemporaryDirectory() as tmp:
        source, target = Path(tmp) / "hf", Path(tmp) / "ct2"
        hf_model.save_pretrained(source)
        words = Tokenizer(WordLevel(vocab=vocab, unk_token="t0"))
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=words, unk_token="t0", bos_token="t0", eos_token="t0"
        ).save_pretrained(source)
        ctranslate2.converters.TransformersConverter(str(source)).convert(str(target))
        return ctranslate2.Generator(
            str(target), device="cpu", intra_threads=threads, inter_threads=1
        )


def greedy(generator, idx: torch.Tensor, new: int) -> list[list[int]]:
    """The `new` greedy tokens after each prompt row of idx (B, T), never stopping early."""
    prompts = [[f"t{i}" for i in row] for row in idx.tolist()]
    results = generator.generate_batch(
        prompts, max_length=new, min_length=new, sampling_topk=1, include_prompt_in_result=False
    )
    return [[int(token[1:]) for token in r.sequences[0]] for r in results]
