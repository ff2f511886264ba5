"""Benchmark the solvers; run: /work/venv/bin/python benchmarks/bench_solve.py

(a) DP on a 1,000-block Llama-like chain, pp 64, v in {1, 2, 4, 8} (target: all four
    under 1 s), without a memory limit and with one that forces recompute;
(b) ILP on 128 blocks, pp 8, v 2 (interleaved-1f1b) with a memory limit (target:
    optimal under 10 s), CBC and HiGHS; the 40 GiB case is the target, the 24 GiB
    case (memory binds, recompute on) is shown for reference.
Every time is the median of ``--repeats`` runs (default 3; the machine is shared),
each on a freshly built chain; the simulator's in-flight counts and the solver
imports are outside the timings. The DP is compared with the even split on the same
objective in the same run. Ends with one table: case, solver, seconds, status, gap,
target, PASS/FAIL.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from solve_helpers import GIB, MIB, chain_of, llama_like

from autopart.schedules import stage_to_rank
from autopart.simulate import max_in_flight
from autopart.solve import ILPLimits, baseline_split, solve_dp, solve_ilp
from autopart.solve.dp import plan_objective

_DP_TARGET_S = 1.0
_ILP_TARGET_S = 10.0


def run_dp(limit_bytes: int | None, in_flights: dict[int, list[int]], verbose: bool) -> float:
    """Solve pp 64 x v in {1,2,4,8} on a fresh chain; return the total DP seconds."""
    profile = llama_like(997, act_bytes=10 * MIB)
    chain = chain_of(profile)
    pp, m, total = 64, 256, 0.0
    for v, in_flight in in_flights.items():
        num_stages = pp * v
        limits = [None if limit_bytes is None else limit_bytes / v] * num_stages
        weight = v * v * (m - 1)
        start = time.perf_counter()
        sol = solve_dp(chain, num_stages=num_stages, in_flight=in_flight, limits_bytes=limits,
                       weight=weight)
        seconds = time.perf_counter() - start
        total += seconds
        if verbose:
            even = baseline_split("even", profile.blocks, num_stages)
            even_obj, _ = plan_objective(chain, even, [False] * num_stages, weight)
            print(f"  v={v}  stages={num_stages:4d}  dp {seconds * 1e3:7.1f} ms  "
                  f"runs={sol.num_evaluations:2d}  recompute={sum(sol.recompute):3d}  "
                  f"objective {sol.objective_ms:10.1f}  even {even_obj:10.1f}  "
                  f"ratio {even_obj / sol.objective_ms:.3f}")
    return total


def run_ilp(backend: str, limit_bytes: int, in_flight: list[int]):
    """128 blocks, pp 8, v 2, memory-limited; return (seconds, solution)."""
    chain = chain_of(llama_like(125, act_bytes=GIB // 4, head_ms=6.0))
    pp, v, m = 8, 2, 16
    ranks = [stage_to_rank(s, pp, v, "loop") for s in range(pp * v)]
    start = time.perf_counter()
    sol = solve_ilp(chain, stage_ranks=ranks, in_flight=in_flight, num_microbatches=m,
                    limit_bytes=limit_bytes,
                    limits=ILPLimits(backend=backend, time_limit_s=_ILP_TARGET_S))
    return time.perf_counter() - start, sol


def main() -> None:
    """Print the per-v DP detail, then the summary table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import highspy  # noqa: F401  (imports are not solve time)
    import pulp  # noqa: F401

    rows = []
    in_flights = {v: max_in_flight("1f1b" if v == 1 else "interleaved-1f1b", 64, v, 256)
                  for v in (1, 2, 4, 8)}
    print("(a) DP, 1,000 blocks, pp 64, m 256, per v (first run):")
    for label, limit in (("no limit", None), ("6 GiB limit", 6 * GIB)):
        print(f" {label} (even ignores the limit, so ratio < 1 is expected with one):")
        times = [run_dp(limit, in_flights, verbose=i == 0) for i in range(args.repeats)]
        seconds = statistics.median(times)
        rows.append((f"(a) DP 1000 blk pp64 v1-8, {label}", "dp", seconds, "optimal", 0.0,
                     f"< {_DP_TARGET_S:g} s total", seconds < _DP_TARGET_S))
    print("(b) ILP, 128 blocks, pp 8, v 2, m 16 (objective, recompute, of the median run):")
    in_flight = max_in_flight("interleaved-1f1b", 8, 2, 16)
    for limit_gib, tag in ((40, "target"), (24, "memory binds, reference")):
        for backend in ("cbc", "highs"):
            runs = sorted((run_ilp(backend, limit_gib * GIB, in_flight)
                           for _ in range(args.repeats)), key=lambda run: run[0])
            seconds, sol = runs[len(runs) // 2]
            status = "no plan" if sol is None else sol.status
            gap = None if sol is None else sol.gap
            if sol is not None:
                print(f"  {limit_gib} GiB {backend:5s} objective {sol.objective_ms:.3f} ms  "
                      f"recompute={sum(sol.recompute)}  runs: "
                      + " ".join(f"{s:.2f}s/{r.status}" for s, r in runs))
            rows.append((f"(b) ILP 128 blk pp8 v2, {limit_gib} GiB ({tag})", backend, seconds,
                         status, gap, f"< {_ILP_TARGET_S:g} s, optimal",
                         seconds < _ILP_TARGET_S and status == "optimal"))
    _print_table(rows, args.repeats)


def _print_table(rows, repeats: int) -> None:
    print(f"\nsummary (seconds: median of {repeats} runs)")
    header = ("case", "solver", "seconds", "status", "gap", "target", "result")
    cells = [header] + [(case, solver, f"{seconds:.3f}", status,
                         "n/a" if gap is None else f"{gap:.2g}", target,
                         "PASS" if ok else "FAIL")
                        for case, solver, seconds, status, gap, target, ok in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
