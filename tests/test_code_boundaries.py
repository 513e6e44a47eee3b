"""Where code may import from: test modules share helpers through ``megazero.testing`` (which
spawned ranks and benchmarks import too), never through each other; the library that users run
(``megazero/`` outside ``megazero/testing/``, ``pretrain_gpt.py``, ``tools/``) never imports
test support."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imports(path: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file, nested ones included."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)]
            if node.module == "megazero":  # from megazero import testing
                out += [(node.lineno, f"megazero.{a.name}") for a in node.names]
    return out


def _python_files(*parts: str) -> list[str]:
    root = os.path.join(REPO, *parts)
    if root.endswith(".py"):
        return [root]
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in sorted(files)
            if f.endswith(".py")]


def test_test_modules_do_not_import_each_other():
    local = {f[:-3] for f in os.listdir(os.path.join(REPO, "tests")) if f.endswith(".py")}
    bad = [f"{os.path.relpath(path, REPO)}:{line} imports {mod}"
           for path in _python_files("tests") for line, mod in _imports(path)
           if mod.split(".")[0] in local | {"tests"}]
    assert bad == [], "shared test helpers belong in megazero/testing/:\n" + "\n".join(bad)


def test_library_does_not_import_test_support():
    testing = os.path.join(REPO, "megazero", "testing") + os.sep
    files = [p for p in _python_files("megazero") if not p.startswith(testing)]
    files += _python_files("pretrain_gpt.py") + _python_files("tools")
    assert len(files) > 50
    bad = [f"{os.path.relpath(path, REPO)}:{line} imports {mod}"
           for path in files for line, mod in _imports(path)
           if mod == "megazero.testing" or mod.startswith("megazero.testing.")]
    assert bad == [], "\n".join(bad)
