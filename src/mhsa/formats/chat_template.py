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
operation allocates, computed from its arguments. Every door the sandbox leaves open is
checked: the operators (* + % **), `~`, slices, the methods of str, bytes and int that can
grow a value (ljust, center, zfill, expandtabs, replace, join, translate, to_bytes),
str.format and format_map (each field's width, precision and value, nested widths
included), printf's widths (%*s too), the filters, the text of a container that is output
or formatted (a list of a million references to one long string), and blocks and macros.
No one value may pass `chars`, and what a rendering builds in all may not pass 100 times
`chars` (a loop that keeps many values, each within the limit).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import inspect
import itertools
import json
import re
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, MappingView, Sized
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from operator import index as _index
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


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@dataclass(frozen=True)
class RenderLimits:
    """seconds: how long one rendering may run; chars: the most characters (or items) it
    may output or build in one string or list (and 100 times that in all it builds)."""

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


# What a rendering has built so far (characters, and 16 for each item of a list or dict: a
# list of a million new one-character strings holds 80 MB); at most _BUILT_TIMES * chars.
_BUILT: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "chat_template_built", default=None
)
_BUILT_TIMES, _ITEM = 100, 16


def _build(what: str, size: int, weight: int = 1) -> None:
    """A value of size characters (weight 1) or items (weight _ITEM) is about to be built:
    refused past chars, or when what the rendering has built in all would pass
    _BUILT_TIMES * chars (a loop that keeps many values, each within the limit)."""
    _check_size(what, size)
    built = _BUILT.get()
    if built is not None:
        built[0] += size * weight
        if built[0] > _BUILT_TIMES * _limits().chars:
            raise TemplateLimitError(
                f"the chat template built {built[0]:,} characters (or items, {_ITEM} each) "
                f"in all, more than the {_BUILT_TIMES * _limits().chars:,} ({_BUILT_TIMES} "
                "times the limit) a rendering may build",
                "chars",
            )


def _built(what: str, value: Any) -> None:
    """Counts a string, list, tuple, dict or set just built (see _build)."""
    if isinstance(value, str | bytes | bytearray):
        _build(what, len(value))
    elif isinstance(value, list | tuple | dict | set | frozenset):
        _build(what, len(value), _ITEM)


_NUMBER = re.compile(r"\d+")
# printf's %[(key)][flags][width][.precision][length]type, and format()'s spec
_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d*)(\.\*|\.\d*)?[hlL]?(.?)", re.S)
_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[_,]?(?:\.(\d*))?[a-zA-Z%]?", re.S)
_BITS = 4096  # (the most bits a number that ** or * computes may have)
_END = object()


def _text_size(value: Any, separator: int = 2, indent: int = 0) -> int:
    """About len(str(value)): a string's length, a container's as its repr (or JSON with
    `separator` characters between items and `indent` more a level), counted only until it
    passes the limit, so that a million references to one long string cost nothing."""
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    from jinja2.utils import Namespace

    limit, size, stack = _limits().chars, 0, [iter((value,))]
    while stack and size <= limit:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        size += separator + indent * len(stack) + 1
        if isinstance(item, str | bytes | bytearray):
            size += len(item) + 2
        elif isinstance(item, int):
            size += item.bit_length() // 3
        elif isinstance(item, Mapping | Namespace):
            attributes = item._Namespace__attrs if isinstance(item, Namespace) else item
            size += 14 + indent * len(stack)
            stack.append(itertools.chain.from_iterable(attributes.items()))
        elif isinstance(item, list | tuple | AbstractSet | MappingView):
            size += 2 + indent * len(stack)
            stack.append(iter(item))
        else:
            size += 24  # (a float, None, a macro... whose text is short)
    return size


def _number(digits: str) -> int:
    return int(digits[:19]) if digits else 0  # (19 digits: past any limit already)


def _field_size(value: Any, width: Any, precision: Any, kind: str) -> int:
    """The most characters one formatted field (printf's or str.format's) can have."""
    for number in (width, precision):
        if isinstance(number, int):
            _check_size("asks to format a field", abs(number))
    precision = precision if isinstance(precision, int) else None
    if isinstance(value, str | bytes | bytearray):
        body = len(value) + 3 if precision is None else min(len(value), precision)
    elif isinstance(value, int | float) and kind not in ("s", "r", "a"):
        body = 500 + abs(precision or 0) + (value.bit_length() if isinstance(value, int) else 0)
    else:
        body = _text_size(value)
    return max(abs(width) if isinstance(width, int) else 0, body)


