"""fill_table: in a narrow terminal the label folds and no number is cut."""

from __future__ import annotations

import pytest
from rich import box
from rich.console import Console
from rich.table import Table

from reasonkv.util.tables import fill_table


def render(table: Table, width: int) -> str:
    console = Console(width=width, record=True)
    console.print(table)
    return console.export_text()


@pytest.mark.parametrize("width", [70, 80])
def test_numbers_stay_whole_and_labels_fold(width) -> None:
    columns = ("method", "budget", "mean KL", "top-1", "ppl ratio", "live/head", "seconds")
    rows = [["reasonalloc-layer-rkv[tau=4.0]", "512", "0.078412", "0.914", "1.104", "524", "1631.2"]]
    table = Table(box=box.SIMPLE_HEAD) if width == 70 else Table()
    text = render(fill_table(table, columns, rows, width=width), width)
    assert "…" not in text
    for cell in columns[1:] + tuple(rows[0][1:]):
        assert cell in text
    if width == 80:  # room for the label's floor: it folds at 12 or more
        assert "reasonalloc-" in text and "method" in text
    assert max(len(line) for line in text.splitlines()) <= width


def test_a_wide_terminal_folds_nothing() -> None:
    rows = [["reasonalloc-layer-rkv[tau=4.0]", "0.078412"]]
    text = render(fill_table(Table(), ("method", "mean KL"), rows, width=120), 120)
    assert "reasonalloc-layer-rkv[tau=4.0]" in text


def test_markup_in_a_cell_is_printed_as_text() -> None:
    text = render(fill_table(Table(), ("run", "n"), [["[bold]x[/bold]", "1"]]), 80)
    assert "[bold]x[/bold]" in text


def test_a_row_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        fill_table(Table(), ("run", "n"), [["a", "1", "2"]])
