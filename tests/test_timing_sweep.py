"""The timing sweep's shapes, method syntax and error distributions (no runs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

_SPEC = importlib.util.spec_from_file_location(
    "timing_sweep", Path(__file__).resolve().parent.parent / "scripts" / "timing_sweep.py")
timing_sweep = importlib.util.module_from_spec(_SPEC)
sys.modules["timing_sweep"] = timing_sweep  # its dataclasses look their module up there
_SPEC.loader.exec_module(timing_sweep)


def test_shapes_cover_what_issue_22_asks():
    """At least 12 shapes: hidden 64..1024, 2..24 layers, vocabulary 512..32k, several
    micro-batch and sequence sizes, three families with one MoE; each a valid config."""
    shapes = timing_sweep.SHAPES
    assert len(shapes) >= 12
    assert min(s.hidden for s in shapes) == 64 and max(s.hidden for s in shapes) == 1024
    assert min(s.layers for s in shapes) == 2 and max(s.layers for s in shapes) == 24
    assert min(s.vocab for s in shapes) == 512 and max(s.vocab for s in shapes) >= 32000
    assert len({s.mbs for s in shapes}) >= 3 and len({s.seq for s in shapes}) >= 3
    assert {s.family for s in shapes} == {"llama", "qwen2", "mixtral"}
    for shape in shapes:
        config = AutoConfig.for_model(shape.family, **shape.config())
        assert config.hidden_size % config.num_attention_heads == 0
        assert config.num_attention_heads % config.num_key_value_heads == 0


def test_methods_parse_and_bad_ones_exit_2(capsys):
    assert timing_sweep.parse_methods("none:1,llc:0:wall,order:1:bare,order:1:auto:bare") == [
        ("none", 1, "auto", True), ("llc", 0, "wall", True), ("order", 1, "auto", False),
        ("order", 1, "auto", False)]
    assert timing_sweep.method_name(("none", 1, "thread", True)) == (
        "flush none, 1 neighbour(s), thread clock")
    assert timing_sweep.method_name(("order", 1, "auto", False)) == (
        "flush order, 1 neighbour(s), not rehearsed")
    with pytest.raises(SystemExit) as exit_info:
        timing_sweep.parse_methods("l3:1")
    assert exit_info.value.code == 2
    assert "bad method 'l3:1'" in capsys.readouterr().err


def test_distribution_is_median_p90_worst_of_magnitudes():
    values = [0.01 * i * (-1) ** i for i in range(1, 11)]  # 1% .. 10%, signs alternating
    assert timing_sweep.distribution(values) == "5.5% / 9.0% / 10.0%"
    assert timing_sweep.distribution([]) == "-"


def test_loop_line_reads_the_replanned_errors_off_the_loop_rows():
    def row(err: str) -> list[str]:
        cells = dict.fromkeys(timing_sweep.LOOP_HEADER, "x")
        cells["err"] = err
        return list(cells.values())

    line = timing_sweep.loop_line([row("+3.0%"), row("-8.0%"), row("+12.0%")])
    assert line == ("replanned |step error| 8.0% / 12.0% / 12.0% (median / p90 / worst), "
                    "within 5% on 1 of 3, within 10% on 2")


def test_probe_line_reads_against_the_quietest_timing():
    """The machine probe's sentence: quietest timing, then median, p90 and worst above it."""
    line = timing_sweep.probe_line([[2.0, 2.2, 2.0], [2.4, 3.0], [6.0]])
    assert "timed 6 times" in line and "quietest 2.00 ms" in line
    assert "median +15%" in line and "p90 +50%" in line and "worst +200%" in line
    assert timing_sweep.probe_line([]) == ""
    assert len(timing_sweep.machine_probe(timings=3)) == 3


def test_launch_line_reads_two_launches_of_one_plan_against_each_other():
    """100 vs 110 and 90 vs 90: 10% and 0% apart (over the smaller); one run had a third."""
    runs = [timing_sweep.Run("s", "1f1b", "even", None, launches=launches)
            for launches in ((100.0, 110.0, 104.0), (90.0, 90.0), (50.0,))]
    line = timing_sweep.launch_line(runs)
    assert "read 5.0% / 10.0% / 10.0% apart" in line and "third launch in 1 of 3 runs" in line
    assert timing_sweep.launch_line(runs[2:]) == ""


