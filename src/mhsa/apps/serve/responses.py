"""The JSON bodies of OpenAI's API: completions, their streamed chunks, usage, models."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any


class Reply:
    """The fixed fields of one response: id, object kind, created time, model."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model, self.created = kind, model, int(time.time())
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def whole(
        self,
        choices: list[tuple[str, str | None]],
        usage: dict[str, Any],
    ) -> dict[str, Any]:
        """The non-streamed response of choices [(text, finish_reason)]."""
        if self.kind == "chat":
            body = self._head("chat.completion")
            body["choices"] = [
                {
                    "index": i,
                    "logprobs": None,
                    "finish_reason": finish,
                    "message": {"role": "assistant", "content": text},
                }
                for i, (text, finish) in enumerate(choices)
            ]
        else:
            body = self._head("text_completion")
            body["choices"] = [
                {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                for i, (text, finish) in enumerate(choices)
            ]
        body["usage"] = usage
        return body

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None = None,
        *,
        role: bool = False,
        usage: bool = False,
    ) -> dict[str, Any]:
        """One streamed chunk of choice index: its new text (None: none, as in the
        chunk that only says finish_reason), role=True for a chat's first chunk."""
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            delta = {"role": "assistant", "content": text or ""} if role else {}
            if text and not role:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            body = self._head("text_completion")
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        body["choices"] = [choice]
        if usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "mhsa"}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"
