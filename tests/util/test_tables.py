"""fill_table: in a narrow terminal the label folds and no number is cut."""

from __future__ import annotations

import pytest
from rich import box
from rich.console import Console
from rich.table import Table

from reasonkv.util.tables import fill_table, wrap_label


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


# ------------------------------------------------------------ 80 columns, and 200
WIDE_COLUMNS = ("method", "budget", "tok/s first", "tok/s last", "× full", "KV", "× full ", "peak KV")
WIDE_COLUMNS += ("RSS Δ", "score+select", "vs snapkv", "top-1")
WIDE_ROWS = [
    ["reasonalloc-layer-rkv", "512", "41.3", "38.9", "0.93", "25.1 MiB", "0.245", "27.9 MiB", "3.1 MiB"]
    + ["7.4%", "+2.1%", "0.912"],
    ["full", "-", "44.6", "41.7", "1.00", "102.4 MiB", "1.000", "102.4 MiB", "98.2 MiB"]
    + ["0.0%", "-", "1.000"],
]


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_a_wide_table_at_80_columns_splits_and_cuts_nothing() -> None:
    text = render(fill_table(Table(), WIDE_COLUMNS, WIDE_ROWS, width=80), 80)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for cell in [c.strip() for c in WIDE_COLUMNS[1:]] + [c for row in WIDE_ROWS for c in row[1:]]:
        assert cell in text, cell
    # The label breaks after a hyphen, never mid-word, and repeats in the second table.
    tables = sum("method" in line for line in lines_of(text))
    assert tables >= 2 and text.count("reasonalloc-") == tables and text.count("layer-rkv") == tables


def test_optional_columns_go_first_and_the_caption_says_so() -> None:
    optional = ("tok/s first", "× full ", "RSS Δ", "vs snapkv", "top-1", "score+select")
    table = Table(caption="speeds")
    text = render(fill_table(table, WIDE_COLUMNS, WIDE_ROWS, width=80, optional=optional), 80)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    caption = " ".join(text.split("speeds")[1].split())  # the caption, its line breaks undone
    assert "left out at 80 columns" in caption and "tok/s first" in caption
    assert "102.4 MiB" in text and "tok/s last" in text
    assert sum("method" in line for line in lines_of(text)) == 1  # one table: no split needed


def test_at_200_columns_nothing_is_left_out_or_split() -> None:
    optional = ("tok/s first", "RSS Δ")
    text = render(fill_table(Table(), WIDE_COLUMNS, WIDE_ROWS, width=200, optional=optional), 200)
    assert "left out" not in text and "reasonalloc-layer-rkv" in text
    assert sum("method" in line for line in lines_of(text)) == 1
    assert all(cell in text for row in WIDE_ROWS for cell in row)


@pytest.mark.parametrize(
    ("text", "width", "expected"),
    [
        ("reasonalloc-layer-rkv", 12, "reasonalloc-\nlayer-rkv"),
        ("beaconkv@128", 9, "beaconkv@\n128"),
        ("snapkv[window=16]", 40, "snapkv[window=16]"),
        ("abcdefghijklmnop", 6, "abcdef\nghijkl\nmnop"),
    ],
)
def test_wrap_label_breaks_after_separators(text, width, expected) -> None:
    assert wrap_label(text, width) == expected
