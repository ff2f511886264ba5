"""Memory of one block: saved activations, live-tensor peaks, byte helpers.

* ``SavedTensors``: a ``saved_tensors_hooks`` context that records every tensor
  autograd saves from the forward for the backward. Storages are deduplicated by
  their ``StorageImpl`` (``untyped_storage()._cdata``, which also works on meta),
  and storages of parameters, buffers and other excluded tensors are skipped.
* ``LiveTensors``: a ``TorchDispatchMode`` that logs every storage an op allocates
  and, through ``weakref.finalize`` on the tensors that reference it, when it is
  freed (PyTorch keeps a tensor's Python object alive as long as autograd holds
  the tensor, so the finalizer fires when the memory is really released). The peak
  of the live bytes, less storages the caller excludes (saved activations, the
  output, gradients), is the block's transient workspace.

Tensors autograd never sees (stored on ``ctx`` of a custom ``Function`` instead of
``save_for_backward``) are invisible to both, as are allocations made inside a
kernel; on CUDA the allocator's peak is used for the transient figure instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, KeysView
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensors", "storage_key"]


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the storage behind ``t`` (``None`` where there is none, e.g. XLA)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass that wraps one local tensor (a ``DTensor``, whose ops run under the
    mode without it seeing them) as that tensor; others as themselves."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def tensor_bytes(t: Any) -> int:
    """Bytes of the elements of a tensor (or of all tensors in a nested structure)."""
    return sum(x.numel() * x.element_size() for x in tree_leaves(t) if isinstance(x, torch.Tensor))


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Records the storages autograd saves for backward while the context is active."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {k for k in (storage_key(t) for t in exclude) if k is not None}
        self.storages: dict[int, int] = {}
        """storage key -> nbytes of every saved, non-excluded storage."""
        self._held: list[Any] = []
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key not in self.excluded and key not in self.storages:
            self.storages[key] = t.untyped_storage().nbytes()
            # Keys are storage addresses: hold the storage (not the tensor, whose free
            # LiveTensors watches) so that no later allocation reuses a saved key and is
            # excluded from a live-tensor peak in its place.
            self._held.append(t.untyped_storage())
        return t

    @property
    def total_bytes(self) -> int:
        """Saved bytes, each storage once."""
        return sum(self.storages.values())


class LiveTensors(TorchDispatchMode):
    """Logs allocations and frees of storages created by ops run under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        """(storage key, +nbytes on allocation / -nbytes on free), in order."""
        self._live: dict[int, list[int]] = {}
        """storage key -> [nbytes, number of live tensors referencing it]."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {storage_key(_local(t)) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(_local(t), inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int | None]) -> None:
        key = storage_key(t)
        if key is None:
            return
        if key in self._live:
            self._live[key][1] += 1
        elif key in inputs:
            return  # a view or in-place result of a storage that existed before
        else:
            nbytes = t.untyped_storage().nbytes()
            self._live[key] = [nbytes, 1]
            self.events.append((key, nbytes))
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.events.append((key, -entry[0]))

    @property
    def allocated(self) -> KeysView[int]:
        """Keys of the storages allocated under this mode and alive now."""
        return self._live.keys()

    def peak_bytes(self, exclude: set[int] = frozenset()) -> int:
        """Peak of the live bytes over the log, ignoring storages in ``exclude``."""
        current = peak = 0
        for key, delta in self.events:
            if key not in exclude:
                current += delta
                peak = max(peak, current)
        return peak
