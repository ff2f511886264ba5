"""``autopart calibrate PROFILE RUN.json --out OUT``: fold a verified run into a profile.

Scales every block of each stage by that stage's measured / predicted F, B and W
(``autopart.verify.calibrate_profile``) and writes the calibrated profile; the
next ``autopart plan`` on it plans with the measured times.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from autopart.jsonio import check_writable
from autopart.schema import Plan, Profile
from autopart.verify import RunReport, calibrate_profile


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``calibrate`` command."""
    p = sub.add_parser("calibrate", help="fold measured stage times into a profile",
                       description="Scale the block times of PROFILE by the measured / "
                                   "predicted stage times of a run report written by "
                                   "`autopart verify --json`.")
    p.add_argument("profile", metavar="PROFILE", help="profile the plan was made from")
    p.add_argument("report", metavar="RUN_JSON", help="run report of `autopart verify --json`")
    p.add_argument("--plan", default=None,
                   help="the plan that was verified (optional: checked against the report)")
    p.add_argument("--out", required=True, metavar="OUT", help="calibrated profile to write")


def run(args: argparse.Namespace) -> int:
    """Calibrate and write the profile; print the factors."""
    check_writable(args.out)
    profile = Profile.load(args.profile)
    report = RunReport.load(args.report)
    calibrated = calibrate_profile(profile, report, Plan.load(args.plan) if args.plan else None,
                                   source=args.report)
    calibrated.save(args.out)
    console = Console()
    for f in calibrated.calibration["factors"]:
        console.print(f"stage {f['stage']} ({f['first_block']} .. {f['last_block']}): "
                      f"F x{f['fwd']:.3f}, B x{f['bwd_input']:.3f}, W x{f['bwd_weight']:.3f}",
                      highlight=False)
    console.print(f"calibrated profile written to {args.out}")
    return 0
