"""Whisper's audio front end: 16 kHz mono audio -> the log-mel spectrogram its encoder reads.

    audio (..., samples) --pad/trim to 30 s--> (..., 480000)
      --STFT (n_fft 400, hop 160, Hann, centred), power, last frame dropped--> (..., 201, 3000)
      --80 Slaney mel filters--> log10 (floor 1e-10) --> max(x, x.max() - 8) --> (x + 4) / 4

The filterbank is librosa.filters.mel(sr=16000, n_fft=400, n_mels=80), the one
Whisper ships as mel_filters.npz, computed here rather than downloaded.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples in a 30 s window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames in a window

# Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above
_F_SP = 200.0 / 3.0
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = math.log(6.4) / 27.0


def hz_to_mel(hz: Tensor) -> Tensor:
    """Slaney mel scale (librosa's default, htk=False)."""
    linear = hz / _F_SP
    log = _MIN_LOG_MEL + torch.log(hz.clamp(min=_MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOG_STEP
    return torch.where(hz >= _MIN_LOG_HZ, log, linear)


def mel_to_hz(mel: Tensor) -> Tensor:
    """Inverse of hz_to_mel."""
    linear = mel * _F_SP
    log = _MIN_LOG_HZ * torch.exp(_LOG_STEP * (mel.clamp(min=_MIN_LOG_MEL) - _MIN_LOG_MEL))
    return torch.where(mel >= _MIN_LOG_MEL, log, linear)


def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> Tensor:
    """(n_mels, n_fft // 2 + 1) float32 triangular filters, evenly spaced on the Slaney
    mel scale from 0 Hz to Nyquist, each scaled to unit area (Slaney normalisation)."""
    for name, value in (("n_mels", n_mels), ("n_fft", n_fft), ("sample_rate", sample_rate)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    nyquist = torch.tensor(sample_rate / 2, dtype=torch.float64)
    mels = torch.linspace(0.0, float(hz_to_mel(nyquist)), n_mels + 2, dtype=torch.float64)
    edges = mel_to_hz(mels)  # (n_mels + 2,) filter edges in Hz
    freqs = torch.linspace(0.0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs - lower) / (center - lower)
    falling = (upper - freqs) / (upper - center)
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return (filters * (2.0 / (upper - lower))).float()


def pad_or_trim(audio: Tensor, length: int = N_SAMPLES) -> Tensor:
    """(..., samples) -> (..., length): cut the end off, or pad it with zeros."""
    if audio.shape[-1] >= length:
        return audio[..., :length]
    return torch.nn.functional.pad(audio, (0, length - audio.shape[-1]))


def log_mel_spectrogram(audio: Tensor, n_mels: int = 80, *, pad: bool = True) -> Tensor:
    """Whisper's log-mel features of 16 kHz audio: (..., samples) -> (..., n_mels, frames).

    pad=True pads or trims to 30 s first, so frames = 3000, the encoder's input size;
    pad=False keeps the length (frames = samples // 160). Each spectrogram is clamped
    to 8 (log10 units) below its own maximum, then scaled as (x + 4) / 4.
    """
    if not isinstance(audio, Tensor) or not audio.is_floating_point() or audio.dim() == 0:
        raise TypeError(
            "audio must be a floating-point tensor (..., samples) at 16 kHz, got "
            f"{type(audio).__name__} {getattr(audio, 'dtype', '')}"
        )
    if pad:
        audio = pad_or_trim(audio)
    elif audio.shape[-1] <= N_FFT // 2:  # (the STFT's reflect padding needs more)
        raise ValueError(
            f"audio must hold more than {N_FFT // 2} samples with pad=False, got "
            f"{audio.shape[-1]}; pass pad=True to pad it to 30 s"
        )
    batch_shape, samples = audio.shape[:-1], audio.shape[-1]
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(
        audio.float().reshape(-1, samples), N_FFT, HOP_LENGTH, window=window, return_complex=True
    )
    power = stft[..., :-1].abs() ** 2  # (N, 201, frames); Whisper drops the last frame
    mel = mel_filters(n_mels).to(audio.device) @ power
    log_spec = mel.clamp(min=1e-10).log10()
    peak = log_spec.amax(dim=(-2, -1), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return ((log_spec + 4.0) / 4.0).reshape(*batch_shape, n_mels, -1)
