"""benchmarks/bench_table.py: Markdown tables of a `reasonkv bench` record (the device check's)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "performance-data" / "8k" / "bench.json"


def bench_table():
    """The script as a module (it is not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "benchmarks" / "bench_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tables_of_the_8k_run_match_the_docs() -> None:
    text = bench_table().markdown(json.loads(RECORD.read_text()), "bench.json")
    # The same numbers as docs/performance.md's table of this run.
    assert "| streaming@512 | 14.1 | 13.1 | 1.54 | 23.2 MiB | 0.063 |" in text
    assert "| full | 15.4 | 8.5 | 1.00 | 366.7 MiB | 1.000 |" in text
    assert "| run | 1024 | 2048 | 4096 | 8192 |" in text
    assert "| full | 15.4 tok/s · 50.5 MiB |" in text
    assert "*model: SmolLM2-135M-Instruct" in text


def test_a_random_model_gets_its_note_and_other_files_are_refused(tmp_path, capsys) -> None:
    record = json.loads(RECORD.read_text()) | {"model": "random:qwen3-8b"}
    assert "random weights in Qwen3-8B's shape" in bench_table().markdown(record)
    other = tmp_path / "replay.json"
    other.write_text(json.dumps({"kind": "replay"}))
    with pytest.raises(SystemExit):
        bench_table().main([str(other)])
    assert "is not a `reasonkv bench` result" in capsys.readouterr().err


def test_a_batch_capacity_record_gets_its_own_table() -> None:
    record = json.loads((ROOT / "docs" / "performance-data" / "batch-capacity" / "bench-4k.json").read_text())
    text = bench_table().markdown(record, "bench-4k.json")
    assert "256.0 MiB" in text and "batch capacity" in text
    # The numbers of docs/performance.md's batch-capacity table.
    assert "| full | 191.8 MiB | 191.8 MiB | 1 | 191.8 MiB | 16.4 | 1.00 |" in text
    assert "| snapkv@512 | 29.1 MiB | 29.1 MiB | 8 | 232.5 MiB | 78.2 | 4.78 |" in text


def test_the_section_table_is_ms_per_decode_step() -> None:
    """A run of 4 decode steps in 0.2 s whose scorer took 10 ms in score and 2 ms in on_step,
    and whose compress took 6 ms: 50 ms a step, scoring 3 ms of it."""
    record = json.loads(RECORD.read_text())
    run = record["runs"][0] | {
        "label": "hand@8",
        "steps": 4,
        "decode_seconds": 0.2,
        "sections": {
            "score": {"seconds": 0.010, "calls": 1},
            "on_step": {"seconds": 0.002, "calls": 4},
            "compress": {"seconds": 0.006, "calls": 1},
        },
    }
    text = bench_table().markdown(record | {"runs": [run]})
    assert "| hand@8 | 50.0 | 3.00 | 0.50 | 2.50 | 1.50 |" in text
