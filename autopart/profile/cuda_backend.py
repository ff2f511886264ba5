"""The ``cuda`` backend: CUDA events around each call with the host queueing ahead of
the GPU and the L2 flushed; saved activations from saved-tensor hooks, transient
workspace from the caching allocator (``reset_peak_memory_stats`` /
``max_memory_allocated``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from autopart.errors import ProfileError
from autopart.profile.backend_base import CACHE_FLUSHES, Backend

__all__ = ["CUDABackend", "l2_flush_bytes"]


class CUDABackend(Backend):
    """One CUDA GPU: CUDA events and the caching allocator's statistics.

    With ``flush="llc"`` every timed call starts with a cold L2, as in Triton's
    ``do_bench``: a buffer of twice the L2 (``torch.cuda.get_device_properties``) is
    zeroed before the start event, outside the timed region (run on an H200:
    ``scripts/cuda_check.py``).

    A call is timed with the host ahead of the GPU, as a stage runs it: a GPU spin
    (``torch.cuda._sleep``, ``LEAD_MS``) queued before the start event lets the host
    queue the call's kernels; the time is the larger of the GPU span and the host's
    queueing time (docs/timing-sweep.md, "CUDA on one H200": from an idle GPU each
    projection block paid the host's start again).
    """

    name = "cuda"
    time_source = "measured: CUDA events, the host queueing ahead of the GPU"
    memory_source = "measured: saved-tensor hooks + CUDA allocator peak"

    def __init__(self, flush: str = "llc") -> None:
        if not torch.cuda.is_available():
            raise ProfileError(
                f"backend 'cuda' needs a CUDA GPU, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                f"use --backend cpu, or analytical:h100 to estimate without a GPU")
        if flush not in CACHE_FLUSHES or flush in ("model", "order"):
            raise ProfileError(f"cache_flush {flush!r} is not one for cuda; expected auto, "
                               f"none or llc")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.flush_bytes = (l2_flush_bytes(torch.cuda.get_device_properties(self.device))
                            if flush == "llc" else 0)
        if self.flush_bytes:
            self.time_source = (f"measured: CUDA events, the host queueing ahead of the GPU, "
                                f"L2 flushed before each timed call "
                                f"({self.flush_bytes >> 20} MiB zeroed)")
        # allocated here, never inside a measured region (the allocator's peak is tracked)
        self._flush = torch.empty(self.flush_bytes, dtype=torch.int8, device=self.device)
        self._lead_cycles = int(LEAD_MS * _spin_cycles_per_ms())

    def time(self, fn: Callable[[], Any], hot: tuple[Any, ...] = (),
             warm: Callable[[], Any] | None = None) -> tuple[float, Any]:
        """The larger of the GPU milliseconds between two events recorded around ``fn``
        (after the flush and the spin) and the host's milliseconds queueing it."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        if self.flush_bytes:
            self._flush.zero_()  # queued before the start event: outside the timed span
        if self._lead_cycles:
            torch.cuda._sleep(self._lead_cycles)  # the host queues fn while the GPU spins
        start.record()
        began = time.perf_counter()
        out = fn()
        host_ms = (time.perf_counter() - began) * 1e3
        end.record()
        end.synchronize()
        return max(start.elapsed_time(end), host_ms), out

    def sync(self) -> None:
        """``torch.cuda.synchronize``."""
        torch.cuda.synchronize(self.device)

    def allocator_peak(self, fn: Callable[[], Any]) -> int | None:
        """``max_memory_allocated`` above ``memory_allocated`` at the start."""
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        fn()
        self.sync()
        return torch.cuda.max_memory_allocated(self.device) - base

    def bytes_in_use(self) -> int | None:
        """``torch.cuda.memory_allocated``."""
        return torch.cuda.memory_allocated(self.device)


LEAD_MS = 2.0
"""GPU spin queued before each timed CUDA call (``CUDABackend``)."""


def _spin_cycles_per_ms() -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per millisecond on this GPU."""
    torch.cuda._sleep(1_000_000)  # warm-up: clocks up, kernel loaded
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def l2_flush_bytes(props: Any) -> int:
    """Bytes to write over a GPU's L2 before a timed call: twice ``props.L2_cache_size``
    (``torch.cuda.get_device_properties``), or 256 MiB, Triton's ``do_bench`` buffer,
    where the property is missing or 0."""
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    return 2 * l2 if l2 > 0 else 256 << 20
