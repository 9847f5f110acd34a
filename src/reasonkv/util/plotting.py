"""Matplotlib without a display: one place that picks the backend and saves figures."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """`matplotlib.pyplot` on the Agg backend (files only; it works with no display).
    Imported on first use, so commands that draw nothing never load matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 130, **savefig_kwargs) -> Path:
    """Write `fig` to `path` (folders created), close it, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, **savefig_kwargs)
    pyplot().close(fig)
    return path
