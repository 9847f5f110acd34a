"""The `reasonkv` command line: list methods, generate under a KV budget, run the demo.

Every user error (unknown method or knob, bad budget, missing or unsupported model) ends
as one red line and exit code 2, never a traceback. Later commands (profile, replay, eval,
sweep, bench, analyze, plot) are added to `app` the same way, one function each.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
import typing
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reasonkv.core.models import DEFAULT_MODEL, load_model
from reasonkv.harness.demo import memory_summary, run_demo
from reasonkv.harness.runs import load_run, plot_head_budgets, run_record, save_run
from reasonkv.methods.api import generate as generate_text
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import check_knobs
from reasonkv.methods.registry import METHODS, PROTECTION_KNOBS, MethodSpec, get_method
from reasonkv.util.formatting import format_bytes
from reasonkv.util.runtime import quiet_loading, set_threads

app = typer.Typer(
    name="reasonkv",
    help="Keep the KV cache of a reasoning LLM small while it writes a long chain of thought.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

USAGE_ERROR = 2
MODEL_HELP = "Bundled name (smollm2-135m), local directory or .gguf file, or Hugging Face id."


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def fail(message: str) -> typing.NoReturn:
    err_console.print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(USAGE_ERROR)


# ------------------------------------------------------------------ lists
def split_list(text: str, option: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']; an empty list is an error naming the option."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise CliError(f"{option} takes a comma-separated list, got {text!r}")
    return items


def positive_ints(text: str, option: str, what: str) -> list[int]:
    """'64,128,64' -> [64, 128] (first occurrence order); anything but positive integers is an
    error naming the option and what the numbers count (`what`)."""
    values = []
    for item in split_list(text, option):
        try:
            value = int(item)
        except ValueError:
            raise CliError(f"{option} takes positive integers ({what}), got {item!r}") from None
        if value <= 0:
            raise CliError(f"{option} takes positive integers ({what}), got {value}")
        values.append(value)
    return list(dict.fromkeys(values))


# ------------------------------------------------------------------ knobs
def parse_value(text: str) -> object:
    """Auto-type a `--set` value: true/false -> bool, none -> None, then int, float, str."""
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_sets(items: list[str] | None) -> dict[str, object]:
    """['window=16', 'pooling=avg'] -> {'window': 16, 'pooling': 'avg'} (later items win)."""
    out: dict[str, object] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CliError(f"--set takes key=value, got {item!r}")
        out[key] = parse_value(value)
    return out


def describe_schedule(spec: MethodSpec) -> str:
    """The schedule with this method's defaults, e.g. 'buffer(every 128)'."""
    sched = spec.schedule
    if isinstance(sched, type):
        names = {f.name for f in dataclasses.fields(sched) if f.init and f.name != "name"}
        sched = sched(**{k: v for k, v in spec.knobs().items() if k in names})
    return sched.describe()


def format_knobs(spec: MethodSpec) -> str:
    return " ".join(f"{k}={v}" for k, v in spec.knobs().items())


# --------------------------------------------------------------- commands
def methods_markdown() -> str:
    """The method table as Markdown (the README's table is this output)."""
    rows = ["| method | what it does | schedule | default knobs | paper |", "|---|---|---|---|---|"]
    for name, spec in METHODS.items():
        knobs = f"`{format_knobs(spec)}`"
        cells = [f"`{name}`", spec.description, describe_schedule(spec), knobs, spec.paper]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


@app.command("methods")
def methods_command(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown table instead.")] = False,
) -> None:
    """List every registered KV-cache method with its schedule and default parameters."""
    if markdown:
        typer.echo(methods_markdown())
        return
    narrow = console.width < 110  # fold the paper into the description rather than squeeze 5 columns
    table = Table(title="reasonkv methods", show_lines=True, expand=True)
    longest = max((len(n) for n in METHODS), default=4)
    table.add_column("name", style="bold cyan", no_wrap=True, min_width=longest)
    table.add_column("description" + (" / paper" if narrow else ""), ratio=3)
    table.add_column("schedule", min_width=12, max_width=14 if narrow else 22)
    table.add_column("default knobs (--set key=value)", ratio=2, overflow="fold")
    if not narrow:
        table.add_column("paper", ratio=2)
    for name, spec in METHODS.items():
        # Registry text is plain: escape it so a "[...]" in a description is not read as markup.
        desc, paper = escape(spec.description), escape(spec.paper)
        row = [escape(name), desc, escape(describe_schedule(spec)), escape(format_knobs(spec))]
        if narrow:
            row[1] = desc if spec.paper == "-" else f"{desc}\n[dim]{paper}[/dim]"
        else:
            row.append(paper)
        table.add_row(*row)
    console.print(table)
    protect = ", ".join(f"{k}: {v}" for k, v in PROTECTION_KNOBS.items())
    console.print(f"Every compressing method also takes the protection knobs ({protect}).", markup=False)


