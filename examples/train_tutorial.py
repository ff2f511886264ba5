"""The PyTorch pipelining tutorial's script, with autopart choosing the split.

Changes from https://pytorch.org/tutorials/intermediate/pipelining_tutorial.html,
each marked ``# autopart:``: the model is built on the meta device (each rank
materializes only its own blocks), ``auto_pipeline`` replaces the manual or traced
split, the ``PipelineStage`` and the ``ScheduleGPipe``, and ``step`` takes the
same batch on every rank. Without ``--plan``, rank 0 profiles the blocks and
solves for the cuts, the schedule and the microbatch count.

    torchrun --nnodes 1 --nproc_per_node 2 examples/train_tutorial.py --steps 5
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from autopart import PlanOptions, ProfileOptions, auto_pipeline  # autopart: the one import

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tutorial_model import TINY, ModelArgs, Transformer  # noqa: E402 - the tutorial's model

global rank, device, pp_group, stage_index, num_stages


def init_distributed():
    global rank, device, pp_group, stage_index, num_stages
    rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # autopart: explicit

    # This group can be a sub-group in the N-D parallel case
    pp_group = dist.new_group()
    stage_index = rank
    num_stages = world_size


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the pipelining tutorial, split by autopart")
    parser.add_argument("--plan", default="auto", help="plan JSON from `autopart plan`, or auto")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--full-size", action="store_true",
                        help="the tutorial's 512-wide model and 32x500 batch (slow on a CPU)")
    cli = parser.parse_args()
    init_distributed()
    torch.manual_seed(0)  # autopart: the same dummy data on every rank, run to run
    num_microbatches = 4
    model_args = ModelArgs() if cli.full_size else TINY
    with torch.device("meta"):  # autopart: nothing of full size on any rank
        model = Transformer(model_args)

    # Dummy data
    batch, seq = (32, 500) if cli.full_size else (8, 32)
    x = torch.ones(batch, seq, dtype=torch.long)
    y = torch.randint(0, model_args.vocab_size, (batch, seq), dtype=torch.long)

    def tokenwise_loss_fn(outputs, targets):
        loss_fn = nn.CrossEntropyLoss()
        outputs = outputs.view(-1, model_args.vocab_size)
        targets = targets.view(-1)
        return loss_fn(outputs, targets)

    # autopart: instead of manual_model_split / tracer_model_split and ScheduleGPipe
    pipe = auto_pipeline(model, plan=cli.plan, loss_fn=tokenwise_loss_fn, device=device,
                         pp_group=pp_group,
                         profile_options=ProfileOptions(micro_batch_size=batch // num_microbatches,
                                                        seq_len=seq),
                         plan_options=PlanOptions(pp_size=pp_group.size() if pp_group else
                                                  dist.get_world_size(),
                                                  num_microbatches=num_microbatches))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    if pipe.is_last:
        print(pipe.debug_summary(), flush=True)

    for step in range(cli.steps):
        optimizer.zero_grad()
        losses = []
        output = pipe.step(x, target=y, losses=losses)  # autopart: same call on every rank
        optimizer.step()
        if pipe.is_last:
            print(f"step {step}: loss {output.item():.4f} "
                  f"(microbatches {[round(v.item(), 3) for v in losses]})", flush=True)
    dist.destroy_process_group()
