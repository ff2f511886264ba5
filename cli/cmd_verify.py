"""``autopart verify PLAN --model MODEL``: run a plan for real and compare it with its prediction.

Spawns the plan's ranks (or runs in place under torchrun), trains ``--steps``
steps after ``--warmup`` on synthetic tokens, and prints per stage predicted vs
measured F and B (W) ms, per rank predicted vs measured peak memory, busy and
wait, then the step time, each with its error. ``--json`` writes the run report,
``--trace`` one Perfetto trace of the measured and simulated steps, ``--profile P
--calibrated-profile OUT`` the profile with the measured stage times folded in.
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.table import Table

from autopart.errors import RuntimeSetupError
from autopart.jsonio import check_writable
from autopart.schema import Plan, Profile
from autopart.simulate import simulate_plan
from autopart.simulate.picture import require_matplotlib
from autopart.verify import (
    RunReport,
    RunSettings,
    calibrate_profile,
    verify_plan,
    write_comparison_trace,
)
from autopart.verify.attribution import error_drivers
from autopart.verify.comparison import save_comparison_png
from autopart.verify.report import report_thread_mismatch

from ._format import gib
from ._progress import progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``verify`` command."""
    p = sub.add_parser("verify", help="run a plan for real and compare with its prediction",
                       description="Run PLAN on MODEL for a few steps on synthetic tokens; "
                                   "measure per stage F/B/W, per rank peak memory and the step "
                                   "time, and compare them with what the plan predicted.")
    p.add_argument("plan", metavar="PLAN", help="plan JSON written by `autopart plan`")
    p.add_argument("--model", required=True, help="the model the plan is for (preset, path)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default and only allowed value: the plan's "
                        "pp x dp x tp)")
    p.add_argument("--threads-per-rank", type=int, default=None, metavar="N",
                   help="torch threads per rank (default: CPU cores / ranks)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="timeout of every collective in seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="write the run report here")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="write one Perfetto trace: measured and simulated step")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="draw the measured and the predicted step one above the other "
                        "(needs matplotlib: pip install 'autopart[plot]')")
    p.add_argument("--profile", default=None, metavar="PROFILE",
                   help="the profile the plan was made from: print which blocks drive each "
                        "stage's forward error (and needed by --calibrated-profile)")
    p.add_argument("--calibrated-profile", default=None, metavar="OUT",
                   help="write PROFILE with the measured stage times folded in")


def run(args: argparse.Namespace) -> int:
    """Verify, print the comparison, write the requested files."""
    if args.calibrated_profile and not args.profile:
        raise RuntimeSetupError("--calibrated-profile needs --profile (the profile the plan "
                                "was made from); give both")
    for path in (args.json, args.trace, args.calibrated_profile, args.png):
        if path:
            check_writable(path)  # before the run, not after
    if args.png:
        require_matplotlib()
    plan = Plan.load(args.plan)
    profile = Profile.load(args.profile) if args.profile else None
    ranks = plan.pp_size * plan.dp_size * plan.tp_size
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)
    settings = RunSettings(model=args.model, steps=args.steps, warmup=args.warmup,
                           threads_per_rank=threads, timeout_s=args.timeout)
    with progress_bar("verifying") as progress:
        report = verify_plan(plan, settings, nproc=args.nproc, progress=progress)
    if report is None:  # a non-zero rank under torchrun
        return 0
    console = Console(width=None if sys.stdout.isatty() else 140)
    print_report(report, console)
    if args.json:
        report.save(args.json)
        console.print(f"run report written to {args.json}")
    if args.trace:
        write_comparison_trace(report, simulate_plan(plan), args.trace)
        console.print(f"trace (measured + simulated) written to {args.trace}")
    if args.png:
        save_comparison_png(report, simulate_plan(plan), args.png)
        console.print(f"timelines (measured above predicted) written to {args.png}")
    if profile is not None:
        print_drivers(report, profile, console)
    if args.calibrated_profile:
        calibrate_profile(profile, report, plan, source=args.json or "").save(
            args.calibrated_profile)
        console.print(f"calibrated profile written to {args.calibrated_profile}")
    return 0


