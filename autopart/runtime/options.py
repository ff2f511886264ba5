"""``RuntimeOptions``: how ``auto_pipeline`` builds this rank's stages, in one typed object."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.errors import RuntimeSetupError, unknown_field

__all__ = ["RuntimeOptions"]


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """Where this rank's stages live and how their blocks get their weights."""

    device: torch.device | str | None = None
    """Where this rank's blocks live (default: the current CUDA device, else the CPU)."""
    pp_group: dist.ProcessGroup | None = None
    """The pipeline's process group when it is not the whole world."""
    device_mesh: Any = None
    """A DeviceMesh with a ``"pp"`` dimension and optional ``"dp"`` and ``"tp"`` ones
    (instead of ``pp_group``). Without either the groups come from the plan: the world
    must have ``pp_size * dp_size * tp_size`` ranks, laid out as ``("pp", "dp", "tp")``."""
    param_init_fn: Callable[[nn.Module], None] | None = None
    """``param_init_fn(block)`` initializes a materialized block."""
    dtype: torch.dtype | None = None
    """Cast the blocks to this dtype (default: the plan's parameter dtype, the dtype its
    profile measured in, where it is narrower than the model's and no ``autocast_dtype``
    is given; else the model's own)."""
    activation_checkpointing: bool | str | None = None
    """``"plan"`` (the stages the plan marks), ``True`` (every stage) or ``None``."""
    checkpoint_path: str | Path | None = None
    """Local safetensors file or directory to load weights from."""
    autocast_dtype: torch.dtype | None = None
    """Run the forward under ``torch.autocast`` in this dtype."""
    init_seed: int = 0
    """Seed of the default per-block initialization."""

    @classmethod
    def of(cls, options: RuntimeOptions | None = None, **fields: Any) -> RuntimeOptions:
        """``options`` with ``fields`` replaced (a new object from ``fields`` alone).

        Raises:
            RuntimeSetupError: A field that ``RuntimeOptions`` does not have.
        """
        unknown = unknown_field(cls, fields)
        if unknown:
            raise RuntimeSetupError(f"unknown auto_pipeline option {unknown[0]!r}; options are "
                                    f"plan, loss_fn, options, plan_options, profile_options "
                                    f"and {unknown[1]}")
        return cls(**fields) if options is None else dataclasses.replace(options, **fields)
