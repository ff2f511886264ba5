"""tp x pp x dp mesh planning beside the common recipes, from analytical profiles.

Gemma-7B on 32 trn1 NeuronCores (one trn1.32xlarge, 16 GiB per core) and Llama-3-70B
on 64 H100s (8 nodes of 8), 4k tokens, bf16 mixed precision with Adam, ZeRO-1, global
batch 1024. For each it prints autopart's chosen mesh (``plan_mesh``: tp, pp, dp,
schedule, v, m, cuts and recompute searched together) next to:

- TP 8 with the smallest PP that fits (the NxD / Megatron habit): even layer split,
  1F1B, micro-batch 1; and autopart's own plan on that same mesh;
- NeMo AutoConfigurator's grid: the rule of ``GPT3GridSearch.init_params`` and the
  filters of ``generate_grid_search_configs`` in NVIDIA/NeMo
  ``nemo/collections/llm/tools/auto_configurator/core/training_config.py`` (commit
  25a148a9a6efe5479481325936a0ca51274c6e5a). NeMo launches a trial run per grid point;
  here every point is predicted by the same cost model with NeMo's even split and
  schedule (interleaved 1F1B with v = layers / pp when pp > 2, else 1F1B), at
  micro-batch 1 (the grid's other micro-batch sizes only add bubble in this model).

All figures are predictions from the same profiles and the same simulator; the ratio
is recipe step / autopart step. Run:

    python benchmarks/bench_mesh.py
"""

from __future__ import annotations

import functools
import sys
import time

from autopart.errors import InfeasibleError, PlanError
from autopart.profile import load_device_spec, profile_model
from autopart.profile.tp_shard import profile_tp_shard
from autopart.solve.mesh import MeshCandidate, plan_mesh

GLOBAL_BATCH = 1024
SEQ_LEN = 4096
SETTINGS = {"precision": "bf16-mixed", "optimizer": "adam", "zero_stage": 1, "solver": "dp"}
"""The DP solver (plus the local search): PuLP 3's HiGHS interface raises a KeyError on
HiGHS's solution-limit status, which the ILP's node limit can produce on Llama-3-70B."""

# (preset, device, devices, heads, layers, NeMo grid: tp, pp range, min/max model parallel,
#  a named recipe: (label, tp, pp) or None)
CASES = (
    # trn1 has 16 GiB per core: GPT3GridSearch.init_params has branches for 80 and 40 GB
    # only, so the class defaults apply: tp [1, 2, 4, 8], pp [1], model parallel 1..8.
    ("gemma-7b", "trn1", 32, 16, 28, (1, 2, 4, 8), (1, 1), (1, 8),
     ("NxD user's TP 8 x PP 4 (the issue)", 8, 4)),
    # 80 GB, seq 4096, 45 < size <= 95 B: tp [4, 8], pp in 1..8 dividing the layers,
    # model parallel 8..64, gbs 1024.
    ("llama-3-70b", "h100", 64, 64, 80, (4, 8), (1, 8), (8, 64), None),
)


