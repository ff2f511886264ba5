"""Helpers for the runtime tests: contiguous plans from block counts, gloo workers, references."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopart.intake import BlockChain
from autopart.schedules import SCHEDULES, stage_to_rank
from autopart.schema import Part, Plan, RankPlan, StagePlan, TrainingSetup
from autopart.schema.parts import derived_name

Planned = list[tuple[str, tuple[Part, ...]]]
"""A plan's blocks in order: each name with its parts."""


def planned_blocks(chain: BlockChain, *, units: dict[str, int] | None = None,
                   vocab: int = 0) -> Planned:
    """The chain's blocks with the modules in ``units`` cut into that many parts along
    ``units`` (slices of a half's module) and the head into ``vocab`` parts (0: whole)."""
    out: Planned = []
    for block in chain.blocks:
        module = next((m for m in units or {} if m in block.fqns), None)
        count, axis = (units[module], "units") if module else (vocab, "vocab")
        if module is None:
            module = block.name
        if count and (axis == "units" or block is chain.blocks[-1]):
            out += [(derived_name(module, axis, i, count),
                     (*block.parts, Part(module=module, axis=axis, index=i, count=count)))
                    for i in range(count)]
        else:
            out.append((block.name, block.parts))
    return out

PG_TIMEOUT_S = 90


def make_stage_plan(chain: BlockChain, counts: list[int], *, schedule: str, pp_size: int,
                    num_microbatches: int, recompute: tuple[int, ...] = (),
                    blocks: Planned | None = None) -> Plan:
    """A plan with contiguous stages of ``counts`` blocks each, ranks from ``stage_to_rank``.

    ``blocks`` (``planned_blocks``) replaces the chain's blocks (e.g. with the head's
    vocabulary parts or a half's slices); the plan's level is the chain's (``slice`` when
    a half is cut by units)."""
    blocks = blocks if blocks is not None else [(b.name, b.parts) for b in chain.blocks]
    names = [name for name, _ in blocks]
    sliced = any(p and p[-1].axis == "units" for _, p in blocks)
    assert sum(counts) == len(names), (counts, len(names))
    assert len(counts) % pp_size == 0, (counts, pp_size)
    virtual = len(counts) // pp_size
    style = SCHEDULES[schedule].style
    stages, start = [], 0
    for idx, count in enumerate(counts):
        stages.append(StagePlan(
            index=idx, rank=stage_to_rank(idx, pp_size, virtual, style),
            modules=tuple(names[start:start + count]), fwd_ms=1.0, bwd_ms=2.0, param_count=0,
            first_block_idx=start, last_block_idx=start + count - 1,
            recompute=idx in recompute))
        start += count
    ranks = tuple(RankPlan(rank=r, stages=tuple(s.index for s in stages if s.rank == r),
                           peak_memory_bytes=0, busy_ms=0.0) for r in range(pp_size))
    return Plan(profile_fingerprint=chain.fingerprint, pp_size=pp_size, virtual_stages=virtual,
                schedule=schedule, num_microbatches=num_microbatches,
                pipeline_cuts=tuple(s.modules[-1] for s in stages[:-1]), stages=tuple(stages),
                ranks=ranks, predicted_step_ms=0.0, bubble_fraction=0.0,
                setup=TrainingSetup(pp_size=pp_size, num_microbatches=num_microbatches),
                granularity="slice" if sliced else chain.granularity,
                parts={name: parts for name, parts in blocks if parts})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable,
            args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, tmp_path: Path, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their JSON results."""
    mp.spawn(_worker, args=(world_size, _free_port(), str(tmp_path), fn, args),
             nprocs=world_size, join=True)
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]


def padded_batch(vocab_size: int, batch: int = 8, seq_len: int = 12, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, labels with right padding, left padding and full rows."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (batch, seq_len), generator=gen)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        pad = (row * 3) % (seq_len - 2)
        if row % 3 == 1:
            mask[row, seq_len - pad:] = 0
        elif row % 3 == 2:
            mask[row, :pad] = 0
    input_ids = input_ids.masked_fill(mask == 0, 0)
    labels = input_ids.masked_fill(mask == 0, -100)
    return input_ids, mask, labels


def max_grad_diffs(named_params: list[tuple[str, torch.nn.Parameter]],
                   ref_grads: dict[str, torch.Tensor], aliases: dict[str, str] | None = None
                   ) -> dict[str, float]:
    """Max |grad - reference grad| per parameter FQN (inf when one model has a gradient the
    other lacks; 0 for a parameter with no gradient in either model: frozen, like an MoE
    router's load-balancing bias, or unused by this input, like a sparse-attention
    indexer whose output only selects positions or a vision tower fed no image)."""
    aliases = aliases or {}
    diffs = {}
    for name, p in named_params:
        ref = _reference(ref_grads, aliases, name)
        if ref is None and (p.grad is None or not p.grad.any()):
            diffs[name] = 0.0  # no gradient in either model
        elif p.grad is None or ref is None:
            diffs[name] = float("inf")
        else:
            diffs[name] = (p.grad.float() - ref.float()).abs().max().item()
    return diffs


def _reference(ref_grads: dict[str, torch.Tensor], aliases: dict[str, str],
               name: str) -> torch.Tensor | None:
    """``name``'s reference gradient, under its own name or its tied alias's."""
    return ref_grads.get(name, ref_grads.get(aliases.get(name, ""), None))


def _largest(ref_grads: dict[str, torch.Tensor], aliases: dict[str, str], name: str) -> float:
    """The largest |entry| of ``name``'s reference gradient (0 where it has none)."""
    ref = _reference(ref_grads, aliases, name)
    return 0.0 if ref is None else ref.float().abs().max().item()


