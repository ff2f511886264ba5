"""The dense gradient buffer of a head split by vocabulary, zero-filled once per step.

Every rank with a vocabulary shard of the head holds the head's whole weight, and its
shards add only their rows' gradient into the weight's ``.grad`` (``autopart.runtime.
head_shards``); that buffer is created as zeros the first time a step needs it (the
first forward of a shard stage after ``zero_grad(set_to_none=True)``). Its zero-fill is
the one full-size write left per step: the profiler records its time in
``ProfileSetup.head_grad_ms``, measured (``cpu``, ``cuda``: a fresh ``torch.zeros``, on
CPU with the page faults of a new allocation) or, on analytical profiles, estimated
from the device spec's memory bandwidth.
"""

from __future__ import annotations

import statistics
import time

import torch

from autopart.profile.devices import DeviceSpec
from autopart.schema import DTYPE_BYTES

__all__ = []


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
