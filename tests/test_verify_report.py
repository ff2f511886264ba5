"""Run reports, report building, calibration and the comparison trace, without processes.

Calibration is checked against hand-computed products on a synthetic profile; the
report builder against medians computed by hand from synthetic per-rank spans.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from solve_helpers import llama_like

from autopart.errors import SchemaError
from autopart.simulate import simulate_plan
from autopart.solve import make_plan, plan_again
from autopart.verify import RunReport, RunSettings, calibrate_profile
from autopart.verify.build import build_report
from autopart.verify.comparison import comparison_trace
from autopart.verify.report import MeasuredMemory
from autopart.verify.worker import RankResult
from cli.main import main

OUTSIDE = "(outside blocks)"
"""``BlockTimer.OUTSIDE``."""
REQUIRED = ("predicted_step_ms", "measured_step_ms", "schema_version", "plan_fingerprint",
            "steps", "memory_method", "device", "stages", "ranks")


@pytest.fixture(scope="module")
def profile():
    return llama_like(4, head_ms=4.0)


@pytest.fixture(scope="module")
def plan(profile):
    return make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b")


def _rank_result(plan, rank: int, scale: float) -> RankResult:
    """Synthetic ``run_rank`` output: two steps whose spans are ``scale`` x the plan's times."""
    (stage,) = plan.stages_of_rank(rank)
    steps = []
    for step in range(2):
        spans, t = [], 0.0
        for mb in range(plan.num_microbatches):
            f = scale * stage.fwd_ms * (1 + step)  # step 1 twice as slow: medians over both
            spans += [("F", stage.index, mb, t, t + 0.8 * f), ("LOSS", stage.index, mb,
                      t + 0.8 * f, t + f)] if stage.index == 1 else [("F", 0, mb, t, t + f)]
            t += f
            spans.append(("BW", stage.index, mb, t, t + scale * stage.bwd_ms * (1 + step)))
            t += scale * stage.bwd_ms * (1 + step)
        spans.append(("WAIT", -1, -1, t, t + 1.0))
        steps.append(tuple(spans))
    return RankResult(rank=rank, stages=(stage.index,), step_ms=(100.0, 110.0 + rank),
                      optimizer_ms=(5.0, 5.0), cpu_ms=(90.0, 95.0), spans=tuple(steps),
                      memory=MeasuredMemory(peak_bytes=1000 + rank, params_bytes=1000 + rank),
                      memory_method="test", device="cpu (test)", num_threads=1)


@pytest.fixture(scope="module")
def report(plan):
    settings = RunSettings(model="synthetic", steps=2, warmup=0)
    return build_report(plan, settings, [_rank_result(plan, 1, 3.0), _rank_result(plan, 0, 2.0)])


def test_report_medians_and_prediction(plan, report):
    """Stage F (+ loss) and full backward are the medians of both steps; the step is the
    median of the slowest rank's steps; the prediction is the plan's 1F1B step."""
    # Stage 0 = embedding + 4 layers, stage 1 = norm + head (llama_like, B + W = 2 F);
    # each send is the latency plus 1 MiB over 50 GB/s.
    f0, f1 = 0.1 + 4 * 1.0, 0.02 + 4.0
    b0, b1, send = 2 * f0, 2 * f1, 0.01 + 2**20 / 50e9 * 1e3
    assert [t for s in plan.stages for t in (s.fwd_ms, s.bwd_ms)] == pytest.approx(
        [f0, b0, f1, b1])
    # 1F1B, pp 2, m 4; a rank waits for its steady-state sends (torch batches each with
    # the next receive). Rank 0: F F, then waits for microbatch 0's gradient (send, F1
    # B1, send), then B F, waits for F2's send, B F, waits for F3's send; microbatch 3
    # goes on through rank 1 (F1 B1, send), then rank 0's last B.
    critical_path = (f0 + send + f1 + b1 + send + b0 + f0 + send + b0 + f0
                     + send + f1 + b1 + send + b0)
    assert report.predicted_step_ms == pytest.approx(critical_path)  # 61.02 ms + 5 sends
    assert report.measured_step_ms == pytest.approx((100.0 + 111.0) / 2)
    assert report.measured_steps_ms == (100.0, 111.0)  # each step's slowest rank
    for stage, scale in zip(report.stages, (2.0, 3.0)):
        planned = plan.stages[stage.index]
        assert stage.modules == planned.modules
        assert stage.measured_fwd_ms == pytest.approx(scale * planned.fwd_ms * 1.5)
        assert stage.measured_bwd_ms == pytest.approx(scale * planned.bwd_ms * 1.5)
        assert stage.measured_bwd_input_ms is None
    assert [r.rank for r in report.ranks] == [0, 1]
    assert report.ranks[1].measured_peak_memory_bytes == 1001
    assert report.ranks[1].memory == MeasuredMemory(peak_bytes=1001, params_bytes=1001)
    assert report.ranks[0].measured_cpu_ms == pytest.approx((90.0 + 95.0) / 2)
    assert report.ranks[0].measured_wait_ms == pytest.approx(1.0)
    assert len(report.measured_events) == sum(1 + 2 * 4 + 4 * (s.index == 1) for s in plan.stages)


def test_report_json_round_trip_has_required_keys(report, tmp_path):
    path = tmp_path / "run.json"
    report.save(path)
    data = json.loads(path.read_text())
    assert set(REQUIRED) <= set(data)
    for rank in data["ranks"]:
        assert {"predicted_peak_memory_bytes", "measured_peak_memory_bytes"} <= set(rank)
    assert RunReport.load(path) == report


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(schema_version=99), "schema_version 99"),
    (lambda d: d.pop("measured_step_ms"), "measured_step_ms"),
    (lambda d: d["ranks"][0].pop("measured_peak_memory_bytes"), "measured_peak_memory_bytes"),
])
def test_report_load_rejects_bad_files(report, tmp_path, edit, match):
    data = json.loads(report.to_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=match):
        RunReport.load(path)
    with pytest.raises(SchemaError, match="does not exist"):
        RunReport.load(tmp_path / "missing.json")


