"""What `reasonkv methods` prints, from the registry: each method with only its own knobs, then
the storage and protection knobs every method shares (listed once), then the presets with the
numbers they were chosen on. Three renderings: a table (wide terminals), blocks (narrow ones)
and Markdown (`--markdown`: the methods page under docs/ is its output)."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterator

from rich.markup import escape
from rich.table import Table

from reasonkv.cli.common import console
from reasonkv.core.policy.knob import MAX_TOKENS, Bounds
from reasonkv.core.quantize import STORAGE_KNOBS, KVFormat
from reasonkv.methods.knobs import knob_bounds, literal_choices
from reasonkv.methods.presets import PRESETS, Preset
from reasonkv.methods.registry import METHODS, PROTECTION_KNOBS, MethodSpec

TABLE_WIDTH = 110
"""Below this many columns a table would fold knob names mid-word: blocks instead."""

STORAGE_HEADING = "Storage knobs (every method, `full` included; --set key=value)"
PROTECTION_HEADING = "Protection knobs (every compressing method; defaults are the method's, above)"
PRESETS_HEADING = "Presets (use as a method name: --method NAME; your --set knobs override the preset's)"


def describe_schedule(spec: MethodSpec) -> str:
    """The schedule with this method's defaults, e.g. 'buffer(every 128)'."""
    sched = spec.schedule
    if isinstance(sched, type):
        names = {f.name for f in dataclasses.fields(sched) if f.init and f.name != "name"}
        sched = sched(**{k: v for k, v in spec.knobs().items() if k in names})
    return sched.describe()


def compact_rule(spec: MethodSpec, name: str) -> str:
    """A knob's choices or range in a few characters: '{max|avg}', '[0, 1]', '>=1' ('' for a bool)."""
    choices = literal_choices(spec, name)
    if choices is not None:
        return "{" + "|".join(map(str, choices)) + "}"
    # A knob two parts read (PyramidKV's window: the scorer's >= 1, the allocator's >= 0) must
    # satisfy both: one range, the tightest of each bound.
    tightest: dict[str, float] = {}
    for bounds in knob_bounds(spec, name):
        for side, pick in (("ge", max), ("gt", max), ("le", min), ("lt", min)):
            value = getattr(bounds, side)
            if value is not None:
                tightest[side] = value if side not in tightest else pick(tightest[side], value)
    if tightest.get("le") == MAX_TOKENS:  # a token count: its upper bound is only a sanity limit
        del tightest["le"]
    rule = Bounds(**tightest).describe().replace(" ", "")
    return "" if rule == "anyvalue" else rule[2:] if rule.startswith("in") else f"({rule})"


def _storage_defaults() -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(KVFormat) if f.init}


def own_knobs(spec: MethodSpec) -> dict[str, object]:
    """The knobs of the method's own parts (scorer, schedule, allocators) with its defaults.
    None for a method that never compresses: they would change nothing (sweeps drop them)."""
    if not spec.compresses:
        return {}
    shared = set(_storage_defaults()) | set(PROTECTION_KNOBS)
    return {k: v for k, v in spec.knobs().items() if k not in shared}


def set_knobs(spec: MethodSpec) -> dict[str, object]:
    """The shared knobs the method gives its own value: its protection (where it compresses)
    and any storage knob off the storage default (quant-int4's kv_bits=4)."""
    knobs = spec.knobs()
    storage = _storage_defaults()
    out = {k: knobs[k] for k in PROTECTION_KNOBS if spec.compresses and (k != "protect_prompt" or knobs[k])}
    out.update((k, knobs[k]) for k, default in storage.items() if knobs[k] != default)
    return out


def knob_entries(spec: MethodSpec) -> list[str]:
    """'fraction=0.125 (0,1)', one per own knob, then 'n_sink=4' per shared knob it sets: the
    units a line break must not split."""
    own = [f"{k}={v} {compact_rule(spec, k)}".strip() for k, v in own_knobs(spec).items()]
    return own + [f"{k}={v}" for k, v in set_knobs(spec).items()]


