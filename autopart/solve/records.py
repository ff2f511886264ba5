"""The search's records: what to search (``Options``), where (``Config``), a split simulated
(``Evaluated``), what was found (``Candidate``)."""

from __future__ import annotations

from dataclasses import dataclass

from autopart.cost.stage import StageCost
from autopart.schema import SolverInfo
from autopart.simulate import SimResult

__all__ = []


@dataclass(frozen=True, slots=True)
class Evaluated:
    """A split under one schedule, simulated."""

    schedule: str
    pp_size: int
    virtual_stages: int
    num_microbatches: int
    bounds: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    stage_costs: tuple[StageCost, ...]
    result: SimResult
    fits: bool

    @property
    def peak_memory_bytes(self) -> int:
        """Largest simulated rank peak."""
        return max(self.result.rank_peak_memory_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """How ``make_plan`` searches, fixed for a whole search (checked by ``make_plan``)."""

    partition: str = "optimal"
    """``optimal`` (the solvers, then the local search), a baseline name (``even``,
    ``params``, ``torchtitan``): that split only, or ``cuts``: the split in ``cuts``."""
    solver: str = "auto"
    """``dp``, ``ilp`` or ``auto`` (the DP, plus the ILP for small multi-stage problems)."""
    allow_recompute: bool = True
    """Let a stage recompute its forward (activation checkpointing) to fit memory."""
    ilp_backend: str = "auto"
    """``auto`` (HiGHS when installed, else CBC), ``highs`` or ``cbc``."""
    ilp_max_nodes: int = 2_000
    """Branch-and-bound nodes one ILP solve may explore (work, not time: plans do not
    depend on the machine)."""
    ilp_time_limit_s: float | None = None
    """An optional wall-clock limit of one ILP solve (plans it cuts off depend on the
    machine's speed)."""
    refine_evals: int = 300
    """Simulations the local search may spend per refined candidate (0: no local search)."""
    cuts: tuple[tuple[int, int], ...] | None = None
    """A split the user gave (``partition="cuts"``): evaluated as is under every config."""
    baseline_seeds: bool = True
    """Simulate the public baselines' splits as candidates too (off in the mesh search's
    scan, which only ranks meshes)."""


@dataclass(frozen=True, slots=True)
class Config:
    """One point of the search grid: a schedule with its pp, v and m."""

    schedule: str
    """The schedule's CLI name (``autopart.schedules.SCHEDULES``)."""
    pp_size: int
    """Pipeline ranks."""
    virtual_stages: int
    """Stages per rank."""
    num_microbatches: int
    """Microbatches per step."""

    @property
    def num_stages(self) -> int:
        """``pp_size * virtual_stages``."""
        return self.pp_size * self.virtual_stages

    @property
    def label(self) -> str:
        """Short text for progress lines and messages."""
        return f"{self.schedule} v={self.virtual_stages} m={self.num_microbatches}"

    @classmethod
    def of(cls, ev: Evaluated) -> Config:
        """The configuration a simulated split was evaluated under."""
        return cls(ev.schedule, ev.pp_size, ev.virtual_stages, ev.num_microbatches)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A split some method proposed, simulated, with the record of how it was found."""

    evaluated: Evaluated
    """The split under its configuration, with its simulated step and memory."""
    solver: SolverInfo
    """Which method proposed it (``Plan.solver`` when it wins)."""
