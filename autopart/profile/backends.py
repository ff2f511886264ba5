"""Timing and memory backends: ``cpu``, ``cuda`` and ``xla``.

* ``cpu``: ``time.perf_counter`` around each call, the caches flushed before it
  (``CPUBackend``); memory from saved-tensor hooks
  and a live-tensor dispatch mode (``autopart.profile.memory``).
* ``cuda``: CUDA events around each call, the host queueing ahead of the GPU
  (``autopart.profile.cuda_backend``); saved activations from saved-tensor hooks,
  transient workspace from the caching allocator.
* ``xla``: ``xm.mark_step()`` (``torch_xla.sync()``) + ``xm.wait_device_ops()``
  closes each timed region; each block is compiled by its warm-up run, outside the
  timed region, and torch_xla's ``CompileTime`` metric over the warm-up is recorded
  as ``compile_ms``. XLA tensors have no storages, so saved
  activations and transient workspace are computed from shapes on meta; where
  ``xm.get_memory_info`` reports ``bytes_used``, the bytes a forward leaves on the
  device are measured instead (``memory_source`` says which). ``torch_xla`` is
  imported only when this backend is chosen.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autopart.errors import ProfileError
from autopart.profile.backend_base import CACHE_FLUSHES, Backend

__all__ = []


class CPUBackend(Backend):
    """Host CPU, timed with ``perf_counter``; optionally with cold caches.

    ``flush="model"`` reads as many bytes as the model's weights (at most twice the
    last-level cache, sysfs) before every timed call and then touches the call's inputs:
    in a pipeline the other blocks' weights pass through the caches between two calls of
    a block, while its input was just produced (``size_flush`` sets the size once the
    model is known). ``flush="llc"`` writes over twice the last-level cache, as Triton's
    ``do_bench`` clears the GPU's L2; ``flush="none"`` times the calls back to back (warm
    caches). Which one transfers to a pipeline is what ``scripts/timing_sweep.py``
    measures (docs/timing-sweep.md).
    """

    def __init__(self, flush: str = "none", clock: str = "wall") -> None:
        super().__init__()
        if clock not in CLOCKS:
            raise ProfileError(f"unknown clock {clock!r}; expected auto, {' or '.join(CLOCKS)}")
        if clock == "thread" and torch.get_num_threads() > 1:
            raise ProfileError(f"clock 'thread' times the calling thread only, but torch runs "
                               f"{torch.get_num_threads()} threads; profile with --threads 1 "
                               f"(or --pp N on N cores) or with the wall clock")
        self.clock = clock
        if flush not in CACHE_FLUSHES:
            raise ProfileError(f"unknown cache_flush {flush!r}; expected auto, "
                               f"{', '.join(CACHE_FLUSHES)}")
        self.flush = flush
        self.size_flush(0)

    @property
    def warms_a_copy(self) -> bool:
        """The ``model`` and ``order`` flushes run the call on a copy of the weights."""
        return self.flush in ("model", "order")

    @property
    def times_in_order(self) -> bool:
        """``order``: forwards are timed again in the model's order
        (``autopart.profile.order``)."""
        return self.flush == "order"

    def size_flush(self, model_bytes: int) -> None:
        """Size the ``model`` flush by the bytes of the model's weights (``llc`` and
        ``none`` do not depend on it); call before any measured region, since the buffer
        is allocated here (memory is tracked there)."""
        llc = 2 * last_level_cache_bytes()
        model = min(max(model_bytes, 0), llc)
        self.flush_bytes = {"llc": llc, "model": model, "order": model, "none": 0}[self.flush]
        clock = ("time.thread_time (the thread's CPU time)" if self.clock == "thread"
                 else "time.perf_counter")
        sources = {
            "none": f"measured: {clock}, calls back to back (no flush)",
            "llc": f"measured: {clock}, caches flushed before each timed call "
                   f"({self.flush_bytes >> 20} MiB written)",
        }
        sources["model"] = (
            f"measured: {clock}, the model's weights' worth read before each timed call "
            f"({self.flush_bytes / 2**20:.1f} MiB), then the call run on a copy of the "
            f"block's weights and its input touched")
        sources["order"] = sources["model"] + ("; forwards scaled to their times in model "
                                               "order, backwards to the model's one backward")
        self.time_source = sources[self.flush]
        self._flush = torch.ones(self.flush_bytes // 4, dtype=torch.float32)

    def time(self, fn: Callable[[], Any], hot: tuple[Any, ...] = (),
             warm: Callable[[], Any] | None = None) -> tuple[float, Any]:
        """Milliseconds ``fn`` takes (after the flush, if any), and its result: wall time,
        or with ``clock="thread"`` the calling thread's CPU time, which a process waiting
        for a core on a shared machine does not accrue. After a ``model`` flush ``warm``
        runs (the call on a copy of the weights: warm code, cold weights) and the tensors
        in ``hot`` are read again, as a pipeline hands a block its input warm."""
        if self.flush == "llc":
            self._flush.add_(1.0)
        elif self.flush_bytes:
            self._flush.sum()
            if warm is not None:
                warm()
            for tensor in hot:
                if isinstance(tensor, torch.Tensor) and tensor.numel():
                    tensor.detach().sum()
        if self.clock == "wall":
            return super().time(fn)
        start = time.thread_time()
        out = fn()
        return (time.thread_time() - start) * 1e3, out


class XLABackend(Backend):
    """One XLA device (TPU, Trainium through torch-neuronx, ...)."""

    name = "xla"
    has_storages = False
    time_source = "measured: mark_step + wait_device_ops, compilation excluded"
    memory_source = "computed: shapes on meta"

    def __init__(self) -> None:
        try:
            import torch_xla.core.xla_model as xm
        except ImportError:
            raise ProfileError("backend 'xla' needs torch_xla, which is not installed; "
                               "install autopart[xla] (pip install 'autopart[xla]') or use "
                               "--backend cpu / analytical:trn2") from None
        import torch_xla

        self.xm = xm
        # torch_xla 2.9 deprecates xm.xla_device / xm.mark_step in favour of torch_xla.device /
        # torch_xla.sync; older builds (torch-neuronx pins its own) only have the xm spellings.
        self._xla_sync = getattr(torch_xla, "sync", None) or xm.mark_step
        get_device = getattr(torch_xla, "device", None) or xm.xla_device
        self.device = torch.device(get_device())
        self._metrics = _xla_metrics()
        hw = getattr(xm, "xla_device_hw", None)
        self.device_name = f"XLA {hw(self.device) if hw else ''} ({self.device})".strip()
        if self.bytes_in_use() is not None:
            self.memory_source = ("measured: xm.get_memory_info bytes_used after forward "
                                  "(activations); transient computed on meta")

    def time(self, fn: Callable[[], Any], hot: tuple[Any, ...] = (),
             warm: Callable[[], Any] | None = None) -> tuple[float, Any]:
        """Wall milliseconds until the graph traced by ``fn`` has run on the device."""
        start = time.perf_counter()
        out = fn()
        self.sync()
        return (time.perf_counter() - start) * 1e3, out

    def sync(self) -> None:
        """Cut the lazy graph, run it, and wait for the device.

        ``mark_step`` + ``wait_device_ops``.
        """
        self._xla_sync()
        self.xm.wait_device_ops()

    def compile_clock_ms(self) -> float | None:
        """Total XLA compilation time so far (``CompileTime`` metric), if torch_xla counts it."""
        if self._metrics is None:
            return None
        data = self._metrics.metric_data("CompileTime")
        return data[1] / 1e6 if data else 0.0

    def bytes_in_use(self) -> int | None:
        """``bytes_used`` of ``xm.get_memory_info`` where this torch_xla reports it."""
        get_info = getattr(self.xm, "get_memory_info", None)
        if get_info is None:
            return None
        try:
            info = get_info(self.device)
        except (RuntimeError, TypeError, ValueError):
            return None
        if "bytes_used" in info:
            return int(info["bytes_used"])
        if "kb_total" in info and "kb_free" in info:
            return int(info["kb_total"] - info["kb_free"]) * 1024
        return None


_DEFAULT_LLC_BYTES = 32 << 20
AUTO_FLUSH = {"cpu": "order", "cuda": "llc"}
"""``cache_flush="auto"`` per backend: on CPU ``order``, the method the timing sweep kept
(docs/timing-sweep.md, "blocks timed again in model order"); on CUDA an L2 flush, as
Triton's ``do_bench``."""
CLOCKS = ("wall", "thread")
"""``ProfileOptions.clock``: ``time.perf_counter``, or (cpu, one thread) the thread's CPU
time; ``auto`` is ``thread`` on cpu with one torch thread, else ``wall`` (``auto_clock``)."""


