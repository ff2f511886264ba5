"""The embedding and the head split by vocabulary over the tensor-parallel group.

The embedding looks up only this rank's rows (Megatron's ``VocabParallelEmbedding``) and
the partial lookups are summed; the head computes the logits of its rows
(``ColwiseParallel`` with the output left split), which the built-in loss folds over the
group (``autopart.runtime.loss.VocabParallelLoss``). Used by
``autopart.runtime.tensor_parallel``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from autopart.errors import RuntimeSetupError
from autopart.intake.chain import Block

__all__ = []

logger = logging.getLogger(__name__)

_SEQ = Shard(1)


def vocab_embedding(module: nn.Module, block: Block, sp: bool) -> dict[str, ParallelStyle]:
    """torch's ``RowwiseParallel`` for an embedding with its own ``forward``; the plain
    ``nn.Embedding`` forward is split by ``split_lookup`` instead (no style)."""
    fqn = block.fqns[-1]
    embedding = module.get_submodule(fqn)
    if not isinstance(embedding, nn.Embedding):
        raise RuntimeSetupError(f"the embedding block {block.name} is a "
                                f"{type(embedding).__name__}, not an nn.Embedding autopart "
                                f"can split by vocabulary; use tp_size 1")
    if type(embedding).forward is nn.Embedding.forward:
        return {}
    logger.warning("%s (%s) has its own forward: split with torch's RowwiseParallel, whose "
                   "backward computes the whole embedding gradient on every tp rank before "
                   "keeping its rows (more memory than the plan counts)", fqn,
                   type(embedding).__name__)
    return {fqn: RowwiseParallel(input_layouts=Replicate(), output_layouts=_SEQ if sp
                                 else Replicate(), use_local_output=not sp)}


def split_lookup(embedding: nn.Embedding, mesh: DeviceMesh, sp: bool) -> None:
    """Split a plain ``nn.Embedding`` by rows over ``mesh``, Megatron's way: each rank looks
    up the tokens in its rows (zeros for the others), and the partial lookups are summed
    (reduce-scattered along the sequence under sequence parallelism). The backward adds
    into this rank's rows only, where torch's ``RowwiseParallel`` computes the whole
    gradient on every rank first."""
    embedding.weight = nn.Parameter(distribute_tensor(embedding.weight.detach(), mesh,
                                                      [Shard(0)], src_data_rank=None),
                                    requires_grad=embedding.weight.requires_grad)
    lo, hi = local_rows(embedding.weight)
    pad = embedding.padding_idx
    local_pad = pad - lo if pad is not None and lo <= pad < hi else None
    placement = _SEQ if sp else Replicate()

    def lookup(input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < lo) | (input_ids >= hi)
        ids = (input_ids - lo).masked_fill(outside, 0)
        part = F.embedding(ids, embedding.weight.to_local(), local_pad, embedding.max_norm,
                           embedding.norm_type, embedding.scale_grad_by_freq,
                           embedding.sparse).masked_fill(outside.unsqueeze(-1), 0)
        out = DTensor.from_local(part, mesh, [Partial()], run_check=False)
        out = out.redistribute(placements=[placement])
        return out if sp else out.to_local()

    embedding.forward = lookup


def vocab_head(module: nn.Module, block: Block, sp: bool,
               gather: bool) -> dict[str, ParallelStyle]:
    """``ColwiseParallel`` for the head: its rows' logits, or gathered whole (``gather``)."""
    fqn = block.fqns[-1]
    head = module.get_submodule(fqn)
    if not isinstance(head, nn.Linear):
        raise RuntimeSetupError(f"the head block {block.name} is a {type(head).__name__}, "
                                f"not an nn.Linear autopart can split by vocabulary; use "
                                f"tp_size 1")
    return {fqn: ColwiseParallel(input_layouts=_SEQ if sp else Replicate(),
                                 output_layouts=Replicate() if gather else Shard(-1))}


def local_rows(weight: torch.Tensor) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a weight split by rows that this rank holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh,
                                                          weight.placements)
    return offset[0], offset[0] + shape[0]
