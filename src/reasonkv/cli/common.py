"""What every `reasonkv` command shares: the consoles, the one-line user error, list and
`--set` parsing, and the option declarations that several commands repeat.

A user error (unknown method or knob, bad budget, missing model) ends as one red line on
stderr and exit code 2, never a traceback: commands raise `CliError` (or a library
ValueError) before any slow work and hand the message to `fail`.
"""

from __future__ import annotations

import contextlib
import shlex
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from reasonkv.core.models import resolve_device, resolve_dtype
from reasonkv.core.policy.knob import MAX_TOKENS
from reasonkv.core.random_models import RANDOM_MODELS
from reasonkv.harness.record_knobs import recorded
from reasonkv.harness.replay_run import ReplayRun
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import share_knobs
from reasonkv.methods.registry import get_method
from reasonkv.methods.resolved import resolve_method
from reasonkv.util.progress import LineProgress, progress_for
from reasonkv.util.runtime import quiet_loading

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

USAGE_ERROR = 2
MODEL_HELP = (
    "Bundled name (smollm2-135m), local directory or .gguf file, Hugging Face id, or "
    f"random:NAME[:layers=2,hidden=64,...] ({', '.join(RANDOM_MODELS)}): a real model's shape with "
    "random weights, for speed and memory work only, meaningless for fidelity."
)

# Options that several commands declare the same way (the default stays with each command).
ModelOption = Annotated[str, typer.Option("--model", help=MODEL_HELP)]
MethodOption = Annotated[str, typer.Option("--method", "-m", help="A name from `reasonkv methods`.")]
BudgetOption = Annotated[int, typer.Option("--budget", "-b", help="Tokens kept per KV head.")]
BudgetsOption = Annotated[str, typer.Option("--budgets", "-b", help="Comma-separated tokens per KV head.")]
AttnOption = Annotated[str, typer.Option(help="Attention backend: sdpa or eager.")]
DeviceOption = Annotated[
    str, typer.Option("--device", help="auto (CUDA when present, else cpu), cpu, cuda, cuda:N or mps.")
]
DtypeOption = Annotated[
    str, typer.Option("--dtype", help="auto (bfloat16 on CUDA, else float32), float32, bfloat16 or float16.")
]
MethodSetsOption = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Method parameter key=value (repeatable).")
]
SharedSetsOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="key=value for every method that has the knob (repeatable)."),
]
TracesOption = Annotated[Path, typer.Option("--traces", help="jsonl with id, problem, trace.")]
VariantOption = Annotated[
    str, typer.Option("--variant", help="Keep rows of this `variant` ('all' = every row).")
]
MaxTokensOption = Annotated[int, typer.Option("--max-tokens", help="Truncate prompt + trace to this.")]
TraceLimitOption = Annotated[int | None, typer.Option("--limit", help="Use the first N traces.")]
ResultsOutOption = Annotated[Path, typer.Option("--out", help="Where to write the results JSON.")]


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def fail(message: str) -> typing.NoReturn:
    err_console.print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(USAGE_ERROR)


def check_attn(attn: str) -> None:
    if attn not in ("sdpa", "eager"):
        raise CliError(f"--attn must be sdpa or eager, got {attn!r}")


def check_device(device: str, dtype: str) -> dict[str, object]:
    """--device and --dtype as load_model's keywords; a bad or unavailable value is a CliError
    (checked before the model loads)."""
    try:
        resolved = resolve_device(device)
        return {"device": resolved, "dtype": resolve_dtype(dtype, resolved)}
    except ValueError as err:
        raise CliError(f"--device/--dtype: {err}") from None


def placement_parts(where: dict[str, object]) -> list[object]:
    """--device and --dtype as they resolved, for a saved command: rerun on another machine, it
    runs what ran here (auto would pick that machine's own)."""
    return ["--device", str(where["device"]), "--dtype", str(where["dtype"]).removeprefix("torch.")]


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


