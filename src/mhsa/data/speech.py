"""A built-in spoken-digit dataset, synthesised with espeak-ng (Debian package
`espeak-ng`): the words zero..nine in many voices, pitches and speeds, with noise.
Voices held out for testing are never heard in training. Nothing is downloaded."""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import torch
from torch import Tensor

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan",
           "en-gb-x-gbcwmd")  # fmt: skip
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5")
SAMPLE_RATE = 16000
CLIP_SECONDS = 1.0
INSTALL_HINT = "espeak-ng is not installed: apt-get install espeak-ng (Debian/Ubuntu)"


def read_wav(path: str | Path) -> tuple[Tensor, int]:
    """Mono float waveform in [-1, 1] and its sample rate, from a 16-bit PCM WAV file."""
    try:
        with wave.open(str(path), "rb") as f:
            if f.getsampwidth() != 2:
                raise ValueError(f"{path}: only 16-bit PCM WAV is supported")
            rate, channels = f.getframerate(), f.getnchannels()
            frames = f.readframes(f.getnframes())
    except (wave.Error, EOFError) as error:
        raise ValueError(f"{path}: not a readable WAV file ({error})") from error
    audio = torch.frombuffer(bytearray(frames), dtype=torch.int16).float() / 32768.0
    return audio.view(-1, channels).mean(dim=1), rate


def resample(audio: Tensor, rate: int, target: int = SAMPLE_RATE) -> Tensor:
    """Linear-interpolation resampling of a 1-D waveform."""
    if rate == target:
        return audio
    length = max(1, round(len(audio) * target / rate))
    return torch.nn.functional.interpolate(audio.view(1, 1, -1), size=length, mode="linear",
                                           align_corners=False).flatten()  # fmt: skip


def speak(word: str, voice: str, pitch: int, speed: int, workdir: Path) -> Tensor:
    """espeak-ng's rendering of `word`, at 16 kHz."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit(INSTALL_HINT)
    path = workdir / "word.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-p", str(pitch), "-s", str(speed), "-w", str(path),
                    word], check=True, capture_output=True)  # fmt: skip
    audio, rate = read_wav(path)
    return resample(audio, rate)


def fit_clip(audio: Tensor, g: torch.Generator) -> Tensor:
    """Place the audio at a random offset in a fixed-length clip (cropped if longer)."""
    size = int(SAMPLE_RATE * CLIP_SECONDS)
    audio = audio[:size]
    clip = torch.zeros(size)
    offset = int(torch.randint(0, size - len(audio) + 1, (), generator=g))
    clip[offset : offset + len(audio)] = audio
    return clip


def voices() -> list[str]:
    return [f"{accent}+{variant}" for accent in ACCENTS for variant in VARIANTS]


def synthesize(per_voice: int, seed: int, voice_list: list[str] | None = None):
    """Waveforms (N, 16000), labels (N,), voice index (N,): each digit `per_voice` times
    per voice, at random pitch and speed, with background noise."""
    g = torch.Generator().manual_seed(seed)
    voice_list = voices() if voice_list is None else voice_list
    clips, labels, speakers = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for v, voice in enumerate(voice_list):
            for label, word in enumerate(WORDS):
                for _ in range(per_voice):
                    pitch = int(torch.randint(20, 80, (), generator=g))
                    speed = int(torch.randint(120, 220, (), generator=g))
                    clip = fit_clip(speak(word, voice, pitch, speed, Path(tmp)), g)
                    noise = 10 ** (-float(torch.empty(()).uniform_(1.5, 3.0, generator=g)) / 2)
                    clips.append(clip + noise * torch.randn(len(clip), generator=g))
                    labels.append(label)
                    speakers.append(v)
    return torch.stack(clips), torch.tensor(labels), torch.tensor(speakers)


def mel_filterbank(n_fft: int, n_mels: int, sample_rate: int) -> Tensor:
    """(n_mels, n_fft // 2 + 1) triangular filters evenly spaced on the HTK mel scale."""

    def to_mel(hz):
        return 2595.0 * math.log10(1.0 + hz / 700.0)

    mels = torch.linspace(to_mel(0.0), to_mel(sample_rate / 2), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    lower, center, upper = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    rising = (freqs - lower) / (center - lower)
    falling = (upper - freqs) / (upper - center)
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


def log_mel(audio: Tensor, n_mels: int = 64, n_fft: int = 400, hop: int = 160) -> Tensor:
    """(..., samples) at 16 kHz -> log-mel spectrogram (..., n_mels, frames)."""
    window = torch.hann_window(n_fft, device=audio.device)
    spec = torch.stft(audio.reshape(-1, audio.shape[-1]), n_fft, hop, window=window,
                      return_complex=True).abs().square()  # fmt: skip
    mel = mel_filterbank(n_fft, n_mels, SAMPLE_RATE).to(audio.device) @ spec
    return torch.log(mel + 1e-6).reshape(*audio.shape[:-1], n_mels, -1)
