"""Measure one block on a real backend: F, B, W times and memory.

Times (median of ``num_repeats`` after ``num_warmup`` warm-up iterations):

* ``fwd_ms``: the training forward (autograd records the graph).
* ``bwd_ms``: the full backward from the block output (with a fixed random
  incoming gradient) or from the loss for the last block: input and weight grads.
* ``bwd_input_ms`` (B): ``torch.autograd.grad`` with respect to the block input
  only; autograd then skips every weight-gradient kernel.
* ``bwd_weight_ms`` (W): ``bwd_ms - bwd_input_ms`` (clamped at 0): what a
  zero-bubble schedule still has to run after B. Measuring W as the gradient with
  respect to the parameters alone would recompute the input-gradient chain inside
  the block and overstate it. Blocks without an input gradient (the embedding) have
  B = 0 and W = full backward; blocks without trainable weights have W = 0.
* ``split_extra_ms``: B and W the way torch's zero-bubble schedules run them
  (``stage_backward_input``, then ``stage_backward_weight`` adding into gradients that
  exist, as from a step's second microbatch on) less the full backward, clamped at 0:
  their graph walk per parameter group, and every weight's gradient made apart and then
  added. B is that ``stage_backward_input``.

Spreads are ``(p75 - p25) / median`` of the repeats. Memory comes from one extra
forward + backward (see ``memory_pass``), and one forward + B the way torch's
split-backward schedules run it (``held_for_weight_bytes``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from autopart.profile.backends import Backend
from autopart.profile.memory import LiveTensors, SavedTensors, storage_key, tensor_bytes
from autopart.profile.split_backward import held_for_weight_bytes, timed_split
from autopart.profile.tasks import BlockTask
from autopart.profile.warm import hot_inputs, warm_on_a_copy

__all__ = []

NOISE_SPREAD = 0.2
"""A measurement whose F or full-backward repeats spread more than this ((p75 - p25) /
median) was disturbed; two measurements of one call whose F + B differ by more than
this disagree."""
_MAX_MEASUREMENTS = 3


@dataclass(frozen=True, slots=True)
class TimeFigures:
    """Median times of one block (ms) and their relative spreads."""

    fwd_ms: float
    bwd_ms: float
    bwd_input_ms: float
    bwd_weight_ms: float
    fwd_ms_spread: float = 0.0
    bwd_ms_spread: float = 0.0
    compile_ms: float = 0.0
    split_extra_ms: float = 0.0
    """torch's split backward (B + W as zero-bubble schedules run it) - ``bwd_ms``."""
    num_measurements: int = 1
    """How many times the block was measured (re-measured while disturbed)."""
    noisy: bool = False
    """The kept measurement still spreads more than ``NOISE_SPREAD``."""

    @property
    def worst_spread(self) -> float:
        """The larger of the F and full-backward spreads."""
        return max(self.fwd_ms_spread, self.bwd_ms_spread)


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """Memory of one block for one microbatch (bytes)."""

    activation_bytes: int
    output_bytes: int
    transient_bytes: int
    held_for_weight_bytes: int = 0
    """Gradients the block's B keeps for its W (``held_for_weight_bytes``)."""
    adopted_grad_bytes: int = 0
    """The part of ``transient_bytes`` that is the weights' gradients (``BlockProfile``)."""


