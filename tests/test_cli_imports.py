"""``autopart plan`` on an existing profile stays light: no torch, no transformers.

Checked in a fresh interpreter (this test process has torch loaded already).
"""

from __future__ import annotations

import subprocess
import sys

from solve_helpers import llama_like


def test_plan_imports_neither_torch_nor_transformers(tmp_path):
    """A fixed 1F1B plan runs the whole command; afterwards neither module is loaded."""
    path = tmp_path / "p.json"
    llama_like(6).save(str(path))
    code = ("import sys; from autopart.cli.main import main; "
            f"rc = main(['plan', {str(path)!r}, '--pp', '2', '--schedule', '1f1b', "
            "'--format', 'json']); "
            "print('torch' in sys.modules, 'transformers' in sys.modules, rc, file=sys.stderr)")
    # From tmp_path: in the repository root ``-c`` would import the source tree's
    # autopart, which has no autopart.cli (CI installs non-editable).
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=tmp_path)
    assert out.stderr.split()[-3:] == ["False", "False", "0"]
