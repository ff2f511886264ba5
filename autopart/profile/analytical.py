"""The analytical backend: FLOPs and bytes counted per op on meta, roofline time per op.

Each block runs its forward, full backward and input-only backward on the meta
device (nothing is allocated) under ``Roofline``, a dispatch mode that counts, per
aten op, the FLOPs (``torch.utils.flop_counter``'s formulas: matmuls,
convolutions, attention kernels) and the bytes read and written (all tensor
arguments and results; view ops move nothing). The op's time is
``max(flops / (peak * compute_eff), bytes / (bandwidth * memory_eff))`` with the
``DeviceSpec`` of ``profiles/devices.json``; the block's F, B and full backward
are the sums, W = full - B.

Attention: on meta, ``scaled_dot_product_attention`` takes the math path, which
materializes and saves the ``[b, h, s, s]`` probabilities and would overstate
activation memory against the flash kernels real devices run (and FlopCounterMode
counts no FLOPs for CPU's flash kernel). ``flash_sdpa()`` therefore replaces SDPA
with a flash-attention stand-in: forward ``4*b*h*s_q*s_k*d`` FLOPs (half when
causal), backward 2.5x that (five matmuls, one of them recomputing ``QK^T``); it
saves only q, k, v, the output and the float32 log-sum-exp, like FlashAttention-2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autopart.profile.devices import DeviceSpec
from autopart.profile.measure import TimeFigures, incoming_grad
from autopart.profile.memory import tensor_bytes
from autopart.profile.tasks import BlockTask

__all__ = []

_aten = torch.ops.aten
_NO_TRAFFIC = {_aten.empty, _aten.empty_like, _aten.new_empty, _aten.empty_strided,
               _aten.new_empty_strided, _aten.detach, _aten.alias, _aten._unsafe_view,
               _aten.lift_fresh}


class Roofline(TorchDispatchMode):
    """Sums FLOPs, bytes and roofline seconds of every op, per phase."""

    def __init__(self, spec: DeviceSpec, dtype: str) -> None:
        super().__init__()
        self.spec, self.dtype = spec, dtype
        self.phase = "fwd"
        self.seconds: dict[str, float] = {}
        self.flops: dict[str, float] = {}

    def add(self, flops: float, num_bytes: float) -> None:
        """Account one op of ``flops`` FLOPs moving ``num_bytes`` bytes to the current phase."""
        self.flops[self.phase] = self.flops.get(self.phase, 0.0) + flops
        seconds = self.spec.op_time_s(flops, num_bytes, self.dtype)
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + seconds

    def ms(self, phase: str) -> float:
        """Estimated milliseconds of ``phase``."""
        return self.seconds.get(phase, 0.0) * 1e3

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.is_view or packet in _NO_TRAFFIC:
            return out
        counter = flop_registry.get(packet)
        flops = counter(*args, **kwargs, out_val=out) if counter is not None else 0
        self.add(flops, tensor_bytes((args, kwargs)) + tensor_bytes(out))
        return out


class _FlashAttention(torch.autograd.Function):
    """Shape-only stand-in for a flash-attention kernel (meta tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sink):
        out = _attention_output(q, v)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sink, ctx.flops = sink, _attention_flops(q, k, v, causal)
        if sink is not None:
            sink.add(ctx.flops, tensor_bytes((q, k, v, out, lse)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        if ctx.sink is not None:
            ctx.sink.add(2.5 * ctx.flops, tensor_bytes((q, k, v, out, lse, grad_out, grads)))
        return (*grads, None, None)


def _attention_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output, laid out ``[b, s, h, d]`` in memory like flash kernels write it."""
    if q.dim() != 4:
        return q.new_empty((*q.shape[:-1], v.shape[-1]))
    b, h, s, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)


class _FlashMode(TorchFunctionMode):
    def __init__(self, sink: Roofline | None) -> None:
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _flash_call(self.sink, *args, **kwargs)
        return func(*args, **kwargs)


def _flash_call(sink: Roofline | None, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    return _FlashAttention.apply(query, key, value, is_causal, sink)


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float:
    *batch, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    num = 1
    for dim in batch:
        num *= dim
    flops = 2.0 * num * s_q * s_k * (d + d_v)
    return flops / 2 if causal else flops


@contextlib.contextmanager
def flash_sdpa(sink: Roofline | None = None) -> Iterator[None]:
    """Within: SDPA calls on meta use the flash-attention stand-in (module docstring)."""
    with _FlashMode(sink):
        yield


def estimate_times(task: BlockTask, spec: DeviceSpec, dtype: str) -> TimeFigures:
    """Roofline F, B, W and full-backward times of a meta ``task`` on ``spec``."""
    roof = Roofline(spec, dtype)
    grad_out = incoming_grad(task)
    differentiable = task.input_grad or bool(task.trainable())
    with flash_sdpa(roof), roof:
        roof.phase = "fwd"
        out = task.forward()
        if differentiable:
            roof.phase = "bwd"
            torch.autograd.backward(out, grad_out)
        if task.input_grad:
            roof.phase = "ignore"
            out = task.forward()
            roof.phase = "bwd_input"
            torch.autograd.grad(out, task.inputs, grad_out)
    task.inputs.grad = None
    bwd = roof.ms("bwd")
    b_ms = min(roof.ms("bwd_input"), bwd)
    if task.input_grad and not task.trainable():
        b_ms = bwd
    return TimeFigures(fwd_ms=roof.ms("fwd"), bwd_ms=bwd, bwd_input_ms=b_ms,
                       bwd_weight_ms=max(bwd - b_ms, 0.0))
