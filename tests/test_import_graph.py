"""The import graph of llmctl and llmctl_kernels has no cycles, and the kernels never import llmctl.

The graph is read statically with `ast`, so a module that fails to import (a missing optional
dependency, an unbuilt extension) is still checked. Every import statement counts, at module level
and inside functions: a function-local import that only hides a cycle is still a cycle, it merely
runs later. Imports under `if TYPE_CHECKING:` are left out: they never run, and annotations are
how a lower layer may name a type of a higher one without depending on it at run time.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# The import name of each package and the folder that holds it (pyproject.toml's package-dir).
PACKAGE_DIRS: dict[str, Path] = {
    "llmctl": REPO_ROOT / "llmctl",
    "llmctl_kernels": REPO_ROOT / "kernels",
}


def _module_name(package: str, package_dir: Path, path: Path) -> str:
    parts = list(path.relative_to(package_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def discover_modules() -> dict[str, Path]:
    """Every Python module of the two packages, by dotted name."""
    modules: dict[str, Path] = {}
    for package, package_dir in PACKAGE_DIRS.items():
        for path in sorted(package_dir.rglob("*.py")):
            modules[_module_name(package, package_dir, path)] = path
    return modules


def _is_type_checking_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_time_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all of them but those under `if TYPE_CHECKING:`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking_guard(node.test):
            stack.extend(node.orelse)  # the `else:` branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return module in modules and modules[module].name == "__init__.py"


def _resolve_base(node: ast.ImportFrom, importer: str, modules: dict[str, Path]) -> str:
    """The absolute module a `from X import ...` names, relative levels resolved against the importer."""
    if node.level == 0:
        return node.module or ""
    # A package's own __init__ is its anchor for level 1; a plain module's anchor is its parent.
    anchor = importer.split(".")
    if not _is_package(importer, modules):
        anchor = anchor[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _nearest_known(name: str, modules: dict[str, Path]) -> str | None:
    """`a.b.c` -> the longest prefix that is one of our modules (importing a.b.c runs a.b and a.b.c)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imported_modules(importer: str, modules: dict[str, Path]) -> set[str]:
    """The modules of the two packages that `importer` imports, at any level of its code."""
    tree = ast.parse(modules[importer].read_text(encoding="utf-8"), filename=str(modules[importer]))
    targets: set[str] = set()
    for node in _run_time_imports(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _resolve_base(node, importer, modules)
            # `from pkg import name` imports pkg.name when that is a module, else pkg itself.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            known = _nearest_known(name, modules)
            if known is not None and known != importer:
                targets.add(known)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = discover_modules()
    return {module: imported_modules(module, modules) for module in modules}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module, as a closed path.

    Tarjan's algorithm finds the components; a breadth-first search inside each one gives the
    shortest cycle through its first module, which is the path a reader needs to break it.
    """
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    def strongconnect(root: str) -> None:
        nonlocal counter
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = lowlink[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = lowlink[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    lowlink[node] = min(lowlink[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            strongconnect(module)

    cycles = []
    for component in sorted(components):
        members = set(component)
        start = component[0]
        previous: dict[str, str] = {}
        frontier = [start]
        found: str | None = None
        while frontier and found is None:
            next_frontier = []
            for node in frontier:
                for child in sorted(graph[node] & members):
                    if child == start:
                        found = node
                        break
                    if child not in previous:
                        previous[child] = node
                        next_frontier.append(child)
                if found is not None:
                    break
            frontier = next_frontier
        assert found is not None, "a strongly connected component always holds a cycle"
        path = [found]
        while path[-1] != start:
            path.append(previous[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def test_the_graph_finds_both_packages_and_their_imports() -> None:
    """Guards the checks below against passing on an empty or unresolved graph."""
    graph = import_graph()
    assert "llmctl.engine.llm_engine" in graph
    assert any(module.startswith("llmctl_kernels.") for module in graph)
    assert "llmctl.engine.scheduler" in graph["llmctl.engine.llm_engine"]


def test_find_cycles_reports_each_knot_as_a_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_and_type_checking_imports_are_left_out(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import leaf\n")
    (package / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import top\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.hidden import Thing\n"
        "def later():\n"
        "    from pkg.sub import helper_name\n"
    )
    (package / "top.py").write_text("")
    (package / "hidden.py").write_text("")
    modules = {_module_name("pkg", package, path): path for path in package.rglob("*.py")}
    assert imported_modules("pkg.sub", modules) == {"pkg.sub.leaf"}
    # `from .. import top` imports the module pkg.top; `from pkg.sub import helper_name` (not a
    # module) the package pkg.sub itself; the TYPE_CHECKING import of pkg.hidden is left out.
    assert imported_modules("pkg.sub.leaf", modules) == {"pkg.top", "pkg.sub"}


def test_no_import_cycles() -> None:
    llmctl_graph = {
        module: {target for target in targets if target.split(".")[0] == "llmctl"}
        for module, targets in import_graph().items()
        if module.split(".")[0] == "llmctl"
    }
    cycles = find_cycles(llmctl_graph)
    if cycles:
        pytest.fail("import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles))


def test_kernels_do_not_import_llmctl() -> None:
    offenders = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph().items())
        if module.startswith("llmctl_kernels")
        for target in sorted(targets)
        if target.split(".")[0] == "llmctl"
    ]
    if offenders:
        pytest.fail("kernels/ imports llmctl:\n" + "\n".join(offenders))