def auto_clock(name: str) -> str:
    """The clock ``auto`` means on backend ``name``: the thread's CPU time on one-thread
    cpu profiles (the timing sweep: under load, wall-clock profiles read 72% / 118% off
    the stages' CPU time in a pipeline, thread-clock ones 28% / 6.6%, medians of stage F /
    B; docs/timing-sweep.md), else the wall clock."""
    return "thread" if name == "cpu" and torch.get_num_threads() == 1 else "wall"


def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs), or 32 MiB where the system does not say."""
    best = 0
    for entry in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(entry).read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or _DEFAULT_LLC_BYTES


def make_backend(name: str, cache_flush: str = "auto", clock: str = "auto") -> Backend:
    """The timing backend called ``name`` (``cpu``, ``cuda`` or ``xla``).

    Args:
        name: ``cpu``, ``cuda`` or ``xla``.
        cache_flush: The flush before each timed call (``CACHE_FLUSHES`` or ``auto``,
            ``AUTO_FLUSH``): on ``cpu`` the model's weights' worth or the last-level cache,
            on ``cuda`` the L2; ``xla`` ignores it.
        clock: ``wall``, ``thread`` (cpu only: the thread's CPU time) or ``auto``
            (``auto_clock``).

    Raises:
        ProfileError: An unknown backend or flush.
    """
    if clock == "auto":
        clock = auto_clock(name)
    if cache_flush == "auto":
        cache_flush = AUTO_FLUSH.get(name, "none")
    if name == "cpu":
        return CPUBackend(cache_flush, clock)
    if clock != "wall":
        raise ProfileError(f"clock {clock!r} is for the cpu backend; {name} times with its "
                           f"own clock (use clock 'wall')")
    if name == "cuda":
        from autopart.profile.cuda_backend import CUDABackend

        return CUDABackend(cache_flush)
    backends = {"xla": XLABackend}
    if name not in backends:
        raise ProfileError(f"unknown backend {name!r}; expected cpu, cuda, xla or "
                           f"analytical:<device>")
    return backends[name]()


def _xla_metrics() -> Any:
    """``torch_xla.debug.metrics``, or ``None`` where this torch_xla has no metrics."""
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        return None
    return met if hasattr(met, "metric_data") else None
