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
stops loops that output nothing, but not one C call: so sizes are checked before the
operation allocates, computed from its arguments (template_limits.py). Every door the
sandbox leaves open is checked: the operators (* + % **), `~`, slices, the methods of
str, bytes and int that can grow a value (ljust, center, zfill, expandtabs, replace,
join, translate, to_bytes), str.format and format_map (each field's width, precision
and value, nested widths included), printf's widths (%*s too), the filters, the text
of a container that is output or formatted (a list of a million references to one long
string), and blocks and macros. No one value may pass `chars`, and what a rendering
builds in all may not pass 100 times `chars` (a loop that keeps many values, each
within the limit).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import Any

from .template_limits import (
    _BUILT,
    _ITEM,
    _METHODS,
    RenderLimits,
    TemplateLimitError,
    _binop_result_size,
    _build,
    _built,
    _check_numbers,
    _check_size,
    _concat,
    _finalize,
    _limited_filter,
    _limits,
    _lipsum,
    _listed,
    _spec_size,
    _text_size,
    _tojson,
    _too_large,
    render_limits,
)

__all__ = ["RenderLimits", "TemplateLimitError", "compile_template", "render_chat", "render_limits"]

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


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment_class():
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator, optimizeconst
    from jinja2.runtime import markup_join, str_join
    from jinja2.sandbox import (
        ImmutableSandboxedEnvironment,
        SandboxedEscapeFormatter,
        SandboxedFormatter,
    )
    from markupsafe import Markup

    class Limited:
        """A str.format whose fields' sizes are checked before each is formatted."""

        def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
            self.made = sum(len(literal) for literal, *_ in self.parse(format_string))
            return super().vformat(format_string, args, kwargs)

        def convert_field(self, value: Any, conversion: str | None) -> Any:
            if conversion:  # (!r, !s, !a)
                _check_size("formats a value", _text_size(value))
            return super().convert_field(value, conversion)

        def format_field(self, value: Any, format_spec: str) -> Any:
            _check_size("formats a field", _spec_size(value, format_spec))
            text = super().format_field(value, format_spec)
            self.made += len(text)
            _check_size("formats a string", self.made)
            _build("formats a field", len(text))
            return text

    class Formatter(Limited, SandboxedFormatter):
        pass

    class EscapeFormatter(Limited, SandboxedEscapeFormatter):
        pass

    class Generator(CodeGenerator):
        """Compiles a ~ b ~ c and s[a:b] to calls that check sizes before they build."""

        @optimizeconst
        def visit_Concat(self, node: Any, frame: Any) -> None:
            self.write("environment.concat_parts((")
            for part in node.nodes:
                self.visit(part, frame)
                self.write(", ")
            self.write("), context.eval_ctx)")

        def visit_Getitem(self, node: Any, frame: Any) -> None:
            if not isinstance(node.arg, nodes.Slice):  # (jinja compiles a slice to obj[a:b])
                return super().visit_Getitem(node, frame)
            self.write("environment.sliced(")
            self.visit(node.node, frame)
            self.write(", slice(")
            for part in (node.arg.start, node.arg.stop, node.arg.step):
                if part is None:
                    self.write("None")
                else:
                    self.visit(part, frame)
                self.write(", ")
            self.write("))")

    class LimitedEnvironment(ImmutableSandboxedEnvironment):
        """The immutable sandbox, with the size of what each operator, method, filter, format,
        concatenation and block makes checked before it is built."""

        intercepted_binops = frozenset({"*", "+", "**", "%"})
        code_generator_class = Generator

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            size = _binop_result_size(operator, left, right)
            text = isinstance(left, str | bytes) or isinstance(right, str | bytes)
            _build("builds a value", size, 1 if text else _ITEM)
            _check_numbers(operator, left, right)
            result = super().call_binop(context, operator, left, right)
            if isinstance(result, str | bytes):  # (Markup's % and + escape: up to 5 times)
                _check_size("builds a value", len(result))
            return result

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", None)
            if isinstance(owner, str | bytes | bytearray | int) and name in _METHODS:
                if name == "join" and args:
                    args = (_listed(args[0]), *args[1:])
                try:
                    size = _METHODS[name](owner, *args, **kwargs)
                except TemplateLimitError:
                    raise
                except (TypeError, ValueError, AttributeError):
                    size = 0  # (the call raises its own error)
                _build(f"asks {name} for a value", size)
            result = super().call(context, obj, *args, **kwargs)
            if name in _METHODS and isinstance(owner, str | bytes | bytearray | int):
                _check_size("builds a value", len(result))
            else:
                _built("builds a value", result)
            return result

        def sliced(self, obj: Any, key: slice) -> Any:
            if isinstance(obj, str | bytes | list | tuple):
                with contextlib.suppress(TypeError):  # (obj[key] raises it)
                    length = len(range(*key.indices(len(obj))))
                    _build("slices a value", length, 1 if isinstance(obj, str | bytes) else _ITEM)
            return obj[key]

        def concat_parts(self, parts: tuple, eval_ctx: Any) -> str:
            _build("joins strings", sum(map(_text_size, parts)))
            join = markup_join if eval_ctx.volatile or eval_ctx.autoescape else str_join
            return join(parts)

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            if super().wrap_str_format(value) is None:
                return None  # (not a str's format or format_map)
            owner, mapping = value.__self__, value.__name__ == "format_map"
            formatter = (
                EscapeFormatter(self, escape=owner.escape)
                if isinstance(owner, Markup)
                else Formatter(self)
            )

            def limited(*args: Any, **kwargs: Any) -> str:
                if mapping:
                    if kwargs:
                        raise TypeError("format_map() takes no keyword arguments")
                    if len(args) != 1:
                        raise TypeError(
                            f"format_map() takes exactly one argument ({len(args)} given)"
                        )
                    args, kwargs = (), args[0]
                return type(owner)(formatter.vformat(owner, args, kwargs))

            return functools.update_wrapper(limited, value)

    return LimitedEnvironment


def _generation_tag():
    """The jinja2 extension of `{% generation %}...{% endgeneration %}`, which templates
    made for training on the assistant's tokens alone wrap those in (transformers marks
    them so): rendered as the body, as transformers renders it."""
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


@lru_cache(maxsize=8)
def compile_template(template: str):
    """The compiled jinja2 template (cached: a chat renders the same one every turn)."""
    try:
        import jinja2
        import jinja2.ext
    except ImportError as error:
        raise ImportError(f"chat templates need the jinja2 package: {INSTALL_HINT}") from error
    env = _environment_class()(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _generation_tag()],
    )
    env.concat = _concat  # (what the compiled template joins blocks and macros with)
    env.finalize = _finalize
    env.filters["tojson"] = _tojson
    for name, function in env.filters.items():
        env.filters[name] = _limited_filter(name, function)
    env.globals["lipsum"] = _lipsum
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

    token = _BUILT.set([0])
    try:
        return _with_deadline(limits.seconds, render)
    finally:
        _BUILT.reset(token)


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
