"""Timers on a running torch pipeline: per-action compute spans and p2p waits of one rank.

``StepRecorder.attach(pipe)`` wraps, on this rank's ``PipelineStage`` instances,
``forward_one_chunk`` (``F``), ``backward_one_chunk`` (``B`` when
``full_backward=False``, else ``BW``: the full backward) and
``backward_weight_one_chunk`` (``W``); on the schedule instance
``_maybe_compute_loss`` (``LOSS``, counted as part of the last stage's ``F``); and
the module-level ``torch.distributed.pipelining.schedules._wait_batch_p2p``
(``WAIT``: time blocked on sends/receives). The router loss's counting pass
(``PipelinedModel._counting_pass``, a forward-only pass of the schedule before the
step) is one ``COUNT`` span with nothing inside it recorded: its forwards are not the
step's, and a stage's F summed over both read twice the stage's forward. Spans are kept
in milliseconds from the start of the current step (``begin_step``). ``detach``
restores everything.

On CUDA each span synchronizes the device before it reads the clock, so a span is
the kernels' time, not the launch time.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import schedules as torch_schedules

__all__ = []

@dataclass(frozen=True, slots=True)
class Span:
    """One timed call on one rank, in ms from the start of its step."""

    kind: str
    """``F``, ``LOSS``, ``B``, ``BW`` (full backward), ``W``, ``WAIT`` or ``COUNT``."""
    stage_idx: int
    """The stage that ran it (-1 for ``WAIT`` and ``COUNT``)."""
    microbatch_idx: int
    """-1 for ``WAIT`` and ``COUNT``."""
    start_ms: float
    end_ms: float
    cpu_ms: float = 0.0
    """CPU time of the calling thread during the call (``time.thread_time``): below the
    span's length when the rank was descheduled by other work on its cores."""


class StepRecorder:
    """Records the spans of this rank's pipeline actions, step by step."""

    def __init__(self, device: torch.device) -> None:
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" \
            else (lambda: None)
        self._t0 = time.perf_counter()
        self.steps: list[list[Span]] = []
        """Spans of every step since ``attach``, one list per ``begin_step``."""
        self._restore: list[tuple[Any, str, Any]] = []
        self.enabled = True

    def begin_step(self) -> None:
        """Start a new step: later spans are timed from now."""
        self._sync()
        self._t0 = time.perf_counter()
        self.steps.append([])

    def attach(self, pipe: Any) -> StepRecorder:
        """Wrap the stages, the schedule and the p2p wait of ``pipe`` (a ``PipelinedModel``)."""
        if not pipe.pipe_stages:
            raise RuntimeError("the PipelinedModel exposes no pipe_stages to time")
        for stage in pipe.pipe_stages:
            idx = stage.stage_index
            self._wrap(stage, "forward_one_chunk", lambda a, kw, i=idx: ("F", i, a[0]))
            self._wrap(stage, "backward_one_chunk", lambda a, kw, i=idx: (
                "BW" if kw.get("full_backward", a[2] if len(a) > 2 else True) else "B", i,
                a[0]))
            self._wrap(stage, "backward_weight_one_chunk", lambda a, kw, i=idx: ("W", i, a[0]))
        self._wrap(pipe.schedule, "_maybe_compute_loss", _loss_label)
        self._wrap(torch_schedules, "_wait_batch_p2p",
                   lambda a, kw: ("WAIT", -1, -1) if a and a[0] else None)
        if hasattr(pipe, "_counting_pass"):
            self._wrap(pipe, "_counting_pass", lambda a, kw: ("COUNT", -1, -1), apart=True)
        return self

    def detach(self) -> None:
        """Undo every wrapper ``attach`` installed."""
        for owner, name, original in reversed(self._restore):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore.clear()

    def _wrap(self, owner: Any, name: str, label: Callable[[tuple, dict], Any],
              apart: bool = False) -> None:
        """Time every call of ``owner.name`` that ``label`` tags; ``apart``: record
        nothing inside the call (it is one span of its own)."""
        original = getattr(owner, name)
        own = owner.__dict__.get(name) if hasattr(owner, "__dict__") else None
        self._restore.append((owner, name, own))

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            tag = label(args, kwargs) if self.enabled and self.steps else None
            if tag is None:
                return original(*args, **kwargs)
            self._sync()
            start, cpu = time.perf_counter(), time.thread_time()
            if apart:
                self.enabled = False
                try:
                    out = original(*args, **kwargs)
                finally:
                    self.enabled = True  # it was: a call is timed only when recording
            else:
                out = original(*args, **kwargs)
            self._sync()
            end, cpu = time.perf_counter(), time.thread_time() - cpu
            self.steps[-1].append(Span(tag[0], tag[1], int(tag[2]), 1e3 * (start - self._t0),
                                       1e3 * (end - self._t0), 1e3 * cpu))
            return out

        setattr(owner, name, timed)


