"""No import cycles between megazero's modules.

The graph has one edge per import statement anywhere in a module: at module level, inside
functions and methods, and under ``if TYPE_CHECKING:``. An import moved into a function runs
later, and one under ``TYPE_CHECKING`` never runs, but both still say that one module needs the
other: hiding a circle that way leaves the two modules unable to stand apart, so every import
counts. ``from megazero.x import y``
is an edge to ``megazero.x.y`` when that is a module, else to ``megazero.x``. Importing
``megazero.a.b`` also runs ``megazero/a/__init__.py``, so it is an edge to ``megazero.a`` too,
except from modules inside ``megazero.a`` (that ``__init__`` is already running or done by then;
``from megazero.a import submodule`` there is an edge to the submodule only).
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megazero"


def package_modules(root: str = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """dotted module name -> file path, for every .py file under ``root/package``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def _all_imports(tree: ast.Module):
    """Every import statement of the module, wherever it stands."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _with_parents(name: str, importer: str, modules: dict[str, str]) -> list[str]:
    """``name`` and every package above it that is one of ours and does not contain
    ``importer`` (Python runs a package's ``__init__`` before any of its modules)."""
    parts = name.split(".")
    parents = [".".join(parts[:i]) for i in range(1, len(parts))]
    inside = [p for p in parents if importer == p or importer.startswith(p + ".")]
    return [m for m in [*parents, name] if m in modules and m not in inside]


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = path.endswith("__init__.py")
        edges: set[str] = set()
        for node in _all_imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edges.update(_with_parents(alias.name, module, modules))
            else:
                target = _resolve_from(module, is_package, node)
                subs = [f"{target}.{a.name}" for a in node.names]
                edges.update(s for s in subs if s in modules)
                parents = _with_parents(target, module, modules)
                if all(s in modules for s in subs):  # only submodules: not a name of target
                    parents = [p for p in parents if p != target or not module.startswith(p + ".")]
                edges.update(parents)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_checker_finds_a_cycle_and_resolves_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import x\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("x = 1\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    (pkg / "sub" / "d.py").write_text("from pkg.sub import b\n")  # a submodule, not a name
    modules = package_modules(str(tmp_path), "pkg")
    graph = import_graph(modules)
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}
    assert graph["pkg.sub.d"] == {"pkg.sub.b"}
    assert find_cycle(graph) is None
    planted = {
        "module level": "from ..c import y\n",
        "inside a function": "x = 1\ndef f():\n    from pkg import a\n",
        "under TYPE_CHECKING": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from pkg.c import y\n"),
    }
    for where, text in planted.items():
        (pkg / "sub" / "b.py").write_text(text)
        cycle = find_cycle(import_graph(package_modules(str(tmp_path), "pkg")))
        assert cycle is not None and cycle[0] == cycle[-1], where
        assert {"pkg.a", "pkg.sub.b"} <= set(cycle), where


def test_megazero_has_no_import_cycle():
    modules = package_modules()
    assert "megazero.config" in modules and "megazero.distributed.topology" in modules
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
