"""The public API: every exported name resolves, and ``import autopart`` stays light."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autopart

PACKAGES = ("autopart", "autopart.intake", "autopart.profile", "autopart.simulate",
            "autopart.solve", "autopart.runtime", "autopart.verify")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


def test_top_level_is_one_name_per_step():
    """profile, plan, export, simulate, train (4), verify (2), calibrate, the options of
    profile, plan and train; data; errors."""
    assert sorted(autopart.__all__) == sorted([
        "profile_model", "make_plan", "export_plan", "simulate_plan", "auto_pipeline",
        "CausalLMLoss", "save_checkpoint", "load_checkpoint", "verify_plan", "RunSettings",
        "calibrate_profile", "ProfileOptions", "PlanOptions", "RuntimeOptions", "Plan",
        "Profile", "AutopartError", "InfeasibleError", "__version__"])


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'evaluate_split'"):
        _ = autopart.evaluate_split


def test_import_autopart_loads_no_torch():
    code = "import sys, autopart; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


def test_readme_shows_exactly_the_public_api():
    """The README's Development block imports, and names every public name once."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    development = readme.split("\n## Development\n", 1)[1]
    block = re.search(r"```python\n(.*?)```", development, re.S).group(1)
    namespace: dict = {}
    exec(block, namespace)
    shown = sorted(name for name in namespace if name != "__builtins__")
    assert shown == sorted(set(autopart.__all__) - {"__version__"})
