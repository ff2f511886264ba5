"""The PyTorch pipelining tutorial's Transformer: profile, plan, and exact training.

The model (``examples/tutorial_model.py``) keeps its layers in a ``ModuleDict``
called as ``layer(h, h)``. Its ``nn.TransformerDecoderLayer`` is not batch-first, so
attention runs across dimension 0 and a microbatch's output depends on which rows
share it: the reference is therefore the unpipelined model run on the same
microbatches with the loss averaged over them (what any pipeline schedule computes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from runtime_helpers import make_stage_plan, max_grad_diffs, run_ranks
from torch import nn

from autopart.intake import discover_blocks
from autopart.profile import profile_model
from autopart.runtime import auto_pipeline
from autopart.solve import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tutorial_model import TINY, Transformer, tiny_transformer  # noqa: E402

TOL = 1e-5
NAMES = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]
# schedule -> stage sizes of the 7 blocks, pp = 2
PLANS = {"gpipe": [4, 3], "1f1b": [3, 4], "interleaved-1f1b": [2, 2, 1, 2],
         "zbv": [2, 2, 2, 1]}
MICROBATCHES = 4


def tokenwise_loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The tutorial's loss."""
    loss_fn = nn.CrossEntropyLoss()
    outputs = outputs.view(-1, TINY.vocab_size)
    targets = targets.view(-1)
    return loss_fn(outputs, targets)


def without_dropout(model: nn.Module) -> nn.Module:
    """Dropout off, so that two runs can be compared exactly."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, TINY.vocab_size, (8, 10), generator=gen)
    y = torch.randint(0, TINY.vocab_size, (8, 10), generator=gen)
    return x, y


def test_blocks_come_from_the_forward():
    with torch.device("meta"):
        chain = discover_blocks(tiny_transformer())
    assert chain.names == NAMES
    assert chain.family == "traced" and chain.blocks[0].kind == "embedding"
    assert chain.layer_class_names == ("TransformerDecoderLayer",)
    # layer(h, h): one stream tensor, passed twice
    assert chain.call(1).num_stream == 1 and chain.call(1).stream[:2] == (0, 0)


def test_profile_and_plan(steady_machine):
    profile = profile_model("examples.tutorial_model:tiny_transformer", seq_len=16,
                            num_warmup=1, num_repeats=2)
    assert [b.name for b in profile.blocks] == NAMES
    first = profile.blocks[0]
    assert first.bwd_input_ms == 0.0 and first.output_bytes == 16 * TINY.dim * 4
    assert profile.blocks[1].reused_from is None
    assert all(b.reused_from == "layers.0" for b in profile.blocks[2:5])
    plan = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b")
    assert len(plan.pipeline_cuts) == 1 and plan.pipeline_cuts[0] in NAMES[:-1]


def _worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = without_dropout(Transformer(TINY))
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    x, y = _batch()
    losses = [tokenwise_loss_fn(reference(xs), ys)
              for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]
    ref_loss = torch.stack(losses).mean()
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    with torch.device("meta"):
        chain = discover_blocks(Transformer(TINY))
    results = {}
    for schedule, counts in PLANS.items():
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=world_size,
                               num_microbatches=MICROBATCHES)
        with torch.device("meta"):
            model = without_dropout(Transformer(TINY))
        pipe = auto_pipeline(model, plan=plan, loss_fn=tokenwise_loss_fn, device="cpu")
        pipe.load_state_dict(state)
        loss = pipe.step(x, target=y)
        diffs = max_grad_diffs(pipe.named_parameters(), ref_grads)
        results[schedule] = {"loss": None if loss is None else loss.item(),
                             "ref_loss": ref_loss.item(), "max_grad_diff": max(diffs.values()),
                             "num_params": len(diffs)}
    results["num_ref_params"] = len(ref_grads)
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tutorial_transformer_trains_exactly(tmp_path):
    """Loss and every gradient equal the unpipelined model's, on 2 gloo ranks."""
    results = run_ranks(_worker, 2, tmp_path)
    for schedule in PLANS:
        losses = [r[schedule]["loss"] for r in results if r[schedule]["loss"] is not None]
        assert len(losses) == 1, (schedule, results)
        assert abs(losses[0] - results[0][schedule]["ref_loss"]) < TOL, (schedule, results)
        assert all(r[schedule]["max_grad_diff"] < TOL for r in results), (schedule, results)
        assert sum(r[schedule]["num_params"] for r in results) == results[0]["num_ref_params"]
