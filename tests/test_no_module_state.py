"""No hidden state on the attention and decode paths: src/mhsa/core, cache, nn and models
keep no module-level mutable caches. What a decoding step needs travels in the step
(mhsa.PagedStep), and what a model keeps between calls (its compiled step, its captured
graph) lives on the model (models.compiled_step.StepMemo), never in a module-global
"last call" that the next call must guess is still valid. Found by reading the source
(ast), so a new one fails here as it is added:

    a module-level dict, list or set (or any object made by a call) that the module
        mutates: an item stored or deleted, a mutating method called (for an object made
        by a call: any method), an attribute stored, next() on it
    a name rebound at runtime through `global`
    a class used as a mutable singleton: its attributes stored at runtime (Class.x = ...,
        setattr(Class, ...), cls.x = ... in a classmethod)
    a function cache (functools.cache, lru_cache)

ALLOWED names the few that are no such state, each with the reason; an entry that no
longer matches anything fails too, so the list stays true."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "mhsa"
SCANNED = ("core", "cache", "nn", "models")

# (file under src/mhsa, name): why it is not hidden state of a call
ALLOWED = {
    ("core/backends/registry.py", "_BACKENDS"): (
        "the registry: backends register at import, every call reads it by name"
    ),
    ("core/backends/registry.py", "_forced"): (
        "use_backend's scope: a ContextVar, set and reset per thread and task"
    ),
    ("core/backends/registry.py", "_forced_generation"): (
        "counts use_backend entries, so that torch.compile guards a graph on the forced backend"
    ),
    ("core/scores.py", "_LIVING"): (
        "each ScoreMod under its name, for the custom ops and a traced graph's probe: weak "
        "values, an entry leaves with its ScoreMod"
    ),
    ("core/scores.py", "_NAME_NUMBERS"): "numbers those names (a counter, never read back)",
    ("core/backends/op_scores.py", "_PLACES"): (
        "where a ScoreMod's function reads its tensors, found once (weak keys)"
    ),
    ("core/backends/op_values.py", "_REBUILT"): (
        "a pattern per repr text, for the custom ops: keyed by the whole content"
    ),
    ("core/backends/flex.py", "_CACHE"): (
        "FlexAttention BlockMasks keyed by the pattern and the call's shape (PatternCache)"
    ),
    ("core/backends/flex.py", "_compiled_flex"): "torch.compile(flex_attention), made once",
    ("core/backends/triton.py", "_triton_installed"): "whether triton imports, asked once",
    ("core/kernels/triton/tiles.py", "_CACHE"): (
        "Triton tile lists keyed by the pattern and the call's shape (PatternCache)"
    ),
    ("core/kernels/triton/scores.py", "bucket_lookup"): (
        "T5's bucket table, keyed by all its parameters"
    ),
}

CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"}
CONTAINERS |= {"WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update"}
MUTATORS |= {"setdefault", "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"}
CACHES = {"cache", "lru_cache", "cached_property"}


def _name(node: ast.AST) -> str | None:
    """The last part of a name or dotted attribute (functools.lru_cache -> lru_cache)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _stored(node: ast.AST) -> str | None:
    """NAME of a NAME[...] or NAME.x that node stores or deletes, else None."""
    if isinstance(node, ast.Subscript | ast.Attribute) and isinstance(
        node.ctx, ast.Store | ast.Del
    ):
        return node.value.id if isinstance(node.value, ast.Name) else None
    return None


def _module_objects(tree: ast.Module) -> dict[str, bool]:
    """Module-level names bound to a mutable object: name -> whether it is a plain
    container (else an object some call made)."""
    objects = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        displays = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
        container = isinstance(value, displays) or (
            isinstance(value, ast.Call) and _name(value) in CONTAINERS
        )
        if container or isinstance(value, ast.Call):
            for target in targets:
                if isinstance(target, ast.Name):
                    objects[target.id] = container
    return objects


def findings(path: Path) -> set[str]:
    """The names in one file that hold module-level mutable state (see the docstring)."""
    tree = ast.parse(path.read_text(), str(path))
    objects = _module_objects(tree)
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = {_name(d) for d in node.decorator_list}
            if decorators & CACHES:
                found.add(node.name)
            if "classmethod" in decorators and any(
                _stored(inner) == "cls" for inner in ast.walk(node)
            ):  # cls.x = ... makes the class a singleton
                found.add(node.name)
        elif (owner := _stored(node)) is not None:
            if owner in objects or (owner in classes and isinstance(node, ast.Attribute)):
                found.add(owner)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                owner = func.value.id
                if owner in objects and (func.attr in MUTATORS or not objects[owner]):
                    found.add(owner)
            elif _name(func) in ("next", "setattr") and node.args:
                first = node.args[0]
                if isinstance(first, ast.Name) and (first.id in objects or first.id in classes):
                    found.add(first.id)
    return found


def all_findings() -> set[tuple[str, str]]:
    return {
        (path.relative_to(SOURCE).as_posix(), name)
        for part in SCANNED
        for path in sorted((SOURCE / part).rglob("*.py"))
        for name in findings(path)
    }


def test_the_attention_and_decode_paths_keep_no_module_level_mutable_state():
    found = all_findings()
    assert found - set(ALLOWED) == set(), "module-level mutable state; pass it instead"
    assert set(ALLOWED) - found == set(), "ALLOWED names what is no longer there"


def test_the_check_finds_each_kind_of_hidden_state(tmp_path):
    """The check itself: the four last-call caches the decode path once kept, and the
    other shapes module state takes, are each found; constants and instance state are
    not."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import functools, itertools, weakref\n"
        "SIZES = (1, 2)\n"
        "NAMES = {'a': 1}\n"  # a constant: read only
        "_last_paged = [None, None]\n"
        "_seen = {}\n"
        "_hits = {}\n"
        "_refs = weakref.WeakKeyDictionary()\n"
        "_numbers = itertools.count()\n"
        "_memo = Memo()\n"
        "_total = 0\n"
        "class _LastPlan:\n"
        "    key = ()\n"
        "class _LastLayout:\n"
        "    last = ((), [])\n"
        "class _LastTable:\n"
        "    table = None\n"
        "class Holder:\n"
        "    def __init__(self):\n"
        "        self.memo = {}\n"  # instance state: fine
        "    def put(self, k, v):\n"
        "        self.memo[k] = v\n"
        "    @classmethod\n"
        "    def reset(cls):\n"
        "        cls.count = 0\n"
        "def select(key):\n"
        "    global _total\n"
        "    _total += 1\n"
        "    _last_paged[:] = [key, NAMES['a']]\n"
        "    _seen.setdefault(key, 1)\n"
        "    _hits[key] += 1\n"
        "    _refs[key] = 1\n"
        "    _LastPlan.key = key\n"
        "    _LastLayout.last = key, []\n"
        "    setattr(_LastTable, 'table', key)\n"
        "    _memo.get(key)\n"
        "    return next(_numbers), SIZES\n"
        "@functools.lru_cache(maxsize=4)\n"
        "def lookup(key):\n"
        "    return key\n"
    )
    assert findings(planted) == {
        "_last_paged",
        "_seen",
        "_hits",
        "_refs",
        "_numbers",
        "_memo",
        "_total",
        "_LastPlan",
        "_LastLayout",
        "_LastTable",
        "reset",
        "lookup",
    }