def nemo_grid(devices: int, heads: int, layers: int, tps: tuple[int, ...],
              pp_range: tuple[int, int], mp_range: tuple[int, int]) -> list[tuple[int, int]]:
    """(tp, pp) of NeMo's grid at micro-batch 1 after its own filters."""
    valid_pp = [x for x in range(1, layers + 1) if layers % x == 0]
    out = []
    for tp in tps:
        for pp in (x for x in valid_pp if pp_range[0] <= x <= pp_range[1]):
            model_parallel = tp * pp
            if (heads % tp == 0 and layers % pp == 0 and devices % model_parallel == 0
                    and GLOBAL_BATCH % (devices // model_parallel) == 0
                    and mp_range[0] <= model_parallel <= mp_range[1]):
                out.append((tp, pp))
    return out


def recipe(profile, spec, devices, tp, pp, layers, shard_of,
           nemo: bool = False) -> MeshCandidate | None:
    """One fixed mesh with a framework's even split, micro-batch 1, and 1F1B (NeMo's grid:
    interleaved 1F1B with v = layers / pp when pp > 2)."""
    dp = devices // (tp * pp)
    schedule, virtual = ("1f1b", 1)
    if nemo and pp > 2:
        schedule, virtual = "interleaved-1f1b", layers // pp
    try:
        result = plan_mesh(profile, devices=devices, device=spec, tp_size=tp, pp_size=pp,
                           dp_size=dp,
                           num_microbatches=GLOBAL_BATCH // dp, partition="even",
                           schedule=schedule, virtual_stages=virtual, shard_of=shard_of,
                           memory_limit_bytes=spec.memory_bytes, **SETTINGS)
    except InfeasibleError:
        return None
    return result.candidates[0]


def row(name: str, cand: MeshCandidate | None, best_ms: float, extra: str = "") -> str:
    """One printed line."""
    if cand is None:
        return f"  {name:<34} {'does not fit memory':>40}  {extra}"
    plan = cand.plan
    mesh = f"tp{cand.tp_size} pp{cand.pp_size} dp{cand.dp_size}"
    sched = f"{plan.schedule} v={plan.virtual_stages} m={plan.num_microbatches}"
    return (f"  {name:<34} {mesh:<14} {cand.step_ms:>11.1f} {cand.step_ms / best_ms:>6.3f}x "
            f"{cand.peak_memory_bytes / 2**30:>7.2f} GiB  {sched} {extra}")


def run_case(preset, device, devices, heads, layers, tps, pp_range, mp_range, named) -> None:
    """Profile, plan the mesh, and print it beside the recipes."""
    spec = load_device_spec(device)
    profile = profile_model(preset, backend=f"analytical:{device}", seq_len=SEQ_LEN,
                            dtype="bfloat16")
    shard_of = functools.cache(lambda tp: profile_tp_shard(profile, tp))
    start = time.perf_counter()
    result = plan_mesh(profile, devices=devices, device=spec, global_batch_size=GLOBAL_BATCH,
                       shard_of=shard_of, memory_limit_bytes=spec.memory_bytes,
                       progress=_progress, **SETTINGS)
    seconds = time.perf_counter() - start
    best = result.candidates[0]
    print(f"\n{preset} on {devices} x {spec.name} ({spec.memory_bytes / 2**30:.0f} GiB, node "
          f"{spec.node_size}), global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens; "
          f"{len(result.candidates)} meshes searched in {seconds:.0f} s")
    print(f"  {'':<34} {'mesh':<14} {'step ms':>11} {'ratio':>7} {'peak':>11}  schedule")
    print(row("autopart (chosen)", best, best.step_ms))
    for cand in result.candidates[1:5]:
        print(row("autopart runner-up", cand, best.step_ms, f"lost: {cand.lost_because}"))
    for pp in sorted(p for p in range(1, devices // 8 + 1) if devices // 8 % p == 0):
        fixed = recipe(profile, spec, devices, 8, pp, layers, shard_of)
        if fixed is not None:
            print(row(f"TP 8, smallest PP that fits (pp {pp})", fixed, best.step_ms,
                      "even split"))
            same = next(c for c in result.candidates
                        if (c.tp_size, c.pp_size) == (8, pp))
            print(row("  autopart on that mesh", same if same.fits else None, best.step_ms))
            break
    if named is not None:
        label, tp, pp = named
        print(row(label, recipe(profile, spec, devices, tp, pp, layers, shard_of),
                  best.step_ms, "even split"))
    grid = nemo_grid(devices, heads, layers, tps, pp_range, mp_range)
    points = [(tp, pp, recipe(profile, spec, devices, tp, pp, layers, shard_of, nemo=True))
              for tp, pp in grid]
    fitting = [c for _, _, c in points if c is not None]
    print(f"  NeMo AutoConfigurator grid: {len(grid)} (tp, pp) points "
          f"{[(tp, pp) for tp, pp in grid]}, {len(fitting)} fit memory")
    if fitting:
        print(row("NeMo grid, best point", min(fitting, key=lambda c: c.step_ms),
                  best.step_ms, "even split"))


def _progress(done: int, total: int, what: str) -> None:
    print(f"  searched {done}/{total}: {what}", file=sys.stderr, flush=True)


def main() -> None:
    """Both must-show cases."""
    for case in CASES:
        try:
            run_case(*case)
        except PlanError as exc:
            print(f"{case[0]}: {exc}")


if __name__ == "__main__":
    main()
