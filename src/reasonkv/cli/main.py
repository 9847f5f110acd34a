"""The `reasonkv` command line: one typer app with every command registered on it.

The commands live in their own modules (shared parsing and options in cli.common); this
module only assembles them, in the order `reasonkv --help` lists them.
"""

from __future__ import annotations

import inspect
from typing import Annotated

import typer

from reasonkv.cli.analyze import analyze_command
from reasonkv.cli.bench import bench_command
from reasonkv.cli.evaluate import eval_command
from reasonkv.cli.generate import demo_command, generate_command, methods_command
from reasonkv.cli.plot import plot_app
from reasonkv.cli.profile import profile_command
from reasonkv.cli.replay import replay_command
from reasonkv.cli.serve import CONTEXT as SERVE_CONTEXT
from reasonkv.cli.serve import serve_command
from reasonkv.cli.sweep import report_command, sweep_command
from reasonkv.util.version import package_version

app = typer.Typer(
    name="reasonkv",
    help="Keep the KV cache of a reasoning LLM small while it writes a long chain of thought.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"reasonkv {package_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Keep the KV cache of a reasoning LLM small while it writes a long chain of thought."""


def flowed_help(doc: str | None) -> str | None:
    """A docstring as help text: its paragraphs kept, the line breaks inside each joined, so
    that the terminal wraps sentences instead of breaking them where the source did."""
    if not doc:
        return doc
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


COMMANDS = {
    "methods": methods_command,
    "generate": generate_command,
    "demo": demo_command,
    "profile": profile_command,
    "replay": replay_command,
    "eval": eval_command,
    "sweep": sweep_command,
    "report": report_command,
    "analyze": analyze_command,
    "bench": bench_command,
    "serve": serve_command,
}
CONTEXTS = {"serve": SERVE_CONTEXT}  # serve passes the options it does not know on to vLLM
for name, command in COMMANDS.items():  # in the order `reasonkv --help` lists them
    app.command(name, help=flowed_help(command.__doc__), context_settings=CONTEXTS.get(name))(command)
    if name == "profile":
        app.add_typer(plot_app, name="plot")


def main() -> None:  # pragma: no cover - `python -m reasonkv.cli.main`
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
