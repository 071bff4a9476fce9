"""A choice's text as it streams, cut at the first of the request's stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from .models import TextStream


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
