"""Search the tp x pp x dp mesh around the pipeline search; the public ``plan_mesh``.

For every mesh with ``tp`` dividing the node size and ``tp * pp * dp == devices``, the
profile is sharded for TP (``autopart.cost.mesh.shard_profile``), the pipeline link is
the intra-node one while the whole mesh fits in one node and the inter-node one
otherwise, and ``make_plan`` searches schedule, v, m, cuts and recompute within memory
as it does for ``--pp`` alone, with ``global_batch_size / (dp * micro_batch_size)``
microbatches per replica (the profile's micro-batch size).

Rank order is (pp, dp, tp), tp fastest (the runtime's DeviceMesh): a dp group spans
``tp * dp`` consecutive devices and stays in one node when that is at most the node size.

Data parallelism adds the gradient ring all-reduce of each pipeline rank's gradients
(ZeRO-1: a reduce-scatter of the gradients and an all-gather of the updated parameters,
each half an all-reduce of its dtype; FSDP: the reduce-scatter of the gradients, once
per stage and step). It overlaps the pipeline drain: rank r starts when its own last
backward ends, so only what runs past the pipeline's end adds to the step. Bucketed
overlap with earlier backwards is not modelled (an upper bound). FSDP gathering once
per step gathers a rank's first stage before its first forward, hidden while the
rank waits for its first input (the later stages are prefetched under compute);
gathering per microbatch puts the gathers in the block times
(``autopart.cost.mesh.gather_per_microbatch``) and plans without the split-backward
schedules, whose weight gradients the runtime cannot compute after a reshard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopart.cost.mesh import (
    gather_per_microbatch,
    ring_all_gather_ms,
    ring_all_reduce_ms,
    shard_profile,
    tp_comm_ms_per_block,
)
from autopart.errors import InfeasibleError, PlanError
from autopart.levels import coarsen
from autopart.profile.devices import DeviceSpec
from autopart.schedules import SCHEDULES
from autopart.schema import DTYPE_BYTES, Plan, Profile, setup_fields_with_precision
from autopart.simulate import simulate_plan
from autopart.solve.mesh_shapes import mesh_sizes
from autopart.solve.options import PlanOptions, device_of
from autopart.solve.search import plan_pipeline, scan_plan

__all__ = ["MeshCandidate", "MeshResult", "plan_mesh"]

_NUM_REFINED_MESHES = 2
"""How many of the fastest meshes of the scan (one level, no local search) are planned as
asked (every level, the local search)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshCandidate:
    """One mesh, planned (or refused) under the same settings as the others."""

    tp_size: int
    pp_size: int
    dp_size: int
    plan: Plan | None
    """The pipeline plan of this mesh; ``None`` when nothing fits memory."""
    step_ms: float | None = None
    """Pipeline step plus the gradient sync that runs past it."""
    grad_sync_ms: float = 0.0
    """The data-parallel gradient all-reduce time that runs past the pipeline's end."""
    tp_comm_ms: float = 0.0
    """TP collective time on the busiest pipeline rank over the step."""
    peak_memory_bytes: int | None = None
    needed_bytes: int | None = None
    """When nothing fits: the smallest per-device memory that would (if known)."""
    lost_because: str = ""
    """Why it lost to the chosen mesh: ``memory``, ``bubble``, ``communication`` or
    ``compute``, with the figure; empty for the chosen mesh."""
    refused: str = ""
    """Why no plan of this mesh could be made at all (one line), when that was not memory."""

    @property
    def fits(self) -> bool:
        """A plan fits every device's memory."""
        return self.plan is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshResult:
    """The chosen mesh's plan and every mesh tried, best first."""

    plan: Plan
    candidates: tuple[MeshCandidate, ...]


