"""Markdown tables of `reasonkv bench` results, for the docs and the device check.

For each JSON file `reasonkv bench --out` wrote: a line on what ran (model, its note, prompt,
versions, wall time), a summary with one row per run (speed over the first and last window,
K/V bytes at the longest length, the cache's peak K/V, scoring share, top-1 agreement; ratios
to the full cache), and one row per run at each length mark (tok/s over the window that ends
there, K/V bytes there), then the cache's own work per decode step by section (the scorer's
`on_step` and `score`, the selection with its compaction), in ms.

    python benchmarks/bench_table.py out/bench.json > out/bench.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reasonkv.core.models import model_note
from reasonkv.util.formatting import format_bytes, format_or_dash


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return [_row(header), _row(align), *(_row(r) for r in rows)]


def _window_ending_at(run: dict, tokens: int) -> dict:
    """The last tokens/s window that ends at or before `tokens` generated tokens."""
    before = [w for w in run["windows"] if w["end"] <= tokens]
    return before[-1] if before else run["windows"][0]


def summary_rows(record: dict) -> list[list[str]]:
    rows = []
    for r in record["runs"]:
        ratios = r.get("ratios", {})
        last = r["marks"][-1] if r["marks"] else {}
        rows.append(
            [
                r["label"],
                f"{r['windows'][0]['tokens_per_second']:.1f}",
                f"{r['windows'][-1]['tokens_per_second']:.1f}",
                format_or_dash((ratios.get("windows") or [None])[-1], ".2f"),
                format_bytes(last.get("kv_bytes")),
                format_or_dash((ratios.get("kv_bytes") or [None])[-1], ".3f"),
                format_bytes(r.get("peak_kv_bytes")),
                f"{100 * r['score_select_fraction']:.1f} %",
                format_or_dash(r.get("top1_agreement"), ".3f"),
            ]
        )
    return rows


def length_rows(record: dict) -> list[list[str]]:
    rows = []
    for r in record["runs"]:
        cells = [r["label"]]
        for mark in r["marks"]:
            window = _window_ending_at(r, mark["tokens"])
            cells.append(f"{window['tokens_per_second']:.1f} tok/s · {format_bytes(mark['kv_bytes'])}")
        rows.append(cells)
    return rows


def section_rows(record: dict) -> list[list[str]]:
    """Milliseconds per decode step: the whole step, then the cache's timed sections (the
    prefill's are in them too, once per run)."""
    rows = []
    for r in record["runs"]:
        steps = max(r["steps"], 1)
        ms = {name: 1e3 * v["seconds"] / steps for name, v in r.get("sections", {}).items()}
        scoring = sum(ms.get(n, 0.0) for n in ("score", "on_step", "split"))
        cells = [f"{1e3 * r['decode_seconds'] / steps:.1f}", f"{scoring:.2f}"]
        cells += [f"{ms.get(n, 0.0):.2f}" for n in ("on_step", "score", "compress")]
        rows.append([r["label"], *cells])
    return rows


def capacity_markdown(record: dict, source: str = "") -> str:
    """A batch-capacity record (bench --kv-memory / --batch) as Markdown."""
    cap = record["batch_capacity"]
    lines = [f"### `{record['model']}`, batch capacity" + (f" ({source})" if source else ""), ""]
    if note := model_note(record["model"]):
        lines += [f"*{note}.*", ""]
    limit = format_bytes(cap["kv_memory_bytes"]) if cap.get("kv_memory_bytes") else "no limit"
    lines += [
        f"K/V memory {limit}, batch {cap['batch']} (at most {cap['max_batch']}), {cap['target_tokens']} "
        f"generated tokens; {record.get('wall_seconds', 0):.0f} s wall.",
        "",
        f"`{record['command']}`",
        "",
    ]
    rows = []
    for r in cap["runs"]:
        # Records before the state meter planned and measured K/V alone.
        held = "state" if "peak_state_bytes" in r else "kv"
        pred = r.get(f"predicted_peak_{held}_bytes_per_sequence")
        rows.append(
            [
                r["label"],
                "-" if pred is None else format_bytes(pred),
                format_bytes(r[f"peak_{held}_bytes_per_sequence"]),
                str(r["batch"]),
                format_bytes(r[f"peak_{held}_bytes"]) + (" OVER" if r.get("over_limit") else ""),
                f"{r['aggregate_tokens_per_second']:.1f}",
                "-" if r.get("aggregate_ratio") is None else f"{r['aggregate_ratio']:.2f}",
            ]
        )
    what = "held" if all("peak_state_bytes" in r for r in cap["runs"]) else "K/V"
    header = [
        "run",
        f"peak {what} per seq (predicted)",
        "measured",
        "batch",
        f"batch peak {what}",
        "agg tok/s",
        "× full",
    ]
    lines += _table(header, rows)
    return "\n".join(lines) + "\n"


def markdown(record: dict, source: str = "") -> str:
    """The tables of one bench record, as Markdown."""
    if "batch_capacity" in record:
        return capacity_markdown(record, source)
    lengths = record["lengths"]
    machine = record.get("machine", {})
    lines = [f"### `{record['model']}`" + (f" ({source})" if source else ""), ""]
    if note := model_note(record["model"]):
        lines += [f"*{note}.*", ""]
    lines += [
        f"Prompt {record['prompt_tokens']} tokens + {lengths[-1]} forced tokens, windows of "
        f"{record['window']} steps; {record.get('wall_seconds', 0):.0f} s wall; torch "
        f"{machine.get('torch', '?')}, transformers {machine.get('transformers', '?')}.",
        "",
        f"`{record['command']}`",
        "",
    ]
    header = ["run", "tok/s first", "tok/s last", "× full", f"K/V at {lengths[-1]}", "× full", "peak K/V"]
    lines += _table(header + ["score+select", "top-1"], summary_rows(record))
    lines += ["", "tok/s over the window ending at each length, and K/V bytes there:", ""]
    lines += _table(["run", *(str(n) for n in lengths)], length_rows(record))
    lines += ["", "The cache's own work, ms per decode step (scoring = on_step + score + split):", ""]
    header = ["run", "step", "scoring", "on_step", "score", "selection (compress)"]
    lines += _table(header, section_rows(record))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="bench JSON files (reasonkv bench --out)")
    args = parser.parse_args(argv)
    parts = []
    for path in args.files:
        record = json.loads(path.read_text())
        if record.get("kind") != "bench":
            parser.error(f"{path} is not a `reasonkv bench` result (kind={record.get('kind')!r})")
        parts.append(markdown(record, path.name))
    sys.stdout.write("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
