"""The package's import graph: no cycles between modules, no private name used across packages.

Every `import` and `from ... import` in treeflow/**.py is read from the source (AST, so the
imports inside functions count too: a lazy import hides a cycle from the interpreter, not from
a reader). An edge goes to the module named (`from treeflow.a import b` is treeflow.a.b when
that is a module, else treeflow.a). A private name belongs to what holds it: a module `_x` to its
package (treeflow._errors anywhere in treeflow, treeflow.stages.flat only from
treeflow.stages.*), a symbol `_y` to its module (`from treeflow.cli import _positive` is
refused anywhere else).

Floors (FLOORS, as docs/architecture.md draws them): a package imports only packages on its own
floor or below -- `stages` never `ops`, `ops` never `train`, `models` nothing above `stages`'s
floor, nothing but `cli` imports `cli` -- function-level imports included.

KNOWN_CYCLES, KNOWN_PRIVATE and KNOWN_UPWARD are what the tree held when each check was written:
the test fails on anything new, and on an entry that is gone (remove it), so the lists only
shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "treeflow"

# strongly connected components of the import graph (each a cycle or several), sorted
KNOWN_CYCLES: set[tuple[str, ...]] = set()
# (importer, private name imported from outside what holds it)
KNOWN_PRIVATE: set[tuple[str, str]] = set()
# each package's floor: it may import its own floor and those below. "treeflow" is the
# package's top-level modules (tree.py, atomic.py, tensorfile.py, ...).
FLOORS = {"treeflow": 0, "schemas": 0, "parallel": 0, "models": 1, "io": 1, "tq": 1,
          "stages": 2, "ops": 3, "train": 4, "pipeline": 5, "engines": 6, "programs": 7,
          "tools": 7, "cli": 8}
# (importer, imported) modules across floors upward. Pipeline.run takes an engine by name (the
# registry lives in engines/), so the declaration still looks one floor up.
KNOWN_UPWARD: set[tuple[str, str]] = {
    ("treeflow.pipeline.pipeline", "treeflow.engines"),
}


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, mods: dict[str, Path]) -> bool:
    return name in mods and mods[name].name == "__init__.py"


def imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(module imported, symbol or None, line) for every import of `name` into the package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    base = name if _is_package(name, mods) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package up
                up = base.split(".")[: len(base.split(".")) - node.level + 1]
                origin = ".".join(up + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for a in node.names:
                if f"{origin}.{a.name}" in mods:  # a submodule
                    out.append((f"{origin}.{a.name}", None, node.lineno))
                else:
                    out.append((origin, None if a.name == "*" else a.name, node.lineno))
    return [(m, s, line) for m, s, line in out if m == PACKAGE or m.startswith(PACKAGE + ".")]


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges = {name: set() for name in mods}
    for name, path in mods.items():
        for module, _, _ in imports(name, path, mods):
            if module in mods and module != name:
                edges[name].add(module)
    return edges


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], set(), [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.add(tuple(sorted(component)))
    return out


def owner(dotted: str, mods: dict[str, Path]) -> str | None:
    """Where a private name may be imported (None if no part of `dotted` is private): inside
    what holds it. A module `_x` is its package's; a symbol `_y` of a module is that module's
    alone, one of a package's `__init__` the package's; the innermost private part decides."""
    parts = dotted.split(".")
    private = [i for i, part in enumerate(parts) if part.startswith("_") and
               not part.startswith("__")]
    return ".".join(parts[:private[-1]]) if private else None


def private_imports(mods: dict[str, Path], root: Path = ROOT) -> dict[tuple[str, str], str]:
    """{(importer, private name): 'file:line'} for each private name imported from outside the
    package that holds it."""
    out = {}
    for name, path in mods.items():
        for module, symbol, line in imports(name, path, mods):
            dotted = module if symbol is None else f"{module}.{symbol}"
            pkg = owner(dotted, mods)
            if pkg is not None and name != pkg and not name.startswith(pkg + "."):
                out[(name, dotted)] = f"{path.relative_to(root)}:{line}"
    return out


def test_no_new_import_cycle():
    found = cycles(graph(modules()))
    new = found - KNOWN_CYCLES
    assert not new, "import cycle(s): " + "; ".join(" <-> ".join(c) for c in sorted(new))
    gone = KNOWN_CYCLES - found
    assert not gone, f"cycle(s) fixed, remove them from KNOWN_CYCLES: {sorted(gone)}"


def test_no_private_name_across_packages():
    found = private_imports(modules())
    new = {k: v for k, v in found.items() if k not in KNOWN_PRIVATE}
    assert not new, "private names imported across packages (make them public API of their " \
        "package, or move the code): " + "; ".join(f"{where} {a} imports {b}"
                                                   for (a, b), where in sorted(new.items()))
    gone = KNOWN_PRIVATE - set(found)
    assert not gone, f"fixed, remove them from KNOWN_PRIVATE: {sorted(gone)}"


def floor_of(module: str, mods: dict[str, Path]) -> str:
    """The FLOORS key of a module: its subpackage, or "treeflow" for a top-level module."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and not _is_package(module, mods)):
        return PACKAGE
    return parts[1]


