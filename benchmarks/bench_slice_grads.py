"""A half's slice's backward against its share of the whole half, on plain views and on
the runtime's views (``autopart.runtime.held_grads``).

A rank holding slices of an MLP (``model.layers.3.mlp.slice1of4``) computes them from
views of the whole MLP's weights. Plain views (``weight[lo:hi]``, ``weight[:, lo:hi]``)
hand autograd a full-size gradient every backward; the runtime's add only the slice's
rows (sparse) and columns (in place). The planner prices a slice as its share of the
MLP's measured backward (by unit fraction). This times, in one process and one thread,
alternately, the backward of the whole MLP and of a quarter and three quarters of it on
both kinds of view, the ``.grad`` buffers kept between calls as over a step's
microbatches, and prints each against its share and the two views' ratio.

    python benchmarks/bench_slice_grads.py [--hidden 1024] [--tokens 32] [--repeats 21]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from autopart.intake.slice_rules import partial_forward, slice_rule
from autopart.runtime.held_grads import cols_of, rows_of


class _MLP(nn.Module):
    """A gated MLP as Llama's: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def backward_ms(mlp: _MLP, x: torch.Tensor, units: tuple[int, int] | None, held: bool,
                repeats: int) -> float:
    """Median ms of the backward of ``mlp`` (``units`` None) or of its units' slice."""
    rule, why = slice_rule(mlp)
    assert rule is not None, why
    views = {"rows": rows_of, "cols": cols_of} if held else {}
    mlp.zero_grad(set_to_none=True)
    times = []
    for _ in range(repeats):
        inp = x.clone().requires_grad_()
        out = mlp(inp) if units is None else partial_forward(mlp, rule, *units, (inp,), {},
                                                             **views)
        grad = torch.randn_like(out)
        start = time.perf_counter()
        out.backward(grad)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    """Parse the flags, time, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    inter = (args.hidden * 8 // 3 + 7) // 8 * 8
    mlp = _MLP(args.hidden, inter)
    x = torch.randn(1, args.tokens, args.hidden)
    print(f"MLP {args.hidden} x {inter}, {args.tokens} tokens, 1 thread, load average "
          f"{os.getloadavg()[0]:.2f}; backward ms, median of {args.repeats - 3}")
    print("| round | whole | slice | its share | plain views | runtime views | plain / share "
          "| runtime / share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        whole = backward_ms(mlp, x, None, False, args.repeats)
        for name, (lo, hi) in (("1/4", (0, inter // 4)), ("3/4", (inter // 4, inter))):
            share = whole * (hi - lo) / inter
            plain = backward_ms(mlp, x, (lo, hi), False, args.repeats)
            held = backward_ms(mlp, x, (lo, hi), True, args.repeats)
            print(f"| {r} | {whole:.2f} | {name} | {share:.2f} | {plain:.2f} | {held:.2f} | "
                  f"{plain / share:.2f}x | {held / share:.2f}x |")


if __name__ == "__main__":
    main()
