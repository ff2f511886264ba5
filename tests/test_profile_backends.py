"""The xla backend's control flow, run against a stand-in ``torch_xla`` that executes on CPU.

The stand-in has no ``get_memory_info``, so memory must come from the meta
computation; the figures are compared with the analytical backend's.
"""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from autopart.profile import profile_model


@pytest.fixture()
def fake_xla(monkeypatch):
    calls = {"mark_step": 0}
    xm = types.ModuleType("torch_xla.core.xla_model")
    xm.xla_device = lambda: torch.device("cpu")
    xm.mark_step = lambda: calls.__setitem__("mark_step", calls["mark_step"] + 1)
    xm.wait_device_ops = lambda: None
    for name, module in (("torch_xla", types.ModuleType("torch_xla")),
                         ("torch_xla.core", types.ModuleType("torch_xla.core")),
                         ("torch_xla.core.xla_model", xm)):
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("torch_xla.debug", "torch_xla.debug.metrics"):
        monkeypatch.setitem(sys.modules, name, None)  # the stand-in counts no compilations
    sys.modules["torch_xla"].core = sys.modules["torch_xla.core"]
    sys.modules["torch_xla.core"].xla_model = xm
    return calls


def test_xla_backend_syncs_compiles_outside_timing_and_computes_memory(fake_xla):
    xla = profile_model("tiny-llama", backend="xla", seq_len=16, num_warmup=1, num_repeats=2)
    meta = profile_model("tiny-llama", backend="analytical:h100", seq_len=16)
    assert fake_xla["mark_step"] > 0
    assert xla.setup.memory_source.startswith("computed")
    assert xla.setup.time_source.startswith("measured: mark_step")
    for x, m in zip(xla.blocks, meta.blocks, strict=True):
        assert x.compile_ms > 0 or x.reused_from
        assert x.activation_bytes == m.activation_bytes
        assert x.output_bytes == m.output_bytes
        assert "fwd_ms" in x.measured and "activation_bytes" not in x.measured


def test_xla_needs_a_warmup_run(fake_xla):
    from autopart.errors import ProfileError

    with pytest.raises(ProfileError, match="num_warmup >= 1"):
        profile_model("tiny-llama", backend="xla", seq_len=16, num_warmup=0)


def test_cpu_times_every_call_after_writing_over_twice_the_last_level_cache():
    from autopart.profile.backends import CPUBackend, last_level_cache_bytes

    llc = last_level_cache_bytes()
    assert llc >= 1 << 20
    backend = CPUBackend("llc")
    assert backend.flush_bytes == 2 * llc
    assert backend._flush.numel() * 4 == backend.flush_bytes
    before = float(backend._flush[-1])
    ms, out = backend.time(lambda: 7)
    assert out == 7 and ms >= 0
    assert float(backend._flush[-1]) == before + 1  # the whole buffer was written
    assert "caches flushed" in backend.time_source


def test_model_flush_reads_the_weights_worth_then_touches_the_inputs(monkeypatch):
    """``model``: a read (never a write) of as many bytes as the model's weights, capped at
    twice the last-level cache, then the call's inputs read again, all before the clock."""
    from torch.overrides import TorchFunctionMode

    from autopart.profile import backends

    monkeypatch.setattr(backends, "last_level_cache_bytes", lambda: 1 << 20)
    backend = backends.CPUBackend("model")
    assert backend.flush_bytes == 0  # sized once the model is known
    backend.size_flush(4096)
    assert backend.flush_bytes == 4096 and backend._flush.numel() == 1024
    assert "weights' worth read" in backend.time_source and "0.0 MiB" in backend.time_source
    backend.size_flush(10 << 20)
    assert backend.flush_bytes == 2 << 20  # capped at twice the last-level cache

    order = []

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "sum":
                order.append("flush" if args[0] is backend._flush else "input")
            return func(*args, **(kwargs or {}))

    x = torch.ones(3)
    before = backend._flush.clone()
    with Log():
        _, out = backend.time(lambda: order.append("fn") or 5, (x, None))
    assert out == 5 and order == ["flush", "input", "fn"]
    assert torch.equal(backend._flush, before)  # read, not written
    llc = backends.CPUBackend("llc")
    llc.size_flush(4096)
    assert llc.flush_bytes == 2 << 20  # llc does not depend on the model


