"""``ProfileOptions``: how ``profile_model`` measures, in one typed object (no torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopart.errors import ProfileError, unknown_field

__all__ = ["ProfileOptions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    """What to measure and how (``autopart profile``'s flags); the defaults are the CLI's."""

    backend: str = "cpu"
    """``cpu``, ``cuda``, ``xla`` or ``analytical:<device>`` (a key of
    ``profiles/devices.json``)."""
    micro_batch_size: int = 1
    """Sequences per microbatch."""
    seq_len: int = 128
    """Tokens per sequence."""
    dtype: str = "float32"
    """``float32``, ``bfloat16`` or ``float16``."""
    num_warmup: int = 3
    """Untimed runs per block before measuring."""
    num_repeats: int = 10
    """Timed runs per block (the median is kept)."""
    layer_classes: tuple[str, ...] | None = None
    """Class names of the repeated layers, overriding discovery."""
    leaf_modules: tuple[str, ...] | None = None
    """Class names never split into smaller blocks."""
    granularity: str = "projection"
    """The finest level to measure (``autopart.schema.parts.LEVELS``): ``projection`` (each
    decoder layer's attention and MLP halves, each cut before its output projection where
    that cut is exact), ``half`` or ``layer``. Identical parts are measured once."""
    neighbours: int = 0
    """CPU only: other processes that profile the same model while it is measured,
    standing in for the pipeline's other ranks (``autopart profile --pp N``: ``N - 1``)."""
    cache_flush: str = "auto"
    """Before every timed call: ``none`` times each call right after the previous one;
    ``model`` (cpu) reads as many bytes as the model's weights, runs the call on a copy of
    the block's weights and touches its input (in a pipeline the other blocks' weights
    pass through the caches between two calls of a block, while its code and input are
    warm); ``llc`` writes over twice the last-level cache (cpu) or zeroes twice the L2
    (cuda); ``auto`` is ``model`` on cpu (chosen by ``scripts/timing_sweep.py``, see
    docs/timing-sweep.md) and ``llc`` on cuda, as Triton's ``do_bench``."""
    clock: str = "auto"
    """``wall`` (``time.perf_counter``); on cpu with one thread ``thread``: the thread's
    CPU time, which waiting for a core on a shared machine does not add to; ``auto``:
    ``thread`` on one-thread cpu profiles, else ``wall``."""

    @classmethod
    def of(cls, options: ProfileOptions | None = None, **fields: Any) -> ProfileOptions:
        """``options`` with ``fields`` replaced (a new object from ``fields`` alone).

        Raises:
            ProfileError: A field that ``ProfileOptions`` does not have.
        """
        unknown = unknown_field(cls, fields)
        if unknown:
            raise ProfileError(f"unknown profile option {unknown[0]!r}; options are "
                               f"{unknown[1]}")
        for key in ("layer_classes", "leaf_modules"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        return cls(**fields) if options is None else dataclasses.replace(options, **fields)

    def as_fields(self) -> dict[str, Any]:
        """The options as keyword arguments of ``profile_model``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
