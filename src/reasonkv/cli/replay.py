"""`reasonkv replay`: trace-replay fidelity of methods × budgets on reasoning traces."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from reasonkv.cli.common import (
    BudgetsOption,
    CliError,
    DeviceOption,
    DtypeOption,
    MaxTokensOption,
    ModelOption,
    ResultsOutOption,
    SharedSetsOption,
    TraceLimitOption,
    TracesOption,
    VariantOption,
    build_runs,
    check_device,
    check_runs_build,
    command_line,
    console,
    err_console,
    fail,
    loading_status,
    parse_budgets,
    parse_sets,
    placement_parts,
    progress_bar,
    replay_unit_line,
    split_list,
)
from reasonkv.core.models import (
    DEFAULT_MODEL,
    load_model,
    load_tokenizer_and_config,
    max_positions,
    model_note,
)
from reasonkv.harness.replay import (
    BIN,
    BLOCK,
    metrics,
    plot_fidelity,
    replay_batch,
    replay_methods,
    replay_work,
    summarize,
)
from reasonkv.harness.traces import check_replay_input, load_traces_where, replay_input
from reasonkv.util.formatting import format_or_dash
from reasonkv.util.records import utc_timestamp, write_json_atomic
from reasonkv.util.runtime import set_threads
from reasonkv.util.tables import fill_table


def _log_units(results: list, start: float) -> None:
    """Not on a terminal (a pipe, a log): one plain line per finished trace × method × budget."""
    if err_console.is_terminal:
        return
    for r in results:
        m = metrics(r.sums())
        line = replay_unit_line(r.trace_id, r.run.label, m["mean_kl"], m["top1"], r.peak_live_tokens)
        line += f", {time.perf_counter() - start:.0f} s elapsed"
        err_console.print(escape(line), soft_wrap=True, highlight=False)


def replay_command(
    traces: TracesOption,
    out: ResultsOutOption = Path("replay.json"),
    model_name: ModelOption = DEFAULT_MODEL,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    methods: Annotated[
        str,
        typer.Option(
            "--methods",
            "-m",
            help="Comma-separated names from `reasonkv methods`; "
            "name:key=value:... gives one its own knobs (snapkv,snapkv:kv_bits=4).",
        ),
    ] = "full,streaming,snapkv,rkv",
    budgets: BudgetsOption = "128",
    ids: Annotated[
        str | None, typer.Option("--ids", help="Comma-separated trace ids (in this order).")
    ] = None,
    limit: TraceLimitOption = None,
    variant: VariantOption = "well_posed",
    max_tokens: MaxTokensOption = 2048,
    sets: SharedSetsOption = None,
    bin_size: Annotated[int, typer.Option("--bin", help="Trace tokens per bin of the curves.")] = BIN,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Also draw KL / top-1 vs position here (PNG).")
    ] = None,
    per_position: Annotated[
        bool, typer.Option("--per-position", help="Also store every position's numbers in the JSON.")
    ] = False,
    batch: Annotated[
        bool,
        typer.Option(
            "--batch/--one-by-one",
            help="Replay all traces as one left-padded batch (one forward serves every trace; "
            "equal to one by one up to float rounding).",
        ),
    ] = False,
) -> None:
    """Teacher-force reasoning traces and measure each method's fidelity to the full cache:
    mean KL(full‖method), top-1 agreement and perplexity ratio, overall and by position."""
    try:
        method_names = split_list(methods, "--methods")
        budget_list = parse_budgets(budgets)
        runs = build_runs(method_names, budget_list, parse_sets(sets))
        if max_tokens <= 1:
            raise CliError(f"--max-tokens must be at least 2, got {max_tokens}")
        if bin_size <= 0:
            raise CliError(f"--bin must be positive, got {bin_size}")
        if limit is not None and limit <= 0:
            raise CliError(f"--limit must be positive, got {limit}")
        id_list = split_list(ids, "--ids") if ids is not None else None
        rows = load_traces_where(
            traces, limit=limit, variant=None if variant == "all" else variant, ids=id_list
        )
        if not rows:
            raise CliError(f"{traces}: no traces of variant {variant!r}")
        where = check_device(device, dtype)
        set_threads()
        # Every trace is checked against the tokenizer and the model's positions (seconds)
        # before the weights load (a minute): a bad trace fails now, by name.
        with loading_status(model_name, " (tokenizer, config)"):
            tokenizer, config = load_tokenizer_and_config(model_name)
        limit_positions = max_positions(config)
        inputs = [
            check_replay_input(replay_input(tokenizer, row, max_tokens, where=at), limit_positions, at)
            for at, row in rows
        ]
        with loading_status(model_name):
            model, _ = load_model(model_name, **where)
        check_runs_build(model, runs)
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))

    quantized = [r.label for r in runs if r.resolved.stores_quantized]
    if batch and quantized and len(inputs) > 1:
        err_console.print(
            f"note: --batch with quantized storage ({', '.join(quantized)}): a batch quantizes only where "
            "every row has left the full-precision residual, so those rows are not the traces alone "
            "(their KL and peak differ); leave out --batch to measure each trace alone",
            soft_wrap=True,
        )
    total = replay_work(inputs, runs, batch)
    results = []
    start = time.perf_counter()
    with progress_bar() as progress:
        # Counted per run (runs × positions): the line moves as each run feeds a chunk.
        what = "runs × trace columns" if batch else "runs × positions"
        task = progress.add_task(f"replaying {len(inputs)} traces × {len(runs)} runs ({what})", total=total)
        advance = lambda k: progress.advance(task, k)  # noqa: E731
        if batch:
            for per_trace in replay_batch(model, inputs, runs, progress=advance):
                results += per_trace
                _log_units(per_trace, start)
        for inp in inputs if not batch else []:
            progress.update(task, description=f"replaying {inp.id}")
            per_trace = replay_methods(
                model, inp.input_ids, inp.prompt_len, runs, trace_id=inp.id, progress=advance
            )
            results += per_trace
            _log_units(per_trace, start)
    wall = time.perf_counter() - start
    summary = summarize(results, bin_size)

    parts = ["--traces", traces, "--out", out, "--model", model_name, "--methods", methods]
    parts += ["--budgets", budgets, "--variant", variant, "--max-tokens", max_tokens, "--bin", bin_size]
    parts += ["--ids", ids] if ids is not None else []
    parts += ["--limit", limit] if limit is not None else []
    for item in sets or []:
        parts += ["--set", item]
    parts += ["--plot", plot] if plot is not None else []
    parts += ["--per-position"] if per_position else []
    parts += ["--batch"] if batch else []
    record = {
        "kind": "replay",
        "model": model_name,
        "traces_file": str(traces),
        "traces": [i.id for i in inputs],
        "tokens": [int(i.input_ids.shape[1]) for i in inputs],
        "prompt_tokens": [i.prompt_len for i in inputs],
        "max_tokens": max_tokens,
        "bin_size": bin_size,
        "block": BLOCK,
        "runs": [r.to_dict() for r in runs],
        "wall_seconds": wall,
        "command": command_line("replay", parts + placement_parts(where)),
        "device": str(where["device"]),
        "dtype": str(where["dtype"]).removeprefix("torch."),
        "created": utc_timestamp(),
        "summary": summary,
        "per_trace": [r.to_dict(bin_size, per_position) for r in results],
    }
    write_json_atomic(record, out, indent=1)

    table = Table(
        title=f"replay fidelity: {model_name}, {len(inputs)} traces, ≤{max_tokens} tokens",
        caption=model_note(model_name),
        caption_justify="left",
    )
    columns = ("method", "budget", "mean KL", "top-1", "ppl ratio", "tokens", "live/head", "seconds")
    names = {run.label: run.name for run in runs}  # method and its own knobs: two settings, two labels
    rows = [
        [
            names.get(row["label"], row["method"]),
            "-" if row["budget"] is None else str(row["budget"]),
            format_or_dash(row["mean_kl"], ".4f"),
            format_or_dash(row["top1"], ".3f"),
            format_or_dash(row["ppl_ratio"], ".3f"),
            str(row["positions"]),
            f"{row['live_tokens']:.0f}",
            f"{row['seconds']:.1f}",
        ]
        for row in summary
    ]
    optional = ("seconds", "tokens", "ppl ratio")
    console.print(
        fill_table(table, columns, rows, label_style="bold cyan", width=console.width, optional=optional)
    )
    console.print(f"[dim]{wall:.1f} s wall; results -> {escape(str(out))}[/dim]", soft_wrap=True)
    if plot is not None:
        console.print(f"fidelity plot -> {escape(str(plot_fidelity(summary, plot, model=model_name)))}")
