"""Plan -> the formats other tools take. Nothing here decides anything.

* NxD (``NxDPPModel``): ``pipeline_cuts`` (the last transformer layer of every stage
  but the final one), ``virtual_pipeline_size``, ``num_microbatches``,
  ``transformer_layer_cls`` and ``leaf_module_cls``.
* NeMo AutoPipeline and torchtitan: ``module_fqns_per_model_part`` (a list of
  module FQNs per stage; NeMo also wants the shared rotary module on every stage).
  The FQNs are those of the model definition the tool trains: NeMo trains the HF
  model, torchtitan its own ``Transformer`` (``tok_embeddings``, ``layers.N``,
  ``norm``, ``output``, as its ``generate_llm_fqn_per_model_part`` names them), so
  torchtitan gets the HF layout mapped to those names unless HF names are asked for.
* Megatron-core: ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t``
  decoder layer, ``L`` loss/head, stages split by ``|``, listed in stage order).

What each tool can run (cut positions, schedules) is ``autopart.targets``; a plan
that breaks those rules is refused here with a ``PlanError``.
"""

from __future__ import annotations

import json

from autopart.errors import PlanError
from autopart.levels import coarsen
from autopart.schedules import schedule_info
from autopart.schema import Plan, Profile
from autopart.targets import TARGETS, planning_constraints

__all__ = ["FORMATS", "MODULE_NAMES", "export_plan"]

FORMATS = TARGETS

MODULE_NAMES = ("native", "hf")
"""``native``: the names of the model definition the target tool trains; ``hf``: the
HF model's (the profile's) names."""

_NORM_LEAF_CLASSES = ("RMSNorm", "LayerNorm")
_TORCHTITAN_NAMES = {"embedding": "tok_embeddings", "norm": "norm", "head": "output"}
"""torchtitan's own module for each block kind; decoder layer ``i`` is ``layers.i``."""


def to_nxd(plan: Plan, profile: Profile) -> dict[str, object]:
    """NxDPPModel arguments for ``plan``.

    Args:
        plan: A plan within ``planning_constraints("nxd")``.
        profile: The profile it was made from (layer and norm class names).

    Returns:
        ``pipeline_cuts``, ``virtual_pipeline_size``, ``num_microbatches``,
        ``pipeline_parallel_size``, ``transformer_layer_cls``, ``leaf_module_cls``, and
        the mesh for ``initialize_model_parallel``: ``tensor_model_parallel_size`` and
        ``pipeline_model_parallel_size``.

    Raises:
        PlanError: NxD cannot run the plan (see ``autopart.targets``).
    """
    planning_constraints("nxd").check_plan(plan, profile)
    cuts = list(plan.pipeline_cuts)
    layer_cls = list(profile.model.layer_classes)
    leaf_cls = sorted({b.class_name for b in profile.blocks
                       if b.class_name.endswith(_NORM_LEAF_CLASSES)})
    return {"pipeline_cuts": cuts, "virtual_pipeline_size": plan.virtual_stages,
            "num_microbatches": plan.num_microbatches, "pipeline_parallel_size": plan.pp_size,
            "transformer_layer_cls": layer_cls, "leaf_module_cls": leaf_cls,
            "tensor_model_parallel_size": plan.tp_size,
            "pipeline_model_parallel_size": plan.pp_size}


def nxd_snippet(plan: Plan, profile: Profile) -> str:
    """Ready-to-paste Python for ``NxDPPModel`` built from ``to_nxd``."""
    args = to_nxd(plan, profile)
    layer_cls = ", ".join(args["transformer_layer_cls"]) or "<your decoder layer class>"
    leaf = ", ".join(f"{c}.__name__" for c in args["leaf_module_cls"])
    lines = [
        (f"# autopart plan for {plan.model_name or 'the model'}: pp={plan.pp_size}, "
        f"{plan.schedule}, predicted {plan.predicted_step_ms:.1f} ms/step"),
        *_nxd_mesh_lines(plan, args),
        f"pipeline_cuts = {json.dumps(args['pipeline_cuts'])}",
        "model = NxDPPModel(",
        "    model,",
        f"    transformer_layer_cls={layer_cls},",
        f"    num_microbatches={args['num_microbatches']},",
        f"    virtual_pipeline_size={args['virtual_pipeline_size']},",
        "    output_loss_value_spec=(True, False),",
        '    input_names=["input_ids", "attention_mask", "labels"],',
        "    pipeline_cuts=pipeline_cuts,",
        f"    leaf_module_cls=[{leaf}],",
        ")",
    ]
    return "\n".join(lines) + "\n"