def measure_times(task: BlockTask, backend: Backend, num_warmup: int,
                  num_repeats: int) -> TimeFigures:
    """Time forward, full backward and input-only backward of ``task`` (module docstring)."""
    if not (task.input_grad or task.trainable()):
        return _forward_only_times(task, backend, num_warmup, num_repeats)
    grad_out = incoming_grad(task)
    _same_graph_every_round(task, backend)
    warm = warm_on_a_copy(task, grad_out) if backend.warms_a_copy else (None, None)
    with _compile_clock(backend) as compile_ms:
        for _ in range(num_warmup):
            _timed_round(task, backend, grad_out, warm)
    fwd, full, inp, split = [], [], [], []
    for _ in range(num_repeats):
        round_fwd, round_full, round_inp, round_split = _timed_round(task, backend, grad_out,
                                                                     warm)
        fwd += round_fwd
        full.append(round_full)
        inp += round_inp
        split += round_split
    task.inputs.grad = None
    for p in task.trainable():
        p.grad = None
    bwd = statistics.median(full)
    b_ms = min(statistics.median(inp), bwd) if inp else 0.0
    if not task.trainable():
        b_ms = bwd if task.input_grad else 0.0
    extra = max(statistics.median(split) - bwd, 0.0) if split else 0.0
    return TimeFigures(fwd_ms=statistics.median(fwd), bwd_ms=bwd, bwd_input_ms=b_ms,
                       bwd_weight_ms=max(bwd - b_ms, 0.0), fwd_ms_spread=_spread(fwd),
                       bwd_ms_spread=_spread(full), compile_ms=compile_ms[0],
                       split_extra_ms=extra)


def measure_times_clean(task: BlockTask, backend: Backend, num_warmup: int,
                        num_repeats: int) -> TimeFigures:
    """``measure_times``, measured again (up to three times in all) while disturbed.

    The least spread measurement is kept; it is flagged ``noisy`` when even that one
    spreads more than ``NOISE_SPREAD``.

    Args:
        task: The block call to time.
        backend: Where to time it.
        num_warmup: Untimed runs before the first measurement.
        num_repeats: Timed runs per measurement.

    Returns:
        The kept figures, with ``num_measurements`` and ``noisy`` set.
    """
    best = measure_times(task, backend, num_warmup, num_repeats)
    count = 1
    while best.worst_spread > NOISE_SPREAD and count < _MAX_MEASUREMENTS:
        again = measure_times(task, backend, 1, num_repeats)
        count += 1
        if again.worst_spread < best.worst_spread:
            best = again
    return dataclasses.replace(best, num_measurements=count,
                               noisy=best.worst_spread > NOISE_SPREAD)


def memory_pass(task: BlockTask, backend: Backend | None = None) -> MemoryFigures:
    """Saved activations, output and transient workspace of one forward + backward.

    The transient figure is the workspace on top of the block's saved activations
    at the block's own peak (``coinciding_workspace``): with ``backend`` = CUDA the
    allocator's peak above the start, less the new saved activations, the output and
    the input gradient (``allocator_workspace``); else (CPU, meta) the same from the
    live-tensor log (``logged_workspace``).

    The weights' gradients are ``None`` before, as after ``zero_grad()``: autograd
    allocates them in the backward, and the workspace holds them. The part of the
    workspace they make up is ``adopted_grad_bytes``, found from the live-tensor log
    without their allocations, on every backend: on CUDA the block runs once more under
    the log (which counts tensors' storages, not the allocator's blocks), and the figure
    is capped at the allocator's workspace.
    """
    grad_out = incoming_grad(task)
    exclude = [*task.module.parameters(), *task.module.buffers(), *task.exclude]
    if backend is not None and backend.name == "cuda":
        transient, saved, out = allocator_workspace(task, backend, grad_out, exclude)
        for p in task.trainable():
            p.grad = None  # as before the first pass: the log sees them allocated
        _, adopted, _, _ = logged_workspace(task, grad_out, exclude)
        adopted = min(adopted, transient)
    else:
        transient, adopted, saved, out = logged_workspace(task, grad_out, exclude)
    task.inputs.grad = None
    return MemoryFigures(activation_bytes=saved.total_bytes, output_bytes=tensor_bytes(out),
                         transient_bytes=transient, adopted_grad_bytes=adopted,
                         held_for_weight_bytes=held_for_weight_bytes(task, grad_out))


