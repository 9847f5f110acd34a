"""`reasonkv sweep` and `reasonkv report`: run a grid into a resumable JSONL, then read it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from reasonkv.cli.common import console, err_console, fail, replay_unit_line, split_list
from reasonkv.harness.report import load_records, rich_table, summarize_results, write_report
from reasonkv.harness.sweep import GridError, SweepPlan, load_grid, plan, read_results, run_sweep
from reasonkv.util.progress import progress_for

INTERRUPTED = 130
FAILED_UNITS = 1


def sweep_command(
    grid_file: Annotated[
        Path, typer.Argument(help="The grid: TOML (or YAML). See examples/sweep-replay.toml.")
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Results JSONL (appended; default: GRID-NAME.jsonl here)."),
    ] = None,
    workers: Annotated[
        int, typer.Option("--workers", "-w", help="Parallel workers; more than 1 runs on local Ray.")
    ] = 1,
    ray_address: Annotated[
        str | None, typer.Option("--ray", help="Ray cluster address (e.g. ray://host:10001 or auto).")
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads", help="Torch threads per worker (default: REASONKV_THREADS, else cores // workers)."
        ),
    ] = None,
    retry_errors: Annotated[
        bool, typer.Option("--retry-errors", help="Also rerun units whose only line is an error.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Count units and what is left; run nothing.")
    ] = False,
) -> None:
    """Run a grid of models × methods × budgets × datasets × seeds, one JSON line per unit.
    Interrupted (Ctrl-C, kill -9)? Run the same command again: it resumes where it stopped."""
    try:
        if workers < 1:
            raise GridError(f"--workers must be at least 1, got {workers}")
        if threads is not None and threads < 1:
            raise GridError(f"--threads must be at least 1, got {threads}")
        grid = load_grid(grid_file)
        out = out if out is not None else Path(grid_file.stem + ".jsonl")
        if dry_run:
            records = read_results(out)[0] if out.exists() else []
            p = plan(grid, records, retry_errors)
            console.print(_plan_line(p, out), soft_wrap=True)
            return
    except (GridError, ValueError, FileNotFoundError) as err:
        fail(str(err))

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[failed]} failed[/red]"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with progress_for(err_console, *columns) as progress:
        task = None

        def on_start(p: SweepPlan) -> None:
            nonlocal task
            err_console.print(_plan_line(p, out), soft_wrap=True)
            task = progress.add_task(
                f"sweep {grid_file.stem}", total=len(p.units), completed=p.done, failed=0
            )

        def on_records(records: list[dict]) -> None:
            failed = progress.tasks[0].fields["failed"] + sum(r["status"] != "ok" for r in records)
            progress.update(task, advance=len(records), failed=failed)
            if not err_console.is_terminal:  # a log shows each unit's numbers as it lands
                for record in records:
                    err_console.print(escape(unit_line(record)), soft_wrap=True, highlight=False)

        try:
            stats = run_sweep(
                grid,
                out,
                workers=workers,
                ray_address=ray_address,
                threads=threads,
                retry_errors=retry_errors,
                on_start=on_start,
                on_records=on_records,
            )
        except KeyboardInterrupt:
            progress.stop()
            done = int(progress.tasks[0].completed) if progress.tasks else 0
            err_console.print(
                f"[yellow]interrupted[/yellow] with {done} units in {escape(str(out))}; "
                "run the same command again to resume (units in flight rerun)",
                soft_wrap=True,
            )
            raise typer.Exit(INTERRUPTED) from None
        except (GridError, ValueError, FileNotFoundError) as err:
            progress.stop()
            fail(str(err))

    new = stats.ok + stats.failed
    console.print(
        f"{stats.total} units: {stats.skipped} already done, {stats.ok} run now"
        + (f", [red]{stats.failed} failed[/red]" if stats.failed else "")
        + f" ({stats.seconds:.1f} s) -> {escape(str(out))}",
        soft_wrap=True,
    )
    for line in stats.errors[:5]:
        console.print(f"[red]error:[/red] {escape(line)}", soft_wrap=True)
    if len(stats.errors) > 5:
        console.print(f"[red]… and {len(stats.errors) - 5} more errors in {escape(str(out))}[/red]")
    if new or stats.skipped:
        console.print(f"[dim]tables and plots: reasonkv report {escape(str(out))}[/dim]", soft_wrap=True)
    if stats.failed:
        raise typer.Exit(FAILED_UNITS)


def unit_line(record: dict) -> str:
    """One finished sweep unit as a plain line: what ran, its main numbers, its task's time."""
    c = record["config"]
    label = c["method"] if c.get("budget") is None else f"{c['method']}@{c['budget']}"
    if record["status"] != "ok":
        return f"{c.get('item')} {label}: failed: {record.get('error', '?')}"
    m = record["metrics"]
    if c["kind"] == "replay":
        line = replay_unit_line(c.get("item"), label, m["mean_kl"], m["top1"], m.get("peak_live_tokens", 0))
    else:
        line = f"{c.get('item')} {label}: pass@1 {m['pass@1']:.3f}, {m['generated_tokens']} tokens"
    seconds = record.get("timings", {}).get("task_seconds", record.get("timings", {}).get("seconds"))
    return line + (f" ({seconds:.0f} s)" if seconds is not None else "")


