"""Packed rows through whole models: GPT (every position kind, with and without a
window), Llama (grouped-query heads, a sliding window on some layers), BERT and a ViT
with images of different sizes give, packed, what each sequence gives alone: the
outputs, the loss and every weight's gradient, in float64 and float32; nothing leaks
between sequences (mhsa.testing.assert_no_cross_document_leak); a row of 1000 short
sequences; and the known failure modes of packing: an all-ones 2-D mask, position_ids
alone, sequences of length 1 and 0, sequences longer than the window, and the
arguments that contradict each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import expect_error, max_error
from mhsa.models import GPT, Bert, BertConfig, GPTConfig, Llama, LlamaConfig, ViT, ViTConfig
from mhsa.models.packing import IGNORE, next_token_targets
from mhsa.testing import assert_no_cross_document_leak

LENGTHS = [5, 1, 0, 17, 9, 1]  # a single token, an empty sequence, longer than the window
VOCAB = 50
# (forward, gradients): the bounds in float32; float64 is near exact (Llama's
# RMSNorm and rotary tables compute in float32, hence its float64 floor)
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-9, 1e-7)}
DTYPES = [torch.float64, torch.float32]


def offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each non-empty sequence."""
    return [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True) if b > a]


def gpt(dtype=torch.float64, **options) -> GPT:
    config = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, max_len=32, **options)
    return GPT(config).to(dtype)


def llama(dtype=torch.float64) -> Llama:
    config = LlamaConfig(
        vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        d_ff=48,
        sliding_window=4,
        window_layers=(1,),
    )
    return Llama(config).to(dtype)


def bert(dtype=torch.float64) -> Bert:
    config = BertConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layer=2,
        n_head=4,
        d_ff=48,
        max_len=32,
        dropout=0.0,
    )
    return Bert(config).to(dtype)


def vit(dtype=torch.float64) -> ViT:
    config = ViTConfig(image_size=8, patch_size=2, d_model=32, n_layer=2, n_head=4, dropout=0.0)
    return ViT(config).to(dtype)


def weight_grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same(packed, alone, dtype, what):
    forward, gradient = TOLERANCE[dtype]
    if isinstance(packed, dict):
        assert packed.keys() == alone.keys(), what
        for name in packed:
            scale = max(1.0, alone[name].abs().max().item())
            assert max_error(packed[name], alone[name]) < gradient * scale, (what, name)
    else:
        scale = max(1.0, alone.abs().max().item())
        assert max_error(packed, alone) < forward * scale, what


def check_causal_lm(model, dtype, lengths=LENGTHS, **packing):
    """Logits, loss (mean over every sequence's next-token targets) and weight gradients
    of a packed row against each sequence alone."""
    cu = offsets(lengths)
    idx = torch.randint(0, VOCAB, (1, int(cu[-1])))
    targets = next_token_targets(idx, cu)
    logits = model(idx, **packing(cu) if callable(packing) else {"cu_seqlens": cu})
    loss = F.cross_entropy(logits[0], targets[0], reduction="sum")
    packed_grads = weight_grads(model, loss)
    alone_logits, alone_loss = [], 0.0
    for a, b in spans(cu):
        out = model(idx[:, a:b])
        alone_logits.append(out)
        # alone, a sequence's last token predicts nothing: the packed targets say so
        alone_loss = alone_loss + F.cross_entropy(out[0, :-1], idx[0, a + 1 : b], reduction="sum")
    alone_grads = weight_grads(model, alone_loss)
    assert_same(logits.detach(), torch.cat(alone_logits, 1).detach(), dtype, "logits")
    assert_same(loss.detach(), alone_loss.detach(), dtype, "loss")
    assert_same(packed_grads, alone_grads, dtype, "gradients")
    return idx, cu


