"""AST: the log-mel front end, WAV reading, the model against torch's own modules,
training end to end (espeak-ng)."""

from __future__ import annotations

import math
import wave

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import max_error
from mhsa.cli import main
from mhsa.data import speech
from mhsa.models.ast import AST, ASTConfig


def test_mel_filterbank_and_log_mel_of_a_tone():
    bank = speech.mel_filterbank(400, 64, 16000)
    assert bank.shape == (64, 201) and (bank >= 0).all() and bank.max() <= 1.0
    t = torch.arange(16000) / 16000
    for hz in (300.0, 3000.0):
        spec = speech.log_mel(torch.sin(2 * math.pi * hz * t))
        assert spec.shape == (64, 101)
        peak = int(spec.mean(dim=1).argmax())
        centers = bank.argmax(dim=1) * 8000 / 200  # each filter's peak frequency
        assert abs(centers[peak] - hz) < 0.15 * hz


def test_read_wav_and_errors(tmp_path):
    path = tmp_path / "tone.wav"
    samples = (torch.sin(torch.arange(8000) / 5) * 16000).short()
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(8000)
        f.writeframes(samples.numpy().tobytes())
    audio, rate = speech.read_wav(path)
    assert rate == 8000 and audio.shape == (8000,) and abs(audio.abs().max() - 0.49) < 0.01
    assert speech.resample(audio, 8000).shape == (16000,)
    # a longer recording gives its centre second (its first second once: silence here)
    longer = torch.cat([torch.zeros(16000), torch.ones(4000), torch.zeros(16000)])
    assert speech.fit_clip(longer).sum() == 4000
    drawn = speech.fit_clip(longer, torch.Generator().manual_seed(0))
    assert drawn.shape == (16000,) and drawn.sum() <= 4000
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not a wav")
    with pytest.raises(ValueError, match="not a readable WAV"):
        speech.read_wav(bad)


def test_model_shapes_and_bad_input():
    config = ASTConfig(d_model=32, n_layer=1)
    assert config.grid() == (5, 9)
    model = AST(config)
    assert model(torch.randn(2, 64, 101)).shape == (2, 10)
    with pytest.raises(ValueError, match=r"spectrogram must be \(batch, 64, 101\)"):
        model(torch.randn(2, 64, 50))
    with pytest.raises(ValueError, match="stride must be at least 1"):
        ASTConfig(stride=0)
    with pytest.raises(ValueError, match=r"patch \(16\) must be between 1 and n_mels \(8\)"):
        ASTConfig(n_mels=8, frames=10)


def _torch_layer(block, d_model: int, heads: int) -> nn.TransformerEncoderLayer:
    """torch's own pre-norm encoder layer holding one of our blocks' weights."""
    layer = nn.TransformerEncoderLayer(
        d_model,
        heads,
        4 * d_model,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=True,
    )
    attn = block.self_attn
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        )
        layer.self_attn.in_proj_bias.copy_(
            torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        )
    layer.self_attn.out_proj.load_state_dict(attn.out_proj.state_dict())
    layer.linear1.load_state_dict(block.feed_forward.linear1.state_dict())
    layer.linear2.load_state_dict(block.feed_forward.linear2.state_dict())
    layer.norm1.load_state_dict(block.attn_block.norm.state_dict())
    layer.norm2.load_state_dict(block.ff_block.norm.state_dict())
    return layer.eval()


def test_ast_equals_an_independent_composition_of_torch_modules():
    """Overlapping patches cut with unfold, a CLS token, positions, torch's encoder
    layers and the head, on the model's weights: the same logits."""
    config = ASTConfig(n_mels=32, frames=41, d_model=32, n_layer=2, n_head=4, dropout=0.0)
    torch.manual_seed(0)
    model = AST(config).eval()
    with torch.no_grad():
        model.cls_token.normal_()  # zeros at init: make the CLS token count
    x = torch.randn(2, 32, 41)
    patches = F.unfold(x.unsqueeze(1), config.patch, stride=config.stride).transpose(1, 2)
    assert patches.shape[1] == 2 * 3  # the (32 - 16) / 10 + 1 by (41 - 16) / 10 + 1 grid
    kernel = model.patch_embed.weight.view(config.d_model, -1)
    tokens = patches @ kernel.T + model.patch_embed.bias
    tokens = torch.cat([model.cls_token.expand(2, -1, -1), tokens], dim=1) + model.pos_emb
    for block in model.blocks:
        tokens = _torch_layer(block, config.d_model, config.n_head)(tokens)
    cls = F.layer_norm(tokens[:, 0], (config.d_model,), model.norm.weight, model.norm.bias)
    with torch.no_grad():
        assert max_error(model(x), model.head(cls)) < 1e-5


def test_missing_espeak_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(speech.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="apt-get install espeak-ng"):
        speech.speak("one", "en-us", 50, 150, tmp_path)


def test_train_ast_end_to_end(tmp_path, capsys):
    args = [
        "train",
        "ast",
        "--out",
        str(tmp_path / "ast"),
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--voices",
        "5",
        "--per-voice",
        "1",
        "--layers",
        "1",
        "--d-model",
        "32",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "espeak-ng" in out and "test accuracy" in out
    # classify a spoken word at 22050 Hz (espeak-ng's rate: resampled like any WAV)
    import subprocess

    wav = tmp_path / "seven.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(wav), "seven"], check=True)
    assert main(["classify", str(tmp_path / "ast"), str(wav)]) == 0
    label = capsys.readouterr().out.split(": ")[1].split(" (")[0]
    assert label in speech.WORDS
    assert main(["classify", str(tmp_path / "ast"), str(tmp_path / "missing.wav")]) == 2
    assert "no such audio file" in capsys.readouterr().err
