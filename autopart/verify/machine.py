"""The machine check: the pipeline runtime's own cost and the link, measured once per machine.

``check_machine`` spawns two local ranks and runs ``torch.distributed.pipelining``'s
``Schedule1F1B`` on stages that compute almost nothing (one 16 x 16 linear layer on
a 1 x 16 microbatch), at two microbatch counts. Per rank and step it times every
``forward_one_chunk`` and ``backward_one_chunk`` (less the layer's own compute,
timed alone), the p2p waits, and the step. What the actions cost is the runtime's
work per F and B; what is left of a step outside actions and waits grows with the
microbatches by the p2p ops posted (two per microbatch on each of the two ranks) and
is otherwise the fixed work per step. A ping-pong then measures the link's
latency (4-byte messages) and bandwidth (4 MiB); on CPU the latency is the mean while
the other rank keeps a core busy, as in a pipeline (gloo's threads then wait for a core:
0.58 ms against 0.09 ms idle on this project's 2-core VM, a tail of scheduler slices).
Two more runs (``autopart.verify.machine_runtime``) time what torch's action runtime
(every multi-stage schedule) spends per send or receive with stages that compute, and
the all-reduce that sums a gradient held on both ranks. The result, a ``RuntimeOverhead``,
is cached under ``~/.cache/autopart`` per host, torch version, backend and thread
count, and ``autopart profile`` records it in the profiles it takes there.

    autopart calibrate --machine --threads 1     # once per machine and thread count
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import RuntimeSetupError, SchemaError
from autopart.jsonio import dump_json, write_text
from autopart.schema import Profile, RuntimeOverhead
from autopart.verify.machine_runtime import (
    all_reduce_times,
    fit_runtime,
    runtime_post_times,
    sync,
    timed_method,
    timed_step,
)

__all__ = ["check_machine", "load_cached_overhead", "machine_check_for", "round_trips",
           "save_cached_overhead"]

CHECK_VERSION = 3
"""What the check measures; a cached check of another version is not used (2: the link's
latency beside a busy core on CPU; 3: the action runtime's posts and the gradient sum,
``autopart.verify.machine_runtime``)."""

_WIDTH = 16
_COUNTS = (2, 8)
"""Microbatch counts of the two runs; the per-step and per-p2p costs come from the
difference."""
_P2P_PER_MICROBATCH = 2
"""Sends + receives a rank of a two-rank 1F1B posts per microbatch (F: one, B: one)."""


def check_machine(*, num_threads: int = 1, num_steps: int = 20, num_warmup: int = 3,
                  timeout_s: float = 120.0) -> RuntimeOverhead:
    """Measure the pipeline runtime's own cost and the local link (module docstring).

    Args:
        num_threads: torch threads in each of the two ranks (what training ranks get).
        num_steps: Timed steps per microbatch count.
        num_warmup: Untimed steps first.
        timeout_s: Timeout of every collective.

    Returns:
        The measured ``RuntimeOverhead`` (gloo on CPU, nccl where two GPUs exist).

    Raises:
        RuntimeSetupError: A bad setting, or a rank failed.
    """
    if num_threads < 1 or num_steps < 2 or num_warmup < 0:
        raise RuntimeSetupError(f"machine check needs threads >= 1 and steps >= 2, got "
                                f"threads {num_threads}, steps {num_steps}")
    import torch.multiprocessing as mp

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="autopart-machine-") as tmp:
        try:
            mp.spawn(_rank_main, nprocs=2, join=True, args=(
                _free_port(), tmp, backend, num_threads, num_steps, num_warmup, timeout_s))
        except Exception as exc:  # noqa: BLE001 -- any rank failure becomes one line
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RuntimeSetupError(f"the machine check failed ({last}); rerun with "
                                    f"--debug for the traceback") from exc
        raw = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    return _fit(raw, backend, num_threads, load)


def _fit(raw: list[dict[str, Any]], backend: str, num_threads: int,
         load: float) -> RuntimeOverhead:
    """Turn both ranks' timings into per-action, per-p2p and per-step constants."""
    fwd = statistics.median(x for r in raw for x in r["fwd"]) - raw[0]["module_fwd"]
    bwd = statistics.median(x for r in raw for x in r["bwd"]) - raw[0]["module_bwd"]
    low, high = _COUNTS
    rest = {m: statistics.median(x for r in raw for x in r["rest"][str(m)]) for m in _COUNTS}
    p2p = max(rest[high] - rest[low], 0.0) / ((high - low) * _P2P_PER_MICROBATCH)
    step = max(rest[low] - low * _P2P_PER_MICROBATCH * p2p, 0.0)
    link = raw[0]["link"]
    bandwidth = link["large_bytes"] / max(1e-6, (link["large_ms"] - link["small_ms"]) / 1e3)
    # a transfer in a pipeline mostly lands while the other rank computes: on CPU its
    # threads then wait for a core (a heavy tail, up to a scheduler slice), so the link's
    # latency is the mean of messages sent beside a busy core, not the idle median
    latency = link.get("busy_small_ms", link["small_ms"])
    runtime_p2p, allreduce_latency, allreduce_bandwidth = (
        fit_runtime(raw) if "runtime" in raw[0] else (0.0, 0.0, 0.0))
    return RuntimeOverhead(
        fwd_action_ms=round(max(fwd, 0.0), 4), bwd_action_ms=round(max(bwd, 0.0), 4),
        p2p_ms=round(p2p, 4), step_ms=round(step, 4), link_latency_ms=round(latency, 4),
        link_bandwidth_bytes_per_s=float(f"{bandwidth:.4g}"), backend=backend,
        num_threads=num_threads, hostname=platform.node(), torch_version=torch.__version__,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load_average=round(load, 2), runtime_p2p_ms=round(runtime_p2p, 4),
        allreduce_latency_ms=round(allreduce_latency, 4),
        allreduce_bandwidth_bytes_per_s=float(f"{allreduce_bandwidth:.4g}"))


