"""`reasonkv plot`: figures from saved runs (`generate --record`) and profiles (`profile`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from reasonkv.cli.common import console, fail
from reasonkv.harness.profile import plot_wave
from reasonkv.harness.runs import load_run, plot_head_budgets
from reasonkv.methods.profiles import load_profile

plot_app = typer.Typer(help="Draw figures from saved runs and profiles.", no_args_is_help=True)


def _parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"--layers takes comma-separated layer numbers, got {text!r}")


@plot_app.command("budgets")
def plot_budgets_command(
    run: Annotated[Path, typer.Argument(help="A run saved by `reasonkv generate --record`.")],
    out: Annotated[Path, typer.Option("--out", help="PNG to write.")] = Path("budgets.png"),
    layers: Annotated[str | None, typer.Option("--layers", help="e.g. 0,5,29 (default: all).")] = None,
) -> None:
    """Heatmap of per-head budgets over decoding steps, one panel per layer."""
    try:
        path = plot_head_budgets(load_run(run), out, _parse_layers(layers))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    console.print(f"head budgets -> {path}")


@plot_app.command("wave")
def plot_wave_command(
    profile: Annotated[Path, typer.Argument(help="A profile JSON from `reasonkv profile`.")],
    out: Annotated[Path, typer.Option("--out", help="PNG to write.")] = Path("wave.png"),
) -> None:
    """The Reasoning Wave of a profile: per-layer demand with its spread across traces."""
    try:
        path = plot_wave(load_profile(profile), out)
    except (ValueError, FileNotFoundError, KeyError) as err:
        fail(str(err))
    console.print(f"Reasoning Wave -> {path}")
