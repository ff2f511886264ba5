"""``PipelinedModel``: this rank's part of a model, trained by a torch pipeline schedule.

``step`` runs one forward and backward over all microbatches, then makes the
gradients whole: per-head norm gradients are summed over the tensor-parallel
group, a weight held on several pp ranks (the tied embedding, a head split
by vocabulary) summed over them, and every
gradient over the data-parallel group. Parameters and state dicts use the original
model's FQNs, so optimizers, grad clipping and checkpoints work as for the
unpipelined model; under tensor parallelism the split layers' parameters are
``DTensor``s (``autopart.runtime.tensor_parallel``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from autopart.errors import RuntimeSetupError
from autopart.runtime.aux_loss import RouterAuxLoss
from autopart.runtime.groups import Groups, all_reduce, all_reduce_grads
from autopart.runtime.loss import TokenMeanLoss
from autopart.runtime.stages import LABELS_KWARG, input_kwarg
from autopart.runtime.tensor_parallel import local_tensor, place_grads
from autopart.runtime.torch_stages import keep_inferred_shapes
from autopart.schedules import schedule_info
from autopart.schema import Plan, StagePlan

__all__ = ["PipelinedModel"]


def _split_groups(grad: torch.Tensor) -> tuple:
    """The process groups of the mesh dimensions ``grad`` is split along (none: plain); FSDP
    places a tensor-parallel shard's dp shards as ``_StridedShard``."""
    if not isinstance(grad, DTensor):
        return ()
    mesh = grad.device_mesh
    return tuple(mesh.get_group(i) for i, placement in enumerate(grad.placements)
                 if placement.is_shard() or isinstance(placement, _StridedShard))


@dataclass(slots=True)
class TiedWeight:
    """A weight held on several ranks (tied embedding/head, split head), as held on this one."""

    name: str
    """The weight's FQN in the original model."""
    param: nn.Parameter
    group: dist.ProcessGroup
    counts_in_norm: bool
    """True on the lowest holding rank: the weight is counted once in grad norms."""


