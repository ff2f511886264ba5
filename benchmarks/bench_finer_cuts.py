"""How close finer cuts get to perfect balance (analytical H100 profiles, no GPU needed).

Perfect balance for 1F1B is ``(m + p - 1) * sum(F + B) / p``: every rank busy the
same time. For each model at seq 4096, bf16, pp 8, 1F1B, m 32, prints the
simulated step of the anchors' rules (even = NxD/NeMo/Megatron, params =
DeepSpeed, torchtitan) and of autopart's plan at whole-layer granularity, then
autopart's plan with each decoder layer profiled as two blocks (``sublayer``:
attention half, MLP half), as four (``quarter``: each half cut before its output
projection, where the residual crosses beside the projection's input) and with each
half cut inside its call into slices (``slice``: KV-head groups, MLP column groups;
the half's input, the residual and the partial sum cross), each divided by its
profile's perfect balance.
Target: plan / perfect <= 1.03 at the finest granularity for the 7B-class rows;
<= 1.10 for Llama-3.2-1B, whose 128k-vocabulary head is 1.76x an ideal stage, once
the head is split by vocabulary (``+head`` rows: ``lm_head.shard<i>of<k>`` blocks).
Halves and quarters do not reach it everywhere: the MLP up to its output projection
is over half a layer, so interior stages still round to it (the 'best' column
proves it); p2p transfers are
simulated over the H100's links from profiles/devices.json, as ``autopart plan``
does (the 'free links' column drops them, as the issue's figures did). 'slowest' is
the plan's slowest stage (F+B) over the ideal ``sum(F+B) / p`` and 'best' the smallest
slowest stage any split of the profiled blocks could have (exact, head whole): where
they are equal, no plan over these blocks does better and only finer blocks can.

    python benchmarks/bench_finer_cuts.py

Rows are ``Case`` entries in ``CASES``; each ``Split`` is one column set (a
granularity and a way to profile/plan), so finer granularities add a ``Split``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from autopart.granularity import fuse_quarters
from autopart.profile import load_device_spec, profile_model
from autopart.schema import Profile
from autopart.solve import make_plan
from autopart.solve.slices import slice_halves

PP, M, SEQ = 8, 32, 4096
MEMORY_LIMIT = 80 * 2**30
TARGET = 1.03


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
    """One model row: its name, how to get it, and the ratio it must reach."""

    name: str
    source: Callable[[], str | nn.Module]
    target: float | None = TARGET
    """Bound on the finest split's plan / perfect (None: shown, not checked)."""


@dataclass(frozen=True)
class Split:
    """One granularity: how the model is profiled and planned."""

    name: str
    granularity: str
    plan_options: dict = field(default_factory=dict)


CASES = [
    Case("Qwen2.5-7B", lambda: "qwen2.5-7b"),
    Case("Gemma-7B", _gemma_7b),
    Case("Mistral-7B", lambda: "mistral-7b"),
    Case("Llama-3.2-1B", lambda: "llama-3.2-1b", target=1.10),
]
SPLITS = [Split("layer", "layer", {"granularity": "layer"}),
          Split("layer+head", "layer"),
          Split("sublayer+head", "sublayer", {"granularity": "sublayer"}),
          Split("quarter+head", "quarter", {"granularity": "quarter"}),
          Split("slice+head", "sublayer", {"granularity": "slice"}),
          Split("auto", "quarter")]
"""Coarse to fine; the last one is checked against the case's target. ``layer``: whole
layers and head; ``+head``: the head split into vocabulary shards (``lm_head.shard<i>of<k>``)
beside whole layers, layer halves, quarters (each half cut before its output projection
too, ``autopart.intake.inner``) or slices (each half cut inside its call into 4 KV-head
or MLP-column groups, ``autopart.solve.slices``); ``auto``: what ``autopart plan`` does by
default on a ``quarter`` profile (the faster of slices and quarters, head split or whole)."""


def perfect_ms(profile: Profile) -> float:
    """``(m + p - 1) * sum(F + B) / p`` of ``profile`` (1F1B with no bubble imbalance)."""
    total = sum(b.fwd_ms + b.bwd_ms for b in profile.blocks)
    return (M + PP - 1) * total / PP


def _plan(profile: Profile, split: Split, free_links: bool):
    spec = load_device_spec("h100")
    links = {"link_bandwidth_bytes_per_s": 1e18, "link_latency_ms": 0.0} if free_links else {
        "link_bandwidth_bytes_per_s": spec.link_bandwidth_bytes_per_s,
        "link_latency_ms": spec.link_latency_ms}
    return make_plan(profile, pp_size=PP, schedule="1f1b", num_microbatches=M,
                     memory_limit_bytes=MEMORY_LIMIT, param_dtype="bfloat16",
                     grad_dtype="bfloat16", **links, **split.plan_options)


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


def plan_rows(case: Case, split: Split) -> list[tuple]:
    """``(split name, step / perfect, same with free links, blocks per stage, plan's slowest
    stage / ideal, best slowest stage / ideal)`` rows: the anchors' rules (first split
    only), then autopart at ``split``."""
    profile = profile_model(case.source(), backend="analytical:h100", seq_len=SEQ,
                            dtype="bfloat16", granularity=split.granularity)
    perfect = perfect_ms(profile)
    plan, free = _plan(profile, split, False), _plan(profile, split, True)
    rows = []
    if split is SPLITS[0]:
        rows = [(name, info.predicted_step_ms / perfect,
                 free.baselines[name].predicted_step_ms / perfect, None, None, None)
                for name, info in sorted(plan.baselines.items())]
    sizes = [len(s.modules) for s in plan.stages]
    ideal = perfect / (M + PP - 1)
    slowest = max(s.fwd_ms + s.bwd_ms for s in plan.stages)
    planned = profile
    if any(".slice" in m for s in plan.stages for m in s.modules):  # best over the slices
        planned = slice_halves(fuse_quarters(profile))
    return rows + [(f"autopart {split.name}", plan.predicted_step_ms / perfect,
                    free.predicted_step_ms / perfect, sizes, slowest / ideal,
                    best_max_stage_ms(planned) / ideal)]


def main() -> None:
    """Profile, plan and print one line per (model, split)."""
    print(f"pp {PP}, 1F1B, m {M}, seq {SEQ}, bf16, analytical H100, {MEMORY_LIMIT >> 30} GiB; "
          f"step/perfect = simulated step / ((m + p - 1) * sum(F+B) / p); 'free links' "
          f"simulates with no p2p cost; 'slowest' = the plan's slowest stage F+B / ideal "
          f"(sum(F+B) / p), 'best' = the smallest slowest stage any split of the profiled "
          f"blocks (head whole) can have / ideal")
    print(f"{'model':<12} {'split':<22} {'step/perfect':>13} {'free links':>11} "
          f"{'slowest':>8} {'best':>6}  blocks/stage")
    failures = []
    for case in CASES:
        for split in SPLITS:
            for name, ratio, free, sizes, slowest, best in plan_rows(case, split):
                extra = f"{slowest:>8.3f} {best:>6.3f}" if slowest else f"{'':>8} {'':>6}"
                print(f"{case.name:<12} {name:<22} {ratio:>13.3f} {free:>11.3f} {extra}  "
                      f"{sizes or ''}")
        if case.target is not None and ratio > case.target + 1e-9:
            failures.append(f"{case.name}: {ratio:.3f} > {case.target}")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))


if __name__ == "__main__":
    main()
