"""The plan's contract: the training setup with its precision presets, stages, ranks,
solver and baselines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopart.errors import RuntimeSetupError, SchemaError
from autopart.jsonio import JsonFile
from autopart.schema.parts import LEVELS, Part
from autopart.schema.profile import DTYPE_BYTES, OPTIMIZERS, RuntimeOverhead

PLAN_SCHEMA_VERSION = 2
"""2: typed ``parts`` of the planned blocks, ``head_shards``, levels by their new names
(schema 1 plans are upgraded on load, ``autopart.schema.upgrade``)."""

PRECISIONS: dict[str, dict[str, Any]] = {
    # Plain torch training in one dtype: AdamW's exp_avg / exp_avg_sq are
    # zeros_like(param), so they take the parameters' dtype (torch/optim/adamw.py).
    "fp32": {"param_dtype": "float32", "grad_dtype": "float32",
             "optimizer_dtype": "float32", "master_weights": False},  # 4 + 4 + 8 = 16 B
    "bf16": {"param_dtype": "bfloat16", "grad_dtype": "bfloat16",
             "optimizer_dtype": "bfloat16", "master_weights": False},  # 2 + 2 + 4 = 8 B
    "fp16": {"param_dtype": "float16", "grad_dtype": "float16",
             "optimizer_dtype": "float16", "master_weights": False},  # 2 + 2 + 4 = 8 B
    # Mixed precision as Megatron / DeepSpeed / NeMo run it: low-precision weights for
    # compute, fp32 master weights, fp32 main gradients, fp32 Adam state.
    "bf16-mixed": {"param_dtype": "bfloat16", "grad_dtype": "float32",
                   "optimizer_dtype": "float32", "master_weights": True},  # 2+4+4+8 = 18 B
    "fp16-mixed": {"param_dtype": "float16", "grad_dtype": "float32",
                   "optimizer_dtype": "float32", "master_weights": True},  # 2+4+4+8 = 18 B
}
"""Static-memory presets: the ``TrainingSetup`` dtype fields each one sets."""
ZERO_STAGES = (0, 1, 3)
"""``zero_stage`` values: nothing sharded over dp, the optimizer state, or everything."""
DP_SHARDS = {"none": (0, False), "optimizer": (1, False), "params-per-step": (3, False),
             "params-per-microbatch": (3, True)}
"""``autopart plan --dp-shard`` names -> ``(zero_stage, reshard_after_forward)``."""
_PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSetup:
    """What the planner needs besides the profile."""

    pp_size: int
    num_microbatches: int
    optimizer: str = "adam"
    param_dtype: str = "float32"
    grad_dtype: str = "float32"
    optimizer_dtype: str = "float32"
    master_weights: bool = False
    """Keep an fp32 copy of the weights (mixed precision)."""
    memory_limit_bytes: int | None = None
    """Per-device memory limit; ``None`` means unlimited."""
    link_bandwidth_bytes_per_s: float = 50e9
    link_latency_ms: float = 0.01
    dp_size: int = 1
    """Data-parallel replicas; with ``zero_stage`` 1 or 3 they share state (``DP_SHARDS``)."""
    zero_stage: int = 0
    """What the dp replicas shard: 0 nothing; 1 the optimizer state and master weights
    (ZeRO-1); 3 parameters, gradients, optimizer state and master weights (FSDP2,
    ``fully_shard`` per block). ZeRO-2 (gradients too, parameters whole) is not offered:
    under torch's pipeline schedules gradients stay whole until the step's last backward
    anyway, so it would hold what ZeRO-1 holds."""
    reshard_after_forward: bool = False
    """With ``zero_stage`` 3: free the gathered parameters after each forward and gather
    them again for the backward (per microbatch); off, a stage's parameters are gathered
    once per step (torchtitan's default under pipeline parallelism)."""
    runtime_overhead: RuntimeOverhead | None = None
    """The pipeline runtime's own cost added to stage and step times (the profile's)."""
    router_loss_pass: bool = False
    """Each step first runs the MoE router loss's counting pass (the profile's
    ``ModelInfo.router_loss_pass``); the step adds it (``simulate.replay.counting_pass_ms``)."""

    def __post_init__(self) -> None:
        if self.dp_size < 1 or self.zero_stage not in ZERO_STAGES:
            raise SchemaError(f"dp_size ({self.dp_size}) must be >= 1 and zero_stage "
                              f"({self.zero_stage}) one of {ZERO_STAGES}")
        if self.reshard_after_forward and self.zero_stage != 3:
            raise SchemaError(f"reshard_after_forward needs zero_stage 3 (parameters "
                              f"sharded), got zero_stage {self.zero_stage}")
        if self.pp_size < 1:
            raise SchemaError(f"pp_size must be >= 1, got {self.pp_size}")
        if self.num_microbatches < 1:
            raise SchemaError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.optimizer not in OPTIMIZERS:
            raise SchemaError(f"optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")
        for name in ("param_dtype", "grad_dtype", "optimizer_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise SchemaError(
                    f"{name} {getattr(self, name)!r} is not one of {tuple(DTYPE_BYTES)}"
                )
        if not self.link_bandwidth_bytes_per_s > 0:
            raise SchemaError(f"link bandwidth must be positive, got "
                              f"{self.link_bandwidth_bytes_per_s} bytes/s")
        if not self.link_latency_ms >= 0:
            raise SchemaError(f"link latency must be >= 0 ms, got {self.link_latency_ms}")

    @property
    def precision(self) -> str:
        """The ``PRECISIONS`` preset these dtype fields match, or ``"custom"``."""
        for name, fields in PRECISIONS.items():
            if all(getattr(self, key) == value for key, value in fields.items()):
                return name
        return "custom"


def precision_fields(precision: str) -> dict[str, Any]:
    """The ``TrainingSetup`` dtype fields of a ``PRECISIONS`` preset.

    Args:
        precision: A preset name (``fp32``, ``bf16``, ``fp16``, ``bf16-mixed``, ``fp16-mixed``).

    Returns:
        ``param_dtype``, ``grad_dtype``, ``optimizer_dtype`` and ``master_weights``.

    Raises:
        SchemaError: Unknown preset.
    """
    if precision not in PRECISIONS:
        raise SchemaError(f"precision {precision!r} is not one of {tuple(PRECISIONS)}")
    return dict(PRECISIONS[precision])


def setup_fields_with_precision(fields: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``TrainingSetup`` keyword arguments with a ``precision`` preset expanded.

    Args:
        fields: Keyword arguments for ``TrainingSetup``, plus an optional ``precision``.
        dtype: The profile's dtype, whose preset applies when neither ``precision`` nor
            a dtype field is given.

    Returns:
        The arguments with the preset's dtype fields in place of ``precision``.

    Raises:
        SchemaError: Unknown preset, or a preset given together with dtype fields.
    """
    fields = dict(fields)
    precision = fields.pop("precision", None)
    explicit = sorted(key for key in PRECISIONS["fp32"] if key in fields)
    if precision is not None and explicit:
        raise SchemaError(f"precision {precision!r} sets the dtypes; do not also give "
                          f"{', '.join(explicit)}")
    if precision is None and not explicit:
        precision = default_precision(dtype)
    return fields if precision is None else {**precision_fields(precision), **fields}


def default_precision(dtype: str) -> str:
    """The preset of plain training in a profile's ``dtype`` (what ``verify`` runs)."""
    return _PRECISION_OF_DTYPE.get(dtype, "fp32")


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldModule:
    """A module a stage holds whole while holding only part of it (``autopart.cost.held``)."""

    module: str
    """The module (a half's main module, the head; the head also for a tied weight)."""
    static_bytes: int
    """Its whole parameters + gradients + optimizer state (in the stage's ``static_bytes``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage: a contiguous run of blocks on one rank."""

    index: int
    rank: int
    modules: tuple[str, ...]
    """Block FQNs in order."""
    fwd_ms: float
    bwd_ms: float
    param_count: int
    first_block_idx: int = 0
    last_block_idx: int = 0
    bwd_input_ms: float = 0.0
    bwd_weight_ms: float = 0.0
    recompute: bool = False
    """Activation checkpointing on this stage's blocks."""
    activation_bytes: int = 0
    """Activations one microbatch keeps alive in this stage (after recompute)."""
    static_bytes: int = 0
    """Parameters + gradients + optimizer state."""
    input_bytes: int = 0
    """Received from the previous stage per microbatch."""
    output_bytes: int = 0
    """Sent to the next stage per microbatch."""
    transient_bytes: int = 0
    held: tuple[HeldModule, ...] = ()
    """Modules this stage holds whole while holding only part of them, so another stage
    holds them too (a tied weight, the head cut by vocabulary, a half cut by units): a
    rank holds each once, the ranks holding one sum its gradient after the step."""
    held_for_weight_bytes: int = 0
    """Zero-bubble schedules: bytes a microbatch holds from its B until its W on top of
    ``activation_bytes`` (``autopart.cost.stage.StageCost``; 0 in plans written before it)."""
    adopted_grad_bytes: int = 0
    """The part of ``transient_bytes`` that is weight gradients, paid only by backwards
    after the stage's first in a step (``autopart.cost.stage.StageCost``; 0 in plans written
    before it)."""
    split_extra_ms: float = 0.0
    """What torch's split backward adds to the W of zero-bubble schedules
    (``BlockProfile.split_extra_ms``; 0 in plans written before it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    """What one rank holds and how busy it is."""

    rank: int
    stages: tuple[int, ...]
    peak_memory_bytes: int
    busy_ms: float
    idle_ms: float = 0.0
    memory_limit_bytes: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverInfo:
    """Which method found the plan's split, and how sure it is (``Plan.solver``)."""

    name: str
    """``dp`` or ``ilp``; or the baseline (``even``, ``params``, ``torchtitan``) whose split
    won the search or was asked for with ``partition``."""
    status: str
    """``model_optimal`` (the DP or ILP proved the split optimal for its closed-form
    model of the step; the simulator, which judges, may still find a faster split:
    see ``refined``), ``layer_optimal`` (the same, over cuts between layer halves or
    whole layers only: a seed for a profile cut inside layers), ``heuristic`` (a
    baseline partition was asked for), ``baseline``
    (a baseline split won the search), or ``limit`` (the ILP's best split when its node
    or time limit stopped it). Plans written before say ``optimal`` / ``time_limit``."""
    gap: float | None = 0.0
    """Relative gap between the ILP's split and its bound: 0 when proven optimal,
    ``None`` when the ILP stopped at its limit without reporting one."""
    objective_ms: float | None = None
    """The solver's closed-form objective, before the split was simulated."""
    backend: str = ""
    """The ILP backend (``cbc`` or ``highs``)."""
    refined: bool = False
    """The local search moved cuts and found a faster split than the solver's."""
    refine_gain: float = 0.0
    """How much faster the refined split is: solver's step / refined step - 1."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselineResult:
    """A public baseline split under the plan's schedule, v and m, simulated
    (``Plan.baselines``)."""

    predicted_step_ms: float
    """The baseline's simulated step time."""
    speedup: float
    """The baseline's step / the plan's step (above 1: the plan is faster)."""
    fits: bool
    """Every rank's simulated peak is within the memory limit."""
    peak_memory_bytes: int
    """The largest simulated rank peak."""
    stage_num_blocks: tuple[int, ...] = ()
    """Blocks per stage, in stage order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan(JsonFile):
    """The planner's answer (``autopart plan``)."""

    _json_what = "plan"
    _json_remedy = "autopart plan"
    _json_version = PLAN_SCHEMA_VERSION

    profile_fingerprint: str
    pp_size: int
    virtual_stages: int
    schedule: str
    num_microbatches: int
    pipeline_cuts: tuple[str, ...]
    stages: tuple[StagePlan, ...]
    ranks: tuple[RankPlan, ...]
    predicted_step_ms: float
    bubble_fraction: float
    setup: TrainingSetup
    """The training setup the plan was made for: optimizer, dtypes, memory limit, links.
    Its ``pp_size`` and ``num_microbatches`` repeat the plan's at planning time; the
    plan's own fields are the ones that run and are simulated."""
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    """Each public baseline (``even``, ``params``, ``torchtitan``) by name."""
    schema_version: int = PLAN_SCHEMA_VERSION
    model_name: str = ""
    partition: str = "optimal"
    """``optimal``, or the baseline partition that was asked for."""
    solver: SolverInfo | None = None
    """How the split was found; ``None`` for plans written by hand."""
    notes: tuple[str, ...] = ()
    """Human-readable reasons (e.g. why rank 0 holds fewer blocks)."""
    granularity: str = "layer"
    """The level the plan cuts at (``autopart.schema.parts.LEVELS``): ``layer``, ``half``,
    ``projection`` or ``slice``."""
    head_shards: int = 0
    """Vocabulary shards the head is cut into (0: whole)."""
    parts: dict[str, tuple[Part, ...]] = field(default_factory=dict)
    """For every block of ``stages[].modules`` that is part of a module's call, its parts
    (``BlockProfile.parts``), by block name."""
    micro_batch_size: int = 0
    """Samples per microbatch the plan was made for (the profile's, or rescaled)."""
    seq_len: int = 0
    dtype: str = ""
    """The profile's dtype."""
    tp_size: int = 1
    """Tensor-parallel degree: devices (within one node) that shard every stage."""
    sequence_parallel: bool = True
    """With ``tp_size`` above 1: the residual stream between the split layers is sharded
    along the sequence (Megatron's sequence parallelism; the norms run on the shards and
    a pipeline cut sends one shard per tp rank), as the plan was priced
    (``autopart.cost.mesh``). Plans written before this key planned with it on."""
    dp_size: int = 1
    """Data-parallel replicas of the whole pipeline; the mesh is tp x pp x dp devices."""
    zero_stage: int = 0
    """What the dp replicas shard (``TrainingSetup.zero_stage``): 0 nothing, 1 optimizer
    state (ZeRO-1), 3 parameters, gradients and optimizer state (FSDP2)."""
    reshard_after_forward: bool = False
    """With ``zero_stage`` 3: parameters gathered per microbatch (True) or per step."""
    grad_sync_ms: float = 0.0
    """Data-parallel gradient all-reduce time that runs past the pipeline's end; the
    predicted step with data parallelism is ``predicted_step_ms + grad_sync_ms``."""
    profile_threads: int = 0
    """torch threads per process the profile was measured with (0: unknown); on CPU a
    rank with another thread count runs at another speed."""

    def __post_init__(self) -> None:
        # Plans come from users' files: check with exceptions, which ``python -O`` keeps.
        for name in ("pp_size", "virtual_stages", "num_microbatches", "tp_size", "dp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SchemaError(f"plan {name} must be an integer >= 1, got {value!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise SchemaError(f"plan zero_stage must be one of {ZERO_STAGES}, got "
                              f"{self.zero_stage!r}")
        if self.reshard_after_forward and self.zero_stage != 3:
            raise SchemaError(f"plan reshard_after_forward needs zero_stage 3, got "
                              f"{self.zero_stage}")
        num_stages = self.pp_size * self.virtual_stages
        if len(self.stages) != num_stages:
            raise SchemaError(f"plan has {len(self.stages)} stage(s), expected pp_size x "
                              f"virtual_stages = {self.pp_size} x {self.virtual_stages} = "
                              f"{num_stages}")
        if len(self.pipeline_cuts) != num_stages - 1:
            raise SchemaError(f"plan has {len(self.pipeline_cuts)} pipeline cut(s) for "
                              f"{num_stages} stages, expected {num_stages - 1} (one after "
                              f"every stage but the last)")
        if len(self.ranks) != self.pp_size:
            raise SchemaError(f"plan lists {len(self.ranks)} rank(s), expected pp_size = "
                              f"{self.pp_size}")
        bad = [s.index for s in self.stages if not 0 <= s.rank < self.pp_size]
        if bad:
            raise SchemaError(f"plan places stage(s) {bad} on ranks outside 0..{self.pp_size - 1}")
        if self.granularity not in LEVELS:
            raise SchemaError(f"plan granularity {self.granularity!r} is not one of {LEVELS}")

    @classmethod
    def _json_upgrade(cls, data: dict[str, Any], version: Any) -> dict[str, Any] | None:
        """Schema 1 plans load (``autopart.schema.upgrade.plan_from_v1``)."""
        from autopart.schema.upgrade import plan_from_v1

        return plan_from_v1(data) if version == 1 else None

    def parts_of(self, name: str) -> tuple[Part, ...]:
        """The parts of the planned block ``name`` (empty for a whole module)."""
        return self.parts.get(name, ())

    def check_model(self, fingerprint: str, model: str = "this model") -> None:
        """Refuse to run the plan on a model other than the one it was planned for.

        Args:
            fingerprint: The model's block-chain fingerprint (``BlockChain.fingerprint``).
            model: How to name the model in the message.

        Raises:
            RuntimeSetupError: ``fingerprint`` is not the plan's ``profile_fingerprint``.
        """
        if fingerprint != self.profile_fingerprint:
            raise RuntimeSetupError(
                f"the plan was made for another model (profile fingerprint "
                f"{self.profile_fingerprint}, {model} has {fingerprint}); profile and plan "
                f"{model} again")

    def stages_of_rank(self, rank: int) -> list[StagePlan]:
        """The stages one rank holds.

        Args:
            rank: A pipeline rank, ``0 .. pp_size - 1``.

        Returns:
            Its stages, in stage order (empty for a rank outside the plan).
        """
        return [s for s in self.stages if s.rank == rank]