def exact_step(config: Any, plan: Plan, reference: Any, aliases: dict[str, str],
               recompute: bool, grad_norm: bool = False, steps: int = 1) -> dict:
    """One training step of ``plan`` on this rank against the unpipelined ``reference``
    (``families.Reference``): the loss (``None`` off the loss stage), the
    largest gradient difference and its parameter, and the state dict's keys; with
    ``grad_norm``, the global gradient norm ``clip_grad_norm_`` reports too (collective).
    ``steps``: the same step run that many times (gradients cleared between, no
    optimizer), the last one compared; ``modes`` holds torch's shape inference mode of
    this rank's stages after it."""
    from autopart.intake.sources import build_hf_model
    from autopart.runtime import auto_pipeline

    pipe = auto_pipeline(build_hf_model(config), plan=plan, device="cpu",
                         activation_checkpointing=True if recompute else None)
    pipe.load_state_dict(reference.state)
    for _ in range(steps):
        for param in pipe.parameters():
            param.grad = None
        loss = pipe.step(reference.input_ids, target=reference.labels,
                         attention_mask=reference.mask)
    diffs = max_grad_diffs(pipe.named_parameters(), reference.grads, aliases)
    # each difference over its reference gradient's largest entry where that exceeds 1
    # (|a - b| <= tol * max(1, |b|), as torch.allclose with atol = rtol): float32 rounds
    # a gradient of 163.5 (a tiny RWKV's embedding) to steps of 1.5e-5
    scaled = {name: diff / max(1.0, _largest(reference.grads, aliases, name))
              for name, diff in diffs.items()}
    norm = pipe.clip_grad_norm_(float("inf")).item() if grad_norm else None
    return {"grad_norm": norm, "loss": None if loss is None else loss.item(),
            "max_grad_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get),
            "max_scaled_grad_diff": max(scaled.values()),
            "worst_scaled": max(scaled, key=scaled.get),
            "keys": sorted(pipe.state_dict()),
            "modes": [str(getattr(stage, "_inference_mode", None)) for stage in pipe.pipe_stages]}


def check_exact(results: list[dict], plans: dict, tol: float) -> None:
    """Every plan of ``plans`` (``exact_step`` results per rank, plus ``ref_loss`` and
    ``ref_keys``): one loss equal to the reference's, every gradient within ``tol``,
    the state dicts' keys the model's own (at most one, a tied copy, missing)."""
    ref_keys = set(results[0]["ref_keys"])
    for schedule in plans:
        losses = [r[schedule]["loss"] for r in results if r[schedule]["loss"] is not None]
        assert len(losses) == 1, (schedule, results)
        assert abs(losses[0] - results[0]["ref_loss"]) < tol, (schedule, losses)
        for r in results:
            assert r[schedule]["max_grad_diff"] < tol, (schedule, r[schedule]["worst"],
                                                        r[schedule]["max_grad_diff"])
        keys = {k for r in results for k in r[schedule]["keys"]}
        assert keys <= ref_keys and len(ref_keys - keys) <= 1, (schedule, ref_keys - keys)