def _loss_label(args: tuple, kwargs: dict) -> tuple[str, int, int] | None:
    """``_maybe_compute_loss(stage, output, target_mbs, mb_index, ...)``: only last stages."""
    stage = args[0]
    if not stage.is_last:
        return None
    return "LOSS", stage.stage_index, args[3]


_PART_SUFFIX = re.compile(r"\.(shard|slice)\d[\w-]*$")


def block_module_name(block: str) -> str:
    """The module a block's forward ends in: the block's name, less a vocabulary-shard or
    unit-slice suffix (``lm_head.shard2of46`` -> ``lm_head``)."""
    return _PART_SUFFIX.sub("", block)


class BlockTimer:
    """Where each forward of this rank's stages spends its time, block by block.

    A forward pre-hook on each block's first call (``block_starts`` of the stage module,
    else the module the block is a part of: ``block_module_name``) records when the
    block's forward starts; ``StepRecorder``'s F spans then split into the time before
    the first block (``OUTSIDE``: the stage's own code, the model's code before its first
    block such as masks and rotary tables, and the stand-ins of earlier stages' blocks)
    and each block's time from its start to the next block's (the last one's to the
    end of the F, plus the microbatch's ``LOSS`` span on a last stage: the profile prices
    the loss inside the head, and the stage's F counts it). Backward is not split.
    """

    OUTSIDE = "(outside blocks)"

    def __init__(self, recorder: StepRecorder) -> None:
        self._recorder = recorder
        self.starts: list[list[tuple[int, str, float]]] = []
        """Per step of ``recorder``: (stage, block, ms from the step's start)."""
        self._handles: list[Any] = []

    def attach(self, pipe: Any) -> BlockTimer:
        """Hook the first calls of the blocks of ``pipe``'s stages (a ``PipelinedModel``)."""
        stage_modules = list(getattr(pipe, "stage_modules", None) or [None] * len(
            pipe.stage_plans))
        for plan, stage_module in zip(pipe.stage_plans, stage_modules):
            starts = getattr(stage_module, "block_starts", None) or {}
            seen = set()
            for block in plan.modules:
                label = block_module_name(block)
                call = starts.get(block, label)
                if call in seen:
                    continue
                seen.add(call)
                try:
                    module = pipe.module.get_submodule(call)
                except AttributeError:
                    continue
                self._handles.append(module.register_forward_pre_hook(
                    functools.partial(self._start, plan.index, label)))
        return self

    def _start(self, stage: int, name: str, *_: Any) -> None:
        recorder = self._recorder
        if not (recorder.enabled and recorder.steps):
            return
        recorder._sync()
        while len(self.starts) < len(recorder.steps):
            self.starts.append([])
        self.starts[len(recorder.steps) - 1].append(
            (stage, name, 1e3 * (time.perf_counter() - recorder._t0)))

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def samples(self, step: int) -> list[tuple[int, str, float]]:
        """(stage, block or ``OUTSIDE``, ms) of every F span of timed step ``step``; a
        last stage's loss is in its last row, so a span's rows add up to its F and loss."""
        spans = self._recorder.steps[step]
        starts = self.starts[step] if step < len(self.starts) else []
        loss = {(s.stage_idx, s.microbatch_idx): s.end_ms - s.start_ms
                for s in spans if s.kind == "LOSS"}
        out = []
        for span in spans:
            if span.kind != "F":
                continue
            inside = sorted((t, name) for stage, name, t in starts
                            if stage == span.stage_idx and span.start_ms <= t <= span.end_ms)
            ends = [t for t, _ in inside[1:]] + [span.end_ms]
            rows = [(span.stage_idx, self.OUTSIDE,
                     (inside[0][0] if inside else span.end_ms) - span.start_ms)]
            rows += [(span.stage_idx, name, end - t) for (t, name), end in zip(inside, ends)]
            stage, name, ms = rows[-1]
            rows[-1] = (stage, name, ms + loss.get((stage, span.microbatch_idx), 0.0))
            out += rows
        return out
