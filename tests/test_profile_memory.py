"""Memory accounting against byte counts worked out by hand."""

from __future__ import annotations

import torch
from torch import nn

from autopart.profile import profile_model
from autopart.profile.measure import coinciding_workspace, memory_pass, without_last
from autopart.profile.memory import LiveTensors, SavedTensors, storage_key, tensor_bytes
from autopart.profile.tasks import BlockTask

FAST = {"num_warmup": 1, "num_repeats": 2, "seq_len": 16}


def _task(module: nn.Module, x: torch.Tensor, input_grad: bool = True) -> BlockTask:
    x = x.detach().requires_grad_(input_grad)
    return BlockTask(run=module, inputs=x, input_grad=input_grad, loss_output=False,
                     module=module)


def test_linear_saves_exactly_its_input():
    """Linear saves its input (for dW) and its weight (excluded): activation = input bytes."""
    x = torch.randn(2, 16, 32)
    mem = memory_pass(_task(nn.Linear(32, 8), x))
    assert mem.activation_bytes == x.numel() * 4 == 4096
    assert mem.output_bytes == 2 * 16 * 8 * 4


def test_linear_without_input_grad_still_saves_input_only():
    x = torch.randn(4, 32)
    assert memory_pass(_task(nn.Linear(32, 8), x, input_grad=False)).activation_bytes == 512


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x  # mul saves x twice: one storage


class TempThenSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x + 1.0) * self.w).sum(dim=-1)


def test_shared_storage_is_counted_once():
    x = torch.randn(64)
    assert memory_pass(_task(Square(), x)).activation_bytes == 256


def test_views_of_one_storage_count_the_storage_once():
    saved = SavedTensors()
    x = torch.randn(8, 8, requires_grad=True)
    with saved:
        y = x.view(64) * x.view(4, 16).reshape(64)
    y.sum().backward()
    assert saved.total_bytes == 256 and len(saved.storages) == 1


def test_transient_temporary_is_seen_and_not_saved():
    """(x + 1) * w saves x + 1 (for dw): activation; the output and grads are not transient."""
    x = torch.randn(32, 64)
    mem = memory_pass(_task(TempThenSum(), x))
    assert mem.activation_bytes == x.numel() * 4  # the x + 1 temporary is saved for dw
    assert mem.output_bytes == 32 * 4
    assert mem.transient_bytes >= x.numel() * 4  # the product before the sum, and backward temps


def test_live_tensors_log_alloc_and_free():
    live = LiveTensors()
    with live:
        a = torch.ones(256)  # 1 KiB
        b = a * 2  # 1 KiB
        view = b[:10]
        del b
        c = a + 1
        del a, c
    assert [d for _, d in live.events][:3] == [1024, 1024, 1024]
    assert live.peak_bytes() == 3072
    assert live.events[-1][1] == -1024
    del view


def test_peak_excludes_named_storages():
    live = LiveTensors()
    with live:
        keep = torch.zeros(100)
        tmp = torch.zeros(50)
        del tmp
    assert live.peak_bytes() == 600
    assert live.peak_bytes({storage_key(keep)}) == 200


def test_tensor_bytes_of_nested_structures():
    assert tensor_bytes((torch.zeros(3), [torch.zeros(2, dtype=torch.float16)], "x")) == 16


def test_profile_of_two_linears_by_hand():
    model = nn.Sequential(nn.Linear(12, 20), nn.Linear(20, 3))
    profile = profile_model(model, micro_batch_size=2, **FAST)
    first, last = profile.blocks
    assert first.activation_bytes == 2 * 16 * 12 * 4  # its input
    assert first.output_bytes == 2 * 16 * 20 * 4
    assert first.param_bytes == (12 * 20 + 20) * 4 and first.num_params == 260
    # last block: input saved by Linear, its output saved by pow for the documented loss
    assert last.activation_bytes == 2 * 16 * 20 * 4 + 2 * 16 * 3 * 4
    assert last.output_bytes == 4


def test_held_for_weight_is_each_linear_output_gradient():
    """torch's split B keeps the gradient into every weight op until W: for a Linear, the
    gradient of its output (2 x 16 x 5 floats for the middle one). The first block has
    no input gradient (the pipeline input), so its B keeps nothing."""
    model = nn.Sequential(nn.Linear(12, 20), nn.Linear(20, 5), nn.Linear(5, 3))
    profile = profile_model(model, micro_batch_size=2, **FAST)
    assert [b.held_for_weight_bytes for b in profile.blocks] == [0, 2 * 16 * 5 * 4,
                                                                 2 * 16 * 3 * 4]