def parse_budgets(text: str, option: str = "--budgets") -> list[int]:
    """'64,128' -> [64, 128]: positive, and at most MAX_TOKENS (each method checks the rest when
    its runs are built)."""
    budgets = positive_ints(text, option, "tokens per KV head")
    for budget in budgets:
        if budget > MAX_TOKENS:
            raise CliError(f"{option} takes at most {MAX_TOKENS} tokens per KV head, got {budget}")
    return budgets


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


def parse_method_entry(entry: str) -> tuple[str, dict[str, object]]:
    """'snapkv:kv_bits=4:group_size=32' -> ('snapkv', {'kv_bits': 4, 'group_size': 32}): a
    method with knobs of its own, beside --set's shared ones."""
    name, *items = entry.split(":")
    own: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"method {entry!r}: knobs go as method:key=value:key=value, got {item!r}")
        own[key.strip()] = parse_value(value)
    return name.strip(), own


def build_runs(methods: list[str], budgets: list[int], knobs: dict[str, object]) -> list[ReplayRun]:
    """Every (method, budget), `full` once. A --set knob goes to every method that has it; a
    knob that none of the methods knows is an error (a typo would otherwise be ignored), and so
    is a budget below a method's protected window. An entry `method:key=value` gives that run
    knobs of its own (over --set's), so one method can run under two settings side by side."""
    entries = list(
        dict.fromkeys((name, tuple(own.items())) for name, own in map(parse_method_entry, methods))
    )
    shared = share_knobs([name for name, _ in entries], knobs)
    runs = []
    for name, extra in entries:
        own = (
            shared[name]
            if not extra
            else share_knobs([name], {}, {name: {**shared[name], **dict(extra)}})[name]
        )
        ignored = [k for k, _ in extra if k not in own]
        if ignored:  # a method that never compresses takes its storage knobs only
            raise CliError(f"method {name!r} does not use {', '.join(ignored)} (given as {name}:...)")
        tag = "".join(f":{k}={v}" for k, v in extra)
        # No budgets: only a method that never compresses runs (once, as it does with budgets).
        listed = budgets or ([] if get_method(name).compresses else [None])
        for budget in listed:  # resolved here, once, for every cache the run makes
            run = ReplayRun.of(recorded(resolve_method(name, budget, own)), tag)
            runs.append(run)
            if not run.resolved.compresses:  # `full` once, whatever the budgets
                break
    return runs


def check_runs_build(model, runs: list[ReplayRun]) -> None:
    """Build each run's cache once and drop it, so a bad budget (below the protected window)
    or knob fails with a one-line error before any slow work."""
    for run in runs:
        make_cache(model, run.resolved)


# ----------------------------------------------------------------- output
def replay_unit_line(item: str, label: str, kl: float, top1: float, peak: float) -> str:
    """One finished replay unit (trace × method@budget) as a plain log line, for replay and sweep."""
    return f"{item} {label}: KL {kl:.4f}, top-1 {top1:.3f}, peak {peak:.0f} tokens/head"


@contextlib.contextmanager
def loading_status(model_name: str, part: str = "") -> Iterator[None]:
    """While a model (or a `part` of it) loads: a spinner on stderr that names it, the libraries'
    own bars hidden."""
    with err_console.status(f"loading {model_name}{part}…"), quiet_loading():
        yield


def progress_bar(transient: bool = False) -> Progress | LineProgress:
    """Progress on stderr, so stdout holds only the results: a live bar on a terminal, plain
    timestamped lines in a pipe or a log."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    return progress_for(err_console, *columns, transient=transient)


def command_line(command: str, parts: list[object]) -> str:
    """The shell command that reruns `command` with these options, for the saved record. Built
    from the parsed options, not sys.argv, which is not ours when the app is invoked from Python."""
    return f"reasonkv {command} " + " ".join(shlex.quote(str(a)) for a in parts)
