"""Seeded random ``autopart plan`` cases on tiny shapes of the served families.

    python scripts/plan_fuzz.py --cases 200 --seed 1 [--train 5]

Each case must end in a plan or in one refusal line (``tests/plan_fuzz.py`` says what is
drawn); ``--train N`` also trains the first N plans that run on 2 or 4 gloo ranks on
this CPU against the unpipelined model. Prints every failure with its command line, the
counts, and exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from plan_fuzz import cases, run_plan, train_worker, trainable  # noqa: E402
from runtime_helpers import check_exact, run_ranks  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train", type=int, default=0, metavar="N")
    args = parser.parse_args()
    counts: collections.Counter = collections.Counter()
    failures, trained = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for case, path in cases(args.seed, args.cases, folder):
            outcome = run_plan(case, path, folder)
            counts[outcome.result] += 1
            print(f"{case.index:4d} {outcome.result:8s} {case.family:10s} "
                  f"{' '.join(case.argv)}", flush=True)
            if outcome.result == "failed":
                failures.append(f"{case.family} {case.shape} {' '.join(case.argv)}\n    "
                                f"{outcome.message}")
            elif trained < args.train and trainable(outcome):
                from autopart.schema import Plan

                world = Plan.load(outcome.plan_path).pp_size
                (folder / f"run{case.index}").mkdir()
                try:
                    check_exact(run_ranks(train_worker, world, folder / f"run{case.index}",
                                          case, str(outcome.plan_path)), {"plan": None}, 1e-5)
                    counts["trained exactly"] += 1
                except Exception as exc:  # noqa: BLE001 - a failed run is a finding
                    failures.append(f"not exact: {case.family} {' '.join(case.argv)}: "
                                    f"{str(exc).strip()[-300:]}")
                trained += 1
    for failure in failures:
        print(failure)
    print(f"plan fuzz, seed {args.seed}: {args.cases} cases, {dict(counts)}, "
          f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
