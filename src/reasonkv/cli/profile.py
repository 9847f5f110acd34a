"""`reasonkv profile`: measure a model's Reasoning Wave (per-layer attention entropy) on traces,
the profile that the reasonalloc-* methods allocate budgets from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress

from reasonkv.cli.common import (
    CliError,
    DeviceOption,
    DtypeOption,
    MaxTokensOption,
    ModelOption,
    TraceLimitOption,
    VariantOption,
    check_device,
    command_line,
    console,
    fail,
    loading_status,
    placement_parts,
    progress_bar,
)
from reasonkv.core.models import DEFAULT_MODEL, load_model
from reasonkv.harness.profile import plot_wave, profile_traces
from reasonkv.harness.traces import load_problem_rows, load_traces
from reasonkv.methods.api import GREEDY
from reasonkv.methods.api import generate as generate_text
from reasonkv.methods.profiles import save_profile
from reasonkv.util.runtime import set_threads


def _generated_traces(
    model, tokenizer, problems: list[dict], max_tokens: int, progress: Progress
) -> list[dict]:
    """Let the model write its own traces (full cache, greedy) for problem rows."""
    rows = []
    task = progress.add_task("generating traces", total=len(problems))
    for row in problems:
        texts, _ = generate_text(
            model,
            tokenizer,
            row["problem"],
            max_new_tokens=max_tokens,
            **GREEDY,
        )
        rows.append({"id": str(row.get("id", len(rows))), "problem": row["problem"], "trace": texts[0]})
        progress.advance(task)
    return rows


def profile_command(
    traces: Annotated[
        Path, typer.Option("--traces", help="jsonl with id, problem, trace (or problems with --generate).")
    ],
    out: Annotated[Path, typer.Option("--out", help="Where to write the profile JSON.")],
    model_name: ModelOption = DEFAULT_MODEL,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    limit: TraceLimitOption = None,
    variant: VariantOption = "well_posed",
    max_tokens: MaxTokensOption = 2048,
    stride: Annotated[int, typer.Option(help="Profile every N-th trace position.")] = 16,
    chunk: Annotated[int, typer.Option(help="Tokens per forward while replaying.")] = 64,
    topk: Annotated[int, typer.Option(help="k of the top-k attention mass signal.")] = 64,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Also draw the Reasoning Wave here (PNG).")
    ] = None,
    generate: Annotated[
        bool, typer.Option("--generate", help="--traces holds problems: the model writes the traces first.")
    ] = False,
) -> None:
    """Profile the Reasoning Wave: per-layer attention entropy while replaying reasoning traces."""
    try:
        if generate:
            problems = load_problem_rows(traces, limit)
            if not problems:
                raise CliError(f"{traces}: --generate needs rows with a `problem` field")
        else:
            rows = load_traces(traces, limit=limit, variant=None if variant == "all" else variant)
            if not rows:
                raise CliError(f"{traces}: no traces of variant {variant!r}")
        if max_tokens <= 0 or stride <= 0 or chunk <= 0:
            raise CliError("--max-tokens, --stride and --chunk must be positive")
        where = check_device(device, dtype)
        set_threads()
        with loading_status(model_name):
            model, tokenizer = load_model(model_name, **where)
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))
    parts = [
        "--traces",
        traces,
        "--out",
        out,
        "--model",
        model_name,
        "--variant",
        variant,
        "--max-tokens",
        max_tokens,
        "--stride",
        stride,
        "--chunk",
        chunk,
        "--topk",
        topk,
    ]
    parts += ["--limit", limit] if limit is not None else []
    parts += ["--plot", plot] if plot is not None else []
    parts += ["--generate"] if generate else []
    with progress_bar() as progress:
        if generate:
            rows = _generated_traces(model, tokenizer, problems, max_tokens, progress)
        task = progress.add_task("profiling traces", total=len(rows))
        profile = profile_traces(
            model,
            tokenizer,
            rows,
            max_tokens=max_tokens,
            chunk=chunk,
            stride=stride,
            topk=topk,
            command=command_line("profile", parts + placement_parts(where)),
            progress=lambda done, total, _id: progress.update(task, completed=done),
        )
    save_profile(profile, out)
    console.print(
        f"profile of {profile['model']} from {len(rows)} traces ({profile['tokens_seen']} tokens) -> {out}"
    )
    console.print("demand per layer: " + " ".join(f"{d:.3f}" for d in profile["demand"]), soft_wrap=True)
    if plot is not None:
        console.print(f"Reasoning Wave plot -> {plot_wave(profile, plot)}")
