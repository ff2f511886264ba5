"""Pipeline a custom (non-HF) model with autopart: an ``nn.Sequential`` of MLP blocks.

The model is built on the meta device; each rank materializes only its own
blocks. ``--plan auto`` profiles the blocks on rank 0 and solves for the cuts.
Regression onto a fixed random target function; the last rank prints the loss.

    torchrun --nproc_per_node=2 examples/train_custom.py --steps 20
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from autopart import PlanOptions, ProfileOptions, auto_pipeline

WIDTH, SEQ = 64, 16


def make_model(num_blocks: int) -> nn.Sequential:
    """Residual-free MLP blocks (LayerNorm, Linear, GELU), then a linear readout."""
    blocks = [nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU())
              for _ in range(num_blocks)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="auto", help="plan JSON path or 'auto'")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))

    with torch.device("meta"):
        model = make_model(args.blocks)
    profile_options = ProfileOptions(micro_batch_size=args.batch_size // args.microbatches,
                                     seq_len=SEQ, num_warmup=1, num_repeats=3)
    plan_options = PlanOptions(pp_size=dist.get_world_size(), num_microbatches=args.microbatches)
    pipe = auto_pipeline(model, plan=args.plan, loss_fn=nn.functional.mse_loss, device="cpu",
                         plan_options=plan_options, profile_options=profile_options)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    teacher = torch.Generator().manual_seed(0)
    projection = torch.randn(WIDTH, 1, generator=teacher) / WIDTH**0.5
    if pipe.is_last:
        print(pipe.debug_summary(), flush=True)
    for step in range(1, args.steps + 1):
        gen = torch.Generator().manual_seed(step)  # the same batch on every rank
        x = torch.randn(args.batch_size, SEQ, WIDTH, generator=gen)
        y = torch.tanh(x @ projection)
        optimizer.zero_grad()
        loss = pipe.step(x, target=y)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        if pipe.is_last:
            print(f"step {step:3d}  loss {loss.item():.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