def test_adopted_gradients_are_the_weight_gradients_in_the_workspace():
    """Linear(200, 300) + the documented loss: its backward's peak holds the weight and
    bias gradients (``.grad``) and a 4-byte scalar. Without them the peak is made of
    the loss backward's output-sized gradients (2 x 16 x 300 floats each), so the
    gradients' part is positive and at most their size."""
    model = nn.Sequential(nn.Linear(12, 200), nn.Linear(200, 300))
    profile = profile_model(model, micro_batch_size=2, **FAST)
    last = profile.blocks[-1]
    grads = (200 * 300 + 300) * 4
    assert last.transient_bytes == grads + 4
    assert 0 < last.adopted_grad_bytes <= grads
    assert last.transient_bytes - last.adopted_grad_bytes >= 2 * 16 * 300 * 4


def test_a_reused_address_leaves_out_only_the_latest_tensor():
    """A 1000-byte temporary freed at address 5, whose address the 10-byte input gradient
    took later: only the gradient leaves the log, so the temporary still peaks."""
    live = LiveTensors()
    live.events = [(5, 1000), (5, -1000), (6, 30), (5, 10)]
    assert coinciding_workspace(without_last(live, {5}), {}, None, set()) == 1000
    assert coinciding_workspace(live, {}, None, {5}) == 30  # the old exclusion by key


def test_measured_activations_match_the_shape_computation():
    """CPU measurement (real SDPA kernel) and analytical count on meta (flash stand-in) agree."""
    cpu = profile_model("tiny-llama", **FAST)
    meta = profile_model("tiny-llama", backend="analytical:h100", seq_len=16)
    assert [b.activation_bytes for b in cpu.blocks] == [b.activation_bytes for b in meta.blocks]
    assert [b.output_bytes for b in cpu.blocks] == [b.output_bytes for b in meta.blocks]
    assert [b.held_for_weight_bytes for b in cpu.blocks] == \
        [b.held_for_weight_bytes for b in meta.blocks]
    layer = cpu.blocks[1]
    assert layer.activation_bytes > 5 * 16 * 64 * 4 and layer.transient_bytes > 0


def test_workspace_counts_only_what_exceeds_the_freed_saved_activations():
    """Hand-worked log: saved s1 (100) and s2 (50) alive, then s1 freed before a
    workspace of 120 peaks: the peak is 50 + 120 = 170, so the block needs 170 - 150
    = 20 on top of holding its 150 saved bytes (the old rule said 120)."""
    live = LiveTensors()
    live.events = [(1, 100), (2, 50), (3, 10), (3, -10), (1, -100), (4, 120), (4, -120),
                   (9, 500), (2, -50)]
    assert coinciding_workspace(live, {1: 100, 2: 50, 7: 64}, in_key=7, exclude={9}) == 20
    # A workspace while everything is still saved counts whole.
    live.events = [(1, 100), (2, 50), (4, 120), (4, -120)]
    assert coinciding_workspace(live, {1: 100, 2: 50}, in_key=None, exclude=set()) == 120


class _CountingAllocator:
    """A stand-in for the CUDA backend on CPU: ``allocator_peak`` is the peak of the bytes
    allocated above the start while ``fn`` runs, from the live-tensor log, as
    ``max_memory_allocated - memory_allocated`` reports it on a GPU."""

    name = "cuda"

    def allocator_peak(self, fn) -> int:
        live = LiveTensors()
        with live:
            fn()
        current = peak = 0
        for _, delta in live.events:
            current += delta
            peak = max(peak, current)
        return peak


def test_adopted_gradients_are_measured_beside_an_allocator_peak():
    """On CUDA the workspace is the allocator's peak, and the weights' gradients in it come
    from a second forward + backward under the live-tensor log, as on CPU (they were 0 on
    CUDA before). Linear(200, 300) with a fixed output gradient: the workspace is its
    weight and bias gradients, all of it adopted by ``.grad``."""
    lin = nn.Linear(200, 300)
    x = torch.randn(2, 16, 200)
    allocator = memory_pass(_task(lin, x), _CountingAllocator())
    lin.zero_grad(set_to_none=True)
    log = memory_pass(_task(lin, x))
    grads = (200 * 300 + 300) * 4
    assert allocator.transient_bytes == log.transient_bytes
    assert allocator.adopted_grad_bytes == log.adopted_grad_bytes == grads
    assert allocator.activation_bytes == log.activation_bytes == x.numel() * 4
