"""The package's imports go one way, in the layer order LAYERS below states: a module
may import its own layer's parts or any layer below, never one above,
and no import cycle exists, between modules or between the parts of the package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "mhsa"
# The layers, top first. A module may import its own layer or any layer below it.
# Parts inside core/ and apps/ are layers of their own; elsewhere a part is a top-level
# package or module. docs/ and the README describe this order; this list is the rule.
LAYERS = [
    ["cli"],
    ["benchmarks"],
    ["apps.serve", "apps.export", "apps.viz"],
    ["apps.chat", "apps.embed", "apps.transcribe", "apps.train"],
    ["integrations", "flex", "masks", "scores", "positional"],
    ["models"],
    ["nn"],
    ["cache", "distributed", "testing"],
    ["core.varlen"],
    ["core.attention", "core.cluster", "core.moba"],
    ["core.paged"],
    ["core.validate"],
    ["core.backends"],
    ["core.kernels"],
    ["core.masks"],
    ["core.paged_step"],
    ["core.scores", "core.score_checks", "core.checks", "core.tracing"],
    ["checkpoint"],
    ["formats", "data", "packaged", "launch", "version"],
]


def stated_layers() -> list[list[str]]:
    """The layers, top first."""
    return LAYERS


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in SOURCE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The mhsa modules that module `name` imports, anywhere in its body (imports inside
    functions count: they are dependencies too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {target for target in found if target == "mhsa" or target.startswith("mhsa.")}


NESTED = ("core", "apps")  # packages whose parts are layers of their own


def part_of(module: str) -> str:
    """The part of the package a module belongs to ('' for the root and for the
    `core` and `apps` packages themselves)."""
    parts = module.split(".")[1:]
    if not parts or (parts[0] in NESTED and len(parts) == 1):
        return ""
    return ".".join(parts[:2]) if parts[0] in NESTED else parts[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as a list of nodes, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_part_of_the_package_has_a_stated_layer():
    stated = [part for layer in stated_layers() for part in layer]
    assert len(stated) == len(set(stated)), f"a part is listed twice: {stated}"
    parts = {part_of(name) for name in modules()} - {""}
    assert parts <= set(stated), f"place these in LAYERS: {parts - set(stated)}"
    assert set(stated) <= parts, f"LAYERS lists parts that do not exist: {set(stated) - parts}"


def test_imports_never_go_up_the_stated_order(graph):
    level = {part: i for i, layer in enumerate(stated_layers()) for part in layer}
    upward = []
    for name, targets in graph.items():
        if name == "mhsa":
            continue  # the root only re-exports, for users
        for target in targets:
            if target == "mhsa":
                upward.append(f"{name} imports the root package (import the module instead)")
            elif level[part_of(target)] < level[part_of(name)]:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports that go up the order in LAYERS:\n" + "\n".join(sorted(upward))


def test_no_import_cycle_between_modules(graph):
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_import_cycle_between_parts(graph):
    parts: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if name == "mhsa":
            continue
        source = part_of(name)
        parts.setdefault(source, set()).update(
            part_of(t) for t in targets if part_of(t) not in ("", source)
        )
    assert find_cycle(parts) is None, " -> ".join(find_cycle(parts))


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    """The helpers above on a made-up package: they must fail where they should."""
    (tmp_path / "mhsa" / "low").mkdir(parents=True)
    (tmp_path / "mhsa" / "__init__.py").write_text("")
    (tmp_path / "mhsa" / "low" / "__init__.py").write_text("")
    (tmp_path / "mhsa" / "low" / "a.py").write_text("def f():\n    from ..high import g\n")
    (tmp_path / "mhsa" / "high.py").write_text("from .low.a import f\n")
    paths = {
        "mhsa.low.a": tmp_path / "mhsa" / "low" / "a.py",
        "mhsa.high": tmp_path / "mhsa" / "high.py",
    }
    known = set(paths) | {"mhsa", "mhsa.low"}
    edges = {name: imports_of(name, path, known) for name, path in paths.items()}
    assert edges == {"mhsa.low.a": {"mhsa.high"}, "mhsa.high": {"mhsa.low.a"}}
    assert find_cycle(edges) in (
        ["mhsa.high", "mhsa.low.a", "mhsa.high"],
        ["mhsa.low.a", "mhsa.high", "mhsa.low.a"],
    )


@pytest.mark.slow
def test_mhsa_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import mhsa\n"
        "from mhsa.core.backends.triton import TritonBackend\n"
        "print(TritonBackend().available())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "not installed" in result.stdout


def test_the_root_names_load_on_first_use():
    """`import mhsa` is light; every name of mhsa.__all__ loads on first use, and the
    ring backend is registered with the first."""
    code = (
        "import sys, mhsa\n"
        "assert 'torch' not in sys.modules\n"
        "for name in mhsa.__all__:\n"
        "    getattr(mhsa, name)\n"
        "from mhsa import attention, masks\n"
        "assert 'ring' in mhsa.backends(), mhsa.backends()\n"
        "assert set(mhsa.__all__) <= set(dir(mhsa))\n"
        "try:\n"
        "    mhsa.no_such_name\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "module 'mhsa' has no attribute 'no_such_name'"


def test_the_public_modules_import_by_their_dotted_names():
    """`import mhsa.masks` (and scores, positional) works as `from mhsa import masks`
    does, and both give one module object, whichever comes first."""
    code = (
        "import mhsa.masks, mhsa.scores, mhsa.positional\n"
        "from mhsa.masks import SlidingWindow\n"
        "from mhsa.scores import Softcap\n"
        "from mhsa.positional import alibi_slopes\n"
        "import mhsa.core.masks, mhsa.core.scores, mhsa.nn.positional\n"
        "assert mhsa.masks is mhsa.core.masks, mhsa.masks\n"
        "assert mhsa.scores is mhsa.core.scores, mhsa.scores\n"
        "assert mhsa.positional is mhsa.nn.positional, mhsa.positional\n"
        "from mhsa import masks, positional, scores\n"
        "assert (masks, scores, positional) == (mhsa.masks, mhsa.scores, mhsa.positional)\n"
        "assert SlidingWindow is masks.SlidingWindow and Softcap is scores.Softcap\n"
        "assert alibi_slopes is positional.alibi_slopes\n"
    )
    for first in ("", "from mhsa import masks, positional, scores\n"):
        ran = subprocess.run(
            [sys.executable, "-c", first + code], capture_output=True, text=True, timeout=300
        )
        assert ran.returncode == 0, ran.stderr


def test_docs_layout_states_the_layers_of_this_test():
    """docs/layout.md restates LAYERS in one line; it cannot drift from the rule."""
    line = "imports: " + " -> ".join(", ".join(layer) for layer in LAYERS)
    assert line in (ROOT / "docs" / "layout.md").read_text().splitlines()
