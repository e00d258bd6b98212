"""The layout of the source (issue 23), read from the files with `ast`, nothing imported: modules of a
readable size, no underscore name imported from another module, and no import circle among a
package's modules."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the import name it installs under (pyproject.toml's package-dir), in layer order, lowest first
PACKAGES = {"hooks": "probe.hooks", "probe": "probe", "analyses": "probe.analyses", "scripts": "probe.cli"}
MAX_LINES = 400
# modules allowed past MAX_LINES: generated tables and the like, each with the reason
LONG_ALLOWED: dict[str, str] = {}
# import circles known and not yet broken, each with the reason; an entry goes once its circle does (a test says so)
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


@functools.cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the source packages (a package is its __init__)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return found


def layer(module: str) -> str:
    """The folder a dotted module name comes from: the longest installed package name it starts with."""
    return max((folder for folder, package in PACKAGES.items() if module == package or module.startswith(package + ".")),
               key=lambda folder: len(PACKAGES[folder]))


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import of a source module in `path`,
    at any depth (a function's deferred import counts: it still ties the two modules together).
    `from pkg import sub` of a submodule `sub` is an import of `pkg.sub`."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:  # `if TYPE_CHECKING:` imports never run
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "probe"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "probe":
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{node.module}.{n}" in known]
            found += [(f"{node.module}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                found.append((node.module, rest, node.lineno))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def source_imports() -> dict[str, list[tuple[str, list[str], int]]]:
    """`imports` of every source module, parsed once for all the tests."""
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {target for target, _, _ in found if target in known and target != name}
            for name, found in source_imports().items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_checks_find_what_they_look_for(tmp_path):
    """The oracle for the checks themselves: a hand-made circle, a private import and a deferred import."""
    (tmp_path / "a.py").write_text("from probe.analyses.b import _helper\n")
    (tmp_path / "b.py").write_text("if TYPE_CHECKING:\n    import probe.analyses.d\ndef f():\n    import probe.analyses.c\n")
    (tmp_path / "c.py").write_text("from probe.analyses import a\n")
    known = {"probe.analyses": tmp_path / "none.py", **{f"probe.analyses.{m}": tmp_path / f"{m}.py" for m in "abc"}}
    assert imports(known["probe.analyses.a"], known) == [("probe.analyses.b", ["_helper"], 1)]
    assert [target for target, _, _ in imports(known["probe.analyses.b"], known)] == ["probe.analyses.c"]  # TYPE_CHECKING skipped
    edges = {name: set() for name in known}
    for name in "abc":
        edges[f"probe.analyses.{name}"] = {t for t, _, _ in imports(known[f"probe.analyses.{name}"], known)}
    assert cycles(edges) == [["probe.analyses.a", "probe.analyses.b", "probe.analyses.c"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_no_module_is_past_the_readable_size():
    too_long = {name: n for name, path in modules().items()
                if (n := len(path.read_text().splitlines())) > MAX_LINES and name not in LONG_ALLOWED}
    assert not too_long, f"modules over {MAX_LINES} lines (split them by concept): {too_long}"


def test_no_underscore_name_is_imported_from_another_module():
    known = modules()
    private = [f"{known[module].relative_to(ROOT)}:{line}: {name} from {target}"
               for module, found in source_imports().items() for target, names, line in found
               for name in names if name.startswith("_") and not name.startswith("__")]
    assert not private, "private names imported across modules (make them public or move them):\n" + "\n".join(private)


@pytest.mark.parametrize("package", ["hooks", "probe", "analyses"])
def test_no_import_circle_within_a_package(package):
    edges = graph()
    inside = {name: {t for t in targets if layer(t) == package}
              for name, targets in edges.items() if layer(name) == package}
    found = {frozenset(circle) for circle in cycles(inside)}
    known = {circle for circle in KNOWN_CIRCLES if layer(next(iter(circle))) == package}
    assert found <= known, f"import circles in {package}/: {[sorted(c) for c in found - known]}"
    assert known <= found, f"circles in KNOWN_CIRCLES that are gone (remove them): {[sorted(c) for c in known - found]}"


def test_the_layers_point_one_way():
    """hooks <- probe <- analyses <- scripts: no module imports a package above its own."""
    order = {folder: i for i, folder in enumerate(PACKAGES)}
    upward = [f"{name} imports {target}" for name, targets in graph().items() for target in targets
              if order[layer(target)] > order[layer(name)]]
    assert not upward, "\n".join(upward)
