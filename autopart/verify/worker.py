"""What every rank does under ``verify_plan``: build its stages, train, time, measure memory.

Each rank builds its stages with ``auto_pipeline(model, plan=plan)`` (its tensor- and
data-parallel shards too), trains ``warmup + steps`` steps on synthetic token ids
(labels = ids) of the plan's batch per replica (``micro_batch_size * num_microbatches``
x ``seq_len``, a different batch on each replica) with the plan's
optimizer (adam -> AdamW, sgd -> SGD with momentum, none -> no update), timing
each step between barriers and every F/B/W and p2p wait inside it
(``StepRecorder``). A last, untimed step measures memory. The result is a
``RankResult``, gathered on rank 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopart.errors import RuntimeSetupError
from autopart.profile.profiler import ProgressFn
from autopart.schema import Plan
from autopart.verify.instrument import BlockTimer, StepRecorder
from autopart.verify.memory import CPU_METHOD, CUDA_METHOD, measure_step_memory
from autopart.verify.report import MeasuredMemory

__all__ = ["RunSettings"]

"""``progress(done, total, what)``: ``done`` of ``total`` units finished, the last ``what``."""

Span = tuple[str, int, int, float, float]
"""One timed action: kind (``F``, ``LOSS``, ``B``, ``BW``, ``W``, ``WAIT``), stage index,
microbatch index, start and end in ms from the step's start (-1 for no stage / mb)."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSettings:
    """How to run a plan for verification.

    Raises ``RuntimeSetupError`` on construction for a value out of range.
    """

    model: str
    """Model source (preset, HF config path, ...) as ``auto_pipeline`` takes it."""
    steps: int = 5
    """Timed steps."""
    warmup: int = 2
    """Untimed steps first (shape inference, allocator and thread-pool warm-up)."""
    threads_per_rank: int = 1
    """``torch.set_num_threads`` in each rank (CPU)."""
    timeout_s: float = 300.0
    """Timeout of every collective."""
    seed: int = 0
    """Seeds the weights' initialization and the synthetic tokens."""
    lr: float = 1e-4
    """Learning rate of the plan's optimizer (AdamW or SGD with momentum 0.9)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise RuntimeSetupError(f"--steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            raise RuntimeSetupError(f"--warmup must be >= 0, got {self.warmup}")
        if self.threads_per_rank < 1:
            raise RuntimeSetupError(f"--threads-per-rank must be >= 1, got "
                                    f"{self.threads_per_rank}")
        if not self.timeout_s > 0:
            raise RuntimeSetupError(f"--timeout must be a positive number of seconds, got "
                                    f"{self.timeout_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankResult:
    """What one rank measured under ``verify_plan`` (timed steps only)."""

    rank: int
    """Pipeline rank."""
    stages: tuple[int, ...]
    """Indices of the stages this rank ran."""
    step_ms: tuple[float, ...]
    """Each timed pipeline step, between barriers (optimizer step excluded)."""
    optimizer_ms: tuple[float, ...]
    """Each timed step's ``optimizer.step()``."""
    cpu_ms: tuple[float, ...]
    """Process CPU time during each timed pipeline step."""
    spans: tuple[tuple[Span, ...], ...]
    """Per timed step, every F/B/W and p2p wait of this rank."""
    memory: MeasuredMemory
    """Memory of the last, untimed step."""
    memory_method: str
    """How memory was measured (``verify.memory.CPU_METHOD`` or ``CUDA_METHOD``)."""
    device: str
    """The device's name."""
    num_threads: int
    """torch's thread count in this rank."""
    dp_rank: int = 0
    """Data-parallel replica of this process (0 without data parallelism)."""
    tp_rank: int = 0
    """Tensor-parallel rank of this process (0 without tensor parallelism)."""
    span_cpu_ms: tuple[tuple[float, ...], ...] = ()
    """Per timed step, the thread CPU time of each span of ``spans``, in the same order."""
    block_fwd: tuple[tuple[tuple[int, str, float], ...], ...] = ()
    """Per timed step, (stage, block module, ms) of every F span split by ``BlockTimer``."""


