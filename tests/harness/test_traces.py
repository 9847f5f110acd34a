"""Reading trace and problem files: good rows come back in file order, a bad row names its line."""

from __future__ import annotations

import json

import pytest

from reasonkv.harness.datasets import read_jsonl
from reasonkv.harness.traces import load_problem_rows, load_traces
from reasonkv.util.records import RecordError


def _write(path, *rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_trace_rows_are_read_with_numeric_ids_as_strings(tmp_path) -> None:
    path = tmp_path / "traces.jsonl"
    _write(path, {"id": 7, "problem": "p", "trace": "t"}, "", {"id": "b", "problem": "q", "trace": "u"})
    rows = load_traces(path, variant=None)
    assert [r["id"] for r in rows] == ["7", "b"]
    assert [r["id"] for r in load_traces(path, variant=None, ids=["b", "7"])] == ["b", "7"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": "a", "problem": "p"}, "traces.jsonl:2: trace rows need ['trace']"),
        (
            {"id": "a", "problem": ["p"], "trace": "t"},
            "traces.jsonl:2: `problem` must be a string, got a list",
        ),
        ({"id": "a", "problem": "p", "trace": None}, "traces.jsonl:2: `trace` must be a string, got null"),
        (
            {"id": None, "problem": "p", "trace": "t"},
            "traces.jsonl:2: `id` must be a non-empty string or an integer",
        ),
        (
            {"id": "a", "problem": "p\udc80", "trace": "t"},
            "`problem` is not UTF-8 text (byte 0x80 at character 2)",
        ),
        ("null", "traces.jsonl:2: each trace row must be a JSON object ({...}), got null"),
    ],
)
def test_a_bad_trace_row_is_a_record_error_naming_its_line(tmp_path, row, message) -> None:
    path = tmp_path / "traces.jsonl"
    _write(path, {"id": "ok", "problem": "p", "trace": "t"}, row)
    with pytest.raises(RecordError) as err:
        load_traces(path, variant=None)
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value)


def test_problem_files_name_the_bad_line(tmp_path) -> None:
    path = tmp_path / "problems.jsonl"
    _write(path, {"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"})
    assert [r["problem"] for r in load_problem_rows(path, limit=1)] == ["a"]
    assert [r["answer"] for r in read_jsonl(path)] == ["1", "2"]
    _write(path, {"problem": "a", "answer": "1"}, "[1]")
    with pytest.raises(RecordError, match=r"problems\.jsonl:2: each problem row must be a JSON object"):
        read_jsonl(path)
    with pytest.raises(FileNotFoundError, match="no problem file at"):
        load_problem_rows(tmp_path / "missing.jsonl")
