"""Helpers for the solver tests: synthetic profiles and a brute-force reference."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autopart.cost.blocks import block_arrays
from autopart.schema import (
    BlockProfile,
    ModelInfo,
    Part,
    Profile,
    ProfileSetup,
    TrainingSetup,
)
from autopart.solve.chain import Chain, build_chain

MIB = 1 << 20
GIB = 1 << 30


def make_block(name: str, *, kind: str = "block", fwd_ms: float = 1.0, bwd_ms: float | None = None,
               num_params: int = 0, activation_bytes: int = 0, output_bytes: int = 0,
               transient_bytes: int = 0) -> BlockProfile:
    """A block whose backward is twice its forward unless given (B and W split evenly)."""
    bwd = 2.0 * fwd_ms if bwd_ms is None else bwd_ms
    return BlockProfile(name=name, kind=kind, fwd_ms=fwd_ms, bwd_ms=bwd,
                        bwd_input_ms=bwd / 2, bwd_weight_ms=bwd / 2,
                        param_bytes=4 * num_params, activation_bytes=activation_bytes,
                        output_bytes=output_bytes, transient_bytes=transient_bytes,
                        num_params=num_params)


def half_of(layer: str, index: int) -> tuple[Part, ...]:
    """The parts of a decoder layer's half ``index`` (0: attention, 1: MLP)."""
    return (Part(module=layer, axis="calls", index=index, count=2),)


def make_profile(blocks: Sequence[BlockProfile], name: str = "synthetic") -> Profile:
    """A profile around ``blocks`` with a fixed fingerprint."""
    return Profile(
        model=ModelInfo(name=name, fingerprint=f"fp-{name}-{len(blocks)}",
                        num_params=sum(b.num_params for b in blocks)),
        setup=ProfileSetup(backend="cpu", device_name="test", dtype="float32",
                           micro_batch_size=1, seq_len=16, torch_version="test"),
        blocks=tuple(blocks))


def llama_like(num_layers: int, *, layer_ms: float = 1.0, head_ms: float = 3.0,
               act_bytes: int = 100 * MIB, hidden_bytes: int = MIB,
               layer_params: int = 1_000_000, vocab_params: int = 4_000_000,
               head_act_bytes: int | None = None) -> Profile:
    """embedding, decoder layers, norm, head: the shape of an HF causal LM."""
    blocks = [make_block("model.embed_tokens", kind="embedding", fwd_ms=0.1,
                         num_params=vocab_params, activation_bytes=0, output_bytes=hidden_bytes)]
    blocks += [make_block(f"model.layers.{i}", kind="decoder_layer", fwd_ms=layer_ms,
                          num_params=layer_params, activation_bytes=act_bytes,
                          output_bytes=hidden_bytes) for i in range(num_layers)]
    blocks.append(make_block("model.norm", kind="norm", fwd_ms=0.02, num_params=1000,
                             activation_bytes=hidden_bytes, output_bytes=hidden_bytes))
    blocks.append(make_block("lm_head", kind="head", fwd_ms=head_ms, num_params=vocab_params,
                             activation_bytes=8 * act_bytes if head_act_bytes is None
                             else head_act_bytes, output_bytes=4))
    return make_profile(blocks, name=f"llama{num_layers}")


def chain_of(profile: Profile, setup: TrainingSetup | None = None) -> Chain:
    """The solver chain of ``profile`` (default setup: pp 1, one microbatch)."""
    setup = setup or TrainingSetup(pp_size=1, num_microbatches=1)
    return build_chain(block_arrays(profile, setup), setup)


def brute_force(chain: Chain, num_stages: int, in_flight: Sequence[int],
                limits: Sequence[float | None], weight: float,
                allow_recompute: bool = True, blocking: bool = False) -> float | None:
    """Best objective (1) over every split and recompute choice; None if none fits."""
    from autopart.solve.dp import plan_objective

    n = chain.num_blocks
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = (0, *cuts, n)
        bounds = list(itertools.pairwise(edges))
        options = (0, 1) if allow_recompute else (0,)
        for flags in itertools.product(options, repeat=num_stages):
            fits = all(lim is None or chain.stage_memory(i, j, r, k) <= lim
                       for (i, j), r, k, lim in zip(bounds, flags, in_flight, limits))
            if not fits:
                continue
            obj = plan_objective(chain, bounds, flags, weight, blocking)[0]
            best = obj if best is None or obj < best else best
    return best


def brute_force_ranks(chain: Chain, stage_ranks: Sequence[int], in_flight: Sequence[int],
                      num_microbatches: int, limit: float | None,
                      allow_recompute: bool = True) -> float | None:
    """Best ILP objective (rank sums, exact rank memory) over every split; None if none fits."""
    from autopart.solve.ilp import rank_objective

    n, num_stages = chain.num_blocks, len(stage_ranks)
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = (0, *cuts, n)
        bounds = list(itertools.pairwise(edges))
        options = (0, 1) if allow_recompute and limit is not None else (0,)
        for flags in itertools.product(options, repeat=num_stages):
            if limit is not None and rank_memory(chain, bounds, flags, stage_ranks,
                                                 in_flight) > limit:
                continue
            obj = rank_objective(chain, bounds, flags, stage_ranks, num_microbatches)
            best = obj if best is None or obj < best else best
    return best


def rank_memory(chain: Chain, bounds, flags, stage_ranks, in_flight) -> int:
    """Largest rank memory of a split: sum of stage terms + the largest transient."""
    import numpy as np

    from autopart.solve.chain import range_query

    worst = 0
    for rank in set(stage_ranks):
        total, transient = 0, 0
        for s, ((i, j), r) in enumerate(zip(bounds, flags)):
            if stage_ranks[s] != rank:
                continue
            ii, jj = np.array([i]), np.array([j])
            work = range_query(chain.transient_table[0], np.maximum, ii, jj)[0]
            if r:
                work += range_query(chain.transient_table[1], np.maximum, ii, jj)[0]
            total += chain.stage_memory(i, j, r, in_flight[s]) - int(work)
            transient = max(transient, int(work))
        worst = max(worst, total + transient)
    return worst


def check_ilp_against_brute_force(data, chain: Chain, limits: Sequence[int | None]):
    """Draw a placement (pp, v, loop/V, in-flight counts, m, limit) with hypothesis's
    ``data``, solve it with the ILP and by brute force, and assert they agree.

    Returns ``(solution, stage_ranks, in_flight, limit)`` when a plan exists, else None.
    """
    from hypothesis import strategies as st

    from autopart.schedules import stage_to_rank
    from autopart.solve import ILPLimits, solve_ilp

    pp, num_virtual = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    num_stages = pp * num_virtual
    if num_stages > chain.num_blocks:
        return None
    style = data.draw(st.sampled_from(["loop", "v"]))
    ranks = [stage_to_rank(s, pp, num_virtual, style) for s in range(num_stages)]
    in_flight = data.draw(st.lists(st.integers(1, 4), min_size=num_stages,
                                   max_size=num_stages))
    limit = data.draw(st.sampled_from(list(limits)))
    m = data.draw(st.integers(1, 8))
    expected = brute_force_ranks(chain, ranks, in_flight, m, limit)
    sol = solve_ilp(chain, stage_ranks=ranks, in_flight=in_flight, num_microbatches=m,
                    limit_bytes=limit,
                    limits=ILPLimits(data.draw(st.sampled_from(["cbc", "highs"]))))
    if expected is None:
        assert sol is None
        return None
    assert sol.status == "optimal"
    assert abs(sol.objective_ms - expected) <= 1e-6 * max(1.0, abs(expected))
    return sol, ranks, in_flight, limit
