"""Busy neighbours: measure a CPU rank's blocks while the other ranks of its machine work.

Ranks that share one CPU share its memory bandwidth and last-level cache, so a block
runs slower inside a pipeline than when it is measured alone on an idle machine (on a
2-core machine, 6-10% over a small Llama's blocks and up to 20% on a memory-bound
head). ``autopart profile --pp N`` on CPU therefore measures with ``N - 1`` neighbours:
processes with the same thread count that profile the same model at the same time, so
each block is measured while the neighbours run that model's own kernels, as the
other ranks will. The neighbours' figures are thrown away.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autopart.errors import ProfileError

__all__ = []

_READY_TIMEOUT_S = 300.0


@contextmanager
def busy_neighbours(source: Any, count: int, num_threads: int, settings: dict[str, Any],
                    work: Callable[..., Any]) -> Iterator[None]:
    """Run ``count`` neighbour processes profiling ``source`` until the block exits.

    Args:
        source: The model source (a string: preset, HF config path, ``pkg.module:factory``);
            each neighbour builds its own copy.
        count: Neighbours to start (0: none, the block runs alone).
        num_threads: torch threads of each neighbour.
        settings: Keyword arguments of ``work`` (shape, dtype, repeats...).
        work: What each neighbour runs over and over, ``work(loaded_model, **settings)``
            (``profile_model``; a module-level function, since neighbours are spawned).

    Raises:
        ProfileError: ``source`` is not a string, or a neighbour failed to start.
    """
    if count <= 0:
        yield
        return
    if not isinstance(source, str):
        raise ProfileError("profiling with busy neighbours needs the model as a source string "
                           "(preset, config path or pkg.module:factory), not a module object; "
                           "pass neighbours=0 to measure alone")
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), [ctx.Event() for _ in range(count)]
    procs = [ctx.Process(target=_neighbour_main, daemon=True,
                         args=(source, num_threads, settings, work, stop, flag)) for flag in ready]
    try:
        for proc in procs:
            proc.start()
        for proc, flag in zip(procs, ready):
            if not flag.wait(_READY_TIMEOUT_S) or not proc.is_alive():
                raise ProfileError(f"a busy neighbour (pid {proc.pid}) did not start "
                                   f"(exit code {proc.exitcode}); profile with --neighbours 0 "
                                   f"to measure alone")
        yield
    finally:
        stop.set()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(10)


def _neighbour_main(source: str, num_threads: int, settings: dict[str, Any],
                    work: Callable[..., Any], stop: Any, ready: Any) -> None:
    """A neighbour: build the model, say so, then profile it over and over until stopped."""
    from autopart.intake import load_model

    torch.set_num_threads(num_threads)
    loaded = load_model(source)
    ready.set()
    while not stop.is_set():
        work(loaded, **settings)
