"""Process groups of a pipelined model: pipeline, data parallel, tied embeddings.

Either the whole world is one pipeline, or ``pp_group`` names it, or a 2-D
``DeviceMesh`` with dimensions ``("pp", "dp")`` gives both. Gradient reductions
over these groups (flattened into buckets) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from autopart.errors import RuntimeSetupError

__all__ = ["Groups", "all_reduce_grads", "resolve_groups", "tied_group"]

_BUCKET_BYTES = 32 * 2**20


@dataclass(frozen=True, slots=True)
class Groups:
    """This rank's place in the pipeline and data-parallel groups."""

    pp_group: dist.ProcessGroup
    pp_rank: int
    pp_size: int
    pp_global_ranks: tuple[int, ...]
    """Global rank of every pp rank of this rank's pipeline."""
    dp_group: dist.ProcessGroup | None = None
    dp_size: int = 1


def resolve_groups(pp_group: dist.ProcessGroup | None, device_mesh) -> Groups:
    """Work out the groups from the arguments of ``auto_pipeline`` (no collective)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeSetupError("torch.distributed is not initialized; call "
                                "torch.distributed.init_process_group (e.g. under torchrun) "
                                "before auto_pipeline")
    if pp_group is not None and device_mesh is not None:
        raise RuntimeSetupError("pass pp_group or device_mesh, not both")
    dp_group, dp_size = None, 1
    if device_mesh is not None:
        names = tuple(device_mesh.mesh_dim_names or ())
        if "pp" not in names:
            raise RuntimeSetupError(f"device_mesh has dimensions {names}; expected ('pp',) or "
                                    f"('pp', 'dp')")
        pp_group = device_mesh["pp"].get_group()
        if "dp" in names:
            dp_group = device_mesh["dp"].get_group()
            dp_size = dist.get_world_size(dp_group)
    group = pp_group if pp_group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    return Groups(pp_group=group, pp_rank=dist.get_rank(group), pp_size=len(ranks),
                  pp_global_ranks=ranks, dp_group=dp_group, dp_size=dp_size)


def tied_group(groups: Groups, first_rank: int, last_rank: int) -> dist.ProcessGroup:
    """A group of the two pp ranks holding the tied embedding and the tied head.

    Only those two ranks call this (local synchronization), so other pipelines and
    middle ranks are not involved.
    """
    ranks = sorted({groups.pp_global_ranks[first_rank], groups.pp_global_ranks[last_rank]})
    return dist.new_group(ranks, use_local_synchronization=True)


def all_reduce_grads(params: list[torch.nn.Parameter], group: dist.ProcessGroup,
                     divide_by: int = 1) -> None:
    """Sum the gradients of ``params`` over ``group`` (flattened buckets), then divide.

    Every member must pass the same parameters in the same order, each with a gradient.
    """
    grads = [p.grad for p in params]
    assert all(g is not None for g in grads), "all_reduce_grads needs every gradient"
    for bucket in _buckets(grads):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat.div_(divide_by)
        for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > _BUCKET_BYTES or buckets[-1][0].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets
