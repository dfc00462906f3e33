"""The shape of the package: no import cycles, and readers that do not import the writer.

Imports are read from the source (module level and inside functions alike), so a
cycle hidden in a function-level import is found too.  ``from . import
__version__`` is an edge to the package's ``__init__``, which defines the version
before importing anything; edges into ``__init__`` are therefore left out.
"""

from __future__ import annotations

import ast
import os

import pytest

import ckptfmt

ROOT = os.path.dirname(os.path.abspath(ckptfmt.__file__))

#: the save path and the modules that wait for saves: no cycle may pass through them
SAVE_PATH = [
    "ckptfmt.bytesview",
    "ckptfmt.commit",
    "ckptfmt.inflight",
    "ckptfmt.staging",
    "ckptfmt.chunkio",
    "ckptfmt.background",
    "ckptfmt.writer",
    "ckptfmt.api",
    "ckptfmt.verify",
    "ckptfmt.inplace",
]


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))[:-3]
                name = rel.replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _graph(module_level_only: bool) -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        nodes = tree.body if module_level_only else list(ast.walk(tree))
        deps: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for alias in node.names:
                    full = f"{mod}.{alias.name}"
                    deps.add(full if full in mods else mod)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in mods and d != name and d != "ckptfmt"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_module_level_imports_have_no_cycle():
    assert _cycles(_graph(module_level_only=True)) == []


def test_no_cycle_passes_through_the_save_path():
    graph = _graph(module_level_only=False)
    assert set(SAVE_PATH) <= set(graph)
    for comp in _cycles(graph):
        assert not set(comp) & set(SAVE_PATH), comp


@pytest.mark.parametrize("reader", ["ckptfmt.api", "ckptfmt.verify", "ckptfmt.inplace", "ckptfmt.inflight"])
def test_readers_do_not_import_the_writer(reader):
    reached = _reach(_graph(module_level_only=False), reader)
    assert not reached & {"ckptfmt.writer", "ckptfmt.background", "ckptfmt.chunkio", "ckptfmt.commit"}


def test_the_commit_protocol_and_the_registry_import_nothing_of_ckptfmt():
    """...but the commit protocol works inside a directory through the one module that owns
    filesystem operations there, which imports nothing but the errors."""
    graph = _graph(module_level_only=False)
    assert graph["ckptfmt.commit"] == {"ckptfmt.ckptdir", "ckptfmt.errors"}
    assert graph["ckptfmt.ckptdir"] == {"ckptfmt.errors", "ckptfmt.fileio"}
    assert graph["ckptfmt.inflight"] == set()
    assert graph["ckptfmt.bytesview"] == set()


def test_the_graph_reader_sees_a_cycle(tmp_path):
    """The check itself can fail: a cycle made of two modules is found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