def logged_workspace(task: BlockTask, grad_out: torch.Tensor | None,
                     exclude: list[torch.Tensor]
                     ) -> tuple[int, int, SavedTensors, torch.Tensor]:
    """One forward + backward under the live-tensor log (``LiveTensors``).

    Args:
        task: The block call; its weights' ``.grad`` ``None`` (the backward allocates
            them, as after ``zero_grad()``).
        grad_out: The incoming gradient (``None`` for a loss output).
        exclude: Tensors the saved-tensor hooks leave out (parameters, buffers).

    Returns:
        The workspace (``coinciding_workspace``, the output and the input gradient left
        out), the part of it that is the weights' gradients, the saved tensors and the
        output.
    """
    task.inputs.grad = None
    saved = SavedTensors(exclude)
    live = LiveTensors()
    with live:
        with saved:
            out = task.forward()
        if task.input_grad or task.trainable():
            torch.autograd.backward(out, grad_out)
    in_key, out_key = storage_key(task.inputs), storage_key(out)
    grad_key = storage_key(task.inputs.grad) if task.inputs.grad is not None else None
    # The output and the input gradient are counted elsewhere: leave out their own
    # allocations only, as a freed temporary may have had the same address.
    log = without_last(live, {out_key, grad_key})
    transient = coinciding_workspace(log, saved.storages, in_key, set())
    weight_grads = {storage_key(p.grad) for p in task.trainable() if p.grad is not None}
    adopted = transient - coinciding_workspace(without_last(log, weight_grads),
                                               saved.storages, in_key, set())
    return transient, adopted, saved, out


def allocator_workspace(task: BlockTask, backend: Backend, grad_out: torch.Tensor | None,
                        exclude: list[torch.Tensor]) -> tuple[int, SavedTensors, torch.Tensor]:
    """One forward + backward under the backend's allocator peak (CUDA).

    Args:
        task: The block call; its weights' ``.grad`` as the caller left them (``None``:
            the backward allocates them inside the peak).
        backend: A backend whose ``allocator_peak`` reports bytes.
        grad_out: The incoming gradient (``None`` for a loss output).
        exclude: Tensors the saved-tensor hooks leave out (parameters, buffers).

    Returns:
        The workspace (the peak above the start less the new saved activations, the
        output and the input gradient), the saved tensors, and the output.
    """
    saved = SavedTensors(exclude)
    result: dict[str, torch.Tensor] = {}
    task.inputs.grad = None

    def step() -> None:
        with saved:
            result["out"] = task.forward()
        if task.input_grad or task.trainable():
            torch.autograd.backward(result["out"], grad_out)

    peak = backend.allocator_peak(step) or 0
    out = result.pop("out")
    in_key, out_key = storage_key(task.inputs), storage_key(out)
    new_saved = sum(b for k, b in saved.storages.items() if k not in (in_key, out_key))
    grad_bytes = tensor_bytes(task.inputs.grad) if task.inputs.grad is not None else 0
    return max(peak - new_saved - tensor_bytes(out) - grad_bytes, 0), saved, out


def without_last(live: LiveTensors, keys: set[int | None]) -> LiveTensors:
    """A copy of ``live``'s log without the latest allocation (and its free) of each key.

    Args:
        live: The log of one forward + backward.
        keys: Storage keys of tensors alive at the end that are counted elsewhere.

    Returns:
        A log for ``coinciding_workspace``. Keys are addresses: an earlier storage freed
        at an address such a tensor took later is another tensor and stays in the log.
    """
    last = {key: i for i, (key, delta) in enumerate(live.events) if key in keys and delta > 0}
    copy = LiveTensors()
    copy.events = [(key, delta) for i, (key, delta) in enumerate(live.events)
                   if not (key in last and i >= last[key])]
    return copy


def coinciding_workspace(live: LiveTensors, saved: dict[int, int], in_key: int | None,
                         exclude: set[int | None]) -> int:
    """Live bytes at the block's peak above all of its new saved activations.

    The log counts a saved storage only while it is alive, so a workspace that peaks
    in the backward, after autograd freed part of the saved activations, adds only
    what exceeds them: ``transient_bytes`` is what a stage needs on top of holding
    the block's ``activation_bytes`` (the cost model adds it to them). ``exclude``:
    the output and the input gradient, counted elsewhere.
    """
    new_saved = sum(b for k, b in saved.items() if k != in_key)
    current = peak = 0
    for key, delta in live.events:
        if key not in exclude:
            current += delta
            peak = max(peak, current)
    return max(peak - new_saved, 0)


