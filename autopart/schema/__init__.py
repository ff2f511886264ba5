"""Data contracts between phases: Profile, TrainingSetup, Plan, and their JSON.

JSON reading and writing lives in ``autopart.jsonio`` (``JsonFile``). Keys listed in
DESIGN.md are the stable minimum; the extra keys here sit beside them.
"""

from autopart.schema.parts import LEVELS, Part
from autopart.schema.plan import (
    DP_SHARDS,
    PRECISIONS,
    ZERO_STAGES,
    BaselineResult,
    HeldModule,
    Plan,
    RankPlan,
    SolverInfo,
    StagePlan,
    TrainingSetup,
    default_precision,
    precision_fields,
    setup_fields_with_precision,
)
from autopart.schema.profile import (
    BLOCK_KINDS,
    DTYPE_BYTES,
    OPTIMIZERS,
    BlockProfile,
    ModelInfo,
    Profile,
    ProfileSetup,
    RuntimeOverhead,
)

__all__ = [
    "DP_SHARDS",
    "ZERO_STAGES",
    "BLOCK_KINDS",
    "BaselineResult",
    "BlockProfile",
    "DTYPE_BYTES",
    "HeldModule",
    "LEVELS",
    "ModelInfo",
    "OPTIMIZERS",
    "PRECISIONS",
    "Part",
    "Plan",
    "Profile",
    "ProfileSetup",
    "RankPlan",
    "RuntimeOverhead",
    "SolverInfo",
    "StagePlan",
    "TrainingSetup",
    "default_precision",
    "precision_fields",
    "setup_fields_with_precision",
]
