"""`mhsa translate CHECKPOINT TEXT...`: English number words to French (seq2seq)."""

from __future__ import annotations

import argparse

from .common import (
    add_option,
    finite_float,
    load_model,
    positive_int,
    threads_option,
    with_threads,
)
from .device import device_options, placement


@with_threads
def translate(args: argparse.Namespace) -> int:
    """Translate English number words with a `mhsa train translate` checkpoint."""
    from ..data.numbers import Vocabulary, pad_batch
    from ..models.seq2seq import Seq2Seq, Seq2SeqConfig

    device, dtype = placement(args)
    model, state = load_model(args.checkpoint, {"seq2seq": (Seq2Seq, Seq2SeqConfig)})
    model.to(device=device, dtype=dtype)
    vocab = Vocabulary(state["info"]["vocab"])
    for text in args.texts:
        if not text.strip():
            raise ValueError("a text to translate is empty; give English number words")
        unknown = vocab.unknown_words(text)
        if unknown:
            raise ValueError(
                f"unknown words {unknown} in {text!r}: the model knows English "
                f"number words such as 'three hundred and twelve'"
            )
    ids = pad_batch([vocab.encode(text) for text in args.texts])
    if ids.shape[1] > model.config.max_len:
        raise ValueError(f"a text is longer than the model's {model.config.max_len} tokens")
    outputs = model.translate(
        ids.to(device), beam_size=args.beam_size, length_penalty=args.length_penalty
    )
    for out in outputs:
        print(vocab.decode(out))
    return 0


def length_penalty(text: str) -> float:
    """--length-penalty: a finite number in -10..10 (length ** it must stay finite)."""
    value = finite_float(text)
    if not -10 <= value <= 10:
        raise argparse.ArgumentTypeError(f"must be in -10..10, got {text}")
    return value


def add_parser(commands) -> None:
    translate_parser = commands.add_parser("translate", help="translate with a seq2seq checkpoint")
    translate_parser.add_argument("checkpoint", help="output folder of `mhsa train translate`")
    translate_parser.add_argument("texts", nargs="+", help='e.g. "three hundred and twelve"')
    add_option(
        translate_parser,
        "--beam-size",
        4,
        "beams kept per text; 1 is greedy",
        type=positive_int,
    )
    add_option(
        translate_parser,
        "--length-penalty",
        1.0,
        "beams are ranked by log-probability / length ** this (a number in -10..10)",
        type=length_penalty,
    )
    device_options(translate_parser)
    threads_option(translate_parser)
    translate_parser.set_defaults(run=translate)
