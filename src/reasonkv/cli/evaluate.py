"""`reasonkv eval`: math accuracy (pass@1) of a model under a KV budget, with length and truncation."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from reasonkv.cli.common import (
    AttnOption,
    BudgetOption,
    CliError,
    MethodOption,
    MethodSetsOption,
    ModelOption,
    check_attn,
    check_budget,
    console,
    fail,
    loading_status,
    parse_sets,
    progress_bar,
)
from reasonkv.core.models import DEFAULT_MODEL, load_model
from reasonkv.harness.accuracy import evaluate
from reasonkv.harness.datasets import DATA_DIR_ENV, KNOWN, load_problems_from
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import check_knobs
from reasonkv.methods.registry import get_method
from reasonkv.util.formatting import format_bytes
from reasonkv.util.runtime import set_threads
from reasonkv.util.tables import fill_table

THINK_HELP = (
    "For thinking models: if the completion has not closed </think> after N tokens, append "
    "'\\n</think>\\n\\n' and let it answer with the rest of --max-new-tokens (one sequence per call)."
)


def summary_table(result: dict) -> Table:
    budget = result["budget"] if get_method(result["method"]).compresses else "-"
    decoding = "greedy" if result["greedy"] else f"T {result['temperature']}, top-p {result['top_p']}"
    size = f"{result['n_problems']} problems × {result['n_samples']} samples"
    table = Table(
        title=f"{result['dataset']} · {size} · {decoding}",
        caption="length: generated tokens per sample (EOS included); truncated: hit --max-new-tokens without "
        "EOS; KV: per sequence over decoding steps, storage peak and live-token mean.",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    row = [
        result["method"],
        str(budget),
        f"{result['pass@1']:.3f}",
        f"{result['mean_length']:.1f}",
        f"{result['truncation_rate']:.1%}",
        f"{result['tokens_per_second']:.1f}",
        format_bytes(int(result["peak_kv_bytes"])),
        format_bytes(int(result["mean_live_kv_bytes"])),
    ]
    columns = ("method", "budget", "pass@1", "mean length", "truncated", "tok/s", "peak KV", "mean live KV")
    return fill_table(table, columns, [row])


def problem_line(row: dict) -> str:
    marks = "".join("✓" if c else "✗" for c in row["correct"])
    preds = ", ".join("∅" if p is None else p for p in row["predictions"])
    cut = sum(row["truncated"])
    lengths = "/".join(map(str, row["lengths"]))
    tail = f" · {cut} truncated" if cut else ""
    return f"{marks} {row['id']}: gold {row['answer']} · predicted {preds} · {lengths} tokens{tail}"


def eval_command(
    dataset: Annotated[
        str, typer.Option("--dataset", "-d", help=f"{', '.join(KNOWN)}, or a jsonl with id, problem, answer.")
    ] = "math500",
    model_name: ModelOption = DEFAULT_MODEL,
    method: MethodOption = "snapkv",
    budget: BudgetOption = 128,
    sets: MethodSetsOption = None,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", help=f"Folder holding <dataset>.jsonl (default: ${DATA_DIR_ENV})."),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Use the first N problems.")] = None,
    ids: Annotated[str | None, typer.Option("--ids", help="Comma-separated problem ids to run.")] = None,
    samples: Annotated[int, typer.Option("--samples", "-k", help="Completions per problem.")] = 1,
    sample: Annotated[
        bool, typer.Option("--sample/--greedy", help="Sample (T, top-p), or decode greedily.")
    ] = True,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 0.6,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 0.95,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", help="Cap on generated tokens per completion.")
    ] = 512,
    think_budget: Annotated[int | None, typer.Option("--think-budget", help=THINK_HELP)] = None,
    seed: Annotated[int, typer.Option(help="Seed of the sampling.")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per generate call.")] = 1,
    attn: AttnOption = "sdpa",
    hub: Annotated[
        bool, typer.Option("--hub/--no-hub", help="May fetch known datasets from the Hugging Face hub.")
    ] = True,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the full results as JSON.")] = None,
) -> None:
    """Task accuracy: pass@1 on MATH-500 / AIME under a KV budget, with mean length and truncation."""
    try:
        spec = get_method(method)
        knobs = check_knobs(spec, parse_sets(sets))
        if spec.compresses:
            check_budget(budget)
        if min(samples, max_new_tokens, batch_size) <= 0:
            raise CliError("--samples, --max-new-tokens and --batch-size must be positive")
        if not sample and samples > 1:
            raise CliError("--greedy gives the same completion every time: use --samples 1 or --sample")
        if think_budget is not None and not 0 < think_budget < max_new_tokens:
            raise CliError(f"--think-budget must be between 1 and --max-new-tokens - 1, got {think_budget}")
        check_attn(attn)
        id_list = [i.strip() for i in ids.split(",") if i.strip()] if ids else None
        problems, source = load_problems_from(dataset, limit=limit, ids=id_list, data_dir=data_dir, hub=hub)
        if not problems:
            raise CliError(f"{dataset}: no problems to evaluate")
        set_threads()
        with loading_status(model_name):
            model, tokenizer = load_model(model_name, attn_implementation=attn)
        make_cache(model, method, budget, **knobs)  # e.g. a budget below the protected window
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))

    started = time.perf_counter()
    with progress_bar(transient=True) as progress:
        task = progress.add_task(f"{method} on {dataset}", total=len(problems) * samples)
        result = evaluate(
            model,
            tokenizer,
            problems,
            method,
            budget,
            knobs,
            n_samples=samples,
            greedy=not sample,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=seed,
            batch_size=batch_size,
            think_budget=think_budget,
            progress=lambda done, total, _id: progress.update(task, completed=done),
        )
    result = {
        "model": model_name,
        "dataset": dataset,
        "data_source": source,
        "seconds": time.perf_counter() - started,
        **result,
    }
    for row in result["problems"]:
        console.print(escape(problem_line(row)), soft_wrap=True)
    console.print(summary_table(result))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        console.print(f"[dim]results -> {escape(str(out))}[/dim]")
