"""Chat template renderings are bounded (mhsa.formats.chat_template.render_limits): each
way a template can ask for a huge value, or run for ever, is a TemplateLimitError naming
the limit, and the thread that rendered carries on unharmed."""

from __future__ import annotations

import pytest

from mhsa.formats.chat_template import TemplateLimitError, render_chat, render_limits
from optional import needs

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "template, limit",
    [
        ("{{ 'a' * 10**10 }}", "chars"),
        ("{{ [1] * 10**9 }}", "chars"),
        ("{% set s = 'a' * 60000 %}{{ s + s }}", "chars"),
        ("{{ 'a' | center(10**10) }}", "chars"),
        ("{{ 'a' | indent(10**10) }}", "chars"),
        ("{{ '%99999999999s' | format(1) }}", "chars"),
        ("{{ '%99999999999s' % 1 }}", "chars"),
        ("{{ '{:>99999999999}'.format(1) }}", "chars"),
        ("{{ 2 ** 100000 }}", "chars"),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "chars",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "seconds",
        ),
    ],
)
def test_a_template_that_asks_too_much_is_stopped(template, limit):
    needs("jinja2")
    with render_limits(0.5, 100_000), pytest.raises(TemplateLimitError) as caught:
        render_chat(template, MESSAGES)
    assert caught.value.limit == limit
    assert render_chat("{{ messages[0].content }}", MESSAGES) == "hi"  # (this thread is fine)


def test_templates_within_the_limits_render_as_before():
    needs("jinja2")
    template = "{% for m in messages %}{{ m.role | upper }}={{ '%-4s' % m.content }}|{% endfor %}"
    with render_limits(0.5, 100):
        assert render_chat(template, MESSAGES) == "USER=hi  |"
    assert render_chat("{{ 'ab' * 3 }}{{ 2 ** 10 }}", MESSAGES) == "ababab1024"


def test_raise_exception_is_a_template_error_and_a_value_error():
    jinja2 = needs("jinja2")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system") as caught:
        render_chat("{{ raise_exception('no system') }}", MESSAGES)
    assert isinstance(caught.value, ValueError)  # (a command prints it in one line)
