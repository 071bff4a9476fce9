"""Chat-template bombs are refused before they allocate: each asks, through a string method,
a format width, a printf width, a replace, a concatenation, a filter or the repr of a shared
container, for gigabytes that a template a few dozen characters long can name. They render
under the server's size limit (1,000,000 characters; the time limit raised to 60 s, so
that the size limit refuses them on any CPU) in one child process whose address
space is capped at 1 GiB above what it holds after its imports: a refusal that came after
the allocation shows as a MemoryError there, never as gigabytes in the test process."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from mhsa.formats.chat_template import render_chat, render_limits
from optional import needs

MESSAGES = [{"role": "user", "content": "hi"}]
BIG = "{% set s = 'a' * 1000000 %}"  # (a string just at the limit)
LIST = "{% set l = [s] * 1000000 %}"  # (8 MB of references, 10**12 characters as text)


def keep(value: str) -> str:
    """A loop that keeps 100,000 values, each within the limit."""
    loop = "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    return BIG + loop + "{% set ns.l = ns.l + [" + value + "] %}{% endfor %}{{ ns.l | length }}"


BOMBS = {
    # the rows of issue 47 (3.4 GB, 3.4 GB, 3.4 GB, 3.4 GB, 2.0 GB before)
    "ljust": "{{ 'a'.ljust(3000000000) }}",
    "nested format width": "{{ '{0:{1}}'.format('a', 3000000000) }}",
    "printf star width": "{{ '%*s' % (3000000000, 'a') }}",
    "replace": BIG + "{{ s.replace('a', 'a' * 3000) }}",
    "namespace doubling": "{% set ns = namespace(s='a') %}{% for i in range(31) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    # the same kinds of request through the other doors
    "rjust": "{{ 'a'.rjust(3000000000) }}",
    "center method": "{{ 'a'.center(3000000000) }}",
    "zfill": "{{ '1'.zfill(3000000000) }}",
    "expandtabs": BIG + "{{ s.replace('a', '\t').expandtabs(4000) | length }}",
    "format width": "{{ '{:>3000000000}'.format(1) }}",
    "format keyword width": "{{ '{0:>{w}}'.format('a', w=3000000000) }}",
    "format precision": "{{ '{:.3000000000f}'.format(1.0) }}",
    "format_map": "{{ '{a:{w}}'.format_map({'a': 'a', 'w': 3000000000}) }}",
    "format many fields": BIG + "{{ ('{0}' * 2000).format(s) | length }}",
    "format repr of shared list": BIG + LIST + "{{ '{}'.format(l) | length }}",
    "printf width": "{{ '%3000000000s' % 'a' }}",
    "printf precision": "{{ '%.*f' % (2000000000, 1.0) }}",
    "printf many fields": BIG + "{{ (('%s' * 2000) % ((s,) * 2000)) | length }}",
    "printf keyed width": "{{ '%(a)3000000000s' % {'a': 1} }}",
    "bytes printf": "{{ ('%*s'.encode()) % (3000000000, 'a'.encode()) }}",
    "replace empty": BIG + "{{ s.replace('', 'b' * 3000) | length }}",
    "join method": BIG + "{{ s.join(s) | length }}",
    "join of a generator": BIG + "{{ s.join(range(100000) | map('string')) | length }}",
    "translate": BIG + "{{ s.translate({97: 'b' * 3000}) | length }}",
    "to_bytes": "{{ (1).to_bytes(3000000000, 'big') | length }}",
    "concat of many": BIG + "{{ (s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s) | length }}",
    "plus doubling": "{% set ns = namespace(s='a') %}{% for i in range(31) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "markup plus": "{% set ns = namespace(s='a' | safe) %}{% for i in range(31) %}"
    "{% set ns.s = ns.s + (ns.s ~ '') %}{% endfor %}{{ ns.s | length }}",
    "bytes repeat": "{{ 'a'.encode() * 3000000000 }}",
    "block set": BIG + "{% set t %}{% for i in range(3000) %}{{ s }}{% endfor %}{% endset %}"
    "{{ t | length }}",
    "macro": BIG + "{% macro m() %}{% for i in range(3000) %}{{ s }}{% endfor %}{% endmacro %}"
    "{{ m() | length }}",
    "filter block": BIG + "{% filter upper %}{% for i in range(3000) %}{{ s }}{% endfor %}"
    "{% endfilter %}",
    "output of a shared list": BIG + LIST + "{{ l }}",
    "string filter of a shared list": BIG + LIST + "{{ l | string | length }}",
    "nested literal lists": BIG + "{% set ns = namespace(l=[s]) %}{% for i in range(31) %}"
    "{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l | length }}{{ ns.l }}",
    "tojson of a shared list": BIG + LIST + "{{ l | tojson | length }}",
    "tojson indent": "{% set ns = namespace(l=1) %}{% for i in range(200) %}"
    "{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l | tojson(indent=900000) | length }}",
    "tojson separators": BIG + "{{ ([1] * 100000) | tojson(separators=(s, ':')) | length }}",
    "pprint of a shared list": BIG + LIST + "{{ l | pprint | length }}",
    "join filter": BIG + LIST + "{{ l | join | length }}",
    "join filter separator": BIG + "{{ s | join(s) | length }}",
    "printf of a shared list": BIG + LIST + "{{ ('%s' % (l,)) | length }}",
    "concat of a shared list": BIG + LIST + "{{ (l ~ '') | length }}",
    "center filter": "{{ 'a' | center(3000000000) }}",
    "indent filter": BIG + "{{ s[:500000].replace('a', 'a\n') | indent(3000) | length }}",
    "indent filter string": BIG + "{{ s[:500000].replace('a', 'a\r') | indent(s) | length }}",
    "wordwrap filter": BIG + "{{ s | wordwrap(1, wrapstring=s) | length }}",
    "replace filter": BIG + "{{ s | replace('a', 'a' * 3000) | length }}",
    "format filter": "{{ '%*s' | format(3000000000, 'a') }}",
    "sum of lists": "{% set l = [1] * 1000000 %}{{ ([l] * 150) | sum(start=[]) | length }}",
    "integer product": "{% set ns = namespace(x=4 ** 1000) %}{% for i in range(40) %}"
    "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
    "lipsum": "{{ lipsum(1, min=3000000000, max=3000000001) | length }}",
    # many values, each within the limit, kept by a loop (2 GB in the 2 s before)
    "kept concatenations": keep("s[:999990] ~ i"),
    "kept slices": keep("s[i:]"),
    "kept filter results": keep("s | upper"),
    "kept method results": keep("s.lower()"),
    "kept lists": keep("t | list").replace(BIG, BIG + "{% set t = '€' * 1000000 %}"),
    "kept formats": keep("'{}{}'.format(s[:999990], i)"),
    "mapped filter": BIG + "{{ ([s] * 100000) | map('upper') | list | length }}",
}

REFUSAL = (
    r"1,000,000 a rendering may make|more than 4096 bits"
    r"|more than the 100,000,000 \(100 times the limit\) a rendering may build"
)
CHILD = """
import json, resource, sys, time
from mhsa.formats.chat_template import TemplateLimitError, render_chat, render_limits
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))
outcomes = {}
for name, template in json.loads(sys.stdin.read()).items():
    start = time.perf_counter()
    try:
        with render_limits(60.0, 1_000_000):  # (time ample on any CPU: size must refuse)
            outcome = ["rendered", len(render_chat(template, [{"role": "user", "content": "hi"}]))]
    except TemplateLimitError as error:
        outcome = ["limit", error.limit, str(error)]
    except BaseException as error:
        outcome = [type(error).__name__, str(error)[:200]]
    outcomes[name] = outcome + [round(time.perf_counter() - start, 3)]
