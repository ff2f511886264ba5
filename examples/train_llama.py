"""Train an HF Llama-family model with pipeline parallelism planned by autopart.

Synthetic, padded batches of a learnable pattern (each token is the previous one
plus a fixed stride), AdamW, linear warmup then cosine decay, global grad-norm
clipping across the pipeline, DCP checkpoints every ``--ckpt-every`` steps and
exact resume with ``--resume``. The last pipeline rank prints the loss per step.
A plan with ``tp_size`` or ``dp_size`` above 1 runs on pp x dp x tp ranks: each
data-parallel replica trains on its slice of the batch, and tensor-parallel ranks
split every decoder layer (``autopart plan --devices 4 --tp 2``).

Run on CPU (gloo; nccl is used when CUDA is present):

    torchrun --nproc_per_node=2 examples/train_llama.py --model tiny-llama --plan auto \
        --steps 5 --save-plan plan.json
    torchrun --nproc_per_node=2 examples/train_llama.py --model tiny-llama --plan plan.json \
        --steps 20 --ckpt-dir /tmp/ckpt --ckpt-every 10
    torchrun --nproc_per_node=2 examples/train_llama.py --model tiny-llama --plan plan.json \
        --steps 30 --ckpt-dir /tmp/ckpt --resume /tmp/ckpt/step_20
    torchrun --nproc_per_node=4 examples/train_llama.py --model tiny-llama \
        --plan plan_pp2_tp2.json --steps 8
"""

from __future__ import annotations

import argparse
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from autopart import (
    PlanOptions,
    ProfileOptions,
    auto_pipeline,
    load_checkpoint,
    save_checkpoint,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="preset, HF config path, ...")
    parser.add_argument("--plan", required=True, help="plan JSON path or 'auto'")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4, help="for --plan auto")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    parser.add_argument("--save-plan", default=None, help="write the plan used to this JSON")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="autocast forward to bfloat16")
    return parser.parse_args()


def init_distributed() -> torch.device:
    """Process group from torchrun's environment; this rank's device."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=5))
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def make_batch(step: int, vocab_size: int, batch_size: int, seq_len: int):
    """Right-padded rows of an arithmetic token pattern; the same batch for a step on every rank."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(3, vocab_size, (batch_size, 1), generator=gen)
    stride = 7
    input_ids = (start + stride * torch.arange(seq_len)) % (vocab_size - 3) + 3
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=gen)
    mask = (torch.arange(seq_len) < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(mask == 0, 0)
    labels = input_ids.masked_fill(mask == 0, -100)
    return input_ids, mask, labels


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``--lr`` then cosine decay to a tenth of it (step counts from 1)."""
    if step <= args.warmup_steps:
        return args.lr * step / max(1, args.warmup_steps)
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main() -> None:
    args = parse_args()
    device = init_distributed()
    profile_options = ProfileOptions(micro_batch_size=max(1, args.batch_size // args.microbatches),
                                     seq_len=args.seq_len, num_warmup=1, num_repeats=3)
    plan_options = PlanOptions(pp_size=dist.get_world_size(), num_microbatches=args.microbatches)
    pipe = auto_pipeline(args.model, plan=args.plan, device=device, plan_options=plan_options,
                         profile_options=profile_options,
                         activation_checkpointing="plan" if args.activation_checkpointing
                         else None, autocast_dtype=torch.bfloat16 if args.bf16 else None)
    vocab_size = pipe.config.vocab_size
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    start = 0
    if args.resume:
        start = load_checkpoint(pipe, optimizer, args.resume) or 0
    if args.save_plan and dist.get_rank() == 0:
        pipe.plan.save(args.save_plan)
    groups = pipe.groups
    reports = pipe.is_last and groups.dp_rank == 0 and groups.tp_rank == 0
    if reports:
        print(pipe.debug_summary(), flush=True)
    if args.batch_size % groups.dp_size:
        raise SystemExit(f"--batch-size {args.batch_size} does not split over "
                         f"{groups.dp_size} data-parallel replicas; use a multiple of it")
    rows = slice(groups.dp_rank * args.batch_size // groups.dp_size,
                 (groups.dp_rank + 1) * args.batch_size // groups.dp_size)
    for step in range(start + 1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        batch = make_batch(step, vocab_size, args.batch_size, args.seq_len)
        input_ids, mask, labels = (t[rows] for t in batch)  # this replica's rows
        optimizer.zero_grad()
        loss = pipe.step(input_ids, target=labels, attention_mask=mask)
        grad_norm = pipe.clip_grad_norm_(args.grad_clip)
        optimizer.step()
        if reports:
            print(f"step {step:4d}  loss {loss.item():.4f}  grad_norm {grad_norm.item():.3f}  "
                  f"lr {lr_at(step, args):.2e}", flush=True)
        if args.ckpt_dir and args.ckpt_every and step % args.ckpt_every == 0:
            save_checkpoint(pipe, optimizer, os.path.join(args.ckpt_dir, f"step_{step}"), step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
