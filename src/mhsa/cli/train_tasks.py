"""The training commands of the models other than GPT (`mhsa train vit|bert|ast|points|
translate`), and `fit`, the shared loop with the common options that each calls."""

from __future__ import annotations

import argparse
import math

from .checks import FLAGS, build_model
from .common import train_config


def device_line(args: argparse.Namespace) -> str:
    """The run's device line, of --device and --dtype: device: cuda:0 (NVIDIA H200),
    bfloat16 autocast (float32 weights)."""
    from .device import describe, placement

    device, dtype = placement(args, training=True)
    if device.type == "cuda":
        import torch

        if device.index is None:  # the current GPU, as the loop takes it
            device = torch.device("cuda", torch.cuda.current_device())
        text = describe(device, dtype, training=True)
        name = torch.cuda.get_device_name(device)
        return "device: " + text.replace(f"{device},", f"{device} ({name}),", 1)
    return f"device: {describe(device, dtype, training=True)}"


def speed(result: dict) -> str:
    """The run's speed, of train()'s result with flops_per_token (tokens: the task's
    items): 45.1k tokens/s, MFU 2.1% of the float32 matmul measured at start, 95.3
    GFLOP/s on cpu."""
    text = f"{result['tokens_per_second'] / 1e3:.1f}k tokens/s"
    if "mfu" in result:
        text += f", MFU {result['mfu']:.1%} of {result['matmul'].describe()}"
    return text


def steps_made(result: dict) -> str:
    """The steps this run made, of train()'s result: "600 steps", or after a resume
    "500 steps (101 to 600)" (its seconds and tokens/s count those alone)."""
    made, last = result["steps_this_run"], result["step"]
    if made == last:
        return f"{made} steps"
    return f"{made} steps ({last - made + 1} to {last})" if made else "0 steps (already done)"


def fit(model, task, args: argparse.Namespace, kind: str, **info) -> dict:
    """Run the shared training loop with the common command-line options; the checkpoint's
    info is the model's kind, its config and the extra info (classes, vocab)."""
    from ..apps.train import train
    from ..apps.train.throughput import flops_per_token

    params = sum(p.numel() for p in model.parameters())
    print(f"model: {kind}, {params / 1e6:.3f}M parameters")
    print(device_line(args))
    context = task.tokens_per_batch() // args.batch_size  # tokens (items) of one sample
    result = train(
        model,
        task,
        train_config(args, args.lr),
        args.out,
        model_info={"model": kind, "config": model.config.to_dict(), **info},
        resume=args.resume,
        overwrite=args.overwrite,
        stop_after=args.stop_after,
        flops_per_token=flops_per_token(model, context),
    )
    last = result["history"][-1] if result["history"] else {}
    accuracy = f", test accuracy {last['test_acc']:.2%}" if "test_acc" in last else ""
    loss = f"{last['val_loss']:.4f}" if "val_loss" in last else "not evaluated yet"
    print(
        f"{steps_made(result)} in {result['seconds']:.0f} s ({speed(result)}); validation loss "
        f"{loss}{accuracy}; checkpoint: {args.out}"
    )
    return result


def train_vit(args: argparse.Namespace) -> int:
    """A ViT on sklearn's bundled digits (or --data DIR of class sub-folders)."""
    from ..data.classify import ClassificationTask, digits, image_folder, shift_augment, split
    from ..models.vit import ViT, ViTConfig

    if args.data:
        images, labels, classes = image_folder(args.data, args.image_size, args.channels)
    else:
        images, labels = digits()
        classes = [str(d) for d in range(10)]
    side = "--image-size" if args.data else "the digits' side"  # (--image-size is for --data)
    config, model = build_model(
        ViT,
        ViTConfig,
        {**FLAGS, "image_size": side},
        image_size=images.shape[-1],
        patch_size=args.patch_size,
        channels=images.shape[1],
        num_classes=int(labels.max()) + 1,
        d_model=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        dropout=args.dropout,
    )
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
    fit(model, task, args, "vit", classes=classes)
    return 0


