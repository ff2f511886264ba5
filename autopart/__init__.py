"""autopart: automatic pipeline parallelism for PyTorch training.

Profile every block of a model on the target device, solve for the pipeline cuts,
virtual stages, schedule and microbatch count that give the fastest step within
each device's memory, and run that plan on ``torch.distributed.pipelining``::

    profile = autopart.profile_model("llama-3-8b", backend="analytical:h100", seq_len=4096)
    plan = autopart.make_plan(profile, pp_size=8, num_microbatches=32,
                              memory_limit_bytes=80 * 2**30)
    model = autopart.auto_pipeline("llama-3-8b", plan=plan, loss_fn=None)  # under torchrun

Heavy submodules (torch, transformers, pulp) load on first use of a name below.
"""

from __future__ import annotations

import importlib
from typing import Any

from autopart.errors import (
    AutopartError,
    InfeasibleError,
    ModelSourceError,
    PlanError,
    ProfileError,
    RuntimeSetupError,
    SchemaError,
)
from autopart.schema import BlockProfile, Plan, Profile, TrainingSetup

__version__ = "0.1.0"

# Public entry points, by the module that defines them; loaded lazily.
_LAZY = {
    "load_model": "autopart.intake",
    "discover_blocks": "autopart.intake",
    "list_presets": "autopart.intake",
    "profile_model": "autopart.profile",
    "load_device_spec": "autopart.profile",
    "list_devices": "autopart.profile",
    "simulate": "autopart.simulate",
    "make_plan": "autopart.solve",
    "export_plan": "autopart.export",
    "auto_pipeline": "autopart.runtime",
    "PipelinedModel": "autopart.runtime",
    "save_checkpoint": "autopart.runtime",
    "load_checkpoint": "autopart.runtime",
}

__all__ = [
    "AutopartError",
    "BlockProfile",
    "InfeasibleError",
    "ModelSourceError",
    "PipelinedModel",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "RuntimeSetupError",
    "SchemaError",
    "TrainingSetup",
    "__version__",
    "auto_pipeline",
    "discover_blocks",
    "export_plan",
    "list_devices",
    "list_presets",
    "load_checkpoint",
    "load_device_spec",
    "load_model",
    "make_plan",
    "profile_model",
    "save_checkpoint",
    "simulate",
]
assert set(_LAZY) <= set(__all__)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopart' has no attribute {name!r}")
