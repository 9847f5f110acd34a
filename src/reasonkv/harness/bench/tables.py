"""The benchmark's terminal tables (rich)."""

from __future__ import annotations

from reasonkv.harness.bench.runs import BASELINE
from reasonkv.util.formatting import format_bytes, format_or_dash


def summary_table(record: dict, baseline: str = BASELINE):
    """One row per run: speed (first/last window), K/V at the longest length, RSS, scoring cost,
    and the overhead over `baseline` (as `add_ratios` was given it)."""
    from rich import box
    from rich.table import Table

    from reasonkv.util.tables import fill_table

    runs = record["runs"]
    lengths = record["lengths"]
    table = Table(
        title=f"decode speed and memory · prompt {record['prompt_tokens']} + {lengths[-1]} forced tokens",
        caption="tok/s over the first and last windows of decoding; × full: ratio to the full cache in the "
        "same run. KV: K/V storage at the longest length; peak KV: the most held at once (the cache's "
        "meter). RSS Δ: peak RSS "
        "above the run's start. score+select: share of decode time in scoring, selection and compaction; "
        f"vs {baseline}: extra time over {baseline} at the same budget. "
        "top-1: argmax = reference's next token.",
        box=box.SIMPLE_HEAD,
        caption_justify="left",
    )
    cols = ("method", "budget", "tok/s first", "tok/s last", "× full", "KV", "× full ", "peak KV", "RSS Δ")
    cols += ("score+select", f"vs {baseline}", "top-1")
    rows = []
    for r in runs:
        ratios = r.get("ratios", {})
        last_mark = r["marks"][-1] if r["marks"] else {}
        kv_ratio = (ratios.get("kv_bytes") or [None])[-1]
        win_ratio = (ratios.get("windows") or [None])[-1]
        over = ratios.get(f"overhead_vs_{baseline}")
        rows.append(
            [
                r["method"],
                "-" if r["budget"] is None else str(r["budget"]),
                f"{r['windows'][0]['tokens_per_second']:.1f}",
                f"{r['windows'][-1]['tokens_per_second']:.1f}",
                format_or_dash(win_ratio, ".2f"),
                format_bytes(last_mark.get("kv_bytes")),
                format_or_dash(kv_ratio, ".3f"),
                format_bytes(r["peak_kv_bytes"]),
                format_bytes(r["rss_peak_delta"]),
                f"{100 * r['score_select_fraction']:.1f}%",
                "-" if over is None else f"{100 * over:+.1f}%",
                format_or_dash(r["top1_agreement"], ".3f"),
            ]
        )
    # At 80 columns the first-window speed, ratios and RSS go first (the JSON keeps them all).
    optional = ("tok/s first", "× full ", "RSS Δ", f"vs {baseline}", "top-1", "score+select")
    return fill_table(table, cols, rows, optional=optional)


def windows_table(record: dict):
    """Tokens/s per window (rows: runs), with the ratio to full."""
    from rich import box
    from rich.table import Table

    from reasonkv.util.tables import fill_table

    table = Table(title="tokens/s per window of decode steps (× full)", box=box.SIMPLE_HEAD)
    columns = ["run"] + [f"{w['start']}–{w['end']}" for w in record["runs"][0]["windows"]]
    rows = []
    for r in record["runs"]:
        ratios = r.get("ratios", {}).get("windows") or [None] * len(r["windows"])
        rows.append(
            [r["label"]]
            + [
                f"{w['tokens_per_second']:.1f}" + ("" if q is None else f" ({q:.2f})")
                for w, q in zip(r["windows"], ratios, strict=True)
            ]
        )
    return fill_table(table, columns, rows)


def memory_table(record: dict):
    """K/V bytes at each length mark (rows: runs), with the ratio to full."""
    from rich import box
    from rich.table import Table

    from reasonkv.util.tables import fill_table

    table = Table(title="K/V bytes at each length (× full)", box=box.SIMPLE_HEAD)
    columns = ["run"] + [str(length) for length in record["lengths"]]
    rows = []
    for r in record["runs"]:
        ratios = r.get("ratios", {}).get("kv_bytes") or [None] * len(r["marks"])
        rows.append(
            [r["label"]]
            + [
                format_bytes(m["kv_bytes"]) + ("" if q is None else f" ({q:.3f})")
                for m, q in zip(r["marks"], ratios, strict=True)
            ]
        )
    return fill_table(table, columns, rows)


def capacity_table(record: dict):
    """Batch capacity at fixed memory, one row per run: peak K/V of one sequence (predicted from
    the schedule, and measured), the batch, the batch's measured peak, aggregate tokens/s and its
    ratio to the full cache. A run whose measured peak passed the limit says so in its row."""
    from rich import box
    from rich.table import Table

    from reasonkv.util.tables import fill_table

    section = record["batch_capacity"]
    memory = section["kv_memory_bytes"]
    limit = "no K/V limit" if memory is None else f"{format_bytes(memory)} of K/V"
    how = "the largest batch that fits" if section["batch"] == "auto" else f"batch {section['batch']}"
    if section["batch"] == "auto":
        how += f", at most {section['max_batch']}"
    table = Table(
        title=f"batch capacity · {limit} · {how} · prompt {record['prompt_tokens']} + "
        f"{section['target_tokens']} forced tokens",
        caption="pred/seq, peak/seq: the peak of everything one sequence holds (K/V, slot indices, query "
        "windows, beacons, policy state), predicted from the schedule before decoding, and measured by the "
        "cache's meter (the batch's peak / batch). batch held: the whole batch's measured peak (OVER: above "
        "the limit). agg tok/s: batch × tokens / decode seconds; × full: "
        "its ratio to the full cache's. rows: every row predicted the same tokens.",
        box=box.SIMPLE_HEAD,
        caption_justify="left",
    )
    cols = ("run", "pred/seq", "peak/seq", "batch", "batch held")
    cols += ("agg tok/s", "× full", "tok/s/seq", "rows")
    rows, styles = [], []
    for r in section["runs"]:
        over = bool(r["over_limit"])
        rows.append(
            [
                r["label"],
                format_bytes(r["predicted_peak_state_bytes_per_sequence"]),
                format_bytes(r["peak_state_bytes_per_sequence"]),
                str(r["batch"]),
                format_bytes(r["peak_state_bytes"]) + (" OVER" if over else ""),
                f"{r['aggregate_tokens_per_second']:.1f}",
                format_or_dash(r.get("aggregate_ratio"), ".2f"),
                f"{r['tokens_per_second']:.2f}",
                "same" if r["rows_agree"] else "differ",
            ]
        )
        styles.append("bold red" if over else None)
    if section["over_limit"]:
        table.caption += f" OVER THE LIMIT: {', '.join(section['over_limit'])}."
    optional = ("rows", "tok/s/seq", "peak/seq")  # peak/seq = batch held / batch
    return fill_table(table, cols, rows, row_styles=styles, optional=optional)
