"""The package's shape, read from the source with `ast` (nothing is imported).

Layers, lowest first: util < core.policy < core < methods < serving < harness < cli; the facade
`reasonkv/__init__.py` sits on top. A module may import its own layer or a lower one; pure
policy math imports no transformers; util imports no reasonkv module; no import cycles;
policy classes are not type-checked outside core; files stay short; comments and
docstrings do not point at files outside the repository.

Each rule is a small function over (module name, source text), so the tests at the bottom
can feed it a hand-made violation and check that it is caught.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "reasonkv"
MAX_LINES = 550

LAYERS = (  # (prefix, rank): the first matching prefix wins
    ("reasonkv.util", 0),
    ("reasonkv.core.policy", 1),
    ("reasonkv.core", 2),
    ("reasonkv.methods", 3),
    ("reasonkv.serving", 4),
    ("reasonkv.harness", 5),
    ("reasonkv.cli", 6),
)
LAYER_NAMES = {0: "util", 1: "core.policy", 2: "core", 3: "methods", 4: "serving", 5: "harness", 6: "cli"}

OUTSIDE_POINTERS = (
    ("DESIGN.md", re.compile(re.escape("DESIGN.md"))),
    ("shared/", re.compile(re.escape("shared/"))),
    ("seeds/", re.compile(re.escape("seeds/"))),
    ("methods.md", re.compile(re.escape("methods.md"))),
    ("§", re.compile("§")),
    ("issue <n>", re.compile(r"(?i)\bissue #?\d")),
)


# --------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. reasonkv.core.cache; a package is named by its __init__
    path: str  # for messages: relative to src/
    text: str
    is_package: bool = False

    @property
    def tree(self) -> ast.Module:
        return ast.parse(self.text, filename=self.path)


def module_from_text(name: str, text: str, is_package: bool = False) -> Module:
    path = name.replace(".", "/") + ("/__init__.py" if is_package else ".py")
    return Module(name, path, text, is_package)


def load_modules(src: Path = SRC) -> dict[str, Module]:
    modules = {}
    for file in sorted((src / PACKAGE).rglob("*.py")):
        rel = file.relative_to(src)
        is_package = rel.name == "__init__.py"
        parts = rel.parent.parts if is_package else rel.with_suffix("").parts
        name = ".".join(parts)
        modules[name] = Module(name, str(rel), file.read_text(encoding="utf-8"), is_package)
    return modules


def _resolve_base(module: Module, node: ast.ImportFrom) -> str | None:
    """The absolute module a `from X import ...` reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 > len(parts) - 1:
        return None
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _owning_module(name: str, known: set[str]) -> str:
    """The longest prefix of dotted `name` that is a known module (`name` itself if none is)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return name


def imported_names(module: Module) -> list[tuple[str, int]]:
    """Every absolute module name `module` imports from, anywhere in the file, with its line
    (`from a.b import c` gives a.b)."""
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(module, node)
            if base is None:
                continue
            found.append((base, node.lineno))
    return found


def reasonkv_imports(module: Module, known: set[str]) -> dict[str, int]:
    """{imported reasonkv module: first line}. `from reasonkv.x import y` is an edge to
    reasonkv.x.y when that is a module, else to reasonkv.x; `import reasonkv.x.y` to the
    longest known prefix. A package's `__init__` is only an edge when named explicitly."""
    edges: dict[str, int] = {}
    for node in ast.walk(module.tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_owning_module(a.name, known) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(module, node)
            if base is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known else _owning_module(base, known))
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                edges.setdefault(target, node.lineno)
    return edges


def import_graph(modules: dict[str, Module]) -> dict[str, dict[str, int]]:
    known = set(modules)
    return {name: reasonkv_imports(mod, known) for name, mod in modules.items()}


