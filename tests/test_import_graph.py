"""No import cycle among qkv's modules, lazy imports included (GUIDE, section 1: arrows point one way).

Every module of ``src/qkv`` is read with :mod:`ast`, never imported. Each ``import`` and ``from ... import`` at
any depth counts, those inside functions (lazy imports) too: a cycle that only closes at run time is still one
concept leaning on another that leans back. Relative imports are resolved against the module's package;
``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``.

A package's ``__init__``: importing ``qkv.a.b`` runs ``qkv/a/__init__.py`` first, so an edge to ``qkv.a.b`` is
also one to each package above it (``qkv.a``). Without that, a module below ``interop`` could import
``qkv.interop.families`` alone and close a cycle through ``interop/__init__.py``'s own imports, unseen. Two
exceptions, both what a package is: a package's ``__init__`` importing its own submodules (``qkv.interop`` ->
``qkv.interop.pretrained``) is an edge, but a submodule is not one back to the packages it sits in (it runs inside
them, it does not import them), unless it imports them by name; and ``qkv`` itself is no node: its
``__init__`` gathers the public names of every layer and runs before any module of qkv does, so counting it
would put every module that takes a name from it (``from .. import GPT`` in ``qkv.cli.tour``) in a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    """Every module of qkv by dotted name; a package by its own name (``qkv.interop``: its ``__init__.py``)."""
    found = {}
    for path in sorted((SRC / "qkv").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The qkv modules ``name`` (at ``path``) imports, lazily or not, with the packages each import runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    edges = set()
    for target in targets:
        while target and target not in modules:  # qkv.x.y.Name imported as a module path: its module
            target = target.rpartition(".")[0]
        parts = target.split(".")
        for i in range(2, len(parts) + 1):  # qkv.a.b runs qkv/a/__init__.py first
            edges.add(".".join(parts[:i]))
    return {t for t in edges if t != name and not name.startswith(f"{t}.") and t.startswith("qkv.")}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None (iterative depth-first search)."""
    state = dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done
    for root in sorted(graph):
        if state[root]:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif state.get(nxt) == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_walk_sees_lazy_relative_and_package_imports():
    graph = import_graph()
    assert "qkv.checkpoint" in graph["qkv.training"]  # a top-level relative import
    assert "qkv.interop" in graph["qkv.cli.export"] and "qkv.interop.gguf_export" in graph["qkv.cli.export"]  # lazy
    assert "qkv.nn" in graph["qkv.models.gpt"]  # the package whose __init__ runs first


def test_a_cycle_is_found_and_named():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_qkv_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
