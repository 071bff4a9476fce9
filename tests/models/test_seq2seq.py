"""Encoder-decoder Transformer: cached decoding equals recomputation, beam search
finds the exact optimum when wide enough, the number task keeps its test set apart."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mhsa.cli import main
from mhsa.data.numbers import NumberTranslationTask, detokenize, pad_batch, tokenize
from mhsa.models.beam_search import beam_search
from mhsa.models.decoding import greedy_search
from mhsa.models.seq2seq import Seq2Seq, Seq2SeqConfig


def _model(**changes) -> Seq2Seq:
    torch.manual_seed(0)
    options = {
        "src_vocab": 11,
        "tgt_vocab": 11,
        "d_model": 16,
        "n_head": 2,
        "n_encoder_layer": 2,
        "n_decoder_layer": 2,
        "dropout": 0.0,
        "max_len": 12,
    }
    return Seq2Seq(Seq2SeqConfig(**{**options, **changes})).eval()


def _uncached_greedy(model: Seq2Seq, src: torch.Tensor, steps: int) -> list[list[int]]:
    """Greedy decoding that reruns the whole decoder on the whole prefix every step."""
    tokens = torch.full((src.shape[0], 1), model.config.bos_id)
    for _ in range(steps):
        tokens = torch.cat([tokens, model(src, tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    eos = model.config.eos_id
    return [
        row[1:].tolist()[: row[1:].tolist().index(eos)] if eos in row[1:] else row[1:].tolist()
        for row in tokens
    ]


def test_encoder_and_decoder_inputs_are_scaled_embeddings_plus_sinusoids():
    """What enters each stack, written out: embedding * sqrt(d) + PE (Vaswani et al.)."""
    model = _model()
    d = model.config.d_model
    src, tgt = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[1, 7, 8]])
    seen = {}

    def keep(name):
        def hook(module, args):
            seen[name] = args[0]  # returns None: the inputs are left as they are

        return hook

    model.encoder.register_forward_pre_hook(keep("enc"))
    model.decoder.register_forward_pre_hook(keep("dec"))
    model(src, tgt)

    def expected(table, ids):
        pe = torch.zeros(ids.shape[1], d)
        for pos in range(ids.shape[1]):
            for i in range(d):
                angle = pos / 10000 ** ((i - i % 2) / d)
                pe[pos, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
        return table.weight[ids].detach() * math.sqrt(d) + pe

    assert torch.allclose(seen["enc"], expected(model.src_embed, src), atol=1e-5)
    assert torch.allclose(seen["dec"], expected(model.tgt_embed, tgt), atol=1e-5)


def test_loss_ignores_padding_and_is_0_for_padding_alone():
    """A batch whose targets were all padding gave nan (which stops training)."""
    import torch.nn.functional as F

    model = _model()
    pad = model.config.pad_id
    src, tgt_in = torch.randint(3, 11, (2, 5)), torch.randint(3, 11, (2, 4))
    tgt_out = torch.tensor([[5, 6, pad, pad], [7, pad, pad, pad]])
    logits = model(src, tgt_in).flatten(0, 1)
    want = F.cross_entropy(logits, tgt_out.flatten(), ignore_index=pad)
    assert torch.allclose(model.loss(src, tgt_in, tgt_out), want)
    assert model.loss(src, tgt_in, torch.full_like(tgt_out, pad)) == 0


def test_cached_greedy_equals_recomputation():
    model = _model()
    src = torch.tensor([[5, 6, 7, 2, 0, 0], [4, 9, 8, 10, 6, 2]])
    with torch.no_grad():
        cached = model.translate(src, max_new_tokens=8)
        assert cached == _uncached_greedy(model, src, 8)
        assert model.translate(src, max_new_tokens=8, cache_memory=False) == cached


def test_beam_search_with_and_without_the_memory_cache():
    model = _model(n_head=4)
    src = torch.tensor([[5, 6, 7, 2], [4, 9, 8, 2]])
    with torch.no_grad():
        beams = model.translate(src, beam_size=3, max_new_tokens=8)
        assert model.translate(src, beam_size=3, max_new_tokens=8, cache_memory=False) == beams


class _StepDecoder:
    """A Decoder (mhsa.models.decoder) and its own caches from a function of the newest
    tokens (rows, T) -> next-token logits (rows, vocab); reorder does nothing."""

    def __init__(self, step) -> None:
        self.function = step

    def prefill(self, tokens, caches, *, start=None):
        return self.function(tokens)

    def step(self, tokens, caches):
        return self.function(tokens)

    def reorder(self, index):
        pass


class _HistoryModel(_StepDecoder):
    """A toy decoder whose next-token logits depend on the whole prefix; its state
    (the prefixes) is reordered like a KV cache: it is its own caches."""

    def __init__(self, rows: int, vocab: int, salt: int = 0) -> None:
        super().__init__(self.extend)
        self.prefixes: list[tuple[int, ...]] = [() for _ in range(rows)]
        self.vocab, self.salt = vocab, salt

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        seed = hash((self.salt, *prefix)) % (2**31)
        return torch.randn(self.vocab, generator=torch.Generator().manual_seed(seed)) * 2

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        self.prefixes = [p + tuple(t) for p, t in zip(self.prefixes, tokens.tolist(), strict=True)]
        return torch.stack([self.logits(p) for p in self.prefixes])

    def reorder(self, index: torch.Tensor) -> None:
        self.prefixes = [self.prefixes[i] for i in index.tolist()]


def _exhaustive_best(model: _HistoryModel, start: int, eos: int, max_new: int, penalty: float):
    """The best of every hypothesis: ended by eos within max_new tokens, or max_new
    tokens long without one (cut there), each scored log-prob / length**penalty."""
    best, best_score = None, -math.inf
    words = [t for t in range(model.vocab) if t != eos]
    hypotheses = [
        *(
            (body, (*body, eos))
            for n in range(max_new)
            for body in itertools.product(words, repeat=n)
        ),
        *((body, body) for body in itertools.product(words, repeat=max_new)),
    ]
    for body, tokens in hypotheses:
        seq, score = (start,), 0.0
        for token in tokens:
            score += torch.log_softmax(model.logits(seq), -1)[token].item()
            seq += (token,)
        if score / len(tokens) ** penalty > best_score:
            best, best_score = list(body), score / len(tokens) ** penalty
    return best


@pytest.mark.parametrize("penalty", [0.0, 1.0])
def test_wide_beam_search_finds_the_exact_optimum(penalty):
    vocab, eos, max_new, beam = 4, 0, 4, 64  # 3**3 live prefixes at most: exhaustive
    for start in (1, 2):
        model = _HistoryModel(beam, vocab)
        found = beam_search(model, model, torch.tensor([[start]]), eos, max_new, beam, penalty)[0]
        assert found == _exhaustive_best(_HistoryModel(1, vocab), start, eos, max_new, penalty)


def _narrow_beam(
    model: _HistoryModel, start: int, eos: int, max_new: int, k: int, penalty: float
) -> list[int]:
    """Beam search written out: each step the 2k best extensions are read in order,
    eos ones finish (scored log-prob / length**penalty), the first k others live on;
    the search stops once k have finished and the best live beam, scored at its
    current length, is no better than the k-th best finished; beams alive at max_new
    compete with the finished ones, scored at that length."""
    alive, finished = [(0.0, (start,))], []
    for length in range(1, max_new + 1):
        extended = [
            (score + log_p, prefix + (token,))
            for score, prefix in alive
            for token, log_p in enumerate(torch.log_softmax(model.logits(prefix), -1).tolist())
        ]
        alive = []
        for score, prefix in sorted(extended, reverse=True)[: 2 * k]:
            if len(alive) == k:
                break
            if prefix[-1] == eos:
                finished.append((score / length**penalty, list(prefix[1:-1])))
            else:
                alive.append((score, prefix))
        kth_best = sorted(score for score, _ in finished)[-k] if len(finished) >= k else None
        if kth_best is not None and alive[0][0] / length**penalty <= kth_best:
            return max(finished)[1]
    finished += [(score / max_new**penalty, list(prefix[1:])) for score, prefix in alive]
    return max(finished)[1]


@pytest.mark.parametrize("beam", [1, 2, 3])
@pytest.mark.parametrize("max_new", [2, 6])
@pytest.mark.parametrize("penalty", [0.0, 1.0])
def test_narrow_beam_search_on_a_batch_equals_the_written_out_search(beam, max_new, penalty):
    vocab, eos, starts = 5, 0, (1, 2, 3)
    for salt in range(3):
        model = _HistoryModel(len(starts) * beam, vocab, salt)
        found = beam_search(
            model, model, torch.tensor([[s] for s in starts]), eos, max_new, beam, penalty
        )
        reference = _HistoryModel(1, vocab, salt)
        assert found == [_narrow_beam(reference, s, eos, max_new, beam, penalty) for s in starts]


@pytest.mark.parametrize("penalty", [0.0, 1.0])
@pytest.mark.parametrize("beam, steps", [(1, 1), (2, 2)])
def test_beam_search_stops_when_no_live_beam_can_win(penalty, beam, steps):
    calls = []

    def step(tokens):  # eos (0) is always far more likely than anything else
        calls.append(tokens.shape)
        return torch.tensor([[5.0, 0, 0, 0]]).expand(tokens.shape[0], 4)

    decoder = _StepDecoder(step)
    found = beam_search(
        decoder,
        decoder,
        torch.tensor([[1]]),
        eos=0,
        max_new_tokens=10,
        beam_size=beam,
        length_penalty=penalty,
    )
    # beam 1: the one hypothesis that ends at step 1 beats the live beam; beam 2:
    # step 1 ends one hypothesis, step 2 two more, and the live beams (two unlikely
    # tokens deep) score below the best two that ended
    assert found == [[]] and len(calls) == steps


def test_search_defaults_and_bad_arguments():
    model = _HistoryModel(4, 5, salt=1)
    found = beam_search(model, model, torch.tensor([[1]]), 0, 6)
    model = _HistoryModel(4, 5, salt=1)
    assert found == beam_search(
        model, model, torch.tensor([[1]]), 0, 6, beam_size=4, length_penalty=1.0
    )
    model = _HistoryModel(1, 5)
    assert len(greedy_search(model, model, torch.tensor([[1]]), eos=0, max_new_tokens=1)[0]) <= 1
    for bad in (torch.tensor([1, 2]), torch.zeros(1, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"start must be \(batch, prefix_len >= 1\)"):
            greedy_search(model, model, bad, eos=0, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be positive, got 0"):
        greedy_search(model, model, torch.tensor([[1]]), eos=0, max_new_tokens=0)
    with pytest.raises(ValueError, match="beam_size must be positive, got 0"):
        beam_search(model, model, torch.tensor([[1]]), 0, 2, beam_size=0)


def test_greedy_search_returns_once_every_row_ended():
    calls = []

    def step(tokens):  # row 0 ends at step 1, row 1 at step 2; then both would go on
        calls.append(len(calls))
        ends = torch.tensor([[5.0, 0, 0], [0, 0, 5.0]]) if len(calls) == 1 else None
        return ends if ends is not None else torch.tensor([[0, 5.0, 0], [5.0, 0, 0]])

    decoder = _StepDecoder(step)
    found = greedy_search(decoder, decoder, torch.tensor([[1], [1]]), eos=0, max_new_tokens=5)
    assert found == [[], [2]] and len(calls) == 2


def test_greedy_search_stops_each_row_at_eos():
    def step(tokens):  # row 0 ends at once (eos = 0), row 1 always says 2
        return torch.tensor([[5.0, 0, 0], [0, 0, 5.0]])

    decoder = _StepDecoder(step)
    found = greedy_search(decoder, decoder, torch.tensor([[1], [1]]), eos=0, max_new_tokens=3)
    assert found == [[], [2, 2, 2]]


def test_number_words_round_trip_and_held_out_numbers_stay_out():
    from num2words import num2words

    for n in (0, 21, 71, 80, 1200, 99999, 123456, 999999):
        for lang in ("en", "fr"):
            assert detokenize(tokenize(num2words(n, lang=lang))) == num2words(n, lang=lang)
    task = NumberTranslationTask(64, test_size=200)
    held_out = {tuple(s) for s in task.test_sources}
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        src, decoder_in, decoder_out = task.train_batch(generator)
        for row in src.tolist():
            assert tuple(t for t in row if t != 0) not in held_out
        shifted = decoder_in[:, 1:] != 0  # decoder input = <bos> + target: output shifted
        assert (decoder_in[:, 1:][shifted] == decoder_out[:, :-1][shifted]).all()
        assert (decoder_in[:, 0] == 1).all()
    assert task.vocab.decode(task.test_targets[0]) == num2words(task.test_numbers[0], lang="fr")


def test_bad_inputs_say_what_to_fix():
    with pytest.raises(ValueError, match="share_embeddings"):
        Seq2SeqConfig(src_vocab=10, tgt_vocab=12)
    model = _model()
    with pytest.raises(ValueError, match="src ids must be in"):
        model.translate(torch.tensor([[3, 11]]))
    with pytest.raises(ValueError, match="max_len"):
        model.translate(pad_batch([[3] * 13]))


@pytest.mark.slow
def test_train_and_translate_end_to_end(tmp_path, capsys):
    out = str(tmp_path / "tr")
    args = [
        "train",
        "translate",
        "--out",
        out,
        "--steps",
        "3",
        "--eval-every",
        "3",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--batch-size",
        "8",
    ]
    assert main(args) == 0
    assert "held-out exact match" in capsys.readouterr().out
    assert main(["translate", out, "three hundred and twelve", "--beam-size", "2"]) == 0
    assert main(["translate", out, "hello"]) == 2
    assert "unknown words" in capsys.readouterr().err
    assert main(["translate", out, " "]) == 2
    assert "mhsa translate: a text to translate is empty" in capsys.readouterr().err
