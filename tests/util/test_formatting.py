"""Sizes as people write them (`parse_bytes`) and as they read them (`format_bytes`)."""

from __future__ import annotations

import pytest

from reasonkv.util.formatting import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("4096", 4096),
        ("4096B", 4096),
        ("64KiB", 65536),
        ("3kb", 3000),
        (" 2 gib ", 2 * 1024**3),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("1.0001KB", 1000),  # a fraction of a byte is rounded down
        ("1TiB", 1024**4),
        ("123456789012345678901234567890", 123456789012345678901234567890),  # exact, no float
    ],
)
def test_parse_bytes_reads_units_and_plain_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a size like 2GiB"),
        ("lots", "expected a size like 2GiB"),
        ("2G", "expected a size like 2GiB"),  # an ambiguous unit is refused, not guessed
        ("2 GiB 3", "expected a size like 2GiB"),
        ("-1MiB", "expected a size like 2GiB"),
        ("1e9", "expected a size like 2GiB"),
        ("1,5GB", "expected a size like 2GiB"),
        ("inf", "expected a size like 2GiB"),
        ("0", "at least one byte"),
        ("0.4B", "at least one byte"),
    ],
)
def test_parse_bytes_refuses_anything_else_and_repeats_the_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_bytes(text)
    assert repr(text) in str(err.value)


def test_a_parsed_size_formats_back() -> None:
    assert format_bytes(parse_bytes("512MiB")) == "512.0 MiB"
    assert format_bytes(parse_bytes("2GiB")) == "2.0 GiB"
