"""`reasonkv report`: a sweep's JSONL (or replay / eval --out JSON, see report_inputs) as
method × budget tables, plots and a Markdown page.

Each unit counts once: its first "ok" line, else its last error line (shown as an error,
never in the numbers). Rows pool every unit of a (method, budget, knobs) within one
(kind, model, dataset) section:
- replay: every trace position weighs the same (sums of KL, top-1 hits and NLLs over all
  positions of all traces, as `replay.summarize` pools), so a long trace counts more;
- eval: every sample weighs the same: pass@1 = correct / samples over problems and seeds,
  mean length and truncation rate likewise.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from reasonkv.harness.report_inputs import read_any
from reasonkv.harness.report_plot import model_note, plot_section
from reasonkv.methods.knobs import stores_quantized
from reasonkv.util.formatting import format_bytes, format_or_dash
from reasonkv.util.tables import fill_table


@dataclass
class Section:
    kind: str
    model: str
    dataset: str
    rows: list[dict] = field(default_factory=list)
    placement: str = ""
    """The device and dtype, where a sweep ran the model on other than the defaults (cpu, fp32)."""

    @property
    def title(self) -> str:
        what = "replay fidelity" if self.kind == "replay" else "accuracy"
        model = f"{self.model} ({self.placement})" if self.placement else self.model
        return f"{what} · {model} · {self.dataset}"


def load_records(paths: Iterable[str | Path]) -> tuple[list[dict], int]:
    """The line that counts for each unit over all files, in first-seen order, and the
    number of unreadable lines. A file may be a sweep JSONL or a replay or eval --out JSON
    (report_inputs turns those into the same records)."""
    chosen: dict[str, dict] = {}
    unreadable = 0
    for path in paths:
        records, bad = read_any(path)
        unreadable += bad
        for r in records:
            old = chosen.get(r["key"])
            if old is None or old.get("status") != "ok":  # a later line replaces an error line
                chosen[r["key"]] = r
    return list(chosen.values()), unreadable


def _knobs_id(knobs: dict) -> str:
    return json.dumps(knobs, sort_keys=True)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _stores_quantized(method: str, knobs: dict) -> bool | None:
    """Whether a method's cache stored K/V below the model's precision (None: unknown method)."""
    try:
        return stores_quantized(method, knobs)
    except ValueError:
        return None


def unit_peak_16bit(unit: dict) -> float | None:
    """A replay unit's peak K/V while decoding with every unquantized value at 16 bits (what a
    bf16/fp16 server holds). Units from before that count was recorded all ran on the CPU in
    fp32, 4 bytes a value: where they stored nothing quantized it is exactly half their peak."""
    m, c = unit["metrics"], unit["config"]
    if m.get("decode_peak_kv_bytes_16bit") is not None:
        return m["decode_peak_kv_bytes_16bit"]
    as_run = m.get("decode_peak_kv_bytes")
    fp32_cpu = c.get("dtype", "float32") == "float32" and c.get("device", "cpu") == "cpu"
    if as_run is None or not fp32_cpu or _stores_quantized(c["method"], c.get("knobs", {})) is not False:
        return None
    return as_run / 2


def _replay_row(units: list[dict]) -> dict:
    ok = [u for u in units if u.get("status") == "ok"]
    s = {"n": 0, "kl": 0.0, "top1": 0.0, "nll_full": 0.0, "nll": 0.0}
    live = 0.0
    for u in ok:
        for k in s:
            s[k] += u["metrics"]["sums"][k]
        live += u["metrics"]["live_tokens"] * u["metrics"]["sums"]["n"]
    n = s["n"]

    def mean_over_traces(key) -> float | None:  # None when any unit predates the field
        values = [key(u) if callable(key) else u["metrics"].get(key) for u in ok]
        return sum(values) / len(values) if values and None not in values else None

    return {
        "traces": len({u["config"]["item"] for u in ok}),
        "positions": n,
        "mean_kl": _ratio(s["kl"], n),
        "top1": _ratio(s["top1"], n),
        "ppl_ratio": math.exp((s["nll"] - s["nll_full"]) / n) if n else None,
        "live_tokens": _ratio(live, n),
        # Peaks while decoding: a prompt longer than the budget, held whole for its one forward,
        # would otherwise set every method's peak at small budgets.
        "peak_live_tokens": mean_over_traces("decode_peak_live_tokens"),
        "peak_kv_bytes": mean_over_traces("decode_peak_kv_bytes"),
        "peak_kv_bytes_16bit": mean_over_traces(unit_peak_16bit),
        "seconds": sum(u.get("timings", {}).get("seconds", 0.0) for u in ok),
    }


def _eval_row(units: list[dict]) -> dict:
    ok = [u for u in units if u.get("status") == "ok"]
    correct = sum(sum(u["metrics"]["correct"]) for u in ok)
    samples = sum(len(u["metrics"]["correct"]) for u in ok)
    length = sum(sum(u["metrics"]["lengths"]) for u in ok)
    truncated = sum(sum(u["metrics"]["truncated"]) for u in ok)
    gen_seconds = sum(u.get("timings", {}).get("generate_seconds", 0.0) for u in ok)
    return {
        "problems": len({u["config"]["item"] for u in ok}),
        "seeds": len({u["config"]["seed"] for u in ok}),
        "samples": samples,
        "pass@1": _ratio(correct, samples),
        "mean_length": _ratio(length, samples),
        "truncation_rate": _ratio(truncated, samples),
        "tokens_per_second": _ratio(sum(u["metrics"]["generated_tokens"] for u in ok), gen_seconds),
    }


def _placement(config: dict) -> str:
    """The device and dtype a sweep ran the model on where not the defaults (a sweep config
    holds them only then): a bf16 or GPU run gets its own section, never pooled with fp32 CPU units."""
    return ", ".join(config[k] for k in ("device", "dtype") if k in config)


def summarize_results(records: list[dict]) -> list[Section]:
    """Sections by (kind, model, dataset) in first-seen order; rows by method (first-seen
    order) then budget (none first, ascending)."""
    sections: dict[tuple, dict[tuple, list[dict]]] = {}
    for r in records:
        c = r["config"]
        rows = sections.setdefault((c["kind"], c["model"], c["dataset"], _placement(c)), {})
        rows.setdefault((c["method"], c.get("budget"), _knobs_id(c.get("knobs", {}))), []).append(r)
    out = []
    for (kind, model, dataset, placement), groups in sections.items():
        method_order = {m: i for i, m in enumerate(dict.fromkeys(k[0] for k in groups))}
        settings_of: dict[str, set] = {}
        for method, _, knobs in groups:
            settings_of.setdefault(method, set()).add(knobs)
        section = Section(kind, model, dataset, placement=placement)
        knob_order = {k: i for i, k in enumerate(dict.fromkeys(k[2] for k in groups))}
        keys = sorted(
            groups, key=lambda k: (method_order[k[0]], k[1] is not None, k[1] or 0, knob_order[k[2]])
        )
        for method, budget, knobs_id in keys:
            units = groups[(method, budget, knobs_id)]
            knobs = json.loads(knobs_id)
            name = method
            if len(settings_of[method]) > 1:  # the same method under several knob settings
                name += "[" + (",".join(f"{k}={v}" for k, v in knobs.items()) or "defaults") + "]"
            row = {
                "method": method,
                "name": name,
                "budget": budget,
                "knobs": knobs,
                "label": name if budget is None else f"{name}@{budget}",
                "units": len(units),
                "errors": sum(u.get("status") != "ok" for u in units),
            }
            row.update(_replay_row(units) if kind == "replay" else _eval_row(units))
            section.rows.append(row)
        out.append(section)
    return out


# ---------------------------------------------------------------------- tables
COLUMNS = {
    "replay": [
        "method",
        "budget",
        "traces",
        "tokens",
        "mean KL",
        "top-1",
        "ppl ratio",
        "peak K/V",
        "peak @16-bit",
        "peak live",
        "live/head",
        "errors",
    ],
    "eval": [
        "method",
        "budget",
        "problems",
        "samples",
        "pass@1",
        "length",
        "truncated",
        "tok/s",
        "errors",
    ],
}


def cells(kind: str, row: dict) -> list[str]:
    """A row's cells as text: the same strings in the terminal and in Markdown."""
    budget = "-" if row["budget"] is None else str(row["budget"])
    errors = str(row["errors"]) if row["errors"] else ""
    if kind == "replay":
        return [
            row["name"],
            budget,
            str(row["traces"]),
            str(row["positions"]),
            format_or_dash(row["mean_kl"], ".4f"),
            format_or_dash(row["top1"], ".3f"),
            format_or_dash(row["ppl_ratio"], ".3f"),
            "-" if row.get("peak_kv_bytes") is None else format_bytes(row["peak_kv_bytes"]),
            "-" if row.get("peak_kv_bytes_16bit") is None else format_bytes(row["peak_kv_bytes_16bit"]),
            format_or_dash(row.get("peak_live_tokens"), ".0f"),
            format_or_dash(row["live_tokens"], ".0f"),
            errors,
        ]
    return [
        row["name"],
        budget,
        str(row["problems"]),
        str(row["samples"]),
        format_or_dash(row["pass@1"], ".3f"),
        format_or_dash(row["mean_length"], ".1f"),
        format_or_dash(row["truncation_rate"], ".1%"),
        format_or_dash(row["tokens_per_second"], ".1f"),
        errors,
    ]


