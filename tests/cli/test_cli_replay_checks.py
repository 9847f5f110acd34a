"""`reasonkv replay` checks every trace against the tokenizer and the model's positions before
the weights load, names the bad trace in one line, labels each run apart, and shows progress
that moves with every run (issue 30)."""

from __future__ import annotations

import json
import re

import pytest

from cli_helpers import CharTokenizer, errors_of, runner, tiny_llama
from conftest import tiny_config
from reasonkv.cli import main as cli
from reasonkv.cli import replay as replay_cli

PROBLEM = "What is 2+2?"
PROMPT_TOKENS = len(f"Problem: {PROBLEM}\nSolution: ")  # CharTokenizer: one token a character
GOOD = {"id": "ok", "problem": PROBLEM, "trace": "Two and two make four. " * 2}


def write_traces(path, *rows: dict) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def preview_only(monkeypatch):
    """The tokenizer and a config of 100 positions, read as before the weights; loading the
    weights fails the test."""

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded although a trace could not be replayed")

    monkeypatch.setattr(replay_cli, "load_model", no_weights)
    config = tiny_config("llama", max_position_embeddings=100)
    monkeypatch.setattr(replay_cli, "load_tokenizer_and_config", lambda name: (CharTokenizer(), config))


def one_line(result) -> str:
    err = errors_of(result)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(err.strip().splitlines()) == 1, err
    return err.strip()


def replay_args(traces, tmp_path, *extra: str) -> list[str]:
    return ["replay", "--traces", str(traces), "--variant", "all", "--out", str(tmp_path / "r.json"), *extra]


def test_an_empty_trace_is_named_before_the_weights_load(tmp_path, preview_only) -> None:
    traces = tmp_path / "traces.jsonl"
    write_traces(traces, GOOD, {"id": "blank", "problem": PROBLEM, "trace": ""})
    err = one_line(runner.invoke(cli.app, replay_args(traces, tmp_path, "--max-tokens", "90")))
    assert err == (
        f"error: {traces}:2 (trace 'blank'): 0 trace token(s) after its {PROMPT_TOKENS}-token prompt; "
        "replay needs at least 2"
    )


def test_max_tokens_shorter_than_a_prompt_names_the_trace(tmp_path, preview_only) -> None:
    traces = tmp_path / "traces.jsonl"
    write_traces(traces, GOOD, {**GOOD, "id": "long-question", "problem": PROBLEM * 4})
    err = one_line(runner.invoke(cli.app, replay_args(traces, tmp_path, "--max-tokens", "60")))
    prompt = len(f"Problem: {PROBLEM * 4}\nSolution: ")
    expected = (
        f"{traces}:2 (trace 'long-question'): max_tokens=60 leaves no trace after its {prompt}-token prompt"
    )
    assert err == f"error: {expected}"


def test_a_trace_past_the_models_positions_is_refused_by_name(tmp_path, preview_only) -> None:
    traces = tmp_path / "traces.jsonl"
    write_traces(traces, GOOD, {**GOOD, "id": "t-long", "trace": "x" * 200})
    err = one_line(runner.invoke(cli.app, replay_args(traces, tmp_path, "--max-tokens", "150")))
    tokens = f"150 tokens ({PROMPT_TOKENS} prompt + {150 - PROMPT_TOKENS} trace)"
    assert err == (
        f"error: {traces}:2 (trace 't-long'): {tokens} run past the model's 100 positions "
        "(max_position_embeddings); use max_tokens of at most 100"
    )
    # Within the limit the traces pass the checks and the weights are asked for.
    with pytest.raises(AssertionError, match="the weights were loaded"):
        runner.invoke(cli.app, replay_args(traces, tmp_path, "--max-tokens", "100"), catch_exceptions=False)


@pytest.mark.model
def test_the_default_model_refuses_9000_tokens_without_loading_its_weights(tmp_path, monkeypatch) -> None:
    """The issue's case: SmolLM2 holds 8,192 positions; its tokenizer and config come from the
    GGUF's metadata, and the weights never load."""

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(replay_cli, "load_model", no_weights)
    traces = tmp_path / "traces.jsonl"
    write_traces(traces, {"id": "t9k", "problem": PROBLEM, "trace": "one two three four " * 2500})
    err = one_line(runner.invoke(cli.app, replay_args(traces, tmp_path, "--max-tokens", "9000")))
    assert f"{traces}:1 (trace 't9k'): 9000 tokens" in err
    assert "past the model's 8192 positions (max_position_embeddings)" in err


# ------------------------------------------------------------------ labels and progress
@pytest.fixture
def tiny_replay(monkeypatch):
    monkeypatch.setenv("REASONKV_THREADS", "1")
    monkeypatch.setattr(replay_cli, "load_model", lambda name, **kwargs: (tiny_llama(), CharTokenizer()))
    monkeypatch.setattr(
        replay_cli, "load_tokenizer_and_config", lambda name: (CharTokenizer(), tiny_llama().config)
    )


def label_cells(table: str) -> list[str]:
    """The first column of a rich table's body, a label folded over lines joined back."""
    labels: list[str] = []
    body = table[table.index("┡") :]
    for line in body.splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) < 2 or not cells[0] and not any(cells):
            continue
        if any(cells[1:]):  # a new row: it has numbers
            labels.append(cells[0])
        elif labels:  # the label's next line
            labels[-1] += cells[0]
    return labels


@pytest.mark.parametrize("columns", [80, 200])
def test_two_settings_of_one_method_keep_two_labels(tmp_path, tiny_replay, columns) -> None:
    traces = tmp_path / "traces.jsonl"
    write_traces(traces, GOOD)
    methods = "snapkv,snapkv:interval=4,snapkv:interval=8:n_recent=4"
    args = replay_args(traces, tmp_path, "--model", "tiny", "--methods", methods, "--budgets", "16")
    result = runner.invoke(cli.app, [*args, "--max-tokens", "90"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, errors_of(result)
    table = result.stdout[: result.stdout.index(" s wall")]
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= columns
    assert label_cells(table) == ["snapkv", "snapkv:interval=4", "snapkv:interval=8:n_recent=4"]


def test_progress_counts_runs_times_positions_and_moves_with_each_run(tmp_path, tiny_replay) -> None:
    """Not on a terminal: plain lines, whose total is runs × positions; with 3 runs each run's
    chunk is a third of a trace's share, so the line moves before every run has fed it."""
    traces = tmp_path / "traces.jsonl"
    write_traces(traces, GOOD, {**GOOD, "id": "second"})
    args = replay_args(traces, tmp_path, "--model", "tiny", "--methods", "full,streaming,snapkv")
    result = runner.invoke(cli.app, [*args, "--budgets", "16", "--max-tokens", "90"])
    assert result.exit_code == 0, errors_of(result)
    record = json.loads((tmp_path / "r.json").read_text())
    positions = sum(n - p - 1 for n, p in zip(record["tokens"], record["prompt_tokens"], strict=True))
    total = len(record["runs"]) * positions
    marks = [(int(m[1]), int(m[2])) for m in re.finditer(r"replaying \S+: (\d+)/(\d+) \(", errors_of(result))]
    assert marks and {t for _, t in marks} == {total}
    # Counted once a block for every run, the first mark would be the first trace under all
    # three runs, half the total; a mark below half comes from one run's own chunks.
    assert any(0 < done < total / 2 for done, _ in marks), marks
    assert marks[-1][0] == total
