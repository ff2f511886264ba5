"""Cut inside a decoder layer's halves, before each half's output projection, where exact.

At the ``projection`` level each half of a decoder layer (``autopart.intake.sublayer``)
whose main module ``P`` (the attention, the MLP) holds two or more parameter-holding
children is split before the last child ``C`` it calls (``o_proj``, ``down_proj``):
block one runs the half up to ``C`` (its norm, then ``P``'s own forward until it
calls ``C``: the projections and, for attention, the attention core), block two is
``C`` and the rest of ``P``. Nothing names a family: ``P``'s children are traced as
candidates (``trace_forward(..., carry=True)``) and the cut before ``C`` is kept only
when everything crossing it is ``C``'s stream (the attention output, ``act(gate) * up``)
plus values that are arguments of calls before ``P`` (the residual, the argument of
the input norm). Those ride along (``ForwardTrace.carries``) and a receiving stage
substitutes them by identity.

A half stays whole, with the reason in ``BlockChain.notes``, where ``P`` has fewer
than two such children, calls one twice or not at all, or where some value made
inside ``P`` before ``C`` (or by the model's code) is used after ``C`` starts (an MoE
router's token indices, a residual added inside ``P``).

The chain's calls become ``[..., P, C, ...]``: a stage ending before ``C`` runs
``P`` until ``C`` is called; a stage starting at ``C`` walks ``P``'s code on meta up
to ``C`` (no compute) and runs ``C`` and the rest of ``P`` for real
(``autopart.runtime.stages``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import nn

from autopart.errors import ModelSourceError
from autopart.intake.chain import BlockChain
from autopart.intake.watch import CallRecord, ForwardTrace
from autopart.schema.parts import Part

__all__ = []

Watch = Callable[[nn.Module, list[str], str], tuple[list[str], ForwardTrace]]
"""``watch(model, candidates, what)``: trace with ``carry=True``."""


def _kids(model: nn.Module, fqn: str) -> list[str]:
    return [f"{fqn}.{n}" for n, c in model.get_submodule(fqn).named_children()
            if any(True for _ in c.parameters())]


def _parent(model: nn.Module, fqns: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """The half's module with the most parameters among those with two or more
    parameter-holding children, and those children; ``None`` if there is none."""
    found = [(sum(p.numel() for p in model.get_submodule(f).parameters()), f, _kids(model, f))
             for f in fqns]
    found = [x for x in found if len(x[2]) >= 2]
    return max(found)[1:] if found else None


def _own_parameters(model: nn.Module, fqn: str) -> bool:
    """``fqn`` holds parameters of its own (attention sinks, a linear attention's decay
    ``A_log`` and ``dt_bias``): its code between its sub-modules reads them, so no
    piece of a cut inside it could own them."""
    return any(True for _ in model.get_submodule(fqn).parameters(recurse=False))


def _floating_stream(record: CallRecord) -> bool:
    """Every stream argument of the call is floating point (gradients flow back)."""
    return all("float" in part.rsplit(":", 1)[-1]
               for part in record.signature.split("|") if part.startswith("s"))


def _refusal(order: list[str], trace: ForwardTrace, parent: str, kids: list[str]
             ) -> tuple[int, str]:
    """``(index of the call of the child to cut before, "")`` or ``(-1, why not)``."""
    called = [i for i, f in enumerate(order) if f in kids]
    if sorted(order[i] for i in called) != sorted(kids):
        return -1, f"{parent}'s forward does not call each of its sub-modules once"
    if called != list(range(called[0], called[-1] + 1)):
        return -1, f"{parent}'s sub-modules are not called one after another"
    cut = called[-1]
    carried = trace.carries[cut - 1] if trace.carries else None
    if carried is None:
        return -1, (f"a value made between blocks inside {parent} (not an argument of an "
                    f"earlier block) is used after {order[cut]} starts")
    if any(c >= called[0] for c, _ in carried):
        return -1, f"a value made inside {parent} is used after {order[cut]} starts"
    if not any(s >= 0 for s in trace.calls[cut].stream):
        return -1, f"{order[cut]} receives nothing from the blocks before it"
    if not _floating_stream(trace.calls[cut]):
        return -1, f"{order[cut]} receives a tensor that is not floating point (no gradient)"
    return cut, ""


def split_inner(model: nn.Module, chain, watch: Watch, what: str):
    """``chain`` (``half``) with every half split before its output projection.

    Args:
        model: the model (parameters on meta).
        chain: its ``BlockChain`` at the ``half`` level.
        watch: traces the forward with ``carry=True``.
        what: the model's name for messages.

    Returns:
        The ``projection`` chain (each piece a part of ``P``'s call as well as of its
        layer's), or ``chain`` with a note when no half splits.
    """
    assert isinstance(chain, BlockChain) and chain.trace is not None
    parents = dict(filter(None, (_parent(model, b.fqns) for b in chain.blocks if b.layer)))
    owning = [p for p in parents if _own_parameters(model, p)]
    for p in owning:
        del parents[p]
    if owning:
        chain = replace(chain, notes=(*chain.notes, f"some halves stay whole: {owning[0]} "
                                      f"uses parameters of its own between its sub-modules"))
    if not parents:
        return replace(chain, notes=(*chain.notes, "halves stay whole: their modules hold "
                                     "fewer than two sub-modules with parameters"))
    candidates = [c for f in chain.call_fqns for c in parents.get(f, [f])]
    try:
        order, inner = watch(model, candidates, what)
    except ModelSourceError as exc:  # e.g. a half reads a sub-module's weight itself
        return replace(chain, notes=(*chain.notes, f"halves stay whole: {exc}"))
    cut_of: dict[str, int] = {}
    reasons: list[str] = []
    for parent, kids in parents.items():
        cut, why = _refusal(order, inner, parent, kids)
        if cut >= 0:
            cut_of[parent] = cut
        elif why not in reasons:
            reasons.append(why)
    if not cut_of:
        return replace(chain, notes=(*chain.notes, f"halves stay whole: {reasons[0]}"))
    return _rebuild(model, chain, order, inner, cut_of, reasons)


def _rebuild(model: nn.Module, chain, order: list[str], inner: ForwardTrace, cut_of: dict[str, int],
             reasons: list[str]):
    """The chain with a call of ``C`` after each split ``P`` and the halves in two blocks."""
    assert chain.trace is not None
    old_calls = chain.call_fqns
    fqns: list[str] = []
    records: list[CallRecord] = []
    new_of: dict[int, int] = {}  # old call index -> new
    old_at: list[int] = []  # new call index -> the old call it is (or is inside)
    for i, fqn in enumerate(old_calls):
        new_of[i] = len(fqns)
        fqns.append(fqn)
        records.append(chain.trace.calls[i])
        old_at.append(i)
        if fqn in cut_of:
            fqns.append(order[cut_of[fqn]])
            records.append(inner.calls[cut_of[fqn]])
            old_at.append(i)
    index = {f: i for i, f in enumerate(fqns)}
    safe: list[bool] = []
    carries: list[tuple[tuple[int, int], ...] | None] = []
    for k in range(len(fqns) - 1):
        if fqns[k] in cut_of:
            carried = inner.carries[cut_of[fqns[k]] - 1] or ()
            safe.append(False)
            carries.append(tuple(sorted((index[order[c]], leaf) for c, leaf in carried)))
        else:
            safe.append(chain.trace.safe_cuts[old_at[k]])
            carries.append(() if safe[-1] else None)
    trace = ForwardTrace(calls=tuple(records), safe_cuts=tuple(safe),
                         output_labelled=True, stream_reused=True, carries=tuple(carries),
                         after_last=chain.trace.after_last, logit_ops=chain.trace.logit_ops)
    blocks = []
    for block in chain.blocks:
        calls = tuple(new_of[c] for c in block.calls)
        parent = next((f for f in block.fqns if f in cut_of), None)
        if parent is None:
            blocks.append(replace(block, calls=calls))
            continue
        pos = block.fqns.index(parent)
        child = order[cut_of[parent]]
        kids = [f for f in order if f.startswith(parent + ".") and f != child]
        after = (child, *block.fqns[pos + 1:])
        piece = [(*block.parts, Part(module=parent, axis="calls", index=i, count=2))
                 for i in range(2)]
        blocks.append(replace(block, name=kids[-1], modules=(*block.fqns[:pos], *kids),
                              calls=calls[:pos + 1], parts=piece[0],
                              class_name=type(model.get_submodule(kids[-1])).__name__))
        blocks.append(replace(block, name=after[-1], modules=after if len(after) > 1 else (),
                              calls=(index[child], *calls[pos + 1:]), parts=piece[1],
                              class_name=type(model.get_submodule(after[-1])).__name__))
    notes = chain.notes + ((f"some halves stay whole: {reasons[0]}",) if reasons else ())
    return replace(chain, blocks=tuple(blocks), trace=trace, granularity="projection",
                   calls=tuple(fqns), splits=tuple((index[p], index[order[c]])
                                                   for p, c in cut_of.items()),
                   notes=notes)

