"""`reasonkv methods`, `generate` and `demo`: list the methods, generate under a KV budget,
and compare methods on one problem."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
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
    console,
    err_console,
    fail,
    loading_status,
    parse_sets,
)
from reasonkv.core.models import DEFAULT_MODEL, load_model
from reasonkv.core.policy.knob import MAX_TOKENS
from reasonkv.core.quantize import LOW_TIER_KNOBS, KVFormat
from reasonkv.harness.demo import memory_summary, run_demo
from reasonkv.harness.runs import record_all_events, run_record, save_run
from reasonkv.methods.api import GREEDY, make_cache
from reasonkv.methods.api import generate as generate_text
from reasonkv.methods.knobs import check_budget, check_knobs, knob_bounds, literal_choices
from reasonkv.methods.registry import METHODS, PROTECTION_KNOBS, MethodSpec, get_method
from reasonkv.util.formatting import format_bytes
from reasonkv.util.records import not_utf8
from reasonkv.util.runtime import set_threads


def describe_schedule(spec: MethodSpec) -> str:
    """The schedule with this method's defaults, e.g. 'buffer(every 128)'."""
    sched = spec.schedule
    if isinstance(sched, type):
        names = {f.name for f in dataclasses.fields(sched) if f.init and f.name != "name"}
        sched = sched(**{k: v for k, v in spec.knobs().items() if k in names})
    return sched.describe()


def format_knobs(spec: MethodSpec) -> str:
    """The method's knobs with their defaults; the storage knobs only where the method sets
    them (every method has them, and at 16 bits or without a low tier they change nothing)."""
    knobs = spec.knobs()
    storage = {f.name for f in dataclasses.fields(KVFormat)}

    def shown(name: str) -> bool:
        if name in LOW_TIER_KNOBS:
            return knobs["low_budget"] != 0
        return name not in storage or knobs["kv_bits"] != 16

    return " ".join(f"{k}={v}" for k, v in knobs.items() if shown(k))


def _compact_rule(spec: MethodSpec, name: str) -> str:
    """A knob's choices or range in a few characters: '{max|avg}', '[0, 1]', '>=1' ('' for a bool)."""
    choices = literal_choices(spec, name)
    if choices is not None:
        return "{" + "|".join(map(str, choices)) + "}"
    rules = []
    for bounds in knob_bounds(spec, name):
        if bounds.le == MAX_TOKENS:  # a token count: its upper bound is only a sanity limit
            bounds = dataclasses.replace(bounds, le=None)
        rule = bounds.describe().replace(" ", "")
        rules.append("" if rule == "anyvalue" else rule[2:] if rule.startswith("in") else f"({rule})")
    return ",".join(r for r in dict.fromkeys(rules) if r)


def format_knob_ranges(spec: MethodSpec) -> str:
    """Each knob's default and what it accepts, e.g. 'fraction=0.125 (0,1) window=8 (>=1)'."""
    parts = ((f"{k}={v}", _compact_rule(spec, k)) for k, v in spec.knobs().items())
    return " ".join(f"{knob} {rule}" if rule else knob for knob, rule in parts)


def methods_markdown() -> str:
    """The method table as Markdown (the README's table is this output)."""
    rows = ["| method | what it does | schedule | default knobs | paper |", "|---|---|---|---|---|"]
    for name, spec in METHODS.items():
        knobs = f"`{format_knobs(spec)}`"
        cells = [f"`{name}`", spec.description, describe_schedule(spec), knobs, spec.paper]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def methods_command(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown table instead.")] = False,
) -> None:
    """List every registered KV-cache method with its schedule and default parameters."""
    if markdown:
        typer.echo(methods_markdown())
        return
    if console.width < 110:  # a table would fold knob names mid-word: key: value blocks instead
        _print_methods_as_blocks(console.width)
        return
    table = Table(title="reasonkv methods", show_lines=True, expand=True)
    longest = max((len(n) for n in METHODS), default=4)
    table.add_column("name", style="bold cyan", no_wrap=True, min_width=longest)
    table.add_column("description", ratio=3)
    table.add_column("schedule", min_width=12, max_width=22)
    table.add_column("default knobs (--set key=value) and ranges", ratio=2)
    table.add_column("paper", ratio=2)
    for name, spec in METHODS.items():
        # Registry text is plain: escape it so a "[...]" in a description is not read as markup.
        desc, paper = escape(spec.description), escape(spec.paper)
        knobs = escape(format_knob_ranges(spec))
        table.add_row(escape(name), desc, escape(describe_schedule(spec)), knobs, paper)
    console.print(table)
    protect = ", ".join(f"{k}: {v}" for k, v in PROTECTION_KNOBS.items())
    console.print(f"Every compressing method also takes the protection knobs ({protect}).", markup=False)


