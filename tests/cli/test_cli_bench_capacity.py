"""`reasonkv bench --kv-memory ... --batch auto|N`: the capacity table and JSON, the recorded
command, and every bad option refused in one line before the model loads."""

from __future__ import annotations

import json

import pytest

from cli_helpers import WIDE, bench_app, errors_of, runner
from conftest import N_LAYERS

TEXT = "What is 2+3? Think."  # 19 prompt tokens with the CharTokenizer
SLOT = 2 * 2 * 16 * 4  # bytes of one K/V slot of one layer of the tiny Llama (fp32)
FULL_PEAK = N_LAYERS * (len(TEXT) + 256) * SLOT  # the full cache's K/V at 19 + 40 tokens: one chunk past
# ...and beside it, a layer's slot indices (2 KV heads, int64), head counts, one kept query with its
# index and position, prompt end and counter; the cache's budgets whatever its batch.
FULL_HELD = FULL_PEAK + N_LAYERS * ((len(TEXT) + 256) * 2 * 8 + 2 * 2 * 8 + (4 * 16 * 4 + 16) + 16)
PER_CACHE = 2 * 2 * 8 + N_LAYERS * 2 * 2 * 8


@pytest.fixture
def loader(bench_loader):
    return bench_loader


def invoke(tmp_path, *extra: str, methods: str = "snapkv,streaming"):
    out = tmp_path / "cap.json"
    args = ["bench", "--methods", methods, "--budgets", "24", "--lengths", "20,40", "--set", "interval=8"]
    args += ["--prompt", TEXT, "--out", str(out), *extra]
    return runner.invoke(bench_app(), args, env=WIDE), out


def test_kv_memory_picks_the_largest_batch_that_fits_and_records_it(loader, tmp_path) -> None:
    memory = 2 * FULL_HELD + PER_CACHE + 1000  # the full cache fits twice
    result, out = invoke(tmp_path, "--kv-memory", str(memory), "--interleave")
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert "runs" not in record and "profiles" not in record  # the per-sequence record is not made
    assert record["command"].startswith("REASONKV_THREADS=1 reasonkv bench ")
    assert f"--kv-memory {memory} --batch auto --max-batch 256" in record["command"]
    assert "--interleave" in record["command"]
    section = record["batch_capacity"]
    assert section["kv_memory_bytes"] == memory and section["batch"] == "auto"
    assert section["max_batch"] == 256 and section["target_tokens"] == 40 and section["interleave"]
    runs = section["runs"]
    assert [r["label"] for r in runs] == ["full", "snapkv@24", "streaming@24"]
    assert runs[0]["batch"] == 2
    snap = runs[1]["predicted_peak_state_bytes_per_sequence"]
    assert snap > (N_LAYERS + 1) * 32 * SLOT  # more than its K/V: 24 + 8 slots a layer, one twice
    assert runs[1]["batch"] == (memory - PER_CACHE) // snap
    for r in runs:
        assert r["peak_state_bytes"] <= memory and not r["over_limit"] and r["prediction_exact"]
    assert "batch capacity" in result.stdout and "agg tok/s" in result.stdout
    assert "streaming" in result.stdout and "OVER THE LIMIT" not in result.stdout


def test_a_fixed_batch_runs_every_method_at_it_and_says_when_the_limit_is_passed(loader, tmp_path) -> None:
    result, out = invoke(tmp_path, "--batch", "3", "--kv-memory", "300KiB", methods="full,snapkv")
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert "--kv-memory 300KiB --batch 3" in record["command"] and "--max-batch" not in record["command"]
    section = record["batch_capacity"]
    assert section["batch"] == 3 and section["max_batch"] is None
    assert [r["batch"] for r in section["runs"]] == [3, 3]
    # Three full caches hold 3 × 146.7 KiB: over the limit, and the table and stderr say so.
    assert section["over_limit"] == ["full"] and section["runs"][0]["over_limit"] is True
    assert section["runs"][1]["over_limit"] is False
    assert "KiB OVER" in result.stdout and "OVER THE LIMIT: full" in " ".join(result.stdout.split())
    assert "measured peak (K/V and all beside it) above --kv-memory for full" in " ".join(
        errors_of(result).split()
    )


def test_a_fixed_batch_needs_no_prediction(loader, tmp_path) -> None:
    result, out = invoke(tmp_path, "--batch", "2", methods="rpc")
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["batch_capacity"]["runs"]
    assert [r["label"] for r in runs] == ["full", "rpc@24"]
    assert runs[1]["predicted_peak_state_bytes_per_sequence"] is None and runs[1]["over_limit"] is None


def test_plain_bench_output_has_no_capacity_section(loader, tmp_path) -> None:
    result, out = invoke(tmp_path, methods="snapkv")
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert "batch_capacity" not in record and "--batch" not in record["command"]
    assert [r["label"] for r in record["runs"]] == ["full", "snapkv@24"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-memory", "lots"], "--kv-memory: expected a size like 2GiB, 512MiB, 1.5GB"),
        (["--kv-memory", "0"], "--kv-memory: a size must be at least one byte"),
        (["--batch", "auto"], "--batch auto needs --kv-memory"),
        (["--batch", "0"], "--batch takes 'auto' or a positive number of sequences, got '0'"),
        (["--batch", "two"], "--batch takes 'auto' or a positive number of sequences"),
        (["--max-batch", "4"], "--max-batch applies to --batch auto"),
        (["--kv-memory", "1GiB", "--max-batch", "0"], "--max-batch must be positive"),
        (["--batch", "2", "--max-batch", "4"], "--max-batch applies to --batch auto, not to a fixed"),
        (["--batch", "2", "--plot", "plots"], "--profile-at and --plot measure one sequence"),
        (["--kv-memory", "1GiB", "--profile-at", "4"], "--profile-at and --plot measure one sequence"),
    ],
)
def test_bad_capacity_options_are_one_line_before_loading(loader, tmp_path, extra, message) -> None:
    result, out = invoke(tmp_path, *extra)
    assert result.exit_code == 2, result.output
    err = errors_of(result)
    assert message in err and len(err.strip().splitlines()) == 1
    assert loader == [], "the model was loaded although the arguments were invalid"
    assert not out.exists()


def test_a_run_that_does_not_fit_once_is_named(loader, tmp_path) -> None:
    result, out = invoke(tmp_path, "--kv-memory", "40KiB")
    assert result.exit_code == 2, result.output
    err = " ".join(errors_of(result).split())
    assert "full: one sequence holds 146.7 KiB at its peak (K/V and all beside it) at 19 + 40 tokens" in err
    assert "more than the 40.0 KiB given" in err
    assert not out.exists()


def test_auto_refuses_a_method_whose_peak_it_cannot_predict(loader, tmp_path) -> None:
    result, _ = invoke(tmp_path, "--kv-memory", "1GiB", methods="adakv-snapkv")
    assert result.exit_code == 2, result.output
    err = " ".join(errors_of(result).split())
    assert "adakv-snapkv@24: cannot predict the peak state" in err and "give a fixed batch instead" in err
