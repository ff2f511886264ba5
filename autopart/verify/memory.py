"""Peak memory of one rank over one pipeline step, measured the way the cost model counts it.

CUDA: ``torch.cuda.max_memory_allocated`` over the step (everything the allocator
holds: weights, gradients, optimizer state, buffers, activations, workspaces).

CPU has no allocator counter, so the bytes are counted from live tensors:
parameters + gradients + optimizer state (this rank's shards of split ones) + torch's
p2p receive buffers from before the step while they live (a V schedule's turn replaces
them with the tensors it hands over) + the peak of the tensors allocated and alive during
the step (FSDP's whole gradients among them), tracked with
``autopart.profile.memory.LiveTensors`` (gradients excluded from that peak, as they are
counted whole) + FSDP's gathered parameters, which FSDP refills in place (sampled after
every action). This is the quantity the cost model predicts (static
+ in-flight activations + boundary buffers + transient workspace); memory the
allocator or a kernel keeps outside tensors is not seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from autopart.profile.memory import LiveTensors, storage_key
from autopart.runtime.tensor_parallel import local_tensor
from autopart.verify.report import MeasuredMemory

__all__ = []

CPU_METHOD = ("live tensors: params + grads + optimizer state + recv buffers + peak of tensors "
              "alive during the step (LiveTensors dispatch mode) + FSDP-gathered parameters")
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
    held: list[tuple[int, int]] = []
    with live, _gathered_peak(pipe) as gathered, _held_buffers(pipe, live, held):
        run_step()
    params = [local_tensor(p) for p in pipe.parameters()]  # this rank's shards
    grads = [local_tensor(p.grad) for p in pipe.parameters() if p.grad is not None]
    live_bytes, buffer_bytes = peak_over_step(live.events, {storage_key(g) for g in grads},
                                              held)
    parts = {
        "params_bytes": _unique_bytes(params),
        "grads_bytes": _unique_bytes(grads),
        "optimizer_bytes": _unique_bytes(_optimizer_tensors(optimizer)),
        "buffer_bytes": buffer_bytes,
        "live_peak_bytes": live_bytes,
        "gathered_bytes": gathered[0],
    }
    return MeasuredMemory(peak_bytes=sum(parts.values()), **parts)


@contextlib.contextmanager
def _gathered_peak(pipe: Any) -> Iterator[list[int]]:
    """The most bytes of FSDP-gathered parameters held after any action of the step.

    FSDP keeps each parameter's gathered storage (``FSDPParam.all_gather_outputs``, torch
    2.13) and frees and refills it in place (``untyped_storage().resize_``), which no
    dispatched op shows ``LiveTensors``: it is sampled after every F and backward of this
    rank's stages instead. Yields a one-element list with the figure (0 without FSDP).
    """
    # ``fully_shard([a, b])`` (a block of several modules) makes each an FSDPModule with
    # one shared state: count each state's parameters once.
    states = {id(state): state for module in pipe.stage_modules for sub in module.modules()
              if isinstance(sub, FSDPModule) for state in [sub._get_fsdp_state()]}
    gathered = [fp for state in states.values() for group in state._fsdp_param_groups
                for fp in group.fsdp_params]
    peak = [0]

    def sample() -> None:
        held = sum(t.untyped_storage().nbytes() for fp in gathered
                   for t in getattr(fp, "all_gather_outputs", ()))
        peak[0] = max(peak[0], held)

    with _after_every_action(pipe, sample if gathered else None):
        yield peak


@contextlib.contextmanager
def _held_buffers(pipe: Any, live: LiveTensors, held: list[tuple[int, int]]) -> Iterator[None]:
    """Fill ``held`` with ``(event index, bytes)``: the receive buffers alive from before
    the step, sampled before it and after every action.

    Most buffers are torch's, allocated once and refilled in place. A V schedule's two
    stages on one rank hand their tensors over instead (``set_local_fwd_input``,
    ``set_local_bwd_input``): the handed tensor replaces the buffer and the previous
    step's is freed. A tensor handed over this step is counted by ``LiveTensors``, so a
    buffer counts here only while its storage predates the step (counting the buffers
    after the step counted the handed tensors twice, 8% of a ZBV rank)."""
    def sample() -> None:
        seen: dict[int, int] = {}
        for t in _recv_buffers(pipe.pipe_stages):
            key = storage_key(t)
            if key is None or key not in live.allocated:  # no storage key: counted whole
                seen[key if key is not None else id(t)] = t.untyped_storage().nbytes()
        held.append((len(live.events), sum(seen.values())))

    sample()
    with _after_every_action(pipe, sample):
        yield


@contextlib.contextmanager
def _after_every_action(pipe: Any, sample: Callable[[], None] | None) -> Iterator[None]:
    """Call ``sample()`` after every F, backward and weight backward of this rank's
    stages (nothing where ``sample`` is ``None``)."""
    saved = []

    def wrap(stage: Any, name: str) -> None:
        inner = getattr(stage, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            sample()
            return out

        saved.append((stage, name, stage.__dict__.get(name)))
        setattr(stage, name, run)

    if sample is not None:
        for stage in pipe.pipe_stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    wrap(stage, name)
    try:
        yield
    finally:
        for stage, name, before in reversed(saved):  # another wrapper (``StepRecorder``) stays
            if before is None:
                delattr(stage, name)
            else:
                setattr(stage, name, before)


def peak_over_step(events: list[tuple[int, int]], keys: set[int | None],
                   held: list[tuple[int, int]]) -> tuple[int, int]:
    """``(live bytes, held bytes)`` where their sum peaks.

    Live bytes: the running sum of ``events`` leaving out the latest allocation of each
    key in ``keys`` (the gradients, counted whole apart). Keys are storage addresses: an
    earlier storage freed at the address a gradient later took is a different
    allocation and stays counted. Held bytes: a step function of the event index,
    ``(index, bytes)`` samples in order, each holding from its index until the next.
    """
    last = {key: i for i, (key, delta) in enumerate(events) if key in keys and delta > 0}
    current, sample = 0, 0
    base = held[0][1] if held else 0
    best = (0, base)
    for i, (key, delta) in enumerate(events):
        while sample + 1 < len(held) and held[sample + 1][0] <= i:
            sample += 1
            base = held[sample][1]
            best = max(best, (current, base), key=sum)
        if key in last and i >= last[key]:
            continue
        current += delta
        best = max(best, (current, base), key=sum)
    for _, later in held[sample + 1:]:  # samples after the last event
        best = max(best, (current, later), key=sum)
    return best


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int | None, int] = {}
    for t in tensors:
        key = storage_key(t)
        seen[key if key is not None else id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [local_tensor(v) for state in optimizer.state.values() for v in state.values()
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
