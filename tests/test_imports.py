"""The import graph of the ``fedsparse.*`` modules, read statically: no cycle, and no library
module reaching into the command line.

Every ``import`` counts, at module level or inside a function (a deferred import is still a
dependency: it runs the first time the function does), except those under
``if TYPE_CHECKING:``, which never run. An edge goes to the module a statement names:
``from fedsparse.lab import cli`` reaches ``fedsparse.lab.cli``, ``from
fedsparse.lab.experiments.sweep
import stop_pool`` reaches ``fedsparse.lab.experiments.sweep``.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> import name (``pyproject.toml``'s ``package-dir``).
PACKAGE_DIRS = {
    "common": "fedsparse.common",
    "client": "fedsparse.client",
    "server": "fedsparse.server",
    "lab": "fedsparse.lab",
    "protos/fedsparse/v1": "fedsparse.v1",
}
CLI = "fedsparse.lab.cli"


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The ``fedsparse`` modules ``module`` (in ``path``) imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = (
                    module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                )
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in names if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, set(modules)) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its start) per strongly connected component of 2+."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph is a few hundred modules
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in order:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], order[succ])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(_path_back(graph, set(component), node))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def _path_back(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest path ``start -> ... -> start`` inside ``component`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start] * 2
                if succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in no cycle of {sorted(component)}")


def test_the_import_graph_has_no_cycle() -> None:
    assert [" -> ".join(cycle) for cycle in _cycles(_graph())] == []


def test_no_library_module_imports_the_command_line() -> None:
    """The CLI calls the library, never the other way: the reproduction's centralized runs
    (``lab/research/reproduction/central_runs.py``) once borrowed the CLI's ``run_train``
    (now ``lab/experiments/train.py``)."""
    bad = [
        f"{module} imports {name}"
        for module, names in sorted(_graph().items())
        if not (module == CLI or module.startswith(CLI + "."))
        for name in sorted(names)
        if name == CLI or name.startswith(CLI + ".")
    ]
    assert bad == []


def test_the_graph_sees_every_kind_of_import() -> None:
    """The reader's oracle: deferred, relative and ``from package import module`` imports
    are edges; ``TYPE_CHECKING`` imports are not."""
    graph = _graph()
    runs = graph["fedsparse.lab.research.reproduction.central_runs"]
    assert "fedsparse.lab.experiments.train" in runs  # inside a function
    assert "fedsparse.lab.cli.app" in graph[CLI]
    assert "fedsparse.lab.experiments.sweep" in runs


@pytest.mark.parametrize(
    ("graph", "cycles"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c", "a"]]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
        ({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}, [["a", "b", "a"]]),
    ],
)
def test_cycles_are_found_and_named(graph: dict[str, set[str]], cycles: list[list[str]]) -> None:
    assert _cycles(graph) == cycles


def test_relative_and_type_checking_imports(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from .. import other\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.sub import hidden\n"
        "def later():\n"
        "    import pkg.late\n"
    )
    known = {"pkg.sub.sibling", "pkg.other", "pkg.sub.hidden", "pkg.late", "pkg.sub"}
    assert _imported("pkg.sub.mod", source, known) == {"pkg.sub.sibling", "pkg.other", "pkg.late"}


def test_every_package_folder_is_installed() -> None:
    """``[tool.setuptools] packages`` is an explicit list: a package folder missing from it is
    left out of the wheel, so ``import`` works from the checkout and fails once installed."""
    packages = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert sorted(folders - packages) == []
