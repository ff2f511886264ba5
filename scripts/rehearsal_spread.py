"""How much a rehearsal's own spell moves the plans it predicts: one 1F1B run folded in
against two runs minutes apart, pooled (issue 22).

The rehearsal (``autopart.verify.rehearse``) folds the even split's 1F1B run into a CPU
profile. On a shared host a slow spell lasts seconds to minutes, longer than a run's
launches, so one run's stage factors carry its spell into every plan. For each shape of
``timing_sweep.SHAPES`` this script profiles once (bare: flush ``order``, one
neighbour, the cached machine check) and then, ``--reps`` times, does what a rehearsal
does with its runs: the even 1F1B split (``verify_steadily``), the even GPipe split (as
the rehearsal runs it between), the even 1F1B split again. From each repetition it folds
in the first run alone (``single``) and both runs' geometric mean (``pooled``,
``pooled_report``, what the rehearsal folds in), plans the 1F1B split from ``single``,
predicts the same cuts from ``pooled`` and runs that plan.

It prints each repetition and, per shape, how far the predictions of the repetitions lie
apart (highest over lowest - 1: a rehearsal's reproducibility) against how far the plan's
measured steps lie apart, and the error of each against the run.

    python scripts/rehearsal_spread.py --shapes 0,1,3,7 --reps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing_sweep import SHAPES, apart, write_config  # noqa: E402

from autopart.profile import profile_model  # noqa: E402
from autopart.solve import make_plan, plan_again  # noqa: E402
from autopart.verify import (  # noqa: E402
    RunSettings,
    calibrate_profile,
    check_machine,
    load_cached_overhead,
    save_cached_overhead,
    verify_steadily,
)
from autopart.verify.report import pooled_report  # noqa: E402


def main() -> None:
    """Parse the options, run every shape's repetitions, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="0,1,3,7", help="indices into SHAPES")
    parser.add_argument("--reps", type=int, default=3, help="rehearsals per shape")
    parser.add_argument("--json", default=None, help="write every repetition as JSON here")
    args = parser.parse_args()
    if load_cached_overhead("gloo", 1) is None:
        save_cached_overhead(check_machine(num_threads=1))
    rows = []
    with tempfile.TemporaryDirectory(prefix="rehearsal-spread-") as tmp:
        for index in (int(i) for i in args.shapes.split(",")):
            shape = SHAPES[index]
            source = write_config(shape, Path(tmp))
            torch.set_num_threads(1)
            profile = profile_model(source, backend="cpu", seq_len=shape.seq,
                                    micro_batch_size=shape.mbs, cache_flush="order",
                                    neighbours=1)
            profile = dataclasses.replace(profile,
                                          runtime_overhead=load_cached_overhead("gloo", 1))
            settings = RunSettings(model=source, steps=5, warmup=1, threads_per_rank=1)
            even = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b",
                             virtual_stages=1, partition="even")
            gpipe = make_plan(profile, pp_size=2, num_microbatches=8, schedule="gpipe",
                              virtual_stages=1, partition="even")
            for rep in range(args.reps):
                first, _ = verify_steadily(even, settings)
                verify_steadily(gpipe, settings)
                again, _ = verify_steadily(even, settings)
                single = calibrate_profile(profile, first, even)
                pooled = calibrate_profile(profile, pooled_report((first, again)), even)
                plan = make_plan(single, pp_size=2, num_microbatches=4, schedule="1f1b",
                                 virtual_stages=1)
                run, launches = verify_steadily(plan, settings)
                row = {"shape": shape.name, "rep": rep, "first_ms": first.measured_step_ms,
                       "again_ms": again.measured_step_ms,
                       "single_ms": plan.predicted_step_ms,
                       "pooled_ms": plan_again(pooled, plan).predicted_step_ms,
                       "measured_ms": run.measured_step_ms, "launches_ms": launches}
                rows.append(row)
                print(f"{shape.name:>28} rep {rep}: even split {row['first_ms']:.1f} then "
                      f"{row['again_ms']:.1f} ms; plan predicted single "
                      f"{row['single_ms']:.1f} ({_err(row, 'single_ms')}), pooled "
                      f"{row['pooled_ms']:.1f} ({_err(row, 'pooled_ms')}), measured "
                      f"{row['measured_ms']:.1f} ms", flush=True)
    print("\n| shape | predictions apart: single / pooled | measured apart | mean abs error: "
          "single / pooled |\n|---|---|---|---|")
    for name in dict.fromkeys(row["shape"] for row in rows):
        mine = [row for row in rows if row["shape"] == name]
        spread = {key: apart([row[key] for row in mine])
                 for key in ("single_ms", "pooled_ms", "measured_ms")}
        error = {key: statistics.fmean(abs(row[key] / row["measured_ms"] - 1) for row in mine)
                 for key in ("single_ms", "pooled_ms")}
        print(f"| {name} | {100 * spread['single_ms']:.0f}% / {100 * spread['pooled_ms']:.0f}% "
              f"| {100 * spread['measured_ms']:.0f}% | {100 * error['single_ms']:.1f}% / "
              f"{100 * error['pooled_ms']:.1f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _err(row: dict, key: str) -> str:
    return f"{100 * (row[key] / row['measured_ms'] - 1):+.1f}%"


if __name__ == "__main__":
    main()