def shared_entries() -> Iterator[tuple[str, str, str]]:
    """(heading, 'kv_bits=16 {16|8|4|2}', what it does) for every storage and protection knob."""
    spec = METHODS["full"] if "full" in METHODS else next(iter(METHODS.values()))
    for name, default in _storage_defaults().items():
        yield STORAGE_HEADING, f"{name}={default} {compact_rule(spec, name)}".strip(), STORAGE_KNOBS[name]
    compressing = next(s for s in METHODS.values() if s.compresses)
    for name, what in PROTECTION_KNOBS.items():
        yield PROTECTION_HEADING, f"{name} {compact_rule(compressing, name)}".strip(), what


def preset_knobs(preset: Preset) -> str:
    return " ".join(f"{k}={v}" for k, v in preset.knobs.items())


# ------------------------------------------------------------------- wide: tables
def print_tables() -> None:
    table = Table(title="reasonkv methods", show_lines=True, expand=True)
    longest = max((len(n) for n in METHODS), default=4)
    table.add_column("name", style="bold cyan", no_wrap=True, min_width=longest)
    table.add_column("description", ratio=3)
    table.add_column("schedule", min_width=12, max_width=22)
    table.add_column("its own knobs (--set key=value), ranges, and the shared knobs it sets", ratio=2)
    table.add_column("paper", ratio=2)
    for name, spec in METHODS.items():
        # Registry text is plain: escape it so a "[...]" in a description is not read as markup.
        knobs = "  ".join(knob_entries(spec))
        cells = (name, spec.description, describe_schedule(spec), knobs, spec.paper)
        table.add_row(*map(escape, cells))
    console.print(table)
    shared = Table(title="Knobs every method shares", show_lines=False, expand=True)
    shared.add_column("knob=default (range)", style="cyan", no_wrap=True)
    shared.add_column("what it does", ratio=1)
    shared.add_column("applies to", no_wrap=True)
    for heading, entry, what in shared_entries():
        who = "every method" if heading == STORAGE_HEADING else "compressing methods"
        shared.add_row(escape(entry), escape(what), who)
    console.print(shared)
    presets = Table(title=PRESETS_HEADING, show_lines=True, expand=True)
    presets.add_column("preset", style="bold cyan", no_wrap=True, min_width=max(map(len, PRESETS), default=6))
    presets.add_column("method and knobs", ratio=2)
    presets.add_column("measured", ratio=2)
    presets.add_column("evidence", ratio=3)
    for name, preset in PRESETS.items():
        what = f"{preset.method}: {preset_knobs(preset)}"
        evidence = f"{preset.summary}. On {preset.traces}; {preset.sources}"
        presets.add_row(*map(escape, (name, what, preset.measured, evidence)))
    console.print(presets)


# ----------------------------------------------------------------- narrow: blocks
INDENT = "    "


def _wrap_entries(lead: str, entries: list[str], width: int, hang: str | None = None) -> list[str]:
    """`lead` then the entries two spaces apart, lines broken only between entries; the next
    lines start with `hang` (default: under the first entry)."""
    hang = " " * len(lead) if hang is None else hang
    lines, line, start = [], "", lead
    for entry in entries:
        if line and len(start) + len(line) + 2 + len(entry) > width:
            lines.append(start + line)
            line, start = "", hang
        line = f"{line}  {entry}" if line else entry
    return [*lines, start + line]


def _wrap_text(lead: str, text: str, width: int, hang: str = INDENT) -> list[str]:
    return textwrap.wrap(
        text,
        width,
        initial_indent=lead,
        subsequent_indent=hang,
        break_long_words=False,
        break_on_hyphens=False,
    )


