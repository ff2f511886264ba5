"""Heavy-head Llama on 2 CPU ranks: the optimal split vs the even split, predicted and measured.

Profiles ``heavy-head-llama`` (vocabulary 32768 vs hidden 256, 8 layers) on CPU
with one thread (as each rank will run), measures the gloo link between two
local ranks (ping-pong: latency and bandwidth) and plans pp=2, 1F1B, a fixed m
with ``partition="optimal"`` and ``partition="even"`` on those link figures. Both
plans then run for real under ``autopart.verify`` (2 spawned gloo ranks, one thread
each). Prints per plan the predicted and measured step with the error, predicted
and measured peak memory per rank with the errors, and the measured speed-up of
the optimal plan over the even one (targets: >= 1.15x, step and memory errors
within 10%); then calibrates the profile on the optimal run and re-predicts the
even plan from it. Run it on an idle machine; it prints the load average it saw.

    python benchmarks/bench_verify_heavy_head.py [--seq-len 128] [--microbatches 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopart.profile import profile_model
from autopart.schema import Profile
from autopart.solve import make_plan
from autopart.verify import RunReport, RunSettings, calibrate_profile, verify_plan
from autopart.verify.machine import round_trips

MODEL = "heavy-head-llama"


def _ping_pong(rank: int, port: int, out: str, boundary_bytes: int) -> None:
    """Rank 0 <-> rank 1: one-way time of a 4-byte message and of 4 MiB / boundary messages."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    results = {}
    for name, numel, reps in (("small", 1, 300), ("boundary", boundary_bytes // 4, 100),
                              ("large", 2**20, 30)):
        times = round_trips(rank, torch.zeros(numel), reps)
        results[name] = (numel * 4, statistics.median(times))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_link(boundary_bytes: int) -> tuple[float, float, dict]:
    """(latency ms, bandwidth bytes/s, raw one-way times) of the local gloo link."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "link.txt")
        mp.spawn(_ping_pong, args=(port, out, boundary_bytes), nprocs=2, join=True)
        raw = json.loads(Path(out).read_text())
    latency = raw["small"][1]
    large_bytes, large_ms = raw["large"]
    bandwidth = large_bytes / max(1e-6, (large_ms - latency) / 1e3)
    return latency, bandwidth, raw


def _row(name: str, report: RunReport) -> list[str]:
    err = 100 * report.step_error
    cells = [name, f"{report.predicted_step_ms:8.1f}", f"{report.measured_step_ms:8.1f}",
             f"{err:+6.1f}%", f"{100 * report.measured_step_ms_spread:5.1f}%"]
    for r in report.ranks:
        pred, meas = r.predicted_peak_memory_bytes, r.measured_peak_memory_bytes
        cells += [f"{pred / 2**20:7.1f}", f"{meas / 2**20:7.1f}",
                  f"{100 * (pred - meas) / meas:+6.1f}%"]
    return cells


def run_args(description: str) -> argparse.Namespace:
    """The command line shared with ``bench_head_split``: shape, m, steps, warm-up."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args()


def profile_for_two_ranks(model: str, args: argparse.Namespace) -> Profile:
    """``model`` profiled as ``autopart profile MODEL --pp 2`` does on this 2-core
    machine: one thread, one busy neighbour."""
    torch.set_num_threads(1)
    return profile_model(model, backend="cpu", micro_batch_size=args.micro_batch_size,
                         seq_len=args.seq_len, num_warmup=3, num_repeats=10, neighbours=1)


def main() -> None:
    args = run_args(__doc__.split("\n\n")[0])
    load_before = os.getloadavg()
    profile = profile_for_two_ranks(MODEL, args)
    boundary = max(b.output_bytes for b in profile.blocks if b.kind == "decoder_layer")
    latency_ms, bandwidth, raw = measure_link(boundary)
    print(f"gloo link (localhost): latency {latency_ms * 1e3:.0f} us, bandwidth "
          f"{bandwidth / 1e9:.2f} GB/s; one-way {boundary / 1024:.0f} KiB boundary "
          f"{raw['boundary'][1] * 1e3:.0f} us")
    plans = {name: make_plan(profile, pp_size=2, num_microbatches=args.microbatches,
                             schedule="1f1b", virtual_stages=1, partition=name,
                             link_latency_ms=latency_ms, link_bandwidth_bytes_per_s=bandwidth)
             for name in ("optimal", "even")}
    settings = RunSettings(model=MODEL, steps=args.steps, warmup=args.warmup, threads_per_rank=1)
    reports = {}
    for name, plan in plans.items():
        cut = plan.pipeline_cuts[0]
        print(f"{name:>8} plan: cut after {cut}, predicted {plan.predicted_step_ms:.1f} ms")
        reports[name] = verify_plan(plan, settings)
    load_after = os.getloadavg()
    _print_table(reports, args)
    speedup = reports["even"].measured_step_ms / reports["optimal"].measured_step_ms
    predicted = reports["even"].predicted_step_ms / reports["optimal"].predicted_step_ms
    print(f"measured speed-up optimal / even: {speedup:.3f}x (predicted {predicted:.3f}x, "
          f"target >= 1.15x)")
    _cross_check(profile, plans, reports, latency_ms, bandwidth, args)
    print(f"load average: before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"(1-minute; 2 ranks x 1 thread)")


def _cross_check(profile, plans, reports, latency_ms, bandwidth, args) -> None:
    """Calibrate on the optimal run, re-predict the even plan (a run the calibration never saw)."""
    calibrated = calibrate_profile(profile, reports["optimal"], plans["optimal"])
    even = make_plan(calibrated, pp_size=2, num_microbatches=args.microbatches, schedule="1f1b",
                     virtual_stages=1, partition="even", link_latency_ms=latency_ms,
                     link_bandwidth_bytes_per_s=bandwidth)
    assert even.pipeline_cuts == plans["even"].pipeline_cuts
    measured = reports["even"].measured_step_ms
    print(f"even plan predicted from the profile calibrated on the optimal run: "
          f"{even.predicted_step_ms:.1f} ms vs measured {measured:.1f} ms "
          f"({100 * (even.predicted_step_ms - measured) / measured:+.1f}%)")


def _print_table(reports: dict[str, RunReport], args: argparse.Namespace) -> None:
    print(f"{MODEL}, pp=2, 1f1b, m={args.microbatches}, micro batch {args.micro_batch_size} x "
          f"{args.seq_len}, {args.steps} timed steps; memory: {reports['optimal'].memory_method}")
    print_reports(reports)


def print_reports(reports: dict[str, RunReport], with_waits: bool = True) -> None:
    """One row per plan (step and per-rank memory, predicted vs measured), then each
    plan's per-stage F and B (and with ``with_waits`` each rank's busy / wait / CPU)."""
    head = ["plan", "pred ms", "meas ms", "err", "spread"]
    for r in range(2):
        head += [f"r{r} pred MiB", f"r{r} meas MiB", f"r{r} err"]
    rows = [head] + [_row(name, rep) for name, rep in reports.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    for name, rep in reports.items():
        stages = ", ".join(f"s{s.index} F {s.measured_fwd_ms:.1f}/{s.predicted_fwd_ms:.1f} "
                           f"B {s.measured_bwd_ms:.1f}/{s.predicted_bwd_ms:.1f}"
                           for s in rep.stages)
        waits = "; " + ", ".join(
            f"r{r.rank} busy {r.measured_busy_ms:.0f} wait {r.measured_wait_ms:.0f} "
            f"cpu {r.measured_cpu_ms:.0f} ms" for r in rep.ranks) if with_waits else ""
        print(f"  {name}: measured/predicted ms per microbatch: {stages}{waits}")


if __name__ == "__main__":
    main()
