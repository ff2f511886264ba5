"""The cost model: pure functions from block costs and a training setup to times and bytes.

Nothing here knows about schedules or solvers; the simulator and the solvers call it.

- ``autopart.cost.blocks``: a profile's per-block figures as arrays with prefix sums
  (``BlockArrays``), and the per-block rules (static bytes per parameter, checkpointing).
- ``autopart.cost.stage``: one stage from its blocks (time, memory, comm; ``StageCost``),
  in O(1) per candidate stage.
- ``autopart.cost.rank``: what only a rank or a step adds (a rank holding several stages,
  receive buffers, fixed per-step work, the gradient sum of modules held on several ranks).
- ``autopart.cost.held``: modules held whole on several stages (a tied weight, head shards,
  slices), one cost for all of them.
- ``autopart.cost.mesh``: tensor- and data-parallel costs (a profile sharded for TP, ring
  collective times).
"""