GPT_CASES = [
    {"position": "learned"},
    {"position": "sinusoidal"},
    {"position": "rotary", "n_kv_head": 2},
    {"position": "alibi"},
    {"position": "t5"},
    {"position": "rotary", "window": 4},
    {"position": "alibi", "window": 4},
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", GPT_CASES, ids=lambda o: "-".join(map(str, o.values())))
def test_gpt_packed_equals_each_sequence_alone(options, dtype):
    check_causal_lm(gpt(dtype, **options), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_packed_equals_each_sequence_alone(dtype):
    check_causal_lm(llama(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bert_packed_equals_each_sequence_alone(dtype):
    model = bert(dtype)
    cu = offsets(LENGTHS)
    ids = torch.randint(0, VOCAB, (1, int(cu[-1])))
    labels = torch.where(torch.rand(ids.shape) < 0.5, ids, IGNORE)
    hidden = model(ids, cu_seqlens=cu)
    loss = model.loss(ids, None, labels, cu_seqlens=cu) * (labels != IGNORE).sum()
    packed_grads = weight_grads(model, loss)
    alone_hidden, alone_loss = [], 0.0
    for a, b in spans(cu):
        alone_hidden.append(model(ids[:, a:b]))
        logits = model.mlm_logits(alone_hidden[-1])[0]
        alone_loss = alone_loss + F.cross_entropy(logits, labels[0, a:b], reduction="sum")
    alone_grads = weight_grads(model, alone_loss)
    assert_same(hidden.detach(), torch.cat(alone_hidden, 1).detach(), dtype, "hidden")
    assert_same(loss.detach(), alone_loss.detach(), dtype, "loss")
    assert_same(packed_grads, alone_grads, dtype, "gradients")


SIZES = [(8, 8), (4, 6), (2, 2), (10, 4), (6, 12)]  # 17, 7, 2, 11 and 19 tokens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vit_with_different_patch_counts_packed_equals_each_image_alone(dtype):
    model = vit(dtype)
    images = [torch.randn(1, h, w, dtype=dtype) for h, w in SIZES]
    labels = torch.randint(0, 10, (len(images),))
    logits = model.packed(images)
    packed_grads = weight_grads(model, F.cross_entropy(logits, labels, reduction="sum"))
    alone = torch.cat([model(image.unsqueeze(0)) for image in images])
    alone_grads = weight_grads(model, F.cross_entropy(alone, labels, reduction="sum"))
    assert_same(logits.detach(), alone.detach(), dtype, "logits")
    assert_same(packed_grads, alone_grads, dtype, "gradients")


def with_embedding_input(model, embedding, call):
    """model_fn for the leak test: call(batch) with batch["e"] (total, d) added to the
    token embeddings, a float input whose gradients the leak test also checks."""

    def model_fn(batch):
        handle = embedding.register_forward_hook(lambda module, args, out: out + batch["e"])
        try:
            return call(batch)[0]
        finally:
            handle.remove()

    return model_fn


def test_no_leak_in_any_model():
    """The leak test on every model: token ids and a float input added to their
    embeddings perturbed (outputs, and gradients for the float input, must not move
    across documents); for the ViT its packed tokens."""
    cu = offsets(LENGTHS)
    total = int(cu[-1])
    ids = torch.randint(0, VOCAB, (total,))
    batch = {"idx": ids, "e": torch.zeros(total, 32, dtype=torch.float64), "cu_seqlens": cu}
    for model in (gpt(position="rotary"), gpt(position="t5", window=4), gpt(), llama(), bert()):
        embedding = getattr(model, "tok_emb", None) or getattr(model, "embed", None)
        embedding = embedding or model.word_emb
        model_fn = with_embedding_input(
            model, embedding, lambda b, m=model: m(b["idx"][None], cu_seqlens=cu)
        )
        assert_no_cross_document_leak(model_fn, batch)
    model = vit()
    images = [torch.randn(1, h, w, dtype=torch.float64) for h, w in SIZES]
    tokens = torch.cat([model.embed(image.unsqueeze(0))[0] for image in images]).detach()
    cu_images = offsets([1 + h * w // 4 for h, w in SIZES])
    assert_no_cross_document_leak(
        lambda b: model.encode(b["x"][None], b["cu_seqlens"])[0],
        {"x": tokens, "cu_seqlens": cu_images},
    )


def test_the_leak_test_catches_a_model_without_packing():
    """The same check fails where the row is not packed (one sequence over all)."""
    cu = offsets(LENGTHS)
    model = gpt(position="rotary")
    batch = {"idx": torch.randint(0, VOCAB, (int(cu[-1]),)), "cu_seqlens": cu}
    with pytest.raises(AssertionError, match="crosses document boundaries"):
        assert_no_cross_document_leak(lambda b: model(b["idx"][None])[0], batch)


def test_a_thousand_short_sequences():
    """1000 sequences of 0..6 tokens in one row of a GPT (float32): logits, loss and
    gradients as alone, and no leak."""
    lengths = torch.randint(0, 7, (1000,), generator=torch.Generator().manual_seed(5)).tolist()
    model = gpt(torch.float32, position="rotary")
    idx, cu = check_causal_lm(model, torch.float32, lengths)
    assert_no_cross_document_leak(
        lambda b: model(b["idx"][None], cu_seqlens=cu)[0],
        {"idx": idx[0], "cu_seqlens": cu},
        documents=[0, 1, 500, 999],
    )


@pytest.mark.parametrize("make", [gpt, llama, bert], ids=["gpt", "llama", "bert"])
def test_position_ids_alone_isolate_the_sequences(make):
    """transformers-style position_ids restarting at 0, without cu_seqlens: each
    sequence still attends only itself (resetting positions does isolate here)."""
    model = make()
    cu = offsets([s for s in LENGTHS if s])  # position_ids cannot show an empty one
    idx = torch.randint(0, VOCAB, (1, int(cu[-1])))
    position_ids = torch.cat([torch.arange(b - a) for a, b in spans(cu)])
    out = model(idx, position_ids=position_ids)
    alone = torch.cat([model(idx[:, a:b]) for a, b in spans(cu)], 1)
    assert max_error(out, alone) < 1e-10
    both = model(idx, cu_seqlens=cu, position_ids=position_ids.view(1, -1))
    assert torch.equal(both, out)


def test_an_all_ones_mask_with_packing_is_isolated_and_padding_refused():
    """BERT takes a transformers-style 2-D attention_mask: all ones beside packing it
    changes nothing (the sequences stay apart); a padded token inside a pack raises."""
    model = bert()
    cu = offsets(LENGTHS)
    ids = torch.randint(0, VOCAB, (1, int(cu[-1])))
    ones = torch.ones_like(ids)
    out = model(ids, ones, cu_seqlens=cu)
    assert torch.equal(out, model(ids, cu_seqlens=cu))
    alone = torch.cat([model(ids[:, a:b]) for a, b in spans(cu)], 1)
    assert max_error(out, alone) < 1e-10
    padded = ones.clone()
    padded[0, 3] = 0
    message = expect_error(lambda: model(ids, padded, cu_seqlens=cu))
    assert "padded tokens inside a packed batch" in message


def test_contradictions_and_bad_rows_are_refused():
    model = gpt(position="rotary")
    cu = offsets([3, 4])
    idx = torch.randint(0, VOCAB, (1, 7))
    message = expect_error(lambda: model(idx, cu_seqlens=cu, position_ids=torch.arange(7)))
    assert "describe different sequences" in message
    message = expect_error(lambda: model(idx.view(7, 1), cu_seqlens=cu))
    assert "packed input must be one row (1, total)" in message
    message = expect_error(lambda: model(idx[:, :6], cu_seqlens=cu))
    assert "cu_seqlens ends at 7 but the packed tensor holds 6" in message or (
        "describe 7 tokens but the packed row holds 6" in message
    )
    message = expect_error(lambda: model(idx, cu_seqlens=cu, start=torch.zeros(1)))
    assert "does not go with caches, start or positions" in message
    caches = llama().make_caches(1, 8)
    message = expect_error(lambda: llama()(idx, cu_seqlens=cu, caches=caches))
    assert "does not go with caches or start" in message
    from mhsa.models import Gemma3, Gemma3Config  # a family that does not pack

    config = Gemma3Config(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16, d_ff=32)
    with pytest.raises(ValueError, match=r"Gemma3 takes no packed rows \(cu_seqlens"):
        Gemma3(config)(idx, cu_seqlens=cu)


def test_next_token_targets_stop_at_each_boundary():
    cu = offsets([3, 0, 1, 2])
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    assert next_token_targets(tokens, cu).tolist() == [11, 12, IGNORE, IGNORE, 15, IGNORE]
    assert next_token_targets(tokens[None], cu).shape == (1, 6)
    # offsets are checked as attention_varlen checks them (they once ran unchecked)
    for bad, error, fragment in (
        (torch.tensor([0, 4, 12]), ValueError, "ends at 12 but the packed tensor holds 6"),
        (torch.tensor([0, 4, 2, 6]), ValueError, "must not decrease"),
        (torch.tensor([2, 4, 6]), ValueError, "must start at 0"),
        (torch.tensor([0.0, 6.0]), TypeError, "int32 or int64 tensor"),
    ):
        with pytest.raises(error, match=fragment):
            next_token_targets(tokens, bad)


def test_a_batch_with_no_target_has_loss_zero_not_nan():
    """A BERT batch in which no token was drawn, or packed one-token documents, leave
    every target IGNORE: F.cross_entropy's mean is nan there, which stopped training as
    "diverged"; with targets, the loss is the mean it was."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, max_len=16))
    bert = Bert(BertConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, d_ff=32, max_len=16))
    idx = torch.randint(0, 32, (2, 8))
    none = torch.full((2, 8), IGNORE)
    for loss in (gpt.loss(idx, none), bert.loss(idx, None, none)):
        assert loss.item() == 0.0
        loss.backward()
    some = none.clone()
    some[0, 3], some[1, 5] = 7, 9
    expected = F.cross_entropy(gpt(idx).flatten(0, 1), some.flatten(), ignore_index=IGNORE)
    assert max_error(gpt.loss(idx, some), expected) < 1e-6