def to_module_fqns(plan: Plan, shared_modules: tuple[str, ...] = ()) -> list[list[str]]:
    """``module_fqns_per_model_part``: module FQNs per stage, in stage order."""
    return [list(stage.modules) + list(shared_modules) for stage in plan.stages]


def to_torchtitan_fqns(plan: Plan, profile: Profile) -> list[list[str]]:
    """``module_fqns_per_model_part`` in torchtitan's own module names.

    The HF causal-LM layout maps by block kind: the embedding to ``tok_embeddings``,
    the ``i``-th decoder layer to ``layers.i``, the final norm to ``norm`` and the
    head to ``output``.

    Args:
        plan: The plan.
        profile: The profile it was made from (block kinds).

    Returns:
        Module FQNs per stage, in stage order.

    Raises:
        PlanError: A block has no torchtitan counterpart (a generic model), or two
            blocks map to one torchtitan module.
    """
    layers = [b.name for b in profile.blocks if b.kind == "decoder_layer"]
    names = {name: f"layers.{i}" for i, name in enumerate(layers)}
    for block in profile.blocks:
        if block.kind in _TORCHTITAN_NAMES:
            native = _TORCHTITAN_NAMES[block.kind]
            if native in names.values():
                raise PlanError(f"two blocks of {profile.model.name!r} map to torchtitan's "
                                f"{native!r}; export with --module-names hf "
                                f"(module_names='hf') to keep the model's own FQNs")
            names[block.name] = native
    parts = []
    for stage in plan.stages:
        missing = [m for m in stage.modules if m not in names]
        if missing:
            raise PlanError(f"block {missing[0]!r} has no torchtitan module (torchtitan's "
                            f"Transformer has tok_embeddings, layers.N, norm and output); "
                            f"export with --module-names hf (module_names='hf') to keep "
                            f"the model's own FQNs")
        parts.append([names[m] for m in stage.modules])
    return parts


def to_megatron_layout(plan: Plan, profile: Profile) -> str:
    """Megatron-core ``pipeline_model_parallel_layout`` string for ``plan``.

    Args:
        plan: A plan within ``planning_constraints("megatron")``.
        profile: The profile it was made from (block kinds).

    Returns:
        The layout, e.g. ``Et*3|t*3L``.

    Raises:
        PlanError: Megatron cannot run the plan (see ``autopart.targets``), or a
            block is of a kind the layout has no symbol for.
    """
    planning_constraints("megatron").check_plan(plan, profile)
    symbols = {"embedding": "E", "decoder_layer": "t", "head": "L", "norm": ""}
    kinds = _kinds(profile)
    parts = []
    for stage in plan.stages:
        letters = []
        for module in stage.modules:
            kind = kinds.get(module)
            if kind not in symbols:
                raise PlanError(f"Megatron's layout cannot express block {module!r} of kind "
                                f"{kind!r}; it covers embedding, decoder layers and the head")
            letters.append(symbols[kind])
        parts.append(_compress("".join(letters)))
    return "|".join(parts)


