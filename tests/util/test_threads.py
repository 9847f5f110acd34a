"""REASONKV_THREADS: one reading of the variable, applied by load_model as by the commands, and a
bad value refused in one line (issue 30)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from reasonkv.core import models
from reasonkv.util import runtime

TINY_RANDOM = (
    "random:qwen3-0.6b:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=64,head_dim=32,vocab=49152"
)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_tokenizer_files(monkeypatch):
    """A random model without reading the bundled tokenizer (only its special ids are used)."""
    tokenizer = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    monkeypatch.setattr(models, "random_model_tokenizer", lambda: tokenizer)


def test_load_model_applies_reasonkv_threads(monkeypatch, restore_threads, no_tokenizer_files) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("REASONKV_THREADS", "2")
    models.load_model(TINY_RANDOM, device="cpu")
    assert torch.get_num_threads() == 2
    # Unset, a library call leaves the caller's count alone (the commands default to min(4, cores)).
    monkeypatch.delenv("REASONKV_THREADS")
    torch.set_num_threads(1)
    models.load_model(TINY_RANDOM, device="cpu")
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5"])
def test_a_bad_thread_count_is_one_line_before_anything_loads(monkeypatch, restore_threads, value) -> None:
    monkeypatch.setenv("REASONKV_THREADS", value)
    message = f"REASONKV_THREADS must be a positive integer (torch threads), got '{value}'"
    monkeypatch.setattr(models, "build_random_model", None)  # loading would fail otherwise
    with pytest.raises(ValueError, match=re.escape(message)):
        models.load_model(TINY_RANDOM, device="cpu")
    with pytest.raises(ValueError, match="must be a positive integer"):
        runtime.set_threads()


def test_a_command_reports_a_bad_thread_count_in_one_line(tmp_path, monkeypatch, restore_threads) -> None:
    from cli_helpers import errors_of, runner
    from reasonkv.cli import main as cli
    from reasonkv.cli import replay as replay_cli

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded although REASONKV_THREADS was bad")

    monkeypatch.setattr(replay_cli, "load_model", no_loading)
    monkeypatch.setattr(replay_cli, "load_tokenizer_and_config", no_loading)
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps({"id": "t", "problem": "2+2?", "trace": "four four"}) + "\n")
    args = ["replay", "--traces", str(traces), "--variant", "all", "--out", str(tmp_path / "r.json")]
    result = runner.invoke(cli.app, args, env={"REASONKV_THREADS": "lots", "COLUMNS": "200"})
    err = errors_of(result).strip()
    assert result.exit_code == 2
    assert err == "error: REASONKV_THREADS must be a positive integer (torch threads), got 'lots'"
