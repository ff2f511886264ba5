"""The machine check's runs beyond 1F1B: torch's action runtime, and the gradient sum.

``runtime_post_times``: ``ScheduleInterleaved1F1B`` (torch's ``_PipelineScheduleRuntime``,
which every multi-stage schedule runs on) over two stages per rank that compute (three
384 x 384 linear layers on 32 rows per microbatch, about a millisecond per action on one
CPU thread), at two microbatch counts. This runtime posts every send and receive as an
action of its own; what a step spends outside its F and B actions and its p2p waits
grows with the posts, and the growth per post is the runtime's cost per post. Stages
that compute matter on CPU: a post can wait for a core the other rank's compute holds
(2-5 ms on this project's 2-core VM, against 0.05 ms for most posts), which the empty
stages of the 1F1B run never show.

``all_reduce_times``: ``all_reduce_grads`` (flatten, all-reduce, copy back: how the
runtime sums the gradient of a weight held on two ranks) of 4 MiB and 32 MiB.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ALLREDUCE_MIB", "RUNTIME_COUNTS", "all_reduce_times", "fit_runtime",
           "runtime_post_times", "sync", "timed_method", "timed_step"]

RUNTIME_COUNTS = (4, 8)
"""Microbatch counts of the two runtime runs (multiples of the two ranks)."""
ALLREDUCE_MIB = (4, 32)
"""Gradient sizes summed; the fixed ms and the bandwidth come from the two."""
_WIDTH, _ROWS, _DEPTH = 384, 32, 3


def runtime_post_times(rank: int, device: torch.device, num_steps: int,
                       num_warmup: int) -> dict[str, dict[str, Any]]:
    """Per microbatch count: the ms of each step outside actions and waits, and the posts.

    Args:
        rank: This rank (0 or 1) of an initialized two-rank process group.
        device: Where the stages run.
        num_steps: Timed steps per count.
        num_warmup: Untimed steps first.

    Returns:
        ``{str(m): {"rest": [ms per step], "posts": sends and receives posted per step}}``.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.distributed.pipelining import schedules as torch_schedules

    torch.manual_seed(rank)
    out: dict[str, dict[str, Any]] = {}
    for m in RUNTIME_COUNTS:
        modules = [torch.nn.Sequential(*(torch.nn.Linear(_WIDTH, _WIDTH)
                                         for _ in range(_DEPTH))).to(device) for _ in range(2)]
        stages = [PipelineStage(mod, rank + 2 * i, 4, device) for i, mod in enumerate(modules)]
        schedule = ScheduleInterleaved1F1B(stages, m,
                                           loss_fn=lambda out, target: out.pow(2).mean())
        spans: list[float] = []
        restore = [timed_method(stage, name, spans) for stage in stages
                   for name in ("forward_one_chunk", "backward_one_chunk")]
        restore.append(timed_method(torch_schedules, "_wait_batch_p2p", spans))
        x = torch.randn(_ROWS * m, _WIDTH, device=device)
        rest: list[float] = []
        try:
            for step in range(num_warmup + num_steps):
                spans.clear()
                total = timed_step(schedule, rank, x, device)
                if step >= num_warmup:
                    rest.append(total - sum(spans))
                for mod in modules:
                    mod.zero_grad(set_to_none=True)
        finally:
            for undo in restore:
                undo()
        out[str(m)] = {"rest": rest, "posts": _posts(schedule, rank)}
    return out


def timed_step(schedule: Any, rank: int, x: torch.Tensor, device: torch.device) -> float:
    """Ms of one ``schedule.step`` after a barrier: rank 0 feeds ``x``, the last rank
    (1) takes it as the target."""
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=x)
    sync(device)
    return 1e3 * (time.perf_counter() - start)


def _posts(schedule: Any, rank: int) -> int:
    """Sends and receives in this rank's action list (torch's own, with comms)."""
    from torch.distributed.pipelining.schedules import RECV_B, RECV_F, SEND_B, SEND_F

    kinds = (SEND_F, SEND_B, RECV_F, RECV_B)
    return sum(a.computation_type in kinds for a in schedule.pipeline_order_with_comms[rank])


def all_reduce_times(device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Median ms of ``all_reduce_grads`` of each of ``ALLREDUCE_MIB`` (fp32), both ranks.

    Args:
        device: Where the gradient lives.
        repeats: Timed sums per size (one untimed first).

    Returns:
        ``{str(mib): ms}``.
    """
    from autopart.runtime.groups import all_reduce_grads

    out = {}
    for mib in ALLREDUCE_MIB:
        weight = torch.nn.Parameter(torch.zeros(mib * 2**18, device=device))
        weight.grad = torch.ones_like(weight)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            all_reduce_grads([weight], dist.group.WORLD)
            sync(device)
            times.append(1e3 * (time.perf_counter() - start))
        out[str(mib)] = statistics.median(times[1:])
    return out


def timed_method(owner: Any, name: str, into: list[float]) -> Callable[[], None]:
    """Wrap ``owner.name`` to append each call's ms to ``into``; return the undo."""
    original = getattr(owner, name)
    own = owner.__dict__.get(name) if hasattr(owner, "__dict__") else None

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(1e3 * (time.perf_counter() - start))

    setattr(owner, name, timed)

    def undo() -> None:
        if own is None:
            delattr(owner, name)  # the class's method shows through again
        else:
            setattr(owner, name, own)
    return undo


MIN_POST_MS = 0.001
"""The price per post recorded where the rest did not grow with the posts on any rank
(a host's noise over a few steps): measured, below what the check resolves. 0 stays
``RuntimeOverhead``'s "not measured", which charges such schedules ``p2p_ms``."""


def fit_runtime(raw: list[dict[str, Any]]) -> tuple[float, float, float]:
    """``(runtime_p2p_ms, allreduce_latency_ms, allreduce_bandwidth_bytes_per_s)`` from
    both ranks' timings: the growth of the rest per post between the two counts (median
    over the ranks, at least ``MIN_POST_MS``), and the line through the two all-reduce
    sizes (rank 0)."""
    low, high = (str(m) for m in RUNTIME_COUNTS)
    slopes = []
    for r in raw:
        runs = r["runtime"]
        posts = runs[high]["posts"] - runs[low]["posts"]
        grown = statistics.median(runs[high]["rest"]) - statistics.median(runs[low]["rest"])
        slopes.append(max(grown, 0.0) / max(posts, 1))
    small, large = ALLREDUCE_MIB
    times = raw[0]["allreduce"]
    extra_ms = max(times[str(large)] - times[str(small)], 1e-6)
    bandwidth = (large - small) * 2**20 / (extra_ms / 1e3)
    latency = max(times[str(small)] - 1e3 * small * 2**20 / bandwidth, 0.0)
    return max(statistics.median(slopes), MIN_POST_MS), latency, bandwidth


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
