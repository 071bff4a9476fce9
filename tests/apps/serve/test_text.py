"""The server's text streams: stop strings cut a streamed text where they first begin,
whatever the pieces, and byte tokens decode UTF-8 across pieces."""

from __future__ import annotations

import random

import pytest

from mhsa.apps.serve.models import ByteStream
from mhsa.apps.serve.text import StoppingText


def _run(text: str, stop: list[str], cuts: list[int]) -> tuple[list[str], bool]:
    """The pieces StoppingText hands out for text split at cuts (one token per piece)."""
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    class Pieces:
        def push(self, token: int) -> str:
            return pieces[token]

        def flush(self) -> str:
            return ""

    stream = StoppingText(Pieces(), stop)
    out = [stream.push(i) for i in range(len(pieces)) if not stream.stopped]
    return [*out, stream.flush()], stream.stopped


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_cut_where_the_first_begins_however_the_text_is_split(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c") for _ in range(40))
    stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(2)]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 20)))
    found = [i for s in stop if (i := text.find(s)) >= 0]
    pieces, stopped = _run(text, stop, cuts)
    assert "".join(pieces) == (text[: min(found)] if found else text)
    assert stopped == bool(found)


def test_text_is_held_back_only_while_it_may_begin_a_stop_string():
    pieces, stopped = _run("Hello, World!", ["World", "xyz"], [5, 8, 10])
    assert pieces == ["Hello", ", ", "", "", ""] and stopped  # "Wo" waits, "World" stops
    pieces, stopped = _run("Hello, Wood", ["World"], [5, 8, 10])
    assert pieces == ["Hello", ", ", "Woo", "d", ""] and not stopped  # "W" waited a piece


def test_byte_tokens_decode_utf8_across_pieces():
    stream = ByteStream()
    text = "naïve – 東京 🙂"
    pieces = [stream.push(b) for b in text.encode("utf-8")]
    assert "".join(pieces) + stream.flush() == text
    assert "" in pieces  # a character's first bytes wait for its last
    cut = ByteStream()
    assert cut.push(0xE6) == "" and cut.flush() == "\ufffd"  # an unfinished character