def rich_table(section: Section, width: int | None = None):
    """The section as a rich table fitted to `width` columns (default: the terminal's)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    caption = (
        "pooled over every scored trace position (tokens); mean KL(full ‖ method) in nats; top-1: "
        "argmax agrees with full; ppl ratio: exp(mean NLL − mean NLL of full); peak K/V: the most K/V "
        "storage held at once per sequence while decoding, as run and with every unquantized value "
        "at 16 bits (bf16/fp16 serving); peak live / live/head: KV tokens per head "
        "attended, at most / on average"
        if section.kind == "replay"
        else "pooled over every sample; length: mean generated tokens; truncated: hit max_new_tokens"
    )
    table = Table(
        title=escape(section.title),
        caption=caption,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    names = list(COLUMNS[section.kind])
    rows = [cells(section.kind, row) for row in section.rows]
    drop = [] if any(row["errors"] for row in section.rows) else ["errors"]  # an empty column only takes room
    keep = [i for i, name in enumerate(names) if name not in drop]
    names, rows = [names[i] for i in keep], [[r[i] for i in keep] for r in rows]
    styles = ["red" if row["errors"] else None for row in section.rows]
    return fill_table(table, names, rows, row_styles=styles, width=width, optional=NARROW_DROPS[section.kind])


NARROW_DROPS = {
    "replay": ["tokens", "traces", "ppl ratio", "peak live", "peak K/V"],
    "eval": ["samples", "problems"],
}
"""Columns a narrow terminal leaves out, in order (the Markdown report keeps every column)."""


def markdown_table(section: Section) -> str:
    cols = COLUMNS[section.kind]
    lines = [
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" if c == "method" else "---:" for c in cols) + "|",
    ]
    for row in section.rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(section.kind, row)) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------- plots
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def plot_name(section: Section, sections: list[Section]) -> str:
    base = "fidelity" if section.kind == "replay" else "accuracy"
    if sum(s.kind == section.kind for s in sections) == 1:
        return f"{base}.png"
    where = f"-{_slug(section.placement)}" if section.placement else ""
    return f"{base}-{_slug(section.model)}{where}-{_slug(section.dataset)}.png"


def write_report(sections: list[Section], out_dir: str | Path, sources: list[str]) -> dict:
    """Plots and report.md (tables + image links) into out_dir; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [f"<!-- generated by `reasonkv report {' '.join(sources)}` -->"]
    plots = []
    for section in sections:
        name = plot_name(section, sections)
        plot, caption = plot_section(section, out_dir / name)
        plots.append(plot)
        units = sum(r["units"] for r in section.rows)
        errors = sum(r["errors"] for r in section.rows)
        note = f"{units} units" + (f", {errors} failed (not in the numbers)" if errors else "")
        parts += [
            f"## {section.title}",
            "",
            *([f"*{note_line}.*", ""] if (note_line := model_note(section.model)) else []),
            markdown_table(section),
            "",
            f"{note}.",
            "",
            f"![{section.title}]({name})",
            "",
            caption,
            "",
        ]
    md = out_dir / "report.md"
    md.write_text("\n".join(parts))
    return {"markdown": md, "plots": plots}