def _printf_size(template: str | bytes, values: Any) -> int:
    """The most characters template % values can have, before it is built."""
    text = template.decode("latin-1") if isinstance(template, bytes | bytearray) else template
    positional = iter(values if isinstance(values, tuple) else (values,))
    size = len(text)
    for key, width, precision, kind in _PRINTF.findall(text):
        if kind == "%":
            continue
        width = next(positional, 0) if width == "*" else _number(width)
        if precision:
            precision = next(positional, 0) if precision == ".*" else _number(precision[1:])
        else:
            precision = None
        if key:
            try:
                value = values[key]
            except Exception:
                value = None  # (% raises its own error)
        else:
            value = next(positional, None)
        size += _field_size(value, width, precision, kind)
    return size


def _spec_size(value: Any, spec: str) -> int:
    """The most characters format(value, spec) can have, before it is built."""
    match = _SPEC.fullmatch(spec)
    if match is None:  # (another mini-language: its numbers bound it)
        return _field_size(value, max(map(_number, _NUMBER.findall(spec)), default=0), None, "")
    precision = _number(match[2]) if match[2] else None
    return _field_size(value, _number(match[1]), precision, spec[-1:])


def _listed(values: Any) -> list | tuple:
    """values as a list (a generator consumed once), refused past the limit's count."""
    if isinstance(values, list | tuple):
        return values
    if isinstance(values, Sized):
        _build("builds a list", len(values), _ITEM)
        return list(values)
    items: list = []
    for item in values:
        items.append(item)
        if len(items) > _limits().chars:
            raise _too_large("builds a list", len(items))
    _build("builds a list", len(items), _ITEM)
    return items


def _lines(text: Any) -> int:
    """The most lines str.splitlines can cut text into."""
    if not isinstance(text, str):
        return 1
    return 1 + sum(map(text.count, "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"))


def _tab(text: Any) -> str | bytes:
    return "\t" if isinstance(text, str) else b"\t"


