"""`reasonkv analyze`: show what the cache is doing on one trace (revisits, beacons, the wave)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from reasonkv.cli.common import (
    CliError,
    DeviceOption,
    DtypeOption,
    MaxTokensOption,
    ModelOption,
    SharedSetsOption,
    TracesOption,
    build_runs,
    check_device,
    check_runs_build,
    command_line,
    console,
    fail,
    loading_status,
    parse_sets,
    placement_parts,
    progress_bar,
    split_list,
)
from reasonkv.core.models import DEFAULT_MODEL, load_model, load_tokenizer_and_config, max_positions
from reasonkv.harness.analyze import RevisitRule, analyze_trace, default_distance, write_report
from reasonkv.harness.traces import check_replay_input, load_traces_where, replay_input
from reasonkv.methods.profiles import find_profile, load_profile
from reasonkv.util.runtime import set_threads


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None or text.strip().lower() == "auto":
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{what} takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise CliError(f"{what} takes comma-separated non-negative integers, got {text!r}")
    return sorted(dict.fromkeys(values))


def analyze_command(
    traces: TracesOption,
    out: Annotated[Path, typer.Option("--out", help="Folder for index.html, the PNGs and summary.json.")],
    trace_id: Annotated[
        str | None, typer.Option("--id", help="The trace to analyse (default: the first of --variant).")
    ] = None,
    model_name: ModelOption = DEFAULT_MODEL,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    variant: Annotated[
        str, typer.Option("--variant", help="Rows of this `variant` ('all' = every row).")
    ] = "well_posed",
    max_tokens: MaxTokensOption = 2048,
    layers: Annotated[
        str | None,
        typer.Option("--layers", help="Layers to draw, e.g. 0,15,29 (default: the 3 with most revisits)."),
    ] = None,
    heads: Annotated[
        str | None,
        typer.Option(
            "--heads", help="KV heads to draw in each layer (default: its head with most revisits)."
        ),
    ] = None,
    methods: Annotated[
        str, typer.Option("--methods", "-m", help="Methods to count missed revisits of ('none' = skip).")
    ] = "snapkv,rkv,beaconkv",
    budget: Annotated[int, typer.Option("--budget", "-b", help="Tokens per KV head for the methods.")] = 128,
    sets: SharedSetsOption = None,
    distance: Annotated[
        int | None, typer.Option("--distance", help="D: far = at least this many tokens back (default n/8).")
    ] = None,
    fraction: Annotated[
        float, typer.Option("--fraction", help="φ: global when the top-k far keys hold this share.")
    ] = 0.3,
    top_k: Annotated[int, typer.Option("--top-k", help="k strongest far keys make the far mass.")] = 8,
    n_sink: Annotated[int, typer.Option("--n-sink", help="The first N tokens are sinks (left out).")] = 4,
    persistent: Annotated[
        float,
        typer.Option(
            "--persistent", help="σ: keys in the top-k far keys of this share of queries (0 = off)."
        ),
    ] = 0.5,
    needed_mass: Annotated[
        float, typer.Option("--needed-mass", help="Needed keys hold this share of the top-k far mass.")
    ] = 0.5,
    stride: Annotated[int, typer.Option(help="Record every N-th trace query.")] = 1,
    window: Annotated[int, typer.Option(help="Queries (rows) in the attention maps.")] = 256,
) -> None:
    """Replay one trace with the full cache and show thought revisiting: which queries look far
    back, what they read, the beacons BeaconKV would keep, the Reasoning Wave, and how many of
    the needed tokens each method had already evicted (missed revisits). Writes OUT/index.html."""
    try:
        if methods.strip().lower() in ("none", ""):
            runs = []
        else:
            runs = build_runs(split_list(methods, "--methods"), [budget], parse_sets(sets))
        layer_list = _int_list(layers, "--layers")
        head_list = _int_list(heads, "--heads")
        if max_tokens <= 2:
            raise CliError(f"--max-tokens must be at least 3, got {max_tokens}")
        if stride <= 0 or window <= 0:
            raise CliError("--stride and --window must be positive")
        if not 0.0 < needed_mass <= 1.0:
            raise CliError(f"--needed-mass must be in (0, 1], got {needed_mass}")
        rows = load_traces_where(
            traces, variant=None if variant == "all" else variant, ids=[trace_id] if trace_id else None
        )
        if not rows:
            raise CliError(f"{traces}: no traces of variant {variant!r}")
        at, row = rows[0]
        # Checked now with a placeholder D, so a bad φ/σ/k fails before the model loads.
        RevisitRule(distance or 1, fraction, n_sink, top_k, persistent or None)
        where = check_device(device, dtype)
        set_threads()
        # The trace is checked against the tokenizer and the model's positions (seconds) before
        # the weights load (a minute), as replay does.
        with loading_status(model_name, " (tokenizer, config)"):
            tokenizer, config = load_tokenizer_and_config(model_name)
        inp = check_replay_input(
            replay_input(tokenizer, row, max_tokens, where=at), max_positions(config), at
        )
        with loading_status(model_name):
            model, _ = load_model(model_name, **where)
        n_layers = model.config.num_hidden_layers
        n_kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
        if layer_list and max(layer_list) >= n_layers:
            raise CliError(f"--layers: the model has layers 0..{n_layers - 1}, got {layers}")
        if head_list and max(head_list) >= n_kv:
            raise CliError(f"--heads: the model has KV heads 0..{n_kv - 1}, got {heads}")
        n = int(inp.input_ids.shape[1])
        rule = RevisitRule(distance or default_distance(n), fraction, n_sink, top_k, persistent or None)
        check_runs_build(model, runs)
    except (CliError, ValueError, FileNotFoundError) as err:
        fail(str(err))

    profile_path = find_profile(model.config)
    profile = load_profile(profile_path, model.config) if profile_path is not None else None
    trace_tokens = n - inp.prompt_len
    total = trace_tokens * (2 if (rule.persistent is not None or layer_list is None) else 1)
    start = time.perf_counter()
    with progress_bar() as progress:
        task = progress.add_task(f"analysing {row['id']} ({n} tokens, {len(runs)} methods)", total=total)
        analysis = analyze_trace(
            model,
            inp.input_ids,
            inp.prompt_len,
            rule,
            trace_id=row["id"],
            stride=stride,
            window=window,
            layers=layer_list,
            needed_mass=needed_mass,
            runs=runs,
            progress=lambda stage, k: progress.update(task, advance=k, description=f"{stage} {row['id']}"),
        )
    # Absolute paths: the command in the report reruns from any folder.
    model_arg = Path(model_name).resolve() if Path(model_name).exists() else model_name
    parts = [
        "--traces",
        Path(traces).resolve(),
        "--out",
        out.resolve(),
        "--id",
        row["id"],
        "--model",
        model_arg,
    ]
    parts += ["--max-tokens", max_tokens, "--methods", methods, "--budget", budget]
    parts += ["--distance", rule.distance, "--fraction", fraction, "--top-k", top_k, "--n-sink", n_sink]
    parts += [
        "--persistent",
        persistent,
        "--needed-mass",
        needed_mass,
        "--stride",
        stride,
        "--window",
        window,
    ]
    parts += ["--layers", ",".join(map(str, analysis.layers))]
    parts += ["--heads", heads] if heads is not None else []
    parts += ["--variant", variant] if variant != "well_posed" else []
    for item in sets or []:
        parts += ["--set", item]
    summary = write_report(
        analysis,
        tokenizer,
        out,
        heads=head_list,
        profile=profile,
        model_name=model_name,
        command=command_line("analyze", parts + placement_parts(where)),
    )
    wall = time.perf_counter() - start
    share = analysis.global_fraction()
    console.print(
        f"{row['id']}: {summary['global_queries']} global (layer, head, query) triples; most revisiting "
        f"layer {int(share.mean(-1).argmax())} ({100 * float(share.mean(-1).max()):.1f}% of its queries); "
        f"rule: D={rule.distance}, φ={rule.fraction:g}, top-{rule.top_k}",
        soft_wrap=True,
    )
    for m in summary["methods"]:
        kl = "-" if m["mean_kl"] is None else f"{m['mean_kl']:.4f}"
        console.print(
            f"  {escape(m['label'])}: missed {m['missed_keys']}/{m['needed_keys']} needed keys "
            f"({100 * m['missed_fraction']:.1f}%), {m['queries_with_missed']} global queries with a miss, "
            f"mean KL {kl}",
            soft_wrap=True,
        )
    console.print(
        f"[dim]{wall:.1f} s wall; report -> {escape(str(out / 'index.html'))}[/dim]", soft_wrap=True
    )