@app.command("generate")
def generate_command(
    prompt: Annotated[str, typer.Argument(help="The user message (wrapped in the chat template).")],
    method: Annotated[str, typer.Option("--method", "-m", help="A name from `reasonkv methods`.")] = "snapkv",
    budget: Annotated[int, typer.Option("--budget", "-b", help="Tokens kept per KV head.")] = 128,
    model_name: Annotated[str, typer.Option("--model", help=MODEL_HELP)] = DEFAULT_MODEL,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 256,
    sample: Annotated[bool, typer.Option("--sample/--greedy", help="Sample, or decode greedily.")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (with --sample).")] = 0.6,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (with --sample).")] = 0.95,
    seed: Annotated[int | None, typer.Option(help="Seed torch's RNG (sampling).")] = None,
    attn: Annotated[str, typer.Option(help="Attention backend: sdpa or eager.")] = "sdpa",
    chat: Annotated[bool, typer.Option("--chat/--raw", help="Apply the chat template.")] = True,
    sets: Annotated[
        list[str] | None, typer.Option("--set", "-s", help="Method parameter key=value (repeatable).")
    ] = None,
    record: Annotated[
        Path | None, typer.Option("--record", help="Save the run (compression events) as JSON here.")
    ] = None,
    profile: Annotated[
        Path | None, typer.Option("--profile", help="Reasoning Wave profile for reasonalloc-* methods.")
    ] = None,
) -> None:
    """Generate a reply with a compressed KV cache and report what the cache holds."""
    try:
        spec = get_method(method)
        knobs = check_knobs(spec, parse_sets(sets))
        if profile is not None:
            if "profile" not in spec.knobs():
                raise CliError(f"--profile is for profile-driven methods (reasonalloc-*), not {method!r}")
            if not profile.exists():
                raise CliError(f"no profile at {profile}")
            knobs["profile"] = str(profile)
        if spec.compresses and budget <= 0:
            raise CliError(f"budget must be a positive number of tokens per KV head, got {budget}")
        if attn not in ("sdpa", "eager"):
            raise CliError(f"--attn must be sdpa or eager, got {attn!r}")
        if max_new_tokens <= 0:
            raise CliError(f"--max-new-tokens must be positive, got {max_new_tokens}")
        set_threads()
        with err_console.status(f"loading {model_name}…"), quiet_loading():
            model, tokenizer = load_model(model_name, attn_implementation=attn)
        cache = make_cache(model, method, budget, **knobs)
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))

    if seed is not None:
        torch.manual_seed(seed)
    gen_kwargs: dict[str, object] = {"max_new_tokens": max_new_tokens, "do_sample": sample}
    if sample:
        gen_kwargs.update(temperature=temperature, top_p=top_p)
    else:  # silence "temperature is set but do_sample=False" from the model's generation config
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    start = time.perf_counter()
    with err_console.status(f"generating with {method} (budget {budget})…"):
        texts, new_tokens = generate_text(model, tokenizer, prompt, cache=cache, chat=chat, **gen_kwargs)
    elapsed = time.perf_counter() - start
    typer.echo(texts[0])
    mem = memory_summary(cache)
    n_new = int(new_tokens.shape[1])
    console.print(
        f"[dim]{method} budget={budget if spec.compresses else '-'}: {n_new} new tokens, "
        f"{n_new / max(elapsed, 1e-9):.1f} tok/s | KV {format_bytes(mem['kv_bytes'])} "
        f"(physical {format_bytes(mem['physical_bytes'])}) | mean live tokens/head {mem['live_mean']:.1f} | "
        f"seen {mem['seen_tokens']} | compressions/layer {mem['compressions']:g}[/dim]",
        soft_wrap=True,
    )
    if record is not None:
        meta = {"model": model_name, "budget": budget, "knobs": knobs, "prompt": prompt, "new_tokens": n_new}
        save_run(run_record(cache, **meta), record)
        console.print(f"[dim]run saved to {record} (plot it: reasonkv plot budgets {record})[/dim]")


@app.command("demo")
def demo_command(
    model_name: Annotated[str, typer.Option("--model", help=MODEL_HELP)] = DEFAULT_MODEL,
    budget: Annotated[int, typer.Option("--budget", "-b")] = 128,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", "-n")] = None,
) -> None:
    """Full cache vs SnapKV vs StreamingLLM on one math problem: tokens, speed, memory, divergence."""
    kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    try:
        run_demo(model=model_name, budget=budget, **kwargs)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