class PipelinedModel:
    """This rank's stages of a pipelined model (built by ``auto_pipeline``)."""

    def __init__(self, *, module: nn.Module, stage_modules: list[nn.Module],
                 stage_plans: list[StagePlan], schedule: Any, plan: Plan, groups: Groups,
                 device: torch.device, token_loss: TokenMeanLoss | None,
                 tied: list[TiedWeight], aliases: dict[str, str],
                 pipe_stages: list[Any] | None = None,
                 tp_grad_sum: list[nn.Parameter] | None = None,
                 head_split: bool = False, fsdp: bool = False,
                 aux: RouterAuxLoss | None = None) -> None:
        self.module = module
        """This rank's blocks under their original FQNs (a pruned model tree)."""
        self.config = getattr(module, "config", None)
        """The HF config of the model (``None`` for other models)."""
        self.stage_modules = stage_modules
        self.stage_plans = stage_plans
        self.schedule = schedule
        """The ``torch.distributed.pipelining`` schedule object."""
        self.pipe_stages = list(pipe_stages or [])
        """This rank's ``PipelineStage`` objects in stage order (``autopart.verify`` times them)."""
        self.plan = plan
        self.groups = groups
        self.device = device
        self.is_first = any(s.index == 0 for s in stage_plans)
        self.is_last = any(s.index == len(plan.stages) - 1 for s in stage_plans)
        self._token_loss = token_loss
        self._tied = tied
        # one flattened all-reduce per run of weights with the same holders (a module cut
        # into slices has several): each collective costs a link latency or more
        self._tied_runs: list[tuple[dist.ProcessGroup, list[nn.Parameter]]] = []
        for shared in tied:
            if self._tied_runs and self._tied_runs[-1][0] is shared.group:
                self._tied_runs[-1][1].append(shared.param)
            else:
                self._tied_runs.append((shared.group, [shared.param]))
        self._head_split = head_split
        self._aliases = aliases
        self._tp_grad_sum = list(tp_grad_sum or [])
        self._fsdp = fsdp
        """Parameters are sharded over dp (FSDP): the schedule reduce-scatters gradients."""
        self._aux = aux
        """The router's load-balancing loss the config asks for (``autopart.runtime.aux_loss``)."""
        self._shapes_kept = False
        """The stages take the first step's shapes (``keep_inferred_shapes``)."""

    # --- training ------------------------------------------------------------------------------

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None, **kwargs: torch.Tensor | None) -> torch.Tensor | None:
        """One forward + backward of the whole batch over ``plan.num_microbatches`` microbatches.

        Call it on every rank with the same batch (``input_ids``, ``target=`` and
        ``attention_mask``/``position_ids`` keywords for HF models). ``target`` means
        what the loss says (``autopart.runtime.loss``): with the built-in
        ``CausalLMLoss`` (the default for HF causal LMs), the labels as HF takes them
        (shifted inside, -100 ignored) unless it was made with ``shift_labels=False``;
        with a custom ``loss_fn``, whatever it takes: each microbatch's slice of
        ``target`` goes to ``loss_fn(output, target)`` unchanged. Gradients
        accumulate into ``.grad`` and are then reduced over tied and data-parallel
        ranks, so call ``optimizer.zero_grad()`` before each step (gradients accumulated
        over several ``step`` calls would be reduced more than once). Returns the batch
        loss (built-in loss: token mean over the whole batch, all dp replicas; custom
        ``loss_fn``: the mean of the microbatch losses) on ranks holding the last stage,
        ``None`` elsewhere; the router's load-balancing loss is in it when the HF config asks
        for it (``output_router_logits``, ``router_aux_loss_coef > 0``; exact, at the cost
        of one forward-only pass per step, ``autopart.runtime.aux_loss``). ``losses``
        receives the per-microbatch losses on the last stage.
        """
        if (self.is_last or self._head_split) and target is None:
            raise RuntimeSetupError("step() needs target= on the ranks holding the last stage "
                                    "(every rank when the head is split); pass the labels on "
                                    "every rank")
        if self._token_loss is not None and target is not None:
            target = self._token_loss.spec.targets(target)
            if self.is_last:
                self._token_loss.num_tokens = self._count_tokens(target)
        args = tuple(self._to_device(t) for t in inputs) if self.is_first else ()
        kw = {k: self._to_device(v) for k, v in kwargs.items() if v is not None}
        # stages after the first run the model's own forward too: they get its inputs
        kw.update({input_kwarg(i): self._to_device(t) for i, t in enumerate(inputs)})
        if self._head_split:  # every shard stage picks the target logits of its rows
            kw[LABELS_KWARG] = self._to_device(target)
        mb_losses: list[torch.Tensor] = []
        last_target = self._to_device(target) if self.is_last else None
        adding = contextlib.nullcontext()
        if self._aux is not None:  # routing counts of the whole batch first (exact weights)
            self._aux.count(lambda: self._counting_pass(args, last_target, kw), self.device)
            adding = self._aux.adding()
        with adding:
            self.schedule.step(*args, target=last_target, losses=mb_losses,
                               return_outputs=False, **kw)
        if self._aux is not None and not self._shapes_kept:
            keep_inferred_shapes(self.pipe_stages)  # the pass's switches infer no more
            self._shapes_kept = True
        self._sync_grads()
        if losses is not None:
            losses.extend(mb_losses)
        if not self.is_last:
            return None
        total = torch.stack([loss.detach().float() for loss in mb_losses]).sum()
        if self._token_loss is None:
            total = total / len(mb_losses)
        if self.groups.dp_group is not None:
            all_reduce(total, self.groups.dp_group)
            if self._token_loss is None:
                total = total / self.groups.dp_size
        if self._aux is not None:
            total = total + self._aux.total.to(total.device)
        return total

    def _counting_pass(self, args: tuple, target: Any, kw: dict) -> None:
        """The schedule's forward for ``RouterAuxLoss.count``: forward-only, except under
        split-backward schedules (zero bubble, V), whose stages torch cannot switch to
        forward-only and back; there one whole step runs and its gradients are dropped
        (the gradients held before it are put back). The forward-only pass runs without
        autograd, and its outputs are let go after it: torch's stages keep every forward's
        output (the last stage's logits) until a backward takes it, which forward-only
        never runs; with their graphs the pass held all microbatches' activations at once
        (measured on a tiny Qwen2-MoE under 1F1B: 39 / 64 MiB per rank against 19 / 23 MiB
        predicted; without the graphs the last rank still held every microbatch's logits,
        32 MiB, so the last stage lets each go as soon as its loss is taken)."""
        if not schedule_info(self.plan.schedule).split_backward:
            with torch.no_grad(), _last_outputs_dropped(self.pipe_stages):
                self.schedule.eval(*args, target=target, losses=[], return_outputs=False,
                                   **kw)
            for stage in self.pipe_stages:
                stage.fwd_cache.clear()
            return
        params = self.parameters()
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.schedule.step(*args, target=target, losses=[], return_outputs=False, **kw)
        for p, grad in zip(params, held):
            p.grad = grad

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so their global 2-norm is at most ``max_norm``; return the norm.

        Each gradient's squared local part is summed over the mesh dimensions it is
        split along (tensor parallelism, FSDP's dp shards; replicated dimensions count
        it once), then over the pipeline group (a weight held on several ranks once);
        after ``step`` gradients are equal across plain dp replicas, so the norm is global.
        """
        sums: dict[tuple, torch.Tensor] = {}  # the groups to sum over -> squared sum
        for p in self._norm_params():
            if p.grad is not None:
                groups = _split_groups(p.grad)
                part = local_tensor(p.grad.detach()).float().pow(2).sum()
                sums[groups] = sums.get(groups, torch.zeros((), device=self.device)) + part
        squares = torch.zeros((), device=self.device, dtype=torch.float32)
        for groups, part in sorted(sums.items(), key=lambda kv: len(kv[0])):
            for group in groups:
                all_reduce(part, group)
            squares += part
        all_reduce(squares, self.groups.pp_group)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                local_tensor(p.grad.detach()).mul_(coef.to(p.grad.dtype))
        return total

    def _count_tokens(self, aligned: torch.Tensor) -> torch.Tensor:
        num = (aligned != self._token_loss.spec.ignore_index).sum().to(self.device)
        if self.groups.dp_group is not None:
            all_reduce(num, self.groups.dp_group)
        return num.clamp(min=1)

    def _sync_grads(self) -> None:
        params = list(self.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        place_grads(params)
        if self._tp_grad_sum and self.groups.tp_group is not None:
            all_reduce_grads(self._tp_grad_sum, self.groups.tp_group)
        for group, held in self._tied_runs:
            all_reduce_grads(held, group)
        if self.groups.dp_group is not None and not self._fsdp:
            divide = 1 if self._token_loss is not None else self.groups.dp_size
            all_reduce_grads(params, self.groups.dp_group, divide_by=divide)

    def _norm_params(self) -> list[nn.Parameter]:
        skip = {id(t.param) for t in self._tied if not t.counts_in_norm}
        return [p for p in self.parameters() if id(p) not in skip]

    def _to_device(self, value: Any) -> Any:
        return value.to(self.device) if isinstance(value, torch.Tensor) else value

    # --- parameters and state ------------------------------------------------------------------

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (each once)."""
        return list(self.module.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters with their FQNs in the original model."""
        return list(self.module.named_parameters())

    def train(self, mode: bool = True) -> PipelinedModel:
        """Set training mode on this rank's modules."""
        self.module.train(mode)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state, keyed by original FQNs."""
        return self.module.state_dict()

    def load_state_dict(self, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> list[str]:
        """Take this rank's entries of ``state_dict`` (e.g. the full model's); return missing keys.

        With ``strict`` a key this rank needs and ``state_dict`` lacks raises
        ``RuntimeSetupError``; keys of other ranks' blocks are ignored. Under tensor
        parallelism every tp rank passes the same whole tensors and keeps its shard.
        """
        picked, missing = {}, []
        for key, mine in self.module.state_dict().items():
            source = key if key in state_dict else self._aliases.get(key)
            if source is None or source not in state_dict:
                missing.append(key)
            elif isinstance(mine, DTensor):
                picked[key] = distribute_tensor(state_dict[source].to(self.device),
                                                mine.device_mesh, mine.placements,
                                                src_data_rank=None)
            else:
                picked[key] = state_dict[source]
        if strict and missing:
            raise RuntimeSetupError(f"state_dict lacks {len(missing)} key(s) this rank needs, "
                                    f"e.g. {missing[0]!r}; pass the full model's state dict "
                                    f"or strict=False")
        self.module.load_state_dict(picked, strict=False)
        return missing

    def stage_param_counts(self) -> dict[int, int]:
        """Number of parameters of each stage this rank holds (its tp shards), by stage index."""
        return {plan.index: sum(local_tensor(p).numel() for p in module.parameters())
                for plan, module in zip(self.stage_plans, self.stage_modules)}

    def debug_summary(self) -> str:
        """A few lines: this rank, its stages, their blocks and parameter counts."""
        head = (f"pp rank {self.groups.pp_rank}/{self.groups.pp_size} (dp size "
                f"{self.groups.dp_size}, tp size {self.groups.tp_size}), schedule "
                f"{self.plan.schedule}, {self.plan.num_microbatches} microbatches, device "
                f"{self.device}")
        lines = [head]
        counts = self.stage_param_counts()
        for plan, module in zip(self.stage_plans, self.stage_modules):
            blocks = f"{plan.modules[0]} .. {plan.modules[-1]}" if len(plan.modules) > 1 \
                else plan.modules[0]
            recompute = getattr(module, "_recompute", False)
            lines.append(f"  stage {plan.index}: {len(plan.modules)} block(s) {blocks}, "
                         f"{counts[plan.index]:,} params, recompute={recompute}")
        if self._tied:
            names = [shared.name for shared in self._tied]
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                            else "")
            lines.append(f"  held on several ranks, gradient summed over them: {shown}")
        return "\n".join(lines)


@contextlib.contextmanager
def _last_outputs_dropped(pipe_stages: list[Any]) -> Iterator[None]:
    """Inside, a last stage forgets each forward's output once its loss is taken.

    torch's stage keeps every forward's output and inputs (``fwd_cache``) for the backward
    that takes them; forward-only never runs it, so a whole pass's logits pile up. A stage
    that sends its output on reads it from there, so only the last stage (whose output
    goes to the loss, returned by ``forward_one_chunk``) drops it.
    """
    last = [stage for stage in pipe_stages if stage.is_last]
    # A wrapper set on the instance already (``autopart verify``'s timing) is put back.
    before = [vars(stage).get("forward_one_chunk") for stage in last]
    for stage in last:
        def forward_one_chunk(chunk_id: int, *args: Any, _stage: Any = stage,
                              _run: Any = stage.forward_one_chunk, **kwargs: Any) -> Any:
            output = _run(chunk_id, *args, **kwargs)
            _stage.fwd_cache[chunk_id] = ((), ())  # 1F1B still asks it for (no) sends
            return output
        stage.forward_one_chunk = forward_one_chunk
    try:
        yield
    finally:
        for stage, wrapper in zip(last, before, strict=True):
            if wrapper is None:
                del stage.forward_one_chunk  # the class's method again
            else:
                stage.forward_one_chunk = wrapper
