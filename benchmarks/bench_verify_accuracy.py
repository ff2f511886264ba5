"""Step-time accuracy on 2 CPU ranks, profiled the way the README tells a user to.

Runs, in one process and one go:

1. the machine check (``autopart calibrate --machine --pp 2``): the pipeline
   runtime's own cost per F, B, send/recv and step, and the local gloo link;
2. for a heavy-head model (``heavy-head-llama``: vocabulary 32768 vs hidden 256) and
   a model with millisecond blocks (a Llama config written here: hidden 128, 8
   layers, vocabulary 8192, micro batch 2 x 64 tokens; layers of 1-2 ms):
   profile at the thread count each rank will get, with the other rank busy
   (``autopart profile MODEL --pp 2``),
   plan pp=2 1F1B with the optimal and the even partition, run both for real
   (``autopart verify``, 2 spawned gloo ranks) and print predicted vs measured step,
   the error, and the measured vs predicted speed-up of the plan over the even split
   (targets: errors and the speed-up within 10%);
3. the heavy-head model profiled with torch's default thread count and verified on
   ranks with ``cores / 2`` threads: the error, and the line that names the mismatch
   and the command that fixes it.

It prints the 1-minute load average before and after; figures taken on a busy
machine are not the model's error. Takes 2-4 minutes on an idle 2-core CPU.

    python benchmarks/bench_verify_accuracy.py [--steps 6] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch

from autopart.profile import profile_model
from autopart.schema import Profile, RuntimeOverhead
from autopart.solve import make_plan
from autopart.verify import RunReport, RunSettings, check_machine, verify_plan
from autopart.verify.report import report_thread_mismatch

SMALL = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192,
         "max_position_embeddings": 256}
"""The millisecond-block model (an HF Llama config)."""
SHAPES = {"heavy-head-llama": {"seq_len": 128, "micro_batch_size": 1},
          "small": {"seq_len": 64, "micro_batch_size": 2}}


def _small_config(folder: str) -> str:
    """Write the millisecond-block model's config.json; return the model source (its path)."""
    from transformers import AutoConfig

    AutoConfig.for_model("llama", **SMALL).save_pretrained(folder)
    return str(Path(folder) / "config.json")


def _profile(model: str, shape: str, threads: int, check: RuntimeOverhead | None,
             neighbours: int) -> Profile:
    """``autopart profile MODEL --pp 2`` (``threads`` = cores / 2, one busy neighbour) or
    with default threads, alone: the machine check attached when it was taken at this
    thread count, as the CLI does."""
    torch.set_num_threads(threads)
    profile = profile_model(model, backend="cpu", neighbours=neighbours, **SHAPES[shape])
    if check is not None and check.num_threads == threads:
        profile = dataclasses.replace(profile, runtime_overhead=check)
    return profile


def _run(model: str, profile: Profile, args: argparse.Namespace,
         rank_threads: int) -> dict[str, RunReport]:
    settings = RunSettings(model=model, steps=args.steps, warmup=args.warmup,
                           threads_per_rank=rank_threads)
    reports = {}
    for partition in ("optimal", "even"):
        plan = make_plan(profile, pp_size=2, num_microbatches=args.microbatches,
                         schedule="1f1b", virtual_stages=1, partition=partition)
        reports[partition] = verify_plan(plan, settings)
        print(f"  {Path(model).parent.name or model} {partition:>7}: cut after "
              f"{plan.pipeline_cuts[0]}", flush=True)
    return reports


def _print_rows(model: str, how: str, reports: dict[str, RunReport]) -> None:
    for name, r in reports.items():
        noisy = sum(1 for rank in r.ranks if rank.measured_cpu_ms < 0.8 * rank.measured_busy_ms)
        print(f"{model:>17} {how:>13} {name:>7}  {r.predicted_step_ms:9.1f}  "
              f"{r.measured_step_ms:9.1f}  {100 * r.step_error:+7.1f}%  "
              f"{100 * r.measured_step_ms_spread:6.1f}%  "
              f"{'descheduled ranks: ' + str(noisy) if noisy else ''}")
    opt, even = reports["optimal"], reports["even"]
    measured = even.measured_step_ms / opt.measured_step_ms
    predicted = even.predicted_step_ms / opt.predicted_step_ms
    print(f"{'':>17} {'':>13} speed-up measured {measured:.3f}x, predicted {predicted:.3f}x "
          f"({100 * (predicted - measured) / measured:+.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    start, load_before = time.perf_counter(), os.getloadavg()
    default_threads = torch.get_num_threads()
    rank_threads = max(1, (os.cpu_count() or 1) // 2)
    check = check_machine(num_threads=rank_threads)
    print(f"machine check ({rank_threads} thread(s)/rank): F +{check.fwd_action_ms:.3f} ms, "
          f"B +{check.bwd_action_ms:.3f} ms, send/recv +{check.p2p_ms:.3f} ms, step "
          f"+{check.step_ms:.3f} ms; link {1e3 * check.link_latency_ms:.0f} us, "
          f"{check.link_bandwidth_bytes_per_s / 1e9:.2f} GB/s", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="ms-llama-") as folder:
        for name, model in (("heavy-head-llama", "heavy-head-llama"),
                            ("small", _small_config(folder))):
            profile = _profile(model, name, rank_threads, check, neighbours=1)
            runs.append((name if name != "small" else "ms-block llama",
                         f"--pp 2 ({rank_threads}t)",
                         _run(model, profile, args, rank_threads)))
    profile = _profile("heavy-head-llama", "heavy-head-llama", default_threads, check,
                       neighbours=0)
    default_run = _run("heavy-head-llama", profile, args, rank_threads)
    runs.append(("heavy-head-llama", f"default ({default_threads}t)", default_run))
    load_after = os.getloadavg()
    print(f"2 ranks x {rank_threads} thread(s), pp=2, 1f1b, m={args.microbatches}, "
          f"{args.steps} timed steps")
    print(f"{'model':>17} {'profiled':>13} {'plan':>7}  {'pred ms':>9}  {'meas ms':>9}  "
          f"{'error':>8}  {'spread':>7}")
    for model, how, reports in runs:
        _print_rows(model, how, reports)
    line = report_thread_mismatch(default_run["optimal"])
    print(f"default-thread profile on {rank_threads}-thread ranks: "
          f"{line or 'no mismatch (the default is already the ranks thread count)'}")
    print(f"load average: before {load_before[0]:.2f}, after {load_after[0]:.2f} (1-minute, "
          f"{os.cpu_count()} cores); {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