def _replaced(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    times = text.count(old)  # (len(text) + 1 for old == "")
    times = times if count is None or count < 0 else min(times, count)
    return len(text) + times * max(len(new) - len(old), 0)


def _joined(separator: Any, items: Any, size: Callable[[Any], int] = len) -> int:
    return sum(map(size, items)) + len(separator) * max(len(items) - 1, 0)


def _translated(text: Any, table: Any) -> int:
    values = table.values() if isinstance(table, Mapping) else table
    values = values if isinstance(values, Collection) and not isinstance(values, str) else ()
    return len(text) * max([len(v) for v in values if isinstance(v, str)] + [1])


# the size of what a method of a str, bytes or int makes, from its arguments
_METHODS: dict[str, Callable[..., int]] = {
    "ljust": lambda text, width, *fill: max(len(text), width),
    "rjust": lambda text, width, *fill: max(len(text), width),
    "center": lambda text, width, *fill: max(len(text), width),
    "zfill": lambda text, width: max(len(text), width),
    "expandtabs": lambda text, tabsize=8: len(text) + text.count(_tab(text)) * tabsize,
    "replace": _replaced,
    "join": lambda separator, items: _joined(separator, items),
    "translate": _translated,
    "to_bytes": lambda number, length=1, byteorder="big", signed=False: _index(length),
}


def _wrapped_size(a: dict, text: str) -> int:
    wrapstring = "\n" if a["wrapstring"] is None else a["wrapstring"]
    breaks = _lines(text) + sum(map(text.count, " \t\x0b\x0c-")) + len(text) // max(a["width"], 1)
    return len(text) + breaks * len(wrapstring)


def _items_size(a: dict, items: Any, field: str) -> int:
    if a["attribute"] is not None:
        from jinja2.filters import make_attrgetter

        environment = a.get("environment") or a["eval_ctx"].environment
        items = list(map(make_attrgetter(environment, a["attribute"]), items))
    if field == "d":  # (join: the text of each item)
        return _joined(str(a["d"]), items, _text_size)
    if not isinstance(a["start"], str | bytes | list | tuple):
        return 0  # (numbers)
    return len(a["start"]) + sum(len(i) for i in items if isinstance(i, str | bytes | list | tuple))


_TEXT_FILTERS = ("string", "e", "escape", "forceescape", "safe", "upper", "lower", "capitalize")
_TEXT_FILTERS += ("title", "trim", "striptags", "wordcount", "urlize", "urlencode", "truncate")
_TEXT_FILTERS += ("xmlattr",)
# filter -> (the argument that it makes text of, or lists; the size of what it makes)
_FILTERS: dict[str, tuple[str, Callable[[dict, Any], int] | None]] = {
    **{name: ("text", None) for name in _TEXT_FILTERS},
    "pprint": ("text", lambda a, text: _text_size(a["value"], 2, 1)),
    "center": ("text", lambda a, text: max(len(text), a["width"])),
    "indent": (
        "text",
        lambda a, text: (
            len(text)
            + (_lines(text) + 1) * (len(a["width"]) if isinstance(a["width"], str) else a["width"])
        ),
    ),
    "wordwrap": ("text", _wrapped_size),
    "replace": ("text", lambda a, text: _replaced(text, str(a["old"]), str(a["new"]), a["count"])),
    "format": ("text", lambda a, text: _printf_size(text, a["kwargs"] or a["args"])),
    "join": ("items", lambda a, items: _items_size(a, items, "d")),
    "sum": ("items", lambda a, items: _items_size(a, items, "start")),
    "batch": ("none", lambda a, value: _index(a["linecount"])),
    "slice": ("none", lambda a, value: _index(a["slices"])),
}
_PASSED = ("eval_ctx", "environment", "env", "context")


def _limited_filter(name: str, function: Any) -> Any:
    """The filter `name`, refusing before it runs to make more than the limit allows (the
    filters of _FILTERS), or counting what it made (the others: see _build)."""
    if name not in _FILTERS:

        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            _built(f"makes with the {name} filter a value", result)
            return result

        return counted
    kind, size = _FILTERS[name]
    signature = inspect.signature(function)
    parameters = list(signature.parameters)
    # (an async variant is passed the eval context that its signature does not show)
    skip = int(hasattr(function, "jinja_pass_arg") and parameters[0] not in _PASSED)
    subject = next(p for p in parameters if p not in _PASSED)

    @functools.wraps(function)  # (keeps jinja's pass_context marks)
    def limited(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args[skip:], **kwargs)
        except TypeError:
            return function(*args, **kwargs)  # (its own error)
        bound.apply_defaults()
        value = bound.arguments[subject]
        if kind == "items":
            value = bound.arguments[subject] = _listed(value)
        elif kind == "text":
            _check_size("makes text", _text_size(value))
            value = value if isinstance(value, str) or size is None else str(value)
        if size is not None:
            try:
                made = size(bound.arguments, value)
            except TemplateLimitError:
                raise
            except (TypeError, ValueError, AttributeError):
                made = 0  # (the filter raises its own error)
            _build(f"asks the {name} filter for text", made)
        result = function(*args[:skip], *bound.args, **bound.kwargs)
        if size is None:
            _built(f"makes with the {name} filter a value", result)
        elif isinstance(result, str | list):
            _check_size(f"makes with the {name} filter text", len(result))
        return result

    return limited


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    width = len(indent) if isinstance(indent, str) else (indent or 0)
    between = sum(map(len, separators)) if isinstance(separators, tuple | list) else 2
    _check_size("writes JSON", _text_size(value, between, width))
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _concat(pieces: Any) -> str:
    """The text of a block, a macro's call or a {% set %} block: its pieces joined, refused
    before they pass the limit (the rendering counts its own output only)."""
    kept, size, limit = [], 0, _limits().chars
    for piece in pieces:
        size += len(piece)
        if size > limit:
            raise _too_large("builds a string", size)
        kept.append(piece)
    _build("builds a string", size)
    return "".join(kept)


def _finalize(value: Any) -> Any:
    """What {{ value }} outputs, once its text is known not to pass the limit."""
    if not isinstance(value, str):
        _build("outputs a value", _text_size(value))
    return value


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    from jinja2.utils import generate_lorem_ipsum

    _build("asks lipsum for text", abs(n) * (abs(min) + abs(max)) * 12)
    return generate_lorem_ipsum(n, html, min, max)


def _check_numbers(operator: str, left: Any, right: Any) -> None:
    """A number that ** or * computes has at most _BITS bits (a product of two huge numbers
    takes minutes in one call that the time limit cannot stop)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if operator == "**" and abs(left) > 1 and right * abs(left).bit_length() > _BITS:
        what = f"{left}**{right}"
    elif operator == "*" and left.bit_length() + right.bit_length() > _BITS:
        what = f"a product of numbers of {left.bit_length()} and {right.bit_length()} bits"
    else:
        return
    raise TemplateLimitError(
        f"the chat template computes {what}, a number of more than {_BITS} bits", "chars"
    )


def _binop_result_size(operator: str, left: Any, right: Any) -> int:
    """The length a sequence result of left <operator> right would have (0: not one)."""
    sequence = str | bytes | bytearray | list | tuple
    if operator == "*":
        for items, count in ((left, right), (right, left)):
            if isinstance(items, sequence) and isinstance(count, int):
                return len(items) * max(count, 0)
    if operator == "+" and isinstance(left, sequence) and isinstance(right, sequence):
        return len(left) + len(right)
    if operator == "%" and isinstance(left, str | bytes | bytearray):
        return _printf_size(left, right)
    return 0


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
