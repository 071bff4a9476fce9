"""Damaged GGUF files fail fast with one line naming the file and what is wrong: a size
in the metadata that the tensors present contradict (block_count 10**8 in a small file
must not drive an allocation), NaN or infinite weights, a special token id outside the
vocabulary, and `mhsa chat` / `mhsa serve` print such a load error as one line, no
traceback."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from test_gguf import hf_weights, write_gguf

from mhsa.cli import main
from mhsa.formats.gguf import read_gguf, read_gguf_tokenizer

pytest.importorskip("gguf")

DAMAGED = {
    "block_count": ({"block_count": 10**8}, "block_count is 100000000, but the file holds"),
    "no blocks": ({"block_count": 0}, "block_count is 0, but the file holds tensors of 1"),
    "embedding": ({"embedding_length": 128}, "embedding_length is 128, but tensor token_embd"),
    "heads": ({"attention.head_count": 8}, "head_count is 8 heads of 64, but tensor blk.0.attn_q"),
    "kv heads": ({"attention.head_count_kv": 4}, "head_count_kv is 4 heads of 64"),
    "zero heads": ({"attention.head_count": 0}, "do not make attention heads"),
    "ffn": (
        {"feed_forward_length": 10**9},
        r"tensor 'blk.0.ffn_\w+.weight' has shape .* but the metadata",
    ),
    "context": ({"context_length": 2**31}, "context_length is 2147483648, outside"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_size_the_tensors_contradict_fails_fast_naming_the_key(tmp_path, case):
    sizes, message = DAMAGED[case]
    path = write_gguf(tmp_path / "damaged.gguf", sizes=sizes)
    assert path.stat().st_size < 3_000_000
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=message) as caught:
            read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20  # (block_count 10**8 once built 10**9 names: 5.5 GB)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_name_the_tensor(tmp_path, bad):
    weights = hf_weights()
    weights["model.layers.0.mlp.down_proj.weight"][3, 5] = bad
    path = write_gguf(tmp_path / "nan.gguf", weights=weights)
    with pytest.raises(ValueError, match="tensor 'blk.0.ffn_down.weight' holds NaN or infinite"):
        read_gguf(path)


# special token ids outside the 262 tokens of the written vocabulary (262: one past the end)
BAD_IDS = {
    "eos": 10**9,
    "bos": 262,
    "padding": 10**6,
    "unknown": 300,
    "seperator": 4000,  # (llama.cpp's spelling)
    "eot": 2**32 - 1,
    "eom": 263,
    "fim_pre": 999,
}


@pytest.mark.parametrize("name", sorted(BAD_IDS))
def test_a_special_token_id_outside_the_vocabulary_fails_at_load(tmp_path, name):
    path = write_gguf(tmp_path / "ids.gguf", token_ids={name: BAD_IDS[name]})
    message = (
        f"tokenizer.ggml.{name}_token_id is {BAD_IDS[name]}, not a token of the vocabulary "
        "of 262 tokens"
    )
    for load in (read_gguf_tokenizer, lambda p: read_gguf(p).tokenizer(), read_gguf):
        with pytest.raises(ValueError, match=message) as caught:
            load(path)
        assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_special_token_ids_inside_the_vocabulary_load(tmp_path):
    ids = {"padding": 0, "unknown": 5, "eot": 261, "fim_pre": 259}
    tokenizer = read_gguf_tokenizer(write_gguf(tmp_path / "ok.gguf", token_ids=ids))
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id) == (0, 5, 261)


@pytest.mark.timeout(120)  # (before the fix `mhsa serve` loaded the file and served)
@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_report_a_bad_special_token_id_in_one_line(tmp_path, capsys, command):
    path = write_gguf(
        tmp_path / "eos.gguf", chat_template="{{ eos_token }}", token_ids={"eos": 10**9}
    )
    extra = ["--prompt", "hi"] if command == "chat" else ["--port", "0"]
    assert main([command, "--model", str(path), *extra]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith(f"mhsa {command}: "), err[-2000:]
    assert "tokenizer.ggml.eos_token_id is 1000000000" in last and str(path) in last


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_report_a_damaged_file_in_one_line(tmp_path, capsys, command):
    weights = hf_weights()
    weights["model.norm.weight"][0] = np.nan
    files = [
        write_gguf(tmp_path / "blocks.gguf", sizes={"block_count": 10**8}),
        write_gguf(tmp_path / "nan.gguf", weights=weights),
        write_gguf(tmp_path / "heads.gguf", sizes={"attention.head_count": 0}),
    ]
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    files.append(tmp_path / "junk.gguf")
    for path in files:
        extra = ["--prompt", "hi"] if command == "chat" else ["--port", "0"]
        assert main([command, "--model", str(path), *extra]) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err and last.startswith(f"mhsa {command}: ")
        assert str(path) in last, last


def test_chat_reports_a_template_that_refuses_every_conversation_in_one_line(tmp_path, capsys):
    path = write_gguf(tmp_path / "t.gguf", chat_template="{{ raise_exception('no') }}")
    assert main(["chat", "--model", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "mhsa chat: no"
