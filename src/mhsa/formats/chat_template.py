"""Render a chat template (Jinja, as tokenizer_config.json or a GGUF's tokenizer.chat_template
holds it) into a prompt, the way transformers' apply_chat_template(tokenize=False) does.

The template is untrusted text from a model file, so it runs in jinja2's immutable sandbox.
The environment matches transformers' (utils/chat_template_utils.py): trim_blocks and
lstrip_blocks, the loop-controls extension, a `tojson` filter that does not escape HTML and
keeps non-ASCII, and the globals `raise_exception(message)`, `strftime_now(format)`. The
template sees `messages`, `add_generation_prompt`, `tools`, `documents` and any extra
variables (bos_token, eos_token... from the caller).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

INSTALL_HINT = "pip install jinja2 (or pip install 'mhsa[chat]')"


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


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


@lru_cache(maxsize=8)
def compile_template(template: str):
    """The compiled jinja2 template (cached: a chat renders the same one every turn)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise ImportError(f"chat templates need the jinja2 package: {INSTALL_HINT}") from error
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
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
    return compile_template(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **context
    )
