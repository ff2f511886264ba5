"""``verify_plan``: run a plan for real on its ``pp x dp x tp`` ranks and compare it with its
prediction.

Outside a launcher it spawns the ranks itself (``torch.multiprocessing``; gloo on
CPU, nccl with one GPU per rank when CUDA is present); under torchrun
(``WORLD_SIZE``/``RANK`` set) it runs in place on every rank and returns the report
on rank 0 only. Every collective has a timeout. Checks that can fail (plan file,
world size, model fingerprint) run before any process starts.

``verify_steadily`` measures a run in two launches, pooled where their steps agree within
``LAUNCH_SPREAD``, else a third and the two fastest pooled. On a host whose cores slow in spells
one launch's step can be 20-40% off the next one's (``docs/timing-sweep.md``); the
rehearsal uses it. ``verify_in_turn`` measures several plans so, their launches taken in
turn: the validation sweep compares a plan with the even split that way.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autopart.errors import AutopartError, RuntimeSetupError
from autopart.profile.noise import agree
from autopart.profile.profiler import ProgressFn
from autopart.schema import Plan
from autopart.verify.build import build_report
from autopart.verify.report import RunReport, pooled_report
from autopart.verify.worker import RunSettings, run_rank

T = TypeVar("T")

__all__ = ["LAUNCH_SPREAD", "verify_in_turn", "verify_plan", "verify_steadily"]

logger = logging.getLogger(__name__)

LAUNCH_SPREAD = 0.1
"""The most two launches' steps may differ by (over the smaller) before a third decides."""


def verify_plan(plan: Plan | str | Path, settings: RunSettings, *,
                nproc: int | None = None, progress: ProgressFn | None = None
                ) -> RunReport | None:
    """Run ``plan`` for real and compare it with its prediction.

    Args:
        plan: The plan, or the path of its JSON file.
        settings: The model and how to run it (steps, warm-up, threads, timeout).
        nproc: Ranks to spawn; defaults to the plan's ``pp x dp x tp`` and must equal it.
        progress: ``progress(done, total, what)`` after the ranks have built their
            stages, after every step and after the memory step (pipeline rank 0's
            view), in this process.

    Returns:
        The ``RunReport``; ``None`` on ranks other than 0 under torchrun.

    Raises:
        AutopartError: One line, for a missing plan, a world size that is not the
            plan's mesh, a model the plan was not made for, or a rank failing that way.
    """
    plan_obj = plan if isinstance(plan, Plan) else Plan.load(plan)
    mesh = plan_obj.pp_size * plan_obj.dp_size * plan_obj.tp_size
    in_place = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if in_place else (nproc or mesh)
    if world != mesh:
        where = "WORLD_SIZE" if in_place else "--nproc"
        raise RuntimeSetupError(f"{where} is {world} but the plan needs pp {plan_obj.pp_size} "
                                f"x dp {plan_obj.dp_size} x tp {plan_obj.tp_size} = {mesh} "
                                f"ranks; run {mesh} ranks")
    _check_model_matches(plan_obj, settings.model)
    _check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", world)) if in_place else world)
    if in_place:
        return _run_in_place(plan_obj, settings, progress)
    return _spawn(plan_obj, settings, world, progress)


def verify_steadily(plan: Plan, settings: RunSettings, *, progress: ProgressFn | None = None
                    ) -> tuple[RunReport, tuple[float, ...]]:
    """Run ``plan`` in two launches and pool them where their steps agree within
    ``LAUNCH_SPREAD`` (``pooled_report``: the geometric mean of their steps and stage
    times); where they disagree, a third launch runs and the two fastest are pooled: a
    host's load only slows a launch, so the slowest of three is the one a slow spell
    took, also where the spell took two (through r23 of the timing sweep the median launch
    was kept, and r22's even split of three launches 107.2, 95.3 and 106.0 ms kept 106.0).

    Args:
        plan: The plan.
        settings: As for ``verify_plan``.
        progress: As for ``verify_plan``; it counts each launch from the start.

    Returns:
        The pooled ``RunReport`` and every launch's measured step, in launch order.

    Raises:
        AutopartError: As ``verify_plan`` does; under a launcher (``WORLD_SIZE`` set),
            where the ranks are not this function's to launch again.
    """
    return verify_in_turn([plan], settings, progress=progress)[0]


def verify_in_turn(plans: list[Plan], settings: RunSettings, *,
                   progress: ProgressFn | None = None
                   ) -> list[tuple[RunReport, tuple[float, ...]]]:
    """Measure several plans of one model as ``verify_steadily`` measures one, their
    launches taken in turn (A, B, A, B, then a third of each plan whose two disagreed), so
    that a slow spell of the host, which lasts minutes, falls on every plan alike and a
    ratio of their steps (a plan's speed-up over the even split) does not carry it.

    Args:
        plans: The plans, each for ``settings.model``.
        settings: As for ``verify_plan``.
        progress: As for ``verify_plan``; it counts each launch from the start.

    Returns:
        Per plan, in order, what ``verify_steadily`` returns for it.

    Raises:
        AutopartError: As ``verify_steadily`` does.
    """
    if "WORLD_SIZE" in os.environ:
        raise RuntimeSetupError("verify_steadily and verify_in_turn launch their own "
                                "ranks; under torchrun run verify_plan once per launch")

    def launch(plan: Plan) -> RunReport:
        report = verify_plan(plan, settings, progress=progress)
        assert report is not None  # spawned: this process gathers every rank
        return report

    runs: list[list[RunReport]] = [[] for _ in plans]
    for _ in range(2):
        for plan, launches in zip(plans, runs):
            launches.append(launch(plan))
    for plan, launches in zip(plans, runs):
        if not agree(*(r.measured_step_ms for r in launches), LAUNCH_SPREAD):
            logger.info("two launches' steps disagreed (%s ms); pooling the two fastest of "
                        "three",
                        ", ".join(f"{r.measured_step_ms:.1f}" for r in launches))
            launches.append(launch(plan))
    return [(pooled_report(tuple(fastest_two(launches, lambda r: r.measured_step_ms))),
             tuple(r.measured_step_ms for r in launches)) for launches in runs]


