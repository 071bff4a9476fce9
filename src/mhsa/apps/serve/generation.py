"""One API call's engine requests, their tokens carried from the engine's thread into
the event loop (loop.call_soon_threadsafe onto an asyncio.Queue) and turned into text."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from . import errors
from .engine import Request
from .models import ServedModel
from .params import Job
from .text import StoppingText


@dataclass(eq=False)
class ResponseChoice:
    """One prompt's request, its text so far, its token count and finish_reason."""

    index: int
    request: Request
    text: StoppingText
    tokens: int = 0
    finish: str | None = None


class Generation:
    """Submits a Job's prompts to the engine (from the event loop's thread) and yields
    their text as it comes; cancel() ends what is still running (a client gone)."""

    def __init__(self, served: ServedModel, job: Job, cache_salt: bytes = b"") -> None:
        self.engine = served.engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
        self.choices: list[ResponseChoice] = []
        try:
            for index, (prompt, limit) in enumerate(zip(job.prompts, job.max_tokens, strict=True)):
                seed = None if job.seed is None else (job.seed + index) % 2**64  # torch's range
                request = self.engine.submit(
                    prompt,
                    limit,
                    temperature=job.temperature,
                    top_p=job.top_p,
                    seed=seed,
                    on_token=self._deliver,
                    cache_salt=cache_salt,
                )
                self.choices.append(
                    ResponseChoice(index, request, StoppingText(served.stream(), job.stop))
                )
        except ValueError as error:  # what the checks before could not foresee
            self.cancel()
            raise errors.APIError(400, str(error)) from error
        self._by_id = {choice.request.id: choice for choice in self.choices}

    @property
    def prompt_tokens(self) -> int:
        return sum(len(choice.request.prompt) for choice in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(choice.tokens for choice in self.choices)

    @property
    def cached_tokens(self) -> int:
        return sum(choice.request.cached_tokens for choice in self.choices)

    def _deliver(self, request: Request, token: int | None) -> None:
        """(the engine's thread) Hand a token, or None at the end, to the event loop."""
        with contextlib.suppress(RuntimeError):  # (a closed loop: the server has gone)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (request.id, token))

    async def events(self) -> AsyncIterator[tuple[ResponseChoice, str]]:
        """(choice, new text) as tokens arrive; a choice's last event has its finish set.
        Raises APIError when the engine failed or was stopped under a request."""
        running = len(self.choices)
        while running:
            request_id, token = await self.queue.get()
            choice = self._by_id[request_id]
            if choice.finish is not None:
                continue  # (tokens that came after a stop string)
            if token is None:
                choice.finish = _finish_reason(choice.request)
                text = choice.text.flush()
            else:
                choice.tokens += 1
                text = choice.text.push(token)
                if choice.text.stopped:
                    choice.finish = "stop"
                    self.engine.cancel(choice.request)
            running -= choice.finish is not None
            if text or choice.finish is not None:
                yield choice, text

    def cancel(self) -> None:
        """Cancel every request still running (their blocks are freed at the next step)."""
        for choice in self.choices:
            self.engine.cancel(choice.request)


def _finish_reason(request: Request) -> str:
    reason = request.finish_reason
    if reason in ("stop", "length"):
        return reason
    if reason == "cancelled":
        raise errors.APIError(
            503, "The request was cancelled: the server is shutting down.", kind="server_error"
        )
    raise errors.APIError(
        500,
        f"The model failed while generating (finish_reason {reason!r}); "
        "the server log has the traceback.",
        kind="server_error",
    )
