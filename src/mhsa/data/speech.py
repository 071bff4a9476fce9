"""A built-in spoken-digit dataset, synthesised with espeak-ng (Debian package
`espeak-ng`): the words zero..nine in many voices, pitches and speeds, with noise.
Voices held out for testing are never heard in training. Nothing is downloaded."""

from __future__ import annotations

import math
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ACCENTS = (
    "en-us",
    "en-gb",
    "en-gb-scotland",
    "en-gb-x-rp",
    "en-029",
    "en-gb-x-gbclan",
    "en-gb-x-gbcwmd",
)
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5")
SAMPLE_RATE = 16000
CLIP_SECONDS = 1.0
INSTALL_HINT = "espeak-ng is not installed: apt-get install espeak-ng (Debian/Ubuntu)"


# WAVE format tags: integer PCM, IEEE float, and the "extensible" wrapper around either
PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE
CONVERT_HINT = "convert it first, e.g. `ffmpeg -i INPUT -ar 16000 -ac 1 OUTPUT.wav`"


def _wav_chunks(data: bytes, path: Path) -> dict[bytes, bytes]:
    """The chunks of a RIFF/WAVE file by id (the first of each id)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError(f"{path}: not a readable WAV file (no RIFF/WAVE header); {CONVERT_HINT}")
    chunks, pos = {}, 12
    while pos + 8 <= len(data):
        chunk_id, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        chunks.setdefault(chunk_id, data[pos + 8 : pos + 8 + size])  # a cut-off data chunk is kept
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    return chunks


def _decode_samples(raw: bytes, tag: int, bits: int, path: Path) -> Tensor:
    """Interleaved samples as float32 in [-1, 1]."""
    buffer = bytearray(raw)
    if tag == FLOAT and bits in (32, 64):
        float_type = torch.float32 if bits == 32 else torch.float64
        return torch.frombuffer(buffer, dtype=float_type).float()
    if tag == PCM and bits == 8:  # unsigned, 128 = silence
        return (torch.frombuffer(buffer, dtype=torch.uint8).float() - 128.0) / 128.0
    if tag == PCM and bits == 16:
        return torch.frombuffer(buffer, dtype=torch.int16).float() / 2**15
    if tag == PCM and bits == 24:  # three little-endian bytes, sign-extended through int32
        b = torch.frombuffer(buffer, dtype=torch.uint8).view(-1, 3).int()
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        return torch.where(value >= 2**23, value - 2**24, value).float() / 2**23
    if tag == PCM and bits == 32:
        return (torch.frombuffer(buffer, dtype=torch.int32).double() / 2**31).float()
    kind = {PCM: "integer PCM", FLOAT: "float"}.get(tag, f"format tag {tag:#x}")
    raise ValueError(
        f"{path}: unsupported WAV encoding ({kind}, {bits}-bit); 8/16/24/32-bit PCM and "
        f"32/64-bit float are supported; {CONVERT_HINT}"
    )


def read_wav(path: str | Path) -> tuple[Tensor, int]:
    """Mono float waveform (samples,) in [-1, 1] and its sample rate, from a WAV file:
    8/16/24/32-bit integer PCM or 32/64-bit float, any number of channels (averaged)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such audio file")
    chunks = _wav_chunks(path.read_bytes(), path)
    fmt, data = chunks.get(b"fmt "), chunks.get(b"data")
    if fmt is None or len(fmt) < 16 or data is None:
        raise ValueError(f"{path}: not a readable WAV file (no fmt or data chunk); {CONVERT_HINT}")
    tag, channels, rate = struct.unpack("<HHI", fmt[:8])
    block, bits = struct.unpack("<HH", fmt[12:16])
    if tag == EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID starts with the tag
    if channels == 0 or rate == 0 or block == 0:
        raise ValueError(f"{path}: not a readable WAV file (zero channels, rate or block size)")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(
            f"{path}: sample rate {rate} Hz is outside {MIN_RATE}..{MAX_RATE} Hz (a damaged "
            f"header?); {CONVERT_HINT}"
        )
    if block != channels * ((bits + 7) // 8):  # whole bytes per sample
        raise ValueError(
            f"{path}: damaged WAV header: block align {block} bytes does not match "
            f"{channels} channels x {bits} bits; {CONVERT_HINT}"
        )
    data = data[: len(data) // block * block]  # drop a cut-off last frame
    if not data:
        raise ValueError(f"{path}: the WAV file holds no audio (an empty data chunk)")
    audio = _decode_samples(data, tag, bits, path)
    if tag == FLOAT:
        _check_float_samples(audio, path)
    return audio.view(-1, channels).mean(dim=1), rate


# float WAVs may exceed full scale a little (no clipping); far beyond it they are damaged
MAX_FLOAT_SAMPLE = 64.0


def _check_float_samples(audio: Tensor, path: Path) -> None:
    if not bool(audio.isfinite().all()):
        raise ValueError(f"{path}: the float samples hold nan or inf (a damaged file?)")
    peak = float(audio.abs().max())
    if peak > MAX_FLOAT_SAMPLE:
        raise ValueError(
            f"{path}: float samples reach {peak:.3g}, far beyond full scale (1.0; at most "
            f"{MAX_FLOAT_SAMPLE:g} is read); normalise the audio first"
        )


# sample rates we resample from or to: telephone audio (8 kHz) to studio (768 kHz) and
# some margin; outside it a file is almost surely corrupt (or minutes of work per second)
MIN_RATE, MAX_RATE = 1_000, 768_000
# scratch elements per step of the sinc resampler (float64): memory stays bounded
RESAMPLE_SCRATCH = 1 << 22


def check_rate(rate: int, name: str = "sample rate") -> None:
    if not isinstance(rate, int) or not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"{name} must be {MIN_RATE}..{MAX_RATE} Hz, got {rate!r}; {CONVERT_HINT}")


def _sinc_resample(
    audio: Tensor, rate: int, target: int, length: int, zeros: int = 6, rolloff: float = 0.99
) -> Tensor:
    """Band-limited resampling: output m sits at input position x = m * rate / target
    (exact integer arithmetic) and is the sum of the samples within `width` of x, each
    weighted by a Hann-windowed sinc with `zeros` zero crossings. Computed in chunks of
    outputs, so memory is bounded whatever the ratio of the rates."""
    cutoff = min(rate, target) / rate * rolloff  # cycles per input sample, times 2
    width = math.ceil(zeros / cutoff)
    taps = torch.arange(-width, width + 2, dtype=torch.int64)  # around floor(x)
    padded = torch.nn.functional.pad(audio.double(), (width, 2 * width + 2))
    out = torch.empty(length, dtype=torch.float64)
    step = max(1, RESAMPLE_SCRATCH // len(taps))
    for m0 in range(0, length, step):
        numerator = torch.arange(m0, min(length, m0 + step), dtype=torch.int64) * rate
        whole, frac = numerator // target, (numerator % target).double() / target
        t = (frac.view(-1, 1) - taps) * cutoff  # (chunk, taps): distance to x, in cutoffs
        window = torch.cos(t.clamp(-zeros, zeros) * (math.pi / (2 * zeros))) ** 2
        weights = cutoff * torch.sinc(t) * window
        samples = padded[(whole.view(-1, 1) + taps + width).clamp(max=len(padded) - 1)]
        out[m0 : m0 + len(whole)] = (weights * samples).sum(dim=1)
    return out


def resample(audio: Tensor, rate: int, target: int = SAMPLE_RATE, method: str = "linear") -> Tensor:
    """Resample a 1-D waveform from `rate` to `target` Hz (each MIN_RATE..MAX_RATE).

    method "linear" interpolates linearly (cheap, aliases when downsampling);
    "sinc" is band-limited (windowed sinc), for speech recognition; its memory is
    bounded for any pair of rates.
    """
    if method not in ("linear", "sinc"):
        raise ValueError(f"method must be 'linear' or 'sinc', got {method!r}")
    if not isinstance(audio, Tensor) or audio.dim() != 1:
        got = tuple(audio.shape) if isinstance(audio, Tensor) else type(audio).__name__
        raise ValueError(f"audio must be a 1-D waveform (samples,), got {got}: mix channels first")
    check_rate(rate, "rate")
    check_rate(target, "target")
    if rate == target or audio.numel() == 0:
        return audio
    length = max(1, round(len(audio) * target / rate))
    if method == "linear":
        return torch.nn.functional.interpolate(
            audio.view(1, 1, -1), size=length, mode="linear", align_corners=False
        ).flatten()
    return _sinc_resample(audio.cpu(), rate, target, length).to(audio.dtype).to(audio.device)


def speak(word: str, voice: str, pitch: int, speed: int, workdir: Path) -> Tensor:
    """espeak-ng's rendering of `word`, at 16 kHz."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit(INSTALL_HINT)
    path = workdir / "word.wav"
    subprocess.run(
        ["espeak-ng", "-v", voice, "-p", str(pitch), "-s", str(speed), "-w", str(path), word],
        check=True,
        capture_output=True,
    )
    audio, rate = read_wav(path)
    return resample(audio, rate)


def fit_clip(audio: Tensor, g: torch.Generator | None = None) -> Tensor:
    """Place the audio in a fixed-length clip, or a longer one's clip-long part: at a
    random offset drawn from g, or centred without one."""
    size = int(SAMPLE_RATE * CLIP_SECONDS)
    if len(audio) > size:  # the centre (or a random part) of a longer one
        extra = len(audio) - size
        start = extra // 2 if g is None else int(torch.randint(0, extra + 1, (), generator=g))
        audio = audio[start : start + size]
    clip = torch.zeros(size)
    room = size - len(audio)
    offset = room // 2 if g is None else int(torch.randint(0, room + 1, (), generator=g))
    clip[offset : offset + len(audio)] = audio
    return clip


def normalise_clips(features: Tensor) -> Tensor:
    """Log-mel features (..., n_mels, frames) scaled to zero mean and unit std per clip."""
    mean = features.mean(dim=(-2, -1), keepdim=True)
    return (features - mean) / features.std(dim=(-2, -1), keepdim=True).clamp(min=1e-6)


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
    spec = (
        torch.stft(
            audio.reshape(-1, audio.shape[-1]), n_fft, hop, window=window, return_complex=True
        )
        .abs()
        .square()
    )
    mel = mel_filterbank(n_fft, n_mels, SAMPLE_RATE).to(audio.device) @ spec
    return torch.log(mel + 1e-6).reshape(*audio.shape[:-1], n_mels, -1)


def clip_features(path: str | Path, n_mels: int = 64) -> Tensor:
    """A WAV file as the AST models see their training clips: 16 kHz, centred in a
    CLIP_SECONDS clip (cropped if longer), log-mel (n_mels, frames) normalised per clip."""
    audio, rate = read_wav(path)
    audio = resample(audio, rate, method="sinc")  # read_wav refused non-finite samples
    return normalise_clips(log_mel(fit_clip(audio), n_mels=n_mels))
