"""Text in and out of the model: a prompt encoded at a cost bounded by the context,
however long the text (PromptEncoder), and a choice's text as it streams, cut at the
first of the request's stop strings (StoppingText)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from .models import TextStream

# Tokens by which a prefix's count may exceed the whole text's where the prefix was cut:
# merges across the cut differ (BPE may merge "ab" + "c" better than "ab" alone).
MARGIN = 32
# Characters added to the longest token's text: a stream holds back the end of a
# character a token leaves unfinished, and may drop a first token's leading space.
HELD_BACK = 4
# The fewest characters a token is taken to stand for: a stream does not show special
# tokens (`<|endoftext|>`), whose names a prompt may spell and the tokenizer match.
SPECIAL_NAMES = 32


class PromptTooLong(ValueError):
    """A prompt of at least `at_least` tokens, more than the limit it was encoded for."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"the prompt has at least {at_least} tokens; the limit is {limit}")
        self.at_least, self.limit = at_least, limit


class PromptEncoder:
    """encode(text) -> token ids, for prompts that must have fewer than `limit` tokens,
    at a cost bounded by the limit however long the text: `encoder(text, limit)` raises
    PromptTooLong without tokenising all of a text that cannot fit.

    A text of more characters than limit x the longest token is refused unread; a shorter
    one that is long is encoded by prefixes that double in length, each cut before a
    space that begins a word (where byte-level BPE pre-tokenizers split anyway), until
    one alone has limit + MARGIN tokens (refused) or the next would be most of the text
    (the whole text is encoded). stream and vocab_size (a ServedModel's) tell the longest
    token, measured once, the first time a long text needs it."""

    def __init__(
        self, encode: Callable[[str], list[int]], stream: Callable[[], TextStream], vocab_size: int
    ) -> None:
        self.encode, self.stream, self.vocab_size = encode, stream, vocab_size
        self._longest: int | None = None
        self._lock = threading.Lock()

    @property
    def longest(self) -> int:
        """At most this many characters make one token (longest_token, measured once)."""
        with self._lock:  # (requests in worker threads: one measures, the others wait)
            if self._longest is None:
                self._longest = longest_token(self.stream, self.vocab_size)
            return self._longest

    def __call__(self, text: str, limit: int) -> list[int]:
        size = 4 * limit + MARGIN  # characters: about limit tokens of prose
        if len(text) <= 2 * size:
            return self.encode(text)
        if len(text) > limit * self.longest:  # each token stands for <= longest characters
            raise PromptTooLong(len(text) // self.longest, limit)
        while 2 * size < len(text):
            ids = self.encode(text[: _cut(text, size)])
            if len(ids) >= limit + MARGIN:
                raise PromptTooLong(len(ids) - MARGIN, limit)
            size *= 2
        return self.encode(text)


def _cut(text: str, size: int) -> int:
    """Where to end a prefix of about size characters: before the last space in the
    second half of text[:size] that has no whitespace on either side (a word begins
    after it, so byte-level BPE's pre-tokenizers split there anyway); else at size."""
    end = size
    while (at := text.rfind(" ", size // 2, end)) > 0:
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at
        end = at
    return size


def longest_token(stream: Callable[[], TextStream], vocab_size: int) -> int:
    """A bound on the characters one token of the vocabulary stands for: the UTF-8 length
    of the longest token's text, each read alone through a fresh stream (a cut character
    reads as U+FFFD, 3 bytes, never fewer than its bytes), plus HELD_BACK, and at least
    SPECIAL_NAMES. (Walking 49,152 tokens takes about 0.15 s.)"""
    longest = 0
    for token in range(vocab_size):
        decoder = stream()
        try:
            text = decoder.push(token) + decoder.flush()
        except Exception:  # noqa: BLE001 - an id past the tokenizer's (a padded embedding)
            continue
        longest = max(longest, len(text.encode("utf-8", "surrogatepass")))
    return max(longest + HELD_BACK, SPECIAL_NAMES)


class StoppingText:
    """Pieces of a TextStream handed out as they come, except an end that may still
    grow into a stop string (held back until it cannot); at the first stop string the
    text ends before it and `stopped` is set."""

    def __init__(self, stream: TextStream, stop: Sequence[str] = ()) -> None:
        self.stream, self.stop = stream, [s for s in stop if s]
        self.pending = ""  # text that may begin a stop string, not handed out yet
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that may be shown once token is added ("" while held back)."""
        return self._release(self.stream.push(token), final=False)

    def flush(self) -> str:
        """What is left at the end of the generation."""
        return self._release(self.stream.flush(), final=True)

    def _release(self, piece: str, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.pending + piece
        found = [i for s in self.stop if (i := text.find(s)) >= 0]
        if found:
            self.stopped, self.pending = True, ""
            return text[: min(found)]
        keep = 0 if final else self._partial(text)
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def _partial(self, text: str) -> int:
        """The length of the longest end of text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