def test_last_level_cache_falls_back_where_sysfs_says_nothing(monkeypatch):
    from autopart.profile import backends

    monkeypatch.setattr(backends.glob, "glob", lambda pattern: [])
    assert backends.last_level_cache_bytes() == 32 << 20


def test_cuda_l2_flush_is_twice_the_l2_and_runs_before_the_start_event(monkeypatch):
    """No GPU here: the flush's size comes from the device properties, and ``time`` zeroes
    the buffer and queues the GPU spin before recording the start event (events, spin and
    buffer stand-ins log order)."""
    from types import SimpleNamespace

    from autopart.profile import cuda_backend as backends

    assert backends.l2_flush_bytes(SimpleNamespace(L2_cache_size=50 << 20)) == 100 << 20
    assert backends.l2_flush_bytes(SimpleNamespace()) == 256 << 20
    order, made = [], []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            self.name = "end" if made else "start"
            made.append(self)

        def record(self) -> None:
            order.append(f"{self.name} recorded")

        def synchronize(self) -> None:
            order.append(f"{self.name} synchronized")

        def elapsed_time(self, other) -> float:
            return 1.5

    monkeypatch.setattr(backends.torch.cuda, "Event", Event)
    monkeypatch.setattr(backends.torch.cuda, "_sleep", lambda n: order.append(f"spin {n}"))
    backend = object.__new__(backends.CUDABackend)
    backend.flush_bytes = 8
    backend._lead_cycles = 100
    backend._flush = SimpleNamespace(zero_=lambda: order.append("flush"))
    ms, out = backend.time(lambda: order.append("fn") or 3)
    assert (ms, out) == (1.5, 3)
    assert order == ["flush", "spin 100", "start recorded", "fn", "end recorded",
                     "end synchronized"]
    order.clear()
    made.clear()
    backend.flush_bytes = 0
    backend.time(lambda: order.append("fn"))
    assert "flush" not in order
    made.clear()  # a call the host queues slower than the GPU runs it costs the host's time
    ms, _ = backend.time(lambda: time.sleep(0.005))
    assert ms >= 5.0


def test_cpu_backend_without_flush_writes_nothing():
    from autopart.errors import ProfileError
    from autopart.profile.backends import CPUBackend

    backend = CPUBackend("none")
    assert backend.flush_bytes == 0 and backend._flush.numel() == 0
    assert "no flush" in backend.time_source
    with pytest.raises(ProfileError, match="unknown cache_flush .l3.; expected auto"):
        CPUBackend("l3")


def test_auto_flush_is_order_on_cpu_and_an_unknown_flush_is_refused():
    from autopart.errors import ProfileError
    from autopart.profile.backends import AUTO_FLUSH, make_backend

    assert AUTO_FLUSH == {"cpu": "order", "cuda": "llc"}
    assert make_backend("cpu").flush == make_backend("cpu", "auto").flush == "order"
    assert make_backend("cpu", "none").flush_bytes == 0
    assert make_backend("cpu", "llc").flush_bytes > 0
    with pytest.raises(ProfileError, match="expected auto, none, llc, model, order"):
        make_backend("cpu", "l2")


def test_thread_clock_counts_cpu_time_only_and_needs_one_thread(monkeypatch):
    """A sleeping call accrues no thread CPU time (it would be its whole length on the wall
    clock); with more than one torch thread the thread clock is refused in one line."""
    import time

    from autopart.errors import ProfileError
    from autopart.profile.backends import make_backend

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    backend = make_backend("cpu", "none", "thread")
    assert "time.thread_time" in backend.time_source
    ms, out = backend.time(lambda: time.sleep(0.05) or 5)
    assert out == 5 and 0 <= ms < 25  # a sleep is not CPU time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with pytest.raises(ProfileError, match="torch runs 2 threads; profile with --threads 1"):
        make_backend("cpu", "none", "thread")
    with pytest.raises(ProfileError, match="clock 'thread' is for the cpu backend"):
        make_backend("xla", "auto", "thread")


def test_auto_clock_is_the_thread_clock_on_one_thread_cpu_profiles(monkeypatch):
    from autopart.profile.backends import auto_clock, make_backend

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert auto_clock("cpu") == "thread" and auto_clock("cuda") == "wall"
    assert make_backend("cpu").clock == "thread"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert auto_clock("cpu") == "wall" and make_backend("cpu").clock == "wall"
