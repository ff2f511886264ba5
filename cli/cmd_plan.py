"""``autopart plan PROFILE --pp N``: solve for the fastest plan that fits memory.

Prints a per-rank table (stages, modules, F/B ms, memory against the limit), the
predicted step time, bubble, the gain over the public baselines, and the
suggested ``pipeline_cuts``; ``--format`` prints another tool's format instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from autopart.cost.blocks import static_bytes_per_param
from autopart.errors import PlanError
from autopart.export import FORMATS, MODULE_NAMES, export_plan
from autopart.jsonio import check_writable
from autopart.schedules import SCHEDULES
from autopart.schema import DP_SHARDS, PRECISIONS, Plan, Profile
from autopart.simulate import simulate_plan, write_trace
from autopart.solve import PARTITIONS, SOLVERS, PlanOptions, make_plan
from autopart.solve.mesh import plan_mesh
from autopart.solve.options import DEVICE, GRANULARITY_CHOICES

from ._format import gib, parse_bytes, summarize_modules
from ._mesh import dp_shard, parse_size, print_mesh_table
from ._progress import progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``plan`` command."""
    p = sub.add_parser("plan", help="solve for pipeline cuts, schedule and microbatches",
                       description="Find the plan with the fastest simulated step that fits "
                                   "every device's memory, and compare it with the even, "
                                   "parameter-balanced and torchtitan splits.")
    p.add_argument("profile", help="profile JSON written by `autopart profile`")
    p.add_argument("--pp", default=None,
                   help="pipeline-parallel size (ranks); with --devices also auto (default)")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="plan the tp x pp x dp mesh of N devices (node size and links from "
                        "profiles/devices.json)")
    p.add_argument("--tp", default="auto", help="with --devices: tensor-parallel size or auto")
    p.add_argument("--dp", default="auto", help="with --devices: data-parallel size or auto")
    p.add_argument("--dp-shard", default=None, choices=list(DP_SHARDS),
                   help="with --devices: what the data-parallel replicas shard. none; "
                        "optimizer: optimizer state and master weights (ZeRO-1; autopart's "
                        "runtime keeps them whole, the exports set it up); params-per-step: "
                        "parameters, gradients and optimizer state (FSDP2 fully_shard per "
                        "block, parameters all-gathered and gradients reduce-scattered once "
                        "per stage and step, as torchtitan runs it under PP); "
                        "params-per-microbatch: the same, parameters gathered again for "
                        "every forward and backward")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 3],
                   help="with --devices: the same by ZeRO stage: 0 none, 1 optimizer, "
                        "3 params-per-step")
    p.add_argument("--sequence-parallel", default="on", choices=["on", "off"],
                   help="with --devices: TP with sequence parallelism (on, as Megatron and "
                        "NxD run it: every activation split, block times scaled) or without "
                        "(off: norms and dropout whole; analytical profiles take the TP "
                        "shard's own profiled times)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-size", type=int, default=None, metavar="B",
                       help="samples per step. Without --devices: per data-parallel "
                            "replica, m searched among its divisors; with --devices: over "
                            "all replicas, m = B / (dp x the profile's micro-batch size)")
    batch.add_argument("--microbatches", type=int, default=None, metavar="M",
                       help="fix the number of microbatches (default: 4 x pp)")
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="per-device memory, e.g. 80GiB, or 'none' for unlimited (default: "
                        "the capacity of --device or of the profile's device: the analytical "
                        "spec, the GPU's memory, the CPU machine's RAM)")
    p.add_argument("--device", default=None,
                   help="device spec (h100, h200, a100, trn1, trn2) for memory and link defaults")
    p.add_argument("--schedule", default="auto", choices=["auto", *SCHEDULES])
    p.add_argument("--virtual-stages", default="auto", help="stages per rank: auto or K")
    p.add_argument("--partition", default="optimal", choices=PARTITIONS)
    p.add_argument("--solver", default="auto", choices=SOLVERS)
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "none"])
    p.add_argument("--precision", default=None, choices=list(PRECISIONS),
                   help="static bytes per parameter: fp32 = 4+4+8 (params, grads, Adam), "
                        "bf16/fp16 = 2+2+4 (torch AdamW on low-precision params), "
                        "bf16-mixed/fp16-mixed = 2+4+4+8 (fp32 master weights, grads and "
                        "Adam); default: plain training in the profile's dtype")
    p.add_argument("--link-bandwidth", type=float, default=None, metavar="GB/S",
                   help="pipeline link bandwidth in GB/s (default: device spec, else 50)")
    p.add_argument("--link-latency-ms", type=float, default=None)
    p.add_argument("--no-recompute", action="store_true",
                   help="never use activation recomputation to fit memory")
    p.add_argument("--granularity", default="auto", choices=GRANULARITY_CHOICES,
                   metavar="{auto,layer,half,projection,slice}",
                   help="auto (default): every level the profile offers, each with the head "
                        "whole or cut into vocabulary shards (lm_head.shard<i>of<k>), the "
                        "fastest plan; or one level: layer (whole decoder layers), half "
                        "(attention and MLP halves), projection (halves cut before their "
                        "output projection too), slice (halves cut by KV-head groups or MLP "
                        "columns: model.layers.3.mlp.slice1of4). Exports such as nxd and "
                        "megatron always plan at layer")
    p.add_argument("--head", default="auto", choices=["auto", "split", "whole"],
                   help="the head cut into vocabulary shards where faster (auto), where it "
                        "can be (split), or never (whole)")
    p.add_argument("--cuts", default=None, metavar="NAME,...",
                   help="evaluate this split instead of searching: pp * v - 1 cut points in "
                        "model order, each the name of any module that ends there "
                        "(model.layers.7, model.layers.7.self_attn, lm_head.shard1of4)")
    p.add_argument("--format", default="table", choices=["table", "json", *FORMATS])
    p.add_argument("--module-names", default="native", choices=MODULE_NAMES,
                   help="--format torchtitan: native = torchtitan's own Transformer "
                        "(tok_embeddings, layers.N, norm, output), hf = the HF model's FQNs")
    p.add_argument("--trace", default=None, metavar="PATH", help="write the simulated trace")
    p.add_argument("--out", default=None, metavar="PATH", help="write the plan JSON here")