def plan_mesh(profile: Profile, options: PlanOptions | None = None, /, *,
              progress: Callable[[int, int, str], None] | None = None,
              shard_of: Callable[[int], Profile | None] | None = None,
              **fields: Any) -> MeshResult:
    """Plan the fastest tp x pp x dp mesh of ``options.devices`` devices that fits memory.

    Args:
        profile: The unsharded profile (analytical or measured on one device).
        options: What to plan (``PlanOptions``, ``devices`` set; ``tp_size``, ``pp_size``
            and ``dp_size`` fix a size, ``auto`` searches it; ``global_batch_size`` is over
            all replicas, each running ``global_batch_size / (dp * micro_batch_size)``
            microbatches of the profile's micro-batch size); ``fields`` replace its fields.
        progress: ``progress(done, total, what)`` after each mesh.
        shard_of: ``shard_of(tp)`` gives a profile of one TP shard or ``None``; default:
            ``autopart.profile.tp_shard.profile_tp_shard`` (analytical profiles of HF
            configs); without one the block times are scaled (``autopart.cost.mesh``).
        **fields: ``PlanOptions`` fields.

    Returns:
        The chosen mesh's plan (``tp_size``, ``dp_size``, ``zero_stage`` and
        ``grad_sync_ms`` set) and every mesh tried, best first.

    Raises:
        PlanError: Bad sizes (see ``mesh_sizes``), no devices, or no link figures for the
            device.
        InfeasibleError: No mesh fits memory.
    """
    opts = PlanOptions.of(options, **fields)
    if opts.devices is None:
        raise PlanError("plan_mesh needs devices (--devices N)")
    spec = device_of(profile, opts.device)
    if spec is None:
        raise PlanError("--devices needs the device's node size and links: pass --device "
                        "(h100, trn1, ...) or use an analytical profile")
    if spec.intra_node is None or spec.inter_node is None:
        raise PlanError(f"profiles/devices.json has no intra_node / inter_node links for "
                        f"{spec.key!r}; add them with their source to plan a mesh")
    meshes = mesh_sizes(opts.devices, spec.node_size, tp=opts.tp_size,
                        pp=opts.pp_size if opts.pp_size is not None else "auto",
                        dp=opts.dp_size, num_blocks=len(profile.blocks),
                        num_whole_blocks=len(coarsen(profile, "layer", head=False).blocks),
                        batch=(opts.global_batch_size, profile.setup.micro_batch_size))
    if shard_of is None:
        from autopart.profile.tp_shard import profile_tp_shard

        def shard_of(tp: int) -> Profile | None:
            return profile_tp_shard(coarsen(profile, "layer", head=False), tp)

    shards: dict[int, Profile] = {1: profile}
    whole = coarsen(profile, "layer", head=False)  # tp shards whole layers (``_plan_one``)
    intra = spec.intra_node

    def plan_one(mesh: tuple[int, int, int], options: PlanOptions,
                 planner: Callable[[Profile, PlanOptions], Plan]) -> MeshCandidate:
        t = mesh[0]
        if t not in shards:
            shard = shard_of(t)  # at any level: tp shards whole layers, as ``whole`` has them
            shard = coarsen(shard, "layer", head=False) if shard is not None else None
            shards[t] = shard_profile(
                whole, t, sequence_parallel=opts.sequence_parallel, shard=shard,
                bandwidth_bytes_per_s=intra.bandwidth_bytes_per_s, latency_ms=intra.latency_ms)
        comm = tp_comm_ms_per_block(whole, t, intra.bandwidth_bytes_per_s, intra.latency_ms,
                                    opts.sequence_parallel) if t > 1 else []
        return _plan_one(shards[t], spec, mesh, options, planner, comm)

    # Scan every mesh at one level (the profile's, the head cut where it can be) with the
    # DP alone, then plan the best few as asked: the levels, the ILP and the local search
    # multiply the work, too much for every mesh of a large cluster.
    scan = dataclasses.replace(opts, refine_evals=0)
    if opts.granularity == "auto" and opts.split_head is None:
        scan = dataclasses.replace(scan, granularity=profile.setup.granularity,
                                   split_head=bool(profile.model.head_split_rows))
    # FSDP shards no head split across stages (autopart.runtime.fsdp): scan those meshes
    # with the head whole.
    fsdp_scan = dataclasses.replace(scan, split_head=False) \
        if opts.zero_stage == 3 and opts.split_head is None else scan
    found = []
    for done, mesh in enumerate(meshes, 1):
        found.append(plan_one(mesh, fsdp_scan if mesh[2] > 1 else scan, scan_plan))
        if progress is not None:
            progress(done, len(meshes) + 1, "tp={} pp={} dp={}".format(*mesh))
    best_few = sorted((c for c in found if c.fits), key=_order)[:_NUM_REFINED_MESHES]
    for cand in best_few:
        found[found.index(cand)] = plan_one((cand.tp_size, cand.pp_size, cand.dp_size), opts,
                                            plan_pipeline)
    if progress is not None:
        progress(len(meshes) + 1, len(meshes) + 1, "local search")
    return _ranked(found, opts.devices)


def _order(cand: MeshCandidate) -> tuple:
    return (cand.step_ms, cand.tp_size, cand.pp_size)


