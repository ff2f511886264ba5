"""What every timing backend is (``Backend``) and the cache flushes they know; the
backends themselves are in ``autopart.profile.backends`` and
``autopart.profile.cuda_backend``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CACHE_FLUSHES", "Backend"]

CACHE_FLUSHES = ("none", "llc", "model", "order")
"""What a backend does before each timed call: nothing, twice the last-level cache
written, or (cpu) the model's weights' worth read, the call run on a copy of the
block's weights and its input touched; (cpu) ``order`` does as ``model`` and then times
the forwards again in the model's order (``autopart.profile.order``)
(``ProfileOptions.cache_flush``, where ``auto`` picks per backend: ``AUTO_FLUSH``)."""


class Backend:
    """Runs callables on one device and times them."""

    name = "cpu"
    has_storages = True
    """Tensors expose storages, so saved-tensor and live-tensor tracking works."""
    time_source = "measured: time.perf_counter"
    memory_source = "measured: saved-tensor hooks + live-tensor dispatch mode"
    warms_a_copy = False
    """``time`` is handed a ``warm`` callable to run after its flush: the block's calls on
    a copy of its weights (the CPU ``model`` flush; ``autopart.profile.warm``)."""
    times_in_order = False
    """The profiler times the forwards again in model order (the CPU ``order`` method;
    ``autopart.profile.order``)."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.device_name = _cpu_name()

    def size_flush(self, model_bytes: int) -> None:
        """Size a flush that depends on the model (``model_bytes``: its weights); none here."""

    def time(self, fn: Callable[[], Any], hot: tuple[Any, ...] = (),
             warm: Callable[[], Any] | None = None) -> tuple[float, Any]:
        """Milliseconds ``fn`` takes on the device, and its result.

        ``hot``: tensors the call finds in cache in a pipeline (its input, just produced);
        ``warm``: the same call on a copy of the block's weights. A backend that flushes
        before the call runs ``warm`` and touches ``hot`` after the flush, untimed.
        """
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e3, out

    def sync(self) -> None:
        """Wait until the device has finished all queued work."""

    def allocator_peak(self, fn: Callable[[], Any]) -> int | None:
        """Peak allocated bytes above the start while ``fn`` runs; ``None`` if unknown."""
        fn()
        return None

    def bytes_in_use(self) -> int | None:
        """Device bytes in use now, where the runtime reports it."""
        return None

    def compile_clock_ms(self) -> float | None:
        """Milliseconds spent compiling graphs so far; ``None`` where nothing compiles."""
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"
