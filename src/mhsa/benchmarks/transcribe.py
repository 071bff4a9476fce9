"""`mhsa bench transcribe`: Whisper tiny.en speech recognition, mhsa against CTranslate2.

Both run the same weights (the packaged CTranslate2 conversion) in float32 on the CPU
with the same number of threads, greedy, on the same file, measured in the same run.
Both use mhsa's front end (WAV reading, resampling, log-mel), timed on both sides, and
decode up to 4 windows of 30 s at a time. The real-time factor (RTF) is seconds of
compute per second of audio: below 1 is faster than real time.

Each engine is timed in a fresh process of its own: a CTranslate2 model alive in the
same process makes PyTorch's small CPU ops several times slower (two OpenMP runtimes
on the same cores), which would measure the clash rather than either engine.

    python -m mhsa.benchmarks.transcribe ENGINE FILE --threads N --repeat R

prints one JSON line {"seconds": best time, "text": transcript} for that engine.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..apps.transcribe import load_audio, load_whisper, transcribe, whisper_directory
from ..data.speech import INSTALL_HINT
from ..data.whisper_audio import N_SAMPLES, SAMPLE_RATE, log_mel_spectrogram
from .timing import best_times

ENGINES = ("mhsa", "mhsa compiled", "ctranslate2")  # compiled: its decoder step
BATCH = 4  # windows decoded together, by both engines
PASSAGE = (  # about 18 s; tiny.en transcribes espeak-ng's voice well only for some texts
    "The quick brown fox jumps over the lazy dog. Attention lets every word of a sentence "
    "look at every other word. Each head asks its own question, and the answers are mixed "
    "into a new meaning for the word. The model listens to thirty seconds of sound at a "
    "time, and writes down what it hears, one token after another."
)
QUICK_PASSAGE = "The quick brown fox jumps over the lazy dog."


def synthesize(text: str, path: Path, voice: str = "en-us") -> Path:
    """Speak `text` with espeak-ng into the WAV file `path` (22.05 kHz)."""
    if shutil.which("espeak-ng") is None:
        raise ValueError(f"{INSTALL_HINT}; or pass a WAV file to benchmark")
    subprocess.run(
        ["espeak-ng", "-v", voice, "-w", str(path), text], check=True, capture_output=True
    )
    return path


def _ctranslate2_transcriber(threads: int) -> Callable[[Path], str]:
    """path -> text with CTranslate2's Whisper on mhsa's front end (mhsa's model only
    supplies the prompt ids and turns the ids into text)."""
    try:
        import ctranslate2
    except ImportError as error:
        raise RuntimeError("the comparison needs CTranslate2: pip install ctranslate2") from error
    model = ctranslate2.models.Whisper(
        str(whisper_directory()),
        device="cpu",
        compute_type="float32",
        intra_threads=threads,
        inter_threads=1,
    )
    ours = load_whisper()
    prompt = list(ours.config.prompt)

    def run(path: Path) -> str:
        windows = load_audio(path).split(N_SAMPLES)
        texts = []
        for start in range(0, len(windows), BATCH):
            mel = torch.stack([log_mel_spectrogram(w) for w in windows[start : start + BATCH]])
            features = ctranslate2.StorageView.from_array(mel.numpy())
            results = model.generate(features, [prompt] * len(mel), beam_size=1)
            texts += [ours.decode(result.sequences_ids[0]).strip() for result in results]
        return " ".join(text for text in texts if text)

    return run


def time_engine(engine: str, path: str | Path, threads: int, repeat: int) -> dict:
    """In this process: one warm-up transcription, then the best of `repeat`.
    Returns {"seconds", "text"}."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    torch.set_num_threads(threads)
    path = Path(path)
    if engine.startswith("mhsa"):  # the warm-up below compiles
        fn = functools.partial(
            transcribe,
            path,
            load_whisper().decoding_layout(),
            batch_size=BATCH,
            compile=engine == "mhsa compiled",
        )
    else:
        fn = functools.partial(_ctranslate2_transcriber(threads), path)
    text = fn()
    return {"seconds": best_times({engine: fn}, repeat)[engine], "text": text}


def _time_in_subprocess(engine: str, path: Path, threads: int, repeat: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "mhsa.benchmarks.transcribe",
        engine,
        str(path),
        "--threads",
        str(threads),
        "--repeat",
        str(repeat),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"timing {engine} failed: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(
    path: str | Path | None = None, repeat: int = 3, threads: int | None = None, quick: bool = False
) -> dict:
    """Time transcription of `path` (default: an English passage spoken by espeak-ng,
    a short sentence with quick=True) by mhsa and by CTranslate2, each in a fresh
    process: best of `repeat` runs after a warm-up (1 run with quick=True)."""
    threads = torch.get_num_threads() if threads is None else threads
    if threads < 1 or repeat < 1:
        raise ValueError(f"threads and repeat must be >= 1, got {threads} and {repeat}")
    repeat = 1 if quick else repeat
    with tempfile.TemporaryDirectory() as tmp:
        label = "an espeak-ng passage" if path is None else str(path)
        if path is None:
            path = synthesize(QUICK_PASSAGE if quick else PASSAGE, Path(tmp) / "passage.wav")
        path = Path(path)
        seconds = len(load_audio(path)) / SAMPLE_RATE
        results = {name: _time_in_subprocess(name, path, threads, repeat) for name in ENGINES}
    rows = [
        {"name": name, "seconds": r["seconds"], "rtf": r["seconds"] / seconds, "text": r["text"]}
        for name, r in results.items()
    ]
    other = results["ctranslate2"]
    mhsa = min(
        (results[name] for name in ENGINES if name.startswith("mhsa")), key=lambda r: r["seconds"]
    )
    return {
        "file": label,
        "audio_seconds": seconds,
        "threads": threads,
        "rows": rows,
        "ratio": mhsa["seconds"] / other["seconds"],
        "same_text": all(r["text"] == other["text"] for r in results.values()),
    }


def report(result: dict) -> str:
    lines = [
        f"Whisper tiny.en, float32 CPU, {result['threads']} threads, greedy; "
        f"{result['file']} ({result['audio_seconds']:.1f} s of audio)"
    ]
    for row in result["rows"]:
        lines.append(
            f"  {row['name']:<14} {row['seconds']:7.3f} s  RTF {row['rtf']:.3f}  "
            f"{row['text'][:60]!r}"
        )
    lines.append(
        f"  mhsa time (the faster) / ctranslate2 time: {result['ratio']:.2f}x "
        f"(below 1: mhsa is faster); same text: {result['same_text']}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=ENGINES)
    parser.add_argument("file")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(time_engine(args.engine, args.file, args.threads, args.repeat)))


if __name__ == "__main__":
    main()
