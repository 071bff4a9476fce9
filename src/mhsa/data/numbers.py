"""A built-in translation task: numbers written out in English -> the same numbers
written out in French, generated with the `num2words` package (no download).

    "three hundred and twelve" -> "trois cent douze"

Words, hyphens and commas are the tokens, in one vocabulary for both languages.
The test numbers are drawn once and never appear in training.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
TARGETS = ("fr",)


def _num2words():
    try:
        from num2words import num2words
    except ImportError as error:
        raise SystemExit(
            "the translation task needs num2words: pip install num2words "
            "(or pip install -e '.[translate]')"
        ) from error
    return num2words


def tokenize(text: str) -> list[str]:
    """'twenty-one thousand, two' -> ['twenty', '-', 'one', 'thousand', ',', 'two']."""
    return re.findall(r"[^\s,-]+|[,-]", text.lower())


def detokenize(words: list[str]) -> str:
    """Inverse of tokenize: no space around '-' or before ','."""
    text = ""
    for word in words:
        glue = "" if not text or word in ",-" or text.endswith("-") else " "
        text += glue + word
    return text


class Vocabulary:
    """Word <-> id, with <pad> <bos> <eos> <unk> first."""

    def __init__(self, words: list[str]) -> None:
        self.words = list(SPECIALS) + sorted(set(words) - set(SPECIALS))
        self.index = {word: i for i, word in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        """Token ids followed by <eos>."""
        return [self.index.get(word, UNK) for word in tokenize(text)] + [EOS]

    def decode(self, ids: list[int]) -> str:
        return detokenize([self.words[i] for i in ids if i >= len(SPECIALS)])

    def unknown_words(self, text: str) -> list[str]:
        return [word for word in tokenize(text) if word not in self.index]


def number_vocabulary(target: str = "fr") -> Vocabulary:
    """Every word num2words uses for 0 .. 999 999 in English and the target language:
    those of 0..1000 and of the thousands cover them all."""
    num2words = _num2words()
    numbers = list(range(1001)) + [1000 * k for k in range(1, 1000)]
    texts = [num2words(n, lang=lang) for n in numbers for lang in ("en", target)]
    return Vocabulary([",", "-"] + [word for text in texts for word in tokenize(text)])


def pad_batch(rows: list[list[int]], prefix: list[int] | None = None) -> Tensor:
    """Right-pad token lists (with an optional prefix each) into (B, T) with <pad>."""
    rows = [(prefix or []) + row for row in rows]
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def draw_number(generator: torch.Generator, min_digits: int = 1) -> int:
    """A number whose digit count is uniform in min_digits..6, so that short numbers
    are as common as long ones (uniform over 0..999999 would almost never say "seven")."""
    digits = int(torch.randint(min_digits, 7, (), generator=generator))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(torch.randint(low, 10**digits, (), generator=generator))


class NumberTranslationTask:
    """Random training numbers, `test_size` held-out numbers of 3 to 6 digits never
    drawn for training, exact match as the metric.

    Batches are (source (B, S), decoder input (B, T) = <bos> + target, decoder output
    (B, T) = target + <eos>), padded with <pad>."""

    def __init__(
        self, batch_size: int, *, target: str = "fr", test_size: int = 1000, seed: int = 0
    ) -> None:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        self.num2words, self.target = _num2words(), target
        self.vocab = number_vocabulary(target)
        self.batch_size = batch_size
        self._pairs: dict[int, tuple[list[int], list[int]]] = {}
        generator = torch.Generator().manual_seed(seed + 777)
        held_out: set[int] = set()
        while len(held_out) < test_size:  # 3 to 6 digits: all of 0..99 stay in training
            held_out.add(draw_number(generator, min_digits=3))
        self.test_numbers, self._held_out = sorted(held_out), held_out
        pairs = [self.pair(n) for n in self.test_numbers]
        self.test_sources = [src for src, _ in pairs]
        self.test_targets = [tgt[:-1] for _, tgt in pairs]  # without <eos>
        self._eval = [self._batch(pairs[i : i + 250]) for i in range(0, len(pairs), 250)]

    def pair(self, number: int) -> tuple[list[int], list[int]]:
        """(English ids + <eos>, target-language ids + <eos>) for one number; kept, as
        num2words costs more than a training step's share of a pair."""
        if number not in self._pairs:
            english, target = (self.num2words(number, lang=lang) for lang in ("en", self.target))
            self._pairs[number] = (self.vocab.encode(english), self.vocab.encode(target))
        return self._pairs[number]

    def _batch(self, pairs: list[tuple[list[int], list[int]]]) -> tuple[Tensor, Tensor, Tensor]:
        sources, targets = zip(*pairs, strict=True)
        decoder_in = pad_batch([t[:-1] for t in targets], prefix=[BOS])
        return pad_batch(list(sources)), decoder_in, pad_batch(list(targets))

    def train_batch(self, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        numbers: list[int] = []
        while len(numbers) < self.batch_size:
            n = draw_number(generator)
            if n not in self._held_out:
                numbers.append(n)
        return self._batch([self.pair(n) for n in numbers])

    def eval_batches(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        return self._eval

    @staticmethod
    def eval_weight(batch: tuple[Tensor, Tensor, Tensor]) -> int:
        """The target tokens a batch's loss averages over (padding is ignored)."""
        return int((batch[-1] != PAD).sum())

    def tokens_per_batch(self) -> int:
        return self.batch_size * 16  # for the tokens/s figure: about 16 per pair on average

    def metrics(self, model) -> dict:
        """Exact match of greedy translations of the held-out numbers."""
        was_training = model.training
        model.eval()
        hits = 0
        for i in range(0, len(self.test_sources), 250):
            sources = pad_batch(self.test_sources[i : i + 250])
            outputs = model.translate(sources.to(next(model.parameters()).device))
            references = self.test_targets[i : i + 250]
            hits += sum(out == ref for out, ref in zip(outputs, references, strict=True))
        model.train(was_training)
        return {"exact_match": hits / len(self.test_sources)}
