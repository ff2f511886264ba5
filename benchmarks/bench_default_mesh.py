"""``autopart plan P --devices N`` with default options, timed as a user runs it.

For the Qwen2.5-7B, Mistral-7B and Llama-3.2-1B shapes (analytical H100 profiles at seq
4096, bf16, written by ``autopart profile NAME --backend analytical:h100 --seq-len 4096
--dtype bfloat16`` with the default granularity), runs ``autopart plan P --devices N
--global-batch-size 256`` for 8 and 64 devices as a subprocess and prints the chosen
mesh, its predicted step and peak, the whole process's wall and CPU seconds, and the load
average it ran under. Target: at most 30 s each (on a quiet machine; CPU seconds are the
figure to read on a busy one).

    python benchmarks/bench_default_mesh.py [--devices 8 64]
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
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            path = Path(tmp) / f"{name}.profile.json"
            subprocess.run(_autopart("profile", name, "--backend", "analytical:h100",
                                     "--seq-len", "4096", "--dtype", "bfloat16", "--out",
                                     str(path)), check=True, capture_output=True)
            for devices in args.devices:
                out = Path(tmp) / f"{name}.{devices}.plan.json"
                load = os.getloadavg()[0]
                wall, cpu, done = _timed(_autopart("plan", str(path), "--devices", str(devices),
                                                   "--global-batch-size", "256", "--out",
                                                   str(out)))
                if done.returncode != 0:
                    rows.append((name, devices, f"exit {done.returncode}: "
                                 f"{done.stderr.strip()[:80]}", "", "", wall, cpu, load))
                    continue
                plan = Plan.load(out)
                mesh = (f"tp{plan.tp_size} pp{plan.pp_size} dp{plan.dp_size} {plan.schedule} "
                        f"v{plan.virtual_stages} m{plan.num_microbatches} "
                        f"zero{plan.zero_stage}")
                peak = max(r.peak_memory_bytes for r in plan.ranks) / 2**30
                rows.append((name, devices, mesh, f"{plan.predicted_step_ms:.0f}",
                             f"{peak:.1f}", wall, cpu, load))
    print(f"{'model':<13} {'dev':>4}  {'mesh':<44} {'step ms':>8} {'peak GiB':>8} "
          f"{'wall s':>7} {'cpu s':>6} {'load':>5}  target")
    for name, devices, mesh, step, peak, wall, cpu, load in rows:
        verdict = "PASS" if wall <= TARGET_S else "FAIL"
        print(f"{name:<13} {devices:>4}  {mesh:<44} {step:>8} {peak:>8} {wall:>7.1f} "
              f"{cpu:>6.1f} {load:>5.2f}  {verdict} (<= {TARGET_S:.0f} s)")


if __name__ == "__main__":
    main()
