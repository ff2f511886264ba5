"""``autopart simulate --png`` and ``verify``'s comparison picture: a real PNG, or one line.

The PNG is checked by its signature and size; the missing-matplotlib case by hiding
the module, which must give exit 2 and the install command on one line.
"""

from __future__ import annotations

import sys

import pytest
from solve_helpers import llama_like

from autopart.simulate import simulate_plan
from autopart.simulate.picture import PlotError, save_timeline_png
from autopart.solve import make_plan
from cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    make_plan(llama_like(4), pp_size=2, num_microbatches=4, schedule="zbv").save(path)
    return path


def test_simulate_png_is_written(plan_path, tmp_path, capsys):
    out = tmp_path / "sub" / "timeline.png"
    assert main(["simulate", str(plan_path), "--png", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
    assert "timeline written to" in capsys.readouterr().out


def test_two_panels_stack(plan_path, tmp_path):
    from autopart.schema import Plan

    sim = simulate_plan(Plan.load(plan_path))
    one = save_timeline_png([("a", sim.events)], tmp_path / "one.png", num_ranks=2)
    two = save_timeline_png([("a", sim.events), ("b", sim.events)], tmp_path / "two.png",
                            num_ranks=2)
    from PIL import Image

    assert Image.open(two).height > Image.open(one).height


def test_missing_matplotlib_is_one_line_exit_2(plan_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match="pip install 'autopart\\[plot\\]'"):
        save_timeline_png([], tmp_path / "x.png", num_ranks=1)
    assert main(["simulate", str(plan_path), "--png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "autopart[plot]" in err
    assert not (tmp_path / "x.png").exists()
