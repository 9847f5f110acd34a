"""Rich tables of numbers that stay readable at 80 columns.

Rich shrinks every column of a table wider than the terminal and cuts cells with "…",
so at 80 columns a mean KL could read "0.32…" and a method "reasona…". Here numbers are
never cut. When the table is too wide, in this order:

1. the columns the caller marked optional go, least needed first, and the caption says
   which (whoever needs them has the JSON or Markdown output);
2. the label column (method or run name) narrows down to LABEL_MIN_WIDTH, its names broken
   after ':', then '-', '@' or '=' rather than mid-word;
3. what still does not fit goes to a second table below the first, labels repeated.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence

from rich.console import Console, Group
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

LABEL_MIN_WIDTH = 12
"""The label column narrows to this width and no further."""


BREAKS = (r"(?<=[:, ])", r"(?<=[-@=])")
"""Where a label may break, coarsest first: after ':' (a method from its knobs: "snapkv:" /
"kv_bits=4:"), ',' or a space; then, inside a piece still too wide, after '-', '@' or '='."""


def _pieces(text: str, width: int, level: int = 0) -> list[str]:
    if len(text) <= width or level == len(BREAKS):
        return [text]
    return [q for p in re.split(BREAKS[level], text) if p for q in _pieces(p, width, level + 1)]


def wrap_label(text: str, width: int) -> str:
    """`text` broken into lines of at most `width` where BREAKS allow (a knob's key=value stays
    whole where it fits), mid-word only for a piece longer than `width`."""
    if len(text) <= width:
        return text
    pieces = _pieces(text, width)
    lines, line = [], ""
    for piece in pieces:
        while len(piece) > width:  # one piece longer than the column: cut it
            if line:
                lines.append(line)
                line = ""
            lines.append(piece[:width])
            piece = piece[width:]
        if len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        line += piece
    lines.append(line)
    return "\n".join(part.rstrip() for part in lines if part)


def _shell(template: Table) -> Table:
    """An empty table drawn like `template` (box, padding, edges), without title or caption."""
    shell = copy.copy(template)
    shell.columns, shell.rows, shell.title, shell.caption = [], [], None, None
    return shell


def _add(
    table: Table,
    names: Sequence[str],
    rows: Sequence[Sequence[str]],
    label_width: int,
    label_style: str | None = None,
    row_styles: Sequence[str | None] | None = None,
) -> Table:
    table.add_column(names[0], style=label_style, max_width=label_width, overflow="fold")
    for name in names[1:]:
        table.add_column(name, justify="right", no_wrap=True)
    for k, row in enumerate(rows):
        style = None if row_styles is None else row_styles[k]
        table.add_row(escape(wrap_label(row[0], label_width)), *(escape(c) for c in row[1:]), style=style)
    return table


def _width(template: Table, names: Sequence[str], rows: Sequence[Sequence[str]], label_width: int) -> int:
    """The columns a table like `template` with these cells needs."""
    wide = Console(width=100_000)
    table = _add(_shell(template), names, rows, label_width)
    return Measurement.get(wide, wide.options, table).maximum


def _fits(template: Table, names, cells, keep: list[int], label_width: int, width: int) -> bool:
    return _width(template, [names[i] for i in keep], _take(cells, keep), label_width) <= width


def _take(rows: Sequence[Sequence[str]], keep: Sequence[int]) -> list[list[str]]:
    return [[row[i] for i in keep] for row in rows]


def fill_table(
    table: Table,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    label_style: str | None = None,
    row_styles: Sequence[str | None] | None = None,
    width: int | None = None,
    optional: Sequence[str] = (),
) -> Table | Group:
    """Add `columns` (the first is the label, left-aligned; the rest right-aligned numbers)
    and `rows` of plain strings (escaped here) to `table`, fitted to `width` columns (default:
    the terminal's) as the module docstring says; `optional` names the columns that may go,
    least needed first. Returns what to print: `table`, or a Group of `table` and the further
    tables it needed."""
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"every row needs {len(columns)} cells ({', '.join(columns)})")
    width = Console().width if width is None else width
    label = max([len(columns[0])] + [len(row[0]) for row in rows])
    narrowest = min(label, LABEL_MIN_WIDTH)
    keep = list(range(len(columns)))
    hidden = []
    for name in optional:
        if _width(table, [columns[i] for i in keep], _take(rows, keep), narrowest) <= width:
            break
        if name in columns[1:] and columns.index(name) in keep:
            keep.remove(columns.index(name))
            hidden.append(name)
    if hidden:
        note = f"{', '.join(hidden)}: left out at {width} columns"
        table.caption = f"{table.caption} ({note})" if table.caption else note
    names, cells = [columns[i] for i in keep], _take(rows, keep)
    excess = _width(table, names, cells, label) - width
    label_width = label if excess <= 0 else max(narrowest, label - excess)
    # Numbers are never cut: the columns that do not fit beside the label go to the next table.
    parts: list[list[int]] = []
    todo = list(range(1, len(names)))
    while todo:
        part = [todo.pop(0)]  # at least one number a table
        while todo and _fits(table, names, cells, [0] + part + todo[:1], label_width, width):
            part.append(todo.pop(0))
        parts.append(part)
    tables = [table] + [_shell(table) for _ in parts[1:]]
    for target, part in zip(tables, parts or [[]], strict=True):
        _add(
            target,
            [names[0]] + [names[i] for i in part],
            _take(cells, [0] + part),
            label_width,
            label_style,
            row_styles,
        )
    return table if len(tables) == 1 else Group(*tables)
