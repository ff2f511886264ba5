"""``autopart calibrate``: fold a verified run into a profile, or check this machine once.

``autopart calibrate PROFILE RUN.json --out OUT`` scales every block of each stage
by that stage's measured / predicted F, B and W, and prices each send or receive as
the run measured it (``autopart.verify.calibrate_profile``), and writes the calibrated
profile; the next ``autopart plan`` on it plans with the
measured times. Several runs of one plan (``RUN1.json RUN2.json ...``) are folded in as
one, each stage's times and the step their geometric mean (``pooled_report``).
``autopart calibrate --machine [--threads N | --pp N]`` measures the
pipeline runtime's own cost and the local link once (``autopart.verify.check_machine``)
and caches it; ``autopart profile`` records it in every profile it takes here.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from autopart.errors import AutopartError
from autopart.jsonio import check_writable
from autopart.schema import Plan, Profile
from autopart.verify import RunReport, calibrate_profile, check_machine, save_cached_overhead
from autopart.verify.report import pooled_report


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``calibrate`` command."""
    p = sub.add_parser("calibrate", help="fold measured stage times into a profile, or check "
                                         "this machine's pipeline runtime once",
                       description="Scale the block times of PROFILE by the measured / "
                                   "predicted stage times of a run report written by "
                                   "`autopart verify --json`; or, with --machine, measure the "
                                   "pipeline runtime's own cost per action and step and the "
                                   "link between two local ranks, and cache it.")
    p.add_argument("profile", metavar="PROFILE", nargs="?",
                   help="profile the plan was made from")
    p.add_argument("report", metavar="RUN_JSON", nargs="*",
                   help="run report of `autopart verify --json`; several runs of the same "
                        "plan (e.g. minutes apart on a shared machine) are folded in as one, "
                        "each stage's times their geometric mean")
    p.add_argument("--plan", default=None,
                   help="the plan that was verified (optional: checked against the report)")
    p.add_argument("--out", default=None, metavar="OUT", help="calibrated profile to write")
    p.add_argument("--machine", action="store_true",
                   help="run the one-off machine check (empty pipeline stages on 2 local "
                        "ranks) and cache it under ~/.cache/autopart")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="with --machine: torch threads per rank (default: cores / --pp)")
    p.add_argument("--pp", type=int, default=2, metavar="N",
                   help="with --machine: ranks this machine will host (default 2)")


def run(args: argparse.Namespace) -> int:
    """Calibrate and write the profile (print the factors), or run the machine check."""
    if args.machine:
        return _run_machine(args)
    if not (args.profile and args.report and args.out):
        raise AutopartError("calibrate needs PROFILE RUN_JSON --out OUT, or --machine")
    check_writable(args.out)
    profile = Profile.load(args.profile)
    runs = tuple(RunReport.load(path) for path in args.report)
    for path, run in zip(args.report[1:], runs[1:]):
        if run.plan_digest != runs[0].plan_digest:
            raise AutopartError(f"{path} is a run of another plan than {args.report[0]}: "
                                f"several RUN_JSONs must be runs of one plan; calibrate from "
                                f"one plan's runs at a time")
    calibrated = calibrate_profile(profile, pooled_report(runs),
                                   Plan.load(args.plan) if args.plan else None,
                                   source=", ".join(args.report))
    calibrated.save(args.out)
    console = Console()
    for f in calibrated.calibration["factors"]:
        console.print(f"stage {f['stage']} ({f['first_block']} .. {f['last_block']}): "
                      f"F x{f['fwd']:.3f}, B x{f['bwd_input']:.3f}, W x{f['bwd_weight']:.3f}",
                      highlight=False)
    post = calibrated.calibration.get("post")
    if post:
        how = (f"at which the plan predicts {post['predicted_step_ms']:.1f} ms against the "
               f"run's {post['run_step_ms']:.1f} ms" if "run_step_ms" in post else
               "the run's time outside its actions and waits (pass --plan to fit the step)")
        latency = post.get("link_latency_ms")
        console.print(f"per send or receive posted ({post['field']}): {post['before_ms']:.3f} "
                      f"-> {post['after_ms']:.3f} ms, {how}" + (
                          f"; link latency {latency[0]:.3f} -> {latency[1]:.3f} ms"
                          if latency else ""), highlight=False)
    console.print(f"calibrated profile written to {args.out}")
    return 0


def _run_machine(args: argparse.Namespace) -> int:
    if args.profile or args.report:
        raise AutopartError("--machine takes no PROFILE or RUN_JSON; run it alone")
    if args.pp < 1:
        raise AutopartError(f"--pp must be >= 1, got {args.pp}")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.pp)
    overhead = check_machine(num_threads=threads)
    path = save_cached_overhead(overhead)
    console = Console()
    console.print(
        f"pipeline runtime on {overhead.hostname} ({overhead.backend}, {threads} thread(s)/rank, "
        f"load average {overhead.load_average:.2f}): per F {overhead.fwd_action_ms:.3f} ms, "
        f"per B {overhead.bwd_action_ms:.3f} ms, per send/recv {overhead.p2p_ms:.3f} ms, "
        f"per step {overhead.step_ms:.3f} ms; under the multi-stage schedules' runtime per "
        f"send/recv {overhead.runtime_p2p_ms:.3f} ms; link latency "
        f"{1e3 * overhead.link_latency_ms:.0f} us, bandwidth "
        f"{overhead.link_bandwidth_bytes_per_s / 1e9:.2f} GB/s; gradient all-reduce "
        f"{overhead.allreduce_latency_ms:.2f} ms + "
        f"{overhead.allreduce_bandwidth_bytes_per_s / 1e9:.2f} GB/s", highlight=False,
        soft_wrap=True)
    console.print(f"machine check written to {path}; `autopart profile` records it in the "
                  f"profiles it takes at {threads} thread(s)", highlight=False, soft_wrap=True)
    return 0
