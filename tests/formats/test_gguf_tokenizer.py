"""GGUF tokenizers as llama.cpp and transformers read them: control tokens written outside
the byte alphabet (DeepSeek's "<｜User｜>") are special, Llama 3's kind takes whole pieces
(ignore_merges) and adds BOS by default, a reply ends at EOS, EOT or EOM, and damaged
metadata or another byte order fail in one line naming the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from test_gguf import write_gguf

from mhsa.apps.chat import _stop_ids
from mhsa.formats import GGUFTokenizer, gguf_metadata, read_gguf, read_gguf_tokenizer
from mhsa.formats.gguf_tokenizer import byte_alphabet
from optional import needs

needs("tokenizers")
BYTES = [byte_alphabet()[b] for b in range(256)]


def _metadata(tokens, types, merges=(), pre="gpt2", **ids) -> dict:
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(merges),
    }
    return metadata | {f"tokenizer.ggml.{name}_token_id": i for name, i in ids.items()}


def test_control_tokens_outside_the_byte_alphabet_are_special():
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
    tokens = BYTES + ["Ġh", "hi"] + specials
    types = [1] * 258 + [3] * 4
    ours = GGUFTokenizer(_metadata(tokens, types, ["Ġ h", "h i"], pre="deepseek-r1-qwen"))
    text = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == [258, 260, 257, 261]  # (was 59 byte-level ids)
    assert ours.special_ids == {258, 259, 260, 261}
    assert ours.decode(ids) == text and ours.decode(ids, skip_special_tokens=True) == "hi"
    stream = ours.stream()
    assert "".join(stream.push(i) for i in [*ids, 259]) + stream.flush() == "hi"


def test_user_defined_tokens_outside_the_byte_alphabet_match_the_text():
    tokens = BYTES + ["<think>", "  ", "café"]  # llama.cpp writes them as their text
    ours = GGUFTokenizer(_metadata(tokens, [1] * 256 + [4, 4, 4]))
    ids = ours.encode("a  <think>b café", add_special_tokens=False)
    assert ids == [ord("a"), 257, 256, ord("b"), ord(" "), 258]
    stream = ours.stream()  # (é once went through the byte alphabet: "caf\ufffd")
    streamed = "".join(stream.push(i) for i in ids) + stream.flush()
    assert ours.decode(ids) == streamed == "a  <think>b café"


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt2"])
def test_llama3_pieces_that_are_tokens_ignore_the_merges(pre):
    tokens = BYTES + ["ab", "bc", "abc", "<|begin_of_text|>"]
    metadata = _metadata(tokens, [1] * 259 + [3], ["b c", "a b"], pre=pre, bos=259)
    ours = GGUFTokenizer(metadata)
    whole = pre == "llama-bpe"  # what llama.cpp and Llama 3's tokenizer.json do
    pieces = [258] if whole else [ord("a"), 257]  # "abc", or "a" + "bc"
    assert ours.encode("abc", add_special_tokens=False) == pieces
    assert ours.add_bos_token is whole  # llama.cpp's default where the file does not say
    assert ours.encode("abc") == ([259] if whole else []) + pieces
    said = GGUFTokenizer(metadata | {"tokenizer.ggml.add_bos_token": False})
    assert said.add_bos_token is False


def test_a_reply_ends_at_eos_eot_and_eom(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", token_ids={"eot": 258, "eom": 259})
    tokenizer = read_gguf_tokenizer(path)
    assert tokenizer.end_token_ids == (258, 259, 261)
    assert _stop_ids(tokenizer, read_gguf(path).config) == [258, 259, 261]


DAMAGED = {
    "no merge space": (["Ġt"], "merge 0 \\('Ġt'"),
    "unknown side": (["Ġ t", "Ġt xyz"], "merge 1 \\('Ġt xyz'"),
    "join not a token": (["Ġ x"], "merge 0 \\('Ġ x'"),  # (a Rust panic, not an Exception)
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_merges_name_the_file(case):
    merges, message = DAMAGED[case]
    metadata = _metadata(BYTES + ["Ġt"], [1] * 257, merges)
    with pytest.raises(ValueError, match=f"model.gguf: {message}.* a damaged GGUF"):
        GGUFTokenizer(metadata, source="model.gguf")
    del metadata["tokenizer.ggml.tokens"]
    with pytest.raises(ValueError, match="model.gguf: no tokenizer.ggml.tokens"):
        GGUFTokenizer(metadata, source="model.gguf")


def test_a_string_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value("general.name", b"\x88bad", gguf.GGUFValueType.STRING)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.close()
    with pytest.raises(ValueError, match=f"{path}: damaged GGUF metadata, a string that is not"):
        gguf_metadata(path)


def test_a_file_in_the_other_byte_order_is_refused(tmp_path):
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("output_norm.weight", np.full(8, 0.5, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file()
    writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ValueError, match="other byte order"):  # (was weights of 8.8e-44)
        read_gguf(path)