# ----------------------------------------------------------------------------- rules
def layer_of(name: str) -> int | None:
    """The rank of a module; None for the facade (`reasonkv`) and for modules outside every layer."""
    for prefix, rank in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return rank
    return None


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Edges that go up a layer, import the facade, or leave a module outside every layer."""
    bad = []
    for source, edges in sorted(graph.items()):
        src_rank = layer_of(source)
        if source != PACKAGE and src_rank is None:
            bad.append(f"{source}: belongs to no layer ({', '.join(p for p, _ in LAYERS)})")
            continue
        for target, line in sorted(edges.items()):
            if target == PACKAGE:
                if source != PACKAGE:
                    bad.append(f"{source}:{line} -> reasonkv (the facade; import the module that defines it)")
                continue
            dst_rank = layer_of(target)
            if dst_rank is None:
                bad.append(f"{source}:{line} -> {target} (a module outside every layer)")
            elif source != PACKAGE and dst_rank > src_rank:
                bad.append(
                    f"{source}:{line} -> {target} "
                    f"({LAYER_NAMES[src_rank]} must not import {LAYER_NAMES[dst_rank]})"
                )
    return bad


def forbidden_third_party(modules: dict[str, Module], prefix: str, banned: str) -> list[str]:
    """Imports of `banned` (or its submodules) in modules under `prefix`."""
    bad = []
    for name, mod in sorted(modules.items()):
        if not (name == prefix or name.startswith(prefix + ".")):
            continue
        for imported, line in imported_names(mod):
            if imported == banned or imported.startswith(banned + "."):
                bad.append(f"{mod.path}:{line} imports {imported}")
    return sorted(set(bad))


ENGINE_NEUTRAL = ("reasonkv.core.step", "reasonkv.serving.paged_rows", "reasonkv.serving.prefix_sharing")
"""The one decode step, the storage serving engines give it and their prefix-sharing rule: below
every engine integration, so none may reach transformers, not even through another reasonkv
module."""


def reaches_third_party(
    modules: dict[str, Module], graph: dict[str, dict[str, int]], roots: tuple[str, ...], banned: str
) -> list[str]:
    """For each root, the chain of reasonkv imports by which it reaches a module importing `banned`."""
    bad = []
    for root in roots:
        seen, stack = {root: [root]}, [root]
        while stack:
            name = stack.pop()
            mod = modules.get(name)
            if mod is not None and any(
                i == banned or i.startswith(banned + ".") for i, _ in imported_names(mod)
            ):
                bad.append(f"{root} reaches {banned} through {' -> '.join(seen[name])}")
                break
            for target in sorted(graph.get(name, {})):
                if target not in seen:
                    seen[target] = seen[name] + [target]
                    stack.append(target)
    return bad


def util_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    return [
        f"{source}:{line} -> {target}"
        for source, edges in sorted(graph.items())
        if layer_of(source) == 0
        for target, line in sorted(edges.items())
    ]


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with a cycle (more than one module, or a self-import), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:  # Tarjan, iterative: no recursion limit to worry about
        nonlocal counter
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, {}):
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def describe_cycle(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(component)
    edges = [f"{a}:{graph[a][b]} -> {b}" for a in component for b in sorted(graph.get(a, {})) if b in members]
    return f"cycle among {', '.join(component)}: " + "; ".join(edges)


def class_names(modules: dict[str, Module], prefix: str) -> set[str]:
    """Names of every class defined (at any depth) in the modules under `prefix`."""
    return {
        node.name
        for name, mod in modules.items()
        if name == prefix or name.startswith(prefix + ".")
        for node in ast.walk(mod.tree)
        if isinstance(node, ast.ClassDef)
    }


def _names_in(node: ast.expr) -> list[str]:
    """`X`, `a.X`, and the members of a tuple of those."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _names_in(elt)]
    return []


def type_checks_of(module: Module, names: set[str]) -> list[str]:
    """isinstance/issubclass calls in `module` whose class argument names one of `names`
    (classes the module defines itself do not count)."""
    tree = module.tree
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2):
            continue
        if node.func.id not in ("isinstance", "issubclass"):
            continue
        hits = [n for n in _names_in(node.args[1]) if n in names and n not in own]
        if hits:
            bad.append(f"{module.path}:{node.lineno} {node.func.id}(..., {'/'.join(hits)})")
    return bad


def long_files(modules: dict[str, Module], limit: int = MAX_LINES) -> list[str]:
    counts = ((mod.path, len(mod.text.splitlines())) for mod in modules.values())
    return [f"{path}: {n} lines" for path, n in sorted(counts) if n > limit]


def comments_and_docstrings(module: Module) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string statement (docstrings, attribute docs)."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(module.text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                found.append((node.lineno, node.value.value))
    return sorted(found)


def outside_pointers(module: Module) -> list[str]:
    bad = []
    for line, text in comments_and_docstrings(module):
        for label, pattern in OUTSIDE_POINTERS:
            for match in pattern.finditer(text):
                at = line + text[: match.start()].count("\n")
                bad.append(f"{module.path}:{at} mentions {label!r}")
    return bad


# ------------------------------------------------------------------ the real package
MODULES = load_modules()
GRAPH = import_graph(MODULES)


def listing(title: str, items: list[str]) -> str:
    return f"{title} ({len(items)}):\n  " + "\n  ".join(items)


