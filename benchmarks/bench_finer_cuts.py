"""How close the default commands get to perfect balance (analytical H100, no GPU needed).

Perfect balance for 1F1B is ``(m + p - 1) * sum(F + B) / p``: every rank busy the
same time. For each model at seq 4096, bf16, pp 8, 1F1B, m 32 it profiles as
``autopart profile MODEL --backend analytical:h100`` does by default (the finest level
found exact: each layer's halves cut before their output projection, halves that can be
summed over units offered as slices, the head splittable by vocabulary) and plans as
``autopart plan P --pp 8 --schedule 1f1b --microbatches 32`` does by default (every level,
the head whole or split; the device's memory and links from the profile). No granularity
is named anywhere. Beside it: the anchors' rules (even = NxD/NeMo/Megatron, params =
DeepSpeed, torchtitan) and autopart's plan over whole layers with the head whole (the
default profile fused back to layers, ``autopart.levels.coarsen``), each divided by the
profile's perfect balance. 'free links' simulates the same splits with no p2p cost;
'slowest' is the plan's slowest stage (F+B) over the ideal ``sum(F+B) / p`` and 'best'
the smallest slowest stage any split of the whole-layer blocks could have (exact). The
``--devices 8`` row is the mesh search with tp and dp fixed to 1 (pp 8 left to it), as
``autopart plan P --devices 8 --tp 1 --dp 1 --global-batch-size 32`` plans it.
Target: default plan / perfect <= 1.03 for the 7B-class rows, <= 1.10 for Llama-3.2-1B
(its 128k-vocabulary head is 1.76x an ideal stage).

    python benchmarks/bench_finer_cuts.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from autopart.levels import coarsen
from autopart.profile import profile_model
from autopart.schema import Plan, Profile
from autopart.solve import make_plan

PP, M, SEQ = 8, 32, 4096


def _gemma_7b() -> nn.Module:
    """Gemma-7B from its config (no hub access): 28 layers, 256k vocabulary, tied."""
    from transformers import AutoConfig

    from autopart.intake.sources import build_hf_model

    config = AutoConfig.for_model(
        "gemma", hidden_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=16, head_dim=256, intermediate_size=24576, vocab_size=256000,
        tie_word_embeddings=True, max_position_embeddings=8192)
    return build_hf_model(config)


@dataclass(frozen=True)
class Case:
    """One model row: its name, how to get it, and the ratio the default plan must reach."""

    name: str
    source: Callable[[], str | nn.Module]
    target: float = 1.03


CASES = [
    Case("Qwen2.5-7B", lambda: "qwen2.5-7b"),
    Case("Gemma-7B", _gemma_7b),
    Case("Mistral-7B", lambda: "mistral-7b"),
    Case("Llama-3.2-1B", lambda: "llama-3.2-1b", target=1.10),
]


def perfect_ms(profile: Profile) -> float:
    """``(m + p - 1) * sum(F + B) / p`` of ``profile`` (1F1B with no bubble imbalance)."""
    total = sum(b.fwd_ms + b.bwd_ms for b in profile.blocks)
    return (M + PP - 1) * total / PP


def _plan(profile: Profile, free_links: bool, **options) -> Plan:
    """The default plan (links from the profile's device, or free; with ``devices``, the
    mesh search's, whose links are the device's)."""
    links = {"link_bandwidth_bytes_per_s": 1e18, "link_latency_ms": 0.0} if free_links else {}
    if "devices" in options:
        from autopart.profile import load_device_spec

        spec = load_device_spec("h100")
        if free_links:  # the mesh takes its links from the spec: free ones for this column
            free = {"bandwidth_bytes_per_s": 1e18, "latency_ms": 0.0}
            spec = dataclasses.replace(
                spec, intra_node=dataclasses.replace(spec.intra_node, **free),
                inter_node=dataclasses.replace(spec.inter_node, **free))
        links = {"device": spec}
    fields = {"pp_size": PP, "schedule": "1f1b", "num_microbatches": M, **links, **options}
    return make_plan(profile, **fields)


def best_max_stage_ms(profile: Profile, num_stages: int = PP) -> float:
    """The smallest slowest-stage F+B of any split of ``profile``'s blocks (head whole)
    into ``num_stages`` contiguous stages: exact DP over (first block, stages left)."""
    load = [b.fwd_ms + b.bwd_ms for b in profile.blocks]
    prefix = [0.0]
    for x in load:
        prefix.append(prefix[-1] + x)
    n = len(load)
    best = [prefix[n] - prefix[i] for i in range(n + 1)]  # one stage from block i
    for k in range(2, num_stages + 1):
        best = [min((max(prefix[j] - prefix[i], best[j]) for j in range(i + 1, n - k + 2)),
                    default=float("inf")) for i in range(n + 1)]
    return best[0]


def plan_rows(case: Case) -> list[tuple]:
    """``(name, step / perfect, same with free links, blocks per stage, plan's slowest
    stage / ideal, best slowest stage / ideal, chosen level)`` rows: the anchors' rules, the
    whole-layer plan, the default plan."""
    profile = profile_model(case.source(), backend="analytical:h100", seq_len=SEQ,
                            dtype="bfloat16")
    layers = coarsen(profile, "layer", head=False)
    perfect = perfect_ms(profile)
    ideal = perfect / (M + PP - 1)
    rows = []
    whole, whole_free = (_plan(layers, free, split_head=False) for free in (False, True))
    for name, info in sorted(whole.baselines.items()):
        rows.append((name, info.predicted_step_ms / perfect,
                     whole_free.baselines[name].predicted_step_ms / perfect, None, None, None,
                     ""))
    best = best_max_stage_ms(layers) / ideal
    mesh = [_plan(profile, free, devices=PP, tp_size=1, dp_size=1, pp_size=None,
                  global_batch_size=M) for free in (False, True)]
    for name, plan, free in (("autopart, whole layers", whole, whole_free),
                             ("autopart default", *(_plan(profile, f) for f in (False, True))),
                             (f"  --devices {PP}, tp 1 dp 1", *mesh)):
        sizes = [len(s.modules) for s in plan.stages]
        slowest = max(s.fwd_ms + s.bwd_ms for s in plan.stages)
        level = f"{plan.granularity}" + (f", head in {plan.head_shards}" if plan.head_shards
                                         else "")
        rows.append((name, plan.predicted_step_ms / perfect, free.predicted_step_ms / perfect,
                     sizes, slowest / ideal, best if plan is whole else None, level))
    return rows


def main() -> None:
    """Profile, plan and print one line per (model, split)."""
    print(f"pp {PP}, 1F1B, m {M}, seq {SEQ}, bf16, analytical H100 (its memory and links); "
          f"step/perfect = simulated step / ((m + p - 1) * sum(F+B) / p); 'free links' "
          f"simulates with no p2p cost; 'slowest' = the plan's slowest stage F+B / ideal "
          f"(sum(F+B) / p), 'best' = the smallest slowest stage any split of whole layers "
          f"and the whole head can have / ideal")
    print(f"{'model':<12} {'split':<26} {'step/perfect':>13} {'free links':>11} "
          f"{'slowest':>8} {'best':>6}  level / blocks per stage")
    failures = []
    for case in CASES:
        for name, ratio, free, sizes, slowest, best, level in plan_rows(case):
            extra = f"{slowest:>8.3f} " if slowest else f"{'':>8} "
            extra += f"{best:>6.3f}" if best else f"{'':>6}"
            print(f"{case.name:<12} {name:<26} {ratio:>13.3f} {free:>11.3f} {extra}  "
                  f"{level + ' ' if level else ''}{sizes or ''}")
            checked = name == "autopart default" or name.strip().startswith("--devices")
            if checked and ratio > case.target + 1e-9:
                failures.append(f"{case.name} {name.strip()}: {ratio:.3f} > {case.target}")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))


if __name__ == "__main__":
    main()
