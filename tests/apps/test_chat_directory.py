"""A transformers directory's tokenizer settings as `mhsa chat --model DIR` reads them:
special tokens written as strings or as saved AddedTokens render the same template."""

from __future__ import annotations

import json

import pytest

from mhsa.apps.chat import _DirectoryTokenizer
from mhsa.formats import render_chat
from optional import needs

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + "
    "eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)
TEMPLATE_HI = "<s>[user] Hi</s>[assistant] "


def _added(content: str) -> dict:
    """An AddedToken as older tokenizer_config.json files save it."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False}


@pytest.mark.parametrize("as_dict", [False, True])
def test_special_tokens_saved_as_added_tokens_are_read(tmp_path, as_dict):
    needs("tokenizers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<s>": 0, "</s>": 1, "hi": 2}
    Tokenizer(WordLevel(vocab, unk_token="hi")).save(str(tmp_path / "tokenizer.json"))
    bos, eos = (_added("<s>"), _added("</s>")) if as_dict else ("<s>", "</s>")
    settings = {"chat_template": TEMPLATE, "bos_token": bos, "eos_token": eos}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = _DirectoryTokenizer(tmp_path, render_chat)
    text = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text == TEMPLATE_HI
    assert tokenizer.eos_token_id == 1


@pytest.mark.parametrize("adds", ["nothing", "bos", "eos"])
def test_the_token_a_post_processor_puts_first_is_the_bos_a_prompt_gets(tmp_path, adds):
    """Llama 3 directories add <|begin_of_text|> in tokenizer.json's post-processor:
    `mhsa serve` prepends it to a completion prompt, as transformers' tokenizer does."""
    needs("tokenizers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer(WordLevel({"<s>": 0, "</s>": 1, "hi": 2}, unk_token="hi"))
    if adds == "bos":
        tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    elif adds == "eos":  # after the text: not a BOS
        tokenizer.post_processor = TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", 1)]
        )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    ours = _DirectoryTokenizer(tmp_path, render_chat)
    expected = (True, 0) if adds == "bos" else (False, None)
    assert (ours.add_bos_token, ours.bos_token_id) == expected


def test_a_list_of_named_templates_renders_the_default(tmp_path):
    """Hermes-2-Pro and Command-R save [{"name": "default", ...}, {"name": "tool_use", ...}]."""
    needs("tokenizers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"<s>": 0, "</s>": 1}, unk_token="<s>")).save(
        str(tmp_path / "tokenizer.json")
    )
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": TEMPLATE}]
    settings = {"chat_template": named, "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = _DirectoryTokenizer(tmp_path, render_chat)
    assert tokenizer.render_chat([{"role": "user", "content": "Hi"}]) == TEMPLATE_HI
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(ValueError, match="has no \\(default\\) chat template"):
        _DirectoryTokenizer(tmp_path, render_chat)


def test_streamed_text_keeps_the_first_space_a_sentencepiece_decoder_strips(tmp_path):
    """Generated text continues a prompt: "▁today" after it reads " today", as
    decode(prompt + new) - decode(prompt) gives (vLLM, transformers)."""
    needs("tokenizers")
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, "▁Hello": 1, "▁today": 2, "s": 3, "▁a": 4}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()  # (strips the text's first space)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    ours = _DirectoryTokenizer(tmp_path, render_chat)
    prompt, new = [1], [2, 3]
    expected = tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)) :]
    stream = ours.stream()
    assert "".join(stream.push(i) for i in new) + stream.flush() == expected == " todays"
