"""``autopart simulate PLAN``: replay a plan's schedule, draw the timeline (text or
``--png``), write a trace."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from autopart.errors import PlanError
from autopart.jsonio import check_writable
from autopart.schema import Plan
from autopart.simulate import render_timeline, simulate_plan, write_trace
from autopart.simulate.picture import require_matplotlib, save_timeline_png

from ._format import gib


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``simulate`` command."""
    p = sub.add_parser("simulate", help="draw a plan's schedule timeline and write a trace",
                       description="Replay PLAN (from `autopart plan --out`) in the event "
                                   "simulator: per-rank timeline in the terminal, step time, "
                                   "bubble, peak memory, and a Chrome/Perfetto trace.")
    p.add_argument("plan", help="plan JSON written by `autopart plan --out`")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="write the Chrome/Perfetto trace JSON here (open in ui.perfetto.dev)")
    p.add_argument("--width", type=int, default=100, help="timeline width in characters")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="also draw the timeline as a PNG (needs matplotlib: "
                        "pip install 'autopart[plot]')")


def run(args: argparse.Namespace) -> int:
    """Simulate the plan and print the timeline."""
    if args.width < 10:
        raise PlanError(f"--width must be at least 10 characters, got {args.width}")
    for path in (args.trace, args.png):
        if path:
            check_writable(path)
    if args.png:
        require_matplotlib()  # before simulating, not after
    plan = Plan.load(args.plan)
    result = simulate_plan(plan)
    console = Console(width=None if sys.stdout.isatty() else args.width + 20)
    console.print(f"[bold]{plan.model_name or 'plan'}[/]: pp={plan.pp_size} "
                  f"v={plan.virtual_stages} {plan.schedule} m={plan.num_microbatches}")
    console.print(render_timeline(result, width=args.width), highlight=False, markup=False,
                  soft_wrap=True)
    for rank, peak in enumerate(result.rank_peak_memory_bytes):
        console.print(f"  rank {rank}: busy {result.rank_busy_ms[rank]:.2f} ms, "
                      f"idle {result.rank_idle_ms[rank]:.2f} ms, peak memory {gib(peak)}")
    if args.trace:
        names = [f"stage {s.index}: {s.modules[0]}..{s.modules[-1]}" for s in plan.stages]
        write_trace(result, args.trace, stage_names=names)
        console.print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    if args.png:
        title = (f"{plan.model_name or 'plan'}: pp={plan.pp_size} v={plan.virtual_stages} "
                 f"{plan.schedule} m={plan.num_microbatches}, predicted step "
                 f"{result.step_ms:.1f} ms")
        save_timeline_png([(title, result.events)], args.png, num_ranks=plan.pp_size)
        console.print(f"timeline written to {args.png}")
    return 0