def train_bert(args: argparse.Namespace) -> int:
    """Masked-language-model pretraining of a small BERT on the standard library's source."""
    import torch

    from ..apps.train import evaluate
    from ..data.text import MaskedLMTask, read_text, stdlib_corpus
    from ..models.bert import Bert, BertConfig
    from .device import placement

    text = read_text(args.data) if args.data else stdlib_corpus()
    task = MaskedLMTask(
        torch.tensor(list(text.encode("utf-8"))), args.seq_len, args.batch_size, pack=args.pack
    )
    config, model = build_model(
        Bert,
        BertConfig,
        vocab_size=MaskedLMTask.VOCAB,
        d_model=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        d_ff=4 * args.d_model,
        max_len=args.seq_len,
        dropout=0.1,
        pad_token_id=MaskedLMTask.PAD,
    )
    device, dtype = placement(args, training=True)
    start = evaluate(model.to(device), task, dtype)
    print(
        f"data: {'--data ' + args.data if args.data else 'Python standard library source'}; "
        f"15% of tokens selected (80/10/10), {'packed' if args.pack else 'key padding'}; "
        "validation MLM loss at start "
        f"{start:.4f}"
    )
    result = fit(model, task, args, "bert")
    end = result["history"][-1]["val_loss"] if result["history"] else float("nan")
    print(f"validation MLM loss: {start:.4f} at start -> {end:.4f}")
    return 0


def train_ast(args: argparse.Namespace) -> int:
    """An Audio Spectrogram Transformer on spoken digits synthesised with espeak-ng."""
    import torch

    from ..data.classify import ClassificationTask
    from ..data.speech import WORDS, log_mel, normalise_clips, synthesize, voices
    from ..models.ast import AST, ASTConfig

    voice_list = voices()
    order = torch.randperm(len(voice_list), generator=torch.Generator().manual_seed(args.seed))
    voice_list = [voice_list[i] for i in order[: args.voices].tolist()]
    held_out = max(1, len(voice_list) // 5)
    print(
        f"synthesising {len(voice_list) * 10 * args.per_voice} clips with espeak-ng "
        f"({len(voice_list)} voices, {held_out} held out for testing) ..."
    )
    audio, labels, speakers = synthesize(args.per_voice, args.seed, voice_list)
    features = normalise_clips(log_mel(audio))
    test = speakers < held_out  # whole voices, never heard in training
    config, model = build_model(
        AST,
        ASTConfig,
        n_mels=features.shape[1],
        frames=features.shape[2],
        d_model=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
    )
    task = ClassificationTask(
        (features[~test], labels[~test]),
        (features[test], labels[test]),
        args.batch_size,
        items_per_sample=math.prod(config.grid()),  # the patches the encoder runs
    )
    fit(model, task, args, "ast", classes=list(WORDS))
    return 0


def train_points(args: argparse.Namespace) -> int:
    """A point-cloud transformer on built-in randomly posed shapes."""
    from ..data.classify import ClassificationTask
    from ..data.shapes import SHAPES, collate, dataset
    from ..models.points import PointCloudConfig, PointCloudTransformer

    train_split = dataset(args.per_class, seed=args.seed)
    test_split = dataset(max(20, args.per_class // 5), seed=args.seed + 10_000)
    print(
        f"data: {len(SHAPES)} shapes ({', '.join(SHAPES)}), {len(train_split[1])} train / "
        f"{len(test_split[1])} test clouds of 96-160 points"
    )
    config, model = build_model(
        PointCloudTransformer,
        PointCloudConfig,
        num_classes=len(SHAPES),
        d_model=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        pooling=args.pooling,
    )
    task = ClassificationTask(
        train_split, test_split, args.batch_size, collate=collate, items_per_sample=128
    )
    fit(model, task, args, "points", classes=list(SHAPES))
    return 0


def train_translate(args: argparse.Namespace) -> int:
    """The encoder-decoder Transformer on English -> French numbers (num2words)."""
    from ..data.numbers import NumberTranslationTask
    from ..models.seq2seq import Seq2Seq, Seq2SeqConfig

    task = NumberTranslationTask(args.batch_size, seed=args.seed)
    vocab = len(task.vocab)
    print(
        f"data: numbers 0..999999 in English -> French (num2words), {vocab} words; "
        f"{len(task.test_numbers)} held-out numbers never seen in training"
    )
    config, model = build_model(
        Seq2Seq,
        Seq2SeqConfig,
        src_vocab=vocab,
        tgt_vocab=vocab,
        d_model=args.d_model,
        n_head=args.heads,
        n_encoder_layer=args.layers,
        n_decoder_layer=args.layers,
        dropout=args.dropout,
        max_len=32,
    )
    result = fit(model, task, args, "seq2seq", vocab=task.vocab.words)
    last = result["history"][-1] if result["history"] else {}
    if "exact_match" in last:
        print(f"held-out exact match (greedy): {last['exact_match']:.2%}")
    return 0
