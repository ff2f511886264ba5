"""Does the sum of per-block times match the whole model? (profile accuracy on CPU)

Builds a small Llama (hidden 384, 4 layers, seq 256 by default), then, in
alternating rounds so that background load hits both alike:

* whole model: ``loss = model(input_ids, labels=labels).loss; loss.backward()``,
  timed end to end (median of ``--repeats`` after warm-up);
* per block: ``autopart.profile.profile_model`` on the same config and input shape;
  the figure is the sum over blocks of ``fwd_ms + bwd_ms``.

Each round measures both back to back; the reported ratio is the median over
rounds of (per-block sum / whole model), which cancels load that changes between
rounds. The target is within 15% (0.85 .. 1.15).

Run: ``/work/venv/bin/python benchmarks/bench_profile_accuracy.py [--threads 1]
[--hidden 384] [--seq-len 256] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from autopart.intake import LoadedModel
from autopart.profile import profile_model
from autopart.profile.backends import auto_clock


def make_config(hidden: int, layers: int, vocab: int, seq_len: int):
    """A Llama config of the given width, head_dim 64."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(hidden // 128, 1), vocab_size=vocab,
                         max_position_embeddings=max(seq_len, 512), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def time_whole_model(config, seq_len: int, warmup: int, repeats: int) -> float:
    """Median ms of forward + loss + backward of the full model on CPU, on the clock the
    profile uses (``autopart.profile.backends.auto_clock``: the thread's CPU time with one
    torch thread, else the wall clock), so both sides read the same clock."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (1, seq_len))
    labels = torch.randint(0, config.vocab_size, (1, seq_len))
    clock = time.thread_time if auto_clock("cpu") == "thread" else time.perf_counter
    samples = []
    for i in range(warmup + repeats):
        start = clock()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        elapsed = (clock() - start) * 1e3
        if i >= warmup:
            samples.append(elapsed)
    return statistics.median(samples)


def time_blocks(config, seq_len: int, warmup: int, repeats: int,
                cache_flush: str | None = None) -> float:
    """Sum over blocks of the profiled fwd_ms + bwd_ms (``cache_flush``: the profile's
    ``ProfileOptions.cache_flush``, its default when ``None``)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    loaded = LoadedModel(model=model, name="bench-llama", source="bench", config=config)
    flush = {} if cache_flush is None else {"cache_flush": cache_flush}
    profile = profile_model(loaded, backend="cpu", seq_len=seq_len, num_warmup=warmup,
                            num_repeats=repeats, **flush)
    return sum(b.fwd_ms + b.bwd_ms for b in profile.blocks)


def main() -> None:
    """Alternate whole-model and per-block measurements; print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cache-flush", default="default",
                        help="comma-separated ProfileOptions.cache_flush values to compare in "
                             "the same rounds (none, llc; default: the profile's default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = make_config(args.hidden, args.layers, args.vocab, args.seq_len)
    flushes = [None if f == "default" else f for f in args.cache_flush.split(",")]
    whole: list[float] = []
    blocks: dict[str | None, list[float]] = {f: [] for f in flushes}
    for _ in range(args.rounds):
        whole.append(time_whole_model(config, args.seq_len, 3, args.repeats))
        for flush in flushes:
            blocks[flush].append(time_blocks(config, args.seq_len, 3, args.repeats, flush))
    print(f"config: llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"seq {args.seq_len}, mbs 1, float32, {args.threads} thread(s), {args.rounds} rounds")
    print(f"{'measure':<34}{'ms':>10}")
    print(f"{'whole model fwd+loss+bwd':<34}{statistics.median(whole):>10.2f}")
    for flush, sums in blocks.items():
        ratio = statistics.median(x / y for x, y in zip(sums, whole, strict=True))
        label = f"sum of per-block fwd+bwd ({flush or 'default flush'})"
        print(f"{label:<34}{statistics.median(sums):>10.2f}")
        print(f"  ratio (blocks / whole), median over rounds: {ratio:.3f}  (target 0.85 .. 1.15)"
              f"; rounds {[round(x, 2) for x in sums]}")
    print(f"rounds whole: {[round(x, 2) for x in whole]}; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
