"""The chain of blocks intake finds: each ``Block`` and the ``BlockChain`` in call order.

The types only, apart from discovery (``autopart.intake.blocks``) so that the modules
that refine a chain (``autopart.intake.sublayer``, ``autopart.intake.inner``) and its
readers import them without importing discovery.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.intake.watch import CallRecord, ForwardTrace
from autopart.schema.parts import Part

__all__ = ["Block", "BlockChain"]


@dataclass(frozen=True, slots=True)
class Block:
    """One unit the profiler measures and the solver places."""

    name: str
    """FQN of the last module of the block (the block's name in plans and cuts)."""
    kind: str
    """``embedding``, ``decoder_layer``, ``attention``, ``mlp``, ``norm``, ``head`` or ``block``."""
    class_name: str
    modules: tuple[str, ...] = ()
    """Every module FQN of the block in call order (several when calls were fused)."""
    calls: tuple[int, ...] = ()
    """Indices of the block's calls in ``BlockChain.trace.calls``."""
    parts: tuple[Part, ...] = ()
    """The module calls this block is a part of, outermost first (``autopart.schema.parts``)."""

    @property
    def fqns(self) -> tuple[str, ...]:
        """The block's module FQNs (``modules``, or just ``name``)."""
        return self.modules or (self.name,)

    @property
    def layer(self) -> str:
        """FQN of the decoder layer this block is a part of (empty for other blocks)."""
        return self.parts[0].module if self.parts else ""


@dataclass(frozen=True, slots=True)
class BlockChain:
    """The blocks of a model in execution order, and how its forward calls them."""

    blocks: tuple[Block, ...]
    family: str
    """``hf_causal_lm`` for HF causal LMs, ``sequential`` for ``nn.Sequential``, else ``traced``."""
    tied_embeddings: bool
    """Two blocks share a parameter (input embedding and output head)."""
    fingerprint: str
    layer_class_names: tuple[str, ...] = ()
    """Class names of the repeated layers (what NxD calls ``transformer_layer_cls``)."""
    shared_modules: tuple[str, ...] = ()
    """Parameter-free modules outside the blocks that the forward runs on every stage."""
    trace: ForwardTrace | None = None
    """The watched forward: every block call with its stream and context arguments."""
    granularity: str = "layer"
    """The level found (``DISCOVERY_LEVELS``): ``half`` when decoder layers are split into
    halves, ``projection`` when halves are split before their output projection too
    (``autopart.intake.inner``), else ``layer``."""
    notes: tuple[str, ...] = ()
    """Why a finer granularity was asked for and layers or halves stay whole, if they do."""
    calls: tuple[str, ...] = ()
    """Module FQNs the forward calls, in order, where they differ from the blocks' modules
    (``projection``: a half's module ``P`` is called, its output projection ``C`` too)."""
    splits: tuple[tuple[int, int], ...] = ()
    """``(call of P, call of C)`` for every half split before ``C`` (``projection``)."""

    @property
    def names(self) -> list[str]:
        """Block names in order."""
        return [b.name for b in self.blocks]

    @property
    def call_fqns(self) -> list[str]:
        """Module FQNs in the order the forward calls them."""
        return list(self.calls) or [fqn for b in self.blocks for fqn in b.fqns]

    def call(self, idx: int) -> CallRecord:
        """The record of call ``idx``."""
        assert self.trace is not None
        return self.trace.calls[idx]
