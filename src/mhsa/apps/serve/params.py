"""The parameters of a /v1/chat/completions or /v1/completions request, checked as
OpenAI checks them; anything wrong raises an APIError naming the parameter."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...core.checks import is_int
from ...formats.chat_template import TemplateLimitError, render_limits
from . import errors
from .limits import Limits
from .models import ServedModel
from .text import PromptEncoder, PromptTooLong

MAX_SEED = 2**64 - 1
MAX_SALT = 256  # characters of a cache_salt

ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = {"chat": 256, "completion": 16}  # (OpenAI's completions default: 16)
# parameters this server does not implement, and the values that mean "not used"
UNUSED = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),  # (0 asks for the chosen token's logprob)
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "tool_choice": (None, "none", "auto"),  # (no tools: both mean none)
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
}
# OpenAI's parameters of each endpoint (and cache_salt); any other (top_k, min_p...) is
# refused, not dropped. Those neither implemented nor UNUSED change nothing this server
# answers: it stores nothing and keys its prefix cache itself (user, metadata, store...).
SHARED = (
    *("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream"),
    *("stream_options", "user", "n", "logprobs", "logit_bias", "cache_salt"),
    *("frequency_penalty", "presence_penalty"),
)
CHAT = (
    *("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"),
    *("functions", "function_call", "response_format", "modalities", "audio", "metadata"),
    *("store", "service_tier", "parallel_tool_calls", "reasoning_effort", "verbosity"),
    *("prediction", "web_search_options", "safety_identifier", "prompt_cache_key"),
)
ACCEPTED = {
    "chat": frozenset(SHARED + CHAT),
    "completion": frozenset(SHARED + ("prompt", "best_of", "echo", "suffix")),
}


@dataclass
class Job:
    """What to generate: one prompt per choice, each with its max_tokens, and the
    sampling and streaming options they share."""

    kind: str  # "chat" or "completion"
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None  # a namespace of the prefix cache within the API key's


def parse_chat(
    body: dict[str, Any],
    served: ServedModel,
    limits: Limits | None = None,
    encoder: PromptEncoder | None = None,
) -> Job:
    """The Job of a chat completion request (body: the parsed JSON object); it renders
    the chat template and tokenises, so the server calls it in a worker thread. Where
    the model renders and encodes apart (served.render_chat), a rendering that cannot fit
    the context is refused before it is tokenised whole (through encoder, default: a
    PromptEncoder of served.chat_encode)."""
    _check_common(body, served, "chat")
    if served.chat is None:
        raise errors.APIError(
            400,
            f"The model `{served.name}` has no chat template: send "
            "the text to continue to /v1/completions instead.",
            param="messages",
            code="chat_not_supported",
        )
    messages = body.get("messages")
    if messages is None:
        raise errors.missing("messages")
    if not isinstance(messages, list):
        raise errors.invalid_type("messages", "an array of messages", messages)
    if not messages:
        raise errors.invalid_value("messages", "empty array. Expected at least one message.")
    rendered = [_message(i, message) for i, message in enumerate(messages)]
    limits = limits or Limits()
    try:
        with render_limits(limits.template_seconds, limits.template_chars):
            text = None if served.render_chat is None else served.render_chat(rendered)
            prompt = served.chat(rendered) if text is None else None
    except TemplateLimitError as error:
        option = "--template-seconds" if error.limit == "seconds" else "--template-chars"
        raise errors.APIError(
            400,
            f"Invalid 'messages': {error} (mhsa serve {option}); the model's chat template "
            "cannot render this conversation within the server's limits.",
            param="messages",
            code="template_limit_exceeded",
        ) from None
    except Exception as error:  # the template's own complaint (roles out of order...)
        raise errors.invalid_value(
            "messages", f"the chat template refused them: {error}"
        ) from error
    if text is not None:
        encoder = encoder or PromptEncoder(served.chat_encode, served.stream, served.vocab_size)
        try:
            prompt = encoder(text, served.context_length)
        except PromptTooLong as error:
            raise errors.prompt_too_long("messages", error.limit, error.at_least) from None
    limit, param = body.get("max_completion_tokens"), "max_completion_tokens"
    if limit is None:  # (absent or null: the older name counts)
        limit, param = body.get("max_tokens"), "max_tokens"
    return _job("chat", body, [prompt], limit, param, "messages", served)


def parse_completion(
    body: dict[str, Any],
    served: ServedModel,
    limits: Limits | None = None,
    encoder: PromptEncoder | None = None,
) -> Job:
    """The Job of a (legacy) completion request: prompt is a string, an array of
    strings, an array of token ids or an array of such arrays (one choice each), at most
    limits.max_prompts of them. It tokenises (through encoder, default: a PromptEncoder
    of served; the server keeps one), so the server calls it in a worker thread; a text
    that cannot fit the context is refused before it is tokenised whole."""
    _check_common(body, served, "completion")
    if "prompt" not in body:
        raise errors.missing("prompt")
    listed = _prompt_list(body["prompt"])
    max_prompts = (limits or Limits()).max_prompts
    if len(listed) > max_prompts:
        raise errors.too_many_prompts(len(listed), max_prompts)
    encoder = encoder or PromptEncoder(served.encode, served.stream, served.vocab_size)
    prompts = [_prompt(p, served, encoder) for p in listed]
    return _job("completion", body, prompts, body.get("max_tokens"), "max_tokens", "prompt", served)


def _check_common(body: dict[str, Any], served: ServedModel, kind: str) -> None:
    for name in body:
        if name not in ACCEPTED[kind]:
            raise errors.unrecognized(name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.invalid_type("model", "a string", model)
    if model is not None and model != served.name:
        raise errors.unknown_model(model, served.name)
    for name, unused in UNUSED.items():
        value = body.get(name)
        if not any(_same(value, u) for u in unused):
            raise errors.unsupported(name, f" (got {value!r})")


def _same(value: Any, unused: Any) -> bool:
    if isinstance(value, bool) or isinstance(unused, bool) or unused is None:
        return value is unused
    return value == unused


def _job(
    kind: str,
    body: dict[str, Any],
    prompts: list[list[int]],
    limit: Any,
    limit_param: str,
    prompt_param: str,
    served: ServedModel,
) -> Job:
    context = served.context_length
    if limit is not None:
        limit = _integer(limit_param, limit, minimum=1)
    counts = []
    for prompt in prompts:
        if len(prompt) >= context or (limit is not None and len(prompt) + limit > context):
            raise errors.context_exceeded(prompt_param, context, len(prompt), limit)
        counts.append(limit or min(DEFAULT_MAX_TOKENS[kind], context - len(prompt)))
    temperature = _number("temperature", body.get("temperature"), 1.0, 0.0, 2.0)
    top_p = _number("top_p", body.get("top_p"), 1.0, 0.0, 1.0)
    if top_p == 0:  # (the engine's top_p must be > 0; 0 keeps only the likeliest)
        temperature = 0.0
    seed = body.get("seed")
    if seed is not None:
        seed = _integer("seed", seed, minimum=0)
        if seed > MAX_SEED:
            raise errors.above_maximum("seed", MAX_SEED, seed)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise errors.invalid_type("stream", "a boolean", stream)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise errors.invalid_value("stream_options", "only allowed when 'stream' is true.")
    if options is not None and not isinstance(options, dict):
        raise errors.invalid_type("stream_options", "an object", options)
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise errors.invalid_type("stream_options.include_usage", "a boolean", include_usage)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise errors.invalid_type("cache_salt", "a string", salt)
    if salt is not None and not 1 <= len(salt) <= MAX_SALT:
        message = f"expected a string of 1..{MAX_SALT} characters, got {len(salt)}."
        raise errors.invalid_value("cache_salt", message)
    return Job(
        kind,
        prompts,
        counts,
        temperature,
        None if top_p in (0.0, 1.0) else top_p,
        seed,
        _stop(body.get("stop")),
        stream,
        include_usage,
        salt,
    )


def _message(index: int, message: Any) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise errors.invalid_type(param, "an object", message)
    role = message.get("role")
    if role is None:
        raise errors.missing(f"{param}.role")
    if role not in ROLES:
        raise errors.invalid_value(
            f"{param}.role", f"{role!r}. Supported values are: {', '.join(repr(r) for r in ROLES)}."
        )
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise errors.invalid_value(
                    f"{param}.content",
                    'only text parts ({"type": "text", "text": ...}) are supported.',
                )
            text = part.get("text")
            if text is None:
                raise errors.missing(f"{param}.content[{len(texts)}].text")
            if not isinstance(text, str):
                raise errors.invalid_type(f"{param}.content[{len(texts)}].text", "a string", text)
            texts.append(text)
        content = "".join(texts)
    if content is None and role != "assistant":
        raise errors.missing(f"{param}.content")
    if content is not None and not isinstance(content, str):
        raise errors.invalid_type(f"{param}.content", "a string or an array of text parts", content)
    _check_unicode(f"{param}.content", content or "")
    return {**message, "content": content or ""}


def _prompt_list(prompt: Any) -> list[Any]:
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    raise errors.invalid_value(
        "prompt",
        "expected a string, an array of strings, an array of "
        "token ids or an array of such arrays, not empty.",
    )


def _prompt(prompt: Any, served: ServedModel, encoder: PromptEncoder) -> list[int]:
    if isinstance(prompt, str):
        _check_unicode("prompt", prompt)
        try:
            ids = encoder(prompt, served.context_length)
        except PromptTooLong as error:
            raise errors.prompt_too_long("prompt", error.limit, error.at_least) from None
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        ids = prompt
        if any(not 0 <= t < served.vocab_size for t in ids):
            top = served.vocab_size - 1
            raise errors.invalid_value("prompt", f"token ids must be in 0..{top}.")
    else:
        raise errors.invalid_type("prompt", "a string or an array of token ids", prompt)
    if not ids:
        raise errors.invalid_value("prompt", "it is empty: give at least one token of text.")
    return ids


def _check_unicode(param: str, text: str) -> None:
    """A JSON string may hold a lone surrogate ("\\ud800"), which is no text to encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise errors.invalid_value(
            param,
            f"it holds a lone surrogate ({text[error.start]!r} at {error.start}), which is not "
            "text: send valid UTF-8 (pair surrogates as JSON escapes, or send the character).",
        ) from None


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise errors.invalid_type("stop", "a string or an array of strings", stop)
    if len(stops) > 4:
        raise errors.invalid_value("stop", f"at most 4 stop sequences, got {len(stops)}.")
    return tuple(stops)


def _integer(param: str, value: Any, *, minimum: int) -> int:
    if not is_int(value):
        raise errors.invalid_type(param, "an integer", value)
    if value < minimum:
        raise errors.below_minimum(param, minimum, value)
    return value


def _number(param: str, value: Any, default: float, low: float, high: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise errors.invalid_type(param, "a number", value)
    if value < low:
        raise errors.below_minimum(param, low, value)
    if value > high:
        raise errors.above_maximum(param, high, value)
    return float(value)
