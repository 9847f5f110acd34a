"""`reasonkv eval`: math accuracy (pass@1; pass@k and maj@k with --samples) of a model under a
KV budget, with length, truncation, bootstrap standard errors, and one JSON line per sample."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from reasonkv.cli.common import (
    AttnOption,
    BudgetOption,
    CliError,
    DeviceOption,
    DtypeOption,
    MethodOption,
    MethodSetsOption,
    ModelOption,
    check_attn,
    check_device,
    command_line,
    console,
    err_console,
    fail,
    loading_status,
    parse_sets,
    placement_parts,
    progress_bar,
)
from reasonkv.core.models import DEFAULT_MODEL, load_model, model_note
from reasonkv.harness.accuracy import evaluate, sample_rows
from reasonkv.harness.answers import FALLBACK_WARNING, STRING_MATCH, grader
from reasonkv.harness.datasets import DATA_DIR_ENV, KNOWN, load_problems_from
from reasonkv.harness.sweep.log import git_info, versions
from reasonkv.methods.api import make_cache
from reasonkv.methods.registry import get_method
from reasonkv.methods.resolved import resolve_method
from reasonkv.util.formatting import format_bytes
from reasonkv.util.records import utc_timestamp, write_json_atomic, write_jsonl_atomic
from reasonkv.util.runtime import set_threads
from reasonkv.util.tables import fill_table

THINK_HELP = (
    "For thinking models: if the completion has not closed </think> after N tokens, append "
    "'\\n</think>\\n\\n' and let it answer with the rest of --max-new-tokens (one sequence per call)."
)


SAMPLES_SUFFIX = ".samples.jsonl"


def samples_path(out: Path | None, samples_out: Path | None) -> Path | None:
    """Where the per-sample JSONL goes: --samples-out, else --out with its suffix replaced by
    SAMPLES_SUFFIX (r.json -> r.samples.jsonl), else nowhere."""
    if samples_out is not None:
        return samples_out
    return None if out is None else out.with_name(out.stem + SAMPLES_SUFFIX)


def score_names(result: dict) -> list[str]:
    """The aggregates this run has, in table order: pass@1, pass@2, ..., maj@2, ..."""
    names = [k for k in result if k.startswith("pass@")]
    return names + [k for k in result if k.startswith("maj@")]


def with_stderr(result: dict, name: str) -> str:
    se = result.get("stderr", {}).get(name)
    return f"{result[name]:.3f}" + ("" if se is None else f" ±{se:.3f}")


def summary_table(result: dict) -> Table | Group:
    budget = result["budget"] if get_method(result["method"]).compresses else "-"
    decoding = "greedy" if result["greedy"] else f"T {result['temperature']}, top-p {result['top_p']}"
    size = f"{result['n_problems']} problems × {result['n_samples']} samples"
    grading = result.get("grader", "")
    table = Table(
        title=f"{result['dataset']} · {size} · {decoding}" + (f" · graded by {grading}" if grading else ""),
        caption="pass@k: unbiased estimate from the samples; maj@k: majority answer of the first k; "
        "±: bootstrap standard error over problems. length: generated tokens per sample (EOS "
        "included); truncated: hit --max-new-tokens without EOS; KV: per sequence over decoding "
        "steps, storage peak and live-token mean."
        + (f" {note}." if (note := model_note(result.get("model", ""))) else ""),
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    scores = score_names(result)
    row = [
        result["method"],
        str(budget),
        *(with_stderr(result, name) for name in scores),
        f"{result['mean_length']:.1f}",
        f"{result['truncation_rate']:.1%}",
        f"{result['tokens_per_second']:.1f}",
        format_bytes(int(result["peak_kv_bytes"])),
        format_bytes(int(result["mean_live_kv_bytes"])),
    ]
    columns = ("method", "budget", *scores, "mean length", "truncated", "tok/s", "peak KV", "mean live KV")
    optional = ("mean live KV", "tok/s", "peak KV", *reversed(scores[1:]))
    return fill_table(table, columns, [row], optional=optional)


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
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    method: MethodOption = "snapkv",
    budget: BudgetOption = 128,
    sets: MethodSetsOption = None,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", help=f"Folder holding <dataset>.jsonl (default: ${DATA_DIR_ENV})."),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Use the first N problems.")] = None,
    ids: Annotated[str | None, typer.Option("--ids", help="Comma-separated problem ids to run.")] = None,
    samples: Annotated[
        int,
        typer.Option(
            "--samples", "-k", help="Completions per problem (over 1 needs --sample; adds pass@k, maj@k)."
        ),
    ] = 1,
    sample: Annotated[
        bool,
        typer.Option(
            "--sample/--greedy",
            help="Sample with --temperature and --top-p. Default: greedy decoding, as in generate and demo.",
        ),
    ] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (with --sample).")] = 0.6,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (with --sample).")] = 0.95,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", help="Cap on generated tokens per completion.")
    ] = 512,
    think_budget: Annotated[int | None, typer.Option("--think-budget", help=THINK_HELP)] = None,
    seed: Annotated[int, typer.Option(help="Seed of the sampling (with --sample).")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per generate call.")] = 1,
    attn: AttnOption = "sdpa",
    hub: Annotated[
        bool, typer.Option("--hub/--no-hub", help="May fetch known datasets from the Hugging Face hub.")
    ] = True,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Write the summary as JSON (scores, per-problem results, config, versions, git "
            f"commit), and every sample as a JSON line beside it (OUT's name with {SAMPLES_SUFFIX}).",
        ),
    ] = None,
    samples_out: Annotated[
        Path | None,
        typer.Option("--samples-out", help="Write the per-sample JSONL here instead (works without --out)."),
    ] = None,
) -> None:
    """Task accuracy on MATH-500 / AIME under a KV budget: pass@1 (pass@k and maj@k with --samples
    N --sample), each with a bootstrap standard error, mean length and truncation. Decodes
    greedily unless --sample."""
    try:
        resolved = resolve_method(method, budget, parse_sets(sets))
        if min(samples, max_new_tokens, batch_size) <= 0:
            raise CliError("--samples, --max-new-tokens and --batch-size must be positive")
        if not sample and samples > 1:
            raise CliError(
                "--greedy (the default) gives the same completion every time: add --sample to draw "
                f"--samples {samples}, or use --samples 1"
            )
        if think_budget is not None and not 0 < think_budget < max_new_tokens:
            raise CliError(f"--think-budget must be between 1 and --max-new-tokens - 1, got {think_budget}")
        check_attn(attn)
        id_list = [i.strip() for i in ids.split(",") if i.strip()] if ids else None
        problems, source = load_problems_from(dataset, limit=limit, ids=id_list, data_dir=data_dir, hub=hub)
        if not problems:
            raise CliError(f"{dataset}: no problems to evaluate")
        where = check_device(device, dtype)
        set_threads()
        with loading_status(model_name):
            model, tokenizer = load_model(model_name, attn_implementation=attn, **where)
        make_cache(model, resolved)  # e.g. a layer's budget below the protected window
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))

    judge = grader()
    if judge == STRING_MATCH:
        err_console.print(f"[bold yellow]warning:[/bold yellow] {escape(FALLBACK_WARNING)}", soft_wrap=True)
    started = time.perf_counter()
    with progress_bar(transient=True) as progress:
        task = progress.add_task(f"{method} on {dataset}", total=len(problems) * samples)
        result = evaluate(
            model,
            tokenizer,
            problems,
            resolved,
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
    config = {
        "model": model_name,
        "dataset": dataset,
        "data_source": source,
        "data_dir": None if data_dir is None else str(data_dir),
        "limit": limit,
        "ids": id_list,
        "method": method,
        "budget": budget,
        "knobs": dict(resolved.knobs),
        "samples": samples,
        "greedy": not sample,
        "temperature": None if not sample else temperature,
        "top_p": None if not sample else top_p,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "think_budget": think_budget,
        "batch_size": batch_size,
        "attn": attn,
        "hub": hub,
    }
    parts = ["--dataset", dataset, "--model", model_name, "--method", method, "--budget", budget]
    for item in sets or []:
        parts += ["--set", item]
    parts += ["--data-dir", data_dir] if data_dir is not None else []
    parts += ["--limit", limit] if limit is not None else []
    parts += ["--ids", ids] if ids is not None else []
    parts += ["--samples", samples]
    parts += ["--sample", "--temperature", temperature, "--top-p", top_p] if sample else []
    parts += ["--max-new-tokens", max_new_tokens, "--seed", seed, "--batch-size", batch_size]
    parts += ["--think-budget", think_budget] if think_budget is not None else []
    parts += ["--attn", attn] + ([] if hub else ["--no-hub"])
    parts += ["--out", out] if out is not None else []
    parts += ["--samples-out", samples_out] if samples_out is not None else []
    samples_file = samples_path(out, samples_out)
    result = {
        "kind": "eval",
        "model": model_name,
        "dataset": dataset,
        "data_source": source,
        "seconds": time.perf_counter() - started,
        **result,
        "grader": judge,
        "config": config,
        "versions": versions(),
        "git": git_info(),
        "command": command_line("eval", parts + placement_parts(where)),
        "created": utc_timestamp(),
        "samples_file": None if samples_file is None else str(samples_file),
    }
    for row in result["problems"]:
        console.print(escape(problem_line(row)), soft_wrap=True)
    console.print(summary_table(result))
    if samples_file is not None:
        write_jsonl_atomic(sample_rows(result), samples_file)
        console.print(f"[dim]samples -> {escape(str(samples_file))}[/dim]", soft_wrap=True)
    if out is not None:
        write_json_atomic(result, out, indent=1)
        console.print(f"[dim]results -> {escape(str(out))}[/dim]", soft_wrap=True)
