"""What the default (finest) profile costs against whole layers: profiling time and blocks.

    python benchmarks/bench_profile_levels.py

``autopart profile MODEL`` records the finest level it finds exact (each decoder layer's
halves cut before their output projection); identical parts are measured once, so its
cost grows with the kinds of parts, not with the layers. For each model this runs
``autopart profile`` as a user does (a fresh process, imports included) at the default
and with ``--granularity layer``, and prints the wall time of each, their ratio, the
blocks and the blocks measured (not reused). CPU rows measure (10 repeats, the default);
analytical rows estimate on meta.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("tiny-llama", "cpu", 128), ("heavy-head-llama", "cpu", 128),
         ("llama-3.2-1b", "analytical:h100", 4096), ("llama-3-70b", "analytical:h100", 4096)]


def profile(model: str, backend: str, seq_len: int, extra: list[str]) -> tuple[float, dict]:
    """Wall seconds of ``autopart profile`` in a fresh process, and the profile it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.json"
        cmd = [sys.executable, "-m", "autopart", "profile", model, "--backend", backend,
               "--seq-len", str(seq_len), "--out", str(out), *extra]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        return time.perf_counter() - start, json.loads(out.read_text())


def main() -> None:
    print(f"{'model':<18} {'backend':<16} {'layer s':>8} {'default s':>10} {'ratio':>6} "
          f"{'blocks':>14} {'measured':>10}  default level")
    for model, backend, seq_len in CASES:
        layer_s, layer = profile(model, backend, seq_len, ["--granularity", "layer"])
        default_s, default = profile(model, backend, seq_len, [])

        def measured(p: dict) -> int:
            return sum(b.get("reused_from") is None for b in p["blocks"])

        blocks = f"{len(layer['blocks'])} -> {len(default['blocks'])}"
        print(f"{model:<18} {backend:<16} {layer_s:>8.1f} {default_s:>10.1f} "
              f"{default_s / layer_s:>6.2f} {blocks:>14} "
              f"{measured(layer):>4} -> {measured(default):<4} {default['setup']['granularity']}",
              flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
