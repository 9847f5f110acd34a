"""`reasonkv bench`: decode speed and memory of methods × budgets on identical tokens."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from reasonkv.cli.common import (
    AttnOption,
    BudgetsOption,
    CliError,
    DeviceOption,
    DtypeOption,
    ModelOption,
    ResultsOutOption,
    SharedSetsOption,
    build_runs,
    check_attn,
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
    positive_ints,
    progress_bar,
    split_list,
)
from reasonkv.core.models import DEFAULT_MODEL, load_model, model_note
from reasonkv.harness import bench
from reasonkv.harness.demo import PROBLEM
from reasonkv.util.formatting import parse_bytes
from reasonkv.util.records import utc_timestamp, write_json_atomic
from reasonkv.util.runtime import set_threads


def profile_table(profiles: list[dict]) -> Table:
    """Milliseconds per decode step by group, one row per profiled run."""
    groups = list(profiles[0]["groups_seconds_per_step"])
    table = Table(
        title=f"one decode step at {profiles[0]['context']} generated tokens (ms, torch.profiler, "
        f"mean of {profiles[0]['steps']} steps)",
        caption="step: unprofiled wall time; the groups are inclusive CPU time under the profiler "
        "(which adds overhead: they sum to the profiled step).",
        box=box.SIMPLE_HEAD,
        caption_justify="left",
    )
    table.add_column("run", no_wrap=True)
    table.add_column("step", justify="right")
    for g in groups:
        table.add_column(g, justify="right")
    for p in profiles:
        cells = [f"{1000 * p['groups_seconds_per_step'][g]:.2f}" for g in groups]
        table.add_row(p["label"], f"{1000 * p['step_seconds']:.1f}", *cells)
    return table


def _save_record(header: dict, machine: dict, threads: int, runs: list, results: dict, out: Path) -> dict:
    """The bench record (command, machine after the run, planned runs, results, peak RSS),
    written to `out`; both the per-sequence and the batch-capacity paths save it so."""
    machine["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    record = {
        **header,
        "created": utc_timestamp(),
        "threads": threads,
        "machine": machine,
        "runs_planned": [r.to_dict() for r in runs],
        **results,
        "process_max_rss": bench.max_rss(),
    }
    write_json_atomic(record, out, indent=1)
    return record


def _step_progress(progress, total: int) -> Callable[[str, int], None]:
    """A "decoding (steps)" task and the callback that advances it, naming the run."""
    task = progress.add_task("decoding (steps)", total=total)

    def advance(label: str, k: int) -> None:
        progress.update(task, advance=k, description=label)

    return advance


def bench_command(
    model_name: ModelOption = DEFAULT_MODEL,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    methods: Annotated[
        str,
        typer.Option(
            "--methods",
            "-m",
            help="Comma-separated names from `reasonkv methods` (+ full); "
            "name:key=value:... gives one its own knobs (snapkv,snapkv:kv_bits=4).",
        ),
    ] = "full,streaming,snapkv,rkv,beaconkv",
    budgets: BudgetsOption = "512",
    lengths: Annotated[
        str,
        typer.Option("--lengths", "-l", help="Generated-token marks (the largest is the decode length)."),
    ] = "1024,2048,4096,8192",
    window: Annotated[int, typer.Option("--window", help="Decode steps per tokens/s window.")] = 1024,
    sets: SharedSetsOption = None,
    out: ResultsOutOption = Path("bench.json"),
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Also draw tok/s and KV bytes vs length into this folder.")
    ] = None,
    prompt: Annotated[
        str, typer.Option("--prompt", help="User message (chat template); default: the demo's problem.")
    ] = PROBLEM,
    attn: AttnOption = "sdpa",
    interleave: Annotated[
        bool,
        typer.Option(
            "--interleave/--sequential",
            help="Advance all runs step by step together (fair ratios on a busy machine; no per-run RSS), "
            "or one run after the other (per-run RSS).",
        ),
    ] = False,
    sample_every: Annotated[
        int, typer.Option("--sample-every", help="Decode steps between samples of cache bytes and RSS.")
    ] = bench.SAMPLE_EVERY,
    profile_at: Annotated[
        int,
        typer.Option(
            "--profile-at", help="Also profile decode steps after this many generated tokens (0 = off)."
        ),
    ] = 0,
    profile_steps: Annotated[
        int, typer.Option("--profile-steps", help="Decode steps to profile (one compression interval).")
    ] = 128,
    kv_memory: Annotated[
        str | None,
        typer.Option(
            "--kv-memory",
            help="Batch capacity: cache memory for a batch (2GiB, 512MiB, 1.5GB, bytes). Each run decodes "
            "the largest batch whose peak at the longest length fits: everything its cache holds, K/V "
            "and beside it (slot indices, query windows, beacons, policy state) (implies --batch auto).",
        ),
    ] = None,
    batch: Annotated[
        str | None,
        typer.Option(
            "--batch",
            help="Batch capacity: 'auto' (needs --kv-memory) or N sequences for every run; reports "
            "aggregate tok/s (batch × tokens / decode seconds) instead of the per-sequence tables.",
        ),
    ] = None,
    max_batch: Annotated[
        int | None,
        typer.Option(
            "--max-batch", help=f"The largest batch --batch auto picks [default: {bench.MAX_BATCH}]."
        ),
    ] = None,
) -> None:
    """Decode tokens/s, KV bytes, peak memory and scoring cost of methods × budgets, all forced
    through the same tokens (the full cache's greedy output), each as a ratio to the full cache.
    With --kv-memory or --batch: batch capacity instead (how many sequences each run fits in the
    memory, and their aggregate tokens/s)."""
    try:
        capacity = capacity_options(kv_memory, batch, max_batch)
        if capacity is not None and (profile_at or plot is not None):
            raise CliError(
                "--profile-at and --plot measure one sequence: leave them out with --batch/--kv-memory"
            )
        method_names = split_list(methods, "--methods")
        budget_list = parse_budgets(budgets)
        length_list = sorted(positive_ints(lengths, "--lengths", "generated tokens"))
        if window <= 0:
            raise CliError(f"--window must be positive, got {window}")
        if sample_every <= 0:
            raise CliError(f"--sample-every must be positive, got {sample_every}")
        check_attn(attn)
        if profile_at < 0 or profile_steps <= 0:
            raise CliError("--profile-at must be >= 0 and --profile-steps positive")
        if profile_at and profile_at + 2 * profile_steps > length_list[-1]:
            raise CliError(
                f"--profile-at {profile_at} needs {profile_at + 2 * profile_steps} generated tokens "
                f"(2 × --profile-steps after it); the longest length is {length_list[-1]}"
            )
        checked = build_runs(method_names, budget_list, parse_sets(sets))  # names, knobs: before loading
        runs = list(checked)
        if all(r.label != "full" for r in runs):  # a variant (full:kv_bits=4) is no reference
            runs.insert(0, bench.BenchRun("full"))
        runs.sort(key=lambda r: r.label != "full")  # the plain full cache first: every ratio is to it
        where = check_device(device, dtype)
        threads = set_threads()
        with loading_status(model_name):
            model, tokenizer = load_model(model_name, attn_implementation=attn, **where)
        check_runs_build(model, runs)
        prompt_ids = bench.prompt_input(tokenizer, prompt)
        n = length_list[-1]
        if capacity is not None:
            memory, fixed, cap = capacity
            plans = bench.plan_batches(
                model, runs, int(prompt_ids.shape[1]), n, memory=memory, batch=fixed, max_batch=cap
            )
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))

    parts = ["--model", model_name, "--methods", methods, "--budgets", budgets, "--lengths", lengths]
    parts += ["--window", window, "--attn", attn, "--sample-every", sample_every, "--out", out]
    parts += ["--interleave"] if interleave else []
    for item in sets or []:
        parts += ["--set", item]
    parts += ["--plot", plot] if plot is not None else []
    parts += ["--prompt", prompt] if prompt != PROBLEM else []
    parts += ["--profile-at", profile_at, "--profile-steps", profile_steps] if profile_at else []
    parts += [] if capacity is None else capacity_parts(kv_memory, capacity)
    env = f"REASONKV_THREADS={os.environ['REASONKV_THREADS']} " if os.environ.get("REASONKV_THREADS") else ""
    header = {
        "kind": "bench",
        "model": model_name,
        "attn": attn,
        "command": env + command_line("bench", parts + placement_parts(where)),
    }
    machine = bench.machine_info()
    if capacity is not None:
        run_capacity(model, prompt_ids, plans, n, capacity, interleave, header, machine, runs, out, threads)
        return
    with progress_bar() as progress:
        advance = _step_progress(progress, n * (len(runs) + 1))
        record = bench.run_benchmark(
            model,
            prompt_ids,
            runs,
            length_list,
            window=window,
            interleave=interleave,
            sample_every=sample_every,
            progress=advance,
        )
        profiles = []
        if profile_at:
            ptask = progress.add_task("profiling", total=len(runs))
            tokens = torch.tensor(record["reference"]["tokens"])
            for run in runs:
                progress.update(ptask, description=f"profiling {run.label}")
                profiles.append(
                    bench.profile_decode(model, run, prompt_ids, tokens, profile_at, profile_steps)
                )
                progress.advance(ptask)

    record = _save_record(header, machine, threads, runs, {**record, "profiles": profiles}, out)

    console.print(bench.summary_table(record))
    console.print(bench.windows_table(record))
    console.print(bench.memory_table(record))
    if profiles:
        console.print(profile_table(profiles))
    if note := model_note(model_name):
        console.print(f"[dim]{escape(note)}[/dim]")
    load = machine.get("load_average") or []
    console.print(
        f"[dim]{record['wall_seconds']:.0f} s wall · {threads} torch threads · load average "
        f"{' '.join(f'{x:.2f}' for x in load)} · {escape(machine['cpu'] or '?')} · results -> "
        f"{escape(str(out))}[/dim]",
        soft_wrap=True,
    )
    if plot is not None:
        paths = bench.plot_benchmark(record, plot)
        console.print("plots -> " + ", ".join(escape(str(p)) for p in paths))


Capacity = tuple[int | None, int | None, int | None]
"""--kv-memory in bytes (None: no limit), --batch (None: auto), --max-batch (None unless auto)."""


def capacity_options(kv_memory: str | None, batch: str | None, max_batch: int | None) -> Capacity | None:
    """The batch-capacity options checked (None: not asked for); a bad one is a CliError."""
    if kv_memory is None and batch is None:
        if max_batch is not None:
            raise CliError("--max-batch applies to --batch auto (with --kv-memory)")
        return None
    memory = None
    if kv_memory is not None:
        try:
            memory = parse_bytes(kv_memory)
        except ValueError as err:
            raise CliError(f"--kv-memory: {err}") from None
    fixed = None
    if batch is not None and batch.strip().lower() != "auto":
        try:
            fixed = int(batch)
        except ValueError:
            fixed = 0
        if fixed <= 0:
            raise CliError(f"--batch takes 'auto' or a positive number of sequences, got {batch!r}")
    if fixed is None and memory is None:
        raise CliError("--batch auto needs --kv-memory (the K/V memory the batch must fit in)")
    if fixed is not None and max_batch is not None:
        raise CliError("--max-batch applies to --batch auto, not to a fixed --batch")
    if max_batch is not None and max_batch <= 0:
        raise CliError(f"--max-batch must be positive, got {max_batch}")
    return memory, fixed, (max_batch or bench.MAX_BATCH) if fixed is None else None


def capacity_parts(kv_memory: str | None, capacity: Capacity) -> list[object]:
    """The batch-capacity options as the recorded command line gives them (--kv-memory as typed)."""
    _, fixed, max_batch = capacity
    parts: list[object] = [] if kv_memory is None else ["--kv-memory", kv_memory.strip()]
    parts += ["--batch", "auto" if fixed is None else fixed]
    return parts + ([] if max_batch is None else ["--max-batch", max_batch])


def run_capacity(
    model,
    prompt_ids: torch.Tensor,
    plans: list,
    n: int,
    capacity: Capacity,
    interleave: bool,
    header: dict,
    machine: dict,
    runs: list,
    out: Path,
    threads: int,
) -> None:
    """Decode every plan's batch, write the record and print the capacity table."""
    memory, fixed, max_batch = capacity
    with progress_bar() as progress:
        advance = _step_progress(progress, n * (len(plans) + 1))
        record = bench.run_batch_capacity(
            model,
            prompt_ids,
            plans,
            n,
            memory=memory,
            batch=fixed,
            max_batch=max_batch,
            interleave=interleave,
            progress=advance,
        )
    record = _save_record(header, machine, threads, runs, record, out)
    console.print(bench.capacity_table(record))
    over = record["batch_capacity"]["over_limit"]
    if over:
        err_console.print(
            "[bold red]warning:[/bold red] measured peak (K/V and all beside it) above --kv-memory for "
            + escape(", ".join(over)),
            soft_wrap=True,
        )
    console.print(
        f"[dim]{record['wall_seconds']:.0f} s wall · {threads} torch threads · results -> "
        f"{escape(str(out))}[/dim]",
        soft_wrap=True,
    )
