"""`reasonkv methods`, `generate` and `demo`: list the methods, generate under a KV budget,
and compare methods on one problem."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import torch
import typer

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
from reasonkv.cli.methods_list import methods_markdown, print_methods
from reasonkv.core.models import DEFAULT_MODEL, load_model
from reasonkv.harness.demo import memory_summary, run_demo
from reasonkv.harness.runs import record_all_events, run_record, save_run
from reasonkv.methods.api import GREEDY, make_cache
from reasonkv.methods.api import generate as generate_text
from reasonkv.methods.registry import get_method
from reasonkv.methods.resolved import resolve_method
from reasonkv.util.formatting import format_bytes
from reasonkv.util.records import not_utf8
from reasonkv.util.runtime import set_threads


def methods_command(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the reference as Markdown (docs/methods.md is this).")
    ] = False,
) -> None:
    """List every registered KV-cache method with its own knobs, the storage and protection
    knobs they share, and the presets (recommended configurations) with their numbers."""
    if markdown:
        typer.echo(methods_markdown(), nl=False)
        return
    print_methods(console.width)


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
        knobs = parse_sets(sets)
        if profile is not None:
            if "profile" not in get_method(method).knobs():  # clearer than "unknown parameter"
                raise CliError(f"--profile is for profile-driven methods (reasonalloc-*), not {method!r}")
            if not profile.exists():
                raise CliError(f"no profile at {profile}")
            knobs["profile"] = str(profile)
        resolved = resolve_method(method, budget, knobs)  # reads the profile now
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
        cache = make_cache(model, resolved)
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
        f"[dim]{method} budget={budget if resolved.compresses else '-'}: {n_new} new tokens, "
        f"{n_new / max(elapsed, 1e-9):.1f} tok/s | KV {format_bytes(mem['kv_bytes'])} "
        f"(physical {format_bytes(mem['physical_bytes'])}) | mean live tokens/head {mem['live_mean']:.1f} | "
        f"seen {mem['seen_tokens']} | compressions/layer {mem['compressions']:g}[/dim]",
        soft_wrap=True,
    )
    if record is not None:
        meta = {
            "model": model_name,
            "budget": budget,
            "knobs": dict(resolved.knobs),
            "prompt": prompt,
            "new_tokens": n_new,
        }
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