def run(args: argparse.Namespace) -> int:
    """Plan, then print in the requested format."""
    for path in (args.out, args.trace):
        if path:
            check_writable(path)
    profile = Profile.load(args.profile)
    options = plan_options(args)
    mesh = None
    with progress_bar("searching") as progress:
        if options.devices is not None:
            mesh = plan_mesh(profile, options, progress=progress)
            plan = mesh.plan
        else:
            plan = make_plan(profile, options, progress=progress)
    if args.out:
        plan.save(args.out)
    if args.trace:
        _write_trace(plan, args.trace)
    if args.format == "json":
        sys.stdout.write(plan.to_json())
    elif args.format != "table":
        sys.stdout.write(export_plan(plan, profile, args.format,
                                     module_names=args.module_names))
    else:
        console = Console(width=None if sys.stdout.isatty() else 140)
        if mesh is not None:
            print_mesh_table(mesh, console)
        _print_table(plan, console)
        if args.out:
            console.print(f"plan written to {args.out}")
    return 0


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """The command line's flags as ``PlanOptions`` (the library fills in the defaults)."""
    mesh = args.devices is not None
    if not mesh:
        if args.pp is None:
            raise PlanError("give --pp N, or --devices N to plan the tp x pp x dp mesh")
        if args.tp != "auto" or args.dp != "auto" or args.zero is not None or \
                args.dp_shard is not None or args.sequence_parallel != "on":
            raise PlanError("--tp, --dp, --dp-shard, --zero and --sequence-parallel need "
                            "--devices N (the number of devices)")
    elif args.link_bandwidth is not None or args.link_latency_ms is not None:
        raise PlanError("--link-bandwidth and --link-latency-ms apply to --pp alone; with "
                        "--devices the intra- and inter-node links come from "
                        "profiles/devices.json")
    limit: int | str | None = DEVICE
    if args.memory_limit is not None:
        limit = None if args.memory_limit.strip().lower() in ("none", "unlimited") else \
            parse_bytes(args.memory_limit, "--memory-limit")
    zero_stage, per_microbatch = dp_shard(args.dp_shard, args.zero)
    return PlanOptions(
        pp_size=_size(parse_size(args.pp, "--pp")), devices=args.devices,
        tp_size=parse_size(args.tp, "--tp"), dp_size=parse_size(args.dp, "--dp"),
        zero_stage=zero_stage, reshard_after_forward=per_microbatch,
        sequence_parallel=args.sequence_parallel == "on",
        num_microbatches=args.microbatches, global_batch_size=args.global_batch_size,
        schedule=args.schedule, virtual_stages=parse_size(args.virtual_stages,
                                                          "--virtual-stages"),
        granularity=args.granularity,
        split_head={"auto": None, "split": True, "whole": False}[args.head],
        cuts=None if args.cuts is None else tuple(_parse_cuts(args.cuts)),
        partition=args.partition, target=args.format if args.format in FORMATS else None,
        memory_limit_bytes=limit, device=args.device, allow_recompute=not args.no_recompute,
        optimizer=args.optimizer, precision=args.precision,
        link_bandwidth_bytes_per_s=None if args.link_bandwidth is None
        else args.link_bandwidth * 1e9,
        link_latency_ms=args.link_latency_ms, solver=args.solver)


