"""`mhsa train MODEL`: train a model on built-in data with the one training loop."""

from __future__ import annotations

import argparse
import sys

from .checks import check_model_flags, check_output, flag_errors
from .common import (
    add_option,
    common_train_options,
    positive_int,
    size_options,
    train_config,
    with_threads,
)
from .device import placement
from .train_tasks import (
    device_line,
    speed,
    steps_made,
    train_ast,
    train_bert,
    train_points,
    train_translate,
    train_vit,
)


def train_gpt(args: argparse.Namespace) -> int:
    """Train a byte-level GPT on the standard library's source (or --data FILE)."""
    from ..apps.train import check_resumable, load_checkpoint, train
    from ..apps.train.throughput import flops_per_token
    from ..data.text import (
        ByteTokenizer,
        PackedTextTask,
        TextTask,
        describe_loss,
        read_text,
        stdlib_corpus,
    )
    from ..launch import join_torchrun_group
    from ..models import GPT, GPTConfig

    join_torchrun_group()  # a no-op unless started by torchrun with several processes
    tokenizer = ByteTokenizer()
    text = read_text(args.data) if args.data else stdlib_corpus()
    with flag_errors():
        config = GPTConfig(
            vocab_size=tokenizer.vocab_size,
            n_layer=args.layers,
            n_head=args.heads,
            n_kv_head=args.kv_heads,
            d_model=args.d_model,
            max_len=args.seq_len,
            dropout=args.dropout,
            position=args.position,
            window=args.window,
            attention=args.attention,
            moba_block=args.moba_block,
            moba_top_k=args.moba_top_k,
        )
    if args.resume:  # the checkpoint's model, not the command line's
        saved = load_checkpoint(args.out, weights=False)
        check_resumable(saved, "gpt")
        config = GPTConfig.from_dict(saved["info"]["config"])
    tokens = tokenizer.encode(text)
    stream = TextTask(tokens, config.max_len, args.batch_size)
    task = (
        PackedTextTask.from_stream(tokens, config.max_len, args.batch_size) if args.pack else stream
    )
    model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    baseline = stream.unigram_loss(tokenizer.vocab_size)
    print(
        f"data: {'--data ' + args.data if args.data else 'Python standard library source'}, "
        f"{len(stream.train):,} train / {len(stream.val):,} validation tokens ({tokenizer.name})"
    )
    if args.pack:
        print(
            f"packed: {len(task.train):,} documents (split at blank lines, at most "
            f"{config.max_len} tokens) in rows of {task.max_tokens} tokens"
        )
    print(
        f"model: GPT {config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads, "
        f"{config.position} positions, {config.attention} attention, "
        f"{params / 1e6:.2f}M parameters"
    )
    print(device_line(args))
    run_config = train_config(args, args.lr)
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": tokenizer.name}
    result = train(
        model,
        task,
        run_config,
        args.out,
        model_info=info,
        resume=args.resume,
        overwrite=args.overwrite,
        stop_after=args.stop_after,
        context_parallel="zigzag" if args.context_parallel else None,
        flops_per_token=flops_per_token(model, config.max_len),
    )
    final = describe_loss(result["history"][-1]["val_loss"]) if result["history"] else None
    print(
        f"validation loss {final or 'not evaluated yet'}; "
        f"unigram baseline {describe_loss(baseline)}"
    )
    print(
        f"{steps_made(result)} in {result['seconds']:.0f} s ({speed(result)}); "
        f"checkpoint: {args.out}"
    )
    return 0


