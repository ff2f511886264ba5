"""Shared test set-up: the helper modules' import path and the common fixtures.

The helper modules (``families``, ``runtime_helpers``, ``solve_helpers``) are
imported by their plain names from every test (and from spawned gloo ranks, which
inherit this ``sys.path``).
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture
def one_rank():
    """A one-rank gloo process group for the duration of a test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.fixture()
def one_thread():
    """torch on one thread for the duration of a test (timing comparisons)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hold_steady(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block measurement clean and every re-measure agreeing (a quiet machine), so
    which identical blocks are reused does not depend on the load while tests run."""
    import dataclasses

    from autopart.profile import engines, measure, profiler

    monkeypatch.setattr(engines, "measure_times_clean", lambda *a: dataclasses.replace(
        measure.measure_times(*a), fwd_ms_spread=0.0, bwd_ms_spread=0.0))
    monkeypatch.setattr(profiler, "recheck", lambda first, again, times: (first, False))


@pytest.fixture()
def steady_machine(monkeypatch):
    """``hold_steady`` for one test."""
    hold_steady(monkeypatch)