def block_lines(width: int) -> list[str]:
    """`reasonkv methods` for a narrow terminal, lines broken only between knobs and between
    words (plain text; `print_blocks` styles the names)."""
    out: list[str] = []
    for name, spec in METHODS.items():
        out += _wrap_text(f"{name}: ", spec.description, width)
        out += _wrap_text(f"{INDENT}schedule: ", describe_schedule(spec), width, INDENT * 2)
        entries = knob_entries(spec)
        if entries:
            out += _wrap_entries(f"{INDENT}knobs: ", entries, width)
        if spec.paper != "-":
            out += _wrap_text(f"{INDENT}paper: ", spec.paper, width, INDENT * 2)
    heading = None
    for head, entry, what in shared_entries():
        if head != heading:
            out += ["", *_wrap_text("", head + ":", width)]
            heading = head
        out += _wrap_text(f"{INDENT}{entry}: ", what, width, INDENT * 2)
    out += ["", *_wrap_text("", PRESETS_HEADING + ":", width)]
    for name, preset in PRESETS.items():
        out += _wrap_entries(
            f"{name}: {preset.method} with ", preset_knobs(preset).split(), width, INDENT * 2
        )
        out += _wrap_text(INDENT, preset.summary, width)
        out += _wrap_text(f"{INDENT}measured: ", preset.measured, width, INDENT * 2)
        out += _wrap_text(f"{INDENT}on: ", preset.traces, width, INDENT * 2)
        out += _wrap_text(f"{INDENT}from: ", preset.sources, width, INDENT * 2)
    return out


def print_blocks(width: int) -> None:
    names = set(METHODS) | set(PRESETS)
    for line in block_lines(width):
        head, sep, rest = line.partition(": ")
        if sep and head in names:  # a method's or preset's first line: its name in colour
            console.print(f"[bold cyan]{escape(head)}[/bold cyan]: {escape(rest)}", soft_wrap=True)
        else:
            console.print(line, markup=False, highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------ Markdown
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: 'Quantize, evict, or both' -> 'quantize-evict-or-both'."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _code_entries(entries: list[str]) -> str:
    """'fraction=0.125 (0,1)' -> '`fraction=0.125` (0,1)', comma-separated."""
    out = []
    for entry in entries:
        knob, _, rule = entry.partition(" ")
        out.append(f"`{knob}` {rule}".strip())
    return ", ".join(out) or "-"


def methods_markdown() -> str:
    """The methods reference as Markdown (the methods page under docs/ is this output)."""
    lines = [
        "# Methods, shared knobs and presets",
        "",
        "Generated from the registry by `reasonkv methods --markdown > docs/methods.md` (a test fails",
        "when this page and the registry differ). `reasonkv methods` prints the same in the terminal.",
        "",
        "## Methods",
        "",
        "Each method with its own knobs (`--set key=value`, or keywords of `make_cache`), their defaults",
        "and ranges, then the shared knobs it gives its own value.",
        "",
        "| method | what it does | schedule | its knobs | paper |",
        "|---|---|---|---|---|",
    ]
    for name, spec in METHODS.items():
        knobs = _code_entries(knob_entries(spec))
        lines.append(_row([f"`{name}`", spec.description, describe_schedule(spec), knobs, spec.paper]))
    heading = None
    for head, entry, what in shared_entries():
        if head != heading:
            lines += [
                "",
                f"## {head.replace('--set', '`--set`')}",
                "",
                "| knob | what it does |",
                "|---|---|",
            ]
            heading = head
        lines.append(_row([_code_entries([entry]), what]))
    lines += [
        "",
        "## Presets",
        "",
        "The configurations docs/results.md recommends, by name: use one as a method name",
        '(`make_cache(model, "beaconkv-int4", 671)`, `--method beaconkv-int4`, a sweep\'s `methods`); knobs',
        "you set override the preset's. The numbers are at the budget given, on the traces named.",
        "",
        "| preset | method and knobs | what it is | measured | evidence |",
        "|---|---|---|---|---|",
    ]
    for name, preset in PRESETS.items():
        knobs = f"`{preset.method}` with " + ", ".join(f"`{k}={v}`" for k, v in preset.knobs.items())
        section = f"[results.md, “{preset.section}”](results.md#{_anchor(preset.section)})"
        evidence = f"{preset.traces}; records `{preset.records}`, grid `{preset.grid}`; {section}"
        lines.append(_row([f"`{name}`", knobs, preset.summary, preset.measured, evidence]))
    return "\n".join(lines) + "\n"


def print_methods(width: int) -> None:
    """`reasonkv methods` at this terminal width."""
    if width < TABLE_WIDTH:
        print_blocks(width)
    else:
        print_tables()