def _size(value: int | str) -> int | None:
    return None if value == "auto" else int(value)


def _parse_cuts(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not text.strip() or any(not name for name in names):
        raise PlanError(f"--cuts {text!r} has an empty name; give cut names separated by "
                        f"commas, e.g. --cuts model.layers.7,lm_head.shard0of4")
    return names


def _print_table(plan: Plan, console: Console) -> None:
    mesh = f"tp={plan.tp_size}, dp={plan.dp_size}, " if plan.tp_size * plan.dp_size > 1 else ""
    table = Table(title=f"{plan.model_name}: {mesh}pp={plan.pp_size}, {plan.schedule}, "
                        f"v={plan.virtual_stages}, m={plan.num_microbatches}")
    for column in ("rank", "stage", "modules", "F ms", "B ms", "recompute", "memory", "busy ms"):
        table.add_column(column, justify="left" if column == "modules" else "right")
    for rank in plan.ranks:
        limit = f" / {gib(rank.memory_limit_bytes)}" if rank.memory_limit_bytes else ""
        for i, stage_idx in enumerate(rank.stages):
            stage = plan.stages[stage_idx]
            table.add_row(str(rank.rank) if i == 0 else "", str(stage.index),
                          summarize_modules(stage.modules, plan.parts), f"{stage.fwd_ms:.2f}",
                          f"{stage.bwd_ms:.2f}", "yes" if stage.recompute else "",
                          gib(rank.peak_memory_bytes) + limit if i == 0 else "",
                          f"{rank.busy_ms:.1f}" if i == 0 else "")
    console.print(table)
    console.print(f"predicted step: [bold]{plan.predicted_step_ms:.2f} ms[/], bubble "
                  f"{100 * plan.bubble_fraction:.1f}%  (solver: {_solver_text(plan)})")
    if plan.dp_size > 1:
        console.print(f"  + data-parallel gradient sync past the drain {plan.grad_sync_ms:.2f} "
                      f"ms = [bold]{plan.predicted_step_ms + plan.grad_sync_ms:.2f} ms[/] "
                      f"per step")
    console.print(f"static memory: {plan.setup.precision} precision, "
                  f"{static_bytes_per_param(plan.setup):g} B per parameter "
                  f"({plan.setup.optimizer} optimizer)")
    for name, base in sorted(plan.baselines.items()):
        fits = "" if base.fits else "  [red]does not fit memory[/]"
        console.print(f"  vs {name:<10} {base.predicted_step_ms:10.2f} ms  ->  "
                      f"{base.speedup:.3f}x{fits}")
    for note in plan.notes:
        console.print(f"note: {note}")
    console.print("pipeline_cuts = " + json.dumps(list(plan.pipeline_cuts)), highlight=False,
                  soft_wrap=True)


def _solver_text(plan: Plan) -> str:
    info = plan.solver
    if info is None:
        return "not recorded"
    if info.status == "baseline":
        text = f"seeded by the {info.name} split"
    else:
        text = f"{info.name}, {info.status}"
    if info.gap:
        text += f", gap {100 * info.gap:.1f}%"
    if info.refined:
        text += f", then local search: {100 * info.refine_gain:.1f}% faster"
    return text


def _write_trace(plan: Plan, path: str) -> None:
    result = simulate_plan(plan)
    names = [f"stage {s.index}: {summarize_modules(s.modules, plan.parts)}" for s in plan.stages]
    write_trace(result, path, stage_names=names)
