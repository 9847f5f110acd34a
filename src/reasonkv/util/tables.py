"""Rich tables of numbers that stay readable in a narrow terminal.

Rich shrinks every column of a table wider than the terminal and cuts cells with "…",
so at 80 columns a mean KL could read "0.32…" and a method "reasona…". Here the numbers'
columns keep their width and the label column (the method or run name) gives up what
the table lacks, folding its names onto more lines, down to LABEL_MIN_WIDTH.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

LABEL_MIN_WIDTH = 12
"""The label column folds down to this width and no further (a terminal narrower than
the numbers then crops the table, as rich does)."""


def fill_table(
    table: Table,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    label_style: str | None = None,
    row_styles: Sequence[str | None] | None = None,
    width: int | None = None,
) -> Table:
    """Add `columns` (the first is the label, left-aligned; the rest right-aligned numbers)
    and `rows` of plain strings (escaped here) to `table`, fitted to `width` columns (default:
    the terminal's), and return it."""
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"every row needs {len(columns)} cells ({', '.join(columns)})")
    table.add_column(columns[0], overflow="fold", style=label_style)
    for name in columns[1:]:
        table.add_column(name, justify="right", no_wrap=True)
    for k, row in enumerate(rows):
        table.add_row(*(escape(cell) for cell in row), style=None if row_styles is None else row_styles[k])
    width = Console().width if width is None else width
    wide = Console(width=100_000)
    excess = Measurement.get(wide, wide.options, table).maximum - width
    if excess > 0:
        label = max((len(row[0]) for row in rows), default=0)
        table.columns[0].max_width = max(min(label, LABEL_MIN_WIDTH), label - excess)
    return table
