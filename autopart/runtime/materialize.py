"""Give real storage to the blocks one rank holds, and nothing else.

A block on the meta device gets ``to_empty`` on the target device, then its values
from (in order of preference) a local safetensors checkpoint, the user's
``param_init_fn``, or a default initialization in which every module is seeded by its
own FQN, so that a parameter gets the same values whatever the plan, its granularity
(a layer whole or cut into halves, projections or slices) and the rank holding it (HF
models use the model's own ``_init_weights``; other modules their ``reset_parameters``).
Host memory never holds more than this rank's blocks.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from autopart.errors import RuntimeSetupError
from autopart.intake.storage import empty_on, init_empty_parameter, init_hf_weights

__all__ = []

logger = logging.getLogger(__name__)


class SafetensorsReader:
    """Reads single tensors by FQN from an HF safetensors file or directory."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open  # lazy: only checkpoint loading needs it

        self._open = safe_open
        self.path = Path(path)
        self._where: dict[str, Path] = {}
        if self.path.is_file():
            files = [self.path]
        elif self.path.is_dir():
            files = sorted(self.path.glob("*.safetensors"))
        else:
            raise RuntimeSetupError(f"checkpoint_path {self.path} does not exist; give a "
                                    f"safetensors file or a directory of them")
        index = self.path / "model.safetensors.index.json"
        if self.path.is_dir() and index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {k: self.path / v for k, v in weight_map.items()}
        else:
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    self._where.update({k: file for k in f.keys()})  # noqa: SIM118
        if not self._where:
            raise RuntimeSetupError(f"checkpoint_path {self.path} holds no safetensors "
                                    f"tensors; give an HF model directory saved as safetensors")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name`` (only this tensor is read)."""
        with self._open(str(self._where[name]), framework="pt") as f:
            return f.get_tensor(name)


def materialize_blocks(root: nn.Module, blocks: list[tuple[int, str]], *,
                       device: torch.device, dtype: torch.dtype | None,
                       param_init_fn: Callable[[nn.Module], None] | None,
                       checkpoint_path: str | Path | None, init_seed: int,
                       aliases: dict[str, str]) -> None:
    """Allocate and fill the blocks ``[(block_idx, fqn), ...]`` of ``root`` on ``device``.

    ``aliases`` maps a state key to another one holding the same values (tied
    embeddings: ``lm_head.weight`` -> ``model.embed_tokens.weight``).
    """
    reader = SafetensorsReader(checkpoint_path) if checkpoint_path is not None else None
    for block_idx, fqn in blocks:
        module = root.get_submodule(fqn)
        on_meta = any(t.is_meta for t in _tensors(module))
        if on_meta:
            hf = reader is None and param_init_fn is None and hasattr(root, "_init_weights")
            empty_on(module, device, fill=float("nan") if hf else None)
        else:
            module.to(device)
        if dtype is not None:
            module.to(dtype)
        if reader is not None:
            _load_block(module, fqn, reader, aliases)
        elif on_meta:
            _init_block(root, module, fqn, param_init_fn, init_seed, device)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _load_block(module: nn.Module, fqn: str, reader: SafetensorsReader,
                aliases: dict[str, str]) -> None:
    with torch.no_grad():
        for name, tensor in module.state_dict(prefix=f"{fqn}.", keep_vars=True).items():
            key = name if name in reader else aliases.get(name, name)
            if key not in reader:
                raise RuntimeSetupError(f"checkpoint {reader.path} has no tensor {name!r}; "
                                        f"it was saved from a different model")
            value = reader.get(key)
            if tuple(value.shape) != tuple(tensor.shape):
                raise RuntimeSetupError(f"checkpoint {reader.path}: {key!r} has shape "
                                        f"{tuple(value.shape)}, the model expects "
                                        f"{tuple(tensor.shape)}; it is from a different model")
            tensor.copy_(value)


def _seed(init_seed: int, fqn: str) -> int:
    """The RNG seed of the module or parameter called ``fqn``: stable across runs and ranks."""
    return init_seed * 1_000_003 + zlib.crc32(fqn.encode())


def _reset_each(module: nn.Module, fqn: str, seed_each: Callable[[str], None]) -> list[str]:
    """Each submodule's ``reset_parameters``, seeded by its FQN; the parameters none covers
    get ``init_empty_parameter``'s values, seeded by theirs. Returns those parameters."""
    covered: set[int] = set()
    for name, sub in module.named_modules(prefix=fqn):
        seed_each(name)
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if callable(reset):
            reset()
            covered.update(id(p) for p in sub.parameters(recurse=False))
    uncovered = []
    for name, p in module.named_parameters(prefix=fqn):
        if id(p) not in covered:
            uncovered.append(name)
            seed_each(name)
            init_empty_parameter(name, p)
    return uncovered


def _init_block(root: nn.Module, module: nn.Module, fqn: str,
                param_init_fn: Callable[[nn.Module], None] | None, init_seed: int,
                device: torch.device) -> None:
    """Initialize one held module: each submodule seeded by its own FQN.

    Seeding by FQN, not by the block's position in the chain, gives a parameter the same
    values whether its layer is one block or several (``half``, ``projection``, ``slice``
    plans number their blocks differently) and on every rank holding it.
    """
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        def seed_each(name: str) -> None:
            torch.manual_seed(_seed(init_seed, name))

        if param_init_fn is not None:
            seed_each(fqn)
            param_init_fn(module)
            return
        if getattr(root, "_init_weights", None) is not None:
            unset = init_hf_weights(module, root, seed_each=seed_each, prefix=fqn)
            why = "the model's _init_weights does not set"
        else:
            unset = _reset_each(module, fqn, seed_each)
            why = "no reset_parameters sets"
        if unset:
            logger.warning("%s (%s): %s %s; they got zeros, ones or N(0, 0.02); pass "
                           "param_init_fn or checkpoint_path to choose", fqn,
                           type(module).__name__, why, ", ".join(unset[:3]))
    if any(b.is_meta for b in module.buffers()) and param_init_fn is None:
        logger.warning("block %s has buffers that default initialization does not set; "
                       "pass param_init_fn or checkpoint_path", type(module).__name__)
