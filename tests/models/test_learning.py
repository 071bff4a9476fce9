"""Every model learns its built-in task: a few dozen seeded training steps of a small
configuration lower the validation loss by a stated fraction.

The GPT's learning test is in test_train.py. Each bound below is about half-way
between the untrained loss and the loss measured after training, so a training
step that does not update the weights, or a model that cannot see its input, fails."""

from __future__ import annotations

import math

import pytest
import torch

from mhsa.apps.train import TrainConfig, evaluate, train
from optional import needs, needs_program


def learn(model, task, tmp_path, *, steps: int, lr: float) -> tuple[float, float]:
    """(validation loss before, after) `steps` training steps."""
    before = evaluate(model, task)
    config = TrainConfig(steps=steps, lr=lr, warmup=2, eval_every=steps, checkpoint_every=steps)
    result = train(
        model, task, config, tmp_path / "run", model_info={"model": "test"}, log=lambda *_: None
    )
    return before, result["history"][-1]["val_loss"]


@pytest.mark.slow
def test_bert_learns_masked_bytes(tmp_path):
    """Untrained 5.6 (about ln 258); measured 2.8 after 30 steps on repetitive text."""
    from mhsa.data.text import MaskedLMTask
    from mhsa.models.bert import Bert, BertConfig

    torch.manual_seed(0)
    text = "def double(x):\n    return x * 2  # twice x\n" * 100
    task = MaskedLMTask(torch.tensor(list(text.encode())), 32, batch_size=16, eval_batches=2)
    config = BertConfig(
        vocab_size=MaskedLMTask.VOCAB,
        d_model=32,
        n_layer=1,
        n_head=2,
        d_ff=64,
        max_len=32,
        pad_token_id=MaskedLMTask.PAD,
    )
    before, after = learn(Bert(config), task, tmp_path, steps=30, lr=1e-2)
    assert before > 0.9 * math.log(MaskedLMTask.VOCAB)
    assert after < 0.6 * before, (before, after)


@pytest.mark.slow
def test_vit_learns_digits(tmp_path):
    """Untrained 2.6 (about ln 10); measured 0.87 after 120 steps."""
    needs("sklearn")
    from mhsa.data.classify import ClassificationTask, digits, split
    from mhsa.models.vit import ViT, ViTConfig

    torch.manual_seed(0)
    images, labels = digits()
    train_split, test_split = split(images, labels, 0.2, seed=0)
    task = ClassificationTask(train_split, test_split, 32)
    config = ViTConfig(image_size=8, patch_size=2, d_model=32, n_layer=1, n_head=2, dropout=0.0)
    before, after = learn(ViT(config), task, tmp_path, steps=120, lr=1e-2)
    assert before > 0.8 * math.log(10)
    assert after < 0.5 * before, (before, after)


@pytest.mark.slow
def test_point_cloud_transformer_learns_shapes(tmp_path):
    """Untrained 1.8 (about ln 6); measured 0.88 after 120 steps."""
    from mhsa.data.classify import ClassificationTask
    from mhsa.data.shapes import SHAPES, collate, dataset
    from mhsa.models.points import PointCloudConfig, PointCloudTransformer

    torch.manual_seed(0)
    task = ClassificationTask(dataset(40, seed=0), dataset(10, seed=10_000), 32, collate=collate)
    config = PointCloudConfig(num_classes=len(SHAPES), d_model=32, n_layer=1, n_head=2)
    before, after = learn(PointCloudTransformer(config), task, tmp_path, steps=120, lr=3e-3)
    assert before > 0.8 * math.log(len(SHAPES))
    assert after < 0.6 * before, (before, after)


@pytest.mark.slow
def test_seq2seq_learns_number_translation(tmp_path):
    """Untrained 4.1 (ln 63, the vocabulary size); measured 1.6 after 80 steps."""
    needs("num2words")
    from mhsa.data.numbers import NumberTranslationTask
    from mhsa.models.seq2seq import Seq2Seq, Seq2SeqConfig

    torch.manual_seed(0)
    task = NumberTranslationTask(32, test_size=100, seed=0)
    vocab = len(task.vocab)
    config = Seq2SeqConfig(
        src_vocab=vocab,
        tgt_vocab=vocab,
        d_model=32,
        n_head=2,
        n_encoder_layer=1,
        n_decoder_layer=1,
        dropout=0.0,
        max_len=32,
    )
    before, after = learn(Seq2Seq(config), task, tmp_path, steps=80, lr=1e-2)
    assert before > 0.8 * math.log(vocab)
    assert after < 0.6 * before, (before, after)


@pytest.mark.slow
def test_ast_learns_spoken_digits(tmp_path):
    """Untrained 2.6 (about ln 10); measured 1.33 after 80 steps, tested on a voice
    never heard in training."""
    needs_program("espeak-ng")
    from mhsa.data.classify import ClassificationTask
    from mhsa.data.speech import log_mel, normalise_clips, synthesize, voices
    from mhsa.models.ast import AST, ASTConfig

    torch.manual_seed(0)
    audio, labels, speakers = synthesize(3, seed=0, voice_list=voices()[::12][:6])
    features = normalise_clips(log_mel(audio))
    test = speakers == 0
    config = ASTConfig(
        n_mels=features.shape[1],
        frames=features.shape[2],
        d_model=32,
        n_layer=1,
        n_head=2,
        dropout=0.0,
    )
    task = ClassificationTask((features[~test], labels[~test]), (features[test], labels[test]), 32)
    before, after = learn(AST(config), task, tmp_path, steps=80, lr=3e-3)
    assert before > 0.8 * math.log(10)
    assert after < 0.7 * before, (before, after)
