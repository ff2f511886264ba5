"""Data contracts between phases: Profile, TrainingSetup, Plan, and their JSON.

Every file is written with ``indent=2, sort_keys=True`` and a ``schema_version``.
Loaders reject an unknown version or a missing key with a message naming the
file, the key and the remedy (``SchemaError``). Keys listed in DESIGN.md are the
stable minimum; the extra keys here sit beside them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopart.errors import SchemaError

__all__ = [
    "SCHEMA_VERSION",
    "BlockProfile",
    "ModelInfo",
    "Plan",
    "Profile",
    "ProfileSetup",
    "RankPlan",
    "StagePlan",
    "TrainingSetup",
    "dump_json",
    "load_json",
]

SCHEMA_VERSION = 1

BLOCK_KINDS = ("embedding", "decoder_layer", "norm", "head", "block")
OPTIMIZERS = ("adam", "sgd", "none")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockProfile:
    """Cost of one block for one microbatch on one device."""

    name: str
    """FQN of the block's module in the original model (the head block is named by
    its output projection, e.g. ``lm_head``; the loss runs inside it)."""
    kind: str
    """One of ``BLOCK_KINDS``."""
    fwd_ms: float
    bwd_ms: float
    """Full backward (B + W)."""
    bwd_input_ms: float
    """B: gradient with respect to the block's input."""
    bwd_weight_ms: float
    """W: gradient with respect to the block's weights."""
    param_bytes: int
    activation_bytes: int
    """Bytes kept alive from forward to backward (parameters excluded, shared storage once)."""
    output_bytes: int
    """The block's output for one microbatch: what crosses a cut after this block."""
    transient_bytes: int
    """Peak workspace above inputs + saved activations while the block runs."""
    num_params: int = 0
    fwd_ms_spread: float = 0.0
    """Relative spread of the timed repeats: (p75 - p25) / median."""
    bwd_ms_spread: float = 0.0
    measured: tuple[str, ...] = ()
    """Names of the fields above that were measured; every other figure was estimated."""
    reused_from: str | None = None
    """Name of the identical block whose measurement was reused, if any."""
    compile_ms: float = 0.0
    """Compilation time outside the timed region (XLA backend)."""
    class_name: str = ""
    """Class of the block's module (e.g. ``LlamaDecoderLayer``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    """What model a profile describes."""

    name: str
    fingerprint: str
    """Hash of the block chain (names, kinds, parameter shapes): plans check it."""
    num_params: int
    source: str = ""
    family: str = ""
    """``llama``, ``qwen2``, ... for HF causal LMs; ``sequential`` / ``modulelist`` otherwise."""
    tied_embeddings: bool = False
    vocab_size: int = 0
    hidden_size: int = 0
    num_layers: int = 0
    layer_classes: tuple[str, ...] = ()
    """Class names of the repeated layers (NxD's ``transformer_layer_cls``)."""
    shared_modules: tuple[str, ...] = ()
    """Parameter-free modules every stage needs (e.g. ``model.rotary_emb``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSetup:
    """How a profile was taken (provenance)."""

    backend: str
    """``cpu``, ``cuda``, ``xla`` or ``analytical:<device>``."""
    device_name: str
    dtype: str
    micro_batch_size: int
    seq_len: int
    torch_version: str
    transformers_version: str = ""
    num_warmup: int = 0
    num_repeats: int = 0
    time_source: str = "measured"
    """``measured`` or ``estimated`` (analytical)."""
    memory_source: str = "measured"
    """``measured`` (allocator / saved-tensor hooks) or ``computed`` (shapes on meta)."""
    num_threads: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """Per-block latency and memory of a model on a device (``autopart profile``)."""

    model: ModelInfo
    setup: ProfileSetup
    blocks: tuple[BlockProfile, ...]
    schema_version: int = SCHEMA_VERSION
    calibration: dict[str, Any] = field(default_factory=dict)
    """Set when measured stage times were folded back in (``--calibrate``)."""

    def to_json(self) -> str:
        """Serialize to canonical JSON text."""
        return _to_json_text(self)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> Profile:
        """Parse JSON text; ``source`` names the file in error messages."""
        return _from_json_text(cls, text, source, "profile", "autopart profile")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile JSON file."""
        return cls.from_json(_read(path, "profile"), str(path))

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(self.to_json())


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

    def __post_init__(self) -> None:
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
        if self.link_bandwidth_bytes_per_s <= 0:
            raise SchemaError("link bandwidth must be positive")


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
class Plan:
    """The planner's answer (``autopart plan``)."""

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
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``{"even": {"predicted_step_ms": ..., "speedup": ..., "fits": ...}, ...}``."""
    schema_version: int = SCHEMA_VERSION
    model_name: str = ""
    partition: str = "optimal"
    setup: dict[str, Any] = field(default_factory=dict)
    """The TrainingSetup used, as a dict."""
    solver: dict[str, Any] = field(default_factory=dict)
    """``{"name": "dp"|"ilp"|..., "status": "optimal"|..., "gap": float, "seconds": float}``."""
    notes: tuple[str, ...] = ()
    """Human-readable reasons (e.g. why rank 0 holds fewer blocks)."""
    micro_batch_size: int = 0
    """Samples per microbatch the plan was made for (the profile's, or rescaled)."""
    seq_len: int = 0
    dtype: str = ""
    """The profile's dtype."""

    def __post_init__(self) -> None:
        num_stages = self.pp_size * self.virtual_stages
        assert len(self.stages) == num_stages, (len(self.stages), num_stages)
        assert len(self.pipeline_cuts) == num_stages - 1, (self.pipeline_cuts, num_stages)

    def to_json(self) -> str:
        """Serialize to canonical JSON text."""
        return _to_json_text(self)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> Plan:
        """Parse JSON text; ``source`` names the file in error messages."""
        return _from_json_text(cls, text, source, "plan", "autopart plan")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan JSON file."""
        return cls.from_json(_read(path, "plan"), str(path))

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(self.to_json())

    def stages_of_rank(self, rank: int) -> list[StagePlan]:
        """The stages ``rank`` holds, in stage order."""
        return [s for s in self.stages if s.rank == rank]


def dump_json(obj: Any) -> str:
    """Canonical JSON text (sorted keys, indent 2, trailing newline) of a dataclass or dict."""
    if dataclasses.is_dataclass(obj):
        obj = _to_plain(obj)
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def load_json(path: str | Path, what: str) -> dict[str, Any]:
    """Read a JSON object from ``path``; ``what`` names the file kind in errors."""
    text = _read(path, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                          f"regenerate the {what} file") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


# --- private helpers ---------------------------------------------------------------------------


def _read(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise SchemaError(f"{what} file {p} does not exist; check the path")
    return p.read_text()


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, float) and math.isnan(obj):
        raise SchemaError("refusing to write NaN into JSON")
    return obj


def _to_json_text(obj: Any) -> str:
    return dump_json(_to_plain(obj))


def _from_json_text(cls: type, text: str, source: str, what: str, remedy_cmd: str) -> Any:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                          f"regenerate it with `{remedy_cmd}`") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{source} holds a JSON {type(data).__name__}, expected a {what} object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{source} has {what} schema_version {version!r}, this autopart reads "
                          f"{SCHEMA_VERSION}; regenerate it with `{remedy_cmd}`")
    return _build(cls, data, source, "", remedy_cmd)


def _build(cls: type, data: Any, source: str, where: str, remedy_cmd: str) -> Any:
    if not isinstance(data, dict):
        raise SchemaError(f"{source}: {where or 'top level'} should be an object, "
                          f"got {type(data).__name__}; regenerate it with `{remedy_cmd}`")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{source} is missing key {key!r}; "
                                  f"regenerate it with `{remedy_cmd}`")
            continue
        kwargs[f.name] = _convert(hints[f.name], data[f.name], source, key, remedy_cmd)
    try:
        return cls(**kwargs)
    except (TypeError, AssertionError, SchemaError) as exc:
        raise SchemaError(f"{source}: inconsistent {where or cls.__name__} ({exc}); "
                          f"regenerate it with `{remedy_cmd}`") from None


def _convert(hint: Any, value: Any, source: str, key: str, remedy_cmd: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, source, key, remedy_cmd)
    if origin is tuple:
        (item_hint, *_) = typing.get_args(hint)
        if not isinstance(value, list):
            raise SchemaError(f"{source}: key {key!r} should be a list; "
                              f"regenerate it with `{remedy_cmd}`")
        return tuple(_convert(item_hint, v, source, f"{key}[{i}]", remedy_cmd)
                     for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner, value, source, key, remedy_cmd)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and not isinstance(value, hint):
        raise SchemaError(f"{source}: key {key!r} should be {hint.__name__}, got {value!r}; "
                          f"regenerate it with `{remedy_cmd}`")
    return value
