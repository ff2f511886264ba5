"""Benchmark the solvers; run: /work/venv/bin/python benchmarks/bench_solve.py

(a) DP on a 1,000-block Llama-like chain, pp 64, v in {1, 2, 4, 8} (target: all four
    under 1 s), without a memory limit and with one that forces recompute;
(b) ILP on 128 blocks, pp 8, v 2 (interleaved-1f1b) with a memory limit (target:
    optimal under 10 s), CBC and HiGHS.
The DP is compared with the even split on the same objective in the same run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from solve_helpers import GIB, MIB, chain_of, llama_like

from autopart.schedules import stage_to_rank
from autopart.simulate import max_in_flight
from autopart.solve import baseline_split, solve_dp, solve_ilp
from autopart.solve.dp import plan_objective


def bench_dp(limit_bytes: int | None) -> float:
    """Solve pp 64 x v in {1,2,4,8}; print a row per v; return the total DP seconds."""
    profile = llama_like(997, act_bytes=10 * MIB)
    chain = chain_of(profile)
    pp, m, total = 64, 256, 0.0
    for v in (1, 2, 4, 8):
        schedule = "1f1b" if v == 1 else "interleaved-1f1b"
        in_flight = max_in_flight(schedule, pp, v, m)  # simulator time, not DP time
        num_stages = pp * v
        limits = [None if limit_bytes is None else limit_bytes / v] * num_stages
        weight = v * v * (m - 1)
        start = time.perf_counter()
        sol = solve_dp(chain, num_stages=num_stages, in_flight=in_flight, limits_bytes=limits,
                       weight=weight)
        seconds = time.perf_counter() - start
        total += seconds
        even = baseline_split("even", profile.blocks, num_stages)
        even_obj, _ = plan_objective(chain, even, [False] * num_stages, weight)
        print(f"  v={v}  stages={num_stages:4d}  dp {seconds * 1e3:7.1f} ms  "
              f"runs={sol.num_evaluations:2d}  recompute={sum(sol.recompute):3d}  "
              f"objective {sol.objective_ms:10.1f}  even {even_obj:10.1f}  "
              f"ratio {even_obj / sol.objective_ms:.3f}")
    return total


def bench_ilp(backend: str) -> None:
    """128 blocks, pp 8, v 2, memory-limited; print time, status, gap."""
    profile = llama_like(125, act_bytes=GIB // 4, head_ms=6.0)
    chain = chain_of(profile)
    pp, v, m = 8, 2, 16
    ranks = [stage_to_rank(s, pp, v, "loop") for s in range(pp * v)]
    in_flight = max_in_flight("interleaved-1f1b", pp, v, m)
    limit = 40 * GIB
    start = time.perf_counter()
    sol = solve_ilp(chain, stage_ranks=ranks, in_flight=in_flight, num_microbatches=m,
                    limit_bytes=limit, backend=backend, time_limit_s=10)
    seconds = time.perf_counter() - start
    if sol is None:
        print(f"  {backend:5s} {seconds:6.2f} s  no plan fits")
        return
    print(f"  {backend:5s} {seconds:6.2f} s  status={sol.status}  gap={sol.gap}  "
          f"objective {sol.objective_ms:.1f} ms  recompute={sum(sol.recompute)}")


def main() -> None:
    """Print the tables."""
    print("(a) DP, 1,000 blocks, pp 64, m 256 (target: total < 1 s)")
    for label, limit in (("no memory limit", None),
                         ("6 GiB limit (binds; even ignores it, so ratio < 1 is expected)",
                          6 * GIB)):
        print(f" {label}:")
        total = bench_dp(limit)
        print(f"  total {total:.3f} s")
    print("(b) ILP, 128 blocks, pp 8, v 2, m 16, 40 GiB limit (target: optimal < 10 s)")
    for backend in ("cbc", "highs"):
        bench_ilp(backend)


if __name__ == "__main__":
    main()
