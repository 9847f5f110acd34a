"""`--model random:...` end to end: a reduced Qwen3-0.6B shape with random weights through
`reasonkv bench` on the CPU, with the note that its outputs mean nothing."""

from __future__ import annotations

import json

import pytest

from cli_helpers import WIDE, errors_of, runner
from reasonkv.cli import main as cli

MODEL = "random:qwen3-0.6b:layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128,head_dim=16"


@pytest.mark.model  # the random model uses the bundled model's tokenizer
def test_bench_runs_a_random_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("REASONKV_THREADS", "1")
    out = tmp_path / "bench.json"
    args = ["bench", "--model", MODEL, "--device", "cpu", "--dtype", "bfloat16", "--methods", "snapkv"]
    args += ["--budgets", "32", "--lengths", "64", "--window", "32", "--out", str(out)]
    result = runner.invoke(cli.app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["model"] == MODEL
    assert [r["label"] for r in record["runs"]] == ["full", "snapkv@32"]
    assert len(record["reference"]["tokens"]) == 64
    snapkv = record["runs"][1]
    assert snapkv["marks"][-1]["kv_bytes"] < record["runs"][0]["marks"][-1]["kv_bytes"]
    assert "random weights" in result.stdout and "meaningless for fidelity" in result.stdout


def test_a_bad_random_model_is_one_line(tmp_path) -> None:
    args = ["bench", "--model", "random:qwen3-0.6b:layers=x", "--device", "cpu"]
    result = runner.invoke(cli.app, [*args, "--out", str(tmp_path / "b.json")], env=WIDE)
    err = errors_of(result)
    assert result.exit_code == 2, result.output
    assert len(err.strip().splitlines()) == 1 and "layers must be a positive integer" in err, err


def test_model_help_names_the_random_models() -> None:
    result = runner.invoke(cli.app, ["bench", "--help"], env=WIDE)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "random:NAME[:layers=2,hidden=64,...]" in text and "qwen3-8b" in text
    assert "meaningless for fidelity" in text
