"""Pipelined custom models (nn.Sequential, ModuleList models) vs the unpipelined model.

Loss and every gradient must equal those of the same model run whole on the same
batch with the same (microbatch-mean) loss_fn, for every schedule.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import make_stage_plan, max_grad_diffs, run_ranks
from torch import nn

from autopart.intake import discover_blocks
from autopart.runtime import auto_pipeline

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOL = 1e-5
WIDTH = 16

# schedule -> (block counts for 8 blocks, microbatches), pp = 2
SCHEDULES_PP2 = {
    "gpipe": ([4, 4], 4),
    "1f1b": ([3, 5], 4),
    "interleaved-1f1b": ([2, 2, 2, 2], 4),
    "looped-bfs": ([1, 3, 2, 2], 4),
    "interleaved-zb": ([2, 2, 3, 1], 4),
    "zbv": ([2, 2, 2, 2], 4),
    "dualpipev": ([1, 2, 3, 2], 4),
}


def make_sequential() -> nn.Sequential:
    """Eight blocks, each Linear + Tanh (the last a plain Linear)."""
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(7)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 4))


class Stack(nn.Module):
    """An input projection, a ModuleList of six blocks and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU())
            for _ in range(6))
        self.proj_out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for layer in self.layers:
            x = layer(x)
        return self.proj_out(x)


class _Mix(nn.Module):
    """A layer that also reads a ``memory`` tensor (the first projection's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + 0.1 * memory


class ResidualStack(nn.Module):
    """Residual adds between the layers and a memory passed to every layer.

    Both values cross every cut and are used again after the next layer starts,
    so the stages must use the received tensors for those later uses too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(_Mix() for _ in range(6))
        self.proj_out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.proj_in(x)
        h = memory
        for layer in self.layers:
            h = h + layer(h, memory)
        return self.proj_out(h)


def _loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _reference(factory, x: torch.Tensor, y: torch.Tensor):
    torch.manual_seed(0)
    model = factory()
    loss = _loss_fn(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return model.state_dict(), loss.item(), grads


def _worker(rank: int, world_size: int, factory_name: str, in_dim: int) -> dict:
    factory = {"sequential": make_sequential, "stack": Stack,
               "residual": ResidualStack}[factory_name]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, in_dim, generator=gen), torch.randn(8, 4, generator=gen)
    state, ref_loss, ref_grads = _reference(factory, x, y)
    with torch.device("meta"):
        chain = discover_blocks(factory())
    results = {}
    for name, (counts, num_mb) in SCHEDULES_PP2.items():
        plan = make_stage_plan(chain, counts, schedule=name, pp_size=world_size,
                         num_microbatches=num_mb)
        with torch.device("meta"):
            model = factory()
        pipe = auto_pipeline(model, plan=plan, loss_fn=_loss_fn, device="cpu")
        pipe.load_state_dict(state)
        loss = pipe.step(x, target=y)
        diffs = max_grad_diffs(pipe.named_parameters(), ref_grads)
        results[name] = {"loss": None if loss is None else loss.item(), "ref_loss": ref_loss,
                         "max_grad_diff": max(diffs.values()), "params": sorted(diffs)}
    results["num_ref_params"] = len(ref_grads)
    return results


def _check(results: list[dict]) -> None:
    for name in SCHEDULES_PP2:
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert len(losses) == 1, (name, losses)
        assert abs(losses[0] - results[0][name]["ref_loss"]) < TOL, (name, losses)
        assert all(r[name]["max_grad_diff"] < TOL for r in results), (name, results)
        covered = {p for r in results for p in r[name]["params"]}
        assert len(covered) == results[0]["num_ref_params"], name


@pytest.mark.timeout(240)
def test_sequential_every_schedule(tmp_path):
    """nn.Sequential of 8 blocks on 2 ranks, each schedule, MSE loss: equal to unpipelined."""
    _check(run_ranks(_worker, 2, tmp_path, "sequential", WIDTH))


@pytest.mark.timeout(240)
def test_modulelist_chain_every_schedule(tmp_path):
    """proj_in, ModuleList of 6 blocks, proj_out, found through the forward, on 2 ranks."""
    _check(run_ranks(_worker, 2, tmp_path, "stack", 8))


@pytest.mark.timeout(240)
def test_residual_and_memory_across_cuts_every_schedule(tmp_path):
    """Residual adds outside the layers and a memory read by every layer, on 2 ranks."""
    with torch.device("meta"):
        chain = discover_blocks(ResidualStack())
    assert chain.names == ["proj_in", *[f"layers.{i}" for i in range(6)], "proj_out"]
    assert chain.trace.stream_reused
    _check(run_ranks(_worker, 2, tmp_path, "residual", 8))
