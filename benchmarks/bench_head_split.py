"""A vocabulary-heavy Llama on 2 CPU ranks: the head split by vocabulary vs the best
whole-block plan, predicted and measured.

The model is ``heavy-head-llama`` (vocabulary 32768, hidden 256) with 4 decoder
layers, so the head (lm_head + loss) costs more than all the layers together and
is the wall of any whole-block split over 2 ranks. Profiles it on CPU as
``autopart profile --pp 2`` does (one thread, as each rank runs, beside one busy
neighbour), measures the local gloo link, then plans pp=2, 1F1B,
m fixed, ``partition="optimal"`` twice: ``granularity="layer"`` (whole blocks, the
best a partitioner without a head split can do) and ``granularity="sublayer"`` (the
head split into vocabulary shards, ``lm_head.shard<i>of<k>``), and says which of the
two ``auto`` picks. Both run for real
under ``autopart.verify`` (2 spawned gloo ranks, one thread each). Prints per plan
its cut, predicted and measured step with the error, per-rank memory, and the
head split's speed-up over the whole-block plan, predicted and measured. Run it on
an idle machine; it prints the load average it saw.

    python benchmarks/bench_head_split.py [--seq-len 128] [--microbatches 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench_verify_heavy_head import measure_link, print_reports, profile_for_two_ranks, run_args

from autopart.solve import make_plan
from autopart.verify import RunReport, RunSettings, verify_plan

PRESET = Path(__file__).resolve().parents[1] / "profiles" / "presets" / "heavy-head-llama.json"
NUM_LAYERS = 4


def model_config(directory: str) -> str:
    """The heavy-head-llama config with ``NUM_LAYERS`` layers, written to ``directory``."""
    config = json.loads(PRESET.read_text())
    config.update(num_hidden_layers=NUM_LAYERS, _name_or_path=f"heavy-head-llama-{NUM_LAYERS}l")
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(config, indent=2))
    return str(path)


def main() -> None:
    args = run_args(__doc__.split("\n\n")[0])
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_config(tmp)
        profile = profile_for_two_ranks(model, args)
        boundary = max(b.output_bytes for b in profile.blocks if b.kind == "decoder_layer")
        latency_ms, bandwidth, _ = measure_link(boundary)
        print(f"gloo link (localhost): latency {latency_ms * 1e3:.0f} us, bandwidth "
              f"{bandwidth / 1e9:.2f} GB/s")
        plans = {name: make_plan(profile, pp_size=2, num_microbatches=args.microbatches,
                                 schedule="1f1b", virtual_stages=1, granularity=granularity,
                                 link_latency_ms=latency_ms,
                                 link_bandwidth_bytes_per_s=bandwidth)
                 for name, granularity in (("head split", "sublayer"), ("whole blocks", "layer"),
                                           ("auto", "auto"))}
        auto = plans.pop("auto")
        print(f"auto granularity: cut after {auto.pipeline_cuts[0]} "
              f"({'head split' if auto.granularity == 'sublayer' else 'head whole'}); "
              f"head gradient zero-fill {profile.setup.head_grad_ms:.2f} ms per step (measured)")
        settings = RunSettings(model=model, steps=args.steps, warmup=args.warmup,
                               threads_per_rank=1)
        reports = {}
        for name, plan in plans.items():
            print(f"{name:>12} plan: cut after {plan.pipeline_cuts[0]}, predicted "
                  f"{plan.predicted_step_ms:.1f} ms")
            reports[name] = verify_plan(plan, settings)
    load_after = os.getloadavg()
    _print_table(reports, profile, args)
    split, whole = reports["head split"], reports["whole blocks"]
    print(f"speed-up of the head split over the best whole-block plan: measured "
          f"{whole.measured_step_ms / split.measured_step_ms:.3f}x, predicted "
          f"{whole.predicted_step_ms / split.predicted_step_ms:.3f}x")
    print(f"load average: before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"(1-minute; 2 ranks x 1 thread)")


def _print_table(reports: dict[str, RunReport], profile, args: argparse.Namespace) -> None:
    head_ms = profile.blocks[-1].fwd_ms + profile.blocks[-1].bwd_ms
    layer_ms = sum(b.fwd_ms + b.bwd_ms for b in profile.blocks if b.kind == "decoder_layer")
    print(f"heavy-head-llama-{NUM_LAYERS}l, pp=2, 1f1b, m={args.microbatches}, micro batch "
          f"{args.micro_batch_size} x {args.seq_len}, {args.steps} timed steps; head F+B "
          f"{head_ms:.1f} ms vs all layers {layer_ms:.1f} ms (profiled)")
    print_reports(reports, with_waits=False)


if __name__ == "__main__":
    main()
