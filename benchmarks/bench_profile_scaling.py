"""Does profiling cost grow with depth? (48 layers vs 4 layers of the same width)

Writes two Llama ``config.json`` files that differ only in ``num_hidden_layers``
(4 and 48) and times ``autopart.profile.profile_model(path)`` on each, end to
end: building the model on meta, discovering blocks, materializing and measuring.
Identical decoder layers are measured once and reused, so the target is
``t(48) <= 1.5 * t(4)`` with calls timed back to back (``--cache-flush none``). The CPU
default (``model``) reads the model's weights' worth before every timed call, so its
cost grows with the weights until that read reaches twice the last-level cache, where it
stops. Rounds alternate 4 and 48 layers; medians are reported.

Run: ``python benchmarks/bench_profile_scaling.py [--hidden 256] [--seq-len 128]
[--rounds 3] [--cache-flush none]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from autopart.profile import profile_model


def write_config(root: Path, layers: int, hidden: int) -> Path:
    """A Llama config.json with ``layers`` decoder layers of width ``hidden``."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": hidden, "intermediate_size": hidden * 8 // 3,
              "num_hidden_layers": layers, "num_attention_heads": max(hidden // 64, 1),
              "num_key_value_heads": max(hidden // 128, 1), "vocab_size": 4096,
              "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "_name_or_path": f"llama-{layers}l-{hidden}"}
    path = root / f"llama-{layers}" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config))
    return path


def time_profile(path: Path, seq_len: int, repeats: int,
                 cache_flush: str = "auto") -> tuple[float, int]:
    """Seconds of one end-to-end ``profile_model`` call, and how many blocks it measured."""
    start = time.perf_counter()
    profile = profile_model(str(path), backend="cpu", seq_len=seq_len, num_warmup=3,
                            num_repeats=repeats, cache_flush=cache_flush)
    elapsed = time.perf_counter() - start
    return elapsed, sum(1 for b in profile.blocks if b.reused_from is None)


def main() -> None:
    """Alternate 4- and 48-layer profiles; print times and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-flush", default="auto", choices=("auto", "model", "none"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        small, large = write_config(Path(tmp), 4, args.hidden), write_config(Path(tmp), 48,
                                                                            args.hidden)
        time_profile(small, args.seq_len, 1, args.cache_flush)  # imports, first calls
        times: dict[int, list[float]] = {4: [], 48: []}
        measured: dict[int, int] = {}
        for _ in range(args.rounds):
            for layers, path in ((4, small), (48, large)):
                seconds, measured[layers] = time_profile(path, args.seq_len, args.repeats,
                                                         args.cache_flush)
                times[layers].append(seconds)
    t4, t48 = statistics.median(times[4]), statistics.median(times[48])
    print(f"llama hidden {args.hidden}, seq {args.seq_len}, {args.repeats} repeats, "
          f"{args.threads} thread(s), {args.rounds} rounds, cache flush {args.cache_flush}")
    print(f"{'layers':>6} {'seconds':>9} {'blocks measured':>16}")
    print(f"{4:>6} {t4:>9.2f} {measured[4]:>16}")
    print(f"{48:>6} {t48:>9.2f} {measured[48]:>16}")
    print(f"ratio t(48) / t(4): {t48 / t4:.2f}  (target <= 1.5 with --cache-flush none)")


if __name__ == "__main__":
    main()
