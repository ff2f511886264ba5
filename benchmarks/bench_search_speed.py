"""Plan speed as a user sees it, and search quality against brute force.

Run: python benchmarks/bench_search_speed.py [--chains 100] [--skip-auto]

(a) Speed: ``autopart plan`` as a whole process (a subprocess, wall time including
    imports) on a synthetic 1,000-block profile and on a ~2,000-block sub-layer-like one
    (attention and MLP halves), pp 64, m 256: a fixed 1F1B plan (target <= 5 s) and the
    auto search (target <= 15 s); and on a 1,003-block profile shaped like what
    ``autopart profile`` writes by default (Llama-3.2-1B's analytical default profile with
    its layer repeated to 250 layers: each layer's halves cut before their output
    projection, halves offered as slices, the head splittable), where the default plan
    loops over the levels and the head whole or split (target <= 15 s).
    Each run is also checked to leave torch and transformers unimported where the
    schedule does not need torch's orders, and to print the same plan twice.
(b) Quality (item 6): random 12-block chains, 1F1B pp 4 m 8; every one of the 165
    splits is simulated and the plan's step is compared with the fastest: max and
    mean gap over ``--chains`` chains (before issue 11: up to 7.9%).
Ends with one table: case, measured, target, PASS/FAIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from solve_helpers import MIB, llama_like, make_block, make_profile  # noqa: E402

from autopart.cost.blocks import block_arrays  # noqa: E402
from autopart.cost.stage import stage_cost  # noqa: E402
from autopart.schema import Profile, TrainingSetup  # noqa: E402
from autopart.simulate import simulate  # noqa: E402
from autopart.solve import make_plan  # noqa: E402

_FIXED_TARGET_S = 5.0
_AUTO_TARGET_S = 15.0
_PROBE = ("import runpy, sys; sys.argv = ['autopart'] + sys.argv[1:]; "
          "from autopart.cli.main import main; rc = main(); "
          "print('IMPORTED', 'torch' in sys.modules, 'transformers' in sys.modules, "
          "file=sys.stderr); sys.exit(rc)")


def sublayer_profile(num_layers: int) -> Profile:
    """embedding, attention and MLP halves of every layer, norm, head (~2 blocks/layer)."""
    base = llama_like(num_layers, act_bytes=10 * MIB)
    blocks = [base.blocks[0]]
    for layer in base.blocks[1:-2]:
        blocks.append(make_block(f"{layer.name}.self_attn", kind="attention",
                                 fwd_ms=0.4, num_params=layer.num_params // 3,
                                 activation_bytes=4 * MIB, output_bytes=MIB))
        blocks.append(make_block(f"{layer.name}.mlp", kind="mlp", fwd_ms=0.6,
                                 num_params=layer.num_params - layer.num_params // 3,
                                 activation_bytes=6 * MIB, output_bytes=MIB))
    return make_profile(blocks + list(base.blocks[-2:]), name=f"sublayer{num_layers}")


def default_like(num_layers: int = 250) -> Profile:
    """Llama-3.2-1B's default analytical profile (seq 4096, bf16) with its first layer's
    four pieces repeated ``num_layers`` times, renamed (parts included)."""
    from autopart.profile import profile_model

    base = profile_model("llama-3.2-1b", backend="analytical:h100", seq_len=4096,
                         dtype="bfloat16")
    pieces = [b for b in base.blocks if b.layer == "model.layers.0"]

    def renamed(block, i: int):
        def fix(text: str) -> str:
            return text.replace("model.layers.0", f"model.layers.{i}", 1)
        return dataclasses.replace(
            block, name=fix(block.name), modules=tuple(fix(m) for m in block.modules),
            parts=tuple(dataclasses.replace(p, module=fix(p.module)) for p in block.parts),
            reused_from=pieces[0].name if i and block is pieces[0] else None)

    blocks = [base.blocks[0], *(renamed(b, i) for i in range(num_layers) for b in pieces),
              *base.blocks[-2:]]
    model = dataclasses.replace(base.model, name=f"default{len(blocks)}",
                                fingerprint=f"fp-default-{len(blocks)}", num_layers=num_layers)
    return dataclasses.replace(base, model=model, blocks=tuple(blocks))


def run_plan(path: Path, extra: list[str]) -> tuple[float, float, str, str]:
    """Wall and CPU seconds of ``autopart plan`` in a fresh process, its plan's hash, and
    whether it imported torch / transformers (CPU time shows the work on a shared
    machine, where the wall time grows with the load)."""
    cmd = [sys.executable, "-c", _PROBE, "plan", str(path), "--pp", "64", "--microbatches",
           "256", "--format", "json", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    imported = next(line for line in out.stderr.splitlines() if line.startswith("IMPORTED"))
    return seconds, cpu, hashlib.sha256(out.stdout.encode()).hexdigest()[:12], imported


def brute_force_step(profile: Profile, pp: int, m: int) -> float:
    """The fastest simulated 1F1B step over every split into pp stages."""
    setup = TrainingSetup(pp_size=pp, num_microbatches=m)
    arrays, n = block_arrays(profile, setup), len(profile.blocks)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), pp - 1):
        edges = [0, *cuts, n]
        costs = [stage_cost(arrays, i, j - 1) for i, j in itertools.pairwise(edges)]
        best = min(best, simulate(costs, schedule="1f1b", pp_size=pp, virtual_stages=1,
                                  num_microbatches=m, setup=setup,
                                  record_events=False).step_ms)
    return best


def quality(num_chains: int) -> tuple[float, float]:
    """Max and mean relative gap of the plan over brute force on random chains."""
    rng, gaps = random.Random(0), []
    for k in range(num_chains):
        blocks = [make_block(f"b{i}", fwd_ms=rng.uniform(0.1, 3.0),
                             bwd_ms=rng.uniform(0.2, 6.0), output_bytes=rng.randint(1, 64) * MIB)
                  for i in range(12)]
        profile = make_profile(blocks, f"chain{k}")
        plan = make_plan(profile, pp_size=4, num_microbatches=8, schedule="1f1b")
        gaps.append(plan.predicted_step_ms / brute_force_step(profile, 4, 8) - 1)
    return max(gaps), sum(gaps) / len(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=100)
    parser.add_argument("--skip-auto", action="store_true", help="only the fixed 1F1B plans")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, profile in (("1,000 blocks", llama_like(997, act_bytes=10 * MIB)),
                               ("sub-layer", sublayer_profile(997)),
                               ("default-profile", default_like())):
            path = Path(tmp) / f"{profile.model.name}.json"
            profile.save(str(path))
            cases = [("fixed 1F1B", ["--schedule", "1f1b"], _FIXED_TARGET_S)]
            if not args.skip_auto:
                cases.append(("auto search", [], _AUTO_TARGET_S))
            for what, extra, target in cases:
                seconds, cpu, digest, imported = run_plan(path, extra)
                again, cpu2, digest2, _ = run_plan(path, extra)
                name = f"{what}, {label} ({len(profile.blocks)}), pp 64, m 256"
                print(f"{name}: wall {seconds:.1f} s and {again:.1f} s, CPU {cpu:.1f} s and "
                      f"{cpu2:.1f} s, plan {digest} / {digest2} (identical: "
                      f"{digest == digest2}); torch, transformers imported: "
                      f"{imported.split()[1:]}; load average {os.getloadavg()[0]:.1f}",
                      flush=True)
                wall = min(seconds, again)
                rows.append((name, f"{wall:.1f} s wall, {min(cpu, cpu2):.1f} s CPU",
                             f"<= {target:g} s, same plan", wall <= target and digest == digest2))
    start = time.perf_counter()
    worst, mean = quality(args.chains)
    print(f"brute force: {args.chains} chains in {time.perf_counter() - start:.1f} s")
    rows.append((f"plan vs brute force, {args.chains} random 12-block chains, 1F1B pp 4 m 8",
                 f"max {worst:.2%}, mean {mean:.3%}", "(was up to 7.9%)", worst < 0.079))
    print(f"\n{'case':66s} {'measured':24s} {'target':20s}")
    for name, got, target, ok in rows:
        print(f"{name:66s} {got:24s} {target:20s} {'PASS' if ok else 'FAIL'}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
