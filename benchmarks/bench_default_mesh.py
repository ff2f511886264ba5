"""``autopart plan P --devices N`` with default options, timed as a user runs it.

For the Qwen2.5-7B, Mistral-7B and Llama-3.2-1B shapes (analytical H100 profiles at seq
4096, bf16, written by ``autopart profile NAME --backend analytical:h100 --seq-len 4096
--dtype bfloat16`` with the default granularity), runs ``autopart plan P --devices N
--global-batch-size B`` as a subprocess for 8 and 64 devices at a global batch of 256,
and 32 devices at 1024 (each replica then runs 128-1024 microbatches: the schedule
search simulates every candidate at that count), and prints the chosen mesh, its
predicted step and peak, the whole process's wall and CPU seconds, and the load average
it ran under. Target: at most 30 s each (on a quiet machine; CPU seconds are the figure
to read on a busy one).

    python benchmarks/bench_default_mesh.py [--runs 8:256 64:256 32:1024]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autopart.schema import Plan

MODELS = ("qwen2.5-7b", "mistral-7b", "llama-3.2-1b")
TARGET_S = 30.0


def _autopart(*args: str) -> list[str]:
    return [sys.executable, "-m", "autopart", *args]


def _timed(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall and CPU (user + system) seconds of one subprocess."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done


def main() -> None:
    """Profile each shape, plan each device count, print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["8:256", "64:256", "32:1024"],
                        metavar="DEVICES:BATCH", help="device counts and global batch sizes")
    args = parser.parse_args()
    runs = [tuple(int(x) for x in run.split(":")) for run in args.runs]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            path = Path(tmp) / f"{name}.profile.json"
            subprocess.run(_autopart("profile", name, "--backend", "analytical:h100",
                                     "--seq-len", "4096", "--dtype", "bfloat16", "--out",
                                     str(path)), check=True, capture_output=True)
            for devices, batch in runs:
                out = Path(tmp) / f"{name}.{devices}.{batch}.plan.json"
                load = os.getloadavg()[0]
                wall, cpu, done = _timed(_autopart("plan", str(path), "--devices", str(devices),
                                                   "--global-batch-size", str(batch), "--out",
                                                   str(out)))
                if done.returncode != 0:
                    rows.append((name, devices, batch, f"exit {done.returncode}: "
                                 f"{done.stderr.strip()[:80]}", "", "", wall, cpu, load))
                    continue
                plan = Plan.load(out)
                mesh = (f"tp{plan.tp_size} pp{plan.pp_size} dp{plan.dp_size} {plan.schedule} "
                        f"v{plan.virtual_stages} m{plan.num_microbatches} "
                        f"zero{plan.zero_stage}")
                peak = max(r.peak_memory_bytes for r in plan.ranks) / 2**30
                rows.append((name, devices, batch, mesh, f"{plan.predicted_step_ms:.0f}",
                             f"{peak:.1f}", wall, cpu, load))
    print(f"{'model':<13} {'dev':>4} {'batch':>5}  {'mesh':<46} {'step ms':>8} "
          f"{'peak GiB':>8} {'wall s':>7} {'cpu s':>6} {'load':>5}  target")
    for name, devices, batch, mesh, step, peak, wall, cpu, load in rows:
        verdict = "PASS" if wall <= TARGET_S else "FAIL"
        print(f"{name:<13} {devices:>4} {batch:>5}  {mesh:<46} {step:>8} {peak:>8} "
              f"{wall:>7.1f} {cpu:>6.1f} {load:>5.2f}  {verdict} (<= {TARGET_S:.0f} s)")


if __name__ == "__main__":
    main()