def _rank_main(rank: int, port: int, tmp: str, backend: str, num_threads: int,
               num_steps: int, num_warmup: int, timeout_s: float) -> None:
    """One of the two ranks: the pipeline runs, then the ping-pong; writes its timings."""
    torch.set_num_threads(num_threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    try:
        torch.manual_seed(0)
        layer = torch.nn.Linear(_WIDTH, _WIDTH).to(device)
        out: dict[str, Any] = {"fwd": [], "bwd": [], "rest": {}}
        out["module_fwd"], out["module_bwd"] = _module_ms(layer, device)
        for m in _COUNTS:
            times = _pipeline_times(rank, layer, device, m, num_steps, num_warmup)
            out["fwd"] += times["fwd"]
            out["bwd"] += times["bwd"]
            out["rest"][str(m)] = times["rest"]
        out["runtime"] = runtime_post_times(rank, device, num_steps, num_warmup)
        out["allreduce"] = all_reduce_times(device)
        out["link"] = _ping_pong(rank, device)
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _module_ms(layer: torch.nn.Module, device: torch.device) -> tuple[float, float]:
    """Median ms of the layer's own forward and backward on one microbatch."""
    x = torch.randn(1, _WIDTH, device=device, requires_grad=True)
    fwd, bwd = [], []
    for _ in range(50):
        start = time.perf_counter()
        y = layer(x)
        mid = time.perf_counter()
        y.sum().backward()
        sync(device)
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
    return 1e3 * statistics.median(fwd), 1e3 * statistics.median(bwd)


def _pipeline_times(rank: int, layer: torch.nn.Module, device: torch.device, m: int,
                    num_steps: int, num_warmup: int) -> dict[str, list[float]]:
    """Per action F / B ms, and per step what is left outside actions and waits."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.pipelining import schedules as torch_schedules

    stage = PipelineStage(layer, rank, 2, device)
    schedule = Schedule1F1B(stage, m, loss_fn=lambda out, target: out.pow(2).mean())
    spans: dict[str, list[float]] = {"F": [], "B": [], "WAIT": []}
    restore = [timed_method(stage, "forward_one_chunk", spans["F"]),
               timed_method(stage, "backward_one_chunk", spans["B"]),
               timed_method(torch_schedules, "_wait_batch_p2p", spans["WAIT"])]
    x = torch.randn(m, _WIDTH, device=device)
    result: dict[str, list[float]] = {"fwd": [], "bwd": [], "rest": []}
    try:
        for step in range(num_warmup + num_steps):
            for values in spans.values():
                values.clear()
            total = timed_step(schedule, rank, x, device)
            if step >= num_warmup:
                result["fwd"] += spans["F"]
                result["bwd"] += spans["B"]
                result["rest"].append(total - sum(map(sum, spans.values())))
            layer.zero_grad(set_to_none=True)
    finally:
        for undo in restore:
            undo()
    return result


def _ping_pong(rank: int, device: torch.device) -> dict[str, float]:
    """One-way ms of a 4-byte and a 4 MiB message between the two ranks (medians), and on
    CPU the mean of 4-byte messages while rank 1 also computes (``busy_small_ms``)."""
    out = {}
    for name, numel, reps in (("small", 1, 200), ("large", 2**20, 20)):
        times = round_trips(rank, torch.zeros(numel, device=device), reps)
        out[f"{name}_ms"] = statistics.median(times)
        out[f"{name}_bytes"] = numel * 4
    if device.type == "cpu":
        stop = threading.Event()
        worker = threading.Thread(target=_compute_until, args=(stop,), daemon=True)
        if rank == 1:
            worker.start()
        try:
            out["busy_small_ms"] = statistics.mean(round_trips(rank, torch.zeros(1), 400))
        finally:
            stop.set()
            if rank == 1:
                worker.join()
    return out


def round_trips(rank: int, buf: torch.Tensor, reps: int) -> list[float]:
    """One-way ms of each of ``reps`` round trips of ``buf`` between ranks 0 and 1 (a
    barrier before each; call it on both ranks of an initialized process group)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        sync(buf.device)
        times.append(1e3 * (time.perf_counter() - start) / 2)
    return times


def _compute_until(stop: threading.Event) -> None:
    """Keep a core busy with matrix products (which release the GIL) until ``stop``."""
    a = torch.randn(128, 128)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def cache_path(backend: str, num_threads: int, root: Path | None = None) -> Path:
    """Where the machine check of this host, torch version, backend and thread count lives.

    Args:
        backend: ``gloo`` or ``nccl``.
        num_threads: torch threads per rank.
        root: The cache folder (default ``$XDG_CACHE_HOME/autopart`` or ``~/.cache/autopart``).

    Returns:
        ``<root>/machine-<host>-torch<version>-<backend>-<threads>t-v<CHECK_VERSION>.json``.
    """
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "autopart"
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in platform.node() or "host")
    return root / (f"machine-{host}-torch{torch.__version__}-{backend}-{num_threads}t"
                   f"-v{CHECK_VERSION}.json")


