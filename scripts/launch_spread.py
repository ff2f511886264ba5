"""How far launches of one plan lie apart on this host, read by the median step, the lowest
step and the lower quartile (issue 22).

A prediction cannot be checked closer than the measurement repeats. On a shared host a
launch's steps move together with spells longer than the launch; if those spells only
added time, the lowest step of each launch would be the host's quiet speed and agree
from launch to launch where the median does not. For each shape of
``timing_sweep.SHAPES`` this script runs the even 1F1B split (pp 2, m 4; the plan comes
from the analytical profile: only the measurement matters here) in ``--launches``
launches of ``verify_plan`` and prints each launch's median, lowest and lower-quartile
step (``RunReport.measured_steps_ms``), then each statistic's spread over the launches
(highest over lowest - 1) and coefficient of variation.

    python scripts/launch_spread.py --shapes 0,3,7 --launches 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing_sweep import SHAPES, apart, write_config  # noqa: E402

from autopart.profile import profile_model  # noqa: E402
from autopart.solve import make_plan  # noqa: E402
from autopart.verify import RunSettings, verify_plan  # noqa: E402


def lower_quartile(values: list[float]) -> float:
    """The 25th percentile (inclusive)."""
    return statistics.quantiles(values, n=4, method="inclusive")[0]


STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median, "lowest": min, "lower quartile": lower_quartile}
"""What each launch's steps are read by."""


def spread(values: list[float]) -> str:
    """Highest over lowest - 1 and the coefficient of variation, as one cell."""
    cv = statistics.pstdev(values) / statistics.fmean(values)
    return f"{100 * apart(values):.0f}% (cv {100 * cv:.0f}%)"


def main() -> None:
    """Parse the options, run every shape's launches, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="0,3,7", help="indices into SHAPES")
    parser.add_argument("--launches", type=int, default=6, help="launches per shape")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per launch")
    parser.add_argument("--json", default=None, help="write every launch's steps here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    table, record = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for index in (int(i) for i in args.shapes.split(",")):
            shape = SHAPES[index]
            source = write_config(shape, Path(tmp))
            profile = profile_model(source, backend="analytical:h100", seq_len=shape.seq,
                                    micro_batch_size=shape.mbs)
            plan = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b",
                             virtual_stages=1, partition="even")
            settings = RunSettings(model=source, steps=args.steps, warmup=2)
            launches = []
            for launch in range(args.launches):
                steps = list(verify_plan(plan, settings).measured_steps_ms)
                launches.append(steps)
                print(f"{shape.name:>30} launch {launch}: " + ", ".join(
                    f"{name} {read(steps):.1f} ms" for name, read in STATISTICS.items()),
                    flush=True)
            table.append([shape.name] + [spread([read(s) for s in launches])
                                         for read in STATISTICS.values()])
            record.append({"shape": shape.name, "launches_steps_ms": launches})
    print(f"\nspread over {args.launches} launches, highest over lowest - 1 (coefficient of "
          f"variation), {args.steps} timed steps each:\n")
    print("| shape | " + " | ".join(STATISTICS) + " |")
    print("|---" * (len(STATISTICS) + 1) + "|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
