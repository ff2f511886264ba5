"""The tp x pp x dp meshes a number of devices allows (``mesh_sizes``).

``autopart.solve.mesh.plan_mesh`` plans each of them; tp stays within a node, pp within
the profile's blocks, and dp x micro-batch size divides the global batch when one is given.
"""

from __future__ import annotations

from autopart.errors import PlanError

__all__ = ["mesh_sizes"]


def mesh_sizes(devices: int, node_size: int, *, tp: int | str = "auto", pp: int | str = "auto",
               dp: int | str = "auto", num_blocks: int, num_whole_blocks: int | None = None,
               batch: tuple[int | None, int] = (None, 1)) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp dividing the node, tp * pp * dp == devices.

    Args:
        devices: Devices in all.
        node_size: Devices per node.
        tp: Tensor-parallel size or ``"auto"``.
        pp: Pipeline size or ``"auto"`` (at most ``num_blocks``).
        dp: Data-parallel size or ``"auto"``.
        num_blocks: Blocks in the profile.
        num_whole_blocks: Blocks at whole layers with the head whole, what a mesh with
            tp above 1 plans (default ``num_blocks``).
        batch: ``(global_batch_size, micro_batch_size)``: when the global batch size is
            given, dp x micro_batch_size must divide it.

    Returns:
        The meshes, by tp then pp.

    Raises:
        PlanError: A fixed size does not divide the devices, tp exceeds a node, or no
            mesh is left.
    """
    global_batch_size, micro_batch_size = batch
    if devices < 1:
        raise PlanError(f"--devices must be >= 1, got {devices}")
    fixed = {"tp": tp, "pp": pp, "dp": dp}
    for name, value in fixed.items():
        if value != "auto" and (not isinstance(value, int) or value < 1 or devices % value):
            raise PlanError(f"--{name} {value} does not divide --devices {devices}; choose a "
                            f"divisor of {devices} or auto")
    if tp != "auto" and tp > node_size:
        raise PlanError(f"--tp {tp} is larger than a node ({node_size} devices); tensor "
                        f"parallelism stays within a node: use --tp {node_size} or less")
    if dp != "auto" and global_batch_size is not None and \
            global_batch_size % (dp * micro_batch_size):
        step = dp * micro_batch_size
        raise PlanError(f"--global-batch-size {global_batch_size} is not divisible by --dp "
                        f"{dp} x micro-batch size {micro_batch_size}; choose a multiple of "
                        f"{step}")
    out = []
    for t in _divisors(devices):
        for p in _divisors(devices // t):
            d = devices // (t * p)
            most = num_blocks if t == 1 else (num_whole_blocks or num_blocks)
            if node_size % t or p > most or any(
                    v != "auto" and v != x for v, x in ((tp, t), (pp, p), (dp, d))):
                continue
            if global_batch_size is not None and global_batch_size % (d * micro_batch_size):
                continue
            out.append((t, p, d))
    if not out:
        batch = "" if global_batch_size is None else \
            f", dp x {micro_batch_size} dividing {global_batch_size}"
        raise PlanError(f"no tp x pp x dp mesh of {devices} devices fits tp={tp}, pp={pp}, "
                        f"dp={dp} (tp within {node_size}, pp <= {num_blocks} blocks{batch}); "
                        f"change --devices or the fixed sizes")
    return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
