"""The full-size gradient each vocabulary shard of the head writes in its backward.

The runtime's shard ``i`` of ``k`` computes with ``weight[lo:hi]`` of the head's one
weight, so autograd's backward of that slice writes a gradient as large as the whole
weight (zeros outside the shard's rows) and adds it to the weight's ``.grad``: a
zero-fill and an add of ``vocab x hidden`` values per shard and microbatch, whatever
``k`` is. The profiler records that time in ``ProfileSetup.head_grad_ms``: measured
(``cpu``, ``cuda``; the profile's ``time_source``) or, on analytical profiles,
estimated from the device spec's memory bandwidth.
"""

from __future__ import annotations

import statistics
import time

import torch

from autopart.profile.devices import DeviceSpec
from autopart.schema import DTYPE_BYTES

__all__ = ["estimate_head_grad_ms", "measure_head_grad_ms"]

_PASSES = 4
"""Memory passes over the weight: write the zeros, then read both and write the sum."""


def estimate_head_grad_ms(num_values: int, spec: DeviceSpec, dtype: str) -> float:
    """Roofline time of a zero-fill + add of ``num_values`` values of ``dtype`` on ``spec``.

    Args:
        num_values: Values of the head's weight (``vocab x hidden``).
        spec: The device.
        dtype: The parameters' dtype (a key of ``DTYPE_BYTES``).

    Returns:
        Milliseconds: ``4 * bytes / (bandwidth * efficiency)`` (one add per value).
    """
    num_bytes = _PASSES * num_values * DTYPE_BYTES[dtype]
    return 1e3 * spec.op_time_s(float(num_values), float(num_bytes), dtype)


def measure_head_grad_ms(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                         num_warmup: int = 1, num_repeats: int = 5) -> float:
    """Median time of ``zeros(shape)`` then ``grad.add_(it)`` on ``device``, in ms.

    Args:
        shape: The head weight's shape.
        dtype: Its dtype.
        device: A ``cpu`` or ``cuda`` device.
        num_warmup: Untimed runs.
        num_repeats: Timed runs (the median is kept).

    Returns:
        Milliseconds of one zero-fill + add.
    """
    grad = torch.zeros(shape, dtype=dtype, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for run in range(num_warmup + num_repeats):
        sync()
        start = time.perf_counter()
        grad.add_(torch.zeros(shape, dtype=dtype, device=device))
        sync()
        if run >= num_warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)