def test_the_package_is_read() -> None:
    """Guards the checks below against passing on an empty or misread tree."""
    assert {"reasonkv", "reasonkv.core.cache", "reasonkv.core.policy.selection", "reasonkv.cli.main"} <= set(
        MODULES
    )
    assert "reasonkv.core.policy.base" in GRAPH["reasonkv.core.policy.selection"]
    assert "reasonkv.methods.api" in GRAPH["reasonkv"]
    assert class_names(MODULES, "reasonkv.core.policy") >= {"Observation"}


def test_imports_go_to_the_same_or_a_lower_layer() -> None:
    bad = layer_violations(GRAPH)
    order = " < ".join(LAYER_NAMES[rank] for rank in sorted(LAYER_NAMES))
    assert not bad, listing(f"imports that go up a layer ({order}) or import the facade", bad)


def test_policy_math_does_not_import_transformers() -> None:
    bad = forbidden_third_party(MODULES, "reasonkv.core.policy", "transformers")
    assert not bad, listing("core.policy must stay pure torch", bad)


def test_only_the_vllm_adapter_imports_vllm() -> None:
    """vLLM is an optional install: every module outside serving/vllm must import without it."""
    outside = {n: m for n, m in MODULES.items() if not n.startswith("reasonkv.serving.vllm")}
    bad = forbidden_third_party(outside, "reasonkv", "vllm")
    assert not bad, listing("vllm imported outside reasonkv.serving.vllm", bad)


def test_the_step_and_its_serving_storage_reach_no_transformers() -> None:
    assert all(root in MODULES for root in ENGINE_NEUTRAL)
    bad = reaches_third_party(MODULES, GRAPH, ENGINE_NEUTRAL, "transformers")
    bad += reaches_third_party(MODULES, GRAPH, ENGINE_NEUTRAL, "vllm")
    assert not bad, listing("the engine-neutral step must import no engine", bad)


def test_util_imports_no_reasonkv_module() -> None:
    bad = util_violations(GRAPH)
    assert not bad, listing("util must not import reasonkv", bad)


def test_no_import_cycles() -> None:
    cycles = find_cycles(GRAPH)
    assert not cycles, listing("import cycles", [describe_cycle(c, GRAPH) for c in cycles])


def test_policy_classes_are_not_type_checked_outside_core() -> None:
    names = class_names(MODULES, "reasonkv.core.policy")
    bad = [
        hit
        for name, mod in sorted(MODULES.items())
        if not name.startswith("reasonkv.core.") and name != "reasonkv.core"
        for hit in type_checks_of(mod, names)
    ]
    assert not bad, listing("isinstance/issubclass on policy classes outside core (ask the object)", bad)


def test_no_source_file_is_longer_than_the_limit() -> None:
    bad = long_files(MODULES)
    assert not bad, listing(f"files over {MAX_LINES} lines", bad)


def test_comments_and_docstrings_point_nowhere_outside_the_repository() -> None:
    bad = [hit for _, mod in sorted(MODULES.items()) for hit in outside_pointers(mod)]
    assert not bad, listing("comments/docstrings that point outside the repository", bad)


# ------------------------------------------------------------- the checkers themselves
def test_the_import_reader_resolves_modules_and_ignores_implicit_packages() -> None:
    known = {"reasonkv", "reasonkv.core", "reasonkv.core.cache", "reasonkv.core.policy", "reasonkv.util"}
    known |= {"reasonkv.core.policy.base", "reasonkv.methods", "reasonkv.methods.api"}
    text = (
        "import torch\n"
        "from reasonkv.core import cache\n"  # a module: edge to it, not to reasonkv.core
        "from reasonkv.core.policy import EMPTY\n"  # a name: edge to the package
        "def f():\n"
        "    import reasonkv.methods.api\n"  # inside a function still counts
        "    from . import base\n"
    )
    module = module_from_text("reasonkv.core.policy.selection", text)
    edges = reasonkv_imports(module, known)
    assert edges == {
        "reasonkv.core.cache": 2,
        "reasonkv.core.policy": 3,
        "reasonkv.methods.api": 5,
        "reasonkv.core.policy.base": 6,
    }