print(json.dumps(outcomes))
"""


@pytest.fixture(scope="module")
def outcomes() -> dict:
    needs("jinja2")
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(BOMBS),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bomb", list(BOMBS))
def test_a_bomb_is_refused_before_it_allocates(outcomes, bomb):
    outcome = outcomes[bomb]
    assert outcome[:2] == ["limit", "chars"], outcome  # (a MemoryError: it allocated first)
    assert re.search(REFUSAL, outcome[2]), outcome[2]


REAL = [
    # (template, variables, expected): what templates of real models do with these doors
    ("{{ '%-6s|%5.2f|%03d' % ('ab', 3.14159, 7) }}", {}, "ab    | 3.14|007"),
    ("{{ '{:>6}|{:<4}|{:^7.3f}|{!r}'.format('ab', 1, 2.5, 'x') }}", {}, "    ab|1   | 2.500 |'x'"),
    ("{{ '{0:{1}}|{a}'.format('x', 4, a=[1, 'b']) }}", {}, "x   |[1, 'b']"),
    ("{{ 'ab'.ljust(4, '.') ~ 'cd'.center(6, '*') ~ '7'.zfill(3) }}", {}, "ab..**cd**007"),
    ("{{ 'a\tb'.expandtabs(4) ~ 'a-b-c'.replace('-', '--', 1) }}", {}, "a   ba--b-c"),
    (
        "{{ ', '.join(['x', 'y']) ~ ' ' ~ [1, {'k': (2, none)}] ~ ' ' ~ 1.5 }}",
        {},
        "x, y [1, {'k': (2, None)}] 1.5",
    ),
    (
        "{{ tools | tojson(indent=2) }}",
        {"tools": [{"a": [1]}]},
        '[\n  {\n    "a": [\n      1\n    ]\n  }\n]',
    ),
    (
        "{{ 'a\nb' | indent(2, true) }}|{{ 'x y z' | wordwrap(3) }}|{{ 'ab' | center(6) }}",
        {},
        "  a\n  b|x y\nz|  ab  ",
    ),
    (
        "{{ [1, 2] | join('-') }}|{{ [[1], [2]] | sum(start=[]) }}|{{ '%s=%d' | format('a', 2) }}",
        {},
        "1-2|[1, 2]|a=2",
    ),
    (
        "{% set t %}a{{ 'b' }}{% endset %}{% macro m(x) %}<{{ x }}>{% endmacro %}{{ t ~ m(t) }}",
        {},
        "ab<ab>",
    ),
    (
        "{{ 'abc'.translate({97: 'xy'}) ~ (3).to_bytes(2, 'big') | string }}",
        {},
        "xybcb'\\x00\\x03'",
    ),
    ("{{ (2 ** 100) * (3 ** 50) }}", {}, str(2**100 * 3**50)),
]


@pytest.mark.parametrize("template, variables, expected", REAL)
def test_what_real_templates_do_still_renders(template, variables, expected):
    needs("jinja2")
    assert render_chat(template, MESSAGES, **variables) == expected
    with render_limits(2.0, 1_000_000):
        assert render_chat(template, MESSAGES, **variables) == expected


def test_generation_blocks_render_their_body_as_transformers_does():
    """TRL's assistant-only-loss templates wrap the assistant's turns in
    {% generation %}...{% endgeneration %}; rendering shows the body."""
    needs("jinja2")
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "[{{ m.content }}]{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    messages = [*MESSAGES, {"role": "assistant", "content": "hello"}]
    assert render_chat(template, messages, add_generation_prompt=False) == "hi[hello]"


LOOP = "{{% set ns = namespace(s='a') %}}{{% for i in range({}) %}}{}{{% endfor %}}{{{{ ns.s }}}}"


def test_a_value_just_within_the_limit_renders():
    needs("jinja2")
    with render_limits(2.0, 1000):
        assert len(render_chat("{{ 'a'.ljust(1000) }}", MESSAGES)) == 1000
        assert len(render_chat("{{ '{:>1000}'.format(1) }}", MESSAGES)) == 1000
        assert len(render_chat("{{ ('a' * 500).replace('a', 'bb') }}", MESSAGES)) == 1000
        doubling = "{% set ns.s = ns.s ~ ns.s %}"
        template = LOOP.format(9, doubling)
        assert len(render_chat(template, MESSAGES)) == 512
        growing = "{% set ns.s = ns.s ~ 'x' * 16 %}"  # (29,000 characters built in all)
        assert len(render_chat(LOOP.format(60, growing), MESSAGES)) == 961
