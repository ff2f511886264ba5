"""DCP checkpoints of a pipelined model: unpipelined <-> pipelined, and exact resume.

The unpipelined Llama's weights (saved with DCP) start a 2-rank pipeline; the
pipeline's checkpoint loads into the unpipelined model and gives the logits of the
per-rank state dicts merged, and the loss the pipeline saw; training resumed from
it reproduces the uninterrupted loss curve. The same holds with the head split
into two vocabulary shards on the two ranks (each holds the tied weight whole), and
with a cut inside layer 1's MLP (both ranks hold that half whole).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from families import init_real
from runtime_helpers import make_stage_plan, padded_batch, planned_blocks, run_ranks

from autopart.intake import discover_blocks, load_model
from autopart.runtime import auto_pipeline, load_checkpoint, save_checkpoint

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SOURCE = "tiny-llama-tied"
NUM_STEPS = 4


def _real_model(seed: int = 0) -> torch.nn.Module:
    model = load_model(SOURCE).model
    torch.manual_seed(seed)
    init_real(model)
    return model


def _batches() -> list[tuple[torch.Tensor, ...]]:
    return [padded_batch(512, batch=4, seq_len=10, seed=s) for s in range(NUM_STEPS)]


def _train(pipe, optimizer, batches, first_step: int, save_at: int | None = None,
           path: str = "") -> list[float | None]:
    losses = []
    for step, (input_ids, mask, labels) in enumerate(batches, start=first_step):
        optimizer.zero_grad()
        loss = pipe.step(input_ids, target=labels, attention_mask=mask)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        losses.append(None if loss is None else loss.item())
        if step == save_at:
            save_checkpoint(pipe, optimizer, path, step)
    return losses


def _worker(rank: int, world_size: int, init_dir: str, ckpt_dir: str, sd_dir: str,
            split: str) -> dict:
    chain = discover_blocks(load_model(SOURCE).model)
    if split == "head":  # rank 0: .. norm, lm_head.shard0of2; rank 1: lm_head.shard1of2
        plan = make_stage_plan(chain, [7, 1], schedule="1f1b", pp_size=2, num_microbatches=2,
                               blocks=planned_blocks(chain, vocab=2))
    elif split == "half":  # rank 0: .. model.layers.1.mlp.slice0of4; rank 1: slice1of4 ..
        chain = discover_blocks(load_model(SOURCE).model, granularity="half")
        plan = make_stage_plan(chain, [5, 9], schedule="1f1b", pp_size=2, num_microbatches=2,
                               blocks=planned_blocks(chain, units={"model.layers.1.mlp": 4}))
    else:
        plan = make_stage_plan(chain, [3, 4], schedule="1f1b", pp_size=2, num_microbatches=2)
    batches = _batches()
    pipe = auto_pipeline(SOURCE, plan=plan, device="cpu", init_seed=5)
    assert load_checkpoint(pipe, None, init_dir) is None  # weights of the unpipelined model
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    full = _train(pipe, optimizer, batches, 1, save_at=2, path=ckpt_dir)
    resumed_pipe = auto_pipeline(SOURCE, plan=plan, device="cpu", init_seed=9)
    resumed_opt = torch.optim.AdamW(resumed_pipe.parameters(), lr=1e-2)
    step = load_checkpoint(resumed_pipe, resumed_opt, ckpt_dir)
    torch.save(resumed_pipe.state_dict(), f"{sd_dir}/rank{rank}.pt")
    resumed = _train(resumed_pipe, resumed_opt, batches[step:], step + 1)
    return {"full": full, "resumed": resumed, "step": step}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("split", ["none", "head", "half"])
def test_checkpoint_round_trip_and_resume(tmp_path, split):
    init_dir, ckpt_dir, sd_dir = (tmp_path / d for d in ("init", "ckpt", "sd"))
    sd_dir.mkdir()
    reference = _real_model()
    dcp.save({"model": reference.state_dict()}, checkpoint_id=str(init_dir), no_dist=True)
    input_ids, mask, labels = _batches()[0]
    ref_loss = reference(input_ids=input_ids, attention_mask=mask, labels=labels).loss.item()

    results = run_ranks(_worker, 2, tmp_path, str(init_dir), str(ckpt_dir), str(sd_dir),
                        split)
    last = results[1]
    assert results[0]["full"][0] is None and last["step"] == 2
    assert abs(last["full"][0] - ref_loss) < 1e-5, "pipeline did not start from the HF weights"
    assert last["resumed"] == pytest.approx(last["full"][2:], abs=1e-6)
    assert last["full"][-1] < last["full"][0]

    loaded = _real_model(seed=3)
    assert load_checkpoint(loaded, None, ckpt_dir) == 2
    merged = _real_model(seed=4)
    parts = {}
    for rank in range(2):
        parts.update(torch.load(sd_dir / f"rank{rank}.pt"))
    assert set(parts) == set(merged.state_dict())
    merged.load_state_dict(parts)
    input_ids, mask, labels = _batches()[2]
    with torch.no_grad():
        out = loaded(input_ids=input_ids, attention_mask=mask, labels=labels)
        expected = merged(input_ids=input_ids, attention_mask=mask)
    assert torch.equal(out.logits, expected.logits)
    assert abs(out.loss.item() - last["full"][2]) < 1e-5
