"""Cluster-scale meshes: autopart's choice beside torchtitan's shipped meshes and NeMo's grid.

Llama-3-70B on 64 H100s and a Llama-3.1-405B shape (126 layers, hidden 16384, 128 heads,
8 key-value heads, intermediate 53248, vocabulary 128256) on 512 H100s (8 per node,
80 GB parts, 74.5 GiB usable), 8192 tokens, bf16 mixed precision with AdamW, from
analytical profiles (``analytical:h100``, whole layers). Every mesh is predicted by the
same cost model and simulator (``plan_mesh`` with tp, pp and dp fixed): its step
(pipeline + the data-parallel traffic it does not hide) and its largest per-device peak.

- **torchtitan**, read from its repository (pytorch/torchtitan):
  ``torchtitan/models/llama3/train_configs/llama3_70b.toml`` (commit f3534d7: TP 8,
  ``data_parallel_shard_degree = -1``, i.e. FSDP over the other 8, PP 1, local batch 8,
  full activation checkpointing) and ``llama3_405b.toml`` (commit e0d2de6: TP 8, FSDP
  over the rest, PP 1, local batch 2; a preset for 128 GPUs, here over 512), and the 3D
  mesh of ``docs/performance.md`` Table 5 for 405B on 512 H100s (FSDP 8, TP 8, PP 8,
  local batch 32, 1F1B and Interleaved 1F1B; torchtitan measured 82.5 and 72.7 GiB on
  96 GB parts). Their PP meshes use the even layer split.
- **NeMo AutoConfigurator**: ``GPT3GridSearch.init_params`` in NVIDIA/NeMo
  ``nemo/collections/llm/tools/auto_configurator/core/training_config.py`` has, for 80 GB
  and 8192 tokens, branches up to 45B parameters only; 70B and 405B get the class
  defaults: tp in {1, 2, 4, 8}, pp 1, tp x pp at most 8. Each point runs Megatron's
  distributed optimizer (``--dp-shard optimizer``) on the even split.
- **autopart**: every (tp, pp) of the case's ``candidates`` with each ``--dp-shard``
  choice, planned (schedule, v, m, cuts, recompute) by ``plan_mesh``; with ``--search``
  the whole ``plan_mesh`` search over every tp x pp x dp of the devices instead (much
  slower today). The chosen mesh is the fastest autopart's own runtime runs as planned
  (ZeRO-1 is priced for the exports, shown apart: ``auto_pipeline`` keeps the optimizer
  state whole).

A caveat the table carries: autopart prices FSDP as its own runtime runs it under
torch's pipeline schedules (a stage's parameters stay gathered and its gradients whole
for the step, ``autopart.runtime.fsdp``), also at pp 1. torchtitan without PP reshards
layer by layer and reduce-scatters during the backward, so its PP-1 recipes hold less
than predicted here. Run:

    python benchmarks/bench_cluster_meshes.py [--search]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from autopart.errors import InfeasibleError, PlanError
from autopart.profile import load_device_spec, profile_model
from autopart.profile.tp_shard import profile_tp_shard
from autopart.schema import DP_SHARDS, Profile
from autopart.solve.mesh import MeshCandidate, plan_mesh

SEQ_LEN = 8192
SETTINGS = {"precision": "bf16-mixed", "optimizer": "adam", "solver": "dp",
            "refine_evals": 0}
"""The DP solver without the local search: one mesh in seconds."""

LLAMA_405B = {"num_hidden_layers": 126, "hidden_size": 16384, "num_attention_heads": 128,
              "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256,
              "max_position_embeddings": 131072, "_name_or_path": "llama-3.1-405b-shape"}
"""Llama-3.1-405B's shape on Llama-3-70B's config (same family, rope and norm)."""


@dataclass(frozen=True)
class Recipe:
    """A fixed mesh as a framework runs it."""

    label: str
    tp: int
    pp: int
    dp_shard: str
    schedule: str = "1f1b"
    even: bool = True


@dataclass(frozen=True)
class Case:
    """One model on one cluster."""

    name: str
    devices: int
    global_batch: int
    """Sequences per step over all replicas (torchtitan's local batch x its dp)."""
    candidates: tuple[tuple[int, int], ...]
    """(tp, pp) autopart plans, each with every dp-shard choice."""
    recipes: tuple[Recipe, ...]


CASES = (
    Case("llama-3-70b", 64, 64, ((4, 2), (4, 4), (4, 8), (8, 1), (8, 2), (8, 4), (8, 8)), (
        Recipe("torchtitan llama3_70b.toml", 8, 1, "params-per-microbatch"),
    )),
    Case("llama-3.1-405b", 512, 256, ((8, 4), (8, 8), (8, 16), (8, 32), (4, 16)), (
        Recipe("torchtitan llama3_405b.toml", 8, 1, "params-per-microbatch"),
        Recipe("torchtitan Table 5, 1F1B", 8, 8, "params-per-step"),
        Recipe("torchtitan Table 5, interleaved", 8, 8, "params-per-step",
               schedule="interleaved-1f1b"),
    )),
)
NEMO_GRID = ((1, 1), (2, 1), (4, 1), (8, 1))
"""NeMo's default (tp, pp) points for these sizes at 8192 tokens (module docstring)."""


def _profile(name: str) -> Profile:
    if name == "llama-3-70b":
        return profile_model(name, backend="analytical:h100", seq_len=SEQ_LEN,
                             dtype="bfloat16")
    from autopart._data import data_path

    config = json.loads(data_path("presets", "llama-3-70b.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({**config, **LLAMA_405B}))
        return profile_model(tmp, backend="analytical:h100", seq_len=SEQ_LEN,
                             dtype="bfloat16")


def _plan(profile: Profile, case: Case, tp: int, pp: int, dp_shard: str,
          shard_of, **kwargs) -> MeshCandidate | None:
    """One fixed mesh, or ``None`` when nothing fits."""
    spec = load_device_spec("h100")
    zero, per_mb = DP_SHARDS[dp_shard]
    dp = case.devices // (tp * pp)
    try:
        result = plan_mesh(profile, devices=case.devices, device=spec, tp_size=tp, pp_size=pp,
                           dp_size=dp,
                           zero_stage=zero, reshard_after_forward=per_mb,
                           global_batch_size=case.global_batch, shard_of=shard_of,
                           memory_limit_bytes=spec.memory_bytes, **SETTINGS, **kwargs)
    except (InfeasibleError, PlanError):
        return None
    return result.candidates[0]


def _row(label: str, shard: str, cand: MeshCandidate | None, mesh: str,
         best_ms: float | None) -> str:
    if cand is None:
        return f"  {label:<36} {mesh:<14} {shard:<22} {'does not fit 74.5 GiB':>32}"
    plan = cand.plan
    ratio = f"{cand.step_ms / best_ms:6.3f}x" if best_ms else "      "
    sched = f"{plan.schedule} v={plan.virtual_stages} m={plan.num_microbatches}"
    recompute = " recompute" if any(s.recompute for s in plan.stages) else ""
    return (f"  {label:<36} {mesh:<14} {shard:<22} {cand.step_ms:>11.0f} {ratio} "
            f"{cand.peak_memory_bytes / 2**30:>7.1f} GiB  {sched}{recompute}")


def run_case(case: Case, search: bool) -> None:
    """Plan autopart's meshes, the recipes and the grid; print them as one table."""
    start = time.perf_counter()
    profile = _profile(case.name)
    shard_of = functools.cache(lambda tp: profile_tp_shard(profile, tp))
    ours: list[tuple[str, MeshCandidate]] = []
    if search:
        spec = load_device_spec("h100")
        for shard, (zero, per_mb) in DP_SHARDS.items():
            try:
                result = plan_mesh(profile, devices=case.devices, device=spec,
                                   zero_stage=zero, reshard_after_forward=per_mb,
                                   global_batch_size=case.global_batch, shard_of=shard_of,
                                   memory_limit_bytes=spec.memory_bytes, **SETTINGS)
                ours.append((shard, result.candidates[0]))
            except (InfeasibleError, PlanError):
                continue
    else:
        for tp, pp in case.candidates:
            for shard in DP_SHARDS:
                cand = _plan(profile, case, tp, pp, shard, shard_of)
                if cand is not None:
                    ours.append((shard, cand))
    runnable = [sc for sc in ours if sc[0] != "optimizer"]  # what auto_pipeline runs
    best_shard, best = min(runnable, key=lambda sc: sc[1].step_ms)
    mesh = lambda c: f"tp{c.tp_size} pp{c.pp_size} dp{c.dp_size}"  # noqa: E731
    print(f"\n{case.name} on {case.devices} H100 (80 GB), global batch {case.global_batch} x "
          f"{SEQ_LEN} tokens, bf16-mixed AdamW; {len(ours)} autopart plans"
          f"{' (full search)' if search else ''}, {time.perf_counter() - start:.0f} s")
    print(f"  {'':<36} {'mesh':<14} {'dp shard':<22} {'step ms':>11} {'ratio':>7} "
          f"{'peak':>11}  schedule")
    print(_row("autopart (chosen)", best_shard, best, mesh(best), best.step_ms))
    runners = sorted((sc for sc in runnable if sc[1] is not best),
                     key=lambda sc: sc[1].step_ms)
    for shard, cand in runners[:3]:
        print(_row("autopart runner-up", shard, cand, mesh(cand), best.step_ms))
    zero1 = [c for shard, c in ours if shard == "optimizer"]
    if zero1:  # priced for the exports: autopart's runtime keeps the optimizer state whole
        cand = min(zero1, key=lambda c: c.step_ms)
        print(_row("autopart, ZeRO-1 (exports only)", "optimizer", cand, mesh(cand),
                   best.step_ms))
    for r in case.recipes:
        kwargs = {"schedule": r.schedule, **({"partition": "even"} if r.even and r.pp > 1
                                             else {})}
        if r.schedule == "interleaved-1f1b":
            kwargs["virtual_stages"] = 2
        cand = _plan(profile, case, r.tp, r.pp, r.dp_shard, shard_of, **kwargs)
        text = f"tp{r.tp} pp{r.pp} dp{case.devices // (r.tp * r.pp)}"
        print(_row(r.label, r.dp_shard, cand, text, best.step_ms))
        same = _plan(profile, case, r.tp, r.pp, r.dp_shard, shard_of)
        print(_row("  autopart on that mesh", r.dp_shard, same, text, best.step_ms))
    fitting = []
    for tp, pp in NEMO_GRID:
        cand = _plan(profile, case, tp, pp, "optimizer", shard_of, partition="even",
                     schedule="1f1b")
        if cand is not None:
            fitting.append(cand)
    print(f"  NeMo AutoConfigurator grid: {len(NEMO_GRID)} (tp, pp) points "
          f"{list(NEMO_GRID)}, {len(fitting)} fit memory")
    if fitting:
        point = min(fitting, key=lambda c: c.step_ms)
        print(_row("NeMo grid, best point", "optimizer", point, mesh(point), best.step_ms))


def main() -> None:
    """Both cases; ``--search`` runs ``plan_mesh``'s whole search for autopart's column."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search", action="store_true",
                        help="autopart's column from the whole mesh search (slow)")
    parser.add_argument("--case", choices=[c.name for c in CASES], default=None)
    args = parser.parse_args()
    for case in CASES:
        if args.case in (None, case.name):
            try:
                run_case(case, args.search)
            except PlanError as exc:
                print(f"{case.name}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    main()