def upward(mods: dict[str, Path], floors: dict[str, int] = FLOORS) -> set[tuple[str, str]]:
    """(importer, imported) for every import of a package on a higher floor."""
    out = set()
    for a, bs in graph(mods).items():
        for b in bs:
            fa, fb = floor_of(a, mods), floor_of(b, mods)
            if fa not in floors or fb not in floors:
                raise AssertionError(f"{a} -> {b}: give {fa if fa not in floors else fb} a "
                                     "floor in FLOORS (and in docs/architecture.md)")
            if floors[fb] > floors[fa]:
                out.add((a, b))
    return out


def test_no_package_imports_a_higher_floor():
    found = upward(modules())
    new = found - KNOWN_UPWARD
    assert not new, "imports of a higher floor (move the code, or pass what it needs in): " + \
        "; ".join(f"{a} -> {b}" for a, b in sorted(new))
    gone = KNOWN_UPWARD - found
    assert not gone, f"fixed, remove them from KNOWN_UPWARD: {sorted(gone)}"


def test_the_walk_sees_what_it_must(tmp_path):
    """The checks themselves: a planted cycle (through a function-level import) and a planted
    private import are found; an import inside the owning package is not."""
    pkg = tmp_path / PACKAGE
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "m.py").write_text("from treeflow.b import n\n")
    (pkg / "b" / "n.py").write_text("def f():\n    from treeflow.a.m import g\n")
    (pkg / "b" / "_x.py").write_text("")
    (pkg / "b" / "ok.py").write_text("from ._x import y\nfrom treeflow.b.n import _z\n")
    (pkg / "a" / "bad.py").write_text("from treeflow.b._x import y\nfrom ..b.n import _z\n"
                                      "import treeflow.b._x\n")
    (pkg / "a" / "late.py").write_text("def f():\n    import treeflow.b.n\n")
    mods = modules(tmp_path)
    assert cycles(graph(mods)) == {("treeflow.a.m", "treeflow.b.n")}
    # a (floor 0) importing b (floor 1), even inside a function, is an upward import
    assert upward(mods, {"a": 0, "b": 1}) == {("treeflow.a.m", "treeflow.b.n"),
                                              ("treeflow.a.late", "treeflow.b.n"),
                                              ("treeflow.a.bad", "treeflow.b._x"),
                                              ("treeflow.a.bad", "treeflow.b.n")}
    bad = set(private_imports(mods, tmp_path))
    assert bad == {("treeflow.a.bad", "treeflow.b._x"), ("treeflow.a.bad", "treeflow.b._x.y"),
                   ("treeflow.a.bad", "treeflow.b.n._z"), ("treeflow.b.ok", "treeflow.b.n._z")}
