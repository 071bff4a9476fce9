"""Render a chat template (Jinja, as tokenizer_config.json or a GGUF's tokenizer.chat_template
holds it) into a prompt, the way transformers' apply_chat_template(tokenize=False) does.

The template is untrusted text from a model file, so it runs in jinja2's immutable sandbox.
The environment matches transformers' (utils/chat_template_utils.py): trim_blocks and
lstrip_blocks, the loop-controls extension, a `tojson` filter that does not escape HTML and
keeps non-ASCII, and the globals `raise_exception(message)`, `strftime_now(format)`. The
template sees `messages`, `add_generation_prompt`, `tools`, `documents` and any extra
variables (bos_token, eos_token... from the caller).

A rendering is bounded in time and size (`render_limits`; 10 s and 10 million characters
unless a caller sets less): a template that multiplies a string by 10**10, pads to a
huge width or loops without end raises TemplateLimitError instead of taking the machine's
memory or a thread forever. The time limit is delivered as an exception at the next
Python bytecode of the rendering thread (CPython's PyThreadState_SetAsyncExc), so it also
stops loops that output nothing; sizes are checked before the operation allocates.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

INSTALL_HINT = "pip install jinja2 (or pip install 'mhsa[chat]')"


@lru_cache(maxsize=1)
def _refusal_class() -> type:
    import jinja2

    class TemplateRefusal(jinja2.exceptions.TemplateError, ValueError):
        """The template's raise_exception(message): jinja2's TemplateError, and a ValueError
        so that a command reports it in one line."""

    return TemplateRefusal


def _raise_exception(message: str) -> None:
    raise _refusal_class()(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@dataclass(frozen=True)
class RenderLimits:
    """seconds: how long one rendering may run; chars: the most characters (or items) it
    may output or build in one string or list."""

    seconds: float = 10.0
    chars: int = 10_000_000


class TemplateLimitError(ValueError):
    """A rendering went past its RenderLimits; `limit` is "seconds" or "chars"."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


_LIMITS: contextvars.ContextVar[RenderLimits | None] = contextvars.ContextVar(
    "chat_template_limits", default=None
)


def _limits() -> RenderLimits:
    return _LIMITS.get() or RenderLimits()


@contextlib.contextmanager
def render_limits(seconds: float, chars: int) -> Iterator[None]:
    """Renderings in this context (this thread) take at most seconds and chars."""
    token = _LIMITS.set(RenderLimits(seconds, chars))
    try:
        yield
    finally:
        _LIMITS.reset(token)


def _too_large(what: str, size: int) -> TemplateLimitError:
    chars = _limits().chars
    return TemplateLimitError(
        f"the chat template {what} of {size:,} characters or items, more than the "
        f"{chars:,} a rendering may make",
        "chars",
    )


def _check_size(what: str, size: int) -> None:
    if size > _limits().chars:
        raise _too_large(what, size)


_NUMBER = re.compile(r"\d+")


def _check_format(spec: Any) -> None:
    """A format string ("%10000000000s", "{:>99999999999}") must not pad beyond chars."""
    if isinstance(spec, str):
        for number in _NUMBER.findall(spec):
            if len(number) > 12 or int(number) > _limits().chars:
                raise _too_large("asks to format a field", int(number))


def _sized_filter(function: Any) -> Any:
    """A filter whose integer arguments (a width, a count) stay below chars."""

    @functools.wraps(function)  # (keeps jinja's pass_context marks)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                _check_size("asks a filter for a size", abs(value))
        if function.__name__ == "do_format" and len(args) > 0:
            _check_format(args[0])
        return function(*args, **kwargs)

    return checked


def _binop_result_size(operator: str, left: Any, right: Any) -> int:
    """The length a sequence result of left <operator> right would have (0: not one)."""
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, str | list | tuple) and isinstance(count, int):
                return len(sequence) * max(count, 0)
    if operator == "+" and isinstance(left, str | list | tuple) and type(left) is type(right):
        return len(left) + len(right)
    return 0


def _environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedEnvironment(ImmutableSandboxedEnvironment):
        """The immutable sandbox with sizes checked before *, +, ** and % build a value."""

        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_size("builds a value", _binop_result_size(operator, left, right))
            if (
                operator == "**"
                and isinstance(left, int)
                and isinstance(right, int)
                and abs(left) > 1
                and right * abs(left).bit_length() > 4096
            ):
                raise TemplateLimitError(
                    f"the chat template computes {left}**{right}, a number of more than 4096 bits",
                    "chars",
                )
            if operator == "%":
                _check_format(left)
            return super().call_binop(context, operator, left, right)

        def getattr(self, obj: Any, attribute: str) -> Any:
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_format(obj)  # ("{:>99999999999}".format(1))
            return super().getattr(obj, attribute)

    return LimitedEnvironment


@lru_cache(maxsize=8)
def compile_template(template: str):
    """The compiled jinja2 template (cached: a chat renders the same one every turn)."""
    try:
        import jinja2
        import jinja2.ext
    except ImportError as error:
        raise ImportError(f"chat templates need the jinja2 package: {INSTALL_HINT}") from error
    env = _environment_class()(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    for name in ("center", "indent", "wordwrap", "truncate", "format", "batch", "slice"):
        env.filters[name] = _sized_filter(env.filters[name])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(
            f"the chat template does not parse (line {error.lineno}: {error.message}); "
            "pass a valid Jinja template"
        ) from None


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """The prompt `template` makes of `messages` (dicts with "role" and "content").

    With add_generation_prompt the prompt ends where the assistant's reply begins (for
    templates that support it). `variables` (bos_token="<s>", tools=[...]...) reach the
    template as globals. Raises ValueError for malformed messages and jinja2's TemplateError
    when the template itself rejects the conversation (raise_exception).
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(
            "messages must be a list of dicts like {'role': 'user', 'content': 'Hi'}, got "
            f"{type(messages).__name__}"
        )
    for index, message in enumerate(messages):
        if "role" not in message:
            raise ValueError(f"messages[{index}] has no 'role'; add 'role': 'user' (or system...)")
    context = {"tools": None, "documents": None, **variables}
    compiled = compile_template(template)
    limits = _limits()

    def render() -> str:
        pieces, size = [], 0
        for piece in compiled.generate(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        ):
            size += len(piece)
            if size > limits.chars:
                raise _too_large("renders a prompt", size)
            pieces.append(piece)
        return "".join(pieces)

    return _with_deadline(limits.seconds, render)


class _Timeout(BaseException):
    """Raised into a rendering thread at its deadline (a BaseException: no template or
    jinja2 code catches it on the way out)."""


def _set_async_exc(thread: int, exception: type[BaseException] | None) -> None:
    """Raise exception in thread at its next bytecode (None: cancel one not yet raised)."""
    pending = None if exception is None else ctypes.py_object(exception)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), pending)


def _with_deadline(seconds: float, work: Callable[[], str]) -> str:
    """work(), or TemplateLimitError once it has run seconds in this thread."""
    thread, lock = threading.get_ident(), threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exc(thread, _Timeout)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        try:
            return work()
        finally:
            with lock:
                state["done"] = True
            timer.cancel()
            if state["fired"]:
                _set_async_exc(thread, None)  # (drops the exception if it has not arrived)
    except _Timeout:
        pass  # (the timer fired once: nothing more can arrive)
    raise TemplateLimitError(
        f"the chat template rendered for more than {seconds:g} s, the most a rendering may take",
        "seconds",
    )
