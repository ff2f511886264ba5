"""Measure the house: public names in ``__all__`` and import circles inside each package.

Static: every ``.py`` under ``autopart/`` and ``cli/`` is parsed with ``ast``, nothing is
imported. An import circle is a cycle among the modules of one package (a folder), following
the imports each module makes of its siblings; imports at module level and those inside a
function (deferred, which Python tolerates in a circle) are counted apart.

    python scripts/house_check.py            # counts, then each circle
    python scripts/house_check.py --json     # the same as one JSON object
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autopart", "cli")

__all__ = ["House", "find_circles", "measure"]


@dataclass
class House:
    """What ``measure`` finds.

    Attributes:
        all_names: ``__all__`` entries per module (dotted name -> names).
        imports: per module, the modules it imports at module level.
        deferred: per module, the modules it imports inside a function or class body.
    """

    all_names: dict[str, list[str]] = field(default_factory=dict)
    imports: dict[str, set[str]] = field(default_factory=dict)
    deferred: dict[str, set[str]] = field(default_factory=dict)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The dotted modules an ``from X import a, b`` may name (X itself and X.a, X.b)."""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def _all_of(tree: ast.Module) -> list[str]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
                value = ast.literal_eval(node.value)
                return list(value)
    return []


def measure(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> House:
    """Parse every module under ``packages`` and collect its ``__all__`` and imports.

    Args:
        root: the repository root.
        packages: top-level folders to read.

    Returns:
        The ``House`` with every module's public names and imports.
    """
    house = House()
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    modules = {_module_name(p, root) for p in files}
    for path in files:
        name = _module_name(path, root)
        tree = ast.parse(path.read_text(), str(path))
        house.all_names[name] = _all_of(tree)
        top: set[str] = set()
        deferred: set[str] = set()
        is_package = path.name == "__init__.py"
        top_level = {id(node) for node in tree.body}
        for parent in ast.walk(tree):
            for node in ast.iter_child_nodes(parent):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    targets = _resolve(name, is_package, node)
                else:
                    continue
                nested = id(node) not in top_level and not _under_type_checking(tree, node)
                bucket = deferred if nested else top
                bucket.update(t for t in targets if t in modules and t != name)
        house.imports[name] = top
        house.deferred[name] = deferred - top
    return house


def _under_type_checking(tree: ast.Module, node: ast.AST) -> bool:
    """True when ``node`` is at module level inside ``if TYPE_CHECKING:`` (counted as top)."""
    for stmt in tree.body:
        if isinstance(stmt, ast.If | ast.Try):
            for child in ast.walk(stmt):
                if child is node:
                    return True
    return False


def _package_of(module: str, packages: set[str]) -> str:
    return module if module in packages else module.rpartition(".")[0]


def find_circles(edges: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    """Import cycles among the modules of each one package (strongly connected parts).

    Args:
        edges: module -> modules it imports.
        packages: dotted names of the packages (folders with ``__init__.py``).

    Returns:
        Each circle as a sorted list of its modules (two or more), sorted.
    """
    graph = {
        m: {t for t in targets if _package_of(t, packages) == _package_of(m, packages)
            and t != _package_of(m, packages) and m != _package_of(m, packages)}
        for m, targets in edges.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def report(house: House) -> dict:
    """Counts and circles of ``house`` as a JSON-able dict.

    Args:
        house: what ``measure`` returned.

    Returns:
        ``public_names``, ``modules_with_all``, ``circles_module_level`` and
        ``circles_any_level`` (module-level and deferred imports together).
    """
    packages = {m for m in house.all_names
                if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    both = {m: house.imports[m] | house.deferred[m] for m in house.imports}
    return {
        "public_names": sum(len(v) for v in house.all_names.values()),
        "modules_with_all": sum(1 for v in house.all_names.values() if v),
        "circles_module_level": find_circles(house.imports, packages),
        "circles_any_level": find_circles(both, packages),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the house's counts and circles.

    Args:
        argv: command-line arguments (``--json``).

    Returns:
        0 when no package has an import circle, 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = report(measure())
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"public names (__all__ entries): {result['public_names']} "
              f"in {result['modules_with_all']} modules")
        for key in ("circles_module_level", "circles_any_level"):
            print(f"{key}: {len(result[key])}")
            for circle in result[key]:
                print("  " + " <-> ".join(circle))
    return 1 if result["circles_any_level"] else 0


if __name__ == "__main__":
    sys.exit(main())