def _ranked(found: list[MeshCandidate], devices: int) -> MeshResult:
    """The fastest fitting mesh first, then the others with why each lost."""
    fitting = sorted((c for c in found if c.fits), key=_order)
    if not fitting and all(c.refused for c in found):
        first = found[0]
        whole = (f" (tp {first.tp_size} plans whole layers with the head whole)"
                 if first.tp_size > 1 else "")
        raise PlanError(f"no tp x pp x dp mesh of {devices} devices can be planned: tp "
                        f"{first.tp_size} x pp {first.pp_size} x dp {first.dp_size}: "
                        f"{first.refused}{whole}")
    if not fitting:
        need = [c.needed_bytes for c in found if c.needed_bytes is not None]
        more = f"; the smallest needs {min(need)} bytes per device" if need else ""
        raise InfeasibleError(f"no tp x pp x dp mesh of {devices} devices fits the memory "
                              f"limit{more}; add devices, shard more over dp (--dp-shard "
                              f"optimizer or params-per-step) or lower the micro batch size",
                              needed_bytes=min(need) if need else None)
    best = fitting[0]
    ranked = [best] + [_with_reason(c, best) for c in fitting[1:]]
    refused = sorted((c for c in found if not c.fits),
                     key=lambda c: (bool(c.refused), c.needed_bytes or 0, c.tp_size, c.pp_size))
    ranked += [dataclasses.replace(c, lost_because=c.refused or _memory_reason(c))
               for c in refused]
    return MeshResult(plan=best.plan, candidates=tuple(ranked))


def _plan_one(sharded: Profile, spec: DeviceSpec, mesh: tuple[int, int, int],
              opts: PlanOptions, planner: Callable[[Profile, PlanOptions], Plan],
              comm: list[tuple[float, float]]) -> MeshCandidate:
    """Plan the pipeline of one mesh on its TP-sharded profile and add the DP gradient sync
    (``comm``: each whole-layer block's TP collectives, for the report).

    Under tensor parallelism the plan keeps whole layers and the head whole: autopart's
    runtime shards a layer's heads and columns over tp, which a cut inside a half or a
    head split by vocabulary would cut again (said in the plan's notes)."""
    tp, pp, dp = mesh
    zero_stage, per_microbatch = (opts.zero_stage, opts.reshard_after_forward) if dp > 1 \
        else (0, False)
    intra, inter = spec.intra_node, spec.inter_node
    assert intra is not None and inter is not None
    pp_link = intra if tp * pp * dp <= spec.node_size else inter
    dp_link = intra if tp * dp <= spec.node_size else inter
    num_microbatches = opts.num_microbatches
    if num_microbatches is None and opts.global_batch_size is not None:
        num_microbatches = opts.global_batch_size // (dp * sharded.setup.micro_batch_size)
    fields: dict[str, Any] = {
        "devices": None, "pp_size": pp, "dp_size": dp, "tp_size": "auto",
        "link_bandwidth_bytes_per_s": pp_link.bandwidth_bytes_per_s,
        "link_latency_ms": pp_link.latency_ms, "num_microbatches": num_microbatches,
        "global_batch_size": None if num_microbatches is not None else opts.global_batch_size,
        "device": spec, "zero_stage": zero_stage, "reshard_after_forward": per_microbatch}
    if tp > 1:
        fields.update(granularity="layer", split_head=False)
    opts = dataclasses.replace(opts, **fields)
    if per_microbatch:
        try:
            sharded, opts = _gathered_per_microbatch(sharded, opts, dp, dp_link)
        except PlanError as exc:
            return MeshCandidate(tp_size=tp, pp_size=pp, dp_size=dp, plan=None,
                                 refused=str(exc))
    try:
        plan = planner(sharded, opts)
    except InfeasibleError as exc:
        return MeshCandidate(tp_size=tp, pp_size=pp, dp_size=dp, plan=None,
                             needed_bytes=exc.needed_bytes)
    except PlanError as exc:  # e.g. no schedule runs this pp with these microbatches
        return MeshCandidate(tp_size=tp, pp_size=pp, dp_size=dp, plan=None,
                             refused=str(exc))
    sync = _grad_sync_ms(plan, dp, dp_link.bandwidth_bytes_per_s, dp_link.latency_ms)
    per_rank = [0.0]
    if tp > 1:
        per_rank = [sum(sum(comm[i]) for s in plan.stages_of_rank(r)
                        for i in range(s.first_block_idx, s.last_block_idx + 1))
                    for r in range(pp)]
    notes = plan.notes
    if tp > 1:
        notes += (sharded.model.notes[-1], f"tp {tp}: planned at whole layers with the head "
                  f"whole: tensor parallelism already splits each layer and the head by heads, "
                  f"columns and vocabulary")
    plan = dataclasses.replace(plan, tp_size=tp, dp_size=dp, zero_stage=zero_stage,
                               reshard_after_forward=per_microbatch, grad_sync_ms=sync,
                               notes=notes, sequence_parallel=opts.sequence_parallel or tp == 1)
    return MeshCandidate(tp_size=tp, pp_size=pp, dp_size=dp, plan=plan,
                         step_ms=plan.predicted_step_ms + sync, grad_sync_ms=sync,
                         tp_comm_ms=max(per_rank) * plan.num_microbatches,
                         peak_memory_bytes=max(r.peak_memory_bytes for r in plan.ranks))


