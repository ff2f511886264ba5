"""Plan vs public baselines on real model shapes (analytical H100 profiles, no GPU needed).

For Llama-3-8B and Qwen2.5-7B at 4k tokens, bf16, pp 8, 1F1B, 32 microbatches,
prints the plan's simulated step next to the even (NxD/NeMo), parameter-balanced
(DeepSpeed) and torchtitan splits, simulated by the same simulator on the same
profile, and the speed-up over each. Targets: >= 1.15x over even, >= 1.0x over
every baseline.

    python benchmarks/bench_plan_real_shapes.py
"""

from __future__ import annotations

import time

from autopart.profile import profile_model
from autopart.solve import make_plan

MODELS = ("llama-3-8b", "qwen2.5-7b")


def main() -> None:
    """Profile, plan and print one row per (model, baseline)."""
    print(f"{'model':<12} {'split':<11} {'step ms':>10} {'speed-up':>9}  cuts")
    failures = []
    for name in MODELS:
        profile = profile_model(name, backend="analytical:h100", seq_len=4096,
                                dtype="bfloat16")
        start = time.perf_counter()
        plan = make_plan(profile, pp_size=8, schedule="1f1b", num_microbatches=32,
                         memory_limit_bytes=80 * 2**30)
        seconds = time.perf_counter() - start
        print(f"{name:<12} {'autopart':<11} {plan.predicted_step_ms:>10.1f} {'':>9}  "
              f"{list(plan.pipeline_cuts)}  (planned in {seconds:.2f} s)")
        for base, info in sorted(plan.baselines.items()):
            print(f"{'':<12} {base:<11} {info.predicted_step_ms:>10.1f} "
                  f"{info.speedup:>8.3f}x  blocks per stage {list(info.stage_num_blocks)}")
            floor = 1.15 if base == "even" else 1.0
            if info.speedup < floor - 1e-9:
                failures.append(f"{name} vs {base}: {info.speedup:.3f}x < {floor}x")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))


if __name__ == "__main__":
    main()
