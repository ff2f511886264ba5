"""The profile's contract: blocks, the model, how it was measured, the machine check."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopart.errors import SchemaError
from autopart.jsonio import JsonFile
from autopart.schema.parts import LEVELS, Part

BLOCK_KINDS = ("embedding", "decoder_layer", "attention", "mlp", "norm", "head", "block")
"""``attention`` and ``mlp``: the two halves of a decoder layer (``half`` level and finer)."""
PROFILE_SCHEMA_VERSION = 2
"""2: blocks carry typed ``parts`` and levels have their new names (schema 1 files are
upgraded on load, ``autopart.schema.upgrade``)."""
_NON_NEGATIVE_BLOCK_FIELDS = ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms", "param_bytes",
                              "activation_bytes", "output_bytes", "transient_bytes",
                              "num_params", "compile_ms", "held_for_weight_bytes",
                              "adopted_grad_bytes", "glue_after_ms", "stand_in_ms", "walk_ms",
                              "split_extra_ms", "glue_saved_bytes")
OPTIMIZERS = ("adam", "sgd", "none")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockProfile:
    """Cost of one block for one microbatch on one device."""

    name: str
    """FQN of the block's last module in the original model (the head block is named by
    its output projection, e.g. ``lm_head``; the loss runs inside it); a derived part is
    named ``<module>.slice<i>of<k>`` or ``<module>.shard<i>of<k>`` (``parts`` says what it
    is; names are for people)."""
    kind: str
    """One of ``BLOCK_KINDS``."""
    fwd_ms: float
    bwd_ms: float
    """Full backward (B + W)."""
    bwd_input_ms: float
    """B: gradient with respect to the block's input."""
    bwd_weight_ms: float
    """W: gradient with respect to the block's weights (full backward - B)."""
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
    modules: tuple[str, ...] = ()
    """Every module FQN of the block, in call order, when it fuses several (GPT-2's
    ``transformer.wte`` and ``transformer.wpe``); empty means just ``name``."""
    expert_load: tuple[float, ...] = ()
    """MoE layers: (max / mean, min / mean) tokens per expert over the profiled routing."""
    noisy: bool = False
    """The measurement was disturbed: its repeats still spread more than 20% after
    re-measuring, or a re-measure disagreed (then the median of three is kept)."""
    num_measurements: int = 1
    """How many times the block's call was timed (more when it was disturbed)."""
    split_extra_ms: float = 0.0
    """What torch's split backward costs beyond the full one: ``stage_backward_input`` +
    ``stage_backward_weight`` (its graph walk per parameter group, each weight's gradient
    made apart and added into ``.grad``) - ``bwd_ms``. Zero-bubble schedules pay it in
    their W (0: not measured, analytical)."""
    parts: tuple[Part, ...] = ()
    """What module calls this block is a part of, outermost first (``autopart.schema.parts``);
    empty for a whole module."""
    held_for_weight_bytes: int = 0
    """Gradients the block's B keeps alive until its W when a zero-bubble schedule runs
    them apart, on top of ``activation_bytes``: torch's ``stage_backward_input`` stores
    the gradient flowing into every op that feeds a weight (one per linear layer: its
    output's size) for ``stage_backward_weight``. Measured by the profiler (on meta for
    ``analytical``); 0 in profiles written before this field, which models B..W as
    holding the activations alone."""
    adopted_grad_bytes: int = 0
    """The part of ``transient_bytes`` that is the block's weight gradients (measured with
    the gradients ``None``, as after ``zero_grad()``). A stage's first backward in a step
    hands them to the parameters' ``.grad`` (static memory) and a forward computes none,
    so there the workspace is ``transient_bytes - adopted_grad_bytes``; later backwards
    add into ``.grad`` and pay them as workspace. Measured from the live-tensor log on
    CPU, meta and CUDA (there capped at the allocator's workspace); 0 in profiles written
    before this field, or by CUDA before it was measured there, which counts the whole
    workspace on every action."""
    glue_after_ms: float = 0.0
    """The model's own code after the block's calls up to the next block's (after the
    last block: to the end of the forward): residual adds, norms between blocks, the
    output's assembly. A stage runs it when it holds the block (``ProfileSetup.
    glue_fwd_ms`` less every block's ``glue_after_ms`` runs before the first block, on
    every stage). 0 in profiles written before this field, which charge the whole glue
    to every stage."""
    glue_saved_bytes: int = 0
    """The part of ``activation_bytes`` that the model's own code after the block saves
    for its backward (Gemma 2's soft-capped logits after the head: its ``tanh``'s output).
    A head cut into shards repeats that code on each slice (``intake.head_split.
    logit_ops``), so each shard holds its share. 0 in profiles written before this
    field."""
    stand_in_ms: float = 0.0
    """Per F, what a stage after the block pays to stand in for its calls (zeros of its
    output's shape, ``autopart.intake.forward.StandIn``)."""
    walk_ms: float = 0.0
    """Per F, what a stage starting at this block pays when the block starts inside its
    module's parent's call (a split half's ``C``): the parent's code run on meta up to
    it (``autopart.runtime.stages``)."""

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_KINDS:
            raise SchemaError(f"block {self.name!r} has kind {self.kind!r}, expected one of "
                              f"{BLOCK_KINDS}")
        for name in _NON_NEGATIVE_BLOCK_FIELDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise SchemaError(f"block {self.name!r} has {name} = {value!r}, expected a "
                                  f"finite number >= 0")
        if self.adopted_grad_bytes > self.transient_bytes:
            raise SchemaError(f"block {self.name!r} has adopted_grad_bytes "
                              f"({self.adopted_grad_bytes}) > transient_bytes "
                              f"({self.transient_bytes}); it is a part of it: profile again")

    @property
    def layer(self) -> str:
        """FQN of the decoder layer this block is a part of (empty for other blocks)."""
        return self.parts[0].module if self.parts and self.parts[0].axis == "calls" else ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    """What model a profile describes."""

    name: str
    fingerprint: str
    """Hash of the block chain (names, kinds, parameter shapes): plans check it."""
    num_params: int
    source: str = ""
    family: str = ""
    """``llama``, ``qwen2``, ... for HF causal LMs; ``sequential`` or ``traced`` otherwise."""
    tied_embeddings: bool = False
    vocab_size: int = 0
    hidden_size: int = 0
    num_layers: int = 0
    layer_classes: tuple[str, ...] = ()
    """Class names of the repeated layers (NxD's ``transformer_layer_cls``)."""
    shared_modules: tuple[str, ...] = ()
    """Parameter-free modules every stage needs (e.g. ``model.rotary_emb``)."""
    head_split_rows: int = 0
    """Rows of the head's weight when the head can be split by vocabulary (an HF causal
    LM whose ``nn.Linear`` head's output is returned unchanged), else 0; planning at
    ``auto`` granularity splits it into shard blocks (``autopart.intake.head_split``)."""
    router_loss_pass: bool = False
    """The HF config asks for the MoE router's load-balancing loss, which the runtime adds
    (``autopart.runtime.aux_loss.router_loss_spec``): each step first runs a forward-only
    pass of the schedule (a whole step under split-backward schedules) to count the
    routing. Plans add that pass to the step (``TrainingSetup.router_loss_pass``)."""
    slice_units: dict[str, int] = field(default_factory=dict)
    """Per half kind (``attention``, ``mlp``), the units its halves' modules sum over (KV
    heads, MLP columns) when every half of that kind can be cut inside its call, checked
    on the profiling backend (``autopart.intake.slice_rules``); planning at the ``slice``
    level cuts such halves into parts along ``units`` (``<module>.slice<i>of<k>``)."""
    slice_modules: dict[str, str] = field(default_factory=dict)
    """Per kind in ``slice_units``, the module each half of that kind sums over units, by
    its name inside the layer (``self_attn``, ``mlp``)."""
    notes: tuple[str, ...] = ()
    """One line each on how the model is served: eager attention where transformers
    has no SDPA for the family, blocks fused because no exact cut separates their
    modules, MoE routing spread, how the router's auxiliary loss is added."""


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
    glue_fwd_ms: float = 0.0
    """The model's own code between blocks (masks, rotary tables, embedding scaling) for
    one microbatch's forward; every pipeline stage runs it per F (0: not measured)."""
    head_grad_ms: float = 0.0
    """A fresh zero-filled tensor the size of the head's weight: the dense gradient a rank
    with vocabulary shards of the head creates once per step, into which the shards add
    their rows (``autopart.profile.head_grad``); measured or estimated as
    ``time_source`` says (0: not recorded)."""
    head_slice_fwd_ratio: float = 0.0
    """The runtime's sliced loss over the model's own, forward cost per vocabulary row, on
    the head's shapes (``autopart.profile.head_grad.measure_slice_costs``): vocabulary
    shards take their share of the head's times scaled by it (0: not measured, as the
    head)."""
    head_slice_bwd_ratio: float = 0.0
    """The same for the backward."""
    head_slice_fwd_ms: float = 0.0
    """The sliced loss's forward ms per call whatever its rows: a stage with shards pays it
    once per microbatch (they run as one slice)."""
    head_slice_bwd_ms: float = 0.0
    """The same for the backward."""
    load_average: tuple[float, ...] = ()
    """1-minute load average before and after measuring (empty for analytical profiles):
    above the core count, other work shared the CPU and the times are suspect."""
    attn_implementation: str = ""
    """HF attention kernel the model was profiled with (``sdpa``, or ``eager`` where the
    family has no SDPA path); empty for other models."""
    granularity: str = "layer"
    """The finest level of ``autopart.schema.parts.LEVELS`` the blocks are cut at:
    ``layer`` (whole decoder layers), ``half`` (their two halves) or ``projection`` (halves
    cut before their output projection too, where exact); ``slice`` only in profiles a
    planner derived."""
    device_memory_bytes: int = 0
    """Memory of the profiled device: a GPU's or NeuronCore's capacity, the machine's RAM on
    CPU, the spec's for analytical profiles (0: unknown). Plans default their memory limit
    to it when no device spec matches (``autopart.solve.options.memory_limit_of``)."""
    neighbours: int = 0
    """CPU: processes that profiled the same model on this machine while it was measured,
    standing in for the pipeline's other ranks (``--pp N``: ``N - 1``; 0: measured alone)."""

    def __post_init__(self) -> None:
        if self.granularity not in LEVELS:
            raise SchemaError(f"granularity {self.granularity!r} is not one of "
                              f"{LEVELS}; profile again")
        if self.neighbours < 0:
            raise SchemaError(f"neighbours must be >= 0, got {self.neighbours}")
        if self.micro_batch_size < 1 or self.seq_len < 1:
            raise SchemaError(f"micro_batch_size ({self.micro_batch_size}) and seq_len "
                              f"({self.seq_len}) must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeOverhead:
    """The pipeline runtime's own work on one machine, measured once with empty stages.

    ``autopart calibrate --machine`` runs ``torch.distributed.pipelining`` with stages
    that compute almost nothing; what their actions still cost is the runtime's
    (``autopart.verify.machine``). The cost model adds it to every stage's F and B and
    every step (``autopart.cost.stage``), so block times stay the blocks' own.
    """

    fwd_action_ms: float
    """Per forward action (``forward_one_chunk``), beyond the blocks' compute."""
    bwd_action_ms: float
    """Per backward action (``backward_one_chunk``), beyond the blocks' compute; the
    weight-only W actions of zero-bubble schedules are not charged."""
    p2p_ms: float
    """Per send or receive a rank posts (charged to the F or B that posts it)."""
    step_ms: float
    """Per step: schedule set-up, microbatch split, loss bookkeeping, gradient scaling."""
    link_latency_ms: float
    """One-way latency of a small message between two ranks of this machine."""
    link_bandwidth_bytes_per_s: float
    """Bandwidth of a 4 MiB message between two ranks of this machine."""
    backend: str
    """Process-group backend it was measured on (``gloo``, ``nccl``)."""
    num_threads: int
    """torch threads per rank during the check."""
    hostname: str = ""
    torch_version: str = ""
    measured_at: str = ""
    """UTC time of the check (ISO 8601)."""
    load_average: float = 0.0
    """1-minute load average when the check started."""
    runtime_p2p_ms: float = 0.0
    """Per send or receive posted by torch's action runtime (``_PipelineScheduleRuntime``:
    every multi-stage schedule), which posts each as its own action, measured with stages
    that compute: the runtime's bookkeeping per action and the posts that wait for a core
    held by the other rank's compute. 0: not measured (a check before version 3); such
    schedules are then charged ``p2p_ms``."""
    gpipe_p2p_ms: float = 0.0
    """Per send or receive under GPipe, which waits its forward sends only after every
    forward and its backward sends when the step ends, so its posts cost more than
    1F1B's; fitted by the CPU rehearsal's GPipe run (``autopart.verify.rehearse``).
    0: not measured; GPipe is then charged ``p2p_ms``."""
    allreduce_latency_ms: float = 0.0
    """Fixed ms of one all-reduce of a gradient between the two ranks (flatten, sum, copy
    back, as the runtime sums a weight held on several ranks)."""
    allreduce_bandwidth_bytes_per_s: float = 0.0
    """Gradient bytes per second that all-reduce sums between the two ranks, beyond its
    fixed ms. 0: not measured; the sums are then priced on the link."""
    count_pass_scale: float = 1.0
    """The MoE router loss's forward-only counting pass, measured over its price from the
    blocks' training forwards (``simulate.replay.counting_pass_ms``): a forward without
    autograd costs less. Fitted by a run of a plan with the loss (the CPU rehearsal,
    ``autopart.verify.calibrate``); 1: not measured."""

    def __post_init__(self) -> None:
        for name in ("fwd_action_ms", "bwd_action_ms", "p2p_ms", "step_ms", "link_latency_ms",
                     "runtime_p2p_ms", "gpipe_p2p_ms", "allreduce_latency_ms",
                     "allreduce_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise SchemaError(f"runtime overhead {name} = {value!r}, expected a finite "
                                  f"number >= 0; run `autopart calibrate --machine` again")
        if not (math.isfinite(self.count_pass_scale) and self.count_pass_scale > 0):
            raise SchemaError(f"runtime overhead count_pass_scale = {self.count_pass_scale!r}, "
                              f"expected a finite number > 0; run `autopart profile` again")
        if not self.link_bandwidth_bytes_per_s > 0:
            raise SchemaError(f"runtime overhead link bandwidth must be positive, got "
                              f"{self.link_bandwidth_bytes_per_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile(JsonFile):
    """Per-block latency and memory of a model on a device (``autopart profile``)."""

    _json_what = "profile"
    _json_remedy = "autopart profile"
    _json_version = PROFILE_SCHEMA_VERSION

    model: ModelInfo
    setup: ProfileSetup
    blocks: tuple[BlockProfile, ...]
    schema_version: int = PROFILE_SCHEMA_VERSION
    calibration: dict[str, Any] = field(default_factory=dict)
    """Set when measured stage times were folded back in (``--calibrate``)."""
    runtime_overhead: RuntimeOverhead | None = None
    """The machine check of this machine at the profile's thread count, when one was run
    (``autopart calibrate --machine``); plans add it to the stage and step times."""

    @classmethod
    def _json_upgrade(cls, data: dict[str, Any], version: Any) -> dict[str, Any] | None:
        """Schema 1 profiles load (``autopart.schema.upgrade.profile_from_v1``)."""
        from autopart.schema.upgrade import profile_from_v1

        return profile_from_v1(data) if version == 1 else None

    def __post_init__(self) -> None:
        names = [b.name for b in self.blocks]
        if not names:
            raise SchemaError("a profile needs at least one block")
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise SchemaError(f"block names must be unique, {twice} repeat")
