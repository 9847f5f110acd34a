"""--device and --dtype on every command that loads a model: a bad value is one line and
exit code 2 before the model loads; a good one reaches the loader."""

from __future__ import annotations

import json

import pytest

from cli_helpers import WIDE, errors_of, runner
from reasonkv.cli import analyze as analyze_cli
from reasonkv.cli import bench as bench_cli
from reasonkv.cli import evaluate as evaluate_cli
from reasonkv.cli import main as cli
from reasonkv.cli import replay as replay_cli

TRACE = {"id": "t0", "problem": "What is 2+2?", "trace": "Let me think step by step. " * 4}


@pytest.fixture
def no_model(monkeypatch, no_loading):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded although --device/--dtype was invalid")

    for module in (replay_cli, analyze_cli, bench_cli, evaluate_cli):
        monkeypatch.setattr(module, "load_model", load)


def command_args(command: str, tmp_path) -> list[str]:
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps(TRACE) + "\n")
    out = ["--out", str(tmp_path / "out")]
    if command == "generate":
        return ["generate", "hi"]
    if command in ("demo", "bench"):
        return [command]
    if command == "eval":
        problems = tmp_path / "problems.jsonl"
        problems.write_text(json.dumps({"id": "p0", "problem": "2+2?", "answer": "4"}) + "\n")
        return ["eval", "--dataset", str(problems), *out]
    return [command, "--traces", str(traces), *out, "--variant", "all"]


COMMANDS = ["generate", "demo", "profile", "replay", "eval", "analyze", "bench"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "option,value,message",
    [("--device", "tpu", "device must be auto, cpu, cuda"), ("--dtype", "int8", "dtype must be auto")],
)
def test_a_bad_device_or_dtype_is_one_line_before_loading(
    tmp_path, no_model, command, option, value, message
):
    result = runner.invoke(cli.app, [*command_args(command, tmp_path), option, value], env=WIDE)
    err = errors_of(result)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(err.strip().splitlines()) == 1, err
    assert message in err, err


def test_generate_hands_device_and_dtype_to_the_loader(fake_loader) -> None:
    import torch

    result = runner.invoke(
        cli.app, ["generate", "-n", "2", "--device", "cpu", "--dtype", "float32", "hi"], env=WIDE
    )
    assert result.exit_code == 0, result.output
    assert fake_loader[0]["device"] == torch.device("cpu") and fake_loader[0]["dtype"] is torch.float32
