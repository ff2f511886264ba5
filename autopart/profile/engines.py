"""Engines: turn one materialized block task into its time and memory figures.

``MeasuringEngine`` times on a real backend (cpu, cuda, xla); ``AnalyticalEngine``
estimates on meta from a device spec. Both report which fields were measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopart.profile.analytical import estimate_times, flash_sdpa
from autopart.profile.backends import Backend, make_backend
from autopart.profile.devices import DeviceSpec, load_device_spec, parse_backend
from autopart.profile.materialize import materialize_block
from autopart.profile.measure import (
    MemoryFigures,
    TimeFigures,
    measure_times_clean,
    memory_pass,
)
from autopart.profile.memory import tensor_bytes
from autopart.profile.tasks import BlockTask

__all__ = []

_TIMES = ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms")
_MEMORY = ("activation_bytes", "output_bytes", "transient_bytes")


@dataclass(frozen=True, slots=True)
class Figures:
    """Everything an engine found out about one block."""

    times: TimeFigures
    memory: MemoryFigures
    measured: tuple[str, ...]


class MeasuringEngine:
    """Measures blocks on a real device."""

    def __init__(self, backend: Backend, num_warmup: int, num_repeats: int) -> None:
        self.backend = backend
        self.device = backend.device
        self.device_name = backend.device_name
        self.num_warmup, self.num_repeats = num_warmup, num_repeats
        self.memory_source = backend.memory_source
        self.dtype: torch.dtype = torch.float32
        """Set by the profiler: the dtype of meta copies (XLA computes memory on meta)."""

    @property
    def time_source(self) -> str:
        """How the backend times (its flush is sized once the model is known)."""
        return self.backend.time_source

    def measure(self, task: BlockTask, block_module: nn.Module) -> Figures:
        """Time ``task`` on the device and measure (or, on XLA, compute) its memory."""
        times = measure_times_clean(task, self.backend, self.num_warmup, self.num_repeats)
        measured = (*_TIMES, "param_bytes") + (("split_extra_ms",) if times.split_extra_ms
                                                 else ())
        if self.backend.has_storages:
            return Figures(times, memory_pass(task, self.backend), (*measured, *_MEMORY))
        memory = self._meta_memory(task, block_module)
        activation = self._device_activation_bytes(task)
        if activation is not None:
            memory = MemoryFigures(activation_bytes=activation, output_bytes=memory.output_bytes,
                                   transient_bytes=memory.transient_bytes)
            measured = (*measured, "activation_bytes")
        return Figures(times, memory, measured)

    def _meta_memory(self, task: BlockTask, block_module: nn.Module) -> MemoryFigures:
        assert task.meta_task is not None, "tasks carry their meta twin"
        meta_module = materialize_block(block_module, torch.device("meta"), self.dtype)
        meta_task = task.meta_task(meta_module)
        with flash_sdpa():
            return memory_pass(meta_task)

    def _device_activation_bytes(self, task: BlockTask) -> int | None:
        """Device bytes a forward leaves in use (saved activations + output), less the output."""
        before = self.backend.bytes_in_use()
        if before is None:
            return None
        self.backend.sync()
        before = self.backend.bytes_in_use()
        out = task.forward()
        self.backend.sync()
        after = self.backend.bytes_in_use()
        size = tensor_bytes(out)
        del out
        return max(after - before - size, 0) if after is not None else None


class AnalyticalEngine:
    """Estimates blocks on meta with a device spec; allocates nothing."""

    time_source = "estimated: roofline per op (FLOPs, bytes) with profiles/devices.json"
    memory_source = "computed: shapes on meta (attention counted as flash attention)"

    def __init__(self, spec: DeviceSpec, dtype: str) -> None:
        self.spec, self.dtype = spec, dtype
        self.device = torch.device("meta")
        self.device_name = spec.name

    def measure(self, task: BlockTask, block_module: nn.Module) -> Figures:
        """Roofline times and shape-computed memory of the meta ``task``."""
        times = estimate_times(task, self.spec, self.dtype)
        with flash_sdpa():
            memory = memory_pass(task)
        return Figures(times, memory, ())


def make_engine(backend: str, dtype: str, num_warmup: int, num_repeats: int,
                cache_flush: str = "auto", clock: str = "auto"
                ) -> MeasuringEngine | AnalyticalEngine:
    """The engine for a validated backend string (``cache_flush`` and ``clock``: the
    measuring backend's, ``make_backend``)."""
    name = parse_backend(backend)
    if name.device is not None:
        return AnalyticalEngine(load_device_spec(name.device), dtype)
    return MeasuringEngine(make_backend(name.kind, cache_flush, clock), num_warmup, num_repeats)
