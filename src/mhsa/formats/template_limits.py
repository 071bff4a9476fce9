"""The limits of a chat-template rendering (chat_template.py): RenderLimits and
TemplateLimitError, and the size of what each operation the sandbox allows would build,
computed from its arguments before it allocates (the operators, `~`, slices, the methods
of str, bytes and int that grow a value, str.format and printf widths, the filters, the
text of containers), with the running total of what a rendering has built."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping, MappingView, Sized
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from operator import index as _index
from typing import Any


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