def _spawn_data_parallel(args: argparse.Namespace, nproc: int) -> int:
    """Run the command in nproc local processes, one process group (gloo on CPU)."""
    from ..launch import RankFailed, run_local

    if getattr(args, "pack", False):
        raise ValueError("--pack trains in one process: drop --nproc (or --pack)")
    if args.context_parallel:
        if args.seq_len % (2 * nproc):
            raise ValueError(
                f"--seq-len {args.seq_len} must be a multiple of 2 x --nproc "
                f"({2 * nproc}) to shard sequences (zigzag)"
            )
        if args.position in ("alibi", "t5"):
            raise ValueError(
                "--context-parallel works with learned, sinusoidal and rotary "
                f"positions, not {args.position}"
            )
        if getattr(args, "dropout", 0.0) > 0:
            raise ValueError(
                "--context-parallel attends across processes (ring attention), which "
                f"takes no attention dropout: pass --dropout 0 (got {args.dropout})"
            )
    elif args.batch_size % nproc:
        raise ValueError(
            f"--batch-size {args.batch_size} must be divisible by --nproc {nproc}: each "
            "process trains on an equal share of every batch"
        )
    args.nproc = 1  # inside the group each worker trains as one rank of it
    threads = args.threads = max(1, args.threads // nproc)  # --threads is for them all
    try:
        return run_local(_run_as_rank, nproc, args, timeout=None, threads=threads, quiet=True)[0]
    except RankFailed as failure:  # a bad argument or file, as one process says it
        if failure.kind in ("ValueError", "FileNotFoundError"):
            raise ValueError(failure.message) from None
        raise


def _run_as_rank(rank: int, world_size: int, args: argparse.Namespace) -> int:
    return args.run(args)


@with_threads
def run(args: argparse.Namespace) -> int:
    """Train in this process, or in --nproc local processes (data or context parallel).
    A diverged run or Ctrl-C ends with a one-line message naming the latest checkpoint."""
    import torch

    from ..apps.train import TrainingDiverged, check_out_dir
    from ..checkpoint import latest_checkpoint

    check_output("--out", args.out, folder=True)  # before loading data and model
    check_out_dir(args.out, args.resume, args.overwrite)
    check_model_flags(args)
    device, _ = placement(args, training=True)  # a device or dtype it cannot use: said now
    if device.type == "cuda" and getattr(args, "nproc", 1) > 1:
        raise ValueError(
            f"--nproc {args.nproc} runs CPU processes (gloo): on GPUs launch one process per "
            "GPU with torchrun --nproc-per-node N -m mhsa.cli train ..., or pass --device cpu"
        )
    try:
        if getattr(args, "data_parallel", False) and args.nproc > 1:
            return _spawn_data_parallel(args, args.nproc)
        torch.manual_seed(args.seed)  # each rank of a group seeds alike
        return args.train(args)
    except TrainingDiverged as error:
        print(f"\nmhsa train: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        latest = latest_checkpoint(args.out)
        where = f"the latest checkpoint is {latest}" if latest else "no checkpoint was written"
        print(f"\nmhsa train: interrupted; {where}", file=sys.stderr)
        return 130


PACK_HELP = (
    "pack sequences of their own lengths into rows of --batch-size x --seq-len tokens "
    "without padding (each attends only itself; no loss crosses a boundary)"
)


def add_parser(commands) -> None:
    train_parser = commands.add_parser("train", help="train a model on built-in data")
    train_models = train_parser.add_subparsers(dest="model", required=True)
    gpt = train_models.add_parser("gpt", help="byte-level GPT on Python's own source code")
    gpt.add_argument("--data", help="a text file to train on instead")
    common_train_options(gpt, steps=600, out="runs/gpt")
    size_options(gpt, batch_size=24, layers=4, heads=4, d_model=192, lr=2e-3)
    add_option(
        gpt,
        "--seq-len",
        128,
        "tokens per training sequence, the longest context",
        type=positive_int,
    )
    gpt.add_argument(
        "--kv-heads",
        type=positive_int,
        help="key/value heads for grouped-query attention (default: --heads)",
    )
    add_option(gpt, "--dropout", 0.0, "dropout rate", type=float)
    add_option(
        gpt,
        "--position",
        "rotary",
        "positional information; t5 is a learned relative bias",
        choices=["learned", "sinusoidal", "rotary", "alibi", "t5"],
    )
    gpt.add_argument("--window", type=positive_int, help="sliding-window attention span")
    add_option(
        gpt,
        "--attention",
        "standard",
        "each layer's self-attention: multi-head, differential (DiffAttention), MoBA or "
        "multi-head latent attention (LatentAttention)",
        choices=["standard", "diff", "moba", "latent"],
    )
    add_option(gpt, "--moba-block", 32, "MoBA: positions per block", type=positive_int)
    add_option(gpt, "--moba-top-k", 2, "MoBA: earlier blocks each block attends", type=positive_int)
    add_option(
        gpt,
        "--nproc",
        1,
        "data-parallel processes (DistributedDataParallel; gloo on CPU); or launch with torchrun",
        type=positive_int,
    )
    gpt.add_argument(
        "--context-parallel",
        action="store_true",
        help="with --nproc: shard each sequence across the processes "
        "(zigzag), attend with ring attention",
    )
    gpt.add_argument("--pack", action="store_true", help=PACK_HELP)
    gpt.set_defaults(run=run, train=train_gpt, data_parallel=True)

    bert = train_models.add_parser("bert", help="masked-LM BERT on Python's own source code")
    common_train_options(bert, steps=300, out="runs/bert")
    bert.add_argument("--data", help="a text file to train on instead")
    size_options(bert, batch_size=16, layers=4, heads=4, d_model=192, lr=1e-3)
    add_option(bert, "--seq-len", 128, "tokens per training sequence", type=positive_int)
    bert.add_argument("--pack", action="store_true", help=PACK_HELP)
    bert.set_defaults(run=run, train=train_bert)

    vit = train_models.add_parser("vit", help="ViT on sklearn's digits (or --data DIR)")
    common_train_options(vit, steps=6000, out="runs/vit", eval_every=1000)
    vit.add_argument("--data", help="a folder with one sub-folder of images per class")
    add_option(
        vit, "--image-size", 32, "with --data: images are resized to this side", type=positive_int
    )
    vit.add_argument("--channels", type=int, default=1, choices=[1, 3], help="with --data")
    add_option(
        vit, "--patch-size", 2, "side of the square patches, one token each", type=positive_int
    )
    size_options(vit, batch_size=64, layers=4, heads=4, d_model=64, lr=2e-3)
    add_option(vit, "--dropout", 0.0, "dropout rate", type=float)
    vit.set_defaults(run=run, train=train_vit)

    ast = train_models.add_parser("ast", help="AST on spoken digits synthesised by espeak-ng")
    common_train_options(ast, steps=1000, out="runs/ast", eval_every=250)
    ast.add_argument(
        "--voices", type=positive_int, default=84, help="how many voices (of 84; default 84)"
    )
    add_option(ast, "--per-voice", 3, "clips per digit and voice", type=positive_int)
    size_options(ast, batch_size=32, layers=4, heads=4, d_model=96, lr=1e-3)
    ast.set_defaults(run=run, train=train_ast)

    points = train_models.add_parser("points", help="point-cloud transformer on built-in shapes")
    common_train_options(points, steps=2000, out="runs/points", eval_every=250)
    add_option(points, "--per-class", 1000, "training clouds per shape", type=positive_int)
    size_options(points, batch_size=32, layers=3, heads=4, d_model=96, lr=2e-3)
    add_option(
        points,
        "--pooling",
        "attention",
        "how point features become one vector",
        choices=["attention", "mean", "max"],
    )
    points.set_defaults(run=run, train=train_points)

    trans = train_models.add_parser("translate", help="English -> French numbers (seq2seq)")
    common_train_options(trans, steps=800, out="runs/translate", eval_every=200)
    size_options(trans, batch_size=64, layers=3, heads=4, d_model=128, lr=1e-3)
    add_option(trans, "--dropout", 0.1, "dropout rate", type=float)
    trans.set_defaults(run=run, train=train_translate)
