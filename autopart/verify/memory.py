"""Peak memory of one rank over one pipeline step, measured the way the cost model counts it.

CUDA: ``torch.cuda.max_memory_allocated`` over the step (everything the allocator
holds: weights, gradients, optimizer state, buffers, activations, workspaces).

CPU has no allocator counter, so the bytes are counted from live tensors:
parameters + gradients + optimizer state + torch's preallocated p2p receive
buffers + the peak of the tensors allocated and alive during the step, tracked
with ``autopart.profile.memory.LiveTensors`` (gradients excluded from that peak,
as they are counted whole). This is the quantity the cost model predicts (static
+ in-flight activations + boundary buffers + transient workspace); memory the
allocator or a kernel keeps outside tensors is not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from autopart.profile.memory import LiveTensors, storage_key
from autopart.verify.report import MeasuredMemory

__all__ = ["CPU_METHOD", "CUDA_METHOD", "measure_step_memory"]

CPU_METHOD = ("live tensors: params + grads + optimizer state + recv buffers + peak of tensors "
              "alive during the step (LiveTensors dispatch mode)")
CUDA_METHOD = "torch.cuda.max_memory_allocated over the pipeline step"


def measure_step_memory(run_step: Callable[[], None], pipe: Any, optimizer: Any,
                        device: torch.device) -> MeasuredMemory:
    """Run ``run_step`` once (gradients must be ``None`` before) and measure its memory.

    Args:
        run_step: One pipeline step.
        pipe: The rank's ``PipelinedModel``.
        optimizer: Its optimizer, or ``None``.
        device: The rank's device.

    Returns:
        The peak, and on CPU its parts (their sum is the peak).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        torch.cuda.synchronize(device)
        return MeasuredMemory(peak_bytes=int(torch.cuda.max_memory_allocated(device)))
    live = LiveTensors()
    with live:
        run_step()
    params = pipe.parameters()
    grads = [p.grad for p in params if p.grad is not None]
    parts = {
        "params_bytes": _unique_bytes(params),
        "grads_bytes": _unique_bytes(grads),
        "optimizer_bytes": _unique_bytes(_optimizer_tensors(optimizer)),
        "buffer_bytes": _unique_bytes(_recv_buffers(pipe.pipe_stages)),
        "live_peak_bytes": peak_without_last(live.events, {storage_key(g) for g in grads}),
    }
    return MeasuredMemory(peak_bytes=sum(parts.values()), **parts)


def peak_without_last(events: list[tuple[int, int]], keys: set[int | None]) -> int:
    """Peak of the live bytes, leaving out the latest allocation of each key in ``keys``.

    Keys are storage addresses: an earlier storage freed at the address a gradient
    later took is a different allocation and stays counted.
    """
    last = {key: i for i, (key, delta) in enumerate(events) if key in keys and delta > 0}
    current = peak = 0
    for i, (key, delta) in enumerate(events):
        if key in last and i >= last[key]:
            continue
        current += delta
        peak = max(peak, current)
    return peak


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int | None, int] = {}
    for t in tensors:
        key = storage_key(t)
        seen[key if key is not None else id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _recv_buffers(pipe_stages: list[Any]) -> list[torch.Tensor]:
    """torch's preallocated activation and gradient receive buffers (one per microbatch)."""
    buffers = []
    for stage in pipe_stages:
        for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
            for infos in table.values():
                for info in infos:
                    if getattr(info, "buffer", None) is not None \
                            and not getattr(info, "is_root_arg", False):
                        buffers.append(info.buffer)
    return buffers
