"""PNG Gantt charts of simulated timelines (matplotlib, imported lazily: ``commfuse[bench]``).

One panel per timeline; in a panel, one row per (rank, span kind), so compute, transfers,
waits and exposed communication show side by side, as in the bench's timeline PNGs.
"""

from __future__ import annotations

COLORS = {"compute": "#4c72b0", "reduce": "#64b5cd", "host": "#937860", "wait": "#8c8c8c",
          "send": "#dd8452", "recv": "#55a868", "collective": "#c44e52", "tp": "#8172b3",
          "up": "#8172b3", "dp": "#da8bc3", "world": "#c44e52", "exposed": "#c44e52"}
_ORDER = tuple(COLORS)


def write_gantt(panels, path: str, title: str = "", max_ranks: int = 8) -> None:
    """Write ``panels`` = [(name, spans)] (`commfuse.sim.Span`s, seconds) as a PNG at ``path``;
    at most ``max_ranks`` ranks per panel (the first ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_per = [_rows(spans, max_ranks) for _, spans in panels]
    heights = [max(len(r), 1) * 0.28 + 0.5 for r in rows_per]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (name, spans), rows in zip(axes[:, 0], panels, rows_per):
        t0 = min((s.start for s in spans), default=0.0)
        scale, unit = _unit(max((s.end for s in spans), default=0.0) - t0)
        for y, (rank, kind) in enumerate(rows):
            bars = [((s.start - t0) * scale, (s.end - s.start) * scale) for s in spans
                    if s.rank == rank and s.kind == kind]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolor=COLORS.get(kind, "#333333"),
                           edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(rows)), [f"r{r} {k}" for r, k in rows], fontsize=6)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=6)
        ax.set_xlabel(unit, fontsize=6)
    height = sum(heights) + 0.6
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / height if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows(spans, max_ranks: int) -> list[tuple[int, str]]:
    ranks = sorted({s.rank for s in spans})[:max_ranks]
    kinds = {(s.rank, s.kind) for s in spans if s.rank in ranks}
    return sorted(kinds, key=lambda rk: (rk[0], _ORDER.index(rk[1]) if rk[1] in _ORDER
                                         else len(_ORDER)))


def _unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"
