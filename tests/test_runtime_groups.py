"""The runtime's gradient reduction on 2 gloo ranks: sums and divides, and what it keeps.

``all_reduce_grads`` keeps each bucket's work alive (``wait_and_keep``): released on gloo's
worker thread at interpreter exit, a work's tensors aborted one run in ten of a two-rank
test. The kept works must not keep the buckets' memory.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import run_ranks

from autopart.runtime import groups

pytestmark = [pytest.mark.multiprocess]


def _reduce_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((3, 4), (5,))]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(rank + 1 + 10 * i))
    kept_before = len(groups._KEPT)
    groups.all_reduce_grads(params, dist.group.WORLD, divide_by=world_size)
    kept = list(groups._KEPT)[kept_before:]
    return {"grads": [p.grad.unique().tolist() for p in params],
            "kept": len(kept), "completed": all(w.is_completed() for w in kept),
            "kept_bytes": sum(t.untyped_storage().nbytes() for w in kept for t in w.result())}


@pytest.mark.timeout(120)
def test_all_reduce_grads_averages_and_keeps_its_works_not_their_memory(tmp_path):
    results = run_ranks(_reduce_worker, 2, tmp_path)
    for r in results:
        assert r["grads"] == [[1.5], [11.5]]  # (1 + 2) / 2 and (11 + 12) / 2
        assert r["kept"] == 1 and r["completed"]
        assert r["kept_bytes"] == 0
