"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by the original model's FQNs.

Every rank writes only its own blocks, under the same keys the unpipelined model
uses (``model.layers.3.mlp.up_proj.weight``), so a pipelined checkpoint loads into
the unpipelined model (and back, or into another plan). Optimizer state is stored
flattened per FQN (``StateDictOptions(flatten_optimizer_state_dict=True)``), as
torchtitan does for pipeline parallelism.

Layout: ``{"model": {fqn: tensor}, "optim": {...}, "step": int}``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from autopart.errors import RuntimeSetupError
from autopart.runtime.pipeline import PipelinedModel

__all__ = ["load_checkpoint", "save_checkpoint"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def save_checkpoint(model: PipelinedModel | nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: str | Path, step: int) -> None:
    """Write a DCP checkpoint of ``model`` (pipelined or not), ``optimizer`` and ``step``.

    Keys are the unpipelined model's FQNs, so any plan (or none) can load it.
    Collective over the default process group when one is initialized: call it on
    every rank.

    Args:
        model: A ``PipelinedModel`` (this rank's blocks) or a whole ``nn.Module``.
        optimizer: Its optimizer, or ``None`` for weights only.
        path: Checkpoint directory.
        step: Training step stored with it.
    """
    module = _module(model)
    state: dict = {"model": module.state_dict(), "step": int(step)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    dcp.save(state, checkpoint_id=str(path), no_dist=not _distributed())


def load_checkpoint(model: PipelinedModel | nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: str | Path) -> int | None:
    """Load ``model`` (and ``optimizer``) from the DCP checkpoint at ``path``.

    A rank reads only the keys it holds, whatever plan wrote the checkpoint.

    Args:
        model: A ``PipelinedModel`` or a whole ``nn.Module``.
        optimizer: Its optimizer, or ``None`` for weights only.
        path: Checkpoint directory written by ``save_checkpoint``.

    Returns:
        The stored step, or ``None`` when the checkpoint has none (e.g. weights
        saved from an unpipelined model).

    Raises:
        RuntimeSetupError: ``path`` does not exist, or holds no optimizer state
            while ``optimizer`` is given.
    """
    saved = _saved_keys(path)
    module = _module(model)
    state: dict = {"model": module.state_dict()}
    if optimizer is not None:
        if not any(key.startswith("optim.") for key in saved):
            raise RuntimeSetupError(f"checkpoint {path} holds no optimizer state; pass "
                                    f"optimizer=None to load the weights only")
        state["optim"] = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    if "step" in saved:
        state["step"] = 0
    dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    module.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, state["optim"], options=_OPTIONS)
    return state.get("step")


def _module(model: PipelinedModel | nn.Module) -> nn.Module:
    return model.module if isinstance(model, PipelinedModel) else model


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _saved_keys(path: str | Path) -> set[str]:
    if not Path(path).is_dir():
        raise RuntimeSetupError(f"checkpoint {path} does not exist; give a directory written "
                                f"by save_checkpoint or torch.distributed.checkpoint.save")
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return set(metadata.state_dict_metadata)