def _knob_entries(spec: MethodSpec) -> list[str]:
    """'fraction=0.125 (0,1)', one per knob: the unit that line breaks must not split."""
    return [f"{k}={v} {rule}".strip() for k, v in spec.knobs().items() for rule in [_compact_rule(spec, k)]]


def _print_methods_as_blocks(width: int) -> None:
    """`reasonkv methods` for a narrow terminal: a block per method, lines broken only between
    knobs and between words."""
    indent = "    "
    for name, spec in METHODS.items():
        console.print(f"[bold cyan]{escape(name)}[/bold cyan]: {escape(spec.description)}", soft_wrap=False)
        console.print(f"{indent}schedule: {escape(describe_schedule(spec))}", highlight=False)
        lines, line = [], ""
        for entry in _knob_entries(spec):
            if line and len(indent) + len("knobs: ") + len(line) + 2 + len(entry) > width:
                lines.append(line)
                line = ""
            line = f"{line}  {entry}" if line else entry
        lines.append(line)
        for k, text in enumerate(lines):
            lead = f"{indent}knobs: " if k == 0 else indent + " " * len("knobs: ")
            console.print(escape(lead + text), highlight=False, soft_wrap=True)
        if spec.paper != "-":
            console.print(f"{indent}[dim]paper: {escape(spec.paper)}[/dim]")
    protect = ", ".join(f"{k}: {v}" for k, v in PROTECTION_KNOBS.items())
    console.print(f"Every compressing method also takes the protection knobs ({protect}).", markup=False)


def generate_command(
    prompt: Annotated[str, typer.Argument(help="The user message (wrapped in the chat template).")],
    method: MethodOption = "snapkv",
    budget: BudgetOption = 128,
    model_name: ModelOption = DEFAULT_MODEL,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 256,
    sample: Annotated[
        bool,
        typer.Option(
            "--sample/--greedy", help="Sample with --temperature and --top-p. Default: greedy decoding."
        ),
    ] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (with --sample).")] = 0.6,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (with --sample).")] = 0.95,
    seed: Annotated[int | None, typer.Option(help="Seed torch's RNG (sampling).")] = None,
    attn: AttnOption = "sdpa",
    chat: Annotated[bool, typer.Option("--chat/--raw", help="Apply the chat template.")] = True,
    sets: MethodSetsOption = None,
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
            knobs = check_knobs(spec, {**knobs, "profile": str(profile)})  # reads the profile now
        check_budget(spec, budget, knobs)
        if not prompt:
            raise CliError("the prompt is empty: give the text to answer (or, with --raw, to continue)")
        if (why := not_utf8(prompt)) is not None:
            raise CliError(f"the prompt is {why}; give it as UTF-8")
        check_attn(attn)
        if max_new_tokens <= 0:
            raise CliError(f"--max-new-tokens must be positive, got {max_new_tokens}")
        where = check_device(device, dtype)
        set_threads()
        with loading_status(model_name):
            model, tokenizer = load_model(model_name, attn_implementation=attn, **where)
        cache = make_cache(model, method, budget, **knobs)
        if record is not None:
            record_all_events(cache)  # `reasonkv plot budgets` draws every compression
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))

    if seed is not None:
        torch.manual_seed(seed)
    gen_kwargs: dict[str, object] = {"max_new_tokens": max_new_tokens}
    if sample:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        gen_kwargs.update(GREEDY)
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


def demo_command(
    model_name: ModelOption = DEFAULT_MODEL,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    budget: Annotated[int, typer.Option("--budget", "-b")] = 128,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", "-n")] = None,
) -> None:
    """Full cache vs SnapKV vs StreamingLLM on one math problem: tokens, speed, memory, divergence
    (greedy decoding, so the runs differ only by their caches)."""
    kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    try:
        run_demo(model=model_name, budget=budget, **check_device(device, dtype), **kwargs)
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))
