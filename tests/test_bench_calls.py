"""Benchmarks and scripts run by hand, not in CI: their calls of the planning and profiling
entries must name options that exist, or they break silently when the options change."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from autopart.profile import ProfileOptions
from autopart.solve import PlanOptions

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py"),
                *ROOT.glob("examples/*.py")])
ACCEPTED = {
    "make_plan": {f.name for f in dataclasses.fields(PlanOptions)} | {"progress"},
    "plan_mesh": {f.name for f in dataclasses.fields(PlanOptions)} | {"progress", "shard_of"},
    "profile_model": {f.name for f in dataclasses.fields(ProfileOptions)} | {"progress"},
}


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ACCEPTED:
                yield name, node


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_calls_name_existing_options(path):
    for name, call in _calls(path):
        unknown = [k.arg for k in call.keywords if k.arg is not None
                   and k.arg not in ACCEPTED[name]]
        assert not unknown, f"{path.name}:{call.lineno} {name}() has no option {unknown}"