# ---------------------------------------------------------------- profile
def _generated_traces(model, tokenizer, problems: list[dict], max_tokens: int, progress) -> list[dict]:
    """Let the model write its own traces (full cache, greedy) for problem rows."""
    from reasonkv.methods.api import generate as gen

    rows = []
    task = progress.add_task("generating traces", total=len(problems))
    for row in problems:
        texts, _ = gen(
            model,
            tokenizer,
            row["problem"],
            max_new_tokens=max_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        rows.append({"id": str(row.get("id", len(rows))), "problem": row["problem"], "trace": texts[0]})
        progress.advance(task)
    return rows


@app.command("profile")
def profile_command(
    traces: Annotated[
        Path, typer.Option("--traces", help="jsonl with id, problem, trace (or problems with --generate).")
    ],
    out: Annotated[Path, typer.Option("--out", help="Where to write the profile JSON.")],
    model_name: Annotated[str, typer.Option("--model", help=MODEL_HELP)] = DEFAULT_MODEL,
    limit: Annotated[int | None, typer.Option("--limit", help="Use the first N traces.")] = None,
    variant: Annotated[
        str, typer.Option("--variant", help="Keep rows of this `variant` ('all' = every row).")
    ] = "well_posed",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Truncate prompt + trace to this.")] = 2048,
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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from reasonkv.harness.profile import plot_wave, profile_traces
    from reasonkv.harness.traces import load_traces
    from reasonkv.methods.profiles import save_profile

    try:
        if generate:
            problems = [json.loads(line) for line in traces.read_text().splitlines() if line.strip()]
            problems = problems[:limit] if limit is not None else problems
            if not problems or any("problem" not in p for p in problems):
                raise CliError(f"{traces}: --generate needs rows with a `problem` field")
        else:
            rows = load_traces(traces, limit=limit, variant=None if variant == "all" else variant)
            if not rows:
                raise CliError(f"{traces}: no traces of variant {variant!r}")
        if max_tokens <= 0 or stride <= 0 or chunk <= 0:
            raise CliError("--max-tokens, --stride and --chunk must be positive")
        set_threads()
        with err_console.status(f"loading {model_name}…"), quiet_loading():
            model, tokenizer = load_model(model_name)
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))
    # The command that reproduces this profile, from the parsed options (not sys.argv, which
    # is not ours when the app is invoked from Python).
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
    command = "reasonkv profile " + " ".join(shlex.quote(str(a)) for a in parts)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console) as progress:
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
            command=command,
            progress=lambda done, total, _id: progress.update(task, completed=done),
        )
    save_profile(profile, out)
    console.print(
        f"profile of {profile['model']} from {len(rows)} traces ({profile['tokens_seen']} tokens) -> {out}"
    )
    console.print("demand per layer: " + " ".join(f"{d:.3f}" for d in profile["demand"]), soft_wrap=True)
    if plot is not None:
        console.print(f"Reasoning Wave plot -> {plot_wave(profile, plot)}")


# ------------------------------------------------------------------- plot
plot_app = typer.Typer(help="Draw figures from saved runs and profiles.", no_args_is_help=True)
app.add_typer(plot_app, name="plot")


def _parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"--layers takes comma-separated layer numbers, got {text!r}")


@plot_app.command("budgets")
def plot_budgets_command(
    run: Annotated[Path, typer.Argument(help="A run saved by `reasonkv generate --record`.")],
    out: Annotated[Path, typer.Option("--out", help="PNG to write.")] = Path("budgets.png"),
    layers: Annotated[str | None, typer.Option("--layers", help="e.g. 0,5,29 (default: all).")] = None,
) -> None:
    """Heatmap of per-head budgets over decoding steps, one panel per layer."""
    try:
        path = plot_head_budgets(load_run(run), out, _parse_layers(layers))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    console.print(f"head budgets -> {path}")


@plot_app.command("wave")
def plot_wave_command(
    profile: Annotated[Path, typer.Argument(help="A profile JSON from `reasonkv profile`.")],
    out: Annotated[Path, typer.Option("--out", help="PNG to write.")] = Path("wave.png"),
) -> None:
    """The Reasoning Wave of a profile: per-layer demand with its spread across traces."""
    from reasonkv.harness.profile import plot_wave
    from reasonkv.methods.profiles import load_profile

    try:
        path = plot_wave(load_profile(profile), out)
    except (ValueError, FileNotFoundError, KeyError) as err:
        fail(str(err))
    console.print(f"Reasoning Wave -> {path}")


# ------------------------------------------------------- evaluation commands
# Each lives beside its harness; registered here so `reasonkv --help` lists them all.
from reasonkv.cli.evaluate import eval_command  # noqa: E402
from reasonkv.cli.replay import replay_command  # noqa: E402
from reasonkv.cli.sweep import report_command, sweep_command  # noqa: E402

app.command("replay")(replay_command)
app.command("eval")(eval_command)
app.command("sweep")(sweep_command)
app.command("report")(report_command)

from reasonkv.cli.analyze import analyze_command  # noqa: E402
from reasonkv.cli.bench import bench_command  # noqa: E402

app.command("analyze")(analyze_command)
app.command("bench")(bench_command)


def main() -> None:  # pragma: no cover - `python -m reasonkv.cli.main`
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