def run_rank(plan: Plan, settings: RunSettings, device: torch.device,
             progress: ProgressFn | None = None) -> RankResult:
    """Run the plan on this rank and measure it (see the module docstring).

    Args:
        plan: The plan to run; this rank builds only its own stages.
        settings: Steps, warm-up, threads and seed.
        device: This rank's device.
        progress: Called on pipeline rank 0 only, as ``progress(done, total, what)``
            after the stages are built, after every step, and after the memory step.

    Returns:
        This rank's measurements.

    Raises:
        RuntimeSetupError: The model is not an HF causal LM, or the plan lacks its
            micro-batch size, sequence length or a known optimizer.
    """
    from autopart.runtime import auto_pipeline

    torch.set_num_threads(settings.threads_per_rank)
    torch.manual_seed(settings.seed)
    pipe = auto_pipeline(settings.model, plan=plan, device=device)
    if pipe.config is None:
        raise RuntimeSetupError(f"autopart verify trains HF causal LMs on synthetic tokens; "
                                f"{settings.model!r} is not one (give an HF preset or config)")
    optimizer = _make_optimizer(plan.setup.optimizer, pipe.parameters(),
                                settings.lr)
    # each data-parallel replica trains its own slice of the global batch
    ids = _synthetic_ids(plan, pipe.config.vocab_size, settings.seed + pipe.groups.dp_rank)
    ids = ids.to(device)
    num_steps = settings.warmup + settings.steps
    total = num_steps + 2

    def report(done: int, what: str) -> None:
        if progress is not None and pipe.groups.pp_rank == 0:
            progress(done, total, what)

    report(1, "stages built")

    def run_step() -> None:
        pipe.step(ids, target=ids)

    recorder = StepRecorder(device).attach(pipe)
    blocks = BlockTimer(recorder).attach(pipe)
    step_ms, optimizer_ms, cpu_ms = [], [], []
    try:
        for step in range(num_steps):
            ms, opt, cpu = _timed_step(run_step, pipe, optimizer, recorder, device)
            step_ms.append(ms)
            optimizer_ms.append(opt)
            cpu_ms.append(cpu)
            report(2 + step, f"warm-up step {step + 1}/{settings.warmup}"
                   if step < settings.warmup else
                   f"step {step + 1 - settings.warmup}/{settings.steps}")
        recorder.enabled = False
        _zero_grad(pipe, optimizer)
        memory = measure_step_memory(run_step, pipe, optimizer, device)
        report(total, "memory step")
    finally:
        recorder.detach()
        blocks.detach()
    timed = slice(settings.warmup, None)
    return RankResult(
        rank=pipe.groups.pp_rank, stages=tuple(s.index for s in pipe.stage_plans),
        step_ms=tuple(step_ms[timed]), optimizer_ms=tuple(optimizer_ms[timed]),
        cpu_ms=tuple(cpu_ms[timed]),
        spans=tuple(tuple(_span_row(s) for s in step) for step in recorder.steps[timed]),
        span_cpu_ms=tuple(tuple(round(s.cpu_ms, 4) for s in step)
                          for step in recorder.steps[timed]),
        memory=memory, memory_method=CUDA_METHOD if device.type == "cuda" else CPU_METHOD,
        device=_device_name(device), num_threads=torch.get_num_threads(),
        dp_rank=pipe.groups.dp_rank, tp_rank=pipe.groups.tp_rank,
        block_fwd=tuple(tuple((stage, name, round(ms, 4)) for stage, name, ms in
                              blocks.samples(i)) for i in range(num_steps)[timed]))


def _timed_step(run_step, pipe, optimizer, recorder: StepRecorder,
                device: torch.device) -> tuple[float, float, float]:
    """One step fenced by a barrier on this rank: pipeline step ms, optimizer step ms, and
    the process CPU time of the pipeline step (below the wall time when the rank waited or
    was descheduled by other load)."""
    _zero_grad(pipe, optimizer)
    dist.barrier()  # every rank of the mesh starts the step together
    recorder.begin_step()
    start, cpu_start = time.perf_counter(), time.process_time()
    run_step()
    _sync(device)
    mid, cpu_end = time.perf_counter(), time.process_time()
    if optimizer is not None:
        optimizer.step()
        _sync(device)
    end = time.perf_counter()
    return 1e3 * (mid - start), 1e3 * (end - mid), 1e3 * (cpu_end - cpu_start)


def _make_optimizer(name: str, params: list, lr: float):
    if name == "adam":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "none":
        return None
    raise RuntimeSetupError(f"plan optimizer {name!r} is not adam, sgd or none; regenerate "
                            f"the plan")


def _zero_grad(pipe, optimizer) -> None:
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in pipe.parameters():
            p.grad = None


def _synthetic_ids(plan: Plan, vocab_size: int, seed: int) -> torch.Tensor:
    """The same random batch on every rank: (mbs * m) x seq_len token ids."""
    if plan.micro_batch_size < 1 or plan.seq_len < 1:
        raise RuntimeSetupError("the plan does not record micro_batch_size / seq_len; "
                                "regenerate it with `autopart plan`")
    gen = torch.Generator().manual_seed(seed)
    shape = (plan.micro_batch_size * plan.num_microbatches, plan.seq_len)
    return torch.randint(0, vocab_size, shape, generator=gen)


def _span_row(span) -> Span:
    return (span.kind, span.stage_idx, span.microbatch_idx, round(span.start_ms, 4),
            round(span.end_ms, 4))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"
