"""The house's shape: no import circle inside any package of autopart/ or cli/.

Static, by ``scripts/house_check.py`` (ast, nothing imported): imports at module level and
those deferred into a function both count, since a deferred import that closes a circle only
hides it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _house_check():
    spec = importlib.util.spec_from_file_location("house_check", ROOT / "scripts/house_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["house_check"] = module
    spec.loader.exec_module(module)
    return module


def test_no_import_circle_inside_a_package():
    check = _house_check()
    result = check.report(check.measure())
    assert result["circles_module_level"] == []
    assert result["circles_any_level"] == []


def test_the_checker_finds_a_circle_and_a_deferred_one(tmp_path):
    check = _house_check()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n__all__ = ['y']\ny = 1\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\nx = 1\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("from .c import z\nz = 1\n")
    house = check.measure(tmp_path, ("pkg",))
    assert house.all_names["pkg.a"] == ["y"]
    assert house.imports["pkg.a"] == {"pkg.b"}
    assert house.deferred["pkg.b"] == {"pkg", "pkg.a"}
    packages = {"pkg"}
    assert check.find_circles(house.imports, packages) == [["pkg.c", "pkg.d"]]
    both = {m: house.imports[m] | house.deferred[m] for m in house.imports}
    assert check.find_circles(both, packages) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_every_package_is_shipped_by_pyproject():
    """``pyproject.toml`` lists the packages a non-editable install ships: a new package
    missing there imports in the checkout and fails for every user (and in CI)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(root).parts)
             for p in (root / "autopart").rglob("__init__.py")}
    assert found - listed == set(), f"add {sorted(found - listed)} to pyproject.toml packages"