def export_plan(plan: Plan, profile: Profile, fmt: str, *, module_names: str = "native"
                ) -> str:
    """Text of ``plan`` in another tool's format.

    Args:
        plan: The plan; make it with ``make_plan(..., target=fmt)`` so the tool can
            run it.
        profile: The profile it was made from.
        fmt: One of ``FORMATS`` (``nxd``, ``nemo``, ``torchtitan``, ``megatron``).
        module_names: ``native`` names modules as the model definition the tool
            trains does (torchtitan: ``tok_embeddings``, ``layers.N``, ``norm``,
            ``output``; NxD and NeMo train the HF model); ``hf`` keeps the HF names.

    Returns:
        What to paste: Python for NxD, JSON for NeMo and torchtitan, flags for
        Megatron.

    Raises:
        PlanError: An unknown format or ``module_names``, a plan the tool cannot
            run, or a model torchtitan's names cannot describe.
    """
    profile = coarsen(profile, "layer", head=False)  # exports name whole layers, as planned
    planning_constraints(fmt).check_plan(plan, profile)
    if module_names not in MODULE_NAMES:
        raise PlanError(f"unknown module_names {module_names!r}; choose one of "
                        f"{', '.join(MODULE_NAMES)}")
    if fmt == "nxd":
        return nxd_snippet(plan, profile)
    if fmt == "nemo":
        shared = profile.model.shared_modules
        return json.dumps({"module_fqns_per_model_part": to_module_fqns(plan, shared)},
                          indent=2) + "\n"
    if fmt == "torchtitan":
        torch_class = schedule_info(plan.schedule).torch_class
        return json.dumps({"parallelism": {
            **_torchtitan_mesh(plan),
            "pipeline_parallel_degree": plan.pp_size,
            "pipeline_parallel_schedule": torch_class.removeprefix("Schedule"),
            "pipeline_parallel_microbatch_size": plan.micro_batch_size
            or profile.setup.micro_batch_size,
            "module_fqns_per_model_part": to_torchtitan_fqns(plan, profile)
            if module_names == "native" else to_module_fqns(plan)}}, indent=2) + "\n"
    if fmt == "megatron":
        # Megatron derives the virtual pipeline size from the number of stages in the layout.
        layout = to_megatron_layout(plan, profile)
        return (_megatron_mesh_flags(plan) + f"--pipeline-model-parallel-size {plan.pp_size} "
                f"--pipeline-model-parallel-layout \"{layout}\"\n")
    raise AssertionError(f"no exporter for target {fmt!r}")


def _nxd_mesh_lines(plan: Plan, args: dict[str, object]) -> list[str]:
    """NxD's ``initialize_model_parallel`` call, for plans with a tp x pp x dp mesh."""
    _refuse_fsdp(plan, "NxD", "its ZeRO-1 (--dp-shard optimizer)")
    if plan.tp_size == 1 and plan.dp_size == 1:
        return []
    return [f"# mesh: tp={plan.tp_size} x pp={plan.pp_size} x dp={plan.dp_size} "
            f"({plan.tp_size * plan.pp_size * plan.dp_size} NeuronCores)",
            "parallel_state.initialize_model_parallel(",
            f"    tensor_model_parallel_size={args['tensor_model_parallel_size']},",
            f"    pipeline_model_parallel_size={args['pipeline_model_parallel_size']},",
            ")"]


def _refuse_fsdp(plan: Plan, tool: str, instead: str) -> None:
    """One line when ``plan`` shards parameters over dp, which ``tool`` cannot run with PP."""
    if plan.zero_stage == 3:
        raise PlanError(f"{tool} has no FSDP under pipeline parallelism; plan with {instead} "
                        f"or --dp-shard none for {tool}")


def _megatron_mesh_flags(plan: Plan) -> str:
    """Megatron's TP flags (sequence parallel, as planned) and ZeRO-1 flag."""
    _refuse_fsdp(plan, "Megatron", "its distributed optimizer (--dp-shard optimizer)")
    flags = ""
    if plan.tp_size > 1:
        flags += f"--tensor-model-parallel-size {plan.tp_size} "
        flags += "--sequence-parallel " if plan.sequence_parallel else ""
    if plan.zero_stage == 1:
        flags += "--use-distributed-optimizer "
    return flags


def _torchtitan_mesh(plan: Plan) -> dict[str, int]:
    """torchtitan's TP and DP degrees; refuses ZeRO-1, which torchtitan lacks."""
    if plan.zero_stage == 1:
        raise PlanError("torchtitan has no ZeRO-1 (its data_parallel_shard_degree is FSDP, "
                        "which shards parameters too); plan with --dp-shard params-per-step "
                        "or none for torchtitan")
    if plan.tp_size == 1 and plan.dp_size == 1:
        return {}
    fsdp = plan.zero_stage == 3
    return {"tensor_parallel_degree": plan.tp_size,
            "data_parallel_replicate_degree": 1 if fsdp else plan.dp_size,
            "data_parallel_shard_degree": plan.dp_size if fsdp else 1,
            **({"fsdp_reshard_after_forward": "always" if plan.reshard_after_forward
                else "never"} if fsdp else {})}


def _kinds(profile: Profile) -> dict[str, str]:
    return {b.name: b.kind for b in profile.blocks}


def _compress(letters: str) -> str:
    """``Etttt`` -> ``Et*4``: runs of three or more become ``x*N``."""
    out, i = [], 0
    while i < len(letters):
        j = i
        while j < len(letters) and letters[j] == letters[i]:
            j += 1
        run = j - i
        out.append(f"{letters[i]}*{run}" if run >= 3 else letters[i] * run)
        i = j
    return "".join(out)
