"""Peak memory per rank, predicted vs measured, over models and schedules on 2 CPU ranks.

Profiles three small causal LMs on CPU (``tiny-llama``, ``heavy-head-llama`` and a
GPT-2-like tiny config), plans each at pp=2 under 1F1B, GPipe, interleaved 1F1B
(v=2) and ZBV (v=2), runs every plan for real under ``autopart.verify`` (2 spawned
gloo ranks, one memory step) and prints, per rank, the predicted and measured peak
and the error, with both sides split into static (params + grads + optimizer
state), receive buffers and what the step holds (activations, held outputs and
workspace). Memory is counted from live tensors (``autopart.verify.memory``), so it
does not depend on the machine's load. Target: every rank within 5%.

    python benchmarks/bench_verify_memory.py [--seq-len 64] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig

from autopart.cost.rank import rank_static_bytes, recv_buffer_bytes, stage_costs_of_plan
from autopart.profile import profile_model
from autopart.solve import make_plan
from autopart.verify import RunSettings, verify_plan

SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zbv", 2))
TARGET = 0.05


def _gpt2_tiny(folder: Path) -> str:
    """A GPT-2 config with 4 layers of width 64 (the hub is not needed)."""
    config = AutoConfig.for_model("gpt2", n_layer=4, n_embd=64, n_head=4, vocab_size=2048,
                                  n_positions=256, bos_token_id=0, eos_token_id=0)
    config.save_pretrained(folder)
    return str(folder)


def _predicted_parts(plan, rank: int) -> tuple[int, int, int]:
    """(static, receive buffers, the rest) of the plan's prediction for ``rank``."""
    costs = stage_costs_of_plan(plan)
    stages = plan.ranks[rank].stages
    static = rank_static_bytes(costs, stages)
    buffers = sum(recv_buffer_bytes(costs[s], plan.num_microbatches) for s in stages)
    return static, buffers, plan.ranks[rank].peak_memory_bytes - static - buffers


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny-llama": "tiny-llama", "heavy-head-llama": "heavy-head-llama",
                  "gpt2-tiny": _gpt2_tiny(Path(tmp) / "gpt2-tiny")}
        rows, errors = [], []
        for name, source in models.items():
            profile = profile_model(source, backend="cpu", seq_len=args.seq_len,
                                    num_warmup=1, num_repeats=3)
            for schedule, v in SCHEDULES:
                plan = make_plan(profile, pp_size=2, num_microbatches=args.microbatches,
                                 schedule=schedule, virtual_stages=v)
                report = verify_plan(plan, RunSettings(model=source, steps=1, warmup=1))
                for r in report.ranks:
                    pred, meas = r.predicted_peak_memory_bytes, r.measured_peak_memory_bytes
                    mem = r.memory
                    static, buffers, held = _predicted_parts(plan, r.rank)
                    measured_static = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
                    err = (pred - meas) / meas
                    errors.append(err)
                    rows.append([name, f"{schedule} v={v}", str(r.rank), _mib(pred), _mib(meas),
                                 f"{100 * err:+5.1f}%",
                                 f"{_mib(static)} / {_mib(measured_static)}",
                                 f"{_mib(buffers)} / {_mib(mem.buffer_bytes)}",
                                 f"{_mib(held)} / {_mib(mem.live_peak_bytes)}"])
    head = ["model", "schedule", "rank", "pred MiB", "meas MiB", "err",
            "static pred/meas", "recv buffers pred/meas", "step peak pred/meas"]
    print(f"pp=2, m={args.microbatches}, micro batch 1 x {args.seq_len}, fp32 + AdamW "
          f"(16 B/param); memory: live tensors on CPU")
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    worst = max(errors, key=abs)
    within = sum(abs(e) <= TARGET for e in errors)
    print(f"{within}/{len(errors)} ranks within {100 * TARGET:.0f}%; worst {100 * worst:+.1f}%, "
          f"mean |err| {100 * sum(map(abs, errors)) / len(errors):.1f}%")


if __name__ == "__main__":
    main()
