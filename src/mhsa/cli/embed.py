"""`mhsa embed SENTENCE...`: sentence embeddings with all-MiniLM-L6-v2."""

from __future__ import annotations

import argparse

from .common import threads_option, with_threads
from .device import device_options, placement


@with_threads
def embed(args: argparse.Namespace) -> int:
    """Sentence embeddings (all-MiniLM-L6-v2), as JSON or a cosine-similarity matrix."""
    import json

    from ..apps.embed import SentenceEncoder

    device, dtype = placement(args)
    try:
        encoder = SentenceEncoder(device=device, dtype=dtype)
    except RuntimeError as error:
        raise SystemExit(str(error)) from error
    vectors = encoder.encode(args.sentences)
    if args.similarity and args.json:
        print(json.dumps((vectors @ vectors.T).tolist()))
    elif args.similarity:
        sims = vectors @ vectors.T
        width = max(len(s) for s in args.sentences[:20])
        for sentence, row in zip(args.sentences, sims.tolist(), strict=True):
            print(f"{sentence[:40]:<{min(width, 40)}}  " + " ".join(f"{v:6.3f}" for v in row))
    elif args.json:
        print(json.dumps(vectors.tolist()))
    else:
        for sentence, vector in zip(args.sentences, vectors.tolist(), strict=True):
            print(
                f"{sentence[:40]!r}: [{', '.join(f'{v:.4f}' for v in vector[:6])}, ...] "
                f"({len(vector)} dims)"
            )
    return 0


def add_parser(commands) -> None:
    embed_parser = commands.add_parser("embed", help="sentence embeddings (all-MiniLM-L6-v2)")
    embed_parser.add_argument("sentences", nargs="+", help="the sentences to embed")
    embed_parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON (the vectors, or with --similarity the matrix)",
    )
    embed_parser.add_argument(
        "--similarity", action="store_true", help="print the cosine-similarity matrix"
    )
    device_options(embed_parser)
    threads_option(embed_parser)
    embed_parser.set_defaults(run=embed)
