"""Process groups of a pipelined model: pipeline, data parallel, tensor parallel, tied embeddings.

Either ``pp_group`` names the pipeline, or a ``DeviceMesh`` with a ``"pp"``
dimension and optional ``"dp"`` and ``"tp"`` dimensions gives the groups, or
(neither given) they come from the plan: the whole world is one pipeline when
the plan has dp and tp 1, else a ``("pp", "dp", "tp")`` mesh of the plan's sizes
is built over the world (tp innermost, so tensor-parallel ranks are neighbours).
Gradient reductions over these groups (flattened into buckets) live here too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopart.errors import RuntimeSetupError
from autopart.runtime.tensor_parallel import local_tensor

__all__ = []

_MESH_DIMS = ("pp", "dp", "tp")

_BUCKET_BYTES = 32 * 2**20

_KEPT: deque[dist.Work] = deque(maxlen=32)
"""The work objects of the runtime's latest collectives (``wait_and_keep``)."""


@dataclass(frozen=True, slots=True)
class Groups:
    """This rank's place in the pipeline, data-parallel and tensor-parallel groups."""

    pp_group: dist.ProcessGroup
    pp_rank: int
    pp_size: int
    pp_global_ranks: tuple[int, ...]
    """Global rank of every pp rank of this rank's pipeline."""
    dp_group: dist.ProcessGroup | None = None
    dp_size: int = 1
    dp_rank: int = 0
    """This replica's index: it takes the ``dp_rank``-th slice of the global batch."""
    tp_mesh: DeviceMesh | None = None
    """The 1-D mesh of this rank's tensor-parallel group (``None`` without TP)."""
    tp_size: int = 1
    dp_mesh: DeviceMesh | None = None
    """The 1-D mesh of this rank's data-parallel group (FSDP shards over it; ``None``
    without data parallelism or when only a process group was given)."""

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel process group (``None`` without TP)."""
        return None if self.tp_mesh is None else self.tp_mesh.get_group()

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group (0 without TP)."""
        return 0 if self.tp_mesh is None else self.tp_mesh.get_local_rank()


def resolve_groups(pp_group: dist.ProcessGroup | None, device_mesh: DeviceMesh | None, *,
                   sizes: tuple[int, int, int] | None = None,
                   device_type: str = "cpu") -> Groups:
    """Work out the groups from the arguments of ``auto_pipeline``.

    Args:
        pp_group: The pipeline's process group, or ``None``.
        device_mesh: A mesh with a ``"pp"`` dimension and optional ``"dp"``/``"tp"``.
        sizes: The plan's ``(pp, dp, tp)`` sizes when the plan is known: with neither
            group nor mesh given, the world must have ``pp * dp * tp`` ranks, and a
            ``("pp", "dp", "tp")`` mesh is built unless ``dp == tp == 1``.
        device_type: Device type of the mesh built from ``sizes``.

    Returns:
        The groups; only building a mesh runs collectives (creating its groups).

    Raises:
        RuntimeSetupError: torch.distributed is not initialized, both ``pp_group``
            and ``device_mesh`` are given, the mesh lacks ``"pp"``, or the world
            size is not the plan's ``pp * dp * tp``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeSetupError("torch.distributed is not initialized; call "
                                "torch.distributed.init_process_group (e.g. under torchrun) "
                                "before auto_pipeline")
    if pp_group is not None and device_mesh is not None:
        raise RuntimeSetupError("pass pp_group or device_mesh, not both")
    if pp_group is None and device_mesh is None and sizes is not None:
        device_mesh = _mesh_from_plan(sizes, device_type)
    if device_mesh is not None:
        return _groups_of_mesh(device_mesh)
    group = pp_group if pp_group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    return Groups(pp_group=group, pp_rank=dist.get_rank(group), pp_size=len(ranks),
                  pp_global_ranks=ranks)


def _mesh_from_plan(sizes: tuple[int, int, int], device_type: str) -> DeviceMesh | None:
    """A ``("pp", "dp", "tp")`` mesh over the world, or ``None`` for a pure pipeline."""
    pp, dp, tp = sizes
    world = dist.get_world_size()
    if world != pp * dp * tp:
        raise RuntimeSetupError(
            f"the plan needs pp {pp} x dp {dp} x tp {tp} = {pp * dp * tp} rank(s) but the "
            f"world has {world}; launch {pp * dp * tp} ranks (torchrun --nproc_per_node="
            f"{pp * dp * tp}) or make a plan for {world} device(s)")
    if dp == 1 and tp == 1:
        return None
    return init_device_mesh(device_type, sizes, mesh_dim_names=_MESH_DIMS)


def _groups_of_mesh(mesh: DeviceMesh) -> Groups:
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names or any(n not in _MESH_DIMS for n in names):
        raise RuntimeSetupError(f"device_mesh has dimensions {names}; expected 'pp' and "
                                f"optionally 'dp' and 'tp', e.g. ('pp', 'dp', 'tp')")
    pp_group = mesh["pp"].get_group()
    dp_mesh = mesh["dp"] if "dp" in names and mesh["dp"].size() > 1 else None
    dp_group = dp_mesh.get_group() if dp_mesh is not None else None
    tp_mesh = mesh["tp"] if "tp" in names and mesh["tp"].size() > 1 else None
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    return Groups(pp_group=pp_group, pp_rank=dist.get_rank(pp_group), pp_size=len(ranks),
                  pp_global_ranks=ranks, dp_group=dp_group,
                  dp_size=1 if dp_group is None else dist.get_world_size(dp_group),
                  dp_rank=0 if dp_group is None else dist.get_rank(dp_group),
                  tp_mesh=tp_mesh, tp_size=1 if tp_mesh is None else tp_mesh.size(),
                  dp_mesh=dp_mesh)


def wait_and_keep(work: dist.Work) -> None:
    """Wait for a collective issued with ``async_op=True``, then hold its work object.

    Gloo's worker thread lets go of its reference to a collective's work just after the
    caller's wait returns. Where that reference is the last, the work's tensors are
    released on the worker thread, which needs the GIL for their Python objects; at
    interpreter exit it gets none, and the process aborts ("terminate called without an
    active exception", torch issue 190489; 4 of 40 runs of a two-rank ``plan="auto"``
    test that exits right after its step). Held here (the latest 32), the work outlives
    the worker's reference and is released on the thread that runs Python.
    """
    work.wait()
    _KEPT.append(work)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``dist.all_reduce`` (sum, in place) whose work is kept alive past it
    (``wait_and_keep``)."""
    wait_and_keep(dist.all_reduce(tensor, group=group, async_op=True))


def all_reduce_grads(params: list[torch.nn.Parameter], group: dist.ProcessGroup,
                     divide_by: int = 1) -> None:
    """Sum the gradients of ``params`` over ``group`` (flattened buckets), then divide.

    Every member must pass the same parameters in the same order, each with a gradient.
    A tensor-parallel (``DTensor``) gradient is reduced shard by shard: replicas of one
    tp rank hold the same shard.
    """
    grads = [local_tensor(p.grad) if p.grad is not None else None for p in params]
    assert all(g is not None for g in grads), "all_reduce_grads needs every gradient"
    for bucket in _buckets(grads):
        flat = _flatten_dense_tensors(bucket)
        all_reduce(flat, group)
        if divide_by != 1:
            flat.div_(divide_by)
        for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)
        flat.set_()  # its work is kept alive, its memory is not


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
