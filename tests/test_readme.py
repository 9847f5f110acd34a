"""The README against the code: its set-up-free commands, the commands it names, the numbers of
its method table, its Python snippet and every output it quotes.

Quoted outputs live in ```console blocks: a `$ reasonkv ...` line, then what the command prints
on stdout; a line holding only `…` stands for any number of lines. The model tests run each
command in-process on the default model (loaded once) and compare the output exactly, tokens/s
and timings aside. Greedy decoding on the CPU in fp32 gives the same tokens at 1, 2 or 4 threads.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
ANY_LINES = "…"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block as (language, body)."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def section(text: str, title: str) -> str:
    """The text under a `## title` heading, up to the next heading of that level."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section '## {title}'"
    return match[1]


def quoted_runs() -> list[tuple[str, list[str]]]:
    """(command, expected stdout lines) for every `$ ` line of every console block."""
    runs: list[tuple[str, list[str]]] = []
    for lang, body in code_blocks(readme()):
        if lang != "console":
            continue
        for line in body.splitlines():
            if line.startswith("$ "):
                runs.append((line[2:], []))
            else:
                assert runs, f"a console block must start with a `$ ` command line, not {line!r}"
                runs[-1][1].append(line)
    return runs


def mask(text: str) -> str:
    """Tokens/s and timings vary from run to run; everything else must not."""
    text = re.sub(r"\d+(?:\.\d+)? tok/s", "<N> tok/s", text)
    return re.sub(r"\bin \d+(?:\.\d+)? s\b", "in <T> s", text)


def output_matches(expected: list[str], actual: str) -> bool:
    parts = [r"(?:[^\n]*\n)*?" if line == ANY_LINES else re.escape(mask(line)) + r"\n" for line in expected]
    return re.fullmatch("".join(parts), mask(actual).rstrip("\n") + "\n") is not None


def command_names() -> set[str]:
    from reasonkv.cli.main import app

    return set(typer.main.get_command(app).commands)


def test_the_first_commands_are_the_two_set_up_free_ones() -> None:
    lang, body = code_blocks(readme())[0]
    commands = [line.split("#")[0].strip() for line in body.splitlines() if line.strip()]
    assert (lang, commands) == ("bash", ["make demo", "make test"])
    for target in ("demo", "test"):
        assert re.search(rf"^{target}: ", (ROOT / "Makefile").read_text(), re.M)


def test_every_command_the_readme_names_exists() -> None:
    text = readme()
    lines = [line.split(" #")[0] for _, body in code_blocks(text) for line in body.splitlines()]
    code = lines + re.findall(r"`([^`\n]+)`", text)  # comments aside
    named = {name for span in code for name in re.findall(r"(?<![\w/.-])reasonkv (\w[\w-]*)", span)}
    assert named, "the README names no reasonkv command"
    assert named <= command_names(), f"not commands of the CLI: {sorted(named - command_names())}"
    for command, _ in quoted_runs():
        assert command.startswith("reasonkv "), f"only reasonkv commands can be checked: {command!r}"


def test_every_command_in_the_readme_and_usage_page_parses() -> None:
    """Each `reasonkv ...` line of a code block parses: its command, options, their types (none runs)."""
    from reasonkv.cli.main import app

    root = typer.main.get_command(app)
    lines = [
        line.removeprefix("$ ")
        for page in (README, ROOT / "docs" / "usage.md")
        for lang, body in code_blocks(page.read_text(encoding="utf-8"))
        if lang in ("bash", "console")
        for line in body.splitlines()
    ]
    commands = [line for line in lines if line.startswith("reasonkv ")]
    assert len(commands) >= 10
    for line in commands:
        args = shlex.split(line, comments=True)[1:]
        command = root
        while isinstance(command, click.Group):
            command = command.commands[args.pop(0)]
        command.make_context(command.name, args)


def test_the_method_table_quotes_docs_results() -> None:
    """Every number of 'Which method should I use?' is one of docs/results.md's first section."""
    source = section(RESULTS.read_text(encoding="utf-8"), "Which method should I use?")
    ours = section(readme(), "Which method should I use?")
    numbers = set(re.findall(r"\d+\.\d+", ours))
    assert len(numbers) >= 8, "the README's method table has lost its numbers"
    missing = sorted(n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", source))
    assert not missing, f"not in docs/results.md's 'Which method should I use?': {missing}"


def test_output_matching_masks_only_speed() -> None:
    expected = ["a", ANY_LINES, "x: 64 new tokens, 8.2 tok/s | seen 109"]
    assert output_matches(expected, "a\nb\nc\nx: 64 new tokens, 19.0 tok/s | seen 109\n")
    assert output_matches(expected, "a\nx: 64 new tokens, 1 tok/s | seen 109")
    assert not output_matches(expected, "a\nx: 63 new tokens, 8.2 tok/s | seen 109\n")
    assert not output_matches(expected, "a\nx: 64 new tokens, 8.2 tok/s | seen 110\n")
    assert not output_matches(expected, "b\nx: 64 new tokens, 8.2 tok/s | seen 109\n")


@pytest.fixture(scope="module")
def default_model():
    import reasonkv

    return reasonkv.load_model("smollm2-135m")


@pytest.fixture
def loaded_once(default_model, monkeypatch):
    """Every loader the CLI and the package expose hands out the one loaded default model."""
    import reasonkv

    def load(name="smollm2-135m", *args, **kwargs):
        assert name == "smollm2-135m", f"the README's commands run the default model, not {name!r}"
        return default_model

    import reasonkv.cli.main  # noqa: F401  (imports every command's module)

    monkeypatch.setattr(reasonkv, "load_model", load)
    for name, module in list(sys.modules.items()):
        if name.startswith("reasonkv.cli") and hasattr(module, "load_model"):
            monkeypatch.setattr(module, "load_model", load)
    monkeypatch.setenv("REASONKV_THREADS", "1")
    return default_model


@pytest.mark.model
def test_quoted_outputs_are_what_the_commands_print(loaded_once) -> None:
    from reasonkv.cli.main import app

    runs = quoted_runs()
    assert runs, "the README quotes no output"
    for command, expected in runs:
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "250"})
        assert result.exit_code == 0, f"{command}\n{result.output}"
        assert output_matches(expected, result.stdout), (
            f"README.md quotes for `{command}`:\n" + "\n".join(expected) + f"\n\nit prints:\n{result.stdout}"
        )


@pytest.mark.model
def test_the_python_snippet_runs(loaded_once, capsys) -> None:
    snippets = [body for lang, body in code_blocks(readme()) if lang == "python"]
    assert len(snippets) == 1, "the README holds one Python snippet"
    scope: dict = {}
    exec(compile(snippets[0], "README.md", "exec"), scope)
    printed = capsys.readouterr().out
    reply, _, peak = printed.rstrip().rpartition(" ")
    assert reply.strip() and peak.isdigit() and int(peak) > 0, printed
    cache = scope["cache"]
    assert cache.n_compressions > 0, "the snippet's budget must make the cache evict"
