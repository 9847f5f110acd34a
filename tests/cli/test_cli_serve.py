"""`reasonkv serve`: the vLLM command it builds (--dry-run), the errors it gives before anything
starts, and the export cache it keeps. The server itself runs in tests/vllm_adapter/test_server.py
(through this command) and the bundled model's export in test_default_model.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
from pathlib import Path

import pytest

from cli_helpers import WIDE, errors_of, runner
from reasonkv.cli import main as cli
from reasonkv.cli.serve import SERVER_MODULE, split_model
from reasonkv.core import model_folder


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A cache folder where the bundled model's export is already in place (no export runs)."""
    monkeypatch.setenv(model_folder.CACHE_ENV, str(tmp_path / "cache"))
    folder = model_folder.cached_folder_path("smollm2-135m")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def dry_run(*args: str) -> list[str]:
    result = runner.invoke(cli.app, ["serve", *args, "--dry-run"], env=WIDE)
    assert result.exit_code == 0, errors_of(result)
    return shlex.split(result.stdout.strip().splitlines()[-1])


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_the_bundled_model_is_served_from_its_export_with_the_method_and_vllms_options(cache_dir) -> None:
    command = dry_run(
        "--method", "beaconkv", "--budget", "256", "--set", "beacon_max=24",
        "--max-model-len", "4096", "-tp", "1",
    )  # fmt: skip
    assert command[1:3] == ["-m", SERVER_MODULE]
    assert option(command, "--model") == str(cache_dir)
    assert option(command, "--served-model-name") == "smollm2-135m"
    assert json.loads(option(command, "--additional-config")) == {
        "reasonkv": {"method": "beaconkv", "budget": 256, "beacon_max": 24}
    }
    assert "--enforce-eager" in command
    assert (option(command, "--host"), option(command, "--port")) == ("127.0.0.1", "8000")
    assert command[-4:] == ["--max-model-len", "4096", "-tp", "1"]  # vLLM's own options, unchanged, last


def test_vllms_short_flags_are_vllms() -> None:
    """-sc, -dpb, -dpm are vLLM's (speculative config, data-parallel backend and mode): serve
    declares no short options that could take them."""
    command = dry_run("/some/folder", "-sc", "{}", "-dpb", "mp", "-dpm", "x")
    assert command[-6:] == ["-sc", "{}", "-dpb", "mp", "-dpm", "x"]
    assert option(command, "--additional-config") == '{"reasonkv": {"method": "snapkv", "budget": 512}}'


def test_a_folder_is_served_as_it_is_and_the_kv_space_is_set(cache_dir, tmp_path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    result = runner.invoke(
        cli.app,
        ["serve", str(folder), "--kv-space", "2", "--port", "8123", "--served-model-name", "m", "--dry-run"],
        env=WIDE,
    )
    assert result.exit_code == 0, errors_of(result)
    shown = result.stdout.strip().splitlines()[-1]
    assert shown.startswith("VLLM_CPU_KVCACHE_SPACE=2 ")
    command = shlex.split(shown)[1:]
    assert option(command, "--model") == str(folder) and option(command, "--port") == "8123"
    assert command.count("--served-model-name") == 1 and option(command, "--served-model-name") == "m"
    assert json.loads(option(command, "--additional-config")) == {
        "reasonkv": {"method": "snapkv", "budget": 512}
    }


def test_the_model_is_the_first_word_or_the_default() -> None:
    assert split_model(["--max-model-len", "4096"]) == ("smollm2-135m", ["--max-model-len", "4096"])
    assert split_model(["org/model", "--seed", "0"]) == ("org/model", ["--seed", "0"])
    assert split_model([]) == ("smollm2-135m", [])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--method", "nope"], "unknown method 'nope'"),
        (["--budget", "0"], "budget must be a positive number"),
        (["--method", "pyramidkv"], "gives each layer its own budget"),
        (["--set", "windw=3"], "unknown parameter(s) windw"),
        (["--set", "kv_bits=4"], "quantized storage"),
        (["--model", "x"], "--model is this command's own"),
        (["--additional-config", "{}"], "--additional-config is this command's own"),
        (["--additional-config={}"], "--additional-config is this command's own"),
        (["--additional_config", "{}"], "--additional-config is this command's own"),
        (["--set", "foo"], "--set takes key=value, got 'foo'"),
        (["--kv-space", "0"], "--kv-space must be a positive whole number of GiB"),
        (["--export-dtype", "int8"], "--export-dtype must be float32 or bfloat16"),
    ],
)
def test_bad_settings_are_one_line_before_anything_starts(cache_dir, args, words) -> None:
    result = runner.invoke(cli.app, ["serve", *args, "--dry-run"], env=WIDE)
    assert result.exit_code == 2, result.output
    message = errors_of(result).strip()
    assert words in message and "\n" not in message and "Traceback" not in message, message


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_serve_says_how_to_install_it(cache_dir) -> None:
    result = runner.invoke(cli.app, ["serve"], env=WIDE)
    assert result.exit_code == 2
    assert "pip install 'reasonkv[vllm]'" in errors_of(result)


def test_the_export_runs_once_and_an_interrupted_one_leaves_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(model_folder.CACHE_ENV, str(tmp_path))
    made = []

    def fake_export(out: Path, name: str, dtype: str) -> Path:
        made.append((name, dtype))
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_text("weights")
        if len(made) == 1:
            raise KeyboardInterrupt  # the first export is cut off halfway
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(model_folder, "export_model_folder", fake_export)
    with pytest.raises(KeyboardInterrupt):
        model_folder.cached_model_folder("smollm2-135m", "bfloat16")
    assert list((tmp_path / "vllm-models").iterdir()) == []  # no partial folder, no final one
    folder, exported = model_folder.cached_model_folder("smollm2-135m", "bfloat16")
    assert exported and folder == tmp_path / "vllm-models" / "smollm2-135m-bfloat16"
    assert model_folder.cached_model_folder("smollm2-135m", "bfloat16") == (folder, False)
    assert len(made) == 2 and sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    gguf = model_folder.cached_folder_path(str(tmp_path / "a" / "m.gguf"))
    assert gguf.name.startswith("m-") and gguf != model_folder.cached_folder_path(str(tmp_path / "b/m.gguf"))


def test_an_export_finished_elsewhere_meanwhile_is_kept_and_stale_partials_are_swept(tmp_path, monkeypatch):
    """Two processes exporting at once: the one that finishes second throws its copy away and
    serves the first's (never replaced: a server may be reading it); a temporary folder left a
    day by a killed export is removed by the next export."""
    monkeypatch.setenv(model_folder.CACHE_ENV, str(tmp_path))
    final = model_folder.cached_folder_path("smollm2-135m")
    final.parent.mkdir(parents=True)
    stale = final.parent / f"{final.name}{model_folder.PARTIAL}killed"
    stale.mkdir()
    os.utime(stale, (0, 0))

    def export_while_another_finishes(out: Path, name: str, dtype: str) -> Path:
        final.mkdir()
        (final / "config.json").write_text('{"by": "the other process"}')
        (out / "config.json").write_text('{"by": "this process"}')
        return out

    monkeypatch.setattr(model_folder, "export_model_folder", export_while_another_finishes)
    assert model_folder.cached_model_folder("smollm2-135m") == (final, False)
    assert json.loads((final / "config.json").read_text()) == {"by": "the other process"}
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no partial, stale one swept
