"""Overhead of autopart's runtime over a hand-written torch.distributed.pipelining script.

Same Llama model, same cuts, same schedule, same batch, same weights on 2 gloo ranks
(CPU, one thread each). The hand-written side builds its ``PipelineStage`` by hand
on the same block modules; autopart's side is ``auto_pipeline(...).step``. Steps
alternate between the two (barrier-fenced; a step's time is the slowest rank's);
prints the median of N steps of each, the ratio of the medians and the median ratio
of back-to-back pairs (robust to load drift on a shared machine; target: <= 1.03).

    python benchmarks/bench_runtime_overhead.py [--steps 30] [--schedule 1f1b]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from transformers import LlamaConfig
from transformers.masking_utils import create_causal_mask

from autopart.intake import discover_blocks
from autopart.intake.hf import causal_lm_loss
from autopart.intake.sources import build_hf_model
from autopart.intake.storage import empty_on
from autopart.runtime import auto_pipeline
from autopart.schedules import SCHEDULES, stage_to_rank
from autopart.schema import Plan, RankPlan, StagePlan, TrainingSetup

CONFIG = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
          "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
          "max_position_embeddings": 512}
BATCH, SEQ, NUM_MB = 8, 128, 4


class ManualStage(nn.Module):
    """What one writes by hand: embedding / some decoder layers / norm + head."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.embed = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layer_ids)
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        rope = self.rotary(h, pos)
        mask = create_causal_mask(config=self.config, inputs_embeds=h,
                                  attention_mask=attention_mask, past_key_values=None,
                                  position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        return self.head(self.norm(h)) if self.head is not None else h


def _plan(chain, schedule: str, counts: list[int]) -> Plan:
    style, pp = SCHEDULES[schedule].style, 2
    stages, start = [], 0
    for idx, count in enumerate(counts):
        stages.append(StagePlan(index=idx, rank=stage_to_rank(idx, pp, len(counts) // pp, style),
                                modules=tuple(chain.names[start:start + count]), fwd_ms=0.0,
                                bwd_ms=0.0, param_count=0))
        start += count
    ranks = tuple(RankPlan(rank=r, stages=tuple(s.index for s in stages if s.rank == r),
                           peak_memory_bytes=0, busy_ms=0.0) for r in range(pp))
    return Plan(profile_fingerprint=chain.fingerprint, pp_size=pp,
                virtual_stages=len(counts) // pp, schedule=schedule, num_microbatches=NUM_MB,
                pipeline_cuts=tuple(s.modules[-1] for s in stages[:-1]), stages=tuple(stages),
                ranks=ranks, predicted_step_ms=0.0, bubble_fraction=0.0,
                setup=TrainingSetup(pp_size=pp, num_microbatches=NUM_MB))


def _manual(plan: Plan, state: dict, rank: int, num_tokens: list[int]):
    model = build_hf_model(LlamaConfig(**CONFIG))
    empty_on(model, "cpu")
    model.load_state_dict(state)
    pipe_stages = []
    for stage in plan.stages_of_rank(rank):
        ids = [int(m.rsplit(".", 1)[1]) for m in stage.modules if m.startswith("model.layers.")]
        module = ManualStage(model, ids, "model.embed_tokens" in stage.modules,
                             "lm_head" in stage.modules)
        pipe_stages.append(PipelineStage(module, stage.index, len(plan.stages),
                                         torch.device("cpu")))
    cls = getattr(torch_schedules, SCHEDULES[plan.schedule].torch_class)

    def loss_fn(logits, labels):
        return causal_lm_loss(logits, labels, num_tokens=num_tokens[0])

    stages_arg = pipe_stages if SCHEDULES[plan.schedule].multi_stage else pipe_stages[0]
    schedule = cls(stages_arg, n_microbatches=NUM_MB, loss_fn=loss_fn, scale_grads=False)
    is_first = any(s.index == 0 for s in plan.stages_of_rank(rank))
    is_last = any(s.index == len(plan.stages) - 1 for s in plan.stages_of_rank(rank))
    params = [p for s in pipe_stages for p in s.submod.parameters()]

    def step(input_ids, mask, labels):
        for p in params:
            p.grad = None
        num_tokens[0] = int((labels[:, 1:] != -100).sum())
        schedule.step(*((input_ids,) if is_first else ()), attention_mask=mask,
                      target=labels if is_last else None, losses=[], return_outputs=False)
    return step


def _timed(fn, *args) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() * 1e3


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    ref = build_hf_model(LlamaConfig(**CONFIG))
    empty_on(ref, "cpu")
    for module in ref.modules():
        ref._init_weights(module)
    state = ref.state_dict()
    plan = _plan(discover_blocks(build_hf_model(LlamaConfig(**CONFIG))), args.schedule,
                 args.counts)
    pipe = auto_pipeline(build_hf_model(LlamaConfig(**CONFIG)), plan=plan, device="cpu")
    pipe.load_state_dict(state)
    manual = _manual(plan, state, rank, [1])
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[::2, SEQ * 3 // 4:] = 0
    labels = input_ids.masked_fill(mask == 0, -100)

    def autopart_step(ids, m, lab):
        for p in pipe.parameters():
            p.grad = None
        pipe.step(ids, target=lab, attention_mask=m)

    times: dict[str, list[float]] = {"hand-written torch": [], "autopart": []}
    for i in range(args.warmup + args.steps):
        order = [("autopart", autopart_step), ("hand-written torch", manual)]
        for name, fn in order if i % 2 else order[::-1]:
            ms = _timed(fn, input_ids, mask, labels)
            if i >= args.warmup:
                times[name].append(ms)
    if rank == 0:
        _report(times, args)
    dist.destroy_process_group()


def _report(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"schedule {args.schedule}, 2 ranks (gloo, CPU, 1 thread each), stages {args.counts}, "
          f"batch {BATCH}x{SEQ}, {NUM_MB} microbatches, {args.steps} timed steps each")
    print(f"{'runtime':<20} {'median ms':>10} {'p25 ms':>8} {'p75 ms':>8}")
    for name, values in times.items():
        q = statistics.quantiles(values, n=4)
        print(f"{name:<20} {med[name]:>10.1f} {q[0]:>8.1f} {q[2]:>8.1f}")
    ratio = med["autopart"] / med["hand-written torch"]
    paired = statistics.median(a / b for a, b in zip(times["autopart"],
                                                    times["hand-written torch"]))
    print(f"ratio autopart / hand-written: {ratio:.3f} of medians, {paired:.3f} median of "
          f"back-to-back pairs (target <= 1.03)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--counts", type=int, nargs="+", default=[4, 5],
                        help="blocks per stage (9 blocks: embedding, 6 layers, norm, head)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
