"""Text for language modelling: the Python standard library's own source files (present
on every machine that runs Python) or any text file, as bytes."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
from torch import Tensor


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, nothing unknown."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, tokens: Tensor | list[int]) -> str:
        values = tokens.tolist() if isinstance(tokens, Tensor) else tokens
        return bytes(values).decode("utf-8", errors="replace")


def stdlib_corpus(limit_bytes: int | None = None) -> str:
    """The top-level .py files of this interpreter's standard library, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if limit_bytes is not None and size >= limit_bytes:
            break
    if not parts:
        raise RuntimeError(f"no .py files found under {root}; pass --data FILE instead")
    return "\n".join(parts)


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    text = path.read_text(encoding="utf-8", errors="replace")
    undecodable = text.count("\ufffd") + text.count("\x00")
    if undecodable > len(text) // 100:  # more than 1%: not UTF-8 text
        raise ValueError(
            f"--data {path}: {undecodable} of {len(text)} characters are not UTF-8 text "
            "(a binary file?); give a UTF-8 text file"
        )
    if len(text) < 1000:
        raise ValueError(f"--data {path}: only {len(text)} characters; give at least 1000")
    return text


class TextTask:
    """Next-token prediction on one token stream, split 90/10 into train/validation.

    Batches are random windows of `seq_len + 1` tokens; validation uses fixed windows.
    """

    def __init__(self, tokens: Tensor, seq_len: int, batch_size: int, eval_batches: int = 8):
        split = int(len(tokens) * 0.9)
        self.train, self.val = tokens[:split], tokens[split:]
        if len(self.val) <= seq_len + 1:
            raise ValueError(f"text too short for seq_len {seq_len}: give more text")
        self.seq_len, self.batch_size = seq_len, batch_size
        generator = torch.Generator().manual_seed(1234)
        self._eval = [self._windows(self.val, generator) for _ in range(eval_batches)]

    def _windows(self, data: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        starts = torch.randint(
            0, len(data) - self.seq_len - 1, (self.batch_size,), generator=generator
        )
        rows = torch.stack([data[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def train_batch(self, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return self._windows(self.train, generator)

    def eval_batches(self) -> list[tuple[Tensor, Tensor]]:
        return self._eval

    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def unigram_loss(self, vocab_size: int) -> float:
        """Validation cross-entropy (nats/token) of train-set token frequencies."""
        counts = torch.bincount(self.train, minlength=vocab_size).double() + 1.0
        log_probs = torch.log(counts / counts.sum())
        return -log_probs[self.val].mean().item()


def describe_loss(loss: float) -> str:
    return f"{loss:.4f} nats/token ({loss / math.log(2):.3f} bits)"


class MaskedLMTask:
    """Masked-language-model batches from one byte stream (BERT's recipe).

    Each sequence is a window of random length (seq_len / 4 .. seq_len) padded to
    seq_len; 15% of its real tokens are selected: 80% become [MASK], 10% a random
    byte, 10% stay. Labels hold the original token at selected positions, -100 elsewhere.
    """

    PAD, MASK = 256, 257
    VOCAB = 258

    def __init__(self, tokens: Tensor, seq_len: int, batch_size: int, eval_batches: int = 8):
        split = int(len(tokens) * 0.9)
        self.train, self.val = tokens[:split], tokens[split:]
        if len(self.val) <= seq_len:
            raise ValueError(f"text too short for seq_len {seq_len}: give more text")
        self.seq_len, self.batch_size = seq_len, batch_size
        generator = torch.Generator().manual_seed(1234)
        self._eval = [self._batch(self.val, generator) for _ in range(eval_batches)]

    def _batch(self, data: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        n, length = self.batch_size, self.seq_len
        lengths = torch.randint(length // 4, length + 1, (n,), generator=g)
        starts = torch.randint(0, len(data) - length, (n,), generator=g)
        ids = torch.full((n, length), self.PAD, dtype=torch.long)
        for i, (s, k) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            ids[i, :k] = data[s : s + k]
        real = ids != self.PAD
        selected = (torch.rand(n, length, generator=g) < 0.15) & real
        labels = torch.where(selected, ids, torch.full_like(ids, -100))
        roll = torch.rand(n, length, generator=g)
        inputs = torch.where(selected & (roll < 0.8), torch.full_like(ids, self.MASK), ids)
        random_bytes = torch.randint(0, 256, (n, length), generator=g)
        inputs = torch.where(selected & (roll >= 0.8) & (roll < 0.9), random_bytes, inputs)
        return inputs, real, labels

    def train_batch(self, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        return self._batch(self.train, generator)

    def eval_batches(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        return self._eval

    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len