def test_the_layer_rules_catch_upward_edges_the_facade_and_util_imports() -> None:
    graph = {
        "reasonkv": {"reasonkv.cli.main": 1},  # the facade may import anything
        "reasonkv.core.cache": {"reasonkv.core.policy.base": 3, "reasonkv.methods.api": 4},
        "reasonkv.core.policy.base": {"reasonkv.core.policy.rope": 1, "reasonkv.core.models": 2},
        "reasonkv.harness.replay": {"reasonkv": 7},
        "reasonkv.serving.paged_rows": {"reasonkv.harness.replay": 8},
        "reasonkv.util.tables": {"reasonkv.util.formatting": 1},
        "reasonkv.extra": {},
    }
    bad = layer_violations(graph)
    assert bad == [
        "reasonkv.core.cache:4 -> reasonkv.methods.api (core must not import methods)",
        "reasonkv.core.policy.base:2 -> reasonkv.core.models (core.policy must not import core)",
        "reasonkv.extra: belongs to no layer (reasonkv.util, reasonkv.core.policy, reasonkv.core, "
        "reasonkv.methods, reasonkv.serving, reasonkv.harness, reasonkv.cli)",
        "reasonkv.harness.replay:7 -> reasonkv (the facade; import the module that defines it)",
        "reasonkv.serving.paged_rows:8 -> reasonkv.harness.replay (serving must not import harness)",
    ]
    assert util_violations(graph) == ["reasonkv.util.tables:1 -> reasonkv.util.formatting"]
    policy = {
        "reasonkv.core.policy.rope": module_from_text(
            "reasonkv.core.policy.rope", "def f():\n    from transformers.utils import x\n"
        ),
        "reasonkv.core.cache": module_from_text("reasonkv.core.cache", "import transformers\n"),
    }
    assert forbidden_third_party(policy, "reasonkv.core.policy", "transformers") == [
        "reasonkv/core/policy/rope.py:2 imports transformers.utils"
    ]
    chain = {"reasonkv.core.step": {"reasonkv.core.policy.rope": 3}, "reasonkv.core.policy.rope": {}}
    assert reaches_third_party(policy, chain, ("reasonkv.core.step",), "transformers") == [
        "reasonkv.core.step reaches transformers through reasonkv.core.step -> reasonkv.core.policy.rope"
    ]
    assert (
        reaches_third_party(policy, {"reasonkv.core.step": {}}, ("reasonkv.core.step",), "transformers") == []
    )


def test_the_cycle_finder_finds_every_cycle_and_only_cycles() -> None:
    graph = {
        "a": {"b": 1},
        "b": {"c": 1},
        "c": {"a": 1, "d": 2},
        "d": {"e": 1},
        "e": {},
        "f": {"f": 3},
        "g": {"h": 1},
        "h": {"g": 1, "e": 1},
    }
    assert find_cycles(graph) == [["a", "b", "c"], ["f"], ["g", "h"]]
    assert find_cycles({"a": {"b": 1}, "b": {}, "c": {"a": 1}}) == []
    assert describe_cycle(["g", "h"], graph) == "cycle among g, h: g:1 -> h; h:1 -> g"


def test_the_type_check_finder_catches_policy_classes_by_name() -> None:
    text = (
        "from reasonkv.core.policy import schedules as s\n"
        "class Local: ...\n"
        "def f(x, y):\n"
        "    if isinstance(x, (int, s.PeriodicRatio)):\n"
        "        return issubclass(y, SnapKVScorer)\n"
        "    return isinstance(x, Local) or isinstance(x, dict)\n"
    )
    module = module_from_text("reasonkv.harness.sweep", text)
    names = {"PeriodicRatio", "SnapKVScorer", "Local"}
    assert type_checks_of(module, names) == [
        "reasonkv/harness/sweep.py:4 isinstance(..., PeriodicRatio)",
        "reasonkv/harness/sweep.py:5 issubclass(..., SnapKVScorer)",
    ]
    nested = module_from_text("reasonkv.core.policy.x", "class A:\n  class B: ...\n")
    assert class_names({nested.name: nested}, "reasonkv.core.policy") == {"A", "B"}


def test_the_length_and_pointer_checks_catch_bad_text() -> None:
    long = module_from_text("reasonkv.core.big", "x = 1\n" * (MAX_LINES + 1))
    short = module_from_text("reasonkv.core.small", "x = 1\n" * MAX_LINES)
    assert long_files({"a": long, "b": short}) == [f"reasonkv/core/big.py: {MAX_LINES + 1} lines"]
    text = (
        '"""Module doc.\n\nSee DESIGN.md §4."""\n'
        "x = 1  # from shared/seeds/000\n"
        "y = 'methods.md and DESIGN.md in a plain string are not docs'\n"
        "def f():\n"
        '    """Fixes issue 12; an issue in general is fine."""\n'
    )
    got = outside_pointers(module_from_text("reasonkv.core.doc", text))
    assert got == [
        "reasonkv/core/doc.py:3 mentions 'DESIGN.md'",
        "reasonkv/core/doc.py:3 mentions '§'",
        "reasonkv/core/doc.py:4 mentions 'shared/'",
        "reasonkv/core/doc.py:4 mentions 'seeds/'",
        "reasonkv/core/doc.py:7 mentions 'issue <n>'",
    ]