def save_cached_overhead(overhead: RuntimeOverhead, root: Path | None = None) -> Path:
    """Write ``overhead`` to its cache file (``cache_path``); return the path."""
    path = cache_path(overhead.backend, overhead.num_threads, root)
    write_text(path, dump_json(dataclasses.asdict(overhead)))
    return path


def load_cached_overhead(backend: str, num_threads: int,
                         root: Path | None = None) -> RuntimeOverhead | None:
    """The cached machine check for this host and settings, or ``None`` when there is none.

    Raises:
        SchemaError: The cache file exists but is not a machine check (one line, with
            the path to delete).
    """
    path = cache_path(backend, num_threads, root)
    if not path.is_file():
        return None
    try:
        return RuntimeOverhead(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise SchemaError(f"{path} is not a machine check ({exc}); delete it and run "
                          f"`autopart calibrate --machine` again") from None


def machine_check_for(profile: Profile, root: Path | None = None) -> RuntimeOverhead | None:
    """The cached machine check that matches how ``profile`` was taken, if any.

    Args:
        profile: A measured profile (``cpu`` -> gloo, ``cuda`` -> nccl) of this machine.
        root: The cache folder (default as in ``cache_path``).

    Returns:
        The check at the profile's thread count; ``None`` for other backends or when
        ``autopart calibrate --machine`` has not run at that thread count here.
    """
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(profile.setup.backend)
    if backend is None:
        return None
    return load_cached_overhead(backend, profile.setup.num_threads or torch.get_num_threads(),
                                root)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