def fastest_two(items: list[T], step: Callable[[T], float]) -> list[T]:
    """The two of ``items`` (two or three launches or runs) with the shortest ``step``, in
    their order: a host's load only slows a run, so the slowest of three is the one a slow
    spell took, also where the spell took two."""
    if len(items) <= 2:
        return list(items)
    slowest = max(items, key=step)
    return [item for item in items if item is not slowest]


def _check_model_matches(plan: Plan, model: str) -> None:
    """Refuse ``model`` unless it is the model ``plan`` was made for.

    Args:
        plan: The plan to verify.
        model: A model source (preset, HF config path, ...).

    Raises:
        RuntimeSetupError: ``model``'s block chain has another fingerprint, or it is not
            an HF causal LM (verify trains on synthetic tokens with the next-token loss).
        ModelSourceError: ``model`` cannot be loaded.
    """
    from autopart.intake import discover_blocks, load_model

    chain = discover_blocks(load_model(model).model)
    plan.check_model(chain.fingerprint, repr(model))
    if chain.family != "hf_causal_lm":
        raise RuntimeSetupError(
            f"autopart verify trains HF causal LMs on synthetic tokens with the next-token "
            f"loss; {model!r} is not one: run the plan in your own script "
            f"(auto_pipeline(model, plan=..., loss_fn=...)) and time its steps there")


def _run_in_place(plan: Plan, settings: RunSettings,
                  progress: ProgressFn | None) -> RunReport | None:
    device = _device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    if not dist.is_initialized():
        dist.init_process_group(_backend(device), timeout=timedelta(seconds=settings.timeout_s))
    result = run_rank(plan, settings, device, progress)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(result, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    return build_report(plan, settings, gathered)


def _spawn(plan: Plan, settings: RunSettings, world: int,
           progress: ProgressFn | None) -> RunReport:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    # Rank 0 sends (done, total, what) here; this process passes them to ``progress``.
    queue = mp.get_context("spawn").SimpleQueue()

    def relay() -> None:
        while not queue.empty():
            update = queue.get()
            if progress is not None:
                progress(*update)

    with tempfile.TemporaryDirectory(prefix="autopart-verify-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan.save(plan_path)
        try:
            context = mp.spawn(_spawned_rank, nprocs=world, join=False, args=(
                world, _free_port(), str(plan_path), settings, tmp, queue))
            while not context.join(timeout=0.2):
                relay()
            relay()
        except ProcessException as exc:  # a rank failed: show its own one-line error
            raise _rank_error(Path(tmp), exc) from None
        # Written by rank 0 of this very run: RankResult records, pickled.
        results = pickle.loads((Path(tmp) / "results.pkl").read_bytes())
    return build_report(plan, settings, results)


def _spawned_rank(rank: int, world: int, port: int, plan_path: str, settings: RunSettings,
                  tmp: str, queue: Any) -> None:
    """Entry point of a spawned rank: set up the group, run, rank 0 writes all results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    device = _device(rank)
    try:
        dist.init_process_group(_backend(device), rank=rank, world_size=world,
                                timeout=timedelta(seconds=settings.timeout_s))
        result = run_rank(Plan.load(plan_path), settings, device,
                          lambda *update: queue.put(update))
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(result, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            (Path(tmp) / "results.pkl").write_bytes(pickle.dumps(gathered))
    except AutopartError as exc:
        (Path(tmp) / f"error_rank{rank}.txt").write_text(f"rank {rank}: {exc}")
        raise
    except Exception:
        (Path(tmp) / f"crash_rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_error(tmp: Path, exc: Exception) -> AutopartError:
    errors = sorted(tmp.glob("error_rank*.txt"))
    if errors:
        return RuntimeSetupError(errors[0].read_text().strip())
    # A rank that lost its peer crashed because another did: show the other one first.
    # gloo says "Connection closed by peer" or "Connection reset by peer".
    crashes = sorted(((path.read_text(), path) for path in tmp.glob("crash_rank*.txt")),
                     key=lambda crash: (" by peer" in crash[0], crash[1].name))
    if crashes:
        text, path = crashes[0]
        last = text.strip().splitlines()[-1]
        logger.error("%s", text)
        return RuntimeSetupError(f"{path.stem.split('_')[1]} crashed: {last}; rerun with "
                                 f"--debug -v for the traceback")
    return RuntimeSetupError(f"a rank failed ({type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[-1] if str(exc) else ''})")


def _check_gpus(local_ranks: int) -> None:
    """One rank per GPU under nccl: two ranks on one GPU fail inside NCCL's first
    collective, so say so before any rank starts."""
    if torch.cuda.is_available() and torch.cuda.device_count() < local_ranks:
        raise RuntimeSetupError(
            f"the plan runs {local_ranks} ranks on this machine but it has "
            f"{torch.cuda.device_count()} GPU(s), one per rank under nccl; verify on a "
            f"machine with {local_ranks} GPUs (or across machines under torchrun), or on "
            f"CPU with CUDA_VISIBLE_DEVICES= (gloo)")


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