def _plan_line(p: SweepPlan, out: Path) -> str:
    notes = [f"{p.stray} lines from other grids kept"] if p.stray else []
    notes += [f"a partial last line ({p.dropped_tail} bytes) removed"] if p.dropped_tail else []
    notes += [f"{p.unreadable} unreadable lines ignored"] if p.unreadable else []
    return (
        f"{len(p.units)} units, {p.done} done in {escape(str(out))}, {len(p.pending)} to run "
        f"in {len(p.tasks)} tasks" + "".join(f"; {n}" for n in notes)
    )


def report_command(
    results: Annotated[
        list[Path],
        typer.Argument(
            help="Results: sweep JSONL, `reasonkv replay --out` JSON or `reasonkv eval --out` JSON files "
            "(the kind is read from the content; mix them freely)."
        ),
    ],
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder for report.md and the plots (default: RESULTS-report/)."),
    ] = None,
    methods: Annotated[
        str | None,
        typer.Option(
            "--methods",
            "-m",
            help="Report only these methods (comma-separated; every knob setting of each), in this order.",
        ),
    ] = None,
) -> None:
    """Tables (method × budget) and plots (fidelity or accuracy vs budget) of sweep, replay and
    eval results."""
    missing = [str(p) for p in results if not p.is_file()]
    if missing:
        fail(f"no results file at {', '.join(missing)}")
    try:
        records, unreadable = load_records(results)
    except ValueError as err:
        fail(str(err))
    if not records:
        fail(f"no results in {', '.join(map(str, results))}")
    if methods is not None:
        wanted = split_list(methods, "--methods")
        present = {r["config"]["method"] for r in records}
        absent = [m for m in wanted if m not in present]
        if absent:
            fail(
                f"no results for {', '.join(absent)} in these files (they hold {', '.join(sorted(present))})"
            )
        order = {m: i for i, m in enumerate(wanted)}
        records = sorted(
            (r for r in records if r["config"]["method"] in order), key=lambda r: order[r["config"]["method"]]
        )
    try:
        sections = summarize_results(records)
    except (KeyError, TypeError) as err:
        fail(f"results lines lack a field the report needs: {err}")
    for section in sections:
        console.print(rich_table(section, width=console.width))
    if unreadable:
        console.print(f"[yellow]{unreadable} unreadable line(s) skipped (an interrupted write?)[/yellow]")
    out_dir = out_dir if out_dir is not None else results[0].with_name(results[0].stem + "-report")
    written = write_report(sections, out_dir, [str(p) for p in results])
    console.print(f"report -> {escape(str(written['markdown']))}", soft_wrap=True)
    for plot in written["plots"]:
        console.print(f"plot -> {escape(str(plot))}", soft_wrap=True)