def _forward_only_times(task: BlockTask, backend: Backend, num_warmup: int,
                        num_repeats: int) -> TimeFigures:
    """A block with nothing to differentiate (frozen weights, integer input): F only."""
    warm = warm_on_a_copy(task, None)[0] if backend.warms_a_copy else None
    with _compile_clock(backend) as compile_ms:
        for _ in range(num_warmup):
            backend.time(task.forward, hot_inputs(task), warm)
    fwd = [backend.time(task.forward, hot_inputs(task), warm)[0] for _ in range(num_repeats)]
    return TimeFigures(fwd_ms=statistics.median(fwd), bwd_ms=0.0, bwd_input_ms=0.0,
                       bwd_weight_ms=0.0, fwd_ms_spread=_spread(fwd), compile_ms=compile_ms[0])


def _same_graph_every_round(task: BlockTask, backend: Backend) -> None:
    """Give every parameter a gradient to accumulate into, and materialize it.

    Otherwise the first backward assigns the weight gradients and later ones add to
    them: two different graphs, so on XLA the second would compile inside the timed
    region. Accumulating is what a pipeline does for every microbatch but the first.
    The incoming gradient (random, lazy on XLA) is materialized by the same sync.
    """
    for p in task.trainable():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    backend.sync()


@contextmanager
def _compile_clock(backend: Backend) -> Iterator[list[float]]:
    """Yield ``[ms]``, set on exit to the compile time the body took (0 off XLA).

    The backend's own compile counter where it has one (torch_xla's ``CompileTime``),
    else the body's wall time on XLA (tracing + compiling + one run each).
    """
    result = [0.0]
    before, start = backend.compile_clock_ms(), time.perf_counter()
    yield result
    after = backend.compile_clock_ms()
    if before is not None and after is not None:
        result[0] = after - before
    elif backend.name == "xla":
        result[0] = (time.perf_counter() - start) * 1e3


def incoming_grad(task: BlockTask) -> torch.Tensor | None:
    """A fixed random gradient for the output (``None`` when the output is the loss)."""
    if task.loss_output:
        return None
    with torch.no_grad():
        out = task.forward()
    return torch.randn_like(out) if out.is_floating_point() else None


def _timed_round(task: BlockTask, backend: Backend, grad_out: torch.Tensor | None,
                 warm: tuple[Callable[[], None] | None, Callable[[], None] | None] = (None, None)
                 ) -> tuple[list[float], float, list[float], list[float]]:
    """One round: F + full backward, then (with an input grad) F + B, and with weights W
    as torch's split backward runs them; returns the ms (F, full, B, B + W).

    ``warm``: what a flushing backend runs untimed before a forward and before a backward
    (``autopart.profile.warm``)."""
    task.inputs.grad = None
    hot, warm_fwd, warm_bwd = hot_inputs(task), warm[0], warm[1]
    fwd_ms, out = backend.time(task.forward, hot, warm_fwd)
    full_ms, _ = backend.time(lambda: torch.autograd.backward(out, grad_out), (grad_out,),
                              warm_bwd)
    del out
    task.inputs.grad = None
    if not task.input_grad:
        return [fwd_ms], full_ms, [], []
    fwd2_ms, out = backend.time(task.forward, hot, warm_fwd)
    params = task.trainable()
    if not params:
        b_ms, _ = backend.time(lambda: torch.autograd.grad(out, task.inputs, grad_out),
                               (grad_out,), warm_bwd)
        return [fwd_ms, fwd2_ms], full_ms, [b_ms], []
    b_ms, w_ms = timed_split(task, backend, out, grad_out, warm_bwd)
    return [fwd_ms, fwd2_ms], full_ms, [b_ms], [b_ms + w_ms]


def _spread(samples: list[float]) -> float:
    if len(samples) < 2:
        return 0.0
    q = statistics.quantiles(samples, n=4, method="inclusive")
    median = statistics.median(samples)
    return (q[2] - q[0]) / median if median > 0 else 0.0
