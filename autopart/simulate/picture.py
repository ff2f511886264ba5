"""Draw a step as a PNG: one row per rank, F / B / W coloured, each box labelled with its stage.

``save_timeline_png`` draws one or more panels one above the other on a shared time
axis (``autopart verify --png``: measured above predicted). It needs matplotlib, an
optional extra (``pip install 'autopart[plot]'``); without it a ``PlotError`` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from autopart.errors import AutopartError
from autopart.simulate.engine import SimEvent

__all__ = ["require_matplotlib", "save_timeline_png"]

COLORS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B", "WAIT": "#D0D0D0"}
"""Fill colour per action kind (a full backward is drawn as ``B``)."""
_KIND = {"F": "F", "LOSS": "F", "B": "B", "BW": "B", "W": "W", "WAIT": "WAIT"}


class PlotError(AutopartError):
    """The picture cannot be drawn (matplotlib missing)."""


def save_timeline_png(panels: Sequence[tuple[str, Sequence[SimEvent]]], path: str | Path, *,
                      num_ranks: int) -> Path:
    """Draw each panel's events as rows of boxes (rank 0 on top) and write a PNG.

    Args:
        panels: ``(title, events)`` per panel, drawn top to bottom on one time axis.
            Events of kind ``SEND`` are left out; ``LOSS`` is drawn as ``F`` and ``BW``
            (a full backward) as ``B``; ``WAIT`` in grey.
        path: The PNG to write (its folder is created).
        num_ranks: Rows per panel.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        PlotError: matplotlib is not installed (one line with the install command).
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    height = 0.6 + 0.45 * num_ranks
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(12, height * len(panels) + 0.6))
    end = max((e.end_ms for _, events in panels for e in events), default=1.0)
    for ax, (title, events) in zip(axes[:, 0], panels):
        _draw_panel(ax, title, events, num_ranks, end)
    axes[-1, 0].set_xlabel("ms from the start of the step")
    handles = [Patch(color=c, label=k if k != "WAIT" else "p2p wait")
               for k, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _draw_panel(ax, title: str, events: Sequence[SimEvent], num_ranks: int,
                end: float) -> None:
    """One panel: a row of boxes per rank, labelled ``s<stage>`` where they are wide enough."""
    for e in events:
        kind = _KIND.get(e.kind)
        if kind is None:
            continue
        width = e.end_ms - e.start_ms
        ax.barh(e.rank, width, left=e.start_ms, height=0.8, color=COLORS[kind],
                edgecolor="white", linewidth=0.4)
        if kind != "WAIT" and width > end / 60:
            ax.text(e.start_ms + width / 2, e.rank, f"s{e.stage_idx}", ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.set_ylim(num_ranks - 0.5, -0.5)
    ax.set_xlim(0, end * 1.01)
    ax.set_title(title, fontsize=9, loc="left")


def require_matplotlib() -> None:
    """Raise ``PlotError`` (one line with the install command) unless matplotlib imports."""
    _pyplot()


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or a one-line ``PlotError``."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("drawing a PNG needs matplotlib, which is not installed; run "
                        "`pip install 'autopart[plot]'` (or `pip install matplotlib`)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
