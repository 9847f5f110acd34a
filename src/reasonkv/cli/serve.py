"""`reasonkv serve`: vLLM's OpenAI-compatible server with reasonkv's plugin on."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from reasonkv.cli.common import CliError, err_console, fail, loading_status, parse_sets
from reasonkv.core.model_folder import cached_folder_path, cached_model_folder, needs_export
from reasonkv.core.models import DEFAULT_MODEL, looks_like_path
from reasonkv.methods.knobs import KnobError
from reasonkv.serving.vllm.settings import CONFIG_KEY, read_settings

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM options this command sets itself (--host and --port are its own options too).
OWN_FLAGS = ("--model", "--additional-config")
CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}

# Long names only: vLLM's short flags (-sc, -dpb, -dpm, ...) would otherwise be read as -s, -b, -m.
MethodOption = Annotated[str, typer.Option("--method", help="A name from `reasonkv methods`.")]
BudgetOption = Annotated[int, typer.Option("--budget", help="Tokens kept per KV head.")]
SetsOption = Annotated[
    list[str] | None, typer.Option("--set", help="Method parameter key=value (repeatable).")
]


def serve_command(
    ctx: typer.Context,
    method: MethodOption = "snapkv",
    budget: BudgetOption = 512,
    sets: SetsOption = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    kv_space: Annotated[
        int | None,
        typer.Option(
            "--kv-space",
            help="GiB for vLLM's KV pool on the CPU (sets VLLM_CPU_KVCACHE_SPACE; without it, vLLM's "
            "CPU worker refuses to start while other processes hold memory).",
        ),
    ] = None,
    export_dtype: Annotated[
        str, typer.Option("--export-dtype", help="Weights dtype of an exported GGUF: float32 or bfloat16.")
    ] = "float32",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Export the model if needed, print vLLM's command, exit.")
    ] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with reasonkv compressing every request's KV
    cache: `reasonkv serve [MODEL] [OPTIONS] [VLLM OPTIONS]` (a request may bring its own
    settings, or opt out, in `vllm_xargs`; docs/serving.md).

    MODEL, which must come first if given: the bundled model's name (the default,
    smollm2-135m) or a .gguf file, both exported for vLLM once into $REASONKV_CACHE_DIR
    (default $XDG_CACHE_HOME/reasonkv or ~/.cache/reasonkv); or a model folder or Hugging Face
    id, given to vLLM as they are. Options this command does
    not know go to vLLM unchanged, e.g. `reasonkv serve --method beaconkv --budget 1024
    --max-model-len 8192`. The model runs eagerly (--enforce-eager): the plugin has not been
    run in a compiled model. The method and knobs are checked before anything starts; a bad
    one is a one-line error."""
    model_name, extra = split_model(list(ctx.args))
    given = {flag_name(arg) for arg in extra if arg.startswith("--")}
    for flag in OWN_FLAGS:
        if flag in given:
            fail(f"{flag} is this command's own (see reasonkv serve --help; the model is its first word)")
    if export_dtype not in ("float32", "bfloat16"):
        fail(f"--export-dtype must be float32 or bfloat16, got {export_dtype!r}")
    if kv_space is not None and kv_space <= 0:
        fail(f"--kv-space must be a positive whole number of GiB, got {kv_space}")
    try:
        entry = {"method": method, "budget": budget, **parse_sets(sets)}
        read_settings({CONFIG_KEY: entry})
    except (CliError, KnobError, ValueError) as err:
        fail(str(err))
    if importlib.util.find_spec("vllm") is None and not dry_run:
        fail("reasonkv serve needs vLLM in this environment: pip install 'reasonkv[vllm]'")

    folder, served_name = _model_folder(model_name, export_dtype), None
    if needs_export(model_name) and "--served-model-name" not in given:
        served_name = model_name if not looks_like_path(model_name) else Path(model_name).stem
    command = [sys.executable, "-m", SERVER_MODULE, "--model", folder, "--host", host, "--port", str(port)]
    command += ["--enforce-eager", "--additional-config", json.dumps({CONFIG_KEY: entry})]
    if served_name is not None:
        command += ["--served-model-name", served_name]
    command += extra
    pool = {} if kv_space is None else {"VLLM_CPU_KVCACHE_SPACE": str(kv_space)}  # whole GiB
    env = {"VLLM_NO_USAGE_STATS": "1", **os.environ, **pool}
    shown = shlex.join([*(f"{k}={v}" for k, v in pool.items()), *command])
    if dry_run:
        typer.echo(shown)
        return
    err_console.print(
        f"reasonkv serve: {method}, budget {budget}, on http://{host}:{port}\n{shown}",
        soft_wrap=True,
        markup=False,
    )
    sys.stderr.flush()
    os.execve(sys.executable, command, env)  # vLLM's server takes this process (and its signals)


def flag_name(arg: str) -> str:
    """A vLLM option as its parser reads it: `--served_model_name=x` -> `--served-model-name`."""
    return "--" + arg[2:].split("=", 1)[0].replace("_", "-")


def split_model(args: list[str]) -> tuple[str, list[str]]:
    """(MODEL, vLLM's options) from what this command's own options left: the first word is
    the model unless it is an option (then the default model is served)."""
    if args and not args[0].startswith("-"):
        return args[0], args[1:]
    return DEFAULT_MODEL, args


def _model_folder(model_name: str, dtype: str) -> str:
    """The folder or hub id vLLM loads: a GGUF is exported (once) into the cache folder."""
    if not needs_export(model_name):
        return model_name
    target = cached_folder_path(model_name, dtype)
    if not (target / "config.json").is_file():  # a line a log keeps, beside the spinner
        err_console.print(
            f"exporting {model_name} for vLLM into {target} (once)", soft_wrap=True, markup=False
        )
    try:
        with loading_status(model_name):
            folder, _ = cached_model_folder(model_name, dtype)
    except (FileNotFoundError, ValueError) as err:
        fail(str(err))
    return str(folder)
