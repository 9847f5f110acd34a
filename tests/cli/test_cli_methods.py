"""`reasonkv methods`: each method once with only its own knobs, the storage and protection
knobs once for all of them, the presets with their numbers; at any width no line is wider than
the terminal. `--markdown` is docs/methods.md, which must not drift from the registry."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cli_helpers import runner
from reasonkv.cli import main as cli
from reasonkv.cli import methods_list
from reasonkv.core.quantize import KVFormat
from reasonkv.methods.presets import PRESETS
from reasonkv.methods.registry import METHODS, PROTECTION_KNOBS

DOC = Path(__file__).resolve().parents[2] / "docs" / "methods.md"
STORAGE = [f.name for f in dataclasses.fields(KVFormat) if f.init]


def methods_output(width: int) -> str:
    result = runner.invoke(cli.app, ["methods"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    return result.output


def _split(text: str, heading: str) -> tuple[str, str]:
    """The output before the first line that starts the shared knobs, and from there on."""
    at = text.index(heading)
    return text[:at], text[at:]


@pytest.mark.parametrize("width", [80, 200])
def test_methods_lists_each_method_once_and_the_shared_knobs_once(width: int) -> None:
    text = methods_output(width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    if width < methods_list.TABLE_WIDTH:  # blocks: a method's first line is "name: description"
        heads = [line.split(": ", 1)[0] for line in lines if not line.startswith(" ") and ": " in line]
        assert [h for h in heads if h in METHODS] == list(METHODS)
        methods_part, shared_part = _split(text, "Storage knobs")
    else:  # a table: a method's first row starts with its name
        heads = [m.group(1) for line in lines if (m := re.match(r"│ (\S+) +│", line))]
        assert [h for h in heads if h in METHODS] == list(METHODS)
        methods_part, shared_part = _split(text, "Knobs every method shares")
    flat = " ".join(shared_part[: shared_part.index("Presets")].split())  # the presets set some too
    defaults = KVFormat()
    for name in STORAGE:  # once in all: its entry in the shared part, with its default and range
        entry = f"{name}={getattr(defaults, name)}"
        assert len(re.findall(rf"(?<![\w=]){re.escape(entry)}(?![\w.])", flat)) == 1, entry
    for name in STORAGE:  # the methods say only the storage they set themselves (quant-int*'s bits)
        if name != "kv_bits":
            assert f"{name}=" not in methods_part, name
    assert set(re.findall(r"kv_bits=\d+", methods_part)) == {"kv_bits=8", "kv_bits=4", "kv_bits=2"}
    for name, what in PROTECTION_KNOBS.items():  # once, with what it does
        assert len(re.findall(rf"\b{name}\b", flat)) == 1 and what in flat, name
    assert "n_sink (>=0)" in flat


@pytest.mark.parametrize("width", [80, 200])
def test_methods_lists_the_presets_with_their_numbers_and_traces(width: int) -> None:
    text = methods_output(width)
    presets_part = " ".join(text[text.index("Presets") :].split())
    for name, preset in PRESETS.items():
        assert name in presets_part
        for number in re.findall(r"\d+\.\d+", preset.measured):
            assert number in presets_part, (name, number)
        assert "mip-math500-12.jsonl" in presets_part and preset.records in presets_part
    assert "kv_bits=4" in presets_part and "fraction=0.0625" in presets_part


def test_own_knobs_leave_out_the_shared_ones() -> None:
    for spec in METHODS.values():
        own = methods_list.own_knobs(spec)
        assert not set(own) & (set(STORAGE) | set(PROTECTION_KNOBS))
        assert set(own) | set(STORAGE) | set(PROTECTION_KNOBS) >= set(spec.knobs()) or not spec.compresses
    assert methods_list.set_knobs(METHODS["quant-int4"]) == {"kv_bits": 4}
    assert methods_list.set_knobs(METHODS["rpc"]) == {"n_sink": 0, "n_recent": 32, "protect_prompt": True}


def test_the_markdown_page_is_the_registry_and_does_not_drift() -> None:
    result = runner.invoke(cli.app, ["methods", "--markdown"])
    assert result.exit_code == 0
    assert result.stdout == methods_list.methods_markdown()
    assert DOC.read_text(encoding="utf-8") == result.stdout, (
        "docs/methods.md differs from the registry: regenerate it with "
        "`reasonkv methods --markdown > docs/methods.md`"
    )


def test_the_markdown_has_a_row_per_method_per_shared_knob_and_per_preset() -> None:
    text = methods_list.methods_markdown()
    methods, rest = text.split("\n## Storage knobs", 1)
    rows = [line for line in methods.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(METHODS)
    shared, presets = rest.split("\n## Presets", 1)
    knob_rows = [line.split("`")[1].split("=")[0] for line in shared.splitlines() if line.startswith("| `")]
    assert knob_rows == [*STORAGE, *PROTECTION_KNOBS]
    preset_rows = [line.split("`")[1] for line in presets.splitlines() if line.startswith("| `")]
    assert preset_rows == list(PRESETS)
    assert "(results.md#quantize-evict-or-both)" in presets


def test_a_knob_two_parts_read_shows_one_range_the_tightest() -> None:
    """PyramidKV's window is read by its scorer (>= 1) and its allocator (>= 0): >= 1 holds."""
    from reasonkv.cli.methods_list import compact_rule
    from reasonkv.methods.registry import get_method

    assert compact_rule(get_method("pyramidkv"), "window") == "(>=1)"
    assert compact_rule(get_method("snapkv"), "kernel") == "[1,1024]"
