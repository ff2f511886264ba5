"""The dense gradient buffer of a head split by vocabulary, zero-filled once per step.

Every rank with a vocabulary shard of the head holds the head's whole weight, and its
shards add only their rows' gradient into the weight's ``.grad`` (``autopart.runtime.
head_shards``); that buffer is created as zeros the first time a step needs it (the
first forward of a shard stage after ``zero_grad(set_to_none=True)``). Its zero-fill is
the one full-size write left per step: the profiler records its time in
``ProfileSetup.head_grad_ms``, measured (``cpu``, ``cuda``: a fresh ``torch.zeros``, on
CPU with the page faults of a new allocation) or, on analytical profiles, estimated
from the device spec's memory bandwidth.

The shards also compute the loss another way than the head the profile measured: the
runtime's sliced loss (``head_shards.shard_carry``: a log-softmax per slice, a fused
backward, the rows' gradient handed on sparse) instead of the model's cross entropy over
the whole logits. ``measure_slice_costs`` times both on the head's shapes (the sliced
loss on a quarter, half and three quarters of the rows, as a stage runs part of them),
alternately: a fixed cost per call, which every stage with shards pays once per microbatch
(``ProfileSetup.head_slice_fwd_ms``), and a cost per row over the model's loss's
(``head_slice_fwd_ratio``), which scales the shards' share of the head's times
(``levels.split_head``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopart.profile.devices import DeviceSpec
from autopart.schema import DTYPE_BYTES

__all__ = ["head_split_fields"]

SLICE_REPEATS = 6
"""Timed runs of each loss in ``measure_slice_costs`` (alternating, after one of each)."""


@dataclass(frozen=True, slots=True)
class SliceCosts:
    """The runtime's sliced loss on a model's head (``measure_slice_costs``)."""

    fwd_fixed_ms: float
    """Forward ms per call whatever its rows."""
    bwd_fixed_ms: float
    """Backward ms per call whatever its rows."""
    fwd_ratio: float
    """Forward cost per row over the model's loss's (its whole forward / vocabulary)."""
    bwd_ratio: float
    """The same for the backward."""


def estimate_head_grad_ms(num_values: int, spec: DeviceSpec, dtype: str) -> float:
    """Roofline time of a zero-fill of ``num_values`` values of ``dtype`` on ``spec``.

    Args:
        num_values: Values of the head's weight (``vocab x hidden``).
        spec: The device.
        dtype: The gradient's dtype (a key of ``DTYPE_BYTES``).

    Returns:
        Milliseconds: ``bytes / (bandwidth * efficiency)`` (one write pass, no FLOPs).
    """
    return 1e3 * spec.op_time_s(0.0, float(num_values * DTYPE_BYTES[dtype]), dtype)


def measure_head_grad_ms(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                         num_warmup: int = 1, num_repeats: int = 5) -> float:
    """Median time of ``torch.zeros(shape)`` on ``device`` (a new buffer each time), in ms.

    Args:
        shape: The head weight's shape.
        dtype: Its dtype.
        device: A ``cpu`` or ``cuda`` device.
        num_warmup: Untimed runs.
        num_repeats: Timed runs (the median is kept).

    Returns:
        Milliseconds of one zero-filled allocation.
    """
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for run in range(num_warmup + num_repeats):
        sync()
        start = time.perf_counter()
        buffer = torch.zeros(shape, dtype=dtype, device=device)
        sync()
        elapsed = time.perf_counter() - start
        del buffer
        if run >= num_warmup:
            times.append(1e3 * elapsed)
    return statistics.median(times)


def measure_slice_costs(shape: tuple[int, int], positions: int, dtype: torch.dtype,
                        device: torch.device, num_repeats: int = SLICE_REPEATS
                        ) -> SliceCosts:
    """The runtime's sliced loss against the model's own (linear, then cross entropy on
    float32 logits), on the head's shapes: medians of alternating runs on one weight.

    The sliced loss runs on a quarter, half and three quarters of the rows, as a stage
    holds part of the head, each run first in turn; the least-squares line through the
    three splits it into a fixed cost per call and a cost per row (through r35 the line
    through a quarter and half, the quarter always run after the whole loss: on the
    heavy-head Llama's 32768 x 256 head it read 1.1 to 2.5 ms per call where a sweep of an
    eighth to all the rows fits 0.3 to 0.6 ms). Slices, not the whole head: the whole
    head's gradient is a new buffer the size of its weight every backward (on CPU, above
    glibc's 32 MiB mmap ceiling, page faults every time: 47 against 35 ms per
    row-equivalent on a 32768 x 256 head), which a stage's slice of rows mostly is not.

    Args:
        shape: The head weight's ``(vocab, hidden)``.
        positions: Tokens per microbatch whose loss counts (``batch x (seq - 1)``).
        dtype: The weight's and input's dtype.
        device: A ``cpu`` or ``cuda`` device.
        num_repeats: Timed runs of each (after one untimed run of each).

    Returns:
        The fixed ms (forward, backward) and the per-row cost over the whole loss's.
    """
    import torch.nn.functional as F

    from autopart.runtime.head_shards import shard_carry

    vocab, hidden = shape
    sizes = sorted({max(vocab * k // 4, 1) for k in (1, 2, 3)})
    weight = torch.nn.Parameter(0.02 * torch.randn(shape, device=device, dtype=dtype))
    target = torch.randint(0, vocab, (1, positions), device=device)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter

    def whole(x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, weight).float()
        return F.cross_entropy(logits.view(-1, vocab), target.view(-1))

    def sliced(rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def loss(x: torch.Tensor) -> torch.Tensor:
            lse, picked = shard_carry(x, weight, None, (0, rows), target)
            return (lse - picked).mean()
        return loss

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    runs = [(vocab, whole), *((rows, sliced(rows)) for rows in sizes)]
    times: dict[int, list[tuple[float, float]]] = {rows: [] for rows, _ in runs}
    for run in range(num_repeats + 1):
        # each in turn first: none always runs after the whole loss's fresh gradient
        for rows, loss_of in runs[run % len(runs):] + runs[:run % len(runs)]:
            x = torch.randn(1, positions, hidden, device=device, dtype=dtype,
                            requires_grad=True)
            weight.grad = None if loss_of is whole else torch.zeros_like(weight)
            sync()
            start = clock()
            loss = loss_of(x)
            sync()
            mid = clock()
            loss.backward()
            sync()
            if run:
                times[rows].append((1e3 * (mid - start), 1e3 * (clock() - mid)))
    fits = []
    for k in (0, 1):
        ms = {rows: statistics.median(t[k] for t in runs_) for rows, runs_ in times.items()}
        fixed, per_row = _line([(rows, ms[rows]) for rows in sizes])
        fits.append((fixed, per_row * vocab / ms[vocab]))
    return SliceCosts(fwd_fixed_ms=fits[0][0], bwd_fixed_ms=fits[1][0],
                      fwd_ratio=fits[0][1], bwd_ratio=fits[1][1])


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(fixed, per_row)`` of the least-squares line through ``(rows, ms)`` points: the
    fixed part at least 0 (then the line through the origin), the per-row part positive
    (noise that leaves it at or below 0: no fixed part, the mean cost per row)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points) / spread) if spread else 0.0
    if slope <= 0 or mean_y - slope * mean_x < 0:
        return 0.0, sum(y for _, y in points) / sum(x for x, _ in points)
    return mean_y - slope * mean_x, slope


def head_split_fields(shape: tuple[int, int], dtype: str, positions: int,
                      device: torch.device, spec: DeviceSpec | None = None
                      ) -> dict[str, float]:
    """``ProfileSetup``'s figures for a head split by vocabulary: the gradient's zero-fill
    (``head_grad_ms``) and the sliced loss's costs (``head_slice_*``).

    Args:
        shape: The head weight's ``(vocab, hidden)``.
        dtype: The profile's dtype name.
        positions: Tokens per microbatch whose loss counts.
        device: Where the profile runs.
        spec: The device spec of an analytical profile (then the zero-fill is estimated
            and the sliced loss is not measured).

    Returns:
        The fields measured (``cpu``, ``cuda``) or estimated (analytical); none elsewhere.
    """
    from autopart.profile.validate import TORCH_DTYPES

    if spec is not None:
        return {"head_grad_ms": round(estimate_head_grad_ms(shape[0] * shape[1], spec,
                                                            dtype), 6)}
    if device.type not in ("cpu", "cuda"):
        return {}
    torch_dtype = TORCH_DTYPES[dtype]
    costs = measure_slice_costs(shape, positions, torch_dtype, device)
    return {"head_grad_ms": round(measure_head_grad_ms(shape, torch_dtype, device), 6),
            "head_slice_fwd_ratio": round(costs.fwd_ratio, 4),
            "head_slice_bwd_ratio": round(costs.bwd_ratio, 4),
            "head_slice_fwd_ms": round(costs.fwd_fixed_ms, 4),
            "head_slice_bwd_ms": round(costs.bwd_fixed_ms, 4)}