def print_report(report: RunReport, console: Console) -> None:
    """The stage, rank and step comparison tables of ``report``."""
    mesh = ""
    if report.tp_size * report.dp_size > 1:
        shard = {0: "", 1: ", ZeRO-1", 3: ", FSDP per " +
                 ("microbatch" if report.reshard_after_forward else "step")}[report.zero_stage]
        sp = ", sequence parallel" if report.tp_size > 1 and report.sequence_parallel else ""
        mesh = f"tp={report.tp_size}{sp}, dp={report.dp_size}{shard}, "
    title = (f"{report.model}: {mesh}pp={report.pp_size}, {report.schedule}, "
             f"m={report.num_microbatches}, {report.steps} steps on {report.device}, "
             f"{report.num_threads_per_rank} thread(s)/rank")
    stages = Table(title=title + " -- per microbatch")
    for col in ("stage", "rank", "F pred", "F meas", "F err", "B pred", "B meas", "B err",
                "W pred", "W meas", "W err"):
        stages.add_column(col, justify="right")
    for s in report.stages:
        w = ([f"{s.predicted_bwd_weight_ms:.2f}", f"{s.measured_bwd_weight_ms:.2f}",
              _err(s.predicted_bwd_weight_ms, s.measured_bwd_weight_ms)]
             if s.measured_bwd_weight_ms is not None else ["", "", ""])
        b_pred, b_meas = ((s.predicted_bwd_input_span_ms, s.measured_bwd_input_ms)
                          if s.measured_bwd_input_ms is not None
                          else (s.predicted_bwd_span_ms, s.measured_bwd_ms))
        stages.add_row(str(s.index), str(s.rank), f"{s.predicted_fwd_span_ms:.2f}",
                       f"{s.measured_fwd_ms:.2f}",
                       _err(s.predicted_fwd_span_ms, s.measured_fwd_ms),
                       f"{b_pred:.2f}", f"{b_meas:.2f}", _err(b_pred, b_meas), *w)
    console.print(stages)
    if all(s.measured_bwd_input_ms is None for s in report.stages):
        console.print("B = full backward (B + W): this schedule does not split them")
    posts = max((s.predicted_post_ms for s in report.stages), default=0.0)
    if posts > 0:
        console.print(f"pred: what each action's span holds; the posts of a stage's sends "
                      f"and receives (up to {posts:.2f} ms per F and per B) are priced beside "
                      f"it, in the step", highlight=False)
    ranks = Table(title="per rank, one step")
    meshed = report.tp_size * report.dp_size > 1
    for col in ("rank", *(("dp", "tp", "step meas") if meshed else ()), "mem pred",
                "mem meas", "mem err", "busy pred", "busy meas", "idle pred", "wait meas",
                "outside meas", "cpu meas", "optimizer"):
        ranks.add_column(col, justify="right")
    for r in report.ranks:
        where = (str(r.dp_rank), str(r.tp_rank), f"{r.measured_step_ms:.1f}") if meshed else ()
        ranks.add_row(str(r.rank), *where, gib(r.predicted_peak_memory_bytes),
                      gib(r.measured_peak_memory_bytes),
                      _err(r.predicted_peak_memory_bytes, r.measured_peak_memory_bytes),
                      f"{r.predicted_busy_ms:.1f}", f"{r.measured_busy_ms:.1f}",
                      f"{r.predicted_idle_ms:.1f}", f"{r.measured_wait_ms:.1f}",
                      "" if r.measured_outside_ms is None else f"{r.measured_outside_ms:.1f}",
                      f"{r.measured_cpu_ms:.1f}", f"{r.measured_optimizer_ms:.1f}")
    console.print(ranks)
    console.print("outside: the rank's step less its actions and p2p waits (the schedule's "
                  "own work: posting sends and receives); predicted inside busy",
                  highlight=False)
    console.print(f"memory measured as: {report.memory_method}", highlight=False)
    console.print(f"step: predicted [bold]{report.predicted_step_ms:.1f} ms[/], measured "
                  f"[bold]{report.measured_step_ms:.1f} ms[/] (spread "
                  f"{100 * report.measured_step_ms_spread:.1f}%), error "
                  f"{_err(report.predicted_step_ms, report.measured_step_ms)}; with the "
                  f"optimizer step (not predicted): {report.measured_train_step_ms:.1f} ms")
    mismatch = report_thread_mismatch(report)
    if mismatch:
        console.print(f"warning: {mismatch}", highlight=False, soft_wrap=True)


def print_drivers(report: RunReport, profile: Profile, console: Console) -> None:
    """One line per stage: the blocks whose measured forward is furthest from the profile's.

    Args:
        report: The run, with its per-block forwards.
        profile: The profile the plan was made from.
    """
    drivers = error_drivers(report, profile)
    if not drivers:
        console.print("no per-block forward in this run report (written before verify "
                      "recorded it)")
        return
    console.print("blocks driving each stage's forward error (ms per microbatch, profiled -> "
                  "measured inside the stage; backward is not split):", highlight=False)
    for s in report.stages:
        rows = ", ".join(f"{e.block} {e.predicted_fwd_ms:.2f} -> {e.measured_fwd_ms:.2f} "
                         f"({e.delta_ms:+.2f})" for e in drivers.get(s.index, ()))
        error = _err(s.predicted_fwd_span_ms, s.measured_fwd_ms)
        console.print(f"  stage {s.index} (F {error}): {rows}", highlight=False,
                      soft_wrap=True)


def _err(predicted: float, measured: float | None) -> str:
    if not measured:
        return ""
    return f"{100 * (predicted - measured) / measured:+.1f}%"
