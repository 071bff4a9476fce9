"""`mhsa serve --model DIR` over a `mhsa train gpt` checkpoint of every --attention kind
(standard, latent, diff, moba): a live server answers a greedy completion with 200 and
the text `mhsa generate --temperature 0` prints for the same checkpoint and prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from live_server import request

from mhsa.checkpoint import save_checkpoint
from mhsa.cli import main
from mhsa.cli.serve import load_served
from mhsa.models.gpt import ATTENTIONS, GPT, GPTConfig

pytestmark = pytest.mark.slow  # a checkpoint, a server and a generate run per kind

PROMPT = "def attend(q, k, v):"  # 20 bytes: MoBA blocks of 8 choose among earlier ones
NEW_TOKENS = 24


def checkpoint(folder: Path, attention: str) -> Path:
    """A tiny GPT saved as `mhsa train gpt` saves it, its weights spread (an untrained
    model's greedy text is one repeated byte; this one's varies, so a wrong attention
    shows)."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=256,
        max_len=128,
        d_model=32,
        n_head=4,
        n_layer=2,
        attention=attention,
        moba_block=8,
        moba_top_k=1,
    )
    model = GPT(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": "bytes"}
    save_checkpoint(folder, 1, model, info, {})
    return folder


def generated(folder: Path, capsys) -> str:
    """The continuation `mhsa generate --temperature 0` prints."""
    capsys.readouterr()
    argv = ["generate", str(folder), "--prompt", PROMPT, "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(PROMPT) and printed.endswith("\n"), printed
    return printed[len(PROMPT) : -1]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_serve_answers_like_generate_for_every_attention(attention, tmp_path, start_server, capsys):
    folder = checkpoint(tmp_path, attention)
    weights = {"quantize": None, "dtype": torch.float32}  # (the CLI's defaults)
    served = load_served(str(folder), weights, name="gpt", num_blocks=32, block_size=16)
    server = start_server(served=served)
    body = {"model": "gpt", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    status, answer, _ = request(server.port, "POST", "/v1/completions", body)
    assert status == 200, answer
    text = answer["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS
    expected = generated(folder, capsys)
    assert text == expected
    assert len(set(expected)) >= 3, expected  # (a varied text, not one repeated byte)