def test_calibration_scales_each_stage_exactly(profile, plan, report):
    """Blocks of stage 0 get x3 (2 x the 1.5 median), stage 1 x4.5; memory untouched."""
    calibrated = calibrate_profile(profile, report, plan, source="run.json")
    factor = {m: 3.0 if s.index == 0 else 4.5 for s in plan.stages for m in s.modules}
    for old, new in zip(profile.blocks, calibrated.blocks):
        assert new.fwd_ms == pytest.approx(factor[old.name] * old.fwd_ms, rel=1e-12)
        assert new.bwd_input_ms == pytest.approx(factor[old.name] * old.bwd_input_ms, rel=1e-12)
        assert new.bwd_weight_ms == pytest.approx(factor[old.name] * old.bwd_weight_ms, rel=1e-12)
        assert new.bwd_ms == pytest.approx(new.bwd_input_ms + new.bwd_weight_ms)
        assert new.activation_bytes == old.activation_bytes
    record = calibrated.calibration
    assert record["source"] == "run.json" and len(record["factors"]) == 2
    assert record["factors"][1]["fwd"] == pytest.approx(4.5)
    replanned = make_plan(calibrated, pp_size=2, num_microbatches=4, schedule="1f1b",
                          partition="even")
    even = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b", partition="even")
    assert replanned.stages[0].fwd_ms == pytest.approx(3.0 * even.stages[0].fwd_ms)


def test_calibration_rejects_another_plan(profile, plan, report):
    other = make_plan(profile, pp_size=2, num_microbatches=8, schedule="1f1b")
    with pytest.raises(SchemaError, match="another plan"):
        calibrate_profile(profile, report, other)
    with pytest.raises(SchemaError, match="another model"):
        calibrate_profile(llama_like(6), report)


def test_calibration_refuses_the_same_run_twice_and_other_shapes(profile, plan, report):
    once = calibrate_profile(profile, report, plan)
    with pytest.raises(SchemaError, match="already folded into the profile"):
        calibrate_profile(once, report, plan)
    longer = dataclasses.replace(profile, setup=dataclasses.replace(
        profile.setup, seq_len=2 * profile.setup.seq_len))
    with pytest.raises(SchemaError, match="seq_len"):
        calibrate_profile(longer, report, plan)


def test_comparison_trace_holds_measured_and_simulated(plan, report):
    trace = comparison_trace(report, simulate_plan(plan))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"measured", "simulated", "simulated sends"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sum(e["pid"] == 0 for e in spans) == len(report.measured_events)
    assert sum(e["pid"] == 1 for e in spans) == 2 * 2 * plan.num_microbatches
    assert all(e["dur"] >= 0 for e in spans)