def _run(predicted: float, launches: tuple[float, ...]):
    """A run of method ``m``: one stage (F 10, B 20 ms) and one rank, predicted exactly but
    for the step (``predicted`` ms against a measured 100 ms)."""
    stage = SimpleNamespace(measured_fwd_ms=10.0, measured_bwd_ms=20.0,
                            measured_fwd_cpu_ms=10.0, measured_bwd_cpu_ms=20.0)
    rank = SimpleNamespace(predicted_peak_memory_bytes=100, measured_peak_memory_bytes=100)
    report = SimpleNamespace(measured_step_ms=100.0, stages=[stage], ranks=[rank])
    plan = SimpleNamespace(predicted_step_ms=predicted,
                           setup=SimpleNamespace(runtime_overhead=None),
                           stages=[SimpleNamespace(index=0, fwd_ms=10.0, bwd_ms=20.0)])
    return timing_sweep.Run("s", "1f1b", "even", report, {"m": plan}, launches=launches)


def test_stage_errors_take_the_posts_off_the_predicted_stage():
    """A measured F or B span holds no posts: three stages whose spans are their predicted
    F and B less 0.5 ms per cut (the check's ``p2p_ms``), the middle one two cuts, read 0."""
    from autopart.schema import RuntimeOverhead

    check = RuntimeOverhead(fwd_action_ms=0.0, bwd_action_ms=0.0, p2p_ms=0.5, step_ms=0.0,
                            link_latency_ms=0.0, link_bandwidth_bytes_per_s=1e9,
                            backend="gloo", num_threads=1)
    cuts = (1, 2, 1)
    stages = [SimpleNamespace(index=i, fwd_ms=10.0, bwd_ms=20.0) for i in range(3)]
    measured = [SimpleNamespace(measured_fwd_ms=10.0 - 0.5 * c, measured_bwd_ms=20.0 - 0.5 * c,
                                measured_fwd_cpu_ms=None, measured_bwd_cpu_ms=None)
                for c in cuts]
    report = SimpleNamespace(measured_step_ms=100.0, stages=measured, ranks=[])
    plan = SimpleNamespace(predicted_step_ms=100.0, stages=stages,
                           setup=SimpleNamespace(runtime_overhead=check))
    errors = timing_sweep.run_errors(
        timing_sweep.Run("s", "interleaved-1f1b", "even", report, {"m": plan}), "m")
    assert errors["F"] == pytest.approx([0.0] * 3) and errors["B"] == pytest.approx([0.0] * 3)


def test_beyond_launches_is_the_prediction_outside_the_runs_launches():
    """Launches 90..110 ms, the median 100 kept: 95 is inside (0), 121 is 11 ms above the
    highest (+11%), 80 is 10 ms below the lowest (-10%); one launch has no range."""
    assert timing_sweep.beyond_launches(_run(95.0, (110.0, 90.0, 100.0)), "m") == 0.0
    assert timing_sweep.beyond_launches(_run(121.0, (110.0, 90.0, 100.0)), "m") == (
        pytest.approx(0.11))
    assert timing_sweep.beyond_launches(_run(80.0, (110.0, 90.0)), "m") == pytest.approx(-0.10)
    assert timing_sweep.beyond_launches(_run(95.0, (100.0,)), "m") is None


def test_summary_rows_match_the_header_and_count_predictions_inside_their_launches():
    """Two runs, one predicted inside its launches (0) and one 20% above the highest:
    the summary's beyond-launches column reads them, one per header column."""
    rows = timing_sweep.summary_rows([_run(100.0, (95.0, 105.0)), _run(130.0, (100.0, 110.0))],
                                     ["m"])
    assert len(rows) == 1 and len(rows[0]) == len(timing_sweep.SUMMARY_HEADER)
    assert rows[0][2] == "15.0% / 30.0% / 30.0%"
    assert rows[0][3] == "10.0% / 20.0% / 20.0% (1 inside)"
