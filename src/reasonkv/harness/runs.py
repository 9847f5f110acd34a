"""A run record: what a compressed generation did, saved as JSON for later plots.

Holds the method, budgets, and every compression event (layer, tokens seen, live tokens
per head after it), which is what `reasonkv plot budgets` draws.
"""

from __future__ import annotations

import math
from pathlib import Path

from reasonkv.core.cache import CompressedCache
from reasonkv.util.records import read_json_object, write_json_atomic


def record_all_events(cache: CompressedCache) -> CompressedCache:
    """Make `cache` keep every compression event (a cache keeps only the last ones by
    default); call it before the run whose record `run_record` will make."""
    cache.keep_all_events = True
    return cache


def run_record(cache: CompressedCache, **meta) -> dict:
    """JSON-ready summary of a cache after a run (batch row 0 for the per-head lengths). Every
    event is in it when the cache kept them all (`record_all_events`); otherwise the last ones,
    and `compressions` says how many there were."""
    mem = cache.memory()
    live = mem["live_tokens"]
    return {
        **meta,
        "method": cache.method,
        "budgets": cache.budgets.tolist(),
        "seen_tokens": mem["seen_tokens"],
        "kv_bytes": mem["kv_bytes"],
        "physical_bytes": mem["physical_bytes"],
        "live_tokens": None if live is None else live.tolist(),
        "compressions": cache.n_compressions,
        "events": [
            {"layer": e.layer, "seen": e.seen, "lengths": e.lengths[0].tolist()} for e in cache.events
        ],
    }


def save_run(record: dict, path: str | Path) -> Path:
    return write_json_atomic(record, path)


def load_run(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run record at {path}")
    record = read_json_object(path, "run record")
    if not isinstance(record.get("events"), list):
        raise ValueError(f"{path} is not a reasonkv run record (no compression events)")
    return record


def column_edges(steps: list[int], width: float) -> list[float]:
    """x edges of one column per compression, each centred on its step (tokens seen): columns
    meet halfway between steps; the outer ones are as wide as their neighbour's gap, or `width`
    for a layer that compressed once."""
    if len(steps) == 1:
        return [steps[0] - width / 2, steps[0] + width / 2]
    mids = [(a + b) / 2 for a, b in zip(steps, steps[1:], strict=False)]
    return [2 * steps[0] - mids[0], *mids, 2 * steps[-1] - mids[-1]]


def plot_head_budgets(record: dict, path: str | Path, layers: list[int] | None = None) -> Path:
    """Heatmaps of live tokens per KV head after each compression, one panel per layer, each
    column at its compression step (tokens seen)."""
    import numpy as np

    from reasonkv.util.plotting import pyplot, save_figure

    plt = pyplot()

    events = record["events"]
    if not events:
        raise ValueError("this run has no compression events (nothing was evicted)")
    all_layers = sorted({e["layer"] for e in events})
    layers = all_layers if layers is None else layers
    missing = sorted(set(layers) - set(all_layers))
    if missing:
        raise ValueError(f"no compression events for layer(s) {missing}; layers with events: {all_layers}")
    steps_of = {layer: [e["seen"] for e in events if e["layer"] == layer] for layer in layers}
    gaps = [b - a for steps in steps_of.values() for a, b in zip(steps, steps[1:], strict=False) if b > a]
    width = float(np.median(gaps)) if gaps else max(1.0, 0.05 * max(e["seen"] for e in events))
    fig, axes = plt.subplots(len(layers), 1, figsize=(8, 1.2 + 1.1 * len(layers)), squeeze=False, sharex=True)
    vmax = max(max(e["lengths"]) for e in events)
    lo, hi = math.inf, -math.inf
    for ax, layer in zip(axes[:, 0], layers, strict=True):
        mine = [e for e in events if e["layer"] == layer]
        grid = np.array([e["lengths"] for e in mine]).T  # [heads, events]
        x = column_edges(steps_of[layer], width)
        lo, hi = min(lo, x[0]), max(hi, x[-1])
        im = ax.pcolormesh(
            x, np.arange(grid.shape[0] + 1) - 0.5, grid, vmin=0, vmax=vmax, cmap="viridis", shading="flat"
        )
        ax.set_ylim(grid.shape[0] - 0.5, -0.5)
        ax.set_ylabel(f"L{layer}\nhead")
        ax.set_yticks(range(grid.shape[0]))
    axes[-1, 0].set_xlim(lo, hi)
    axes[-1, 0].set_xlabel("tokens seen at compression (each column centred on its step)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="tokens kept per head")
    fig.suptitle(f"head budgets over decoding: {record.get('method')} (budget {record.get('budget', '?')})")
    return save_figure(fig, path, dpi=120, bbox_inches="tight")
