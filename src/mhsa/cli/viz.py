"""`mhsa viz`: attention maps of one input, as a PNG grid and/or an interactive HTML
explorer, for a GPT checkpoint, the chat model, MiniLM or Whisper."""

from __future__ import annotations

import argparse
import sys

from .checks import check_output
from .common import add_option, positive_int, threads_option, with_threads
from .device import device_options, placement

MODELS = ("gpt", "chat", "minilm", "whisper")
IMAGE_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")  # what --out may be (matplotlib writes)
MB = 1 << 20
LARGE = 20 * MB  # past this the command suggests --heads / --max-tokens


@with_threads
def viz(args: argparse.Namespace) -> int:
    """Record the attention of the chosen model for one input; write the PNG (--out)
    and/or the HTML explorer (--html); maps.png when neither is given."""
    from ..apps.viz import plot_maps, record, write_html
    from ..apps.viz.recording import parse_heads

    if args.model not in MODELS:
        raise ValueError(f"unknown --model {args.model!r}: pass one of {', '.join(MODELS)}")
    if args.model != "gpt" and args.text == "":  # (gpt: the checkpoint's own limits)
        raise ValueError("--text must not be empty: pass the text whose attention to show")
    parse_heads(args.heads)  # a malformed --heads fails before any model loads
    out = args.out if args.out or args.html else "maps.png"
    _check_outputs(out, args.html, args.overwrite)
    source = _source(args, *placement(args))
    if args.html:
        rec = record(source, heads=args.heads, max_rows=args.max_tokens)
        size = write_html(rec, args.html, overwrite=args.overwrite)
        print(
            f"{len(rec.layer_names)} layers x {rec.num_heads} heads ({len(rec.stored)} full "
            f"maps, {len(rec.rows)} of {len(rec.queries)} query rows) written to {args.html}: "
            f"{size / MB:.2f} MB"
        )
        if size > LARGE:
            print(
                f"mhsa viz: {args.html} is over {LARGE // MB} MB: pass --heads or a smaller "
                "--max-tokens",
                file=sys.stderr,
            )
    if out:
        maps = _full_maps(source)
        title = f"{source.title}: {args.text!r}" if args.text else f"{source.title}: {source.note}"
        plot_maps(
            maps,
            source.queries,
            out,
            title=title,
            key_labels=None if source.keys is None else source.keys[: source.key_limit],
            layer_names=[name for name, _ in source.layers],
            overwrite=args.overwrite,
        )
        print(f"{len(maps)} layers x {maps[0].shape[1]} heads written to {out}")
    return 0


def _check_outputs(png: str | None, html: str | None, overwrite: bool) -> None:
    """Refuse outputs that could not be written, or that would replace a file without
    --overwrite, before any model loads."""
    from pathlib import Path

    if png and html and Path(png).absolute() == Path(html).absolute():
        raise ValueError(f"--out and --html name the same file ({png}): give them two names")
    for flag, path in (("--out", png), ("--html", html)):
        if path:
            check_output(flag, path, overwrite=overwrite)
    if png and Path(png).suffix.lower().lstrip(".") not in IMAGE_FORMATS:
        raise ValueError(
            f"--out {png}: name an image file ({', '.join('.' + f for f in IMAGE_FORMATS)}), "
            "e.g. maps.png"
        )


def _source(args: argparse.Namespace, device, dtype):
    """The model's Source for this input (mhsa.apps.viz.sources), its model loaded the way
    the model's own command loads it, on device in dtype."""
    from ..apps.viz import chat_source, gpt_source, minilm_source, whisper_source

    placed = {"device": device, "dtype": dtype}
    if args.model == "gpt":
        model, name = _gpt(args)
        return gpt_source(model.to(**placed), _required_text(args), name=name)
    if args.model == "chat":
        from ..apps.chat import load_chat_model

        return chat_source(load_chat_model(args.source, **placed), _required_text(args))
    if args.model == "minilm":
        if args.source is not None:
            raise ValueError("--model minilm takes no file: it is the packaged all-MiniLM-L6-v2")
        text = _required_text(args)
        return minilm_source(_packaged(lambda: _sentence_encoder(**placed)), text)
    if args.source is None:
        raise ValueError("--model whisper needs a WAV file: mhsa viz --model whisper FILE.wav")
    from ..apps.transcribe import load_whisper

    return whisper_source(_packaged(lambda: load_whisper(**placed)), args.source, args.text)


def _gpt(args: argparse.Namespace) -> tuple:
    """(model, name) of the GPT checkpoint args.source."""
    from ..models import GPT, GPTConfig
    from .common import load_model

    if args.source is None:
        raise ValueError(
            "pass a GPT checkpoint folder (mhsa train gpt --out), or --model "
            f"{'|'.join(MODELS[1:])}"
        )
    model, state = load_model(args.source, {"gpt": (GPT, GPTConfig)})
    return model, str(state["path"])


def _required_text(args: argparse.Namespace) -> str:
    if args.text is None:
        raise ValueError(f"--model {args.model} needs --text: the text whose attention to show")
    return args.text


def _sentence_encoder(**placed):
    from ..apps.embed import SentenceEncoder

    return SentenceEncoder(**placed)


def _packaged(load):
    """load(), with a missing weights package or tokenizer as a one-line exit."""
    try:
        return load()
    except RuntimeError as error:
        raise SystemExit(f"mhsa viz: {error}") from error


def _full_maps(source) -> list:
    """Every layer's (1, H, L, S) probabilities, for the PNG (keys past key_limit cut)."""
    from ..apps.viz import capture

    maps: list = []

    def keep(_: int, module, args: tuple, kwargs: dict) -> None:
        maps.append(module.attention_map(*args, **kwargs)[..., : source.key_limit])

    capture([module for _, module in source.layers], source.run, keep)
    return maps


def add_parser(commands) -> None:
    cmd = commands.add_parser(
        "viz", help="attention maps of one input: a PNG grid or an interactive HTML explorer"
    )
    cmd.add_argument(
        "source",
        nargs="?",
        default=None,
        help="gpt: the output folder of `mhsa train gpt` (or a step folder); chat: a .gguf "
        "file or transformers folder (default the packaged SmolLM2); whisper: a WAV file",
    )
    cmd.add_argument(
        "--model",
        default="gpt",
        help=f"which model: {', '.join(MODELS)} (default gpt: a checkpoint)",
    )
    cmd.add_argument(
        "--text",
        default=None,
        help="the text whose attention is drawn (whisper: default its own transcript)",
    )
    cmd.add_argument(
        "--out", default=None, help="the PNG file to write (maps.png when neither --out nor --html)"
    )
    cmd.add_argument(
        "--html", default=None, help="the interactive explorer to write: one self-contained file"
    )
    cmd.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out or --html file"
    )
    cmd.add_argument(
        "--heads",
        default=None,
        help="the heads whose full maps the HTML keeps: indices for every layer and/or "
        "LAYER:HEAD pairs, e.g. 0,3 or 2:5,4:1 (default all; the grid and summary show all)",
    )
    add_option(
        cmd,
        "--max-tokens",
        256,
        "the HTML keeps the full maps' rows of at most this many query tokens, "
        "evenly spread, first and last included",
        type=positive_int,
    )
    device_options(cmd)
    threads_option(cmd)
    cmd.set_defaults(run=viz)
