"""AST: the log-mel front end, WAV reading, the model, training end to end (espeak-ng)."""

from __future__ import annotations

import math
import wave

import pytest
import torch

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


def test_missing_espeak_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(speech.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="apt-get install espeak-ng"):
        speech.speak("one", "en-us", 50, 150, tmp_path)


def test_train_ast_end_to_end(tmp_path, capsys):
    args = ["train", "ast", "--out", str(tmp_path / "ast"), "--steps", "4", "--eval-every", "2",
            "--voices", "5", "--per-voice", "1", "--layers", "1", "--d-model", "32"]  # fmt: skip
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
