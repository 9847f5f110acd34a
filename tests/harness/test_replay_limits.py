"""The library's replay refuses a trace past the model's positions by name, a sweep fails such a
trace's units alone, and replay's progress moves with every run (issue 30)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from cli_helpers import CharTokenizer
from conftest import build_tiny_model
from reasonkv.harness import sweep as sw
from reasonkv.harness.replay import ReplayRun, replay_batch, replay_methods, replay_work
from reasonkv.harness.traces import ReplayInput, check_replay_input, replay_input

RUNS = [ReplayRun("full"), ReplayRun("streaming", 16), ReplayRun("snapkv", 16, {"interval": 8})]


def tiny(max_positions: int = 1024):
    return build_tiny_model("llama", init_range=0.02, bos_token_id=1, max_position_embeddings=max_positions)


def trace_input(trace_id: str, n: int, prompt_len: int = 10, seed: int = 0) -> ReplayInput:
    ids = torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(seed))
    return ReplayInput(trace_id, ids, prompt_len)


def test_replay_refuses_positions_past_the_model_s_limit_before_any_forward() -> None:
    model = tiny(max_positions=64)
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    inp = trace_input("long-one", 65)
    message = (
        "trace 'long-one': 65 tokens (10 prompt + 55 trace) run past the model's 64 positions "
        "(max_position_embeddings); use max_tokens of at most 64"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        replay_methods(model, inp.input_ids, inp.prompt_len, RUNS, trace_id=inp.id)
    with pytest.raises(ValueError, match="trace 'long-one'"):
        replay_batch(model, [trace_input("fits", 40), inp], RUNS)
    assert forwards == []
    assert replay_methods(model, inp.input_ids[:, :64], inp.prompt_len, RUNS[:1])[0].positions == 53


def test_replay_input_and_its_check_name_the_trace_and_where_it_is() -> None:
    row = {"id": "t7", "problem": "2+2?", "trace": "four"}
    prompt = len("Problem: 2+2?\nSolution: ")
    with pytest.raises(
        ValueError, match=rf"^f.jsonl:3 \(trace 't7'\): max_tokens=5 leaves no trace after its {prompt}"
    ):
        replay_input(CharTokenizer(), row, 5, where="f.jsonl:3")
    with pytest.raises(ValueError, match=r"^trace 't7': 1 trace token\(s\) after"):
        check_replay_input(replay_input(CharTokenizer(), row, prompt + 1))
    with pytest.raises(ValueError, match=r"^f.jsonl:3 \(trace 't7'\): .* past the model's 20 positions"):
        check_replay_input(replay_input(CharTokenizer(), row), 20, "f.jsonl:3")
    inp = replay_input(CharTokenizer(), row)
    assert check_replay_input(inp, prompt + 4) is inp


def test_progress_counts_runs_times_positions_and_moves_with_each_run() -> None:
    model = tiny()
    inp = trace_input("t", 70, prompt_len=12)
    calls: list[int] = []
    replay_methods(model, inp.input_ids, inp.prompt_len, RUNS, progress=calls.append)
    assert sum(calls) == replay_work([inp], RUNS) == len(RUNS) * (70 - 12 - 1)
    # One block (57 columns): counted once a block it would be a single call; each run reports
    # its own chunks (full: the block at once; streaming: token by token).
    assert calls[0] == 57 and len(calls) > len(RUNS)
    batch = [inp, trace_input("u", 50, prompt_len=8, seed=1)]
    calls.clear()
    replay_batch(model, batch, RUNS, progress=calls.append)
    assert sum(calls) == replay_work(batch, RUNS, batch=True) == len(RUNS) * 57


def test_a_sweep_fails_the_units_of_a_trace_past_the_model_s_positions_alone(tmp_path) -> None:
    rows = [
        {"id": "short", "problem": "2+3?", "trace": "Add: 5. " * 5},
        {"id": "long", "problem": "2+3?", "trace": "Add: 5. " * 40},
    ]
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    grid = sw.parse_grid(
        {
            "kind": "replay",
            "models": ["tiny"],
            "methods": ["full", "streaming"],
            "budgets": [16],
            "settings": {"max_tokens": 400},
            "datasets": [{"traces": "traces.jsonl"}],
        },
        tmp_path,
    )
    model = tiny(max_positions=100)
    records = [
        r for task in sw.make_tasks(sw.expand(grid)) for r in sw.replay_task(model, CharTokenizer(), task)
    ]
    status = {(r["config"]["item"], r["config"]["method"]): r["status"] for r in records}
    assert status == {
        ("short", "full"): "ok",
        ("short", "streaming"): "ok",
        ("long", "full"): "error",
        ("long", "streaming"): "error",
    }
    errors = {r["error"] for r in records if r["status"] == "error"}
    assert len(errors) == 1
    (error,) = errors
    assert error.startswith(f"ValueError: {tmp_path / 'traces.jsonl'} (trace 'long'): ")
    assert "run past the model's 100 positions (max_position_embeddings)" in error


def test_the_tokenizer_and_config_load_without_the_weights(monkeypatch) -> None:
    from types import SimpleNamespace

    from reasonkv.core import models

    monkeypatch.setattr(models, "random_model_tokenizer", lambda: SimpleNamespace(name="tok"))
    monkeypatch.setattr(models, "build_random_model", None)  # building the weights would fail
    tokenizer, config = models.load_tokenizer_and_config("random:qwen3-0.6b:layers=1")
    assert tokenizer.name == "tok" and models.max_positions(config) == 40_960
    with pytest.raises(FileNotFoundError, match="neither a bundled name"):
        models.load_tokenizer_and_config("nonesuch")
