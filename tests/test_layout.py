"""The package's modules import each other without a circle.

A circle (``a`` imports ``b``, which imports ``a``) means neither module can be read, tested or
changed alone, and it is only a matter of import order before one of them sees the other
half-initialised. The graph here counts every ``import`` and ``from ... import`` in the package:
at module level, inside functions, and under ``if TYPE_CHECKING:`` (a type-only import still ties
the two modules' designs together). ``from package import name`` counts as an import of the
submodule ``package.name`` when there is one, else of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "lightning_zinf"


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the package under ``root``: dotted name -> (file, is a package's ``__init__``)."""
    modules = {}
    for path in (root / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (relative imports resolved; itself left out)."""
    modules = _modules(root)

    def known(name: str) -> Optional[str]:
        while name and name not in modules:  # an imported object: its module
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        targets: set[Optional[str]] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names if alias.name.split(".")[0] == PACKAGE)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in modules else known(source))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One circle of ``graph`` as the path ``[a, b, ..., a]``, or ``None`` (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> Optional[list[str]]:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done:
                found = visit(target)
                if found:
                    return found
        on_path.discard(node)
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


def test_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    # A toy package with one circle through each kind of import the graph must count.
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import B\n")
    (package / "sub" / "b.py").write_text("def f():\n    from lightning_zinf import c\n")
    (package / "c.py").write_text("import lightning_zinf.a\n")
    assert find_cycle(import_graph(tmp_path)) == [f"{PACKAGE}.a", f"{PACKAGE}.sub.b", f"{PACKAGE}.c", f"{PACKAGE}.a"]
    (package / "c.py").write_text("")
    assert find_cycle(import_graph(tmp_path)) is None


def test_no_import_circle() -> None:
    graph = import_graph(ROOT)
    assert f"{PACKAGE}.engine.engine" in graph[f"{PACKAGE}.engine"], "the graph lost the package's own imports"
    cycle = find_cycle(graph)
    assert cycle is None, (
        f"import circle: {' -> '.join(cycle)}. Move what both need (a type, a protocol) to a module "
        "below both, or pass it in (a callable, a constructor argument)."
    )