def _gathered_per_microbatch(sharded: Profile, opts: PlanOptions, dp: int,
                             link: Any) -> tuple[Profile, PlanOptions]:
    """FSDP gathering per microbatch: the gathers in the block times, and the schedules
    without split backward (the runtime refuses those, ``autopart.runtime.fsdp``)."""
    fields = {"precision": opts.precision} if opts.precision else {}
    dtype = setup_fields_with_precision(fields, sharded.setup.dtype)["param_dtype"]
    gathered = gather_per_microbatch(sharded, dp, DTYPE_BYTES[dtype],
                                     link.bandwidth_bytes_per_s, link.latency_ms)
    asked = opts.schedule
    names = list(SCHEDULES) if asked == "auto" else [asked] if isinstance(asked, str) \
        else list(asked)
    kept = tuple(n for n in names if not SCHEDULES[n].split_backward)
    if not kept:
        raise PlanError(f"--dp-shard params-per-microbatch cannot run schedule(s) {names} "
                        f"(their weight gradients run apart from the backward); use "
                        f"--dp-shard params-per-step or 1f1b / interleaved-1f1b")
    return gathered, dataclasses.replace(opts, schedule=kept)


def _grad_sync_ms(plan: Plan, dp: int, bandwidth: float, latency_ms: float) -> float:
    """The data-parallel traffic not hidden by the pipeline: the gradient sync past its end
    (rank r starts at its last backward) and, gathering FSDP parameters once per step, the
    first stage's gather each rank does not hide before its first forward."""
    if dp == 1:
        return 0.0
    result = simulate_plan(plan)
    grad_bytes = DTYPE_BYTES[plan.setup.grad_dtype]
    param_bytes = DTYPE_BYTES[plan.setup.param_dtype]
    end, late = result.step_ms, 0.0
    for rank in range(plan.pp_size):
        mine = [e for e in result.events if e.rank == rank]
        last_bwd = max((e.end_ms for e in mine if e.kind not in ("F", "SEND")), default=0.0)
        num_params = sum(s.param_count for s in plan.stages_of_rank(rank))
        grads = ring_all_gather_ms(num_params * grad_bytes, dp, bandwidth, latency_ms)
        if plan.setup.zero_stage == 1:
            # ZeRO-1: reduce-scatter the gradients, all-gather the updated parameters.
            sync = grads + ring_all_gather_ms(num_params * param_bytes, dp, bandwidth,
                                              latency_ms)
        elif plan.setup.zero_stage == 3:  # FSDP: reduce-scatter the gradients
            sync = grads
            if not plan.setup.reshard_after_forward:
                first = plan.stages_of_rank(rank)[0].param_count * param_bytes
                start = min((e.start_ms for e in mine if e.kind == "F"), default=0.0)
                late = max(late, ring_all_gather_ms(first, dp, bandwidth, latency_ms) - start)
        else:
            sync = ring_all_reduce_ms(num_params * grad_bytes, dp, bandwidth, latency_ms)
        end = max(end, last_bwd + sync)
    return end - result.step_ms + late


def _with_reason(cand: MeshCandidate, best: MeshCandidate) -> MeshCandidate:
    """Name the part of the step that grew most against the chosen mesh."""
    def parts(c: MeshCandidate) -> dict[str, float]:
        bubble = c.plan.bubble_fraction * c.plan.predicted_step_ms
        comm = c.tp_comm_ms + c.grad_sync_ms
        return {"bubble": bubble, "communication": comm,
                "compute": c.step_ms - bubble - comm}
    mine, theirs = parts(cand), parts(best)
    name = max(mine, key=lambda k: mine[k] - theirs[k])
    text = f"{name} +{mine[name] - theirs[name]:.1f} ms"
    if name == "compute" and any(s.recompute for s in cand.plan.stages):
        text += " (recompute to fit memory)"
    return dataclasses.replace(cand, lost_because=text)


def _memory_reason(cand: MeshCandidate) -> str:
    if cand.needed_bytes is None:
        return "memory"
    return f"memory: needs {cand.needed_bytes / 2**30:.2f} GiB"