def test_calibrate_command(profile, plan, report, tmp_path, capsys):
    paths = {name: tmp_path / f"{name}.json" for name in ("profile", "plan", "run", "out")}
    profile.save(paths["profile"])
    plan.save(paths["plan"])
    report.save(paths["run"])
    assert main(["calibrate", str(paths["profile"]), str(paths["run"]), "--plan",
                 str(paths["plan"]), "--out", str(paths["out"])]) == 0
    assert "stage 1" in capsys.readouterr().out
    assert json.loads(paths["out"].read_text())["calibration"]["plan_digest"] == \
        report.plan_digest
    assert main(["calibrate", str(paths["profile"]), str(tmp_path / "nope.json"), "--out",
                 str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err


def test_calibrate_command_pools_runs_of_one_plan(profile, plan, report, tmp_path, capsys):
    """Two runs of one plan, the second 4x slower: the factors are twice one run's (their
    geometric mean); a run of another plan among them is one line, exit 2."""
    slower = dataclasses.replace(report, measured_step_ms=4 * report.measured_step_ms,
                                 stages=tuple(dataclasses.replace(
                                     s, measured_fwd_ms=4 * s.measured_fwd_ms,
                                     measured_bwd_ms=4 * s.measured_bwd_ms)
                                     for s in report.stages))
    paths = [tmp_path / f"{name}.json" for name in ("profile", "run", "again", "other", "out")]
    profile.save(paths[0])
    report.save(paths[1])
    slower.save(paths[2])
    dataclasses.replace(report, plan_digest="another").save(paths[3])
    assert main(["calibrate", str(paths[0]), str(paths[1]), str(paths[2]),
                 "--out", str(paths[4])]) == 0
    capsys.readouterr()
    one = calibrate_profile(profile, report).calibration["factors"]
    both = json.loads(paths[4].read_text())["calibration"]["factors"]
    for a, b in zip(one, both):
        assert b["fwd"] == pytest.approx(2 * a["fwd"], rel=1e-6)
    assert main(["calibrate", str(paths[0]), str(paths[1]), str(paths[3]),
                 "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "another plan" in err and "other.json" in err


def test_live_peak_keeps_an_earlier_storage_at_a_gradient_address():
    """Address 1 holds a 5-byte temporary, then (freed) a gradient: only the gradient goes."""
    from autopart.verify.memory import peak_over_step

    events = [(1, 5), (2, 3), (1, -5), (1, 7), (2, -3)]
    assert peak_over_step(events, {1}, []) == (8, 0)
    assert peak_over_step(events, set(), []) == (10, 0)


def test_step_peak_counts_a_buffer_only_until_a_tensor_of_the_step_replaces_it():
    """A V schedule's buffer of 4 bytes from the last step is replaced after event 0 by
    the tensor allocated there (counted live): the sum peaks at 4 + 4 before it, not at
    the live peak 6 plus the buffers seen after the step (4)."""
    from autopart.verify.memory import peak_over_step

    events = [(1, 4), (2, 2), (2, -2)]
    assert peak_over_step(events, set(), [(0, 4), (1, 0)]) == (4, 4)
    assert peak_over_step(events, set(), [(0, 4)]) == (6, 4)  # never replaced
    assert peak_over_step([], set(), [(0, 4), (0, 1)]) == (0, 4)


def test_thread_mismatch_line_names_the_fix(report):
    """The report keeps the profile's thread count; a different rank count gets one line."""
    from autopart.runtime.validate import thread_mismatch
    from autopart.verify.report import report_thread_mismatch

    assert thread_mismatch(1, 1, pp_size=2) is None
    assert thread_mismatch(0, 1, pp_size=2) is None  # unknown: nothing to say
    line = thread_mismatch(2, 1, pp_size=2, model="heavy-head-llama")
    assert "2 thread(s)" in line and "runs 1" in line
    assert "autopart profile heavy-head-llama --threads 1" in line and "--pp 2" in line
    assert report_thread_mismatch(report) is None  # the synthetic profile records none
    bad = dataclasses.replace(report, profile_threads=2)
    assert "runs 1" in report_thread_mismatch(bad)
    assert report_thread_mismatch(dataclasses.replace(bad, device="cuda (H100)")) is None
    assert RunReport.from_json(bad.to_json()).profile_threads == 2


def test_plan_records_profile_threads(profile):
    threaded = dataclasses.replace(profile, setup=dataclasses.replace(profile.setup,
                                                                      num_threads=3))
    plan = make_plan(threaded, pp_size=2, num_microbatches=4, schedule="1f1b")
    assert plan.profile_threads == 3


def test_comparison_png_has_both_steps(plan, report, tmp_path):
    """``verify --png``: the measured median step above the simulated one, as a PNG."""
    from autopart.verify.comparison import save_comparison_png

    out = save_comparison_png(report, simulate_plan(plan), tmp_path / "cmp.png")
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def _with_blocks(plan, scale: dict[str, float]) -> list[RankResult]:
    """Two synthetic ranks whose F spans are split block by block: each block's forward is
    ``scale[block]`` x its profiled 1.0 ms (layers) and the time outside blocks 0.5 ms."""
    results = []
    for rank in range(2):
        (stage,) = plan.stages_of_rank(rank)
        names = list(stage.modules)
        steps = tuple(tuple(sample for _ in range(plan.num_microbatches)
                            for sample in [(stage.index, OUTSIDE, 0.5),
                                           *((stage.index, n, scale.get(n, 1.0))
                                             for n in names)])
                      for _ in range(2))
        base = _rank_result(plan, rank, 1.0)
        results.append(dataclasses.replace(base, block_fwd=steps))
    return results


def test_block_report_and_error_drivers(profile, plan):
    """Per-block medians land in the report in stage order; the driver of a stage's forward
    error is the block measured furthest from its profile, and outside blocks is what the
    stage's prediction holds beyond its blocks and the code after each."""
    from autopart.verify.attribution import block_errors, error_drivers

    blocks = tuple(dataclasses.replace(b, glue_after_ms=0.05 * (i + 1))  # code after each
                   for i, b in enumerate(profile.blocks))
    profile = dataclasses.replace(profile, blocks=blocks, setup=dataclasses.replace(  # and a
        profile.setup, glue_fwd_ms=sum(b.glue_after_ms for b in blocks) + 0.3))  # lead of 0.3
    plan = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b")
    results = _with_blocks(plan, {"model.layers.2": 4.0})
    report = build_report(plan, RunSettings(model="synthetic", steps=2, warmup=0), results)
    stage0 = plan.stages[0]
    assert [b.block for b in report.blocks if b.stage == 0] == [OUTSIDE, *stage0.modules]
    assert RunReport.from_json(report.to_json()).blocks == report.blocks
    errors = {(e.stage, e.block): e for e in block_errors(report, profile)}
    by_name = {b.name: b for b in profile.blocks}
    layer = errors[0, "model.layers.2"]
    own = {n: b.fwd_ms + b.glue_after_ms for n, b in by_name.items()}  # a block's row runs
    assert layer.predicted_fwd_ms == pytest.approx(own["model.layers.2"], abs=1e-4)
    assert layer.measured_fwd_ms == 4.0
    assert layer.delta_ms == pytest.approx(own["model.layers.2"] - 4.0, abs=1e-4)
    rest = errors[0, OUTSIDE]
    assert rest.predicted_fwd_ms == pytest.approx(
        stage0.fwd_ms - sum(own[m] for m in stage0.modules), abs=1e-4)
    assert rest.predicted_fwd_ms >= 0.3
    drivers = error_drivers(report, profile, top=2)
    assert drivers[0][0].block == "model.layers.2" and len(drivers[0]) == 2
    assert sorted(drivers) == [0, 1]


def _sleepy(seconds: float):
    """A block of known length: its forward sleeps ``seconds``, then adds 1."""
    import time

    from torch import nn

    class Sleepy(nn.Module):
        def forward(self, x):
            time.sleep(seconds)
            return x + 1

    return Sleepy()


def test_block_timer_splits_a_forward_at_each_block_start():
    """A real module's forward, hooked: each block gets the time from its first call's start
    to the next block's (the last one's to the end of the F), the time before the first
    block is outside blocks; the samples add up to the F span. Block ``a`` starts at
    module ``0`` (the stage module's ``block_starts``)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from autopart.verify.instrument import BlockTimer, StepRecorder

    model = nn.Sequential(_sleepy(0.02), _sleepy(0.0), _sleepy(0.01))
    stage = SimpleNamespace(stage_index=0, forward_one_chunk=lambda mb, x: model(x))
    recorder = StepRecorder(torch.device("cpu"))
    recorder._wrap(stage, "forward_one_chunk", lambda a, kw: ("F", 0, a[0]))
    plan = SimpleNamespace(index=0, modules=("a", "1", "2"))
    pipe = SimpleNamespace(stage_plans=[plan], module=model,
                           stage_modules=[SimpleNamespace(block_starts={"a": "0"})])
    timer = BlockTimer(recorder).attach(pipe)
    recorder.begin_step()
    stage.forward_one_chunk(0, torch.zeros(2))
    model(torch.zeros(2))  # outside any F span: not counted
    timer.detach()
    samples = timer.samples(0)
    assert [name for _, name, _ in samples] == [BlockTimer.OUTSIDE, "a", "1", "2"]
    (span,) = recorder.steps[0]
    assert sum(ms for *_, ms in samples) == pytest.approx(span.end_ms - span.start_ms)
    assert samples[1][2] >= 20 and samples[3][2] >= 10  # sleeps never end early
    model(torch.zeros(2))
    assert len(timer.starts[0]) == 3 + 3  # hooks removed: the last forward added nothing


def test_block_timer_puts_the_loss_in_the_last_stages_last_block():
    """The profile prices the loss inside the head; the run computes it as its own action
    after the last stage's F. The head's row takes the microbatch's loss, so a block
    driving the error is not the head for a loss it never ran (and calibration's block
    shares see the head's whole time)."""
    import time
    from types import SimpleNamespace

    import torch
    from torch import nn

    from autopart.verify.instrument import BlockTimer, StepRecorder

    model = nn.Sequential(_sleepy(0.0), _sleepy(0.005))
    stage = SimpleNamespace(stage_index=1, is_last=True,
                            forward_one_chunk=lambda mb, x: model(x))
    schedule = SimpleNamespace(_maybe_compute_loss=lambda st, out, tgt, mb: time.sleep(0.02))
    recorder = StepRecorder(torch.device("cpu"))
    recorder._wrap(stage, "forward_one_chunk", lambda a, kw: ("F", 1, a[0]))
    recorder._wrap(schedule, "_maybe_compute_loss", lambda a, kw: ("LOSS", 1, a[3]))
    pipe = SimpleNamespace(stage_plans=[SimpleNamespace(index=1, modules=("0", "1"))],
                           module=model, stage_modules=[None])
    timer = BlockTimer(recorder).attach(pipe)
    recorder.begin_step()
    for mb in range(2):
        out = stage.forward_one_chunk(mb, torch.zeros(2))
        schedule._maybe_compute_loss(stage, out, None, mb)
    timer.detach()
    samples = timer.samples(0)
    assert [name for _, name, _ in samples] == [BlockTimer.OUTSIDE, "0", "1"] * 2
    spans = recorder.steps[0]
    assert [s.kind for s in spans] == ["F", "LOSS"] * 2
    for mb in range(2):
        rows = samples[3 * mb: 3 * mb + 3]
        f, loss = spans[2 * mb], spans[2 * mb + 1]
        assert sum(ms for *_, ms in rows) == pytest.approx(
            (f.end_ms - f.start_ms) + (loss.end_ms - loss.start_ms))
        assert rows[2][2] >= 25  # the head's own 5 ms and the loss's 20 ms
        assert rows[1][2] < 20


def test_the_router_loss_counting_pass_is_one_span_apart_from_the_stage_forwards():
    """The router loss's counting pass runs every stage forward once before the step: its
    forwards are one ``COUNT`` span, not F spans of the step (summed per stage and
    microbatch with the step's own, they read every stage's F twice). The block timer
    records nothing inside it either."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from autopart.verify.instrument import BlockTimer, StepRecorder

    model = nn.Sequential(nn.Identity(), nn.Identity())
    stage = SimpleNamespace(stage_index=0, forward_one_chunk=lambda mb, x: model(x),
                            backward_one_chunk=lambda mb, *a, **kw: None,
                            backward_weight_one_chunk=lambda mb, *a, **kw: None)

    def counting_pass():
        for mb in range(4):
            stage.forward_one_chunk(mb, torch.zeros(2))

    pipe = SimpleNamespace(pipe_stages=[stage], schedule=SimpleNamespace(
        _maybe_compute_loss=lambda *a, **kw: None), _counting_pass=counting_pass,
        stage_plans=[SimpleNamespace(index=0, modules=("0", "1"))], module=model,
        stage_modules=[None])
    recorder = StepRecorder(torch.device("cpu")).attach(pipe)
    timer = BlockTimer(recorder).attach(pipe)
    recorder.begin_step()
    pipe._counting_pass()
    for mb in range(4):
        stage.forward_one_chunk(mb, torch.zeros(2))
    recorder.detach()
    timer.detach()
    kinds = [span.kind for span in recorder.steps[0]]
    assert kinds == ["COUNT"] + ["F"] * 4
    assert [span.microbatch_idx for span in recorder.steps[0]][1:] == [0, 1, 2, 3]
    assert len(timer.starts[0]) == 4 * 2  # the step's forwards' two blocks only
    assert pipe._counting_pass is counting_pass and recorder.enabled


def test_stage_cpu_time_is_the_median_of_each_microbatchs_spans(plan):
    """Each span's thread CPU time, given as half its length: the stage's forward (F + loss
    on the last stage) and full backward CPU figures are half the measured medians; a
    report without CPU times keeps ``None``."""
    results = []
    for rank, scale in ((0, 2.0), (1, 3.0)):
        base = _rank_result(plan, rank, scale)
        cpu = tuple(tuple(0.5 * (end - start) for _, _, _, start, end in step)
                    for step in base.spans)
        results.append(dataclasses.replace(base, span_cpu_ms=cpu))
    report = build_report(plan, RunSettings(model="synthetic", steps=2, warmup=0), results)
    for stage in report.stages:
        assert stage.measured_fwd_cpu_ms == pytest.approx(0.5 * stage.measured_fwd_ms)
        assert stage.measured_bwd_cpu_ms == pytest.approx(0.5 * stage.measured_bwd_ms)
    bare = build_report(plan, RunSettings(model="synthetic", steps=2, warmup=0),
                        [_rank_result(plan, 0, 2.0), _rank_result(plan, 1, 3.0)])
    assert all(s.measured_fwd_cpu_ms is None for s in bare.stages)


def test_calibration_leaves_what_stages_pay_outside_their_blocks(profile):
    """With glue (1 ms per F, every stage) in the prediction, the blocks take all of the
    measured difference: planning the same cuts again predicts the measured F and B."""
    glued = dataclasses.replace(profile, setup=dataclasses.replace(profile.setup,
                                                                  glue_fwd_ms=1.0))
    planned = make_plan(glued, pp_size=2, num_microbatches=4, schedule="1f1b")
    run = build_report(planned, RunSettings(model="synthetic", steps=2, warmup=0),
                       [_rank_result(planned, 1, 3.0), _rank_result(planned, 0, 2.0)])
    calibrated = calibrate_profile(glued, run, planned)
    again = make_plan(calibrated, pp_size=2, num_microbatches=4, schedule="1f1b",
                      cuts=tuple(planned.pipeline_cuts))
    for stage, measured in zip(again.stages, run.stages):
        assert stage.fwd_ms == pytest.approx(measured.measured_fwd_ms)
        assert stage.bwd_ms == pytest.approx(measured.measured_bwd_ms)


def test_calibration_prices_posts_as_the_run_measured_them(profile):
    """The ranks' time outside actions and waits, less the check's per-step work, over
    the posts each made (one cut: 2 per microbatch), median over the ranks, becomes the
    price per post of a single-stage schedule when the plan is not given; the multi-stage
    price moves by as much."""
    from autopart.schema import RuntimeOverhead
    from autopart.verify.calibrate import measured_post_ms

    check = RuntimeOverhead(fwd_action_ms=0.05, bwd_action_ms=0.07, p2p_ms=0.06, step_ms=0.2,
                            link_latency_ms=0.01, link_bandwidth_bytes_per_s=50e9,
                            backend="gloo", num_threads=1, runtime_p2p_ms=0.3)
    checked = dataclasses.replace(profile, runtime_overhead=check)
    planned = make_plan(checked, pp_size=2, num_microbatches=4, schedule="1f1b")
    run = build_report(planned, RunSettings(model="synthetic", steps=2, warmup=0),
                       [_rank_result(planned, 1, 3.0), _rank_result(planned, 0, 2.0)])
    run = dataclasses.replace(run, ranks=tuple(
        dataclasses.replace(r, measured_step_ms=r.measured_busy_ms + r.measured_wait_ms + extra)
        for r, extra in zip(run.ranks, (6.2, 10.2))))
    assert sorted(r.measured_outside_ms for r in run.ranks) == pytest.approx([6.2, 10.2])
    expected = ((6.2 + 10.2) / 2 - 0.2) / (2 * 4)
    assert measured_post_ms(run, check) == pytest.approx(expected)
    calibrated = calibrate_profile(checked, run)
    assert calibrated.runtime_overhead.p2p_ms == pytest.approx(expected, abs=1e-4)
    shifted = round(0.3 + expected - 0.06, 4)
    assert calibrated.runtime_overhead.runtime_p2p_ms == pytest.approx(shifted)
    assert calibrated.calibration["post"] == {
        "field": "p2p_ms", "before_ms": 0.06, "after_ms": round(expected, 4),
        "other_prices": {"runtime_p2p_ms": [0.3, shifted]}}
    assert measured_post_ms(run, None) is None
    assert calibrate_profile(profile, run).runtime_overhead is None


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("slower", [1.3, 0.9, 0.5])
def test_calibration_with_the_plan_predicts_the_step_that_ran(profile, schedule, slower):
    """Given the plan, the post price of its kind is the one at which the same cuts predict
    the run's step; where free posts still predict too long a step, the link latency
    comes down instead; the other kinds' prices move by as much (GPipe's own moves
    nothing else). (The multi-stage kind is
    fitted on a real run: tests/test_profile_cli.py, the rehearsal.)"""
    from autopart.schema import RuntimeOverhead

    check = RuntimeOverhead(fwd_action_ms=0.05, bwd_action_ms=0.07, p2p_ms=0.06, step_ms=0.2,
                            link_latency_ms=0.5, link_bandwidth_bytes_per_s=50e9,
                            backend="gloo", num_threads=1, runtime_p2p_ms=0.3)
    checked = dataclasses.replace(profile, runtime_overhead=check)
    planned = make_plan(checked, pp_size=2, num_microbatches=4, schedule=schedule)
    run = build_report(planned, RunSettings(model="synthetic", steps=2, warmup=0),
                       [_rank_result(planned, 1, 1.0), _rank_result(planned, 0, 1.0)])
    busy = max(r.measured_busy_ms for r in run.ranks)
    run = dataclasses.replace(run, measured_step_ms=slower * busy)
    calibrated = calibrate_profile(checked, run, planned)
    again = make_plan(calibrated, pp_size=2, num_microbatches=4, schedule=schedule,
                      cuts=tuple(planned.pipeline_cuts))
    post = calibrated.calibration["post"]
    gpipe = schedule == "gpipe"
    field = "gpipe_p2p_ms" if gpipe else "p2p_ms"
    assert post["field"] == field and post["run_step_ms"] == pytest.approx(
        run.measured_step_ms, abs=1e-3)
    assert again.predicted_step_ms == pytest.approx(post["predicted_step_ms"], rel=1e-3)
    new = calibrated.runtime_overhead
    if getattr(new, field) > 1e-4:
        assert again.predicted_step_ms == pytest.approx(run.measured_step_ms, rel=1e-3)
        assert "link_latency_ms" not in post
    else:  # free posts still too slow: the latency came down (not for GPipe's own price)
        assert again.predicted_step_ms >= run.measured_step_ms * 0.999
        assert new.link_latency_ms == 0.5 if gpipe else new.link_latency_ms < 0.5
    if gpipe:  # GPipe's price is its own: nothing else moves
        assert (new.p2p_ms, new.runtime_p2p_ms) == (check.p2p_ms, check.runtime_p2p_ms)
    else:
        shift = new.p2p_ms - check.p2p_ms
        assert new.runtime_p2p_ms == pytest.approx(max(check.runtime_p2p_ms + shift, 0),
                                                   abs=1e-3)


@pytest.mark.parametrize("slower", [0.5, 1.3])
def test_gpipe_posts_the_step_cannot_price_take_the_runs_outside_time(profile, slower):
    """Where free posts predict above the GPipe run's step, the fit cannot price them
    (it said free): given the run's own price per post, that is the price, the record
    says so and the plan predicts with it; where the step does price them, it is the
    fitted one as before."""
    from autopart.schema import RuntimeOverhead
    from autopart.verify.calibrate import fit_post_price

    check = RuntimeOverhead(fwd_action_ms=0.05, bwd_action_ms=0.07, p2p_ms=0.06, step_ms=0.2,
                            link_latency_ms=0.5, link_bandwidth_bytes_per_s=50e9,
                            backend="gloo", num_threads=1, runtime_p2p_ms=0.3,
                            gpipe_p2p_ms=0.4)
    checked = dataclasses.replace(profile, runtime_overhead=check)
    planned = make_plan(checked, pp_size=2, num_microbatches=4, schedule="gpipe")
    step = slower * planned.predicted_step_ms
    free, fit = fit_post_price(planned, step, check, others=False)
    priced, record = fit_post_price(planned, step, check, others=False, outside_ms=0.75)
    if slower < 1:
        assert free.gpipe_p2p_ms == 1e-4 and "from_outside" not in fit
        assert priced.gpipe_p2p_ms == 0.75 and record["from_outside"] is True
        assert record["after_ms"] == 0.75
        again = make_plan(dataclasses.replace(checked, runtime_overhead=priced), pp_size=2,
                          num_microbatches=4, schedule="gpipe",
                          cuts=tuple(planned.pipeline_cuts))
        assert again.predicted_step_ms == pytest.approx(record["predicted_step_ms"], rel=1e-3)
        assert again.predicted_step_ms > planned.predicted_step_ms
    else:
        assert (priced, record) == (free, fit) and free.gpipe_p2p_ms > 0.4
    assert (priced.p2p_ms, priced.runtime_p2p_ms) == (check.p2p_ms, check.runtime_p2p_ms)


def test_outside_is_the_step_less_actions_and_waits(report):
    for rank in report.ranks:
        assert rank.measured_outside_ms == pytest.approx(
            max(rank.measured_step_ms - rank.measured_busy_ms - rank.measured_wait_ms, 0.0))
    older = dataclasses.replace(report.ranks[0], measured_step_ms=0.0)
    assert older.measured_outside_ms is None


def test_the_rank_table_shows_outside(report, capsys):
    from rich.console import Console

    from cli.cmd_verify import print_report

    print_report(report, Console(width=200))
    out = capsys.readouterr().out
    assert "outside meas" in out and "the rank's step less its actions and p2p waits" in out


def test_pooled_report_is_the_geometric_mean_of_runs_of_one_plan(profile, plan, report):
    """Two runs of one plan: each stage's F and B and the step become their geometric
    mean (what the rehearsal folds in); runs of two plans are refused."""
    from autopart.verify.report import pooled_report

    slower = dataclasses.replace(report, measured_step_ms=4 * report.measured_step_ms,
                                 stages=tuple(dataclasses.replace(
                                     s, measured_fwd_ms=4 * s.measured_fwd_ms,
                                     measured_bwd_ms=9 * s.measured_bwd_ms)
                                     for s in report.stages))
    pooled = pooled_report((report, slower))
    assert pooled.measured_step_ms == pytest.approx(2 * report.measured_step_ms)
    assert pooled.measured_steps_ms == 2 * report.measured_steps_ms  # both runs' steps
    for one, both in zip(report.stages, pooled.stages):
        assert both.measured_fwd_ms == pytest.approx(2 * one.measured_fwd_ms)
        assert both.measured_bwd_ms == pytest.approx(3 * one.measured_bwd_ms)
        assert both.measured_bwd_input_ms is None
    assert pooled_report((report,)) == report
    calibrated = calibrate_profile(profile, pooled, plan)
    assert calibrated.calibration["factors"][0]["fwd"] == pytest.approx(2 * 3.0, rel=1e-6)
    with pytest.raises(ValueError, match="same plan"):
        pooled_report((report, dataclasses.replace(report, plan_digest="other")))


def test_the_router_loss_counting_pass_is_priced_as_measured(profile):
    """A run's ``COUNT`` spans (the longest rank's, median over steps) scale the counting
    pass's price from the blocks: planning again prices it as measured, the scale kept
    in the runtime overhead and the calibration record; a report without the spans keeps
    the scale 1."""
    from autopart.cost.rank import stage_costs_of_plan
    from autopart.schema import RuntimeOverhead
    from autopart.simulate.replay import counting_pass_ms

    check = RuntimeOverhead(fwd_action_ms=0.05, bwd_action_ms=0.07, p2p_ms=0.06, step_ms=0.2,
                            link_latency_ms=0.5, link_bandwidth_bytes_per_s=50e9,
                            backend="gloo", num_threads=1)
    moe = dataclasses.replace(profile, runtime_overhead=check, model=dataclasses.replace(
        profile.model, router_loss_pass=True))
    planned = make_plan(moe, pp_size=2, num_microbatches=4, schedule="1f1b")
    results = []
    for rank in (0, 1):
        base = _rank_result(planned, rank, 1.0)
        spans = tuple((("COUNT", -1, -1, 0.0, 7.0 + rank + 2 * step),) + step_spans
                      for step, step_spans in enumerate(base.spans))
        results.append(dataclasses.replace(base, spans=spans))
    run = build_report(planned, RunSettings(model="synthetic", steps=2, warmup=0), results)
    assert run.measured_count_ms == pytest.approx(9.0)  # steps' longest: 8 and 10
    assert all(s.measured_fwd_ms > 0 for s in run.stages)
    calibrated = calibrate_profile(moe, run, planned)
    record = calibrated.calibration["count_pass"]
    assert calibrated.runtime_overhead.count_pass_scale == record["after"] == pytest.approx(
        9.0 / record["priced_ms"], rel=1e-3)
    again = make_plan(calibrated, pp_size=2, num_microbatches=4, schedule="1f1b",
                      cuts=tuple(planned.pipeline_cuts))
    assert abs(record["priced_ms"] - 9.0) > 1.0  # the scale is what brings it to 9
    setup = dataclasses.replace(again.setup, runtime_overhead=dataclasses.replace(
        again.setup.runtime_overhead, p2p_ms=check.p2p_ms))  # the price before the post fit
    assert counting_pass_ms(stage_costs_of_plan(again), schedule="1f1b", pp_size=2,
                            virtual_stages=1, num_microbatches=4, setup=setup,
                            step_ms=0.0) == pytest.approx(9.0, rel=0.02)
    bare = build_report(planned, RunSettings(model="synthetic", steps=2, warmup=0),
                        [_rank_result(planned, 0, 1.0), _rank_result(planned, 1, 1.0)])
    assert bare.measured_count_ms == 0.0
    assert calibrate_profile(moe, bare, planned).runtime_overhead.count_pass_scale == 1.0


def _glued(profile):
    """``profile`` with 0.05 ms of the model's code after each block, a stand-in of 0.02
    ms each and 0.3 ms of code before the first block."""
    blocks = tuple(dataclasses.replace(b, glue_after_ms=0.05, stand_in_ms=0.02)
                   for b in profile.blocks)
    return dataclasses.replace(profile, blocks=blocks, setup=dataclasses.replace(
        profile.setup, glue_fwd_ms=0.05 * len(blocks) + 0.3))


def _run_with_outside(profile, plan, outside: float, blocks: float | dict[str, float]
                      ) -> RunReport:
    """A run in which the model's code outside the blocks (glue, stand-ins) ran ``outside``
    x its profile and the blocks ``blocks`` x theirs (by name: 1 where not named), split
    block by block."""
    speed = blocks if isinstance(blocks, dict) else {}
    from autopart.verify.outside import lead_ms

    index = {b.name: i for i, b in enumerate(profile.blocks)}
    results = []
    for rank in range(2):
        (stage,) = plan.stages_of_rank(rank)
        own = [profile.blocks[index[n]] for n in stage.modules]
        lead = lead_ms(profile, index[stage.modules[0]])
        rows = [(stage.index, OUTSIDE, stage.fwd_ms - sum(b.fwd_ms + b.glue_after_ms
                                                          for b in own)
                 + (outside - 1) * lead)]
        rows += [(stage.index, n, speed.get(n, 1.0 if speed else blocks) * b.fwd_ms
                  + outside * b.glue_after_ms) for n, b in zip(stage.modules, own)]
        measured_f = sum(ms for *_, ms in rows)
        base = _rank_result(plan, rank, measured_f / (1.5 * stage.fwd_ms))  # median: 1.5x
        steps = tuple(tuple(r for _ in range(plan.num_microbatches) for r in rows)
                      for _ in range(2))
        results.append(dataclasses.replace(base, block_fwd=steps))
    return build_report(plan, RunSettings(model="synthetic", steps=2, warmup=0), results)


def test_outside_scale_takes_the_glue_and_stand_ins_off_the_blocks(profile):
    """A run whose glue and stand-ins ran 2x their profile and blocks 1.5x: calibration
    finds both apart, so a plan cutting elsewhere is priced with each where it falls
    (a stage with more stand-ins before it pays more), not with the stages' mixed
    factors."""
    glued = _glued(profile)
    planned = make_plan(glued, pp_size=2, num_microbatches=4, schedule="1f1b",
                        cuts=("model.layers.1",))
    run = _run_with_outside(glued, planned, outside=2.0, blocks=1.5)
    calibrated = calibrate_profile(glued, run, planned)
    assert calibrated.calibration["outside_scale"] == pytest.approx(2.0, rel=1e-4)
    for factor in calibrated.calibration["factors"]:
        assert factor["fwd"] == pytest.approx(1.5, rel=1e-3)
    again = make_plan(calibrated, pp_size=2, num_microbatches=4, schedule="1f1b",
                      cuts=tuple(planned.pipeline_cuts))
    for stage, measured in zip(again.stages, run.stages):
        assert stage.fwd_ms == pytest.approx(measured.measured_fwd_ms, rel=1e-3)
    from autopart.verify.outside import lead_ms

    index = {b.name: i for i, b in enumerate(glued.blocks)}
    other = ("model.layers.2",)
    before = make_plan(glued, pp_size=2, num_microbatches=4, schedule="1f1b", cuts=other)
    after = make_plan(calibrated, pp_size=2, num_microbatches=4, schedule="1f1b", cuts=other)
    for was, now in zip(before.stages, after.stages):
        own = [glued.blocks[index[n]] for n in was.modules]
        lead = lead_ms(glued, index[was.modules[0]])
        assert now.fwd_ms == pytest.approx(
            was.fwd_ms + 0.5 * sum(b.fwd_ms for b in own)
            + (lead + sum(b.glue_after_ms for b in own)), rel=1e-3)


def test_outside_scale_needs_block_rows_and_is_clipped(profile, plan, report):
    """Without per-block rows the scale is 1 (the stages' factors take everything, as
    before); rows that read an outside far beyond the code's profile are clipped."""
    from autopart.verify.outside import OUTSIDE_SCALE_RANGE, fit_outside_scale

    assert report.blocks == ()
    assert fit_outside_scale(profile, report) == (1.0, {})
    glued = _glued(profile)
    planned = make_plan(glued, pp_size=2, num_microbatches=4, schedule="1f1b",
                        cuts=("model.layers.1",))
    scale, added = fit_outside_scale(glued, _run_with_outside(glued, planned, 50.0, 1.0))
    assert scale == OUTSIDE_SCALE_RANGE[1] and sorted(added) == [0, 1]


def test_pooled_report_pools_each_blocks_forward(profile):
    """The rehearsal's two runs: each block's row is their geometric mean too."""
    from autopart.verify.report import pooled_report

    glued = _glued(profile)
    planned = make_plan(glued, pp_size=2, num_microbatches=4, schedule="1f1b")
    one = _run_with_outside(glued, planned, outside=1.0, blocks=1.0)
    four = dataclasses.replace(one, blocks=tuple(
        dataclasses.replace(b, measured_fwd_ms=4 * b.measured_fwd_ms) for b in one.blocks))
    pooled = pooled_report((one, four))
    for a, b in zip(one.blocks, pooled.blocks):
        assert (b.stage, b.block) == (a.stage, a.block)
        assert b.measured_fwd_ms == pytest.approx(2 * a.measured_fwd_ms, abs=1e-3)


def test_each_block_keeps_its_own_speed_when_a_plan_moves_it(profile):
    """Stage 1's layers ran at their profile and its head at 2x: the rows share the
    stage's factor out, so the head alone is slowed and a plan that moves
    ``model.layers.2`` onto stage 0 prices it at its own speed, not at the head's; the
    same cuts planned again still predict each stage's measured F."""
    glued = _glued(profile)
    planned = make_plan(glued, pp_size=2, num_microbatches=4, schedule="1f1b",
                        cuts=("model.layers.1",))
    run = _run_with_outside(glued, planned, outside=1.0, blocks={"lm_head": 2.0})
    calibrated = calibrate_profile(glued, run, planned)
    was, now = ({b.name: b.fwd_ms for b in p.blocks} for p in (glued, calibrated))
    assert now["model.layers.2"] == pytest.approx(was["model.layers.2"], rel=1e-3)
    assert now["lm_head"] == pytest.approx(2 * was["lm_head"], rel=1e-3)
    assert now["model.layers.0"] == pytest.approx(was["model.layers.0"], rel=1e-3)
    again = make_plan(calibrated, pp_size=2, num_microbatches=4, schedule="1f1b",
                      cuts=tuple(planned.pipeline_cuts))
    for stage, measured in zip(again.stages, run.stages):
        assert stage.fwd_ms == pytest.approx(measured.measured_fwd_ms, rel=1e-3)


def _sliced(profile):
    """``_glued(profile)`` with a head split by vocabulary, its sliced loss a quarter of
    the head's cost per row plus 0.5 ms per call."""
    glued = _glued(profile)
    return dataclasses.replace(
        glued, model=dataclasses.replace(glued.model, head_split_rows=1000),
        setup=dataclasses.replace(glued.setup, head_slice_fwd_ratio=0.25,
                                  head_slice_fwd_ms=0.5))


def _sliced_run(sliced, planned, slow_ms: float = 0.0):
    """A run of ``planned`` in which every block ran as priced, its rows split block by
    block on its first stage with shards, but the shards' row ``slow_ms`` slower (the sliced
    loss's fixed cost under-priced)."""
    stage = next(s for s in planned.stages if any(".shard" in m for m in s.modules))
    blocks = {b.name: b for b in sliced.blocks}
    head = blocks["lm_head"]
    kept = [n for n in stage.modules if ".shard" not in n]
    share = (len(stage.modules) - len(kept)) / int(stage.modules[-1].rsplit("of", 1)[1])
    rows = [(stage.index, n, blocks[n].fwd_ms + blocks[n].glue_after_ms) for n in kept]
    rows.append((stage.index, "lm_head", share * (0.25 * head.fwd_ms + head.glue_after_ms)
                 + 0.5 + slow_ms))
    rows.insert(0, (stage.index, OUTSIDE, stage.fwd_ms - sum(ms for *_, ms in rows)
                    + slow_ms))
    assert rows[0][2] > 0
    results = []
    for rank in range(2):
        result = _rank_result(planned, rank, 1 / 1.5)  # medians: 1 x the plan's
        if rank == stage.rank:
            result = dataclasses.replace(result, block_fwd=tuple(
                tuple(r for _ in range(planned.num_microbatches) for r in rows)
                for _ in range(2)), spans=tuple(tuple(
                    (kind, s, mb, start, end + slow_ms if kind == "F" else end)
                    for kind, s, mb, start, end in step) for step in result.spans))
        results.append(result)
    run = build_report(planned, RunSettings(model="synthetic", steps=2, warmup=0), results)
    assert run.stages[stage.index].measured_fwd_ms == pytest.approx(stage.fwd_ms + slow_ms)
    return run


def test_head_shards_are_read_as_the_sliced_loss_they_ran(profile):
    """A run in which every block ran as priced, the head's shards with the runtime's
    sliced loss (their share of the head's forward x ``head_slice_fwd_ratio`` plus the
    slice's fixed cost), leaves every block's forward and the slice's cost as they were,
    and the head's row reads no error; read as the whole head's forward, the row made
    the head 0.5x and the layers faster."""
    from autopart.verify.attribution import block_errors

    sliced = _sliced(profile)
    planned = make_plan(sliced, pp_size=2, num_microbatches=4, schedule="1f1b",
                        cuts=("lm_head.shard1of4",))
    assert planned.stages[0].modules[-2:] == ("lm_head.shard0of4", "lm_head.shard1of4")
    run = _sliced_run(sliced, planned)
    calibrated = calibrate_profile(sliced, run, planned)
    blocks = {b.name: b for b in sliced.blocks}
    for block in calibrated.blocks:
        assert block.fwd_ms == pytest.approx(blocks[block.name].fwd_ms, rel=1e-3), block.name
    assert calibrated.setup.head_slice_fwd_ms == pytest.approx(0.5, abs=1e-3)
    errors = {(e.stage, e.block): e for e in block_errors(run, sliced)}
    assert errors[0, "lm_head"].delta_ms == pytest.approx(0.0, abs=1e-3)
    assert errors[0, OUTSIDE].delta_ms == pytest.approx(0.0, abs=1e-3)


def test_a_slow_sliced_loss_is_its_own_cost_not_the_heads(profile):
    """The shards' row 0.4 ms slower than priced, every other block as priced: the sliced
    loss (its fixed cost and its cost per row) takes the 0.4 ms and no block moves, so
    the same cuts predict the stage's F as run, and a plan with the head whole does not
    pay the sliced loss's excess (read as the head's speed, a rehearsal cut inside
    tiny-llama's head priced its whole head at 1.97 ms where it ran 1.06)."""
    sliced = _sliced(profile)
    planned = make_plan(sliced, pp_size=2, num_microbatches=4, schedule="1f1b",
                        partition="even")  # as the rehearsal: the shards on the last stage
    assert planned.stages[1].modules[-1].startswith("lm_head.shard")
    run = _sliced_run(sliced, planned, slow_ms=0.4)
    calibrated = calibrate_profile(sliced, run, planned)
    # the whole head as one slice: one row cannot tell the fixed cost from the cost per
    # row, so the sliced loss's both take its scale
    priced = 0.25 * next(b for b in sliced.blocks if b.name == "lm_head").fwd_ms + 0.5
    scale = (priced + 0.4) / priced
    assert calibrated.setup.head_slice_fwd_ms == pytest.approx(0.5 * scale, abs=1e-3)
    assert calibrated.setup.head_slice_fwd_ratio == pytest.approx(0.25 * scale, abs=1e-3)
    assert calibrated.calibration["slice_fwd_ms"] == [0.5, pytest.approx(0.5 * scale,
                                                                         abs=1e-3)]
    assert calibrated.calibration["slice_fwd_ratio"] == [0.25, pytest.approx(0.25 * scale,
                                                                             abs=1e-3)]
    blocks = {b.name: b for b in sliced.blocks}
    for block in calibrated.blocks:
        assert block.fwd_ms == pytest.approx(blocks[block.name].fwd_ms, rel=1e-3), block.name
    again = plan_again(calibrated, planned)
    assert again.stages[1].fwd_ms == pytest.approx(run.stages[1].measured_fwd_ms, rel=1e-3)
    whole = make_plan(calibrated, pp_size=2, num_microbatches=4, schedule="1f1b",
                      cuts=(sliced.blocks[-2].name,))
    before = make_plan(sliced, pp_size=2, num_microbatches=4, schedule="1f1b",
                       cuts=(sliced.blocks[-2].name,))
    assert whole.stages[1].fwd_ms == pytest.approx(before.stages[1].fwd_ms, rel=1e-3)


def test_stage_errors_leave_the_posts_the_spans_do_not_hold(profile, capsys):
    """A stage's predicted F and B carry the price of posting its sends and receives
    (``p2p_ms`` per cut), which torch posts outside the F and B spans: the per-stage
    errors and the block attribution take it off, so spans that ran exactly the stage's
    work read 0%, and a middle stage pays for two cuts."""
    from rich.console import Console

    from autopart.cost.stage import stage_post_ms
    from autopart.schema import RuntimeOverhead
    from autopart.verify.attribution import block_errors
    from cli.cmd_verify import print_report

    check = RuntimeOverhead(fwd_action_ms=0.05, bwd_action_ms=0.07, p2p_ms=0.4, step_ms=0.2,
                            link_latency_ms=0.01, link_bandwidth_bytes_per_s=50e9,
                            backend="gloo", num_threads=1)
    assert (stage_post_ms(check, True, True), stage_post_ms(check, False, True),
            stage_post_ms(None, True, True)) == (0.8, 0.4, 0.0)
    checked = dataclasses.replace(profile, runtime_overhead=check)
    planned = make_plan(checked, pp_size=2, num_microbatches=4, schedule="1f1b")
    results = []
    for rank in range(2):  # every span exactly the stage's prediction less its posts
        (stage,) = planned.stages_of_rank(rank)
        f, b = stage.fwd_ms - 0.4, stage.bwd_ms - 0.4
        spans = tuple(s for mb in range(4) for s in (("F", stage.index, mb, 10.0 * mb,
                                                       10.0 * mb + f),
                                                      ("BW", stage.index, mb, 10.0 * mb + f,
                                                       10.0 * mb + f + b)))
        base = _rank_result(planned, rank, 1.0)
        results.append(dataclasses.replace(base, spans=(spans, spans), block_fwd=_with_blocks(
            planned, {})[rank].block_fwd))
    run = build_report(planned, RunSettings(model="synthetic", steps=2, warmup=0), results)
    for stage, reported in zip(planned.stages, run.stages):
        assert reported.predicted_post_ms == pytest.approx(0.4)
        assert reported.predicted_fwd_ms == stage.fwd_ms  # the plan's, posts and all
        assert reported.predicted_fwd_span_ms == pytest.approx(reported.measured_fwd_ms)
        assert reported.predicted_bwd_span_ms == pytest.approx(reported.measured_bwd_ms)
    assert RunReport.from_json(run.to_json()).stages == run.stages
    print_report(run, Console(width=200))
    out = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines()
            if line.startswith("│")]
    rows = [row for row in rows if len(row) == 11][:2]  # the stage table's (then ranks')
    assert [row[0] for row in rows] == ["0", "1"]  # F err and B err, 0 up to rounding
    assert all(row[i] in ("+0.0%", "-0.0%") for row in rows for i in (4, 7)), rows
    assert "up to 0.40 ms per F and per B" in out
    own = {b.name: b.fwd_ms + b.glue_after_ms for b in checked.blocks}
    outside = {e.stage: e for e in block_errors(run, checked) if e.block == OUTSIDE}
    stage0 = planned.stages[0]
    assert outside[0].predicted_fwd_ms == pytest.approx(
        stage0.fwd_ms - 0.4 - sum(own[m] for m in stage0.modules), abs=1e-4)
